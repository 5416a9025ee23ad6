"""CRC-32s computed while DCP writes and checked while it reads (elastic.checkpoint.dcp_io):
one process, DCP without a process group, real files, no Checkpointer."""

from __future__ import annotations

import os
import sys
import zlib

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

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
    dcp.save(state(), storage_writer=writer, no_dist=True)
    return directory, writer.digests()


def load(directory: str, files: dict) -> tuple[dict, dcp_io.VerifyingReader]:
    target = blank()
    reader = dcp_io.VerifyingReader(directory, files)
    dcp.load(target, storage_reader=reader, no_dist=True)
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
        dcp.load(blank(), storage_reader=reader, no_dist=True)
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
        dcp.load(blank(), storage_reader=reader, no_dist=True)
    assert "extra.note" not in unpickled
    assert f"bytes {info.offset}..{info.offset + info.length}" in reader.problems[0].reason


def test_a_flipped_byte_in_the_metadata_is_caught_before_it_is_unpickled(saved):
    directory, files = saved
    path = os.path.join(directory, layout.METADATA_FILE)
    flip(path, os.path.getsize(path) // 2)
    reader = dcp_io.VerifyingReader(directory, files)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader, no_dist=True)
    assert [(p.path, p.reason.split(":")[0]) for p in reader.problems] == [(path, "corrupt")]


def test_items_the_manifest_does_not_list_are_refused(saved):
    directory, files = saved
    lying = dict(files)
    shard = files[SHARD]
    lying[SHARD] = layout.FileDigest(shard.size, shard.crc32, shard.items[:1])
    reader = dcp_io.VerifyingReader(directory, lying)
    with pytest.raises(CheckpointException):
        dcp.load(blank(), storage_reader=reader, no_dist=True)
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
    # A torch whose reader no longer asks _slice_file: nothing vouches for the items.
    directory, files = saved
    monkeypatch.setattr(dcp_io.VerifyingReader, "_slice_file",
                        lambda self, file, sinfo: dcp.FileSystemReader._slice_file(
                            self, file, sinfo))
    with pytest.raises(CheckpointException) as caught:
        load(directory, files)
    assert "reads around the checks" in str(caught.value)
    assert any(isinstance(failure[0], CheckpointError)
               for failure in caught.value.failures.values())


@pytest.fixture
def one_item(tmp_path):
    """A 200 KB file that is one item, open for reading."""
    data = bytes(range(256)) * 800
    path = str(tmp_path / "item")
    with open(path, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_RDONLY)
    yield path, fd, data, layout.ItemDigest(0, len(data), f"{zlib.crc32(data):08x}")
    os.close(fd)


def test_a_view_serves_reads_in_any_order_and_checks_them(one_item):
    path, fd, data, item = one_item
    view = dcp_io._VerifyingView(fd, path, item)
    view.seek(-100, os.SEEK_END)
    assert view.read() == data[-100:]
    view.seek(0)
    buffer = bytearray(len(data))
    assert view.readinto(buffer) == len(data) and bytes(buffer) == data
    assert view.read(10) == b""
    assert view.finish() is None and not view.reread


def test_a_view_rereads_what_it_could_not_follow(one_item):
    path, fd, data, item = one_item
    view = dcp_io._VerifyingView(fd, path, item)
    buffer = bytearray(100_000)
    view.readinto(buffer)
    view.seek(50_000)
    view.readinto(buffer)  # a large read behind the CRC
    assert view.finish() is None and view.reread


def test_bytes_that_change_between_two_reads_are_named(one_item):
    path, fd, data, item = one_item
    view = dcp_io._VerifyingView(fd, path, item)
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
    dcp.load(target, storage_reader=reader, no_dist=True)
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
    dcp.load(target, storage_reader=reader, no_dist=True)
    expected = state()
    assert reader.tensors_in_place == 1  # ids
    assert torch.equal(target["big"], expected["big"].double())
    assert torch.equal(target["bias"], expected["bias"])
    assert reader.items_checked == len(files[SHARD].items) and reader.problems == []


def test_a_file_of_another_byte_order_is_loaded_by_torch(saved, monkeypatch):
    directory, files = saved
    foreign = "big" if sys.byteorder == "little" else "little"
    monkeypatch.setattr(dcp_io._VerifyingView, "byte_order", lambda self: foreign)
    target, reader = load(directory, files)
    assert reader.tensors_in_place == 0 and reader.problems == []
    assert torch.equal(target["big"], state()["big"])


def test_a_view_reports_the_byte_order_torch_save_recorded(saved):
    directory, files = saved
    item = max(files[SHARD].items, key=lambda i: i.length)
    path = os.path.join(directory, SHARD)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = dcp_io._VerifyingView(fd, path, item)
        assert view.byte_order() == sys.byteorder
        assert view.finish() is None  # what it read went through the check
    finally:
        os.close(fd)


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
        view = dcp_io._VerifyingView(fd, path, item)
        wanted = SimpleNamespace(storage_offsets=[start, 0], lengths=[length, 300],
                                 storage_index=None)
        assert dcp_io._load_tensor(view, wanted, target, sys.byteorder)
        assert torch.equal(target, state()["big"][start:start + length])
        assert view.finish() is None and not view.reread
        flip(path, item.offset + item.length // 2)  # a byte this rank may not need
        view = dcp_io._VerifyingView(fd, path, item)
        dcp_io._load_tensor(view, wanted, torch.zeros(length, 300), sys.byteorder)
        assert "corrupt: CRC-32" in view.finish().reason
    finally:
        os.close(fd)
