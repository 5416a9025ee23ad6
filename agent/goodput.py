"""Goodput: where the job's wall time went, as this node sees it.

:class:`Accountant` is pure: fed typed events (:class:`WorkersStarted`,
:class:`Stepped`, :class:`WorkersStopped`, :class:`LeftJob`) with the
agent's monotonic ``now``, it splits every second since the agent started
into one of four kinds, each with a bounded cause:

==============  ==============================================================
``productive``  time of steps done for the first time (cause ``steps``): the
                steps the job keeps, as no step is counted productive twice
``repeated``    time of steps done again after a restart restored an older
                state (cause: the restart's :class:`agent.reactor.StopCause`)
``recovery``    from the last step heard before the workers stopped for a
                restart to the first step of the next round's workers (cause:
                that restart's cause)
``other``       before this node's first step (``startup``), out of the job
                (``standby``: left out of a round, waiting for room) and after
                it (``ended``)
==============  ==============================================================

The rules, and why:

* Steps are the node's newest step from its workers' heartbeats
  (:func:`agent.health.node_progress`); training is synchronous, so one
  node's workers step in lockstep with the job's. A heartbeat carries no
  step time (its datagram is left as it is): the time between two
  heartbeats is shared evenly by the steps they span. Time after the last
  heartbeat is not counted until the next one or a stop: the totals trail
  the truth by at most one heartbeat interval (2 s by default).
* A step at or below the highest step this node has seen is a repeat: its
  time is ``repeated``, charged to the latest restart's cause. Counting the
  redone execution (not the first one) as repeated keeps every series a
  counter, and the total is the same: a step takes as long either time.
  The steps the job keeps are then exactly the productive ones.
* A round's first step ends its recovery: the time up to it is recovery,
  less one step's time (the last heard), which is that step's own.
* The time from the last step heard to a restart's stop (the *tail*) is
  held until the next round's first step says where it resumed: steps made
  in the tail that the restored state keeps (a memory snapshot taken after
  the last heartbeat) get one step's time each, as productive; the rest of
  the tail is recovery. Without this, every unheard step a memory restore
  keeps would count as recovery. Until then the totals trail by the tail.
* A restart during a recovery (a crash loop) charges what follows to the
  new cause; a standby included in a round recovers as ``node_joined``, the
  cause its peers' workers stop for.

The effective training time ratio (ETTR) is productive time over the time
accounted in the last ``window_s`` seconds (:class:`Window`, sampled every
``window_s / 120``, so its span is exact to within that).
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field
from typing import Iterable, Union

from agent import reactor
from agent.lifecycle import AgentState
from agent.status_record import GoodputRow

# Causes of ``other`` time, and the one label of productive time.
STEPS = "steps"
STARTUP = "startup"
STANDBY = "standby"
ENDED = "ended"
OTHER_CAUSES = (STARTUP, STANDBY, ENDED)
# A standby's workers start in a round that grows the job: its peers' stop cause.
_JOINED = reactor.StopCause.NODE_JOINED.value
RESTART_CAUSES = tuple(c.value for c in reactor.StopCause if c.restart)
# Samples per window: the ETTR's span is the window to within window / this.
WINDOW_SAMPLES = 120
DEFAULT_WINDOW_S = 3600.0


class Kind(enum.Enum):
    """Where a second of the job's wall time went (see the module's table)."""

    PRODUCTIVE = "productive"
    REPEATED = "repeated"
    RECOVERY = "recovery"
    OTHER = "other"


def series() -> list[tuple[Kind, str]]:
    """Every (kind, cause) the accountant can charge: the metric's label pairs."""
    return ([(Kind.PRODUCTIVE, STEPS)]
            + [(k, c) for k in (Kind.REPEATED, Kind.RECOVERY) for c in RESTART_CAUSES]
            + [(Kind.OTHER, c) for c in OTHER_CAUSES])


# ------------------------------------------------------------------ events

@dataclass(frozen=True)
class WorkersStarted:
    """This node started the workers of a round."""


@dataclass(frozen=True)
class Stepped:
    """This node's workers' newest step is ``step`` (a heartbeat of the round running here)."""

    step: int


@dataclass(frozen=True)
class WorkersStopped:
    """This node's workers were stopped: for a restart (``restart``) whose
    cause is ``cause`` (a :class:`agent.reactor.StopCause` value), or for good."""

    cause: str
    restart: bool


@dataclass(frozen=True)
class LeftJob:
    """This node is out of the job: ``why`` is :data:`STANDBY` or :data:`ENDED`."""

    why: str


Event = Union[WorkersStarted, Stepped, WorkersStopped, LeftJob]


