"""The hang verdict is bounded in time: ``hung_workers`` judges a silent or stalled worker
hung just after ``hang_timeout_s``, never well before and never much later.

Each test sets a worker's history through its heartbeats, then asks for the verdict
just before and just after the bound (``EPSILON`` either side), so a threshold off
by a factor (three times too long, or half) fails. Time is passed in, never slept.
"""

from __future__ import annotations

import os
import threading
import time
import types

import pytest

from agent.health import (
    HangTimeouts,
    WorkerHealth,
    WorkerTable,
    hung_workers,
    next_hang_verdict_at,
    node_progress,
)

TIMEOUT_S = 30.0
EPSILON = 0.5
T0 = 1_000.0  # a monotonic time at which the worker was heard from


def worker(rank: int = 0) -> WorkerHealth:
    return WorkerHealth(local_rank=rank, rank=rank, started_at=T0 - 100.0)


class Beats:
    """A worker's heartbeats, one a second from ``start``, sent up to a given time:
    a test feeds them up to the moment it asks for a verdict, never beyond."""

    def __init__(self, w: WorkerHealth, start: float):
        self.w = w
        self.next = start

    def up_to(self, end: float, step: int, saving_for_s=lambda now: 0.0) -> None:
        while self.next <= end:
            self.w.on_heartbeat(self.next, step, saving_for_s(self.next))
            self.next += 1.0


def verdict(w: WorkerHealth, now: float) -> str | None:
    """The reason ``w`` is judged hung at ``now``, or None."""
    found = hung_workers([w], now, TIMEOUT_S)
    assert all(judged is w for judged, _ in found)
    return found[0][1] if found else None


BEFORE = T0 + TIMEOUT_S - EPSILON
AFTER = T0 + TIMEOUT_S + EPSILON


# --- no heartbeat -------------------------------------------------------------------------------


def test_a_silent_worker_is_hung_just_after_the_timeout():
    w = worker(rank=3)
    w.on_heartbeat(T0, step=-1, saving_for_s=0.0)  # alive, no step yet; then silent

    assert verdict(w, BEFORE) is None
    reason = verdict(w, AFTER)
    assert reason is not None and "rank 3 sent no heartbeat for 30.5 s" in reason


def test_silence_is_judged_even_after_progress():
    w = worker()
    w.on_heartbeat(T0 - 10.0, step=6, saving_for_s=0.0)
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)  # then silent

    assert verdict(w, BEFORE) is None
    assert "sent no heartbeat" in verdict(w, AFTER)


def test_a_worker_that_never_spoke_is_never_judged():
    # a plain torch script without the library: no heartbeat ever
    assert verdict(worker(), T0 + 100 * TIMEOUT_S) is None


# --- no progress --------------------------------------------------------------------------------


def test_a_stalled_worker_is_hung_just_after_the_timeout():
    w = worker(rank=1)
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)  # step 7 completed at T0, then none
    # its heartbeat thread lives on (a deadlock, a collective stuck on a dead peer)
    beats = Beats(w, T0 + 1.0)

    beats.up_to(BEFORE, step=7)
    assert verdict(w, BEFORE) is None
    beats.up_to(AFTER, step=7)
    reason = verdict(w, AFTER)
    assert reason is not None and "rank 1 made no progress for 30.5 s after step 7" in reason


def test_each_step_restarts_the_progress_clock():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)
    beats = Beats(w, T0 + 1.0)
    beats.up_to(T0 + 19.0, step=7)
    w.on_heartbeat(T0 + 20.0, step=8, saving_for_s=0.0)
    beats = Beats(w, T0 + 21.0)

    beats.up_to(BEFORE + 20.0, step=8)
    assert verdict(w, BEFORE + 20.0) is None
    beats.up_to(AFTER + 20.0, step=8)
    assert "after step 8" in verdict(w, AFTER + 20.0)


# --- an announced save --------------------------------------------------------------------------


SAVE_S = 120.0  # longer than the hang timeout: a big checkpoint


def test_a_saving_worker_is_judged_only_once_its_announced_save_time_passed():
    w = worker(rank=2)
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)
    saving_from = T0 + 5.0
    until = saving_from + SAVE_S

    def left(now: float) -> float:  # the proto's saving_for_s: time left from now
        return max(0.0, until - now)

    beats = Beats(w, saving_from)
    # long past the hang timeout without a step, but within the announced time
    beats.up_to(AFTER, step=7, saving_for_s=left)
    assert verdict(w, AFTER) is None
    beats.up_to(until - EPSILON, step=7, saving_for_s=left)
    assert verdict(w, until - EPSILON) is None
    # the announced time passed and still no step: hung, by the progress rule
    beats.up_to(until + EPSILON, step=7, saving_for_s=left)
    reason = verdict(w, until + EPSILON)
    assert reason is not None and "rank 2 made no progress" in reason


