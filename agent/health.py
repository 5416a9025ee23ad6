"""Health: what the agent knows of each worker, the pure hang verdict, a node's
progress, and a peer agent's health as seen from here.

A worker is judged on its progress once it has reported any (``elastic.step``,
or an optimizer step: the worker bootstrap counts those for every script), or
from its start when the script reported progress on this node in an earlier
round (:attr:`WorkerHealth.judged`); a script that never reports progress
(inference, a custom loop without ``elastic.step``) is never called stalled.
Two timeouts (:class:`HangTimeouts`): ``first_s`` until a worker's first
progress (compilation, data loading, a restore), ``after_s`` after it. A worker
is hung when

* it sent heartbeats and none arrived for the timeout that applies to it (the
  process is frozen, e.g. SIGSTOP, or its heartbeat thread is stuck), or
* it is judged and no step has completed for that timeout (deadlock, a
  collective stuck on a dead peer), unless it announced a checkpoint save that
  is still within its announced time.

Time before ``not_before`` (the end of an etcd outage: a rank waiting on a
commit that the outage blocked is not hung) does not count.

A worker that said it is exiting (its script ended) is not judged any more.

A node's progress is its newest worker's step and its slowest worker's rate
(:func:`node_progress`): what the status record, the status RPC and the
metrics report.
"""

from __future__ import annotations

import dataclasses
import enum
import math
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
    # The script reported progress here in an earlier round: judged from its start.
    expects_progress: bool = False
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

    @property
    def judged(self) -> bool:
        """Whether its progress is judged: it reported progress, or is expected to."""
        return self.last_progress_at is not None or self.expects_progress

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
        self._script_reports_progress = False

    def reset(self, ranks: Iterable[int], now: float) -> None:
        """Fresh records for a round whose local rank ``i`` has global rank
        ``ranks[i]``; judged from their start once a worker of an earlier
        round here reported progress (the script is known to)."""
        with self._lock:
            self._script_reports_progress = self._script_reports_progress or any(
                w.last_progress_at is not None for w in self._workers.values())
            self._workers = {i: WorkerHealth(local_rank=i, rank=rank, started_at=now,
                                             expects_progress=self._script_reports_progress)
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

    def steps(self) -> dict[int, int]:
        """Each worker's last step (-1: none yet), by local rank: what a
        :meth:`snapshot` would say of them, without the copies."""
        with self._lock:
            return {rank: w.step for rank, w in self._workers.items()}

    def snapshot(self) -> list[WorkerHealth]:
        """Copies of the records, by local rank."""
        with self._lock:
            return [dataclasses.replace(w, steps=list(w.steps))
                    for _, w in sorted(self._workers.items())]


@dataclass(frozen=True)
class HangTimeouts:
    """How long a worker may go without progress (seconds; ``after_s`` 0: hang
    detection off): ``first_s`` until its first progress, ``after_s`` after."""

    after_s: float
    first_s: float | None = None  # None: after_s

    def for_worker(self, w: WorkerHealth) -> float:
        """The timeout that applies to ``w`` now."""
        if w.last_progress_at is None and self.first_s is not None:
            return self.first_s
        return self.after_s


def _timeouts(timeouts: HangTimeouts | float) -> HangTimeouts:
    return timeouts if isinstance(timeouts, HangTimeouts) else HangTimeouts(float(timeouts))


def _stalled_since(w: WorkerHealth, not_before: float) -> float | None:
    """Since when a judged worker has made no progress (its last step, or its
    start before the first); None when it is not judged."""
    if not w.judged:
        return None
    return max(w.started_at if w.last_progress_at is None else w.last_progress_at, not_before)


def last_sign_of_life(w: WorkerHealth, now: float, timeouts: HangTimeouts | float,
                      not_before: float = -math.inf) -> float | None:
    """When a worker judged hung at ``now`` last showed what its verdict misses:
    its last heartbeat when it went silent, else its last progress (its start
    before the first). None for a worker that never spoke and is not judged."""
    timeout = _timeouts(timeouts).for_worker(w)
    if w.last_heartbeat_at is not None and (
            now - max(w.last_heartbeat_at, not_before) > timeout or not w.judged):
        return w.last_heartbeat_at
    return _stalled_since(w, -math.inf)


def next_hang_verdict_at(workers: list[WorkerHealth], timeouts: HangTimeouts | float,
                         not_before: float = -math.inf) -> float | None:
    """The earliest time (monotonic) at which :func:`hung_workers` could judge one
    of ``workers`` hung if none of them sent anything meanwhile: a heartbeat or
    a step only moves it later. None: nothing to judge (detection off, or no
    worker has spoken or is judged)."""
    timeouts = _timeouts(timeouts)
    if timeouts.after_s <= 0:
        return None
    deadlines = []
    for w in workers:
        if w.exiting:
            continue
        timeout = timeouts.for_worker(w)
        if w.last_heartbeat_at is not None:
            deadlines.append(max(w.last_heartbeat_at, not_before) + timeout)
        stalled = _stalled_since(w, not_before)
        if stalled is not None:
            deadlines.append(max(stalled + timeout, w.saving_until))
    return min(deadlines, default=None)


def hung_workers(workers: list[WorkerHealth], now: float, timeouts: HangTimeouts | float,
                 not_before: float = -math.inf) -> list[tuple[WorkerHealth, str]]:
    """The workers judged hung at ``now``, each with a reason for the log.

    ``timeouts`` (a number: the same timeout before and after the first
    progress) with ``after_s`` 0 turns hang detection off. Time before
    ``not_before`` does not count.
    """
    timeouts = _timeouts(timeouts)
    if timeouts.after_s <= 0:
        return []
    verdicts = []
    for w in workers:
        if w.exiting:
            continue
        timeout = timeouts.for_worker(w)
        which = "hang timeout" if w.last_progress_at is not None or timeouts.first_s is None \
            else "first-step hang timeout"
        if w.last_heartbeat_at is not None:
            silent = now - max(w.last_heartbeat_at, not_before)
            if silent > timeout:
                verdicts.append((w, f"rank {w.rank} sent no heartbeat for {silent:.1f} s "
                                    f"({which} {timeout:g} s)"))
                continue
        stalled_since = _stalled_since(w, not_before)
        if stalled_since is None or now < w.saving_until:
            continue
        stalled = now - stalled_since
        if stalled > timeout:
            after = f"after step {w.step}" if w.last_progress_at is not None \
                else "since its start"
            verdicts.append((w, f"rank {w.rank} made no progress for {stalled:.1f} s {after} "
                                f"({which} {timeout:g} s)"))
    return verdicts