def events_of(commands: Iterable[reactor.Command]) -> list[Event]:
    """The accountant's events in the reactor's ``commands``, in order."""
    out: list[Event] = []
    for c in commands:
        if isinstance(c, reactor.StartWorkers):
            out.append(WorkersStarted())
        elif isinstance(c, reactor.StopWorkers):
            out.append(WorkersStopped(c.cause.value, c.cause.restart))
        elif isinstance(c, reactor.Transition) and c.to is AgentState.STANDBY:
            out.append(LeftJob(STANDBY))
        elif isinstance(c, reactor.Transition) and c.to.final:
            out.append(LeftJob(ENDED))
    return out


# -------------------------------------------------------------- accounting

def _seconds_of(totals: dict[tuple[Kind, str], float], kind: Kind | None = None) -> float:
    """The seconds ``totals`` charges to ``kind`` (all kinds: None)."""
    return sum(s for (k, _), s in totals.items() if kind is None or k is kind)


@dataclass
class Accountant:
    """The time of one agent, charged by kind and cause (seconds). Times are
    monotonic; ``start`` is when the agent started."""

    start: float
    totals: dict[tuple[Kind, str], float] = field(default_factory=dict)
    # Where time goes now: (kind, cause) while no workers step, None while
    # they do (then it is charged at the next step or stop).
    charging: tuple[Kind, str] | None = (Kind.OTHER, STARTUP)
    since: float = 0.0  # charged up to here
    last_step: int = -1  # of the workers stepping now
    high_step: int = -1  # the highest step seen: a step at or below it is a repeat
    redo_cause: str = reactor.StopCause.REQUESTED.value
    awaiting_first: bool = False  # workers started, no step heard from them yet
    step_s: float | None = None  # a step's time, as last heard
    # Time from the last step heard to a restart's stop, held until the next
    # round's first step: (where it goes, seconds, the highest step heard then).
    tail: tuple[tuple[Kind, str], float, int] | None = None

    def __post_init__(self) -> None:
        self.since = self.start

    def feed(self, event: Event, now: float) -> None:
        """Charge the time up to ``now`` and take ``event`` in."""
        now = max(now, self.since)  # a late event never charges time backwards
        if isinstance(event, Stepped):
            self._stepped(event.step, now)
            return
        if isinstance(event, WorkersStarted):
            self._charge(now)
            self.awaiting_first = True
            if self.charging == (Kind.OTHER, STANDBY):
                self.charging = (Kind.RECOVERY, _JOINED)
            return
        self._flush_tail()  # a second stop before a first step: the tail stays lost
        if isinstance(event, WorkersStopped) and event.restart:
            to = (Kind.RECOVERY, event.cause)
            self.redo_cause = event.cause
        elif isinstance(event, WorkersStopped):
            to = (Kind.OTHER, ENDED)
        else:
            to = (Kind.OTHER, event.why)
        if self.charging is None and to[0] is Kind.RECOVERY:
            # Steps made since the last one heard may survive in the state the
            # next round restores: the next round's first step tells.
            self.tail = (to, now - self.since, self.high_step)
        else:
            self._add(self.charging or to, now - self.since)
        self.since = now
        self.charging, self.awaiting_first = to, False

    def _add(self, key: tuple[Kind, str], seconds: float) -> None:
        if seconds > 0:
            self.totals[key] = self.totals.get(key, 0.0) + seconds

    def _charge(self, now: float) -> None:
        """Charge the time since ``since`` to where it goes now (not while stepping)."""
        if self.charging is not None:
            self._add(self.charging, now - self.since)
            self.since = now

    def _flush_tail(self) -> None:
        if self.tail is not None:
            key, seconds, _ = self.tail
            self._add(key, seconds)
            self.tail = None

    def _step_kind(self, step: int) -> tuple[Kind, str]:
        return (Kind.REPEATED, self.redo_cause) if step <= self.high_step \
            else (Kind.PRODUCTIVE, STEPS)

    def _first_step(self, step: int, now: float) -> None:
        """The first step of a round's workers: the recovery ends, less the
        step's own time; the tail of the last round is settled by where this
        round resumed (``step - 1``: the state restored)."""
        assert self.charging is not None
        gap = now - self.since
        own = min(gap, self.step_s or 0.0)
        self._add(self.charging, gap - own)
        if self.tail is not None:
            key, seconds, high = self.tail
            survived = min(seconds, max(0, step - 1 - high) * (self.step_s or 0.0))
            self._add((Kind.PRODUCTIVE, STEPS), survived)
            self._add(key, seconds - survived)
            if survived > 0:
                self.high_step = max(self.high_step, step - 1)
            self.tail = None
        self._add(self._step_kind(step), own)
        self.charging, self.awaiting_first, self.since = None, False, now
        self.last_step, self.high_step = step, max(self.high_step, step)

    def _stepped(self, step: int, now: float) -> None:
        if step < 0:
            return
        if self.charging is not None:
            if self.awaiting_first:
                self._first_step(step, now)
            return  # else a heartbeat of workers being stopped: nothing new starts
        done = step - self.last_step
        if done <= 0:
            return  # no new step yet: its time is charged with the next one
        seconds = now - self.since
        again = min(done, max(0, self.high_step - self.last_step))
        self._add((Kind.REPEATED, self.redo_cause), seconds * again / done)
        self._add((Kind.PRODUCTIVE, STEPS), seconds * (done - again) / done)
        self.since, self.last_step, self.step_s = now, step, seconds / done
        self.high_step = max(self.high_step, step)

    def settle(self, now: float) -> None:
        """Charge the time up to ``now`` where it goes without a step (never
        while stepping, nor a restart's tail: they wait for the next step)."""
        self._charge(max(now, self.since))

    def total(self, kind: Kind | None = None) -> float:
        """Seconds charged to ``kind`` (all kinds: None)."""
        return _seconds_of(self.totals, kind)