def test_a_save_does_not_excuse_silence():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=SAVE_S)  # then the process froze (SIGSTOP)

    assert verdict(w, BEFORE) is None
    assert "sent no heartbeat" in verdict(w, AFTER)


def test_the_end_of_a_save_restores_the_progress_rule():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=SAVE_S)
    w.on_heartbeat(T0 + 10.0, step=7, saving_for_s=0.0)  # saved; then stuck at step 7
    beats = Beats(w, T0 + 11.0)

    beats.up_to(BEFORE, step=7)
    assert verdict(w, BEFORE) is None
    beats.up_to(AFTER, step=7)
    assert "made no progress" in verdict(w, AFTER)


# --- exiting, and detection off -----------------------------------------------------------------


def test_an_exiting_worker_is_never_judged():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)
    w.on_heartbeat(T0 + 1.0, step=7, saving_for_s=0.0, exiting=True)
    # interpreter shutdown: silent and without progress for as long as it takes
    assert verdict(w, T0 + 100 * TIMEOUT_S) is None


def test_an_exit_is_not_taken_back_by_a_late_heartbeat():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=0.0, exiting=True)
    w.on_heartbeat(T0 + 1.0, step=7, saving_for_s=0.0)  # sent before the exit, arrived after
    assert verdict(w, T0 + 100 * TIMEOUT_S) is None


def test_only_the_hung_workers_of_several_are_named():
    fine, stalled, silent = worker(0), worker(1), worker(2)
    for w in (fine, stalled, silent):
        w.on_heartbeat(T0, 7, 0.0)
    for now in range(int(T0) + 1, int(AFTER) + 1):
        fine.on_heartbeat(float(now), 7 + now - int(T0), 0.0)
        stalled.on_heartbeat(float(now), 7, 0.0)

    found = hung_workers([fine, stalled, silent], AFTER, TIMEOUT_S)
    assert [(w.rank, "progress" if "progress" in why else "heartbeat") for w, why in found] \
        == [(1, "progress"), (2, "heartbeat")]


def test_a_zero_timeout_turns_detection_off():
    w = worker()
    w.on_heartbeat(T0, step=7, saving_for_s=0.0)
    assert hung_workers([w], T0 + 1e6, 0.0) == []


# --- what the worker's heartbeat thread sends -----------------------------------------------------


class RecordingClient:
    """Stands in for the worker's channel to its agent; records each heartbeat."""

    def __init__(self):
        self.sent: list[float] = []
        self.times: list[tuple[float, float]] = []  # (step_time_s, step_busy_s) of each
        self.cond = threading.Condition()
        self.confirmed_at = time.monotonic()

    def heartbeat(self, rank, local_rank, pid, round, step, saving_for_s=0.0,  # noqa: A002
                  exiting=False, step_time_s=0.0, snapshots=0, step_busy_s=0.0):
        with self.cond:
            self.sent.append(saving_for_s)
            self.times.append((step_time_s, step_busy_s))
            self.cond.notify_all()
        return False

    def close(self):
        pass


# A save's announced time counts down from beat to beat: re-sending the whole
# announced time with every beat would move the agent's deadline forward at
# each one, and a worker stuck in a save would never be judged hung.
def test_the_heartbeats_of_a_save_count_its_time_down():
    pytest.importorskip("torch")
    from elastic.worker import runtime

    beat = runtime.Heartbeat(RecordingClient(), interval_s=0.02)
    try:
        beat.report(7, saving_for_s=SAVE_S)
        with beat.client.cond:
            assert beat.client.cond.wait_for(
                lambda: len([s for s in beat.client.sent if s > 0]) >= 3, timeout=30.0), \
                "the heartbeat thread sent fewer than 3 heartbeats in 30 s"
            during = [s for s in beat.client.sent if s > 0][:3]
    finally:
        beat.close()
    # each heartbeat a little later says a little less time is left
    assert during[0] <= SAVE_S and during[0] > during[1] > during[2], during


