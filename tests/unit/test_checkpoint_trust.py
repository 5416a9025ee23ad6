"""Restore runs no code from a checkpoint (elastic.checkpoint.trust): what each of its
three pickles may hold, the refusal that names the rest, and the two ways to allow
more (safe_globals, trust). One process, real files, no process group."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle

import pytest

torch = pytest.importorskip("torch")

from elastic import worker_env  # noqa: E402
from elastic.checkpoint import layout, state, trust  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402
from elastic.checkpoint.trust import LoadPolicy  # noqa: E402
from elastic.errors import CheckpointError, ConfigError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class RunsCommand:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Calls:
    """Unpickling it calls ``function(*args)``: any global an attacker may name."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return (self.function, self.args)


@dataclasses.dataclass
class Note:
    """A user's own type in ``extras``: harmless, but not on the built-in list."""

    text: str


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path):
    """A file the attack's command would create; it must never appear."""
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "the checkpoint ran a command"


def _refused(excinfo, name: str) -> None:
    message = str(excinfo.value)
    assert name in message and "safe_globals" in message
    assert "trust_checkpoint=True" in message and worker_env.CHECKPOINT_TRUST in message


# --- rank-<r>.pt ------------------------------------------------------------------------------


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "unzipped (memory tier)"])
def test_a_rank_state_with_a_command_runs_nothing_and_names_the_function(marker, zip_format):
    record = {"format": state.LOCAL_FORMAT, "extras": RunsCommand(f"touch {marker}")}
    buffer = io.BytesIO()
    torch.save(record, buffer, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(CheckpointError) as excinfo:
        state.load_local(buffer.getvalue(), LoadPolicy(), "rank-00000.pt")
    _refused(excinfo, f"{os.system.__module__}.system")
    assert str(excinfo.value).startswith("rank-00000.pt needs ")


@pytest.mark.parametrize("compact", [False, True], ids=["zip", "compact (memory tier)"])
def test_what_a_rank_state_holds_loads_under_the_default_allow_list(compact):
    import random

    import numpy

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, 3),
                  torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=10),
                  torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                  torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10),
                  torch.optim.lr_scheduler.CyclicLR(optimizer, 0.1, 1.0),
                  torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)]
    from elastic.data import ElasticSampler

    sampler = ElasticSampler(num_samples=100, global_batch_size=8, rank=0, world_size=2)
    numpy.random.seed(5)
    data = state.capture_local(step=3, rank=0, world_size=1, schedulers=schedulers,
                               data_state=sampler.state_dict(),
                               extras={"loss": 0.5, "ids": (1, 2), "blob": b"\x00\xff"},
                               compact=compact)
    assert data.startswith(b"PK") != compact
    expected = (numpy.random.rand(3).tolist(), torch.rand(3).tolist(), random.random())
    record = state.load_local(data, LoadPolicy(), "rank-00000.pt")
    assert record["data_state"] == sampler.state_dict()
    assert record["extras"] == {"loss": 0.5, "ids": (1, 2), "blob": b"\x00\xff"}
    assert [type(s) for s in record["schedulers"]] == [dict] * len(schedulers)
    numpy.random.seed(9)
    torch.manual_seed(9)
    random.seed(9)
    state.restore_rng(record["rng"])
    assert (numpy.random.rand(3).tolist(), torch.rand(3).tolist(), random.random()) == expected
    assert isinstance(record["rng"]["python"][1], bytes)  # one opcode, not 625


def test_a_rank_state_loads_about_as_fast_as_with_weights_only_false():
    # weights_only's unpickler is written in Python: 2 ms for the RNGs' words as ints.
    import time

    data = state.capture_local(step=3, rank=0, world_size=1, schedulers=[], data_state={},
                               extras=None)

    def best(load) -> float:
        """The least CPU time of this thread over 20 loads: what other processes
        do to the machine's load does not count."""
        times = []
        for _ in range(20):
            started = time.thread_time()
            load()
            times.append(time.thread_time() - started)
        return min(times)

    restricted = best(lambda: state.load_local(data, LoadPolicy()))
    trusted = best(lambda: torch.load(io.BytesIO(data), weights_only=False))
    assert restricted < 2 * trusted + 0.001, (restricted, trusted)


