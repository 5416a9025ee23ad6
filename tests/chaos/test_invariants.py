"""The campaign's plan and its pure checks, without running a campaign (fast, no root)."""

from __future__ import annotations

from tests.chaos import faults, invariants
from tests.chaos.cluster import RoundSpan
from tests.chaos.faults import KINDS, FaultRecord


def record(kind: str, t_start: float = 100.0, **fields) -> FaultRecord:
    return FaultRecord(kind, "target", t_start, t_end=t_start + 5,
                       expect_restart=KINDS[kind].expect_restart, event=KINDS[kind].event,
                       **fields)


def event(t: float, kind: str, message: str) -> dict:
    return {"time": t, "node_id": "n1", "round": 2, "kind": kind, "message": message}


def test_every_kind_is_planned_once_where_it_can_be_injected():
    assert sorted(faults.plan(3, len(KINDS), isolated=True, own_disk=True)) == sorted(KINDS)
    without_root = faults.plan(3, len(KINDS), isolated=False, own_disk=False)
    assert "disk_full" not in without_root and "cut_etcd" not in without_root
    assert "ckpt_crash" in without_root  # a worker crash needs no root
    assert faults.unavailable(KINDS["disk_full"], isolated=True, own_disk=False) \
        == "needs a checkpoint disk of its own"


def test_a_full_disk_shows_only_through_a_failed_save_with_enospc():
    full = record("disk_full")
    committed = event(101, "checkpoint", "checkpoint of step 120 committed (step-000000000120)")
    failed = event(102, "checkpoint", "checkpoint of step 130 failed (reported by rank 0): "
                                      "... [Errno 28 ENOSPC] No space left on device ...")
    assert not invariants.faults_visible([full], [committed], {}).ok
    assert invariants.faults_visible([full], [committed, failed], {}).ok
    assert not invariants.faults_visible([full], [dict(failed, time=99.0)], {}).ok  # before


def test_a_crash_mid_save_shows_through_the_restart():
    crash = record("ckpt_crash")
    assert not invariants.faults_visible([crash], [], {}).ok
    assert invariants.faults_visible([crash], [event(101, "round", "round 3: ...")], {}).ok


def test_an_interrupted_save_must_never_commit_and_must_be_cleaned_up():
    crash = record("ckpt_crash", interrupted_save=(109, 2))
    seen_ok = [(90.0, 99, 2), (120.0, 109, 3)]  # step 109 again, but by the next round
    assert invariants.interrupted_saves_discarded([crash], seen_ok, []).ok
    assert not invariants.interrupted_saves_discarded([crash], seen_ok + [(121.0, 109, 2)],
                                                      []).ok
    left = invariants.interrupted_saves_discarded([crash], seen_ok, [".tmp-step-109-round-2"])
    assert not left.ok and "still there" in left.detail
    assert not invariants.interrupted_saves_discarded([crash], seen_ok, None).ok


def span(number: int, first_t: float, steps_by_rank: dict[int, tuple[int, int]],
         world: int = 2) -> RoundSpan:
    """A round whose ranks logged steps ``first..last`` (``steps_by_rank``)."""
    s = RoundSpan(number, world=world, first_t=first_t)
    for rank, (first, last) in steps_by_rank.items():
        s.first_step = min(s.first_step, first)
        s.last_step = max(s.last_step, last)
        s.ranks[rank] = ("n1", 100 + rank, last)
    return s


def test_a_restart_may_resume_at_most_the_snapshot_interval_behind():
    # Round 2: rank 0 got to step 40, rank 1 to step 39: every rank completed step 39.
    before = span(2, 10.0, {0: (0, 40), 1: (0, 39)})
    crash = [record("worker_kill", t_start=50.0)]
    for first, ok in [(40, True), (41, True), (39, True), (38, False), (30, False)]:
        after = span(3, 60.0, {0: (first, first + 5), 1: (first, first + 5)})
        check = invariants.memory_resume_bounded({2: before, 3: after}, crash, every=1)
        assert check.ok is ok, (first, check.detail)
    lost = invariants.memory_resume_bounded(
        {2: before, 3: span(3, 60.0, {0: (30, 35), 1: (30, 35)})}, crash, every=1)
    assert "10 steps behind step 39" in lost.detail and "after worker_kill" in lost.detail
    assert invariants.memory_resume_bounded(
        {2: before, 3: span(3, 60.0, {0: (30, 35), 1: (30, 35)})}, crash, every=10).ok


def test_a_round_where_a_rank_logged_nothing_completed_only_its_start():
    started = span(2, 10.0, {0: (20, 25)})  # rank 1 never stepped: nothing past 19
    assert invariants.completed_by_every_rank(started) == 19
    resumed = span(3, 60.0, {0: (20, 22), 1: (20, 22)})
    assert invariants.memory_resume_bounded({2: started, 3: resumed}, [], every=1).ok
