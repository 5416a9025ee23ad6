"""Writing one rank's snapshots into its two alternating slots, by the slot protocol.

Each slot's ``data.bin`` is made once at the state's size and mapped into
this process (``torch.from_file(shared=True)``), with a view per tensor kept
between snapshots: a snapshot is one copy per tensor into the mapping (CUDA
tensors: a synchronous copy to host), then the small files and the manifest.
The slot being written is made incomplete first (:func:`layout.begin_write`),
so the previous snapshot, in the other slot, stays complete meanwhile. What
does not change from one snapshot to the next is made once: the slot's
directory and paths, its mapping, and the manifest's JSON but for the step, the
files' sizes and the time (a :class:`layout.ManifestTemplate` per layout).
``objects.pt`` is serialized again only when the objects changed (compared by
the plan's ``objects_key``, else by their plain pickle), and a slot's copy of it
is rewritten only when it differs from what this writer last wrote there. A
write that fails (the directory removed under the writer, the tmpfs full)
leaves the slot to be made anew.

A writer only ever touches its own two slots of its own (round, rank): older
rounds' slots are the agent's to free.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import time
from typing import Any

import torch

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.items import SlotPlan, dtype_of
from elastic.checkpoint.staging import local_tensor


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who writes: the job and node (manifest fields), the round, rank and world size."""

    job_id: str
    node_id: str
    round: int
    rank: int
    world_size: int


@dataclasses.dataclass
class _Mapped:
    items: tuple  # the plan's items this mapping was made or last checked for
    signature: tuple
    views: list[torch.Tensor]
    tensors_json: bytes
    tensors: tuple = ()  # the plan's tensors that ``sources`` are the local parts of
    sources: list[torch.Tensor] = dataclasses.field(default_factory=list)
    objects: bytes | None = None  # the objects.pt this writer last wrote into the slot
    manifest: tuple[tuple[str, ...], layout.ManifestTemplate] | None = None  # by objects' names


@dataclasses.dataclass(frozen=True)
class _SlotPaths:
    directory: str
    objects: str
    local: str

    @classmethod
    def of(cls, directory: str) -> "_SlotPaths":
        return cls(directory, os.path.join(directory, layout.OBJECTS),
                   os.path.join(directory, layout.LOCAL))


