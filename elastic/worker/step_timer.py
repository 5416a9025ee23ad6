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

import threading


class StepTimer:
    """Thread-safe; times are the caller's monotonic seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_end: float | None = None
        self._untimed = False
        self._total_s = 0.0
        self._steps = 0

    def step_ended(self, now: float) -> None:
        """A step ended at ``now``: timed unless it is the first or was marked untimed."""
        with self._lock:
            if self._last_end is not None and not self._untimed and now > self._last_end:
                self._total_s += now - self._last_end
                self._steps += 1
            self._last_end, self._untimed = now, False

    def untimed(self) -> None:
        """The step in progress says nothing of this rank's speed."""
        with self._lock:
            self._untimed = True

    def take(self) -> float:
        """The mean seconds per step of the steps timed since the last call
        (0.0: none), and start counting afresh."""
        with self._lock:
            mean = self._total_s / self._steps if self._steps else 0.0
            self._total_s, self._steps = 0.0, 0
            return mean
