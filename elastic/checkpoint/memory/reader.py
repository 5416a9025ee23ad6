"""A DCP storage reader over memory snapshots: restore, resharded or not, from host memory.

Every rank of the old world wrote one slot (:mod:`elastic.checkpoint.memory.layout`):
its shard of every tensor in ``data.bin`` (listed by the manifest's
:class:`~elastic.checkpoint.memory.layout.TensorItem`\\ s) and its non-tensor
values in ``objects.pt``. :class:`MemoryStorageReader` presents the slots of all
old ranks as one DCP checkpoint, so ``dcp.load`` at any new world size (and any
new sharding) plans and copies exactly as it does from files:

* :func:`snapshot_metadata` builds DCP's ``Metadata`` from the manifests of all
  old ranks: per tensor, its dtype, its global size and the union of the
  distinct chunks (a chunk that several ranks hold, a replicated tensor under
  DDP or a scalar such as Adam's ``step``, appears once); per non-tensor value a
  ``BytesStorageMetadata``. Its ``storage_data`` maps each chunk's
  ``MetadataIndex`` to the :class:`Holder`\\ s that hold a copy.
* The reader serves each of DCP's read items from a holder whose data is in this
  process, with one copy: from a slot file on this node straight into the
  destination (:mod:`.slotfile`, batched, the files of every rank read together
  by ``threads`` threads), else from a view of the slot's buffer (no copy until
  DCP's destination takes the wanted part).
* :func:`needed_ranks` says, before any data moves, which old ranks' slots a
  load reads, so a restoring rank fetches from peers only those.

A load through this reader needs no global plan (DCP's default planner reads
each rank's own chunks; nothing is coordinated), so each rank may load alone:
:class:`PlannedLoad` plans once (the plan that says which slots to fetch is the
one the load then reads by), with no collective, through the planner's public
calls in ``dcp.load``'s order (this reader's own plan hooks change nothing);
``dcp.load`` with this reader works too. A rank that fails then fails alone,
and the caller gathers outcomes.

The contract for ``objects.pt`` (the writer's side): ``torch.save`` of one dict
from each state-dict key the manifest lists in ``objects`` (the flattened key,
as for tensors: ``optim.param_groups.<fqn>.lr``) to its value. It is read
through :mod:`elastic.checkpoint.trust`'s allow-list: restore never runs code.

Values of the same key held by several ranks are taken to be equal (they are
copies of one replicated value); the reader takes any present one.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from typing import Any, Collection, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from elastic.checkpoint import trust
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.slotfile import SlotFile, fillable, read_files
from elastic.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class SlotData:
    """One old rank's snapshot as this process sees it.

    ``manifest``: always (every rank knows every manifest). ``data``: the bytes of
    ``data.bin``, or None when this process does not hold them (a peer's slot not
    fetched). Accepted: a :class:`~.slotfile.SlotFile` (read straight into the
    destinations), anything with the buffer protocol (``bytes``,
    ``bytearray``, ``memoryview``, ``mmap.mmap``, read-only ones included) or a
    1-D contiguous CPU ``torch.uint8`` tensor (e.g. ``torch.from_file(path,
    shared=True, size=n, dtype=torch.uint8)``). The reader never writes into it
    and keeps views of it only while a load runs. ``objects``: the bytes of
    ``objects.pt``; ``b""`` when the manifest lists no objects or the data is absent.
    """

    manifest: layout.Manifest
    data: Any = None
    objects: bytes = b""

    @property
    def present(self) -> bool:
        return self.data is not None


class Holder(NamedTuple):
    """Where one chunk lies: the old rank holding it and, for a tensor, its item
    in that rank's ``data.bin`` (None for a non-tensor value, kept in ``objects.pt``)."""

    rank: int
    item: layout.TensorItem | None


