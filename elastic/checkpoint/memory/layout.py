"""The memory tier's files: a node's memory directory, its slots, and their manifests.

No torch here: the agent (which owns the directory, replicates it and frees
it) and the workers (which write and restore snapshots) both read it.

A node's memory directory (``$ELASTIC_MEMORY_DIR``, created by the node's
agent on a tmpfs, ``/dev/shm`` by default) holds::

    own/<slot>/                     snapshots this node's workers wrote
    replicas/<source node id>/<slot>/   snapshots a buddy node replicated here

A slot is named ``round-<round:010d>.rank-<rank:06d>.slot-<0|1>``: the round
the snapshot was taken in (its fencing token), the writer's global rank in
that round, and which of the writer's two alternating slots it is. A slot
directory holds the files its manifest lists (``data.bin``: every tensor's
bytes; ``objects.pt`` and ``local.pt``: torch-saved non-tensor values and the
rank's own state) and ``manifest.json``.

The slot protocol (every writer, workers and replication alike):

1. :func:`begin_write` removes ``manifest.json``: from here on the slot is
   incomplete, so no reader takes it while its files change;
2. the writer (re)writes the files;
3. :func:`finish_write` writes ``manifest.json`` through a temporary file and
   a rename: the slot is complete again, with its new content.

A slot is complete exactly when its manifest parses and every file it lists
has the listed size (:func:`read_slot`). A reader that copies a slot (the
replicator, a restore sending it to a peer) checks :func:`still_same` after
the copy and drops the copy when the manifest changed or vanished meanwhile:
the writer removes the manifest before it touches a file, so an unchanged
manifest means the bytes copied were the ones it vouches for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterator

from elastic.errors import ConfigError
from elastic.records import cap_text, validate_id

FORMAT = 1
OWN = "own"
REPLICAS = "replicas"
MANIFEST = "manifest.json"
DATA = "data.bin"
OBJECTS = "objects.pt"
LOCAL = "local.pt"
SLOTS_PER_RANK = 2
# A manifest lists every tensor of one rank's state; far more than a real model's.
MAX_MANIFEST_BYTES = 64 << 20
MAX_WORLD_SIZE = 1 << 20
DIR_MODE = 0o700
FILE_MODE = 0o600

_MAX_INT64 = 2**63 - 1
_SLOT = re.compile(r"round-(\d{10})\.rank-(\d{6})\.slot-([01])")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_DTYPE = re.compile(r"[a-z0-9_]{1,32}")


@dataclasses.dataclass(frozen=True, order=True)
class SlotKey:
    """Which snapshot slot: the round it was taken in, the writer's rank, slot 0 or 1."""

    round: int
    rank: int
    slot: int

    @property
    def name(self) -> str:
        return f"round-{self.round:010d}.rank-{self.rank:06d}.slot-{self.slot}"


def parse_slot_name(name: str) -> SlotKey | None:
    """The key a slot directory's name encodes, or None for any other name."""
    match = _SLOT.fullmatch(name)
    if match is None:
        return None
    return SlotKey(int(match.group(1)), int(match.group(2)), int(match.group(3)))


def own_dir(memory_dir: str) -> str:
    return os.path.join(memory_dir, OWN)


def replica_dir(memory_dir: str, source_node_id: str) -> str:
    """Where replicas of node ``source_node_id``'s snapshots live; raises ConfigError
    for a node id that is not a valid id (it becomes a path component)."""
    return os.path.join(memory_dir, REPLICAS, validate_id("node id", source_node_id))


