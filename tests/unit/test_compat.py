"""elastic._compat: each shim over a torch, grpc or runpy internal, on the installed versions.

Every torch venv of the matrix (``make test-torch TORCH=X.Y.Z``) runs this file. Each shim
has a test that takes its internal path on the installed version (and fails if that path is
gone, so an upgrade is noticed) and one that forces its public fallback.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- grpc: the slice of grpc-python's blocking waits (elastic._compat.grpc_waits) ----------

def _slices_of_a_wait_that_ends_after(seconds: float) -> int:
    """How many slices grpc's own blocking wait takes for an event set after ``seconds``."""
    from grpc import _common

    done = threading.Event()
    slices = []
    timer = threading.Timer(seconds, done.set)
    timer.start()
    try:
        _common.wait(done.wait, done.is_set, spin_cb=lambda: slices.append(1))
    finally:
        timer.cancel()
    return len(slices)


def test_grpc_wait_slice_is_set_where_grpc_reads_it():
    from elastic._compat import grpc_waits

    saved = grpc_waits.blocking_wait_slice_s()
    assert saved is not None, "grpc lost _common.MAXIMUM_WAIT_TIMEOUT: see grpc_waits"
    try:
        assert grpc_waits.set_blocking_wait_slice_s(30.0)
        assert grpc_waits.blocking_wait_slice_s() == 30.0
        # One slice covers the whole wait: the event ends it, not the slice's end.
        # grpc's own 0.1 s slices would take several for the same 0.4 s.
        assert _slices_of_a_wait_that_ends_after(0.4) == 1
    finally:
        grpc_waits.set_blocking_wait_slice_s(saved)
    assert _slices_of_a_wait_that_ends_after(0.4) >= 2


def test_grpc_wait_slice_without_the_constant_changes_nothing_and_says_so(monkeypatch, caplog):
    import grpc

    from elastic._compat import grpc_waits
    from elastic.net import relax_grpc_blocking_waits

    real = grpc._common
    saved = real.MAXIMUM_WAIT_TIMEOUT
    # A grpc whose _common lacks the constant; grpc's own modules keep the real one,
    # so calls still running in this process are not disturbed.
    monkeypatch.setattr(grpc, "_common", types.ModuleType("grpc._common"))
    with caplog.at_level(logging.DEBUG, logger=grpc_waits.__name__):
        assert grpc_waits.blocking_wait_slice_s() is None
        assert not grpc_waits.set_blocking_wait_slice_s(1.0)
        assert not relax_grpc_blocking_waits(1.0)
    assert real.MAXIMUM_WAIT_TIMEOUT == saved
    assert "MAXIMUM_WAIT_TIMEOUT" in caplog.text


# --- runpy: a module run as ``python -m`` runs it (elastic._compat.runpy_main) -----------

_PROBE = '''
import json, pickle, sys

class Thing:
    pass

# Pickling finds Thing through sys.modules["__main__"], as multiprocessing's spawn does.
pickle.loads(pickle.dumps(Thing()))
with open(sys.argv[1], "w") as f:
    json.dump({"name": __name__, "argv": sys.argv,
               "main_is_me": sys.modules["__main__"].__dict__ is globals()}, f)
sys.exit(7)
'''

_RUNNER = '''
import runpy, sys
sys.path.insert(0, {dir!r})
from elastic._compat import runpy_main
if {fallback!r}:
    del runpy._run_module_as_main
assert runpy_main.has_internal() is not {fallback!r}
sys.argv = [{module!r}, *sys.argv[1:]]
runpy_main.run_module_as_main({module!r})
'''


def _run_module(tmp_path, module: str, fallback: bool, *args: str) -> subprocess.CompletedProcess:
    code = _RUNNER.format(dir=str(tmp_path), module=module, fallback=fallback)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("path", ["internal", "fallback"])
def test_a_module_runs_as_python_dash_m_runs_it(tmp_path, path):
    from elastic._compat import runpy_main

    if path == "internal":
        assert runpy_main.has_internal(), "runpy lost _run_module_as_main: see runpy_main"
    (tmp_path / "probe_mod.py").write_text(_PROBE)
    out = tmp_path / "out.json"
    done = _run_module(tmp_path, "probe_mod", path == "fallback", str(out), "--flag")
    assert done.returncode == 7, done.stderr
    seen = json.loads(out.read_text())
    assert seen == {"name": "__main__", "argv": [str(tmp_path / "probe_mod.py"), str(out),
                                                 "--flag"], "main_is_me": True}

    missing = _run_module(tmp_path, "no_such_mod", path == "fallback")
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"{sys.executable}: No module named no_such_mod"


