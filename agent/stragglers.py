"""Stragglers: the leader's pure rule that names a rank persistently slower than its peers.

Each agent sends the leader, per rank of its node, two windowed times per
step, the medians of the means its worker sent with its recent heartbeats
(:mod:`agent.step_times`; the worker leaves out the first step after its start
or restore and every step with a checkpoint save): its *wall* time, and its
*busy* time, how long its training thread ran on a CPU or waited for one
(not blocked: not waiting for its peers in a collective). Busy time is
measured on Linux by workers that run on CPUs (:mod:`elastic.worker.step_timer`);
a rank without it is judged by its wall time alone. The leader passes what it
last read, with its monotonic ``now``, to :func:`judge`; no I/O and no clock
here, so tests move time by passing another ``now``.

The rules:

* Each measure is compared among the ranks that have it, against the median
  of a rank's peers' (every other rank with that measure): a median, so one
  straggler cannot hide another's peers; its peers', so that with two ranks
  each is compared with the other.
* A rank is *slow* at an observation when its wall time is above its peers'
  median wall time by the factor ``threshold`` and by at least
  :data:`MIN_EXCESS_S`; or when its busy time is, against its peers' busy
  times, and its excess busy time would make its steps ``threshold`` times
  slower than without it (it is at least ``1 - 1/threshold`` of its wall
  time). Busy time is what names the rank that makes a lockstep job (DDP,
  FSDP) wait: there every rank's wall time is the slowest's. Its last
  condition keeps a rank busier than its peers by a sliver of a long step
  (rank 0's logging, a rank whose waits are a little noisier) from being
  named, however large the ratio of two small busy times.
* It is *named* when it was slow, by either measure, at every observation for
  ``window_s``: one slow sample, a garbage collection, a data-loader hiccup
  never last a window. It is named by the measure it is slow by then (wall
  when both), and once per episode.
* The episode ends (and a later slowdown needs a full window again) when the
  rank is no longer slow by that measure with :func:`StragglerPolicy.clear_ratio`
  for the threshold (halfway back to 1): hysteresis, so a rank that hovers at
  the threshold is not named again and again; or when it has no time of that
  measure any more (a new round renumbers the ranks: the caller starts a
  fresh state).
* Fewer than two ranks with a time: nothing is judged.
* A whole job that slows down moves its median with it: nobody is slower
  than their peers, nobody is named. Ranks slower than the median are
  compared with it, so when more than half of the ranks are slow, the fast
  ones are not called stragglers either.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Mapping

# Below this much above its peers a rank is not slow, whatever the ratio: with
# steps of a few milliseconds, timer and scheduling noise is a large fraction.
MIN_EXCESS_S = 0.005

# The measures, as named in reasons, status rows and records.
WALL, BUSY = "wall", "busy"

DEFAULT_THRESHOLD = 1.2
DEFAULT_WINDOW_S = 60.0
ACTIONS = ("report", "replace")


@dataclass(frozen=True)
class StragglerPolicy:
    """``--straggler-threshold``, ``--straggler-window`` and ``--straggler-action``."""

    threshold: float = DEFAULT_THRESHOLD
    window_s: float = DEFAULT_WINDOW_S
    action: str = "report"  # one of ACTIONS

    def clear_ratio(self) -> float:
        """The ratio at or under which a slow rank's episode ends."""
        return 1.0 + (self.threshold - 1.0) / 2

    def period_s(self) -> float:
        """How often step times are published and judged: six times a
        window, so a window spans several observations, and at most every
        5 s, so a job of thousands of nodes writes little (each node writes
        only when its times changed)."""
        return min(5.0, max(0.25, self.window_s / 6))


@dataclass(frozen=True)
class RankTime:
    """A rank's windowed wall and busy times (seconds per step; busy 0.0: not
    measured) and the node that runs it."""

    rank: int
    node_id: str
    step_s: float
    busy_s: float = 0.0

    def of(self, measure: str) -> float:
        """Its time by ``measure`` (WALL or BUSY)."""
        return self.busy_s if measure == BUSY else self.step_s


@dataclass(frozen=True)
class Straggler:
    """A rank named a straggler by ``measure``: its time per step by that
    measure and its peers' median of it (seconds), and when (the judge's
    clock) its episode began."""

    rank: int
    node_id: str
    step_s: float
    peers_s: float
    slow_since: float
    measure: str = WALL

    def ratio(self) -> float:
        return self.step_s / self.peers_s

    def took(self) -> str:
        """Its time, saying by which measure: ``its steps take 0.130 s``,
        ``busy 0.105 s per step``."""
        if self.measure == BUSY:
            return f"busy {self.step_s:.3f} s per step"
        return f"its steps take {self.step_s:.3f} s"

    def reason(self, now: float) -> str:
        """One sentence for the event, the status and the log."""
        return (f"rank {self.rank} (node {self.node_id}) is a straggler: {self.took()}, "
                f"{self.ratio():.2f}x its peers' median of {self.peers_s:.3f} s, "
                f"for {now - self.slow_since:.0f} s")


