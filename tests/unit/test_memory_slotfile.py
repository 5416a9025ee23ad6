"""Reading a slot's data.bin straight into destination tensors
(elastic.checkpoint.memory.slotfile): bitwise, batched into few system calls, spread
over threads that read at once, and refusing ranges the file does not hold."""

from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")

from elastic.checkpoint.memory.slotfile import (  # noqa: E402
    MAX_COPY_THREADS,
    SlotFile,
    copy_threads,
    fillable,
    read_files,
)
from elastic.errors import CheckpointError  # noqa: E402

ALIGN = 64  # the writer's alignment: small gaps between tensors


def write_tensors(path, tensors: list[torch.Tensor]) -> list[int]:
    """``tensors`` laid out in one file as a worker lays out data.bin; their offsets."""
    data, offsets = bytearray(), []
    for tensor in tensors:
        data += bytes(-len(data) % ALIGN)
        offsets.append(len(data))
        data += tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    return offsets


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def count_preadv(monkeypatch):
    """The real preadv, counted."""
    calls = []
    real = os.preadv

    def counted(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    return calls


def test_many_tensors_read_bitwise_in_one_call_whatever_order_they_are_asked_in(
        tmp_path, count_preadv):
    torch.manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.float64, torch.uint8)
    saved = [torch.randn(i % 7 + 1, 3).to(dtypes[i % len(dtypes)]) for i in range(300)]
    saved.append(torch.tensor(5.0))  # a 0-d tensor (Adam's step)
    offsets = write_tensors(tmp_path / "data.bin", saved)
    places = [torch.zeros_like(t) for t in saved]
    order = list(reversed(range(len(saved))))
    SlotFile(str(tmp_path / "data.bin"), os.path.getsize(tmp_path / "data.bin")).read_into(
        [(offsets[i], places[i]) for i in order])
    assert all(same_bits(p, t) for p, t in zip(places, saved))
    assert len(count_preadv) == 1  # 301 destinations and the gaps between them


def test_distant_ranges_and_more_buffers_than_one_call_takes_are_split(tmp_path, count_preadv):
    saved = [torch.full((4,), float(i)) for i in range(1500)]
    offsets = write_tensors(tmp_path / "data.bin", saved)
    places = [torch.zeros(4) for _ in saved]
    size = os.path.getsize(tmp_path / "data.bin")
    # Every other tensor only: the gaps are one tensor wide (still read through).
    SlotFile(str(tmp_path / "data.bin"), size).read_into(
        [(offsets[i], places[i]) for i in range(0, 1500, 2)])
    assert all(same_bits(places[i], saved[i]) for i in range(0, 1500, 2))
    assert not any(places[i].any() for i in range(1, 1500, 2))
    assert len(count_preadv) == 2  # 750 pieces and 749 gaps: more than IOV_MAX (1024)


def test_a_range_outside_the_listed_size_a_short_file_and_a_view_are_refused(tmp_path):
    offsets = write_tensors(tmp_path / "data.bin", [torch.ones(8)])
    size = os.path.getsize(tmp_path / "data.bin")
    with pytest.raises(CheckpointError, match="outside its 32 bytes"):
        SlotFile(str(tmp_path / "data.bin"), size).read_into([(offsets[0] + 4, torch.zeros(8))])
    with pytest.raises(CheckpointError, match="shorter than its manifest"):
        SlotFile(str(tmp_path / "data.bin"), size + 64).read_into([(32, torch.zeros(8))])
    strided = torch.zeros(8, 2)[:, 0]
    assert not fillable(strided)
    with pytest.raises(CheckpointError, match="not a contiguous CPU tensor"):
        SlotFile(str(tmp_path / "data.bin"), size).read_into([(0, strided)])


def test_the_mapping_serves_what_a_read_cannot_fill(tmp_path):
    write_tensors(tmp_path / "data.bin", [torch.arange(8.0)])
    mapped = SlotFile(str(tmp_path / "data.bin"), 32).mapping()
    assert bytes(mapped) == torch.arange(8.0).numpy().tobytes()
    assert SlotFile(str(tmp_path / "none"), 0).mapping() == b""


def test_several_files_read_by_several_threads_land_bitwise(tmp_path, preadv_meeting):
    """Two slots' files, 24 MiB in all, read by 3 threads: cut into parts that
    three threads read at once (the first three reads meet at a barrier that
    fewer threads would never pass), every destination bitwise its saved tensor."""
    calls = preadv_meeting(3)
    torch.manual_seed(1)
    files, jobs, expected = [], [], []
    for name in ("a.bin", "b.bin"):
        saved = [torch.randn(3 << 20 >> 2), torch.randn(5), torch.randn(9 << 20 >> 2)]
        offsets = write_tensors(tmp_path / name, saved)
        slot = SlotFile(str(tmp_path / name), os.path.getsize(tmp_path / name))
        places = [torch.zeros_like(t) for t in saved]
        jobs.append((slot, list(zip(offsets, places))))
        expected += list(zip(places, saved))
        files.append(slot)
    read_files(jobs, threads=3)
    assert all(same_bits(place, saved) for place, saved in expected)
    assert len(set(calls[:3])) == 3 and threading.get_ident() not in calls


def test_a_file_shorter_than_listed_fails_the_threaded_read_too(tmp_path):
    offsets = write_tensors(tmp_path / "data.bin", [torch.ones(3 << 20), torch.ones(3 << 20)])
    size = os.path.getsize(tmp_path / "data.bin")
    os.truncate(tmp_path / "data.bin", size - 4096)
    places = [torch.zeros(3 << 20), torch.zeros(3 << 20)]
    with pytest.raises(CheckpointError, match="shorter than its manifest"):
        SlotFile(str(tmp_path / "data.bin"), size).read_into(list(zip(offsets, places)),
                                                             threads=2)


def test_the_node_cpus_are_shared_among_its_restoring_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert copy_threads(1) == MAX_COPY_THREADS == 4  # capped
    assert copy_threads(4) == 2
    assert copy_threads(8) == 1
    assert copy_threads(16) == 1  # more ranks than CPUs: still one thread each
