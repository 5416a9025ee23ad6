"""CRC-32s computed while DCP writes and checked while it reads (elastic.checkpoint.dcp_io):
one process, DCP without a process group, real files, no Checkpointer."""

from __future__ import annotations

import contextlib
import os
import sys
import zlib

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from elastic._compat import torch_checkpoint as compat  # noqa: E402
from elastic.checkpoint import dcp_io, layout  # noqa: E402
from elastic.errors import CheckpointError  # noqa: E402

# DCP warns at every call without a process group; that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SHARD = "__0_0.distcp"


def state() -> dict:
    """Large tensors (read in place), small ones and objects (read piecemeal)."""
    torch.manual_seed(0)
    return {"big": torch.randn(256, 300), "bias": torch.randn(7), "ids": torch.arange(5),
            "extra": {"note": "hello", "sizes": [1, 2, 3]}}


def blank() -> dict:
    return {"big": torch.zeros(256, 300), "bias": torch.zeros(7),
            "ids": torch.zeros(5, dtype=torch.long), "extra": {"note": "", "sizes": [0, 0, 0]}}


@pytest.fixture
def saved(tmp_path):
    """A DCP checkpoint written through the ChecksummingWriter, and its digests."""
    directory = str(tmp_path / "ckpt")
    writer = dcp_io.ChecksummingWriter(directory)
    dcp.save(state(), storage_writer=writer)
    return directory, writer.digests()


def load(directory: str, files: dict) -> tuple[dict, dcp_io.VerifyingReader]:
    target = blank()
    reader = dcp_io.VerifyingReader(directory, files)
    dcp.load(target, storage_reader=reader)
    return target, reader


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x20]))


def test_digests_are_the_crc32s_of_the_files_and_items_on_disk(saved):
    directory, files = saved
    assert set(files) == {SHARD, layout.METADATA_FILE}
    for name, digest in files.items():
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        assert (digest.size, digest.crc32) == (len(data), f"{zlib.crc32(data):08x}"), name
    items = files[SHARD].items
    assert files[layout.METADATA_FILE].items is None
    assert len(items) == 5  # big, bias, ids and the two objects
    with open(os.path.join(directory, SHARD), "rb") as f:
        data = f.read()
    position = 0
    for item in items:  # they tile the file, each with the CRC-32 of its bytes
        assert item.offset == position
        assert item.crc32 == f"{zlib.crc32(data[item.offset:item.offset + item.length]):08x}"
        position += item.length
    assert position == len(data)


def test_a_clean_load_checks_every_item_without_reading_twice(saved):
    directory, files = saved
    target, reader = load(directory, files)
    assert reader.problems == []
    expected = state()
    assert all(torch.equal(target[k], expected[k]) for k in ("big", "bias", "ids"))
    assert target["extra"] == expected["extra"]
    # Every item went through the check, and torch.load's reads were the expected
    # kind (one large read per storage): none needed a second full read.
    assert reader.items_checked == len(files[SHARD].items)
    assert reader.items_reread == 0


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte"])
@pytest.mark.parametrize("which", ["big", "smallest"])
def test_a_flipped_byte_in_an_item_fails_the_load_naming_the_file(saved, which, where):
    directory, files = saved
    items = files[SHARD].items
    item = (max(items, key=lambda i: i.length) if which == "big"
            else min(items, key=lambda i: i.length))
    offset = {"first byte": item.offset, "middle": item.offset + item.length // 2,
              "last byte": item.offset + item.length - 1}[where]
    path = os.path.join(directory, SHARD)
    size = os.path.getsize(path)
    flip(path, offset)
    assert os.path.getsize(path) == size
    # A damaged zip header may fail torch.load first: the verdict comes all the same.
    reader = dcp_io.VerifyingReader(directory, files)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert [p.path for p in reader.problems] == [path]
    assert "corrupt: CRC-32" in reader.problems[0].reason
    assert f"bytes {item.offset}..{item.offset + item.length}" in reader.problems[0].reason