def test_the_heartbeats_carry_the_steps_wall_and_busy_times():
    pytest.importorskip("torch")
    from elastic.worker import runtime
    from elastic.worker.step_timer import SCHEDSTAT

    beat = runtime.Heartbeat(RecordingClient(), interval_s=0.05)
    try:
        for step in range(8):  # steps of 20 ms of work
            end = time.monotonic() + 0.02
            while time.monotonic() < end:
                pass
            beat.report(step)
        with beat.client.cond:
            assert beat.client.cond.wait_for(
                lambda: any(wall > 0 for wall, _ in beat.client.times), timeout=30.0)
            timed = [t for t in beat.client.times if t[0] > 0]
    finally:
        beat.close()
    wall, busy = timed[0]
    assert wall >= 0.02
    if os.path.exists(SCHEDSTAT):  # the steps are work, not waits: busy about as long
        assert 0.9 * 0.02 <= busy <= wall, timed
    else:
        assert busy == 0.0


def test_busy_time_is_not_sent_once_cuda_is_in_use():
    pytest.importorskip("torch")
    from elastic.worker.runtime import busy_tells

    assert busy_tells(types.SimpleNamespace(is_initialized=lambda: False))
    assert not busy_tells(types.SimpleNamespace(is_initialized=lambda: True))


def test_a_worker_waits_for_its_agent_to_vouch_for_the_round_before_its_next_step():
    # What a worker resumed after a freeze longer than the lease does: no step
    # until its agent confirms the round (or stops it).
    pytest.importorskip("torch")
    from elastic.worker import runtime

    beat = runtime.Heartbeat(RecordingClient(), interval_s=0.02)
    try:
        beat.client.confirmed_at = time.monotonic() - 10.0  # last vouched 10 s ago
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (beat.wait_until_confirmed(5.0), done.set()))
        waiter.start()
        assert not done.wait(0.3), "stepped without the agent vouching for the round"
        beat.client.confirmed_at = time.monotonic()  # the agent answers without hold
        assert done.wait(5.0)
        beat.wait_until_confirmed(0.0)  # 0: never waits
    finally:
        beat.close()


def test_the_next_verdict_comes_at_the_earliest_of_silence_and_stall_not_before():
    # Heard from at T0 (step 5, progress at T0 - 10): a stall verdict comes first.
    w = worker()
    w.on_heartbeat(T0 - 10.0, 5, 0.0)
    w.on_heartbeat(T0, 5, 0.0)
    at = next_hang_verdict_at([w], TIMEOUT_S)
    assert at == T0 - 10.0 + TIMEOUT_S
    assert hung_workers([w], at - EPSILON, TIMEOUT_S) == []
    assert hung_workers([w], at + EPSILON, TIMEOUT_S) != []


def test_a_save_announced_moves_the_stall_verdict_to_its_end():
    w = worker()
    w.on_heartbeat(T0, 5, saving_for_s=2 * TIMEOUT_S)
    at = next_hang_verdict_at([w], TIMEOUT_S)
    assert at == T0 + TIMEOUT_S  # silence still counts while saving
    w.on_heartbeat(T0 + 1.0, 5, saving_for_s=2 * TIMEOUT_S)
    assert next_hang_verdict_at([w], TIMEOUT_S) == T0 + 1.0 + TIMEOUT_S


def test_no_verdict_is_due_without_detection_a_heard_worker_or_one_still_running():
    quiet, leaving = worker(0), worker(1)
    leaving.on_heartbeat(T0, 3, 0.0, exiting=True)
    assert next_hang_verdict_at([quiet, leaving], TIMEOUT_S) is None
    talking = worker(2)
    talking.on_heartbeat(T0, 3, 0.0)
    assert next_hang_verdict_at([talking], 0.0) is None


