"""The memory tier's decisions, pure: what a node sends to its buddy,
what it frees, how much memory it needs.

The rules (each a function below, unit tested without files or clocks):

* **Buddy**: a node sends its snapshots to its buddy and holds the replicas
  of its source, as the round places them (a ring of the members, racks
  interleaved: :mod:`elastic.rendezvous.placement`). Never itself; nobody
  with one member.
* **What to send** (:func:`to_send`): per rank, the newest complete own
  snapshot (by round, then step) that the buddy has not acknowledged; older
  ones are skipped, so a replication that falls behind catches up with the
  newest, not with the backlog.
* **What to free** (:func:`slots_to_free`): once this node's workers have all
  staged a complete snapshot in some round (every one of ``nproc`` ranks),
  every slot of an older round (own and replicas, complete or not) is freed.
  Before that, nothing is freed: the older snapshots are the newest that can
  be restored. Replicas go by their round alone, never because their source
  left the ring: a lost node's replicas are what the next round restores from,
  and its workers stage their first snapshot only after that restore.
* **Need** (:func:`memory_need`): at most two slots per rank, own and
  replicated: twice the node's snapshot plus twice its source's.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from elastic.checkpoint.memory.layout import OWN, SlotKey


@dataclasses.dataclass(frozen=True)
class SlotSeen:
    """A slot directory found on this node: ``holder`` is ``OWN`` or the replica's
    source node; ``step`` and ``nbytes`` come from its manifest, None and 0 when
    the slot is not complete."""

    holder: str
    key: SlotKey
    step: int | None = None
    nbytes: int = 0

    @property
    def complete(self) -> bool:
        return self.step is not None


@dataclasses.dataclass(frozen=True)
class Acked:
    """What the buddy acknowledged of one rank: the snapshot of ``step`` in ``round``."""

    round: int
    step: int


def newest_per_rank(slots: Iterable[SlotSeen]) -> dict[int, SlotSeen]:
    """The newest complete slot (by round, then step) of each rank among ``slots``."""
    newest: dict[int, SlotSeen] = {}
    for s in slots:
        if not s.complete:
            continue
        best = newest.get(s.key.rank)
        if best is None or (s.key.round, s.step) > (best.key.round, best.step):
            newest[s.key.rank] = s
    return newest


def to_send(own: Iterable[SlotSeen], acked: Mapping[int, Acked]) -> list[SlotSeen]:
    """Per rank, the newest complete own slot the buddy has not acknowledged
    (newer round, or same round and newer step), in rank order."""
    out = []
    for rank, s in sorted(newest_per_rank(own).items()):
        done = acked.get(rank)
        if done is None or (s.key.round, s.step) > (done.round, done.step):
            out.append(s)
    return out


def lag_steps(own: Iterable[SlotSeen], acked: Mapping[int, Acked]) -> int:
    """How many steps the buddy's copy trails the newest own snapshot: the
    newest own step minus the oldest step acknowledged among the ranks of the
    newest round (a rank not acknowledged in that round counts as step -1,
    the whole history behind); 0 with no own snapshot."""
    newest = newest_per_rank(own)
    if not newest:
        return 0
    top_round = max(s.key.round for s in newest.values())
    top_step = max(s.step or 0 for s in newest.values())
    behind = 0
    for rank, s in newest.items():
        if s.key.round != top_round:
            continue
        done = acked.get(rank)
        step = done.step if done is not None and done.round == top_round else -1
        behind = max(behind, top_step - step)
    return max(0, behind)


def complete_round(own: Iterable[SlotSeen], nproc: int) -> int | None:
    """The newest round in which ``nproc`` distinct ranks (all of this node's
    workers) have a complete own slot; None when there is none."""
    ranks: dict[int, set[int]] = {}
    for s in own:
        if s.complete and s.holder == OWN:
            ranks.setdefault(s.key.round, set()).add(s.key.rank)
    full = [r for r, seen in ranks.items() if len(seen) >= nproc]
    return max(full, default=None)


def slots_to_free(slots: Sequence[SlotSeen], nproc: int) -> list[SlotSeen]:
    """The slots the module docstring's rule frees: none until this node's
    workers have all staged a complete snapshot in some round R; then every
    slot (own or replica) of a round before R."""
    cutoff = complete_round([s for s in slots if s.holder == OWN], nproc)
    if cutoff is None:
        return []
    return [s for s in slots if s.key.round < cutoff]


def snapshot_bytes(slots: Iterable[SlotSeen]) -> int:
    """One snapshot's bytes: the largest complete slot of each rank, summed."""
    largest: dict[int, int] = {}
    for s in slots:
        if s.complete:
            largest[s.key.rank] = max(largest.get(s.key.rank, 0), s.nbytes)
    return sum(largest.values())


def memory_need(slots: Sequence[SlotSeen]) -> int:
    """Bytes the memory tier may hold on this node at most, from the sizes seen:
    two slots per rank of the own snapshot and of the replicated one."""
    own = [s for s in slots if s.holder == OWN]
    replicas = [s for s in slots if s.holder != OWN]
    return 2 * snapshot_bytes(own) + 2 * snapshot_bytes(replicas)
