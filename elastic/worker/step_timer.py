"""A worker's step times, as its heartbeats carry them to the agent (stragglers).

Two measures of each step. Its *wall* time: from the end of the step before
it. Its *busy* time: how long the thread that ends the steps (the training
thread) ran on a CPU or waited in a run queue for one, from Linux's
``/proc/thread-self/schedstat`` (:class:`ThreadBusyClock`). Time the thread
spends blocked is neither: waiting for its peers in a collective (gloo's
waits sleep on a condition variable), sleeping, reading a file. So where
ranks run in lockstep (DDP, FSDP) and every rank's wall time is its slowest
peer's, the slow rank's busy time still stands out. Where schedstat is
missing (not Linux, an old kernel) only wall time is measured.

The training thread marks the end of each step (:meth:`StepTimer.step_ended`)
and whatever made the step in progress no measure of the rank's speed
(:meth:`StepTimer.untimed`: a checkpoint save, a wait for the agent to vouch
for the round); the heartbeat thread takes the means of the steps timed since
its last beat (:meth:`StepTimer.take`). The first step after the worker's
start (compilation, data loading, a restore) is never timed. Does not import
torch.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, NamedTuple

SCHEDSTAT = "/proc/thread-self/schedstat"

# The caller's (thread, busy nanoseconds since that thread started), or None
# where that cannot be known.
BusyClock = Callable[[], "tuple[int, int] | None"]


class ThreadBusyClock:
    """The calling thread's busy time (:data:`BusyClock`): on-CPU plus
    run-queue nanoseconds, the first two numbers of its schedstat.

    The file is opened once per reading thread and kept: a read is then one
    ``pread`` (about 2 us), where opening it at every step costs tens of
    microseconds or more on a loaded machine. A thread other than the last
    reader's (or a forked child: another thread id) opens its own.
    """

    def __init__(self, path: str = SCHEDSTAT):
        self._path = path
        self._fd = -1
        self._tid = 0  # the native id of the thread whose counters _fd reads
        self._missing = False

    def __call__(self) -> tuple[int, int] | None:
        """(the caller's native thread id, its busy ns); None where schedstat
        is missing (then always) or could not be read (tried again next call)."""
        if self._missing:
            return None
        tid = threading.get_native_id()
        if tid != self._tid and not self._open(tid):
            return None
        try:
            run_ns, wait_ns, _ = os.pread(self._fd, 128, 0).split()
            return tid, int(run_ns) + int(wait_ns)
        except (OSError, ValueError):  # the thread is gone, or a format not known
            self.close()
            return None

    def _open(self, tid: int) -> bool:
        self.close()
        try:
            self._fd = os.open(self._path, os.O_RDONLY)
        except OSError:
            self._missing = True
            return False
        self._tid = tid
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._tid = -1, 0


class Timed(NamedTuple):
    """Mean seconds per step of the steps timed (0.0: none): wall, and busy
    (0.0 also where busy time is not measured)."""

    wall_s: float
    busy_s: float


class StepTimer:
    """Times are the caller's monotonic seconds; ``busy`` is read by the
    thread that ends the steps (None: wall time only).

    No lock on the training thread's path (it runs at every step): one thread
    marks the steps and keeps running totals, replaced as one tuple (atomic
    under the GIL); the heartbeat thread alone takes the difference since its
    last take. ``untimed`` may come from another thread (a background save
    ending): at worst one step is timed or left out wrongly. A step ended by
    another thread than the step before it is timed for its wall time only.
    """

    def __init__(self, busy: BusyClock | None = None) -> None:
        self._busy = busy
        self._last_end: float | None = None
        self._last_busy: tuple[int, int] | None = None
        self._untimed = False
        # Since the start: wall seconds and steps, busy ns and steps.
        self._totals = (0.0, 0, 0, 0)
        self._taken = (0.0, 0, 0, 0)  # the totals at the last take

    def step_ended(self, now: float) -> None:
        """A step ended at ``now``: timed unless it is the first or was marked untimed."""
        busy = self._busy() if self._busy is not None else None
        last, last_busy = self._last_end, self._last_busy
        if last is not None and not self._untimed and now > last:
            seconds, steps, busy_ns, busy_steps = self._totals
            if busy is not None and last_busy is not None and busy[0] == last_busy[0]:
                busy_ns, busy_steps = busy_ns + busy[1] - last_busy[1], busy_steps + 1
            self._totals = (seconds + now - last, steps + 1, busy_ns, busy_steps)
        self._last_end, self._last_busy, self._untimed = now, busy, False

    def untimed(self) -> None:
        """The step in progress says nothing of this rank's speed."""
        self._untimed = True

    def take(self) -> Timed:
        """The means of the steps timed since the last call, and start counting afresh."""
        totals, taken = self._totals, self._taken
        self._taken = totals
        steps, busy_steps = totals[1] - taken[1], totals[3] - taken[3]
        wall = (totals[0] - taken[0]) / steps if steps else 0.0
        busy = (totals[2] - taken[2]) / busy_steps / 1e9 if busy_steps else 0.0
        # A running thread's schedstat is brought up to date at a scheduler
        # tick or switch, so a step's reading may hold up to a tick of the
        # next one: a thread is never busy for longer than the wall time.
        return Timed(wall, min(busy, wall))
