"""What an agent tells etcd about itself: the events of its transitions and
GPU checks, and its status record (:class:`agent.status_record.StatusRecord`).

Events are queued as they happen and written with the status record, in one
transaction under the agent's lease, by the loop's flush: a stop of the
workers never waits on etcd. The record is rewritten at once when its
meaning changes (state, round, failure, workers done), and for the step
alone at most every :data:`STATUS_PROGRESS_S`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from agent.health import WorkerHealth, node_progress
from agent.lifecycle import AgentState, Transition
from agent.metrics import NoMetrics
from agent.reactor import AgentView
from agent.status_record import StatusRecord, StragglerRow, WorkerRow
from elastic import events
from elastic.clock import Clock
from elastic.keyspace import JobKeys
from elastic.store.api import Put, Store

S = AgentState
# The status key is rewritten for the step alone at most this often: a node's
# progress is read live from its agent, the record is the fallback for one that
# cannot be reached, and a write a few seconds per node would fill etcd at
# 1,000 nodes (and wake an idle agent for nothing).
STATUS_PROGRESS_S = 30.0
# Events kept for etcd while it cannot be reached; older ones are dropped.
MAX_QUEUED_EVENTS = 50


def worker_rows(view: AgentView, workers: list[WorkerHealth], pids: dict[int, int],
                now: float) -> list[WorkerRow]:
    """The rows of the workers of ``view``'s round; ``pids`` by local rank."""
    rows = []
    for w in workers:
        state = "succeeded" if w.local_rank in view.exited_ok else (
            "running" if w.last_heartbeat_at is not None or view.state is S.RUNNING
            else "starting")
        rows.append(WorkerRow(
            local_rank=w.local_rank, rank=w.rank, pid=pids.get(w.local_rank, 0), state=state,
            last_step=w.step, step_rate=round(w.step_rate(), 3),
            heartbeat_age_s=round(now - w.last_heartbeat_at, 2)
            if w.last_heartbeat_at is not None else -1.0, judged=w.judged))
    return rows


def status_of(node_id: str, state: AgentState, view: AgentView, workers: list[WorkerHealth],
              pids: dict[int, int], now: float) -> StatusRecord:
    """The status record of an agent in ``state`` that knows ``view``."""
    me = view.round.member(node_id) if view.round else None
    return StatusRecord.of(node_id, state.value, view.round_number,
                           me.node_rank if me else None, worker_rows(view, workers, pids, now),
                           max(0, view.rounds_started - 1), view.last_failure)


def summary_line(state: AgentState, view: AgentView) -> str:
    """One line for systemd's STATUS: the state, the round and the last failure."""
    line = f"{state.value} in round {view.round_number}"
    if view.round is not None:
        line += f", world size {view.round.world_size}"
    if view.last_failure:
        line += f"; last failure: {view.last_failure}"
    return line


@dataclass(frozen=True)
class StatusDigest:
    """What decides whether the status record is worth a write: its
    ``meaning`` (a change is written at once) and its ``last_step`` (written
    alone at most every :data:`STATUS_PROGRESS_S`). Cheap to make at every
    pass of the loop, where the whole record (worker rows, goodput, memory
    tier) is built only when it is written."""

    meaning: tuple
    last_step: int

    @classmethod
    def of(cls, state: AgentState, view: AgentView, steps: dict[int, int],
           stragglers: Iterable[StragglerRow]) -> "StatusDigest":
        """The digest of the record :func:`status_of` makes of ``state``,
        ``view`` and workers whose last steps by local rank are ``steps``,
        with the leader's ``stragglers`` rows."""
        done = frozenset(rank for rank in steps if rank in view.exited_ok)
        named = tuple((s.rank, s.node_id, s.action) for s in stragglers)
        last_step, _ = node_progress((step, 0.0) for step in steps.values())
        return cls((state.value, view.round_number, view.last_failure, done, named), last_step)


class Publisher:
    """Queues this node's events and writes them, with its status record when
    due, to etcd (:meth:`flush`, from the agent's loop)."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, clock: Clock,
                 metrics: NoMetrics, timeout_s: float):
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._clock = clock
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._events: list[Put] = []  # not yet written to etcd
        self._written: tuple | None = None  # the meaning of the record last written
        self._written_step = -1  # the step it carried
        self._written_at = -math.inf  # and when

    def transition(self, t: Transition) -> None:
        """Queue a transition's event (the lifecycle's publisher)."""
        self._metrics.observe_transition(t.after, self._clock.monotonic())
        self.event(t.round, events.KIND_STATE, f"{t.before.value} -> {t.after.value}: {t.reason}")

    def event(self, round_number: int, kind: str, message: str) -> None:
        """Queue an event of this node about ``round_number``."""
        self._events.append(events.event_op(self._keys, self._clock, self._node_id,
                                            round_number, kind, message))
        del self._events[:-MAX_QUEUED_EVENTS]

    def due(self, digest: StatusDigest) -> bool:
        """Whether the record of ``digest`` is worth a write now: its meaning
        changed, or its step did and the record written is
        :data:`STATUS_PROGRESS_S` old."""
        if digest.meaning != self._written:
            return True
        return (digest.last_step != self._written_step
                and self._clock.monotonic() - self._written_at >= STATUS_PROGRESS_S)

    def pending(self, lease: int | None, digest: StatusDigest) -> bool:
        """Whether events, or the record of ``digest`` (when due and there is
        a ``lease`` to write it under), still wait for etcd."""
        return bool(self._events) or (lease is not None and self.due(digest))

    def flush(self, lease: int, digest: StatusDigest,
              record_of: Callable[[], StatusRecord]) -> None:
        """Write the queued events, and the record ``record_of()`` (whose
        digest is ``digest``) when due, in one transaction under ``lease``.
        Raises StoreError (nothing written: all kept)."""
        queued = list(self._events)
        ops = list(queued)
        write = self.due(digest)
        if write:
            ops.append(Put(self._keys.status_of(self._node_id), record_of().to_json(),
                           lease=lease))
        if not ops:
            return
        self._store.txn([], ops, timeout_s=self._timeout_s)
        del self._events[:len(queued)]
        if write:
            self._written, self._written_step = digest.meaning, digest.last_step
            self._written_at = self._clock.monotonic()