def load_objects(data: bytes, policy: trust.LoadPolicy = trust.DEFAULT_POLICY,
                 what: str = layout.OBJECTS) -> dict[str, Any]:
    """The ``{state-dict key: value}`` dict in ``objects.pt``'s bytes (``what``
    names the file in errors), unpickled within ``policy``'s allow-list.

    Raises CheckpointError naming a type outside the allow-list (nothing of it
    runs), or when the file does not hold such a dict; what ``torch.load``
    raises for bytes that are not a ``torch.save`` file."""
    if not data:
        return {}
    found = trust.load_object(data, policy, what)
    if not isinstance(found, dict) or not all(isinstance(key, str) for key in found):
        raise CheckpointError(f"{what} holds a {type(found).__name__}, not a dict from "
                              f"state-dict keys to values")
    return found


def put_objects(state_dict: dict[str, Any], objects: Mapping[str, Any]) -> None:
    """Set each non-tensor value of a checkpoint state dict (``{"model": {...},
    "optim": {...}}``) that ``objects`` holds under its flattened key
    (``<group>.<key>``, the slot's and DCP's name for it)."""
    for group, values in state_dict.items():
        if isinstance(values, dict):
            for key in values:
                found = objects.get(f"{group}.{key}", _ABSENT)
                if found is not _ABSENT:
                    values[key] = found
        elif group in objects:
            state_dict[group] = objects[group]


_ABSENT = object()


# --- metadata -------------------------------------------------------------------------------