def test_a_rank_state_written_with_numpys_array_and_pythons_tuple_still_restores():
    # Files written before the RNGs' words were saved as bytes.
    import random

    import numpy

    numpy.random.seed(4)
    random.seed(4)
    old = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": numpy.random.get_state()}
    expected = (random.random(), numpy.random.rand())
    record = {"format": state.LOCAL_FORMAT, "rng": old}
    loaded = state.load_local(_saved(record), LoadPolicy(), "rank-00000.pt")
    numpy.random.seed(9)
    random.seed(9)
    state.restore_rng(loaded["rng"])
    assert (random.random(), numpy.random.rand()) == expected


def test_a_users_type_is_refused_by_name_then_allowed_by_safe_globals_or_trust():
    data = _saved({"format": state.LOCAL_FORMAT, "extras": Note("hi")})
    with pytest.raises(CheckpointError) as excinfo:
        state.load_local(data, LoadPolicy(), "rank-00000.pt")
    _refused(excinfo, f"{__name__}.Note")
    assert state.load_local(data, LoadPolicy(safe_globals=[Note]))["extras"] == Note("hi")
    assert state.load_local(data, LoadPolicy(trusted=True))["extras"] == Note("hi")


# --- DCP's .metadata --------------------------------------------------------------------------


def _metadata(tmp_path) -> bytes:
    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint import dcp_io

    directory = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(3), "lr": 0.1, "layout": {"n": [1, 2]}},
             storage_writer=dcp_io.ChecksummingWriter(directory))
    with open(os.path.join(directory, layout.METADATA_FILE), "rb") as f:
        return f.read()


def test_dcps_metadata_loads_through_the_allow_list(tmp_path):
    data = _metadata(tmp_path)
    restricted = trust.load_metadata(data, LoadPolicy(), ".metadata")
    assert restricted == pickle.loads(data)


@pytest.mark.parametrize("poison", ["storage_meta", "whole"])
def test_a_metadata_with_a_command_runs_nothing_and_names_the_function(tmp_path, marker,
                                                                        poison):
    metadata = pickle.loads(_metadata(tmp_path))
    if poison == "whole":
        metadata = RunsCommand(f"touch {marker}")
    else:
        metadata.storage_meta = RunsCommand(f"touch {marker}")
    with pytest.raises(CheckpointError) as excinfo:
        trust.load_metadata(pickle.dumps(metadata, protocol=2), LoadPolicy(), "ckpt/.metadata")
    _refused(excinfo, f"{os.system.__module__}.system")


def test_a_metadata_that_is_not_dcps_is_refused():
    with pytest.raises(CheckpointError, match="not DCP's Metadata"):
        trust.load_metadata(pickle.dumps({"a": 1}), LoadPolicy(), ".metadata")


# --- DCP's objects (BYTE_IO items) ------------------------------------------------------------


@pytest.mark.parametrize("obj", [
    {"lr": 0.1, "betas": (0.9, 0.95), "foreach": None, "name": "adam"},
    b"\x00\x01\xff", bytearray(b"ab"), {1, 2}, frozenset({3}), complex(1, 2),
    collections.OrderedDict(a=1), torch.Size([2, 3]), torch.float16, torch.device("cpu"),
    [slice(1, 5, 2), torch.strided, torch.sparse_coo]])
def test_plain_objects_load_without_torch_load(obj, monkeypatch):
    data = _saved(obj)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    assert trust.load_object(data, LoadPolicy(), "an object") == obj


def test_an_object_with_a_tensor_goes_to_torch_load_weights_only():
    loaded = trust.load_object(_saved({"t": torch.arange(3)}), LoadPolicy(), "an object")
    assert torch.equal(loaded["t"], torch.arange(3))


