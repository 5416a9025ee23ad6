"""How often the memory tier snapshots: every k steps, k chosen from what a snapshot costs.

The rule (:func:`choose_every`): the smallest k with
``cost / (k * step interval) <= budget`` (1% by default), so that training
slows by at most the budget; k = 1 when a snapshot costs nothing measurable.
Every rank must snapshot the same steps (a set is complete only when every
rank has its step), so the ranks agree on the largest k any of them chose
(:class:`Cadence` takes that agreement as a function; the tier runs it once,
over the checkpointer's own group, after :data:`CALIBRATION_STEPS`).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

from elastic.errors import ConfigError

AUTO = "auto"
BUDGET = 0.01
# Snapshots taken (one per step) before k is fixed; the first is left out of the
# measure (it collects the state and maps the slot's memory for the first time).
# The median of the rest must be a steady step's: the first few steps of a
# group pay once-only costs (the other slot mapped, an LR warm-up changing the
# hyperparameters that each snapshot then serializes again), so most of the
# measured snapshots come after them.
CALIBRATION_STEPS = 10
MAX_EVERY = 1_000_000


def choose_every(cost_s: float, interval_s: float, budget: float = BUDGET) -> int:
    """The smallest k >= 1 with ``cost_s / (k * interval_s) <= budget``.
    ``interval_s`` is a step's time without the snapshot; one of 0 (steps too
    fast to time) gives the largest k."""
    if cost_s <= 0:
        return 1
    if interval_s <= 0:
        return MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(cost_s / (budget * interval_s) - 1e-9)))


def parse_every(every: int | str) -> int | None:
    """``memory_every`` as given: a positive int, or "auto" (None). Raises ConfigError."""
    if every == AUTO:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"memory_every must be a positive number of steps or {AUTO!r}, "
                          f"got {every!r}")
    return every


class Cadence:
    """Which steps get a snapshot. Fixed ``every``, or (None) calibrated: a
    snapshot at each of the first :data:`CALIBRATION_STEPS` steps, then
    ``agree(k)`` (every rank's largest) fixes k. ``record`` tells it what each
    snapshot cost and when each step ended (monotonic seconds)."""

    def __init__(self, every: int | None, agree: Callable[[int], int]):
        self.every = every
        self._agree = agree
        self._costs: list[float] = []
        self._intervals: list[float] = []
        self._last_end: float | None = None
        self._last_cost = 0.0
        self._steps = 0

    @property
    def calibrating(self) -> bool:
        return self.every is None

    def due(self, step: int) -> bool:
        """Whether ``step`` gets a snapshot (call once per step, every rank alike)."""
        self._steps += 1
        if self.every is None and self._steps > CALIBRATION_STEPS:
            self.every = self._agree(self.proposal())
        if self.every is None:
            return True
        return step % self.every == 0

    def record(self, now: float, cost_s: float) -> None:
        """A step ended at ``now`` (monotonic seconds) and its snapshot, taken
        after that, cost ``cost_s`` (0: none). A step's interval leaves out the
        previous step's snapshot."""
        if self._last_end is not None:
            self._intervals.append(max(0.0, now - self._last_end - self._last_cost))
        if self.every is None and cost_s > 0:
            self._costs.append(cost_s)
        self._last_end, self._last_cost = now, cost_s

    def proposal(self) -> int:
        """This rank's k from what it measured (the first snapshot left out)."""
        costs = self._costs[1:] or self._costs
        intervals = self._intervals or [0.0]
        return choose_every(statistics.median(costs) if costs else 0.0,
                            statistics.median(intervals))