def snapshot_metadata(manifests: Mapping[int, layout.Manifest]) -> Metadata:
    """DCP's ``Metadata`` of the snapshot the manifests (one per old rank, keyed by
    rank) describe together; ``storage_data`` maps each chunk's ``MetadataIndex`` to
    a tuple of :class:`Holder`.

    Raises CheckpointError when the manifests are not one snapshot (another job,
    round, step or world size; a rank missing or keyed wrongly), or disagree on
    a tensor (dtype, global size, a chunk whose byte count does not match its
    shape, a key that is a tensor on one rank and an object on another)."""
    ordered = _one_snapshot(manifests)
    tensors: dict[str, dict[tuple, list[Holder]]] = {}
    objects: dict[str, list[Holder]] = {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for manifest in ordered:
        for item in manifest.tensors:
            _check_item(item, shapes.setdefault(item.fqn, (item.dtype, item.global_shape)))
            chunk = (item.offsets, item.shape)
            tensors.setdefault(item.fqn, {}).setdefault(chunk, []).append(
                Holder(manifest.rank, item))
        for key in manifest.objects:
            objects.setdefault(key, []).append(Holder(manifest.rank, None))
    both = sorted(tensors.keys() & objects.keys())
    if both:
        raise CheckpointError(f"the memory snapshot holds {both[0]!r} as a tensor on some "
                              f"ranks and as an object on others")
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, tuple[Holder, ...]] = {}
    for fqn, chunks in tensors.items():
        dtype_name, global_shape = shapes[fqn]
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_dtype(dtype_name, fqn)),
            size=torch.Size(global_shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
                    for offsets, shape in chunks])
        for (offsets, _), holders in chunks.items():
            storage[MetadataIndex(fqn, torch.Size(offsets))] = tuple(holders)
    for key, holders in objects.items():
        state[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = tuple(holders)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def _one_snapshot(manifests: Mapping[int, layout.Manifest]) -> list[layout.Manifest]:
    """The manifests in rank order, checked to be all ranks of one snapshot."""
    if not manifests:
        raise CheckpointError("a memory snapshot needs the manifests of its ranks; none given")
    for rank, manifest in manifests.items():
        if manifest.rank != rank:
            raise CheckpointError(f"the manifest given for rank {rank} is rank "
                                  f"{manifest.rank}'s")
    ordered = [manifests[rank] for rank in sorted(manifests)]
    first = ordered[0]
    identity = (first.job_id, first.round, first.step, first.world_size)
    for manifest in ordered[1:]:
        other = (manifest.job_id, manifest.round, manifest.step, manifest.world_size)
        if other != identity:
            raise CheckpointError(
                f"the manifests are not one snapshot: rank {first.rank} has (job, round, step, "
                f"world size) {identity}, rank {manifest.rank} {other}")
    missing = sorted(set(range(first.world_size)) - set(manifests))
    if missing:
        raise CheckpointError(f"the memory snapshot of step {first.step} (round {first.round}) "
                              f"lacks the manifests of rank(s) {_ranks(missing)} of "
                              f"{first.world_size}")
    return ordered


def _check_item(item: layout.TensorItem, first_seen: tuple[str, tuple[int, ...]]) -> None:
    if (item.dtype, item.global_shape) != first_seen:
        raise CheckpointError(
            f"the memory snapshot's ranks disagree on tensor {item.fqn!r}: dtype and size "
            f"{first_seen} on one, {(item.dtype, item.global_shape)} on another")
    expected = math.prod(item.shape) * _dtype(item.dtype, item.fqn).itemsize
    if item.nbytes != expected:
        raise CheckpointError(f"tensor {item.fqn!r}: a chunk of shape {item.shape} "
                              f"({item.dtype}) has {item.nbytes} bytes, not {expected}")


def _dtype(name: str, fqn: str) -> torch.dtype:
    found = _DTYPES.get(name)
    if found is None:
        found = getattr(torch, name, None)
        if not isinstance(found, torch.dtype):
            raise CheckpointError(f"tensor {fqn!r}: {name!r} is not a torch dtype")
        _DTYPES[name] = found
    return found


_DTYPES: dict[str, torch.dtype] = {}  # a name's dtype, looked up once


def _ranks(ranks: Iterable[int]) -> str:
    shown = sorted(ranks)
    return ", ".join(map(str, shown[:8])) + (f" and {len(shown) - 8} more" if shown[8:] else "")


# --- the reader -----------------------------------------------------------------------------


class MemoryStorageReader(StorageReader):
    """DCP's ``StorageReader`` over the slots of one memory snapshot.

    ``sources`` maps every old rank to its :class:`SlotData` (the manifest
    always, the data where this process holds it). Construction checks the
    manifests (:func:`snapshot_metadata`, raising CheckpointError); a load raises
    CheckpointError for a chunk whose every holder is absent here (naming the key
    and those ranks), for a buffer shorter than its manifest says, and for an
    ``objects.pt`` outside the policy's allow-list (:func:`load_objects`).
    ``metadata``: :func:`snapshot_metadata` of these very manifests, where the
    caller built it already (:class:`PlannedLoad`); else it is built here.
    ``threads``: how many threads read slot files (:func:`.slotfile.read_files`).
    One reader serves any number of loads, one at a time.
    """

    def __init__(self, sources: Mapping[int, SlotData],
                 policy: trust.LoadPolicy = trust.DEFAULT_POLICY,
                 metadata: Metadata | None = None, threads: int = 1):
        super().__init__()
        self._sources = dict(sources)
        self._policy = policy
        self._threads = threads
        self._metadata = metadata if metadata is not None else snapshot_metadata(
            {r: s.manifest for r, s in self._sources.items()})
        self._storage: dict[MetadataIndex, tuple[Holder, ...]] = self._metadata.storage_data
        self._buffers: dict[int, torch.Tensor] = {}
        self._objects: dict[int, dict[str, Any]] = {}
        self._serialized: dict[int, bytes] = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # a memory snapshot is handed over as sources, never named by a path

    def reset(self, checkpoint_id: Any = None) -> None:
        """Forget what the last load unpacked (buffer views, objects)."""
        self._buffers.clear()
        self._serialized.clear()
        self._objects.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        # The chunk map stays this reader's own: another rank's metadata (should a DCP
        # broadcast it) describes the same snapshot, built from the same manifests.
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Copy every read item of ``plan`` into its place through ``planner``
        (DCP's ``resolve_tensor``/``commit_tensor`` and ``load_bytes``). Raises
        CheckpointError as the class docstring says."""
        direct: dict[int, list[tuple[int, torch.Tensor]]] = {}
        done_later = []
        try:
            for item in plan.items:
                holder = self._present_holder(item.storage_index)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, self._object_stream(holder, item.storage_index.fqn))
                    continue
                target = planner.resolve_tensor(item).detach()
                if tuple(target.size()) != tuple(item.lengths):
                    raise CheckpointError(f"{item.storage_index.fqn!r}: the snapshot's part has "
                                          f"shape {tuple(item.lengths)}, its place "
                                          f"{tuple(target.size())}")
                offset = self._file_offset(item, holder)
                if offset is not None and fillable(target):
                    direct.setdefault(holder.rank, []).append((offset, target))
                    done_later.append((item, target))
                else:
                    target.copy_(_narrow(self._tensor_view(holder), item.storage_offsets,
                                         item.lengths))
                    planner.commit_tensor(item, target)
            self._read_files(direct)
            for item, target in done_later:
                planner.commit_tensor(item, target)
        finally:
            self.reset()
        done: Future = Future()
        done.set_result(None)
        return done

    def _file_offset(self, read: Any, holder: Holder) -> int | None:
        """Where the part ``read`` asks for starts in the holder's slot file, when
        the holder's data is a file on this node and the part is one range of it."""
        item = holder.item
        assert item is not None  # a tensor's holder always has its item
        if not isinstance(self._sources[holder.rank].data, SlotFile):
            return None
        start = _contiguous_start(item.shape, read.storage_offsets, read.lengths)
        if start is None:
            return None
        return item.offset + start * _dtype(item.dtype, item.fqn).itemsize

    def _read_files(self, direct: dict[int, list[tuple[int, torch.Tensor]]]) -> None:
        """Every slot file's reads (old rank -> [(offset, destination)]), together."""
        for rank in direct:
            source = self._sources[rank]
            expected = source.manifest.files.get(layout.DATA, 0)
            if len(source.data) < expected:
                raise CheckpointError(f"rank {rank}'s snapshot data has {len(source.data)} "
                                      f"bytes, its manifest lists {expected}")
        try:
            read_files([(self._sources[rank].data, reads) for rank, reads in direct.items()],
                       self._threads)
        except OSError as exc:
            raise CheckpointError(f"cannot read the snapshot data of old rank(s) "
                                  f"{_ranks(direct)}: {exc}") from exc

    def _present_holder(self, index: MetadataIndex) -> Holder:
        holders = self._storage.get(index)
        if not holders:
            raise CheckpointError(f"the memory snapshot has no chunk of {index.fqn!r} at "
                                  f"{tuple(index.offset or ())}")
        for holder in holders:
            if self._sources[holder.rank].present:
                return holder
        where = f" (the chunk at offsets {tuple(index.offset)})" if index.offset else ""
        raise CheckpointError(
            f"{index.fqn!r}{where} is held only by old rank(s) {_ranks(h.rank for h in holders)}, "
            f"whose memory snapshot is not in this process")

    def _tensor_view(self, holder: Holder) -> torch.Tensor:
        """The saved chunk as a tensor over the slot's buffer (a copy only when its
        bytes are not aligned for the dtype, which a view needs)."""
        item = holder.item
        assert item is not None  # a tensor's holder always has its item
        whole = self._buffers.get(holder.rank)
        if whole is None:
            whole = self._buffers[holder.rank] = byte_tensor(self._sources[holder.rank])
        raw = whole.narrow(0, item.offset, item.nbytes)
        dtype = _dtype(item.dtype, item.fqn)
        if raw.data_ptr() % dtype.itemsize or raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).view(item.shape)

    def read_objects(self, plan: LoadPlan) -> dict[str, Any]:
        """The values of ``plan``'s non-tensor (``BYTE_IO``) items by key, each from
        a holder present here, through the allow-list (one ``objects.pt`` read per
        rank); tensor items are left out. Raises CheckpointError as ``read_data``
        does."""
        try:
            return {item.storage_index.fqn: self._object(
                        self._present_holder(item.storage_index), item.storage_index.fqn)
                    for item in plan.items if item.type == LoadItemType.BYTE_IO}
        finally:
            self.reset()

    def _object(self, holder: Holder, key: str) -> Any:
        objects = self._objects.get(holder.rank)
        if objects is None:
            source = self._sources[holder.rank]
            what = f"{layout.OBJECTS} of rank {holder.rank} (step {source.manifest.step})"
            objects = self._objects[holder.rank] = load_objects(source.objects, self._policy,
                                                                what)
        if key not in objects:
            raise CheckpointError(f"{layout.OBJECTS} of rank {holder.rank} lacks {key!r}, "
                                  f"which its manifest lists")
        return objects[key]

    def _object_stream(self, holder: Holder, key: str) -> io.BytesIO:
        """``key``'s value as the planner's ``load_bytes`` takes it: a ``torch.save``
        stream. The value passed the allow-list already, so the stream holds only
        allowed types, whatever unpickler the planner uses."""
        value = self._object(holder, key)
        # Flattened optimizer options share one object per parameter group (pickle's
        # memo keeps that): serialize each once. ``objects`` keeps it alive, so its id
        # stays its own until reset().
        saved = self._serialized.get(id(value))
        if saved is None:
            stream = io.BytesIO()
            torch.save(value, stream)
            saved = self._serialized[id(value)] = stream.getvalue()
        return io.BytesIO(saved)


def byte_tensor(source: SlotData) -> torch.Tensor:
    """``source.data`` as a 1-D uint8 tensor sharing its memory; raises
    CheckpointError when it is shorter than the manifest's ``data.bin``."""
    data = source.data
    if isinstance(data, SlotFile):
        data = data.mapping()
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.device.type != "cpu" or not data.is_contiguous():
            raise CheckpointError(f"rank {source.manifest.rank}'s snapshot data is a "
                                  f"{data.dtype} tensor on {data.device}, not contiguous "
                                  f"CPU uint8")
        whole = data.reshape(-1)
    elif memoryview(data).nbytes == 0:
        whole = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():
            # A read-only buffer is fine: nothing writes through these views.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            whole = torch.frombuffer(memoryview(data).cast("B"), dtype=torch.uint8)
    expected = source.manifest.files.get(layout.DATA, 0)
    if whole.numel() < expected:
        raise CheckpointError(f"rank {source.manifest.rank}'s snapshot data has "
                              f"{whole.numel()} bytes, its manifest lists {expected}")
    return whole


def _contiguous_start(shape: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]
                      ) -> int | None:
    """The first element (row-major) of the part ``offsets``/``lengths`` of a
    tensor of ``shape`` when the part is one range of its elements (every
    dimension after the innermost cut one is whole, every one before it has
    length 1), else None."""
    cuts = [dim for dim, (size, length) in enumerate(zip(shape, lengths)) if length != size]
    if cuts and any(length != 1 for length in lengths[:cuts[-1]]):
        return None
    start = 0
    for size, offset in zip(shape, offsets):
        start = start * size + offset
    return start


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]
            ) -> torch.Tensor:
    """The part of a saved chunk that a read item asks for (a view)."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


# --- what a load reads ----------------------------------------------------------------------


class PlannedLoad:
    """A load of ``state_dict`` from the memory snapshot that ``manifests`` (every
    old rank's) describe, planned once, with no collective: first which old
    ranks' slots it reads (:meth:`ranks`), then, once those are here, the load
    itself (:meth:`run`), by the very plan that named them.

    The plan is ``planner``'s (DCP's public ``set_up_planner``,
    ``create_local_plan``, ``create_global_plan`` and ``finish_plan``, in
    ``dcp.load``'s order; meta tensors in ``state_dict`` are materialized as
    ``dcp.load`` would). Raises CheckpointError for manifests that are not one
    snapshot (:func:`snapshot_metadata`) and for a state dict that the snapshot
    cannot fill (a key it lacks, another size)."""

    def __init__(self, state_dict: Any, manifests: Mapping[int, layout.Manifest],
                 planner: LoadPlanner):
        self.metadata = snapshot_metadata(manifests)
        self._planner = planner
        try:
            planner.set_up_planner(state_dict, self.metadata, True)
            local = planner.create_local_plan()
            self.plan = planner.finish_plan(planner.create_global_plan([local])[0])
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"the memory snapshot cannot fill this state dict: "
                                  f"{exc}") from exc

    def ranks(self, prefer: Collection[int] = ()) -> set[int]:
        """The old ranks whose slots the load reads: a chunk held by several ranks
        comes from a rank in ``prefer`` when one holds it (e.g. the caller's
        local slots), else from as few distinct ranks as a greedy cover finds."""
        storage = self.metadata.storage_data
        return choose_holders([{h.rank for h in storage[item.storage_index]}
                               for item in self.plan.items], prefer)

    def run(self, sources: Mapping[int, SlotData],
            policy: trust.LoadPolicy = trust.DEFAULT_POLICY, threads: int = 1
            ) -> dict[str, Any]:
        """Load the tensors: ``sources`` and ``threads`` as :class:`MemoryStorageReader`
        takes them, holding the data of at least the ranks :meth:`ranks` named. The
        non-tensor values are not put in through the planner (a ``torch.save``
        round trip each) but returned, by DCP's flattened key, for the caller
        to set (:func:`put_objects`). Raises what the reader's ``read_data`` raises."""
        reader = MemoryStorageReader(sources, policy, self.metadata, threads)
        # The reader's own plan hooks return the plans as given: the plan stands.
        tensors = [item for item in self.plan.items if item.type != LoadItemType.BYTE_IO]
        reader.read_data(dataclasses.replace(self.plan, items=tensors), self._planner).wait()
        return reader.read_objects(self.plan)