# --- elastic._compat.torch_checkpoint ---------------------------------------------------------


def test_dcp_file_reader_cuts_items_where_the_verifying_reader_hooks_in():
    from elastic._compat import torch_checkpoint

    assert torch_checkpoint.file_reader_slices()


def test_torch_save_zips_are_read_and_storage_types_named_without_torch_load():
    import io

    import torch

    from elastic._compat import torch_checkpoint

    buffer = io.BytesIO()
    torch.save(torch.arange(4, dtype=torch.float32), buffer)
    buffer.seek(0)
    archive = torch_checkpoint.zip_archive(buffer)
    assert archive is not None and "data.pkl" in archive.get_all_records()
    assert torch_checkpoint.storage_type_names()[torch.float32] == "FloatStorage"


def test_without_the_internals_the_shims_say_so(monkeypatch):
    import io

    import torch

    from elastic._compat import torch_checkpoint

    monkeypatch.setattr(torch._C, "PyTorchFileReader", None, raising=False)
    monkeypatch.setattr(torch.storage, "_dtype_to_storage_type_map", None, raising=False)
    torch_checkpoint.storage_type_names.cache_clear()
    try:
        assert torch_checkpoint.zip_archive(io.BytesIO(b"")) is None
        assert torch_checkpoint.storage_type_names() == {}
    finally:
        torch_checkpoint.storage_type_names.cache_clear()


def test_without_the_internals_a_restore_reads_items_the_slow_way(tmp_path, monkeypatch):
    """The callers' fallbacks (torch.load for every item); the restore is still bitwise."""
    import torch

    from elastic.checkpoint import dcp_io
    from elastic.checkpoint.checkpointer import Checkpointer

    model = torch.nn.Linear(3, 2)
    Checkpointer(str(tmp_path), model=model).save(0, async_=False)
    monkeypatch.setattr(dcp_io.compat, "zip_archive", lambda stream: None)
    restored = torch.nn.Linear(3, 2)
    checkpointer = Checkpointer(str(tmp_path), model=restored)
    assert checkpointer.restore() == 1
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)


def test_dcps_metadata_classes_and_the_layout_lookup_are_found_on_this_torch():
    import pickle

    import torch

    from elastic._compat import torch_checkpoint

    table = torch_checkpoint.dcp_metadata_globals()
    wanted = {(module, name) for module, names in torch_checkpoint.DCP_METADATA_CLASSES.items()
              for name in names}
    assert wanted <= set(table), "DCP moved a metadata class: see dcp_metadata_globals"
    # torch.save still pickles a layout as a call of _get_layout with its name.
    assert b"torch.serialization\n_get_layout" in pickle.dumps(torch.strided, protocol=2)
    assert table[("torch.serialization", "_get_layout")]("torch.strided") is torch.strided


@pytest.mark.parametrize("lister", [True, False], ids=["listed", "from-the-error"])
def test_a_weights_only_load_widens_its_allow_list_and_names_what_it_refuses(lister,
                                                                             monkeypatch):
    import fractions
    import io
    import pickle

    import torch

    from elastic._compat import torch_checkpoint

    if not lister:
        monkeypatch.delattr(torch.serialization, "get_unsafe_globals_in_checkpoint")
    buffer = io.BytesIO()
    torch.save({"share": fractions.Fraction(1, 3)}, buffer)
    data = buffer.getvalue()
    with pytest.raises(pickle.UnpicklingError) as excinfo:
        torch_checkpoint.load_weights_only(io.BytesIO(data), [])
    assert torch_checkpoint.unsafe_globals(data, excinfo.value, []) == ["fractions.Fraction"]
    loaded = torch_checkpoint.load_weights_only(io.BytesIO(data), [fractions.Fraction])
    assert loaded == {"share": fractions.Fraction(1, 3)}


def test_a_single_process_is_told_to_dcp_where_it_takes_no_dist(tmp_path, monkeypatch):
    """2.8 and newer take no_dist; 2.6 refuses it and decides by itself (the fallback)."""
    import inspect

    import torch
    import torch.distributed.checkpoint as dcp

    from elastic._compat import torch_checkpoint
    from elastic.checkpoint.checkpointer import Checkpointer

    takes = "no_dist" in inspect.signature(dcp.save).parameters
    assert torch_checkpoint.single_process(True) == ({"no_dist": True} if takes else {})
    monkeypatch.setattr(torch_checkpoint, "_takes_no_dist", lambda: False)
    model = torch.nn.Linear(3, 2)
    Checkpointer(str(tmp_path), model=model).save(0, async_=False)
    restored = torch.nn.Linear(3, 2)
    assert Checkpointer(str(tmp_path), model=restored).restore() == 1
    assert torch.equal(restored.weight, model.weight)


