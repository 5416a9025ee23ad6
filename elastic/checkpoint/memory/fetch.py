"""A memory snapshot's slots as a restoring rank holds them: read in place, or sent by a peer.

A slot on this rank's node (own memory or a replica) is opened in place:
``data.bin`` read straight into the tensors that need it, or mapped read-only
where a view is needed (:class:`~.slotfile.SlotFile`; :func:`open_local`). A
slot on another node is sent by a rank of that node over the checkpointer's
gloo group (:func:`exchange`, point to point, following
a plan every rank computed alike: :func:`choice.plan_transfers`): a header of
four sizes, then the manifest, ``data.bin``, ``objects.pt`` and ``local.pt``.
A sender that cannot read its slot sends a header of -1s (its receiver then
fails, and the ranks fall back together), so no rank waits for bytes that never
come. What arrives is checked like a slot read from a file: the manifest must
parse, be the slot asked for, and list the sizes received.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.choice import Transfer
from elastic.checkpoint.memory.reader import SlotData
from elastic.checkpoint.memory.slotfile import SlotFile
from elastic.errors import CheckpointError

_FILES = 4  # manifest, data, objects, local


@dataclasses.dataclass
class Fetched:
    """One old rank's slot, held by this rank: the reader's view of it, its
    ``local.pt`` bytes, and how it got here (``own``, ``replica``, ``peer``).
    ``info``: the slot read on this node (None when a peer sent it)."""

    slot: SlotData
    local: bytes
    origin: str
    info: layout.SlotInfo | None = None
    manifest_json: bytes = b""


def open_local(info: layout.SlotInfo) -> Fetched:
    """The slot at ``info.path``: its small files read, ``data.bin`` as a
    :class:`~.slotfile.SlotFile` (read when the load needs it). Raises OSError."""
    with open(os.path.join(info.path, layout.MANIFEST), "rb") as f:
        manifest_json = f.read(layout.MAX_MANIFEST_BYTES + 1)
    data: Any = b""
    size = info.manifest.files.get(layout.DATA, 0)
    if size:
        data = SlotFile(os.path.join(info.path, layout.DATA), size)
    return Fetched(SlotData(info.manifest, data, _read(info.path, layout.OBJECTS)),
                   _read(info.path, layout.LOCAL),
                   "own" if info.holder == layout.OWN else "replica", info, manifest_json)


def unchanged(fetched: Fetched) -> bool:
    """Whether a slot opened on this node still holds what was read (no writer
    began on it since): a peer sent, or a load used, the bytes its manifest vouches for."""
    return fetched.info is None or layout.still_same(fetched.info)


def exchange(group: CheckpointGroup, plan: Sequence[Transfer], held: Mapping[int, layout.SlotInfo],
             expected: Mapping[int, tuple[int, int]]) -> tuple[dict[int, Fetched], list[str]]:
    """Run this rank's part of ``plan`` in its order: send the slots of ``held``
    (old rank -> slot on this node) that others need, receive those this rank
    needs (``expected``: old rank -> (round, step) the slot must have).
    Returns the slots received and the problems met (empty: all well). Raises
    CheckpointError when the group fails."""
    received: dict[int, Fetched] = {}
    problems: list[str] = []
    for transfer in plan:
        if transfer.sender == group.rank:
            problem = _send(group, transfer, held.get(transfer.source))
        elif transfer.receiver == group.rank:
            problem, fetched = _receive(group, transfer, expected[transfer.source])
            if fetched is not None:
                received[transfer.source] = fetched
        else:
            continue
        if problem:
            problems.append(problem)
    return received, problems


def _send(group: CheckpointGroup, transfer: Transfer, info: layout.SlotInfo | None) -> str:
    parts: list[Any] = []
    problem = ""
    try:
        if info is None:
            raise CheckpointError("this rank does not hold it")
        opened = open_local(info)
        data = opened.slot.data
        parts = [opened.manifest_json, data.mapping() if isinstance(data, SlotFile) else data,
                 opened.slot.objects, opened.local]
    except (OSError, CheckpointError) as exc:
        problem = f"cannot read the slot of old rank {transfer.source} to send it: {exc}"
    sizes = [-1] * _FILES if problem else [len(memoryview(p)) for p in parts]
    peer = dist.get_global_rank(group.pg, transfer.receiver)
    try:
        dist.send(torch.tensor(sizes, dtype=torch.int64), dst=peer, group=group.pg)
        for part in parts:
            if len(memoryview(part)):
                dist.send(_bytes_tensor(part), dst=peer, group=group.pg)
    except RuntimeError as exc:
        raise CheckpointError(f"rank {group.rank}: sending a memory snapshot to rank "
                              f"{transfer.receiver} failed: {exc}") from exc
    if not problem and info is not None and not layout.still_same(info):
        problem = f"the slot of old rank {transfer.source} changed while it was sent"
    return problem


def _receive(group: CheckpointGroup, transfer: Transfer,
             expected: tuple[int, int]) -> tuple[str, Fetched | None]:
    peer = dist.get_global_rank(group.pg, transfer.sender)
    try:
        sizes = torch.empty(_FILES, dtype=torch.int64)
        dist.recv(sizes, src=peer, group=group.pg)
        if int(sizes.min()) < 0:
            return f"rank {transfer.sender} could not send the slot of old rank " \
                   f"{transfer.source}", None
        parts = []
        for size in sizes.tolist():
            buffer = bytearray(size)
            if size:
                dist.recv(torch.frombuffer(buffer, dtype=torch.uint8), src=peer, group=group.pg)
            parts.append(buffer)
    except RuntimeError as exc:
        raise CheckpointError(f"rank {group.rank}: receiving a memory snapshot from rank "
                              f"{transfer.sender} failed: {exc}") from exc
    try:
        manifest = layout.Manifest.from_json(bytes(parts[0]))
    except ValueError as exc:
        return f"the manifest of old rank {transfer.source} sent by rank " \
               f"{transfer.sender} is unusable: {exc}", None
    got = [len(parts[1]), len(parts[2]), len(parts[3])]
    want = [manifest.files.get(name, 0) for name in (layout.DATA, layout.OBJECTS, layout.LOCAL)]
    if (manifest.rank, (manifest.round, manifest.step)) != (transfer.source, expected) \
            or got != want:
        return f"rank {transfer.sender} sent another slot than old rank {transfer.source}'s " \
               f"of round {expected[0]} step {expected[1]}", None
    return "", Fetched(SlotData(manifest, parts[1], bytes(parts[2])), bytes(parts[3]), "peer")


def _bytes_tensor(part: Any) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only mapping: gloo only reads what it sends
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(part, dtype=torch.uint8)


def _read(path: str, name: str) -> bytes:
    try:
        with open(os.path.join(path, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""
