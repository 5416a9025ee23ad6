"""A worker's step times for the agent: what is timed, and the training thread's busy time."""

from __future__ import annotations

import os
import threading
import time

import pytest

from elastic.worker.step_timer import SCHEDSTAT, StepTimer, ThreadBusyClock, Timed

needs_schedstat = pytest.mark.skipif(not os.path.exists(SCHEDSTAT),
                                     reason="no /proc/thread-self/schedstat here")


class BusyCounter:
    """A busy clock the test moves: (thread, busy ns) as set."""

    def __init__(self) -> None:
        self.thread, self.ns = 1, 0

    def __call__(self) -> tuple[int, int]:
        return self.thread, self.ns


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_steps_are_timed_from_the_end_of_the_step_before_and_averaged_per_beat():
    timer = StepTimer()
    timer.step_ended(10.0)  # the first step: from the start, never timed
    assert timer.take() == Timed(0.0, 0.0)
    timer.step_ended(10.2)
    timer.step_ended(10.6)
    assert timer.take() == pytest.approx(Timed(0.3, 0.0)), "no busy clock: wall time alone"
    assert timer.take() == Timed(0.0, 0.0), "each beat sends the steps since the last one"


def test_a_step_with_a_save_or_a_hold_is_not_timed_and_the_next_one_is():
    busy = BusyCounter()
    timer = StepTimer(busy)
    timer.step_ended(0.0)
    timer.untimed()  # a checkpoint save in this step
    busy.ns += 4_000_000_000
    timer.step_ended(5.0)
    busy.ns += 30_000_000
    timer.step_ended(5.1)
    assert timer.take() == pytest.approx(Timed(0.1, 0.03))


def test_busy_time_is_the_mean_of_the_steps_timed_and_a_change_of_thread_is_left_out():
    busy = BusyCounter()
    timer = StepTimer(busy)
    timer.step_ended(0.0)
    busy.ns += 20_000_000
    timer.step_ended(0.1)
    busy.ns += 40_000_000
    timer.step_ended(0.2)
    assert timer.take() == pytest.approx(Timed(0.1, 0.03))
    # Another thread ends a step: its counter is not the last one's.
    busy.thread, busy.ns = 2, 9_000_000_000
    timer.step_ended(0.3)
    assert timer.take() == pytest.approx(Timed(0.1, 0.0)), "timed for its wall time alone"
    busy.ns += 10_000_000
    timer.step_ended(0.4)
    assert timer.take() == pytest.approx(Timed(0.1, 0.01))


def test_busy_time_never_exceeds_the_wall_time_of_the_same_steps():
    busy = BusyCounter()
    timer = StepTimer(busy)
    timer.step_ended(0.0)
    busy.ns += 21_000_000  # the counter took in a tick of the next step
    timer.step_ended(0.02)
    assert timer.take() == pytest.approx(Timed(0.02, 0.02))


@needs_schedstat
def test_the_thread_s_busy_time_counts_spinning_but_not_sleeping():
    clock = ThreadBusyClock()
    timer = StepTimer(clock)
    timer.step_ended(time.monotonic())
    spin(0.05)
    timer.step_ended(time.monotonic())
    spun = timer.take()
    time.sleep(0.05)
    timer.step_ended(time.monotonic())
    slept = timer.take()

    # Run-queue waits count as busy, so even on a loaded machine a spin is busy
    # for about its wall time; a sleep is busy only for its wake-up.
    assert spun.wall_s >= 0.05 and spun.busy_s >= 0.9 * 0.05, spun
    assert slept.wall_s >= 0.05 and slept.busy_s < 0.5 * slept.wall_s, slept


@needs_schedstat
def test_each_thread_reads_its_own_counters():
    clock = ThreadBusyClock()
    own = clock()
    seen = []
    other = threading.Thread(target=lambda: (spin(0.05), seen.append(clock())))
    other.start()
    other.join()
    mine = clock()

    assert own[0] == mine[0] == threading.get_native_id()
    assert seen[0][0] == other.native_id
    assert mine[1] - own[1] < 0.04e9, "the other thread's spin is not this thread's"


def test_without_schedstat_there_is_no_busy_time_and_steps_are_timed_by_the_wall():
    clock = ThreadBusyClock(path="/proc/no-such-schedstat")
    timer = StepTimer(clock)
    timer.step_ended(0.0)
    timer.step_ended(0.1)
    assert clock() is None
    assert timer.take() == pytest.approx(Timed(0.1, 0.0))
