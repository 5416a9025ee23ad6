"""The real :class:`agent.gpu_health.GpuReader`: NVML through ``pynvml``.

``pynvml`` (the ``nvidia-ml-py`` package, ``pip install 'elastic-daemon[gpu]'``)
is imported on the first read, never at import time, so the agent starts
without it and a CPU host never loads it. NVML is the driver's own library:
reading it creates no CUDA context and takes no GPU memory. Every NVML error
is translated here, at the boundary: NVML missing (no package, no library, no
driver) is :class:`~elastic.errors.GpuUnavailableError`; a failure of the
whole read, or a read that does not finish within ``timeout_s`` (a wedged
driver can block an NVML call for minutes), :class:`~elastic.errors.GpuError`;
a single GPU that cannot be read carries its ``error`` in the reading, and a
query a GPU does not support (ECC off, page retirement on Ampere) is None.

:func:`read_gpu_health` is the same reading for a person or a script on a GPU
machine (``python -m agent.nvml`` prints it as JSON).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

from agent.gpu_health import (
    GpuExpectation,
    GpuObservation,
    GpuProcess,
    GpuReading,
    NvmlReading,
    cuda_visible_entries,
    decide,
)
from elastic.errors import GpuError, GpuUnavailableError

READ_TIMEOUT_S = 10.0
# NVML errors that mean "NVML cannot be used on this host", not "it failed".
_UNAVAILABLE = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                "NVMLError_NoPermission", "NVMLError_FunctionNotFound")


class NvmlReader:
    """Reads every GPU NVML sees (see the module docstring). One per agent;
    ``read`` is called from one thread at a time."""

    def __init__(self, timeout_s: float = READ_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._nvml: Any = None  # the pynvml module, once initialised

    def read(self) -> NvmlReading:
        """Raises GpuUnavailableError or GpuError (module docstring)."""
        result: list = []
        worker = threading.Thread(target=lambda: result.append(_capture(self._read)),
                                  name="nvml-read", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not result:
            raise GpuError(f"NVML did not answer within {self.timeout_s:g} s (a wedged driver?)")
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Release NVML (best effort). Idempotent."""
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError:
                pass

    def _init(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            import pynvml
        except ImportError as exc:
            raise GpuUnavailableError("pynvml is not installed (pip install nvidia-ml-py, or "
                                      "elastic-daemon[gpu])") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise _translate(exc, "NVML could not be initialised") from exc
        self._nvml = pynvml
        return pynvml

    def _read(self) -> NvmlReading:
        nvml = self._init()
        try:
            count = nvml.nvmlDeviceGetCount()
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError as exc:
            raise _translate(exc, "NVML could not list the GPUs") from exc
        return NvmlReading(gpus=tuple(_read_gpu(nvml, i) for i in range(count)), driver=driver)


def _capture(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001 - handed to the caller's thread as it is
        return False, exc


def _translate(exc: Exception, what: str) -> GpuError:
    kind = GpuUnavailableError if type(exc).__name__ in _UNAVAILABLE else GpuError
    return kind(f"{what}: {exc}")


def _plain(value: Any) -> Any:
    """``value`` with its tuples as lists, as JSON reads back."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _optional(nvml: Any, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when this GPU or driver does not support the query
    (or, in a container, does not let this user make it)."""
    try:
        return fn()
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound,
            nvml.NVMLError_NoPermission):
        return None


def _processes(nvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    # Drivers before 510 lack the _v3 call that the plain name uses.
    for name in ("nvmlDeviceGetComputeRunningProcesses",
                 "nvmlDeviceGetComputeRunningProcesses_v2"):
        try:
            procs = getattr(nvml, name)(handle)
        except nvml.NVMLError_FunctionNotFound:
            continue
        return tuple(GpuProcess(int(p.pid), None if p.usedGpuMemory is None
                                else int(p.usedGpuMemory)) for p in procs)
    return ()


def _mig_uuids(nvml: Any, handle: Any) -> tuple[str, ...]:
    if not _optional(nvml, lambda: nvml.nvmlDeviceGetMigMode(handle)[0]):
        return ()
    uuids = []
    for i in range(_optional(nvml, lambda: nvml.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except nvml.NVMLError:
            continue  # an empty slot
        uuids.append(_text(nvml.nvmlDeviceGetUUID(mig)))
    return tuple(uuids)


def _read_gpu(nvml: Any, index: int) -> GpuReading:
    """One GPU; a GPU that cannot be read (lost, fallen off the bus) is a
    reading with its ``error``."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    except nvml.NVMLError as exc:
        return GpuReading(index=index, error=str(exc))
    try:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)

        def ecc(counter: int) -> int | None:
            value = _optional(nvml, lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter))
            return None if value is None else int(value)

        retired = _optional(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
        remap = _optional(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        return GpuReading(
            index=index, uuid=uuid, name=_text(nvml.nvmlDeviceGetName(handle)),
            ecc_uncorrected_volatile=ecc(nvml.NVML_VOLATILE_ECC),
            ecc_uncorrected_aggregate=ecc(nvml.NVML_AGGREGATE_ECC),
            retired_pages_pending=None if retired is None
            else retired == nvml.NVML_FEATURE_ENABLED,
            remapped_rows_pending=None if remap is None else bool(remap[2]),
            remapping_failed=None if remap is None else bool(remap[3]),
            memory_used_bytes=int(memory.used), memory_total_bytes=int(memory.total),
            processes=_processes(nvml, handle), mig_uuids=_mig_uuids(nvml, handle))
    except nvml.NVMLError as exc:
        return GpuReading(index=index, uuid=uuid, error=str(exc))


def read_gpu_health(gpus: int | None = None, *, wait_s: float = 0.0,
                    ignore_pids: tuple[int, ...] | None = None,
                    reader: NvmlReader | None = None) -> dict[str, Any]:
    """Read this host's GPUs through NVML and judge them as ``--gpu-check
    enforce`` would before a round; returns a JSON-ready dict:

    ``{"nvml": "available" | "unavailable: <why>", "driver": str, "read_s": float,
    "expected": {"selectors": [...], "required": bool, "why": str},
    "gpus": [{"index", "uuid", "name", "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate", "retired_pages_pending", "remapped_rows_pending",
    "remapping_failed", "memory_used_bytes", "memory_total_bytes",
    "processes": [{"pid", "used_bytes"}], "mig_uuids", "error"}],
    "verdict": {"action": "pass" | "leave", "reason": str, "problems": [...],
    "waited_s": float}}``

    ``gpus``: how many are expected (the first ones CUDA_VISIBLE_DEVICES names
    if set, else NVML's indices 0..gpus-1); None: every GPU NVML sees, or
    those CUDA_VISIBLE_DEVICES names. ``wait_s``: read again (every 0.1 s) until
    no process holds memory, at most this long (after a SIGKILL: how long
    the driver takes to free it, in ``waited_s``). ``ignore_pids``: processes
    whose memory does not count (default: this one, so that a script that
    uses torch can call it). Raises nothing for a host without NVML: the
    verdict says so."""
    reader = reader or NvmlReader()
    ignored = frozenset((os.getpid(),) if ignore_pids is None else ignore_pids)
    started = time.monotonic()
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    named = cuda_visible_entries(cvd) if cvd is not None else None
    while True:
        read_at = time.monotonic()
        try:
            reading = reader.read()
        except GpuError as exc:
            reading = NvmlReading(unavailable=str(exc))
        read_s = time.monotonic() - read_at
        # Without a number or CUDA_VISIBLE_DEVICES: every GPU NVML sees, and at least one.
        count = (gpus if gpus is not None else len(named) if named is not None
                 else max(1, len(reading.gpus)))
        selectors = (named[:count] if named is not None
                     else tuple(str(i) for i in range(count)))
        expected = GpuExpectation(selectors, True, f"{len(selectors)} GPU" + (
            "s" if len(selectors) != 1 else "") + " expected" + (
            f" (CUDA_VISIBLE_DEVICES={cvd!r})" if named is not None else ""))
        now = time.monotonic()
        verdict = decide(GpuObservation(reading, warm_pids=ignored), expected, "enforce",
                         since=started, now=now, release_wait_s=wait_s)
        if verdict.wake_at is None or now >= started + wait_s:
            break
        time.sleep(0.1)
    return {
        "nvml": "unavailable: " + reading.unavailable if reading.unavailable else "available",
        "driver": reading.driver, "read_s": round(read_s, 3),
        "expected": {"selectors": list(expected.selectors), "required": expected.required,
                     "why": expected.why},
        "gpus": [_plain(asdict(g)) for g in reading.gpus],
        "verdict": {"action": verdict.action.value, "reason": verdict.reason,
                    "problems": list(verdict.problems), "waited_s": round(verdict.waited_s, 3)},
    }


if __name__ == "__main__":
    health = read_gpu_health(wait_s=float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
    print(json.dumps(health, indent=2))
    sys.exit(0 if health["verdict"]["action"] == "pass" else 1)