def _torch_save_unzipped(value) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


# Every plain kind the fast path takes, bytes and sets included (pickled through globals).
PLAIN = {"format": 1, "step": 7, "big": 2**70, "lr": [1e-3, float("inf")], "flag": True,
         "none": None, "blob": b"\x00\xff" * 300, "ids": (1, (2, 3)), "set": {1, 2},
         "frozen": frozenset({"a"}), "array": bytearray(b"xy"), "name": "\u00e9t\u00e9"}


def test_a_plain_value_is_saved_unzipped_as_torch_save_writes_it():
    from elastic._compat import torch_checkpoint

    expected = _torch_save_unzipped(PLAIN)
    with pytest.MonkeyPatch.context() as patch:  # the frame taken once, then no torch.save
        torch_checkpoint.save_unzipped(None)
        patch.setattr(torch_checkpoint.torch, "save", None)
        assert torch_checkpoint.save_unzipped(PLAIN) == expected, "torch.save's file changed"


def test_what_is_not_plain_and_a_torch_of_another_frame_go_through_torch_save(monkeypatch):
    import io

    import torch

    from elastic._compat import torch_checkpoint

    value = {"rng": torch.get_rng_state(), "noted": types.SimpleNamespace(a=1), "step": 7}
    data = torch_checkpoint.save_unzipped(value)
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    assert torch.equal(loaded["rng"], value["rng"]) and loaded["noted"].a == 1
    for other in (torch.nn.Linear, len, types.SimpleNamespace):  # classes and functions too
        assert torch_checkpoint.save_unzipped([other]) == _torch_save_unzipped([other])
    monkeypatch.setattr(torch_checkpoint, "_unzipped_frame", lambda: None)
    assert torch_checkpoint.save_unzipped(PLAIN) == _torch_save_unzipped(PLAIN)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "one-by-one"])
def test_copy_all_copies_every_tensor_without_autograd(foreach, monkeypatch):
    import torch

    from elastic._compat import torch_checkpoint

    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_")
    sources = [torch.nn.Parameter(torch.arange(3.0)), torch.tensor(5),
               torch.ones(2, 2, dtype=torch.bfloat16)]
    targets = [torch.zeros_like(t) for t in sources]
    torch_checkpoint.copy_all(targets, sources)
    torch_checkpoint.copy_all([], [])
    assert all(torch.equal(t, s) and not t.requires_grad for t, s in zip(targets, sources))


@pytest.mark.parametrize("internal", [True, False], ids=["module-dicts", "generators"])
def test_module_tensors_are_every_parameter_and_buffer(internal, monkeypatch):
    import torch

    from elastic._compat import torch_checkpoint

    shared = torch.nn.Linear(3, 3, bias=False)  # no bias: a None entry, skipped
    model = torch.nn.Sequential(shared, torch.nn.BatchNorm1d(3), torch.nn.Sequential(shared))
    if not internal:
        monkeypatch.setattr(torch_checkpoint, "MODULE_TENSOR_DICTS", ("_parameters", "_gone"))
    found = torch_checkpoint.module_tensors(model)
    expected = {*map(id, model.parameters()), *map(id, model.buffers())}
    assert set(map(id, found)) == expected and all(t is not None for t in found)
    assert [id(t) for t in torch_checkpoint.module_tensors(model)] == list(map(id, found))


FLIGHT_RECORDER_WORKER = """
import os, sys
import torch, torch.distributed as dist
from elastic._compat import torch_flight_recorder
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(2))
print(torch_flight_recorder.dump_json().decode())
"""


def test_the_flight_recorder_is_found_on_this_torch_and_records_gloo(tmp_path):
    pytest.importorskip("torch")
    from agent.stack_text import in_flight
    from elastic.net import free_port

    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "16", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", FLIGHT_RECORDER_WORKER,
                          str(free_port("127.0.0.1"))], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    record = json.loads(out)
    assert isinstance(record["entries"], list)  # onlyActive: the all_reduce is done
    assert in_flight(out.encode()) is None


def test_without_a_flight_recorder_nothing_is_dumped(monkeypatch):
    torch = pytest.importorskip("torch")
    from elastic._compat import torch_flight_recorder

    monkeypatch.setattr(torch._C, "_distributed_c10d", types.SimpleNamespace())
    assert torch_flight_recorder.dump_json() is None