def test_an_object_is_checked_before_it_is_unpickled(saved, monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    directory, files = saved
    metadata = dcp.FileSystemReader(directory).read_metadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "extra.note")
    flip(os.path.join(directory, SHARD), info.offset + info.length // 2)
    unpickled = []
    real = DefaultLoadPlanner.load_bytes
    monkeypatch.setattr(DefaultLoadPlanner, "load_bytes", lambda self, read_item, value: (
        unpickled.append(read_item.dest_index.fqn), real(self, read_item, value)))
    reader = dcp_io.VerifyingReader(directory, files)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert "extra.note" not in unpickled
    assert f"bytes {info.offset}..{info.offset + info.length}" in reader.problems[0].reason


def test_a_flipped_byte_in_the_metadata_is_caught_before_it_is_unpickled(saved):
    directory, files = saved
    path = os.path.join(directory, layout.METADATA_FILE)
    flip(path, os.path.getsize(path) // 2)
    reader = dcp_io.VerifyingReader(directory, files)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert [(p.path, p.reason.split(":")[0]) for p in reader.problems] == [(path, "corrupt")]


def test_items_the_manifest_does_not_list_are_refused(saved):
    directory, files = saved
    lying = dict(files)
    shard = files[SHARD]
    lying[SHARD] = layout.FileDigest(shard.size, shard.crc32, shard.items[:1])
    reader = dcp_io.VerifyingReader(directory, lying)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert "which the manifest does not list" in reader.problems[0].reason


def test_shard_files_without_items_are_read_unchecked(saved):
    # Manifests written before items existed: the caller checks those files whole.
    directory, files = saved
    old = dict(files)
    old[SHARD] = layout.FileDigest(files[SHARD].size, files[SHARD].crc32)
    flip(os.path.join(directory, SHARD), files[SHARD].size // 2)
    _, reader = load(directory, old)
    assert reader.problems == [] and reader.items_checked == 0


def test_reads_around_the_checks_fail_the_load(saved, monkeypatch):
    # A torch whose reader no longer asks the hook: nothing vouches for the items.
    directory, files = saved
    monkeypatch.setattr(dcp_io.VerifyingReader, compat.SLICE_FILE_HOOK,
                        getattr(dcp.FileSystemReader, compat.SLICE_FILE_HOOK))
    with pytest.raises(CheckpointException) as caught:
        load(directory, files)
    assert "reads around the checks" in str(caught.value)
    assert any(isinstance(failure[0], CheckpointError)
               for failure in caught.value.failures.values())


@contextlib.contextmanager
def item_file(tmp_path, data: bytes):
    """``data`` as a file that is one item, open for reading: its path, the
    descriptor and the item's digest."""
    path = str(tmp_path / "item")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        yield path, fd, layout.ItemDigest(0, len(data), f"{zlib.crc32(data):08x}")
    finally:
        os.close(fd)


@pytest.fixture
def one_item(tmp_path):
    """A 200 KB file that is one item, open for reading."""
    data = bytes(range(256)) * 800
    with item_file(tmp_path, data) as (path, fd, item):
        yield path, fd, data, item


def test_a_view_serves_reads_in_any_order_and_checks_them(one_item):
    path, fd, data, item = one_item
    view = dcp_io.VerifyingView(fd, path, item)
    view.seek(-100, os.SEEK_END)
    assert view.read() == data[-100:]
    view.seek(0)
    buffer = bytearray(len(data))
    assert view.readinto(buffer) == len(data) and bytes(buffer) == data
    assert view.read(10) == b""
    assert view.finish() is None and not view.reread


def test_a_view_rereads_what_it_could_not_follow(one_item):
    path, fd, data, item = one_item
    view = dcp_io.VerifyingView(fd, path, item)
    buffer = bytearray(100_000)
    view.readinto(buffer)
    view.seek(50_000)
    view.readinto(buffer)  # a large read behind the CRC
    assert view.finish() is None and view.reread


def test_bytes_that_change_between_two_reads_are_named(one_item):
    path, fd, data, item = one_item
    view = dcp_io.VerifyingView(fd, path, item)
    view.seek(-4096, os.SEEK_END)
    view.read(4096)  # torch.load reads an item's end first
    with open(path, "r+b") as f:
        f.seek(len(data) - 10)
        f.write(b"\xff")
    view.seek(0)
    view.readinto(bytearray(len(data)))
    problem = view.finish()
    assert problem is not None and problem.path == path
    assert problem.reason.startswith("changed while read")


# --- tensors read straight into their places ----------------------------------------------


def test_tensors_are_read_into_the_state_dicts_own_memory(saved):
    directory, files = saved
    target = blank()
    pointers = {k: target[k].data_ptr() for k in ("big", "bias", "ids")}
    versions = {k: target[k]._version for k in pointers}
    reader = dcp_io.VerifyingReader(directory, files)
    dcp.load(target, storage_reader=reader)
    expected = state()
    assert reader.tensors_in_place == 3 and reader.problems == []
    assert reader.items_reread == 0
    for key in pointers:
        assert torch.equal(target[key], expected[key])
        assert target[key].data_ptr() == pointers[key]  # no tensor of its own
        assert target[key]._version > versions[key]  # an in-place write, as copy_ is


def test_tensors_that_cannot_be_placed_are_loaded_and_copied(saved):
    directory, files = saved
    target = blank()
    target["big"] = torch.zeros(256, 300, dtype=torch.float64)  # converted by copy_
    target["bias"] = torch.zeros(7, 2)[:, 0]  # not contiguous
    reader = dcp_io.VerifyingReader(directory, files)
    dcp.load(target, storage_reader=reader)
    expected = state()
    assert reader.tensors_in_place == 1  # ids
    assert torch.equal(target["big"], expected["big"].double())
    assert torch.equal(target["bias"], expected["bias"])
    assert reader.items_checked == len(files[SHARD].items) and reader.problems == []


def test_a_file_of_another_byte_order_is_loaded_by_torch(saved, monkeypatch):
    directory, files = saved
    foreign = "big" if sys.byteorder == "little" else "little"
    real = dcp_io.VerifyingView.describe
    monkeypatch.setattr(dcp_io.VerifyingView, "describe",
                        lambda self: real(self)._replace(byte_order=foreign))
    target, reader = load(directory, files)
    assert reader.tensors_in_place == 0 and reader.problems == []
    assert torch.equal(target["big"], state()["big"])


def test_a_view_describes_the_tensor_torch_save_wrote(saved):
    directory, files = saved
    item = max(files[SHARD].items, key=lambda i: i.length)  # "big"
    path = os.path.join(directory, SHARD)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = dcp_io.VerifyingView(fd, path, item)
        saved_tensor = view.describe()
        assert saved_tensor.byte_order == sys.byteorder
        assert saved_tensor.tensor.is_meta and saved_tensor.tensor.shape == (256, 300)
        assert saved_tensor.tensor.dtype == torch.float32
        expected = state()["big"]
        data = os.pread(fd, expected.nbytes, item.offset + saved_tensor.offset)
        assert data == expected.numpy().tobytes()  # the storage's bytes are where it says
        assert view.finish() is None  # what it read went through the check
    finally:
        os.close(fd)


def test_a_tensor_saved_as_part_of_a_larger_storage_is_placed(tmp_path):
    # torch.save writes a view's whole storage, with the view's offset and strides.
    import io

    whole = torch.arange(40, dtype=torch.float64)
    data = _saved_bytes(whole.view(4, 10)[1:3])
    from types import SimpleNamespace

    with item_file(tmp_path, data) as (path, fd, item):
        view = dcp_io.VerifyingView(fd, path, item)
        target = torch.zeros(2, 10, dtype=torch.float64)
        wanted = SimpleNamespace(storage_offsets=[0, 0], lengths=[2, 10], storage_index=None)
        assert dcp_io.load_tensor(view, wanted, target)
        assert torch.equal(target, whole.view(4, 10)[1:3])
        assert view.finish() is None
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), target)


def _saved_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


_CALLED = []


def _side_effect(*args):
    _CALLED.append(args)
    return torch.zeros(1)


class _Rigged:
    def __reduce__(self):
        return (_side_effect, ("ran",))


def test_the_tensor_unpickler_runs_no_code_of_the_files_choosing():
    import io
    import pickle

    with pytest.raises(dcp_io.NotPlain):
        dcp_io.TensorUnpickler(io.BytesIO(pickle.dumps(_Rigged()))).load()
    assert _CALLED == []


def test_an_item_that_is_not_one_plain_tensor_is_left_to_torch_load(tmp_path):
    with item_file(tmp_path, _saved_bytes({"not": "a tensor"})) as (path, fd, item):
        view = dcp_io.VerifyingView(fd, path, item)
        assert view.describe() is None and view.tell() == 0
        assert view.finish() is None


@pytest.mark.parametrize("obj", [0.001, (0.9, 0.999), "adam", None, [1, {"a": True}],
                                 {"eps": 1e-8, "foreach": None}])
def test_objects_are_unpickled_as_torch_load_does_without_it(obj, monkeypatch):
    import io

    data = _saved_bytes(obj)
    expected = torch.load(io.BytesIO(data), weights_only=False)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    assert dcp_io.load_object(io.BytesIO(data)) == expected


@pytest.mark.parametrize("trusted", [False, True], ids=["allow-list", "trusted"])
@pytest.mark.parametrize("case", ["a tensor inside", "forced weights only", "not a zip"])
def test_objects_only_torch_load_rebuilds_go_to_it(case, trusted, monkeypatch):
    # weights_only=True unless the checkpoint is trusted (elastic.checkpoint.trust).
    import io
    import pickle

    from elastic.checkpoint.trust import LoadPolicy

    policy = LoadPolicy(trusted=trusted)
    obj = {"t": torch.arange(3)} if case == "a tensor inside" else {"lr": 0.1}
    data = pickle.dumps(obj) if case == "not a zip" else _saved_bytes(obj)
    if case == "forced weights only":
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    calls = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    if case == "not a zip":  # torch.load says what is wrong with it
        with pytest.raises(RuntimeError if trusted else CheckpointError,
                           match="magic number" if trusted else "Unsupported operand"):
            dcp_io.load_object(io.BytesIO(data), policy)
        assert [call["weights_only"] for call in calls] == [not trusted]
        return
    result = dcp_io.load_object(io.BytesIO(data), policy)
    expected_calls = [] if case == "forced weights only" and not trusted else [not trusted]
    assert [call["weights_only"] for call in calls] == expected_calls
    assert result.keys() == obj.keys() and all(
        torch.equal(result[k], v) if isinstance(v, torch.Tensor) else result[k] == v
        for k, v in obj.items())


def test_the_planner_restores_dcps_objects_without_torch_load(saved, monkeypatch):
    directory, files = saved
    target = blank()
    real = torch.load
    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or real(*a, **k))
    reader = dcp_io.VerifyingReader(directory, files)
    dcp.load(target, storage_reader=reader, planner=dcp_io.LoadPlanner())
    assert target["extra"] == state()["extra"]
    assert reader.tensors_in_place == 3 and calls == []  # .metadata is plain pickle


