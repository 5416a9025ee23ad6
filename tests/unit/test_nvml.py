"""The real NVML reader (agent/nvml.py) against a fake ``pynvml`` module, and
against the real one on this host, which has no NVIDIA driver: what it reads,
what it translates at the boundary, its deadline."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import types

import pytest

from agent.nvml import NvmlReader, read_gpu_health
from elastic.errors import GpuError, GpuUnavailableError


class NVMLError(Exception):
    pass


def _error(name):
    return type(name, (NVMLError,), {})


NotSupported = _error("NVMLError_NotSupported")
FunctionNotFound = _error("NVMLError_FunctionNotFound")
LibraryNotFound = _error("NVMLError_LibraryNotFound")
GpuIsLost = _error("NVMLError_GpuIsLost")
Unknown = _error("NVMLError_Unknown")
NoPermission = _error("NVMLError_NoPermission")


def fake_pynvml(gpus, *, init_error=None, block=None):
    """A pynvml of ``gpus``: dicts of what each GPU answers (an exception
    instance is raised for that query)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    for cls in (NotSupported, FunctionNotFound, LibraryNotFound, GpuIsLost, Unknown,
                NoPermission):
        setattr(m, cls.__name__, cls)
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC, m.NVML_AGGREGATE_ECC = 1, 0, 1
    m.NVML_FEATURE_ENABLED = 1
    m.shutdowns = 0

    def answer(index, key, default=None):
        value = gpus[index].get(key, default)
        if isinstance(value, Exception):
            raise value
        return value

    def init():
        if init_error:
            raise init_error
        if block is not None:
            block.wait(5)

    def shutdown():
        m.shutdowns += 1

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlSystemGetDriverVersion = lambda: b"580.65.06"
    m.nvmlDeviceGetHandleByIndex = lambda i: answer(i, "handle", i)
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h}" if isinstance(h, int) else h
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        used=answer(h, "used", 0), total=80 << 30)
    m.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: answer(
        h, "ecc_volatile" if counter == 0 else "ecc_aggregate", 0)
    m.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: answer(h, "retired", NotSupported())
    m.nvmlDeviceGetRemappedRows = lambda h: answer(h, "remap", (0, 0, 0, 0))
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: answer(h, "procs", [])
    m.nvmlDeviceGetComputeRunningProcesses_v2 = lambda h: answer(h, "procs_v2", [])
    m.nvmlDeviceGetMigMode = lambda h: answer(h, "mig_mode", (0, 0))
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: len(answer(h, "migs", []))

    def mig_handle(h, i):
        mig = answer(h, "migs", [])[i]
        if isinstance(mig, Exception):
            raise mig
        return mig

    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return m


def proc(pid, used):
    return types.SimpleNamespace(pid=pid, usedGpuMemory=used)


@pytest.fixture
def with_pynvml(monkeypatch):
    def install(module):
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module
    return install


def test_reads_every_gpu_with_what_it_supports(with_pynvml):
    with_pynvml(fake_pynvml([
        {"used": 5 << 20, "procs": [proc(42, 5 << 20), proc(43, None)],
         "ecc_volatile": 2, "ecc_aggregate": 7},
        {"ecc_volatile": NotSupported(), "ecc_aggregate": NoPermission(), "retired": 1,
         "remap": NotSupported(), "mig_mode": (1, 1), "migs": ["MIG-a", Unknown()]},
    ]))
    reading = NvmlReader().read()
    assert reading.driver == "580.65.06" and not reading.unavailable
    g0, g1 = reading.gpus
    assert (g0.index, g0.uuid, g0.name) == (0, "GPU-0", "NVIDIA H100 80GB HBM3")
    assert (g0.ecc_uncorrected_volatile, g0.ecc_uncorrected_aggregate) == (2, 7)
    assert g0.retired_pages_pending is None  # Ampere and later retire no pages
    assert (g0.remapped_rows_pending, g0.remapping_failed) == (False, False)
    assert [(p.pid, p.used_bytes) for p in g0.processes] == [(42, 5 << 20), (43, None)]
    assert g0.memory_used_bytes == 5 << 20 and g0.memory_total_bytes == 80 << 30
    assert g1.ecc_uncorrected_volatile is None and g1.retired_pages_pending is True
    assert g1.remapped_rows_pending is None and g1.remapping_failed is None
    assert g1.mig_uuids == ("MIG-a",)  # the empty slot skipped


