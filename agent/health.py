"""Health: what the agent knows of each worker, the pure hang verdict, a node's
progress, and a peer agent's health as seen from here.

A worker is judged only once it has spoken: a script that never sends a
heartbeat (plain torch, no ``elastic`` library) is never called hung. Once it
has, it is hung when

* no heartbeat arrived for ``hang_timeout_s`` (the process is frozen, e.g.
  SIGSTOP, or its heartbeat thread is stuck), or
* it reported progress before and no step has completed for ``hang_timeout_s``
  (deadlock, a collective stuck on a dead peer), unless it announced a
  checkpoint save that is still within its announced time.

A worker that said it is exiting (its script ended) is not judged any more.

A node's progress is its newest worker's step and its slowest worker's rate
(:func:`node_progress`): what the status record, the status RPC and the
metrics report.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import Iterable


class PeerHealth(enum.StrEnum):
    """A peer agent's health as seen from here; the values are plain strings."""

    SERVING = "SERVING"
    """The agent and its workers are healthy."""
    NOT_SERVING = "NOT_SERVING"
    """The agent answers but reports itself unhealthy (workers failed, stopping, starting)."""
    UNREACHABLE = "UNREACHABLE"
    """No answer within the timeout, or the connection or watch stream broke."""
    UNKNOWN = "UNKNOWN"
    """The agent answered without a usable status (service not registered, other error)."""


@dataclass
class WorkerHealth:
    """Mutable record the agent's loop keeps per local rank (times: monotonic s)."""

    local_rank: int
    rank: int
    started_at: float
    last_heartbeat_at: float | None = None
    last_progress_at: float | None = None
    step: int = -1
    saving_until: float = 0.0
    exiting: bool = False  # the script ended; shutdown is not judged
    steps: list[tuple[float, int]] = field(default_factory=list)  # recent (time, step)

    def on_heartbeat(self, now: float, step: int, saving_for_s: float,
                     exiting: bool = False) -> None:
        self.last_heartbeat_at = now
        self.exiting = self.exiting or exiting
        if step > self.step:
            self.step = step
            self.last_progress_at = now
            self.steps.append((now, step))
            del self.steps[:-20]
        self.saving_until = now + saving_for_s if saving_for_s > 0 else 0.0

    def step_rate(self) -> float:
        """Steps per second over the recent heartbeats (0 until two are known)."""
        if len(self.steps) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self.steps[0], self.steps[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


def node_progress(workers: Iterable[tuple[int, float]]) -> tuple[int, float]:
    """A node's progress from its workers' ``(step, steps per second)``: the
    newest step (-1 without workers) and the slowest rate (0.0 without)."""
    pairs = list(workers)
    return max((s for s, _ in pairs), default=-1), min((r for _, r in pairs), default=0.0)


class WorkerTable:
    """The health records of the workers of the round running here: replaced
    by the agent's loop for each round it starts, fed by the worker channel's
    threads (heartbeats), read by anyone as copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._workers: dict[int, WorkerHealth] = {}

    def reset(self, ranks: Iterable[int], now: float) -> None:
        """Fresh records for a round whose local rank ``i`` has global rank ``ranks[i]``."""
        with self._lock:
            self._workers = {i: WorkerHealth(local_rank=i, rank=rank, started_at=now)
                             for i, rank in enumerate(ranks)}

    def beat(self, local_rank: int, now: float, step: int, saving_for_s: float,
             exiting: bool) -> tuple[int, float] | None:
        """Record a heartbeat of ``local_rank``; the node's progress after it
        (:func:`node_progress`), None when that rank has no record."""
        with self._lock:
            w = self._workers.get(local_rank)
            if w is None:
                return None
            w.on_heartbeat(now, step, saving_for_s, exiting)
            return node_progress([(x.step, x.step_rate()) for x in self._workers.values()])

    def snapshot(self) -> list[WorkerHealth]:
        """Copies of the records, by local rank."""
        with self._lock:
            return [dataclasses.replace(w, steps=list(w.steps))
                    for _, w in sorted(self._workers.items())]


def last_sign_of_life(w: WorkerHealth, now: float, hang_timeout_s: float) -> float | None:
    """When a worker judged hung at ``now`` last showed what its verdict misses:
    its last heartbeat when it went silent, else its last progress. None for a
    worker that never spoke."""
    if w.last_heartbeat_at is None:
        return None
    if now - w.last_heartbeat_at > hang_timeout_s or w.last_progress_at is None:
        return w.last_heartbeat_at
    return w.last_progress_at


def next_hang_verdict_at(workers: list[WorkerHealth], hang_timeout_s: float) -> float | None:
    """The earliest time (monotonic) at which :func:`hung_workers` could judge one
    of ``workers`` hung if none of them sent anything meanwhile: a heartbeat or
    a step only moves it later. None: nothing to judge (detection off, or no
    worker has spoken)."""
    if hang_timeout_s <= 0:
        return None
    deadlines = []
    for w in workers:
        if w.last_heartbeat_at is None or w.exiting:
            continue
        deadlines.append(w.last_heartbeat_at + hang_timeout_s)
        if w.last_progress_at is not None:
            deadlines.append(max(w.last_progress_at + hang_timeout_s, w.saving_until))
    return min(deadlines, default=None)


def hung_workers(workers: list[WorkerHealth], now: float, hang_timeout_s: float
                 ) -> list[tuple[WorkerHealth, str]]:
    """The workers judged hung at ``now``, each with a reason for the log.

    ``hang_timeout_s`` 0 turns hang detection off.
    """
    if hang_timeout_s <= 0:
        return []
    verdicts = []
    for w in workers:
        if w.last_heartbeat_at is None or w.exiting:
            continue
        silent = now - w.last_heartbeat_at
        if silent > hang_timeout_s:
            verdicts.append((w, f"rank {w.rank} sent no heartbeat for {silent:.1f} s "
                                f"(hang timeout {hang_timeout_s:g} s)"))
            continue
        if w.last_progress_at is None or now < w.saving_until:
            continue
        stalled = now - w.last_progress_at
        if stalled > hang_timeout_s:
            verdicts.append((w, f"rank {w.rank} made no progress for {stalled:.1f} s after "
                                f"step {w.step} (hang timeout {hang_timeout_s:g} s)"))
    return verdicts