class SnapshotWriter:
    """Writes snapshots of ``identity``'s rank into ``<memory_dir>/own/``, slots 0
    and 1 in turn. Not thread-safe: the training thread calls it."""

    def __init__(self, memory_dir: str, identity: Identity):
        self.identity = identity
        self._own = layout.own_dir(memory_dir)
        self._keys = [layout.SlotKey(identity.round, identity.rank, slot)
                      for slot in range(layout.SLOTS_PER_RANK)]
        self._paths = [_SlotPaths.of(os.path.join(self._own, key.name)) for key in self._keys]
        self._next = self._older_slot()
        self._mapped: dict[int, _Mapped] = {}
        self._held: dict[tuple[int, str], _HeldFile] = {}  # (slot, path): its small files
        self._objects: tuple[Any, bytes] = (None, b"")  # (key of the objects, file bytes)
        self.written: layout.SlotKey | None = None  # the last complete snapshot's slot

    def slot_dir(self, slot: int) -> str:
        return self._paths[slot].directory

    def _older_slot(self) -> int:
        """The slot to write first: an incomplete one, else the older snapshot's. A
        restart in the same round (no agent: every run is round 0) then never
        overwrites the newest snapshot first."""
        steps = []
        for slot in range(layout.SLOTS_PER_RANK):
            info = layout.read_slot(self.slot_dir(slot))
            steps.append(-1 if info is None else info.manifest.step)
        return steps.index(min(steps))

    def held_bytes(self) -> int:
        """Bytes of the data files this writer's slots take now (rewritten in place)."""
        total = 0
        for slot in range(layout.SLOTS_PER_RANK):
            try:
                total += os.stat(os.path.join(self.slot_dir(slot), layout.DATA)).st_size
            except OSError:
                pass
        return total

    def write(self, step: int, plan: SlotPlan, local: bytes) -> layout.SlotKey:
        """Snapshot ``plan``'s tensors and objects and ``local`` (this rank's
        serialized state) as of ``step`` into the next slot. Raises OSError
        when the memory directory refuses a write (the slot stays incomplete,
        and the next write into it makes its directory and files anew)."""
        slot = self._next
        try:
            self._write(slot, step, plan, local)
        except OSError:
            self._forget(slot)
            raise
        self._next = 1 - slot
        self.written = self._keys[slot]
        return self.written

    def _write(self, slot: int, step: int, plan: SlotPlan, local: bytes) -> None:
        paths = self._paths[slot]
        # A slot with a mapping has its directory (a failed write drops the mapping).
        layout.begin_write(paths.directory, made=slot in self._mapped)
        mapped = self._mapping(slot, paths.directory, plan)
        if mapped.tensors is not plan.tensors:
            mapped.tensors, mapped.sources = plan.tensors, [local_tensor(t) for t in plan.tensors]
        compat.copy_all(mapped.views, mapped.sources)
        objects = self._objects_file(plan)
        if mapped.objects is not objects:
            mapped.objects = None
            self._file(slot, paths.objects).write(objects)
            mapped.objects = objects
        self._file(slot, paths.local).write(local)
        files = {layout.DATA: plan.data_bytes, layout.OBJECTS: len(objects),
                 layout.LOCAL: len(local)}
        manifest = self._template(mapped, plan).render(step, files, time.time())
        layout.finish_write(paths.directory, manifest)

    def _template(self, mapped: _Mapped, plan: SlotPlan) -> layout.ManifestTemplate:
        """The slot's manifest template for ``plan``, made anew when the objects'
        names changed."""
        names = tuple(plan.objects) if plan.objects_key is None else plan.objects_key[0]
        if mapped.manifest is None or mapped.manifest[0] != names:
            ident = self.identity
            head = layout.Manifest(
                job_id=ident.job_id, node_id=ident.node_id, round=ident.round, step=0,
                rank=ident.rank, world_size=ident.world_size,
                files=dict.fromkeys((layout.DATA, layout.OBJECTS, layout.LOCAL), 0),
                objects=names)
            mapped.manifest = (names, layout.ManifestTemplate(head, mapped.tensors_json))
        return mapped.manifest[1]

    def _mapping(self, slot: int, path: str, plan: SlotPlan) -> _Mapped:
        """The slot's mapped ``data.bin`` with a view per tensor, made anew when the
        layout changed."""
        mapped = self._mapped.get(slot)
        if mapped is not None and (mapped.items is plan.items
                                   or mapped.signature == plan.signature):
            mapped.items = plan.items
            return mapped
        self._mapped.pop(slot, None)
        data_path = os.path.join(path, layout.DATA)
        fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, layout.FILE_MODE)
        try:
            os.ftruncate(fd, plan.data_bytes)
        finally:
            os.close(fd)
        data = (torch.from_file(data_path, shared=True, size=plan.data_bytes, dtype=torch.uint8)
                if plan.data_bytes else torch.empty(0, dtype=torch.uint8))
        views = [data[i.offset:i.offset + i.nbytes].view(dtype_of(i.dtype)).view(i.shape)
                 for i in plan.items]
        tensors_json = json.dumps([i.to_record() for i in plan.items],
                                  separators=(",", ":")).encode()
        mapped = _Mapped(plan.items, plan.signature, views, tensors_json)
        self._mapped[slot] = mapped
        return mapped

    def _objects_file(self, plan: SlotPlan) -> bytes:
        """``objects.pt``'s bytes for ``plan.objects``: the last ones when the
        objects are the same (the plan's ``objects_key``, or else the objects'
        plain pickle: the same values, -0.0 and 0.0 told apart), else
        serialized anew."""
        key = plan.objects_key
        if key is None:
            try:
                key = pickle.dumps(plan.objects, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - only torch.save can: never reused
                key = None
        last_key, last = self._objects
        if key is not None and key == last_key:
            return last
        self._objects = (key, compat.save_unzipped(plan.objects))
        return self._objects[1]

    def _file(self, slot: int, path: str) -> "_HeldFile":
        held = self._held.get((slot, path))
        if held is None:
            held = self._held[(slot, path)] = _HeldFile(path)
        return held

    def _forget(self, slot: int) -> None:
        """Drop what this writer holds of ``slot`` (its next write makes it anew)."""
        self._mapped.pop(slot, None)
        for key in [key for key in self._held if key[0] == slot]:
            self._held.pop(key).close()

    def close(self) -> None:
        """Drop the mappings and files held open (the files stay: they are the snapshots)."""
        for slot in range(layout.SLOTS_PER_RANK):
            self._forget(slot)
        self._mapped.clear()


class _HeldFile:
    """A slot's ``local.pt`` or ``objects.pt``, held open and rewritten in
    place: the same pages each time (truncating and refilling a tmpfs file
    costs 40 us at 13 KiB, this a tenth of it), cut only when the new content
    is shorter. Raises OSError."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, layout.FILE_MODE)
        self._size = -1  # unknown: what a writer before this one left

    def write(self, data: bytes) -> None:
        view, offset = memoryview(data), 0
        while offset < len(view):
            offset += os.pwrite(self._fd, view[offset:], offset)
        if len(data) != self._size:
            os.ftruncate(self._fd, len(data))
            self._size = len(data)

    def close(self) -> None:
        os.close(self._fd)
