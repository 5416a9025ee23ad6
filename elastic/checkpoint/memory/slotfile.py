"""A slot's ``data.bin`` on this node, read straight into the tensors that need its bytes.

A restore copies each saved tensor once, from the tmpfs file into its
destination (a live parameter, an optimizer state), with ``preadv(2)``: the
kernel copies from the file's pages, so no mapping is built (mapping a slot
costs one page-table entry per 4 KiB page, as much as a third of the copy) and
nothing is copied twice. Destinations whose bytes follow one another in the
file go in one system call (the padding between them read into a scratch
buffer), so a rank's whole state is a handful of calls, not one per tensor.

A destination that ``preadv`` cannot fill (not in CPU memory, not contiguous)
is copied from a read-only mapping of the file instead (:meth:`SlotFile.mapping`).

The copy is the restore's largest cost and one thread copies at a fraction of
what a node's memory moves, so :func:`read_files` spreads the calls of several
files over threads (``preadv`` runs without the GIL): as many as
:func:`copy_threads` finds idle, since a restore stops training and the
node's cores have nothing else to do.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import mmap
import os
from typing import Any, Sequence

import torch

from elastic.checkpoint import timing
from elastic.errors import CheckpointError

# Padding this small between two destinations is read rather than split into two
# calls; it is at most the writer's alignment in practice.
_MAX_GAP = 4096
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Linux moves at most 2 GiB - 4 KiB in one read; a call stays below that.
_MAX_CALL_BYTES = 1 << 30
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# A cap: a few threads reach what a socket's memory bandwidth allows (one thread's
# kernel copy moves a fraction of it), more would only contend.
MAX_COPY_THREADS = 4
# With several threads a read is cut into about this many parts per thread (so that
# a thread slowed by another process leaves its share to the others), none smaller
# than _MIN_PART bytes, each a multiple of _PART_ALIGN.
_PARTS_PER_THREAD = 4
_MIN_PART = 4 << 20
_PART_ALIGN = 1 << 16


def copy_threads(ranks_on_node: int) -> int:
    """How many threads one of ``ranks_on_node`` restoring ranks of this node
    copies with: its share of the CPUs this process may run on, at least 1 and
    at most :data:`MAX_COPY_THREADS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_COPY_THREADS, cpus // max(1, ranks_on_node)))


def fillable(tensor: torch.Tensor) -> bool:
    """Whether :meth:`SlotFile.read_into` can fill ``tensor``: a plain, contiguous
    CPU tensor, whose bytes are one range of this process's memory and mean what
    they say (no lazy conjugate or negative view)."""
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg())


class SlotFile:
    """``data.bin`` of a slot on this node (``size`` bytes, as its manifest lists).

    Reading never writes to the file. A writer that starts on the slot meanwhile
    is seen by the caller's ``layout.still_same`` check after the reads (the slot
    protocol), not here."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        self._mapped: Any = None

    def __len__(self) -> int:
        return self.size

    def mapping(self) -> Any:
        """The file mapped read-only (populated at once), mapped on first use and
        kept; ``b""`` for an empty file. Raises OSError."""
        if self._mapped is None:
            if not self.size:
                self._mapped = b""
            else:
                with open(self.path, "rb") as f:
                    self._mapped = mmap.mmap(f.fileno(), 0, flags=_MAP_FLAGS,
                                             prot=mmap.PROT_READ)
        return self._mapped

    def read_into(self, reads: Sequence[tuple[int, torch.Tensor]], threads: int = 1) -> None:
        """Fill each destination (:func:`fillable`) with the bytes at its file
        offset (as many as it holds): :func:`read_files` of this file alone."""
        read_files([(self, reads)], threads)

    def _pieces(self, reads: Sequence[tuple[int, torch.Tensor]], limit: int
               ) -> list[tuple[int, int, int]]:
        """``(file offset, length, address)`` of each destination's bytes, in
        pieces of at most ``limit`` bytes, sorted by offset. Raises CheckpointError
        for a range outside the file's listed size or a destination that is not
        :func:`fillable`."""
        pieces = []
        for offset, tensor in reads:
            nbytes = tensor.numel() * tensor.element_size()
            if offset < 0 or offset + nbytes > self.size:
                raise CheckpointError(f"{self.path}: bytes {offset}..{offset + nbytes} lie "
                                      f"outside its {self.size} bytes")
            if not fillable(tensor):
                raise CheckpointError(f"{self.path}: a destination that is not a contiguous "
                                      f"CPU tensor cannot be read into")
            for start in range(0, nbytes, limit):
                pieces.append((offset + start, min(limit, nbytes - start),
                               tensor.data_ptr() + start))
        pieces.sort(key=lambda piece: piece[0])
        return pieces


@timing.timed("read")
def read_files(jobs: Sequence[tuple[SlotFile, Sequence[tuple[int, torch.Tensor]]]],
               threads: int = 1) -> None:
    """Fill the destinations of every ``(file, [(offset, tensor), ...])`` job
    (:meth:`SlotFile.read_into`), with up to ``threads`` threads: the reads are
    then cut into parts that the threads take as they finish the last one.
    Raises CheckpointError for a range outside a file's listed size, a
    destination that is not :func:`fillable` or a file shorter than its listed
    size (before any byte is read for the first two), OSError (naming the file)
    when one cannot be read."""
    total = sum(tensor.numel() * tensor.element_size() for _, reads in jobs
                for _, tensor in reads)
    limit = _MAX_CALL_BYTES
    if threads > 1:
        share = -(-total // (threads * _PARTS_PER_THREAD))
        limit = min(_MAX_CALL_BYTES, max(_MIN_PART, -(-share // _PART_ALIGN) * _PART_ALIGN))
    planned = [(file, file._pieces(reads, limit)) for file, reads in jobs]
    fds: dict[str, int] = {}
    try:
        calls = []
        for file, pieces in planned:
            if pieces:
                fd = fds.get(file.path)
                if fd is None:
                    fd = fds[file.path] = os.open(file.path, os.O_RDONLY | os.O_NOFOLLOW)
                calls += [(file, fd, *call) for call in _calls(pieces, limit)]
        if threads > 1 and len(calls) > 1:
            with concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(threads, len(calls)),
                    thread_name_prefix="elastic-slot-read") as pool:
                list(pool.map(_read_call, calls))
        else:
            for call in calls:
                _read_call(call)
    finally:
        for fd in fds.values():
            os.close(fd)


def _read_call(call: tuple[SlotFile, int, int, int, list[memoryview]]) -> None:
    file, fd, start, end, buffers = call
    try:
        got = os.preadv(fd, buffers, start)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, file.path) from exc
    if got != end - start:
        raise CheckpointError(f"{file.path} is shorter than its manifest says "
                              f"({file.size} bytes)")


def _calls(pieces: list[tuple[int, int, int]], limit: int = _MAX_CALL_BYTES):
    """``(file start, file end, buffers)`` per system call: pieces (file offset,
    length, address) sorted by offset, joined while they follow one another
    and the call stays within ``limit`` bytes."""
    # The padding between destinations lands here, in every call: calls that run
    # at once may write it together, which is harmless as nothing reads it.
    scratch = memoryview(bytearray(_MAX_GAP))
    start = end = 0
    buffers: list[memoryview] = []
    size = 0
    for offset, length, address in pieces:
        gap = offset - end
        if buffers and (gap < 0 or gap > _MAX_GAP or len(buffers) >= _IOV_MAX - 1
                        or size + gap + length > limit):
            yield start, end, buffers
            buffers = []
        if not buffers:
            start, end, size = offset, offset, 0
        elif gap:
            buffers.append(scratch[:gap])
        buffers.append(memoryview((ctypes.c_char * length).from_address(address)).cast("B"))
        end = offset + length
        size = end - start
    if buffers:
        yield start, end, buffers