@pytest.mark.parametrize("rows", [(0, 100), (100, 156), (0, 256)])
def test_part_of_a_saved_tensor_is_placed_and_the_whole_item_checked(saved, rows):
    # Resharding: a rank needs some rows of a saved chunk.
    from types import SimpleNamespace

    directory, files = saved
    item = max(files[SHARD].items, key=lambda i: i.length)  # "big"
    path = os.path.join(directory, SHARD)
    start, length = rows
    target = torch.zeros(length, 300)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = dcp_io.VerifyingView(fd, path, item)
        wanted = SimpleNamespace(storage_offsets=[start, 0], lengths=[length, 300],
                                 storage_index=None)
        assert dcp_io.load_tensor(view, wanted, target)
        assert torch.equal(target, state()["big"][start:start + length])
        assert view.finish() is None and not view.reread
        flip(path, item.offset + item.length // 2)  # a byte this rank may not need
        view = dcp_io.VerifyingView(fd, path, item)
        dcp_io.load_tensor(view, wanted, torch.zeros(length, 300))
        assert "corrupt: CRC-32" in view.finish().reason
    finally:
        os.close(fd)


def test_a_sizes_only_reader_places_tensors_and_checks_no_bytes(saved):
    directory, files = saved
    item = max(files[SHARD].items, key=lambda i: i.length)  # "big"
    flip(os.path.join(directory, SHARD), item.offset + item.length // 2)  # in its data
    target = blank()
    pointer = target["big"].data_ptr()
    reader = dcp_io.VerifyingReader(directory, files, checksums=False)
    dcp.load(target, storage_reader=reader, planner=dcp_io.LoadPlanner())
    assert reader.tensors_in_place == 3 and target["big"].data_ptr() == pointer
    assert reader.items_checked == 0 and reader.problems == []
    expected = state()
    # The flip went through unseen: one number differs.
    assert (target["big"] != expected["big"]).sum().item() == 1
    assert target["extra"] == expected["extra"]


def test_a_sizes_only_reader_still_opens_only_listed_files(saved):
    directory, files = saved
    unlisted = {name: digest for name, digest in files.items() if name != SHARD}
    reader = dcp_io.VerifyingReader(directory, unlisted, checksums=False)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader)
    assert "not listed in any manifest" in reader.problems[0].reason


def test_a_description_that_overruns_its_storage_is_not_followed(saved, monkeypatch):
    # set_() on the meta device does not check a tensor against its storage's size;
    # bytes past the storage (the rest of the zip) must never be placed as data.
    directory, files = saved
    real = dcp_io.VerifyingView.describe
    monkeypatch.setattr(dcp_io.VerifyingView, "describe",
                        lambda self: real(self)._replace(nbytes=real(self).nbytes - 4))
    target, reader = load(directory, files)
    assert reader.tensors_in_place == 0 and reader.problems == []
    assert torch.equal(target["big"], state()["big"])