@pytest.mark.parametrize("payload", [
    lambda m: RunsCommand(f"touch {m}"),
    lambda m: Calls(eval, f"open({str(m)!r}, 'w')"),
    lambda m: Calls(getattr, str(m), "upper"),
    lambda m: Calls(__import__("subprocess").Popen, ["touch", str(m)]),
    lambda m: Calls(torch.save, {}, str(m)),  # torch's own functions are torch.load's call
    lambda m: Calls(bytearray, 1 << 40),  # a few bytes asking for a terabyte
    lambda m: Calls(__import__("_codecs").encode, b"x" * 10, "zlib_codec"),
], ids=["os.system", "eval", "getattr", "Popen", "torch.save", "bytearray(size)", "codec"])
def test_an_object_naming_anything_else_is_refused(marker, payload):
    with pytest.raises(CheckpointError) as excinfo:
        trust.load_object(_saved({"x": payload(marker)}), LoadPolicy(), "an object")
    _refused(excinfo, "")


def test_a_refusal_names_at_most_three_types():
    error = LoadPolicy().refusal("f", ["a.A", "b.B", "c.C", "d.D", "e.E"])
    assert "a.A, b.B, c.C and 2 more" in str(error)


def test_safe_globals_must_be_named_things():
    with pytest.raises(ConfigError, match="safe_globals"):
        LoadPolicy(safe_globals=[3])


# --- the Checkpointer's arguments and environment ---------------------------------------------


@pytest.mark.parametrize("raw, expected", [("", False), ("0", False), ("off", False),
                                           ("1", True), ("TRUE", True), ("yes", True)])
def test_trust_from_the_environment(raw, expected):
    assert trust.trust_from_env({worker_env.CHECKPOINT_TRUST: raw}) is expected


def test_a_bad_trust_value_is_a_config_error():
    with pytest.raises(ConfigError, match=worker_env.CHECKPOINT_TRUST):
        trust.trust_from_env({worker_env.CHECKPOINT_TRUST: "maybe"})


def _checkpointer(root, **kwargs) -> Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return Checkpointer(str(root), model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                          lr=0.1), **kwargs)


def test_a_checkpointer_refuses_a_users_type_unless_told(tmp_path, monkeypatch):
    monkeypatch.delenv(worker_env.CHECKPOINT_TRUST, raising=False)
    saver = _checkpointer(tmp_path)
    saver.save(1, extras=Note("kept"), async_=False)
    saver.close()
    with pytest.raises(CheckpointError) as excinfo:
        _checkpointer(tmp_path).restore()
    _refused(excinfo, f"{__name__}.Note")
    restorer = _checkpointer(tmp_path, safe_globals=[Note])
    assert restorer.restore() == 2 and restorer.extras == Note("kept")
    monkeypatch.setenv(worker_env.CHECKPOINT_TRUST, "1")
    restorer = _checkpointer(tmp_path)
    assert restorer.policy.trusted and restorer.restore() == 2
    # The argument wins over the environment.
    with pytest.raises(CheckpointError, match="Note"):
        _checkpointer(tmp_path, trust_checkpoint=False).restore()


def test_a_checkpointer_refuses_a_poisoned_metadata_in_one_plain_line(tmp_path, marker,
                                                                      monkeypatch):
    monkeypatch.delenv(worker_env.CHECKPOINT_TRUST, raising=False)
    saver = _checkpointer(tmp_path)
    saver.save(1, async_=False)
    saver.close()
    directory = str(tmp_path / layout.step_dir_name(1))
    path = os.path.join(directory, layout.METADATA_FILE)
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta = RunsCommand(f"touch {marker}")
    data = pickle.dumps(metadata)
    with open(path, "wb") as f:
        f.write(data)
    (manifest,), _ = layout.read_manifests(directory)  # recomputed, as an attacker would
    layout.write_manifest(directory, dataclasses.replace(
        manifest, files=dict(manifest.files, **{layout.METADATA_FILE: layout.bytes_digest(data)})))
    restorer = _checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as excinfo:
        restorer.restore()
    _refused(excinfo, f"{os.system.__module__}.system")
    assert f"failed: {path} needs" in str(excinfo.value)
