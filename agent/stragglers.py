"""Stragglers: the leader's pure rule that names a rank persistently slower than its peers.

Each agent sends the leader, per rank of its node, a windowed step time: the
median of the mean step times its worker sent with its recent heartbeats
(:mod:`agent.step_times`; the worker leaves out the first step after its start
or restore and every step with a checkpoint save). The leader passes what it
last read, with its monotonic ``now``, to :func:`judge`; no I/O and no clock
here, so tests move time by passing another ``now``.

The rules:

* A rank is *slow* at an observation when its step time is above the median
  of its peers' (every other rank with a time) by the factor
  ``threshold`` and by at least :data:`MIN_EXCESS_S`: a median, so one
  straggler cannot hide another's peers; its peers', so that with two ranks
  each is compared with the other.
* It is *named* when it was slow at every observation for ``window_s``: one
  slow sample, a garbage collection, a data-loader hiccup never last a window.
  A rank is named once per episode.
* The episode ends (and a later slowdown needs a full window again) when the
  rank is seen at most :func:`StragglerPolicy.clear_ratio` times its peers'
  median, halfway back to 1: hysteresis, so a rank that hovers at the
  threshold is not named again and again; or when it has no time any more (a
  new round renumbers the ranks: the caller starts a fresh state).
* Fewer than two ranks with a time: nothing is judged.
* A whole job that slows down moves its median with it: nobody is slower
  than their peers, nobody is named. Ranks slower than the median are
  compared with it, so when more than half of the ranks are slow, the fast
  ones are not called stragglers either.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Mapping

# Below this much above its peers a rank is not slow, whatever the ratio: with
# steps of a few milliseconds, timer and scheduling noise is a large fraction.
MIN_EXCESS_S = 0.005

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
    """A rank's windowed step time (seconds) and the node that runs it."""

    rank: int
    node_id: str
    step_s: float


@dataclass(frozen=True)
class Straggler:
    """A rank named a straggler: its step time and its peers' median (seconds),
    and when (the judge's clock) its episode began."""

    rank: int
    node_id: str
    step_s: float
    peers_s: float
    slow_since: float

    def ratio(self) -> float:
        return self.step_s / self.peers_s

    def reason(self, now: float) -> str:
        """One sentence for the event, the status and the log."""
        return (f"rank {self.rank} (node {self.node_id}) is a straggler: its steps take "
                f"{self.step_s:.3f} s, {self.ratio():.2f}x its peers' median of "
                f"{self.peers_s:.3f} s, for {now - self.slow_since:.0f} s")


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
    """Apply one observation of every rank's step time at ``now`` (the rules
    are in the module docstring)."""
    if len(times) < 2:
        return Judgement(StragglerState(), cleared=tuple(state.named.values()))
    slow_since: dict[int, float] = {}
    named: dict[int, Straggler] = {}
    newly: list[Straggler] = []
    cleared: list[Straggler] = []
    ordered = sorted(t.step_s for t in times)  # once: a job may have 100,000 ranks
    # No rank's peers have a median under this (the median without the slowest):
    # a rank this fast is slow for nobody, and needs no median of its own.
    fast_s = median_without(ordered, len(ordered) - 1) * policy.threshold
    for t in times:
        before = state.named.get(t.rank)
        if before is None and t.step_s <= fast_s:
            continue
        peers_s = median_without(ordered, bisect.bisect_left(ordered, t.step_s))
        if before is not None:
            now_s = Straggler(t.rank, t.node_id, t.step_s, peers_s, before.slow_since)
            if t.step_s > peers_s * policy.clear_ratio():  # the episode goes on
                slow_since[t.rank] = before.slow_since
                named[t.rank] = now_s
            else:
                cleared.append(now_s)
            continue
        if t.step_s <= peers_s * policy.threshold or t.step_s - peers_s < MIN_EXCESS_S:
            continue  # not slow: a window counts only a rank slow throughout
        since = state.slow_since.get(t.rank, now)
        slow_since[t.rank] = since
        if now - since >= policy.window_s:
            named[t.rank] = Straggler(t.rank, t.node_id, t.step_s, peers_s, since)
            newly.append(named[t.rank])
    if sum(r in state.named for r in named) + len(cleared) < len(state.named):
        # Some rank named before has no time now.
        seen = {t.rank for t in times}
        cleared += [s for r, s in state.named.items() if r not in seen]  # as last seen
    return Judgement(StragglerState(slow_since, named), tuple(newly), tuple(cleared))


def median_without(ordered: list[float], i: int) -> float:
    """The median of ``ordered`` (sorted, at least 2 values) without its value at ``i``."""
    n = len(ordered) - 1

    def at(k: int) -> float:  # the k-th of the others
        return ordered[k] if k < i else ordered[k + 1]

    half = n // 2
    return at(half) if n % 2 else (at(half - 1) + at(half)) / 2