@dataclasses.dataclass(frozen=True)
class TensorItem:
    """One tensor (or one shard of it) in ``data.bin``.

    ``fqn`` is its state-dict key (``model.<fqn>``, ``optim.state.<fqn>.<name>``);
    ``global_shape`` the whole tensor's shape; ``offsets`` and ``shape`` where this
    chunk sits in it and its size (the whole tensor for a replicated one);
    ``offset`` and ``nbytes`` where its bytes lie in ``data.bin`` (contiguous,
    row-major); ``dtype`` torch's name without the prefix (``float32``).
    """

    fqn: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_record(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "dtype": self.dtype, "global_shape": list(self.global_shape),
                "offsets": list(self.offsets), "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_record(cls, record: object) -> "TensorItem":
        """Raises ValueError naming what is wrong."""
        if not isinstance(record, dict):
            raise ValueError(f"a tensor item is {_shown(record)}, not an object")
        fqn = record.get("fqn")
        if not isinstance(fqn, str) or not fqn or len(fqn) > 4096:
            raise ValueError(f"a tensor item's fqn is {_shown(fqn)}")
        dtype = record.get("dtype")
        if not isinstance(dtype, str) or not _DTYPE.fullmatch(dtype):
            raise ValueError(f"tensor {fqn}: dtype {_shown(dtype)}")
        global_shape = _dims(record, "global_shape", fqn)
        offsets, shape = _dims(record, "offsets", fqn), _dims(record, "shape", fqn)
        if not len(global_shape) == len(offsets) == len(shape):
            raise ValueError(f"tensor {fqn}: global_shape, offsets and shape differ in length")
        if any(o + s > g for o, s, g in zip(offsets, shape, global_shape)):
            raise ValueError(f"tensor {fqn}: the chunk lies outside the tensor")
        return cls(fqn, dtype, global_shape, offsets, shape, _int(record, "offset", 0, _MAX_INT64),
                   _int(record, "nbytes", 0, _MAX_INT64))


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What one slot holds: one rank's state as of ``step`` in ``round``.

    ``files`` maps each file of the slot to its size in bytes; ``tensors`` lie in
    ``data.bin``; ``objects`` names the state-dict keys whose values are not
    tensors (kept in ``objects.pt``). ``node_id`` is the node whose worker wrote
    it (a replica keeps its writer's). ``written_at`` is the writer's wall time.
    """

    job_id: str
    node_id: str
    round: int
    step: int
    rank: int
    world_size: int
    files: dict[str, int]
    tensors: tuple[TensorItem, ...] = ()
    objects: tuple[str, ...] = ()
    written_at: float = 0.0

    @property
    def nbytes(self) -> int:
        """The slot's bytes, manifest aside."""
        return sum(self.files.values())

    def to_json(self) -> bytes:
        return ManifestTemplate(self).render(self.step, self.files, self.written_at)

    @classmethod
    def from_json(cls, data: bytes, *, tensors: bool = True) -> "Manifest":
        """Raises ValueError naming what is wrong: not a JSON object of format
        FORMAT, an id that is not a valid id, a number out of range (``rank``
        below ``world_size``), a file name that is not a plain name, a tensor
        item that is malformed or lies outside ``data.bin``. Without
        ``tensors`` the tensor items are neither read nor checked (the
        manifest's ``tensors`` is empty): for a listing that only chooses."""
        try:
            record = json.loads(data)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if not isinstance(record, dict):
            raise ValueError(f"not a JSON object but a {type(record).__name__}")
        if record.get("format") != FORMAT:
            raise ValueError(f"unknown memory snapshot format {_shown(record.get('format'))}")
        world_size = _int(record, "world_size", 1, MAX_WORLD_SIZE)
        files = _files(record.get("files"))
        records = record.get("tensors", [])
        objects = record.get("objects", [])
        if not isinstance(records, list) or not isinstance(objects, list):
            raise ValueError("'tensors' and 'objects' must be lists")
        items = tuple(TensorItem.from_record(t) for t in records) if tensors else ()
        data_size = files.get(DATA, 0)
        if any(t.offset + t.nbytes > data_size for t in items):
            raise ValueError(f"a tensor's bytes lie outside {DATA} ({data_size} bytes)")
        if not all(isinstance(o, str) and o for o in objects):
            raise ValueError("'objects' must be non-empty strings")
        written_at = record.get("written_at", 0.0)
        if isinstance(written_at, bool) or not isinstance(written_at, (int, float)):
            raise ValueError(f"field 'written_at' is {_shown(written_at)}")
        try:
            job_id = validate_id("job id", record.get("job_id"))
            node_id = validate_id("node id", record.get("node_id"))
        except ConfigError as exc:  # a record is input here, not configuration
            raise ValueError(str(exc)) from None
        return cls(job_id=job_id, node_id=node_id, round=_int(record, "round", 0, _MAX_INT64),
                   step=_int(record, "step", 0, _MAX_INT64),
                   rank=_int(record, "rank", 0, world_size - 1), world_size=world_size,
                   files=files, tensors=items, objects=tuple(objects),
                   written_at=float(written_at))


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """A complete slot found on this node.

    ``holder`` is ``OWN`` for this node's own snapshots, else the node id of the
    replica's source. ``stamp`` identifies the manifest file read (device,
    inode, modification time, size) for :func:`still_same`. A slot listed
    without its tensor items (``read_slot(..., tensors=False)``) has an empty
    ``manifest.tensors``: :func:`with_tensors` reads them.
    """

    path: str
    key: SlotKey
    manifest: Manifest
    holder: str
    stamp: tuple[int, int, int, int]


class ManifestTemplate:
    """The JSON of the manifests that differ from ``head`` only in ``step``, the
    files' sizes (the same names) and ``written_at``: a writer's successive
    snapshots of one layout. The rest (the ids, the tensor list, the objects'
    names) is serialized once, here; ``tensors_json`` is the tensor list's
    JSON when the caller has it already (``head.tensors`` is then not read)."""

    def __init__(self, head: Manifest, tensors_json: bytes | None = None):
        if tensors_json is None:
            tensors_json = _json([t.to_record() for t in head.tensors])
        self.names = tuple(sorted(head.files))
        self._names = set(self.names)
        ids = _json({"format": FORMAT, "job_id": head.job_id, "node_id": head.node_id,
                     "round": head.round})
        self._start = ids[:-1] + b',"step":'
        self._head = b',"rank":%d,"world_size":%d,"files":{' % (head.rank, head.world_size)
        self._keys = tuple((b"," if i else b"") + _json(name) + b":"
                           for i, name in enumerate(self.names))
        self._end = (b'},"tensors":' + tensors_json + b',"objects":' + _json(list(head.objects))
                     + b',"written_at":')

    def render(self, step: int, files: dict[str, int], written_at: float) -> bytes:
        """The manifest's JSON. Raises ValueError for files of other names."""
        if files.keys() != self._names:
            raise ValueError(f"files {sorted(files)} are not the template's {list(self.names)}")
        parts = [self._start, b"%d" % step, self._head]
        for key, name in zip(self._keys, self.names):
            parts += (key, b"%d" % files[name])
        # A number's JSON is the same with json's default separators, whose encoder
        # json.dumps keeps (other separators make a new encoder per call).
        parts += (self._end, json.dumps(written_at).encode(), b"}")
        return b"".join(parts)


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def begin_write(slot_dir: str, *, made: bool = False) -> None:
    """Make the slot incomplete before its files change, creating its directory
    unless ``made`` (the caller made it and has written into it since)."""
    if not made:
        os.makedirs(slot_dir, mode=DIR_MODE, exist_ok=True)
    try:
        os.unlink(os.path.join(slot_dir, MANIFEST))
    except FileNotFoundError:
        pass


def finish_write(slot_dir: str, manifest: Manifest | bytes) -> None:
    """Make the slot complete with ``manifest`` (temporary file, then rename);
    ``bytes``: a manifest's JSON already serialized (a writer that reuses its
    tensor list's). No fsync: the memory tier lives on a tmpfs and dies with
    the machine."""
    tmp = os.path.join(slot_dir, f".{MANIFEST}.tmp-{os.getpid()}")
    write_file(tmp, manifest if isinstance(manifest, bytes) else manifest.to_json())
    os.replace(tmp, os.path.join(slot_dir, MANIFEST))


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` as the whole of ``path`` (created private, truncated; a
    link at ``path`` is refused). Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def read_slot(slot_dir: str, holder: str = OWN, *, tensors: bool = True) -> SlotInfo | None:
    """The slot at ``slot_dir`` if it is complete (its name parses, its manifest
    parses and agrees with the name, every listed file has its size), else None.
    Never raises for what a slot holds: an incomplete or damaged slot is one
    nobody may use. Without ``tensors``, the manifest's tensor items are
    skipped (see :meth:`Manifest.from_json`)."""
    key = parse_slot_name(os.path.basename(slot_dir))
    if key is None:
        return None
    path = os.path.join(slot_dir, MANIFEST)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            return None
        manifest = Manifest.from_json(data, tensors=tensors)
    except (OSError, ValueError):
        return None
    if (manifest.round, manifest.rank) != (key.round, key.rank):
        return None
    for name, size in manifest.files.items():
        try:
            if os.lstat(os.path.join(slot_dir, name)).st_size != size:
                return None
        except OSError:
            return None
    return SlotInfo(slot_dir, key, manifest, holder,
                    (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))


def with_tensors(info: SlotInfo) -> SlotInfo | None:
    """``info`` read again in full (tensor items too), or None when the slot is
    no longer complete, its manifest is no longer the one ``info`` was read
    from, or its tensor items are damaged."""
    full = read_slot(info.path, info.holder)
    if full is None or full.stamp != info.stamp:
        return None
    return full


def still_same(info: SlotInfo) -> bool:
    """Whether the slot's manifest is still the one ``info`` was read from."""
    try:
        st = os.lstat(os.path.join(info.path, MANIFEST))
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size) == info.stamp


def list_slots(memory_dir: str, *, tensors: bool = True) -> list[SlotInfo]:
    """Every complete slot in a node's memory directory, own and replicas
    (without ``tensors``: see :func:`read_slot`)."""
    found = [s for s in _slots_in(own_dir(memory_dir), OWN, tensors)]
    replicas = os.path.join(memory_dir, REPLICAS)
    for source in names_in(replicas):
        found.extend(_slots_in(os.path.join(replicas, source), source, tensors))
    return found


def _slots_in(directory: str, holder: str, tensors: bool) -> Iterator[SlotInfo]:
    for name in names_in(directory):
        info = read_slot(os.path.join(directory, name), holder, tensors=tensors)
        if info is not None:
            yield info


def names_in(directory: str) -> list[str]:
    """The names in ``directory``, sorted; none when it is missing or no directory."""
    try:
        return sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _files(files: object) -> dict[str, int]:
    if not isinstance(files, dict):
        raise ValueError(f"field 'files' is {_shown(files)}, not an object")
    out = {}
    for name, size in files.items():
        if not _FILE.fullmatch(name) or name == MANIFEST:
            raise ValueError(f"file name {_shown(name)} is not a plain name inside the slot")
        if type(size) is not int or not 0 <= size <= _MAX_INT64:
            raise ValueError(f"the size of {name} is {_shown(size)}")
        out[name] = size
    return out


def _dims(record: dict, name: str, fqn: str) -> tuple[int, ...]:
    value = record.get(name)
    if not isinstance(value, list) or len(value) > 64 or not all(
            type(v) is int and 0 <= v <= _MAX_INT64 for v in value):
        raise ValueError(f"tensor {fqn}: {name} is {_shown(value)}")
    return tuple(value)


def _int(record: dict, name: str, low: int, high: int) -> int:
    value = record.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"field {name!r} is {_shown(value)}, expected an integer {low}..{high}")
    return value


def _shown(value: object) -> str:
    return cap_text(repr(value), 80)
