"""Which memory snapshot a restore uses, and who sends which slot to whom: pure rules.

No torch, no files: every rank of the new group computes the same answer from
the same gathered inventory, so no rank has to tell the others what it chose.

The rules of :func:`choose` (each has its test in tests/unit/test_memory_choice.py):

1. A *set* is the slots of one round R and one step S. It is complete when,
   for R's world size W, every rank 0..W-1 of R has a complete slot of step S
   on some node (its own memory or a replica). Only complete slots are ever
   seen here: a torn slot (no manifest, :func:`layout.read_slot`) is not listed.
2. Slots of different rounds are never mixed: a set is one round's.
3. Among complete sets, the one with the highest (round, step) is the candidate,
   so a zombie of an older round (whose slots may carry a higher step) never
   wins over the newer round's snapshot.
4. Against the disk tier's latest commit (step D, round Rd): the candidate is
   used only when R >= Rd and S >= D. Memory never overrides a commit of a
   newer round, nor an older step than disk has; at an equal step memory is
   used (the same state, read faster). Otherwise disk is used.
5. With no complete set, disk is used (and with no disk commit either, the run
   starts from scratch: the disk restore says so).

:func:`plan_transfers` says, for each slot a rank needs and cannot read on its
own node, which rank sends it: the lowest-numbered rank that holds it locally
among those with the fewest sends so far (spreading the sends over the
holders), in the order of (receiver, source rank).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

from elastic.checkpoint.memory.layout import SlotKey

MEMORY = "memory"
DISK = "disk"


@dataclasses.dataclass(frozen=True)
class SlotSeen:
    """A complete slot a rank of the new group can read on its own node:
    ``reader`` is that rank; ``key`` the slot; ``step`` and ``world_size``
    from its manifest."""

    reader: int
    key: SlotKey
    step: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class DiskLatest:
    """The disk tier's latest commit: its step and the round that committed it."""

    step: int
    round: int


@dataclasses.dataclass(frozen=True)
class Choice:
    """The restore's source (:data:`MEMORY` or :data:`DISK`) and why.

    For memory: the set's ``round``, ``step`` and ``world_size``, and
    ``holders``: for each rank of that round, the new ranks that can read its
    slot on their own node, with the slot (``{old rank: {new rank: key}}``).
    """

    source: str
    reason: str
    round: int = -1
    step: int = -1
    world_size: int = 0
    holders: Mapping[int, Mapping[int, SlotKey]] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        """``memory:round-<R>/step-<S>``: what ``Checkpointer.restored_path`` says."""
        return f"memory:round-{self.round}/step-{self.step}"


def choose(seen: Iterable[SlotSeen], disk: DiskLatest | None) -> Choice:
    """The snapshot to restore (rules 1-5 of the module docstring)."""
    sets: dict[tuple[int, int, int], dict[int, dict[int, SlotKey]]] = {}
    for slot in seen:
        ident = (slot.key.round, slot.step, slot.world_size)
        sets.setdefault(ident, {}).setdefault(slot.key.rank, {})[slot.reader] = slot.key
    complete = [(round_, step, world) for (round_, step, world), ranks in sets.items()
                if all(rank in ranks for rank in range(world))]
    incomplete = len(sets) - len(complete)
    if not complete:
        return Choice(DISK, f"no complete memory snapshot ({incomplete} incomplete set(s))")
    round_, step, world = max(complete)
    found = f"memory snapshot round {round_} step {step} ({world} ranks)"
    if disk is not None and disk.round > round_:
        return Choice(DISK, f"disk commit step {disk.step} of round {disk.round} is of a newer "
                            f"round than the {found}")
    if disk is not None and disk.step > step:
        return Choice(DISK, f"disk commit step {disk.step} is newer than the {found}")
    holders = {rank: dict(sorted(readers.items()))
               for rank, readers in sorted(sets[(round_, step, world)].items())}
    return Choice(MEMORY, f"{found} is complete" + (
        f" and not older than disk commit step {disk.step}" if disk is not None else ""),
        round_, step, world, holders)


@dataclasses.dataclass(frozen=True, order=True)
class Transfer:
    """``sender`` sends old rank ``source``'s slot to ``receiver``."""

    receiver: int
    source: int
    sender: int


def plan_transfers(needs: Mapping[int, Iterable[int]],
                   holders: Mapping[int, Mapping[int, SlotKey]]) -> list[Transfer]:
    """The sends that give every new rank the old ranks' slots it ``needs``
    (``{new rank: old ranks}``), from ``holders`` (:attr:`Choice.holders`);
    nothing for a slot the receiver reads on its own node. Raises ValueError
    when a needed slot has no holder (the choice said the set was complete)."""
    sends: dict[int, int] = {}
    plan = []
    for receiver in sorted(needs):
        for source in sorted(set(needs[receiver])):
            readers = holders.get(source, {})
            if receiver in readers:
                continue
            if not readers:
                raise ValueError(f"no rank holds the slot of old rank {source}")
            sender = min(readers, key=lambda r: (sends.get(r, 0), r))
            sends[sender] = sends.get(sender, 0) + 1
            plan.append(Transfer(receiver, source, sender))
    return plan
