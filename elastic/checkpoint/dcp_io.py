"""DCP's file storage with CRC-32s: computed as DCP writes, checked as DCP reads.

:class:`ChecksummingWriter` is DCP's ``FileSystemWriter`` whose file system
hands DCP a stream that keeps a running CRC-32 of what DCP writes through it,
cut into one segment per item: DCP's writer asks the stream for its position
(``tell()``) before and after each item, and those are the cuts. From the
segments and DCP's write results (each item's file, offset and length) it
gives every file's size and CRC-32 and every item's CRC-32
(:meth:`ChecksummingWriter.digests`) for the manifest, without reading
anything back. Should a future DCP write an item without asking for the
position around it, that file gets no items and restore verifies it whole.

:class:`VerifyingReader` is DCP's ``FileSystemReader`` that checks the bytes it
reads against the manifests: ``.metadata`` whole, before DCP unpickles it, and
each item's byte range as ``torch.load`` reads it. ``torch.load`` reads an item
out of order (the zip directory at its end first) in small reads, plus one
large read of each tensor's storage straight into the tensor's memory. A large
read is folded into the item's running CRC-32 in place, with no copy; the
bytes around the large reads are read again with ``pread`` for the CRC-32; and
the small reads are kept (a few KB per item) and compared with the bytes that
went into the CRC-32 at their place (the large read or the ``pread``), so every
byte ``torch.load`` consumed went into the CRC-32 or equals one that did (an
access pattern this cannot follow costs one more read of the item). The
verdict on a tensor's item comes when DCP closes its file, after the tensor was
copied into the model: a failed restore leaves the model's state undefined, as
any failed load does (see :meth:`Checkpointer.restore`). An item read whole in
one read (DCP's pickled objects, which it unpickles with ``weights_only=False``)
is checked before DCP sees its bytes. DCP reads whole items
also when it reshards (it narrows the loaded tensor afterwards), so every item
a restore uses is checked, by the rank that reads it; items no rank reads are
not.

The hooks are DCP's ``FileSystemBase`` (``create_stream``, ``rename``) through
the writer's and reader's ``fs`` attribute, and ``FileSystemReader._slice_file``
(where DCP turns an item's storage info into a stream over its bytes). Should a
future DCP read without ``_slice_file``, :meth:`VerifyingReader.read_data` sees
that items were read unchecked and fails the load rather than trust them.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from typing import Any, Iterator, Mapping

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from elastic.checkpoint import layout
from elastic.errors import CheckpointCorruptError, CheckpointError

# Reads at least this large (a tensor's storage) go into the CRC-32 in place; smaller
# ones (zip headers, the pickle) are kept and compared with the bytes that do.
_LARGE_READ = 64 << 10
_CHUNK = 1 << 20  # our own reads, of the bytes around the large ones


# --- writing -------------------------------------------------------------------------------


class _ChecksummingStream:
    """A write stream that keeps a running CRC-32 of what passes through it, cut
    into segments wherever the writer asks for the position."""

    def __init__(self, raw: Any):
        self._raw = raw
        self.size = 0
        self._start = 0
        self._crc = 0
        self.segments: list[tuple[int, int, int]] = []  # (offset, length, crc32)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        written = len(view) if written is None else written
        self._crc = layout.crc32(view[:written], self._crc)
        self.size += written
        return written

    def tell(self) -> int:
        self._cut()
        return self.size

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()

    def finish(self) -> list[tuple[int, int, int]]:
        self._cut()
        return self.segments

    def _cut(self) -> None:
        if self.size > self._start:
            self.segments.append((self._start, self.size - self._start, self._crc))
            self._start, self._crc = self.size, 0


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, remembering the CRC-32 segments of each file
    written through it (by name), from any of DCP's writer threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.segments: dict[str, list[tuple[int, int, int]]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _ChecksummingStream(raw)
            yield stream
            segments = stream.finish()
        with self._lock:
            self.segments[os.path.basename(path)] = segments

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            segments = self.segments.pop(os.path.basename(path), None)
            if segments is not None:
                self.segments[os.path.basename(new_path)] = segments


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced, never over an existing
    checkpoint) that computes its files' CRC-32s as it writes them."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.fs = _ChecksummingFileSystem()
        self._items: dict[str, list[tuple[int, int]]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        for result in future.value():
            info = result.storage_data
            self._items.setdefault(info.relative_path, []).append((info.offset, info.length))
        return future

    def digests(self) -> dict[str, layout.FileDigest]:
        """Every file this writer wrote (this rank's shards, and ``.metadata`` on
        the coordinator): size, CRC-32 and, for shards, the items' CRC-32s, all
        from the bytes as written."""
        out = {}
        for name, segments in self.fs.segments.items():
            pieces = [layout.ItemDigest(offset, length, f"{crc:08x}")
                      for offset, length, crc in segments]
            size = sum(piece.length for piece in pieces)
            items = _items(pieces, self._items.get(name))
            out[name] = layout.FileDigest(size=size, crc32=layout.combined_crc32(pieces),
                                          items=items)
        return out


def _items(segments: list[layout.ItemDigest], spans: list[tuple[int, int]] | None
           ) -> tuple[layout.ItemDigest, ...] | None:
    """Each item's CRC-32 from the segments that make it up; None when the items
    do not tile the file or an item does not start and end at a cut."""
    if not spans:
        return None
    by_offset = {segment.offset: index for index, segment in enumerate(segments)}
    items = []
    position = 0
    for offset, length in sorted(spans):
        if offset != position or offset not in by_offset:
            return None
        parts = []
        index = by_offset[offset]
        while position < offset + length and index < len(segments):
            parts.append(segments[index])
            position += segments[index].length
            index += 1
        if position != offset + length:
            return None
        items.append(layout.ItemDigest(offset, length, layout.combined_crc32(parts)))
    if position != sum(segment.length for segment in segments):
        return None
    return tuple(items)


# --- reading -------------------------------------------------------------------------------


class _Changed(Exception):
    """Bytes differed between two reads of the same range."""


class _VerifyingView(io.RawIOBase):
    """One item's byte range of an open file, for ``torch.load``; checks what it
    serves against the item's CRC-32 (see the module docstring).

    Positions are relative to the item. ``[0, _verified)`` has gone into
    ``_crc``; large reads are folded in where they land, and everything before
    them is read again (``_advance``) and compared with the small reads kept."""

    def __init__(self, fd: int, path: str, item: layout.ItemDigest):
        super().__init__()
        self._fd = fd
        self.path = path
        self.item = item
        self._pos = 0
        self._crc = 0
        self._verified = 0
        self._kept: list[list[Any]] = []  # [offset, bytes, bytes compared so far]
        self._error: Exception | None = None  # found while torch.load was reading
        self.reread = False  # reads the CRC could not follow: checked by reading it all again

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.item.length}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.item.length - self._pos))
        if wanted == 0:
            return 0
        got = os.preadv(self._fd, [view[:wanted]], self.item.offset + self._pos)
        self._consumed(self._pos, view[:got])
        self._pos += got
        return got

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.item.length - self._pos)
        wanted = left if size is None or size < 0 else min(size, left)
        if wanted == 0:
            return b""
        data = os.pread(self._fd, wanted, self.item.offset + self._pos)
        if self._pos == 0 and len(data) == self.item.length:
            # The whole item at once (DCP reads a pickled object so): checked before
            # anyone unpickles it, which DCP does with weights_only=False.
            self._crc, self._verified = layout.crc32(data), len(data)
            try:
                self._compare(0, data)
            except _Changed as exc:
                self._error = exc
            if f"{self._crc:08x}" != self.item.crc32:
                raise CheckpointCorruptError(f"{self.path}: an item fails its CRC-32")
        else:
            self._consumed(self._pos, data)
        self._pos += len(data)
        return data

    def _consumed(self, offset: int, data: Any) -> None:
        if len(data) < _LARGE_READ:
            self._kept.append([offset, bytes(data), 0])  # the caller may reuse its buffer
        elif offset < self._verified or self._error is not None:
            self.reread = True
        else:
            try:
                self._advance(offset)
                self._compare(offset, data)
            except (_Changed, EOFError, OSError) as exc:
                self._error = exc  # the verdict, when DCP closes the file
                return
            self._crc = layout.crc32(data, self._crc)
            self._verified = offset + len(data)

    def _advance(self, target: int) -> None:
        """Fold ``[_verified, target)`` into the CRC from a read of our own,
        comparing it with the small reads kept. Raises _Changed, EOFError, OSError."""
        while self._verified < target:
            start = self._verified
            data = os.pread(self._fd, min(_CHUNK, target - start), self.item.offset + start)
            if not data:
                raise EOFError(f"the file ends {start} bytes into the item")
            self._compare(start, data)
            self._crc = layout.crc32(data, self._crc)
            self._verified = start + len(data)

    def _compare(self, start: int, data: Any) -> None:
        """Compare the kept small reads with ``data``, the bytes at ``start`` that
        go into the CRC now (e.g. torch.load's read of an item's last 4 KB, which
        overlaps the storage read later). Raises _Changed."""
        end = start + len(data)
        for kept in self._kept:
            offset, piece = kept[0], kept[1]
            low, high = max(start, offset), min(end, offset + len(piece))
            if low < high:
                if data[low - start:high - start] != piece[low - offset:high - offset]:
                    raise _Changed(f"bytes {self.item.offset + low}..{self.item.offset + high} "
                                   f"differ between two reads")
                kept[2] += high - low

    def finish(self) -> layout.Problem | None:
        """The item's verdict: None when what was served matches its CRC-32."""
        where = f"bytes {self.item.offset}..{self.item.offset + self.item.length} (one item)"
        try:
            if self._error is not None:
                raise self._error
            self._advance(self.item.length)
            if self.reread or any(kept[2] < len(kept[1]) for kept in self._kept):
                # A small read behind a large one, or a large one read twice: check
                # everything from one more read.
                self.reread = True
                self._crc, self._verified = 0, 0
                for kept in self._kept:
                    kept[2] = 0
                self._advance(self.item.length)
        except _Changed as exc:
            return layout.Problem(self.path, f"changed while read: {exc}")
        except EOFError as exc:
            return layout.Problem(self.path, f"truncated: {exc}")
        except OSError as exc:
            return layout.Problem(self.path, f"cannot read {where} ({exc})")
        actual = f"{self._crc:08x}"
        if actual != self.item.crc32:
            return layout.Problem(self.path, f"corrupt: CRC-32 {actual} of {where}, expected "
                                             f"{self.item.crc32}")
        return None