def test_an_older_driver_without_the_v3_process_call(with_pynvml):
    with_pynvml(fake_pynvml([{"procs": FunctionNotFound(), "procs_v2": [proc(7, 1)]}]))
    [gpu] = NvmlReader().read().gpus
    assert [p.pid for p in gpu.processes] == [7]


def test_a_gpu_that_cannot_be_read_carries_its_error(with_pynvml):
    with_pynvml(fake_pynvml([{}, {"handle": GpuIsLost("GPU is lost")},
                             {"procs": Unknown("Unknown Error")}]))
    g0, g1, g2 = NvmlReader().read().gpus
    assert not g0.error
    assert (g1.index, g1.error) == (1, "GPU is lost")
    assert (g2.uuid, g2.error) == ("GPU-2", "Unknown Error")


def test_no_library_is_unavailable_and_other_failures_are_gpu_errors(with_pynvml):
    with_pynvml(fake_pynvml([], init_error=LibraryNotFound("NVML Shared Library Not Found")))
    with pytest.raises(GpuUnavailableError, match="NVML could not be initialised: NVML Shared"):
        NvmlReader().read()
    with_pynvml(fake_pynvml([], init_error=Unknown("Unknown Error")))
    with pytest.raises(GpuError) as caught:
        NvmlReader().read()
    assert not isinstance(caught.value, GpuUnavailableError)
    assert isinstance(caught.value.__cause__, Unknown)


def test_without_pynvml_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(GpuUnavailableError, match="pynvml is not installed"):
        NvmlReader().read()


def test_a_read_that_does_not_answer_in_time_is_a_gpu_error(with_pynvml):
    release = threading.Event()
    with_pynvml(fake_pynvml([{}], block=release))
    try:
        with pytest.raises(GpuError, match="NVML did not answer within 0.05 s"):
            NvmlReader(timeout_s=0.05).read()
    finally:
        release.set()


def test_close_shuts_nvml_down_once(with_pynvml):
    module = with_pynvml(fake_pynvml([{}]))
    reader = NvmlReader()
    reader.read()
    reader.close()
    reader.close()
    assert module.shutdowns == 1


def test_read_gpu_health_judges_as_enforce_and_ignores_its_own_process(with_pynvml, monkeypatch):
    import os

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with_pynvml(fake_pynvml([{"procs": [proc(os.getpid(), 1 << 30)]}, {}]))
    health = read_gpu_health()
    assert health["nvml"] == "available" and health["driver"] == "580.65.06"
    assert health["expected"] == {"selectors": ["0", "1"], "required": True,
                                  "why": "2 GPUs expected"}
    assert health["verdict"]["action"] == "pass", health["verdict"]
    assert health["gpus"][0]["processes"] == [{"pid": os.getpid(), "used_bytes": 1 << 30}]
    json.dumps(health)  # JSON-ready
    held = read_gpu_health(ignore_pids=())
    assert held["verdict"]["action"] == "leave"
    assert held["verdict"]["problems"] == ["memory_held"]


def test_on_this_host_without_a_driver(monkeypatch):
    # The real pynvml (installed by make setup) on a machine without NVIDIA's library.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    health = read_gpu_health()
    assert health["nvml"].startswith("unavailable: ")
    assert health["verdict"]["action"] == "leave"
    assert health["verdict"]["problems"] == ["no_nvml"]
    out = subprocess.run([sys.executable, "-m", "agent.nvml"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert json.loads(out.stdout)["verdict"]["problems"] == ["no_nvml"]
