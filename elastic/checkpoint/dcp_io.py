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
one read (DCP's pickled objects) is checked before anyone unpickles its bytes,
which :mod:`elastic.checkpoint.trust` does within an allow-list, as it does
``.metadata`` (:meth:`VerifyingReader.read_metadata`): no code of the
checkpoint's choosing runs.

The reader runs DCP's read loop itself (:meth:`VerifyingReader.read_data`), so
that a tensor's bytes go from the file straight into the state dict's tensor,
chunk by chunk, each chunk folded into the item's CRC-32 while it is in the
CPU's cache; the item's description (dtype, shape, where the bytes lie) comes
from its zip directory and a restricted unpickler (:meth:`VerifyingView.describe`),
not from ``torch.load``, whose fixed cost per call (0.1 to 0.3 ms, most of it its
unpickler written in Python) came to about a sixth of a 0.1 s restore. DCP's
loop lets ``torch.load`` allocate a tensor, read into it and copy that into the
state dict: more memory traffic than the CRC-32 costs. Tensors that cannot be
placed so go DCP's way (:func:`load_tensor`). DCP's pickled objects
(``BYTE_IO`` items, e.g. each hyperparameter of each parameter group) are
unpickled by :class:`LoadPlanner` without ``torch.load`` for the same reason,
within the restore's :class:`~elastic.checkpoint.trust.LoadPolicy`. An item
is checked whole also when resharding places only part of it (the view reads
the rest for the CRC-32), so every item a restore uses is checked, by the rank
that reads it; items no rank reads are not.

The hooks are DCP's ``FileSystemBase`` (``create_stream``, ``rename``) through
the writer's and reader's ``fs`` attribute, and ``FileSystemReader._slice_file``
(where DCP turns an item's storage info into a stream over its bytes). Should a
future DCP read without ``_slice_file``, :meth:`VerifyingReader.read_data` sees
that items were read unchecked and fails the load rather than trust them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import io
import os
import pathlib
import pickle
import sys
import threading
from typing import Any, Iterator, Mapping, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import layout, trust
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
    written through it (by name), from any of DCP's writer threads; what it
    creates gets exactly ``dir_mode`` (directories) or its file mode, whatever
    the umask (DCP's own opens with the umask's mode)."""

    def __init__(self, dir_mode: int = layout.DIR_MODE) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.segments: dict[str, list[tuple[int, int, int]]] = {}
        self.dir_mode = dir_mode

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        with open(layout.open_new(os.fspath(path), layout.file_mode(self.dir_mode)), "wb") as raw:
            stream = _ChecksummingStream(raw)
            yield stream
            segments = stream.finish()
        with self._lock:
            self.segments[os.path.basename(path)] = segments

    def mkdir(self, path: Any) -> None:
        if os.path.isdir(path):  # the checkpointer's temporary directory: made already
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        try:
            layout.make_dir(os.fspath(path), self.dir_mode)
        except FileExistsError:
            pass

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            segments = self.segments.pop(os.path.basename(path), None)
            if segments is not None:
                self.segments[os.path.basename(new_path)] = segments


class ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, fsynced, never over an existing
    checkpoint) that computes its files' CRC-32s as it writes them, and creates
    them with the file mode of directory mode ``mode`` (0o600 for 0o700)."""

    def __init__(self, path: str, mode: int = layout.DIR_MODE):
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self.fs = _ChecksummingFileSystem(mode)
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


class VerifyingView(io.RawIOBase):
    """One item's byte range of an open file, for ``torch.load``; checks what it
    serves against the item's CRC-32 (see the module docstring).

    Positions are relative to the item. ``[0, _verified)`` has gone into
    ``_crc``; large reads are folded in where they land, and everything before
    them is read again (``_advance``) and compared with the small reads kept."""

    def __init__(self, fd: int, path: str, item: layout.ItemDigest, checked: bool = True):
        super().__init__()
        self._fd = fd
        self.path = path
        self.item = item
        self.checked = checked  # False: serves the bytes and checks nothing (sizes-only restore)
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
        if self.checked:
            self._consumed(self._pos, view[:got])
        self._pos += got
        return got

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self.item.length - self._pos)
        wanted = left if size is None or size < 0 else min(size, left)
        if wanted == 0:
            return b""
        data = os.pread(self._fd, wanted, self.item.offset + self._pos)
        if not self.checked:
            pass
        elif self._pos == 0 and len(data) == self.item.length:
            # The whole item at once (DCP reads a pickled object so): checked before
            # anyone unpickles it.
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

    def describe(self) -> "_Saved | None":
        """The one plain tensor ``torch.save`` wrote into this item, as its
        description (see :class:`_Saved`), from the item's zip directory and
        pickle: a few small reads, checked as any others are. None when the
        item is anything else or does not parse (``torch.load`` then reads it
        and says what is wrong); the pickle is read by :class:`TensorUnpickler`,
        which runs no code of the file's choosing, as the bytes are not yet
        verified."""
        try:
            self.seek(0)
            archive = compat.zip_archive(self)
            if archive is None:
                return None
            call = TensorUnpickler(io.BytesIO(archive.get_record("data.pkl"))).load()
            if not (type(call) is _RebuildTensor and type(call.storage) is _StorageRef
                    and not call.backward_hooks and not call.metadata):
                return None
            storage = call.storage
            nbytes = storage.numel * storage.dtype.itemsize
            tensor = torch.empty(0, dtype=storage.dtype, device="meta").set_(
                torch.UntypedStorage(nbytes, device="meta"), call.storage_offset,
                call.size, call.stride)
            offset = archive.get_record_offset(f"data/{storage.key}")
            order = (archive.get_record("byteorder").decode("ascii", "replace")
                     if archive.has_record("byteorder") else None)
        except Exception:  # noqa: BLE001 - any surprise: torch.load's way, which names it
            return None
        finally:
            self.seek(0)
        if not (isinstance(offset, int) and 0 <= offset <= self.item.length - nbytes):
            return None
        return _Saved(tensor, offset, nbytes, order)

    def fill(self, start: int, buffer: Any) -> None:
        """Read the item's bytes ``[start, start + len(buffer))`` into ``buffer``
        (a tensor's memory), a chunk at a time, each folded into the CRC-32 while
        it is still in the CPU's cache. Raises EOFError when the item is shorter."""
        view = memoryview(buffer).cast("B")
        position, end = 0, len(view)
        while position < end:
            size = min(_CHUNK, end - position)
            if end - position - size < _LARGE_READ:
                size = end - position  # no small tail: it would be kept and read again
            self.seek(start + position)
            got = self.readinto(view[position:position + size])
            if got <= 0:
                raise EOFError(f"{self.path}: the item ends {start + position} bytes in, "
                               f"inside a tensor's data")
            position += got

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
            if offset >= end or offset + len(piece) <= start:
                continue
            low, high = max(start, offset), min(end, offset + len(piece))
            if low < high:
                if data[low - start:high - start] != piece[low - offset:high - offset]:
                    raise _Changed(f"bytes {self.item.offset + low}..{self.item.offset + high} "
                                   f"differ between two reads")
                kept[2] += high - low

    def finish(self) -> layout.Problem | None:
        """The item's verdict: None when what was served matches its CRC-32 (or
        the view checks nothing)."""
        if not self.checked:
            return None
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
        if name == layout.METADATA_FILE and reader.checksums:
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
    With ``checksums=False`` (a sizes-only restore) it checks no bytes, only
    that DCP opens no file the manifests do not list, and still reads tensors
    straight into their places. ``policy`` says what its pickles may hold
    (:mod:`elastic.checkpoint.trust`): ``.metadata`` and, through
    :class:`LoadPlanner`, DCP's objects.
    A mismatch is appended to :attr:`problems` (naming the file and the item)
    and fails the load with :class:`CheckpointCorruptError`, which DCP passes
    on to every rank. :attr:`items_checked` counts the items checked, and
    :attr:`items_reread` those whose reads forced a second read of the item,
    :attr:`tensors_in_place` the tensors read straight into the state dict's
    tensors (the rest are loaded and copied, as DCP does), and
    :attr:`tensors_on_device` those of them on a CUDA device (read into
    page-locked memory and copied asynchronously). :attr:`refusal` is the
    CheckpointError of a ``.metadata`` refused by the policy (DCP reports it
    wrapped in the failure of its per-rank fallback).
    """

    def __init__(self, path: str, files: Mapping[str, layout.FileDigest], *,
                 checksums: bool = True, policy: trust.LoadPolicy = trust.DEFAULT_POLICY):
        super().__init__(path)
        self.fs = _VerifyingFileSystem(self)
        self.directory = os.path.abspath(path)
        self.files = files
        self.checksums = checksums
        self.policy = policy
        self.refusal: CheckpointError | None = None  # .metadata's, when refused
        self.problems: list[layout.Problem] = []
        self.items_checked = 0
        self.items_reread = 0
        self._items = {name: {item.offset: item for item in digest.items}
                       for name, digest in files.items() if digest.items is not None}
        self._open: dict[int, list[VerifyingView]] = {}
        self._sliced = 0
        self.tensors_in_place = 0
        self.tensors_on_device = 0  # of those, the ones read into CUDA memory

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
        """DCP's ``.metadata``, checked against the manifests (unless sizes only)
        and unpickled within :attr:`policy` (DCP's own reader unpickles it with
        ``pickle.load``, which runs whatever the file says). Raises
        CheckpointError for a type outside the allow-list."""
        if kwargs.get("rank") is not None:
            # DCP's fallback after the global .metadata failed: we write no per-rank one.
            raise FileNotFoundError("this checkpoint has no per-rank DCP metadata")
        path = os.path.join(self.directory, layout.METADATA_FILE)
        with self.fs.create_stream(pathlib.Path(path), "rb") as stream:  # 2.6 wants a Path
            data = stream.read()
        try:
            metadata = trust.load_metadata(data, self.policy, path)
        except CheckpointError as exc:
            self.refusal = exc  # DCP buries it under its fallback's failure: said plainly
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:  # compat.SLICE_FILE_HOOK
        self._sliced += 1
        path = os.path.join(self.directory, sinfo.relative_path)
        if not self.checksums:
            return VerifyingView(file.fileno(), path,
                                  layout.ItemDigest(sinfo.offset, sinfo.length, ""), checked=False)
        items = self._items.get(sinfo.relative_path)
        if items is None:
            return super()._slice_file(file, sinfo)
        item = items.get(sinfo.offset)
        if item is None or item.length != sinfo.length:
            raise self.fail(layout.Problem(path, f"DCP's .metadata locates an item at bytes "
                                                 f"{sinfo.offset}..{sinfo.offset + sinfo.length}"
                                                 f", which the manifest does not list"))
        view = VerifyingView(file.fileno(), path, item)
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
        """DCP's read, with each tensor read straight into its place (see
        :func:`load_tensor`), then a check that every item went through
        :meth:`_slice_file`. Raises CheckpointError when one did not (a DCP that
        reads around the checks)."""
        before = self._sliced
        if any(getattr(self.storage_data[item.storage_index], "transform_descriptors", None)
               for item in plan.items):
            future = super().read_data(plan, planner)  # DCP's extensions (e.g. compression)
        else:
            future = self._read_items(plan, planner)
        if self._sliced - before != len(plan.items):
            raise CheckpointError(
                f"DCP read {len(plan.items)} item(s) from {self.directory}, "
                f"{self._sliced - before} through the verifying reader: this version of "
                f"torch reads around the checks, so nothing vouches for what it loaded")
        return future

    def _read_items(self, plan: Any, planner: Any) -> Future:
        """DCP's ``FileSystemReader.read_data`` (files opened through ``fs``, items
        cut by ``_slice_file``, the planner's ``load_bytes``, ``resolve_tensor`` and
        ``commit_tensor``), except that a tensor lands in its place directly."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            path = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(path, []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path),
                                       "rb") as stream:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    piece = self._slice_file(stream, info)
                    if item.type == LoadItemType.BYTE_IO:
                        # Its length, as DCP reads it: 2.6's own slice does not end there.
                        planner.load_bytes(item, io.BytesIO(piece.read(info.length)))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    if load_tensor(piece, item, target):
                        self.tensors_in_place += 1
                        self.tensors_on_device += target.is_cuda
                    planner.commit_tensor(item, target)
        if self.tensors_on_device:
            torch.cuda.synchronize()  # the copies of _fill_device, before DCP moves on
        future: Future = Future()
        future.set_result(None)
        return future


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a saved chunk a read item wants (what DCP's reader narrows to)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def load_tensor(piece: Any, item: Any, target: torch.Tensor) -> bool:
    """Put the tensor saved in ``piece`` (one item, a ``torch.save`` zip),
    narrowed as ``item`` says, into ``target``; True when its bytes went there
    directly.

    DCP's reader lets ``torch.load`` allocate the tensor, reads the item into it
    and copies it into the target: three passes over the bytes, the first into
    freshly faulted-in memory. Here the item's description
    (:meth:`VerifyingView.describe`: dtype, shape, strides, where the
    storage's bytes lie in the item, byte order) says where the wanted part
    lies, and its bytes go straight from the file into the target's memory,
    through the view's CRC-32 (:meth:`VerifyingView.fill`); the target's
    in-place counter is bumped as ``copy_`` would. Anything that cannot be put
    in place so (a target that is not contiguous CPU or CUDA memory of the same
    dtype, a part of the saved tensor that is not one block, a file written with
    another byte order, an item that is not one plain tensor, an item read
    without a verifying view) goes DCP's way.
    """
    if (isinstance(piece, VerifyingView) and target.device.type in ("cpu", "cuda")
            and target.is_contiguous()):
        saved = piece.describe()
        if saved is not None and saved.byte_order == sys.byteorder:
            part = _narrow(saved.tensor, item.storage_offsets, item.lengths)
            nbytes = part.numel() * part.element_size()
            start = part.storage_offset() * part.element_size()
            # A meta tensor is not checked against its storage's size: this is.
            if (part.is_contiguous() and part.dtype == target.dtype
                    and part.shape == target.shape and 0 <= start <= saved.nbytes - nbytes):
                if nbytes and target.is_cuda:
                    _fill_device(piece, saved.offset + start, nbytes, target)
                elif nbytes:
                    piece.fill(saved.offset + start,
                               (ctypes.c_char * nbytes).from_address(target.data_ptr()))
                    torch.autograd.graph.increment_version(target)
                return True
    tensor = _narrow(torch.load(piece, map_location="cpu", weights_only=True),
                     item.storage_offsets, item.lengths)
    if target.size() != tensor.size():
        raise CheckpointError(f"item {item.storage_index} has shape {tuple(tensor.size())}, "
                              f"its place in the state dict {tuple(target.size())}")
    target.copy_(tensor)
    return False


def _fill_device(piece: "VerifyingView", start: int, nbytes: int, target: torch.Tensor) -> None:
    """Read an item's bytes into page-locked memory, through the CRC-32, and copy them
    to the CUDA ``target`` asynchronously on its current stream (torch's pinned
    allocator keeps the buffer until the copy is done); the reader synchronizes
    once at the end of the load."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    piece.fill(start, (ctypes.c_char * nbytes).from_address(host.data_ptr()))
    with torch.no_grad():
        target.reshape(-1).view(torch.uint8).copy_(host, non_blocking=True)


# --- what torch.save wrote ------------------------------------------------------------------


class _Saved(NamedTuple):
    """One plain tensor as ``torch.save`` recorded it in an item."""

    tensor: torch.Tensor      # on the meta device: dtype, shape, strides, storage offset
    offset: int               # where its storage's bytes begin in the item
    nbytes: int               # its storage's size, which lies inside the item
    byte_order: str | None    # as recorded ("little", "big"), None when not


class _StorageRef(NamedTuple):
    dtype: torch.dtype
    key: str
    numel: int


class _RebuildTensor(NamedTuple):
    """The arguments of ``torch._utils._rebuild_tensor_v2``, recorded, not called."""

    storage: Any
    storage_offset: int
    size: tuple
    stride: tuple
    requires_grad: bool
    backward_hooks: Any
    metadata: Any = None


class _StorageType(NamedTuple):
    dtype: torch.dtype


@functools.cache
def _storage_types() -> dict[str, _StorageType]:
    """``torch.FloatStorage`` and its kin by name (what ``torch.save`` pickles as a
    storage's type), for the dtypes a plain tensor may have."""
    names = compat.storage_type_names()  # empty on another torch: torch.load's way
    # Quantized tensors (QInt8Storage...) are rebuilt by another function.
    return {name: _StorageType(dtype) for dtype, name in names.items()
            if not name.startswith("Q")}


class NotPlain(Exception):
    """The pickle holds more than one plain tensor."""


class TensorUnpickler(pickle.Unpickler):
    """Unpickles what ``torch.save`` writes for one plain tensor, and nothing else.

    The only things its globals resolve to are records (:class:`_RebuildTensor`,
    :class:`_StorageType`) and an empty ``OrderedDict`` (the backward hooks), so
    no code of the file's choosing runs: it may read bytes not yet verified
    (what ``torch.load(weights_only=True)`` would, at a tenth of the cost of its
    unpickler written in Python). Anything else raises NotPlain.
    """

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _RebuildTensor
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name in _storage_types():
            return _storage_types()[name]
        raise NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        # ("storage", storage type, key, location, number of elements)
        if (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and type(pid[1]) is _StorageType and type(pid[2]) is str
                and type(pid[4]) is int and pid[4] >= 0):
            return _StorageRef(pid[1].dtype, pid[2], pid[4])
        raise NotPlain("a persistent id that is not a storage")


# --- objects --------------------------------------------------------------------------------


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, unpickling DCP's objects (``BYTE_IO`` items:
    e.g. an optimizer's hyperparameters, one item each) within ``policy`` (no
    code of the checkpoint's choosing runs; :mod:`elastic.checkpoint.trust`) and
    without ``torch.load``'s fixed cost per call where it is not needed
    (:func:`load_object`)."""

    def __init__(self, *args: Any, policy: trust.LoadPolicy = trust.DEFAULT_POLICY,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.policy = policy

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_object(value, self.policy, f"DCP's object {fqn!r}")
        if not (hasattr(self, "original_state_dict") and hasattr(self, "mappings")):
            # Another torch: its own way, which unpickles with weights_only=False, so it
            # gets the object checked above, pickled again (nothing but allowed types).
            again = io.BytesIO()
            torch.save(obj, again)
            again.seek(0)
            return super().load_bytes(read_item, again)
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _set_element(root: Any, path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` (dict keys and list indices) in a nested state dict,
    making the dicts and lists on the way (a flattened key's place in the original)."""
    container = root
    for key, following in zip(path, path[1:]):
        empty: Any = {} if isinstance(following, str) else []
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
        else:
            container = container.setdefault(key, empty)
    last = path[-1]
    if isinstance(container, list):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


def load_object(value: io.BytesIO, policy: trust.LoadPolicy = trust.DEFAULT_POLICY,
                what: str = "a DCP object") -> Any:
    """What ``torch.load`` returns for one of DCP's pickled objects (a
    ``torch.save`` zip), within ``policy`` (:func:`elastic.checkpoint.trust.load_object`).
    Its bytes were checked before this unless the restore checks sizes only."""
    return trust.load_object(value.getvalue(), policy, what)