class _VerifyingFileSystem(FileSystem):
    """DCP's local file system for a :class:`VerifyingReader`: opens only files the
    manifests list, serves ``.metadata`` from verified bytes, and settles the
    items read from a file when DCP closes it."""

    def __init__(self, reader: "VerifyingReader"):
        super().__init__()
        self._reader = reader

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise ValueError(f"a checkpoint being restored is opened for reading only, not "
                             f"{mode!r}")
        reader = self._reader
        name = os.path.basename(path)
        expected = reader.files.get(name)
        if expected is None or os.path.dirname(os.path.abspath(path)) != reader.directory:
            raise reader.fail(layout.Problem(str(path), "read by DCP but not listed in any "
                                                        "manifest"))
        if name == layout.METADATA_FILE:
            yield io.BytesIO(reader.verified_bytes(name))
            return
        with super().create_stream(path, mode) as stream:
            try:
                yield stream
            finally:
                reader.settle(stream)


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader for a checkpoint directory whose manifests list ``files``
    (every rank's, by name), checking everything it reads against them.

    ``.metadata`` and every item of a shard file with item CRC-32s are checked
    (see the module docstring); shard files without items (manifests written
    before items existed) are read unchecked: the caller verifies them whole.
    A mismatch is appended to :attr:`problems` (naming the file and the item)
    and fails the load with :class:`CheckpointCorruptError`, which DCP passes
    on to every rank. :attr:`items_checked` counts the items checked, and
    :attr:`items_reread` those whose reads forced a second read of the item.
    """

    def __init__(self, path: str, files: Mapping[str, layout.FileDigest]):
        super().__init__(path)
        self.fs = _VerifyingFileSystem(self)
        self.directory = os.path.abspath(path)
        self.files = files
        self.problems: list[layout.Problem] = []
        self.items_checked = 0
        self.items_reread = 0
        self._items = {name: {item.offset: item for item in digest.items}
                       for name, digest in files.items() if digest.items is not None}
        self._open: dict[int, list[_VerifyingView]] = {}
        self._sliced = 0

    def fail(self, problem: layout.Problem) -> CheckpointCorruptError:
        self.problems.append(problem)
        return CheckpointCorruptError(str(problem))

    def verified_bytes(self, name: str) -> bytes:
        """The bytes of a small file of the checkpoint (``.metadata``, a rank's
        state), read whole and checked. Raises CheckpointCorruptError."""
        path = os.path.join(self.directory, name)
        expected = self.files.get(name)
        if expected is None:
            raise self.fail(layout.Problem(path, "not listed in any manifest"))
        try:
            data = layout.read_limited(path, expected.size)
        except (OSError, ValueError) as exc:
            raise self.fail(layout.Problem(path, f"cannot read ({exc})")) from exc
        problem = layout.check_bytes(path, data, expected)
        if problem is not None:
            raise self.fail(problem)
        return data

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            # DCP's fallback after the global .metadata failed: we write no per-rank one.
            raise FileNotFoundError("this checkpoint has no per-rank DCP metadata")
        return super().read_metadata(*args, **kwargs)

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._sliced += 1
        items = self._items.get(sinfo.relative_path)
        if items is None:
            return super()._slice_file(file, sinfo)
        path = os.path.join(self.directory, sinfo.relative_path)
        item = items.get(sinfo.offset)
        if item is None or item.length != sinfo.length:
            raise self.fail(layout.Problem(path, f"DCP's .metadata locates an item at bytes "
                                                 f"{sinfo.offset}..{sinfo.offset + sinfo.length}"
                                                 f", which the manifest does not list"))
        view = _VerifyingView(file.fileno(), path, item)
        self._open.setdefault(id(file), []).append(view)
        return view

    def settle(self, file: Any) -> None:
        """Give the verdict on the items read from ``file``, which DCP is closing
        (also when the load failed: a corrupt item may be why). Records every bad
        one; raises CheckpointCorruptError for the first."""
        problems = []
        for view in self._open.pop(id(file), []):
            problem = view.finish()
            self.items_checked += 1
            self.items_reread += view.reread
            if problem is not None:
                problems.append(problem)
        if problems:
            self.problems.extend(problems[1:])
            raise self.fail(problems[0])

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, then a check that every item went through :meth:`_slice_file`.
        Raises CheckpointError when one did not (a DCP that reads around the checks)."""
        before = self._sliced
        future = super().read_data(plan, planner)
        if self._sliced - before != len(plan.items):
            raise CheckpointError(
                f"DCP read {len(plan.items)} item(s) from {self.directory}, "
                f"{self._sliced - before} through the verifying reader: this version of "
                f"torch reads around the checks, so nothing vouches for what it loaded")
        return future
