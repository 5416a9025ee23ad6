"""A worker's step times, as its heartbeats carry them to the agent (stragglers).

The training thread marks the end of each step (:meth:`StepTimer.step_ended`)
and whatever made the step in progress no measure of the rank's speed
(:meth:`StepTimer.untimed`: a checkpoint save, a wait for the agent to vouch
for the round); the heartbeat thread takes the mean of the steps timed since
its last beat (:meth:`StepTimer.take`). A step is timed from the end of the
step before it, so the first step after the worker's start (compilation, data
loading, a restore) is never timed. Does not import torch.
"""

from __future__ import annotations


class StepTimer:
    """Times are the caller's monotonic seconds.

    No lock on the training thread's path (it runs at every step): one thread
    marks the steps and keeps running totals, replaced as one tuple (atomic
    under the GIL); the heartbeat thread alone takes the difference since its
    last take. ``untimed`` may come from another thread (a background save
    ending): at worst one step is timed or left out wrongly.
    """

    def __init__(self) -> None:
        self._last_end: float | None = None
        self._untimed = False
        self._totals = (0.0, 0)  # seconds and steps timed since the start
        self._taken = (0.0, 0)  # the totals at the last take

    def step_ended(self, now: float) -> None:
        """A step ended at ``now``: timed unless it is the first or was marked untimed."""
        last = self._last_end
        if last is not None and not self._untimed and now > last:
            seconds, steps = self._totals
            self._totals = (seconds + now - last, steps + 1)
        self._last_end, self._untimed = now, False

    def untimed(self) -> None:
        """The step in progress says nothing of this rank's speed."""
        self._untimed = True

    def take(self) -> float:
        """The mean seconds per step of the steps timed since the last call
        (0.0: none), and start counting afresh."""
        totals, (seconds, steps) = self._totals, self._taken
        self._taken = totals
        return (totals[0] - seconds) / (totals[1] - steps) if totals[1] > steps else 0.0
