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
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, Sequence

import torch

from elastic.errors import CheckpointError

# Padding this small between two destinations is read rather than split into two
# calls; it is at most the writer's alignment in practice.
_MAX_GAP = 4096
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Linux moves at most 2 GiB - 4 KiB in one read; a call stays below that.
_MAX_CALL_BYTES = 1 << 30
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


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

    def read_into(self, reads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Fill each destination (:func:`fillable`) with the bytes at its file
        offset (as many as it holds). Raises CheckpointError for a range outside
        the file's listed size or a file shorter than that, OSError when it
        cannot be read."""
        pieces = []
        for offset, tensor in reads:
            nbytes = tensor.numel() * tensor.element_size()
            if offset < 0 or offset + nbytes > self.size:
                raise CheckpointError(f"{self.path}: bytes {offset}..{offset + nbytes} lie "
                                      f"outside its {self.size} bytes")
            if not fillable(tensor):
                raise CheckpointError(f"{self.path}: a destination that is not a contiguous "
                                      f"CPU tensor cannot be read into")
            for start in range(0, nbytes, _MAX_CALL_BYTES):
                length = min(_MAX_CALL_BYTES, nbytes - start)
                pieces.append((offset + start, length, tensor.data_ptr() + start))
        if not pieces:
            return
        pieces.sort(key=lambda piece: piece[0])
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            for start, end, buffers in _calls(pieces):
                if os.preadv(fd, buffers, start) != end - start:
                    raise CheckpointError(f"{self.path} is shorter than its manifest says "
                                          f"({self.size} bytes)")
        finally:
            os.close(fd)


def _calls(pieces: list[tuple[int, int, int]]):
    """``(file start, file end, buffers)`` per system call: pieces (file offset,
    length, address) sorted by offset, joined while they follow one another."""
    scratch = memoryview(bytearray(_MAX_GAP))
    start = end = 0
    buffers: list[memoryview] = []
    size = 0
    for offset, length, address in pieces:
        gap = offset - end
        if buffers and (gap < 0 or gap > _MAX_GAP or len(buffers) >= _IOV_MAX - 1
                        or size + gap + length > _MAX_CALL_BYTES):
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