@dataclass(frozen=True)
class StragglerState:
    """What the rule remembers between observations: since when each slow rank
    has been slow, and which of them are named."""

    slow_since: Mapping[int, float] = field(default_factory=dict)
    named: Mapping[int, Straggler] = field(default_factory=dict)


@dataclass(frozen=True)
class Judgement:
    """The state after an observation, the ranks it named (new episodes
    only), and the ranks whose named episode ended (with their times now, or
    as last seen when they have none)."""

    state: StragglerState
    named: tuple[Straggler, ...] = ()
    cleared: tuple[Straggler, ...] = ()


def judge(state: StragglerState, times: list[RankTime], now: float,
          policy: StragglerPolicy) -> Judgement:
    """Apply one observation of every rank's times at ``now`` (the rules are
    in the module docstring)."""
    if len(times) < 2:
        return Judgement(StragglerState(), cleared=tuple(state.named.values()))
    slow_since: dict[int, float] = {}
    named: dict[int, Straggler] = {}
    newly: list[Straggler] = []
    cleared: list[Straggler] = []
    measures = {WALL: _Ranking([t.step_s for t in times], policy.threshold),
                BUSY: _Ranking([t.busy_s for t in times if t.busy_s > 0], policy.threshold)}
    wall_fast_s, busy_fast_s = measures[WALL].fast_s, measures[BUSY].fast_s
    for t in times:
        before = state.named.get(t.rank)
        if before is None and t.step_s <= wall_fast_s and t.busy_s <= busy_fast_s:
            continue  # the common case, kept to two comparisons
        if before is not None:
            now_s = _against_peers(t, before.measure, measures, before.slow_since)
            if now_s is not None and _over(now_s, t.step_s, policy.clear_ratio()):
                slow_since[t.rank] = before.slow_since  # the episode goes on
                named[t.rank] = now_s
            else:
                cleared.append(now_s or before)
            continue
        since = state.slow_since.get(t.rank, now)
        slow = _slow(t, measures, policy, since)
        if slow is None:
            continue  # not slow: a window counts only a rank slow throughout
        slow_since[t.rank] = since
        if now - since >= policy.window_s:
            named[t.rank] = slow
            newly.append(slow)
    if sum(r in state.named for r in named) + len(cleared) < len(state.named):
        # Some rank named before has no time now.
        seen = {t.rank for t in times}
        cleared += [s for r, s in state.named.items() if r not in seen]  # as last seen
    return Judgement(StragglerState(slow_since, named), tuple(newly), tuple(cleared))


class _Ranking:
    """One measure's values over the ranks that have it, sorted once (a job
    may have 100,000 ranks)."""

    def __init__(self, values: list[float], threshold: float):
        self.ordered = sorted(values)
        # No rank's peers have a median under this (the median without the
        # slowest): a rank this fast is slow for nobody, and needs no median
        # of its own. Infinite with fewer than two ranks: nobody is judged.
        self.fast_s = (median_without(self.ordered, len(self.ordered) - 1) * threshold
                       if len(self.ordered) >= 2 else math.inf)

    def peers_s(self, value: float) -> float:
        """The median of the others' values (``value`` is one of them, and
        the ranking holds two at least)."""
        return median_without(self.ordered, bisect.bisect_left(self.ordered, value))


def _against_peers(t: RankTime, measure: str, measures: dict[str, _Ranking],
                   since: float) -> Straggler | None:
    """``t`` by ``measure`` against its peers; None when it has no such time
    or no peers with one."""
    value, ranking = t.of(measure), measures[measure]
    if value <= 0 or len(ranking.ordered) < 2:
        return None
    return Straggler(t.rank, t.node_id, value, ranking.peers_s(value), since, measure)


def _over(s: Straggler, wall_s: float, ratio: float) -> bool:
    """Whether ``s`` is above its peers by ``ratio``; by busy time, its excess
    must also make its steps (``wall_s``) ``ratio`` times longer than without it."""
    if s.step_s <= s.peers_s * ratio:
        return False
    return s.measure == WALL or (s.step_s - s.peers_s) * ratio >= (ratio - 1) * wall_s


def _slow(t: RankTime, measures: dict[str, _Ranking], policy: StragglerPolicy,
          since: float) -> Straggler | None:
    """``t`` as a straggler, by the first measure it is slow by, with its
    episode begun at ``since``; None when it is slow by neither."""
    for measure in (WALL, BUSY):
        if t.of(measure) <= measures[measure].fast_s:
            continue
        s = _against_peers(t, measure, measures, since)
        if s is not None and s.step_s - s.peers_s >= MIN_EXCESS_S \
                and _over(s, t.step_s, policy.threshold):
            return s
    return None


def median_without(ordered: list[float], i: int) -> float:
    """The median of ``ordered`` (sorted, at least 2 values) without its value at ``i``."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th of the others
        return ordered[k] if k < i else ordered[k + 1]

    half = n // 2
    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2