def needed_ranks(state_dict: Any, manifests: Mapping[int, layout.Manifest],
                 prefer: Collection[int] = ()) -> set[int]:
    """The old ranks whose slots ``dcp.load(state_dict, storage_reader=...)`` reads
    through a :class:`MemoryStorageReader` over ``manifests`` (every old rank's),
    when the reader holds the data of exactly these ranks: :meth:`PlannedLoad.ranks`
    with DCP's default load planner (raising as :class:`PlannedLoad` does)."""
    return PlannedLoad(state_dict, manifests, DefaultLoadPlanner()).ranks(prefer)


def choose_holders(holders_per_item: Sequence[Collection[int]],
                   prefer: Collection[int] = ()) -> set[int]:
    """Ranks enough to serve every item (each given as the ranks that hold it):
    a rank of ``prefer`` for each item one holds, the rest by a greedy cover
    (the rank that holds most of the items still unserved first, the lower rank
    on a tie). Raises ValueError for an item that no rank holds."""
    preferred = set(prefer)
    chosen: set[int] = set()
    unserved: list[set[int]] = []
    for holders in holders_per_item:
        if not holders:
            raise ValueError("an item that no rank holds")
        mine = preferred.intersection(holders)
        if mine:
            chosen.add(min(mine))
        else:
            unserved.append(set(holders))
    while unserved:
        counts: dict[int, int] = {}
        for holders in unserved:
            for rank in holders:
                counts[rank] = counts.get(rank, 0) + 1
        best = min(counts, key=lambda rank: (-counts[rank], rank))
        chosen.add(best)
        unserved = [holders for holders in unserved if best not in holders]
    return chosen