class Window:
    """The ETTR over the last ``window_s`` seconds, from samples of the
    accountant's productive and accounted totals (at most
    :data:`WINDOW_SAMPLES` per window)."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._every_s = window_s / WINDOW_SAMPLES
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()

    def add(self, now: float, productive_s: float, accounted_s: float) -> None:
        if not self._samples or now - self._samples[-1][0] >= self._every_s:
            self._samples.append((now, productive_s, accounted_s))
        # Keep the newest sample at or before the window's start: the span's base.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def ettr(self, productive_s: float, accounted_s: float) -> float | None:
        """Productive over accounted time since the window's base sample;
        None before anything was accounted."""
        if not self._samples:
            return None
        _, p0, a0 = self._samples[0]
        if accounted_s - a0 <= 0:
            return None
        return (productive_s - p0) / (accounted_s - a0)


@dataclass(frozen=True)
class Snapshot:
    """The accountant's totals (seconds by (kind, cause)) and the ETTR over
    ``window_s`` (None: nothing accounted yet)."""

    totals: dict[tuple[Kind, str], float]
    ettr: float | None
    window_s: float

    def kind_s(self, kind: Kind) -> float:
        return _seconds_of(self.totals, kind)

    def lost_by_cause(self) -> dict[str, float]:
        """Repeated plus recovery seconds of each restart cause that lost any."""
        out: dict[str, float] = {}
        for (k, cause), s in self.totals.items():
            if k in (Kind.REPEATED, Kind.RECOVERY) and s > 0:
                out[cause] = out.get(cause, 0.0) + s
        return out


def row(snap: Snapshot) -> GoodputRow:
    """The snapshot as the status record carries it (seconds rounded to 0.1)."""
    lost = sorted(snap.lost_by_cause().items(), key=lambda kv: -kv[1])
    return GoodputRow(ettr=-1.0 if snap.ettr is None else round(snap.ettr, 4),
                      window_s=snap.window_s,
                      productive_s=round(snap.kind_s(Kind.PRODUCTIVE), 1),
                      repeated_s=round(snap.kind_s(Kind.REPEATED), 1),
                      recovery_s=round(snap.kind_s(Kind.RECOVERY), 1),
                      other_s=round(snap.kind_s(Kind.OTHER), 1),
                      lost_by_cause=tuple((c, round(s, 1)) for c, s in lost))


class GoodputTracker:
    """An :class:`Accountant` and its :class:`Window` behind a lock: fed by the
    agent's loop (the reactor's commands) and by the heartbeat threads
    (steps), read by metrics scrapes and the status record (any thread)."""

    def __init__(self, start: float, window_s: float = DEFAULT_WINDOW_S):
        self._lock = threading.Lock()
        self._acct = Accountant(start)
        self._window = Window(window_s)
        self._window.add(start, 0.0, 0.0)

    def observe(self, commands: Iterable[reactor.Command], now: float) -> None:
        """The loop's reaction at ``now`` produced ``commands``."""
        events = events_of(commands)
        if events:
            with self._lock:
                for event in events:
                    self._acct.feed(event, now)
                self._sample(now)

    def stepped(self, step: int, now: float) -> None:
        """A heartbeat of the round running here left the node's newest step at ``step``."""
        with self._lock:
            self._acct.feed(Stepped(step), now)
            self._sample(now)

    def snapshot(self, now: float) -> Snapshot:
        """The totals and the ETTR as of ``now``."""
        with self._lock:
            self._acct.settle(now)
            self._sample(now)
            productive, accounted = self._acct.total(Kind.PRODUCTIVE), self._acct.total()
            return Snapshot(dict(self._acct.totals), self._window.ettr(productive, accounted),
                            self._window.window_s)

    def _sample(self, now: float) -> None:
        self._window.add(now, self._acct.total(Kind.PRODUCTIVE), self._acct.total())