class TestHang:
    def test_silent_script_is_never_judged(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        assert hung_workers([w], now=10_000.0, timeouts=5) == []

    def test_no_heartbeat_past_the_timeout_is_a_hang(self):
        w = WorkerHealth(local_rank=0, rank=3, started_at=0.0)
        w.on_heartbeat(10.0, -1, 0.0)
        assert hung_workers([w], 14.9, 5) == []
        [(hung, reason)] = hung_workers([w], 15.5, 5)
        assert hung is w and "rank 3 sent no heartbeat for 5.5 s" in reason

    def test_heartbeats_without_progress_are_a_hang_after_the_first_step(self):
        w = WorkerHealth(local_rank=0, rank=1, started_at=0.0)
        for t in range(10, 30):
            w.on_heartbeat(float(t), 7, 0.0)
        [(_, reason)] = hung_workers([w], 29.0, 5)
        assert "made no progress for 19.0 s after step 7" in reason

    def test_announced_save_suspends_the_progress_check(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(10.0, 5, 0.0)
        w.on_heartbeat(14.0, 5, 60.0)  # saving for up to a minute
        w.on_heartbeat(30.0, 5, 60.0)
        assert hung_workers([w], 31.0, 5) == []

    def test_an_exiting_worker_is_not_judged(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(10.0, 5, 0.0)
        w.on_heartbeat(11.0, 5, 0.0, exiting=True)
        assert hung_workers([w], 100.0, 5) == []

    def test_zero_timeout_turns_detection_off(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        w.on_heartbeat(0.0, 1, 0.0)
        assert hung_workers([w], 1e6, 0) == []

    def test_step_rate(self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        for i in range(5):
            w.on_heartbeat(float(i), i * 10, 0.0)
        assert w.step_rate() == pytest.approx(10.0)


class TestNodeProgress:
    def test_a_node_is_at_its_newest_worker_s_step_and_its_slowest_worker_s_rate(self):
        assert node_progress([(7, 2.5), (9, 1.5), (8, 3.0)]) == (9, 1.5)

    def test_a_node_without_workers_has_no_step_and_no_rate(self):
        assert node_progress([]) == (-1, 0.0)


class TestWorkerTable:
    def test_heartbeats_of_known_ranks_are_recorded_and_give_the_node_s_progress(self):
        table = WorkerTable()
        table.reset([4, 5], now=0.0)
        assert table.beat(0, 1.0, 3, 0.0, False) == (3, 0.0)
        assert table.beat(1, 1.0, 2, 0.0, False) == (3, 0.0)
        assert table.beat(1, 2.0, 4, 0.0, False) == (4, 0.0)  # rank 0's rate still unknown
        assert table.beat(2, 2.0, 9, 0.0, False) is None  # no such local rank
        assert [(w.local_rank, w.rank, w.step) for w in table.snapshot()] == [(0, 4, 3),
                                                                            (1, 5, 4)]

    def test_a_snapshot_is_a_copy_and_a_reset_starts_afresh(self):
        table = WorkerTable()
        table.reset([0], now=0.0)
        table.beat(0, 1.0, 1, 0.0, False)
        before = table.snapshot()
        table.beat(0, 2.0, 2, 0.0, False)
        assert before[0].step == 1 and before[0].steps == [(1.0, 1)]
        table.reset([7], now=5.0)
        assert [(w.rank, w.step, w.started_at) for w in table.snapshot()] == [(7, -1, 5.0)]


# --- the first progress, and time that does not count ----------------------------------------

FIRST_S = 100.0
TWO = HangTimeouts(after_s=TIMEOUT_S, first_s=FIRST_S)


def test_a_worker_is_not_judged_on_progress_before_its_first_unless_the_script_reported_before():
    table = WorkerTable()
    table.reset([0], now=T0)
    [fresh] = table.snapshot()
    assert not fresh.judged
    assert hung_workers([fresh], T0 + 10 * FIRST_S, TWO) == []
    table.beat(0, T0 + 1.0, 0, 0.0, False)  # its first optimizer step
    assert table.snapshot()[0].judged
    table.reset([0], now=T0 + 50.0)  # the next round: the script is known to report
    [again] = table.snapshot()
    assert again.judged and again.step == -1
    assert hung_workers([again], T0 + 50.0 + FIRST_S - EPSILON, TWO) == []
    [(_, reason)] = hung_workers([again], T0 + 50.0 + FIRST_S + EPSILON, TWO)
    assert "made no progress for 100.5 s since its start (first-step hang timeout 100 s)" \
        in reason
    assert next_hang_verdict_at([again], TWO) == T0 + 50.0 + FIRST_S


def test_the_short_timeout_applies_from_the_first_progress():
    w = worker()
    w.on_heartbeat(T0, -1, 0.0)  # speaking, no progress yet: silence gets the first timeout
    assert hung_workers([w], T0 + TIMEOUT_S + EPSILON, TWO) == []
    w.on_heartbeat(T0 + 1.0, 0, 0.0)
    assert hung_workers([w], T0 + 1.0 + TIMEOUT_S - EPSILON, TWO) == []
    [(_, reason)] = hung_workers([w], T0 + 1.0 + TIMEOUT_S + EPSILON, TWO)
    assert reason.endswith("(hang timeout 30 s)")


def test_time_before_not_before_does_not_count():
    w = worker()
    w.on_heartbeat(T0, 5, 0.0)
    back = T0 + 2 * TIMEOUT_S  # etcd came back: the outage's time does not count
    assert hung_workers([w], back + TIMEOUT_S - EPSILON, TIMEOUT_S, not_before=back) == []
    assert hung_workers([w], back + TIMEOUT_S + EPSILON, TIMEOUT_S, not_before=back) != []
    assert next_hang_verdict_at([w], TIMEOUT_S, not_before=back) == back + TIMEOUT_S
