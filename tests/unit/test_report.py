"""The job report from hand-built histories (tests/fakes/job_history.py): pure,
times given, no store (the last test reads one from the in-memory store).
tests/integration/test_report.py checks the same against a real job, and renders
the page in a real browser."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

import pytest

from agent import report_html, report_text
from agent.report import GOODPUT_SOURCE
from agent.report_source import read_report
from agent.report_model import FaultKind, JobReport, Recovery, RoundEnd
from agent.status_record import MemoryTierRow, StatusRecord
from elastic.checkpoint.api import CommitEntry
from elastic.events import EVENTS_PER_WRITER, KIND_ROUND, event_op
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import Member, Round
from tests.fakes.clock import FakeClock
from tests.fakes.job_history import CRASH, T0, Job, crashed_job, first_round
from tests.fakes.memory_store import MemoryStore

def parts_add_up(report: JobReport) -> None:
    g = report.goodput
    assert g.productive_s + g.rework_s + g.lost_s + g.other_s == pytest.approx(g.span_s)
    assert g.source == GOODPUT_SOURCE


def test_a_crashed_worker_is_one_fault_with_its_rank_node_and_time_until_the_workers_ran():
    report = crashed_job().report(now=50.0)

    assert report.state == "succeeded" and report.history.complete
    assert [(r.number, r.members, r.world_size, r.end) for r in report.rounds] == [
        (1, ("a", "b"), 4, RoundEnd.FAULT), (2, ("a", "b"), 4, RoundEnd.SUCCEEDED)]
    [fault] = report.faults
    assert (fault.kind, fault.rank, fault.node, fault.reported_by, fault.cause) == (
        FaultKind.WORKER_EXIT, 3, "b", "b", CRASH)
    # Detected at 20 s, recovered when the last member of round 2 ran (23.1 s).
    assert fault.time == T0 + 20.0
    assert (fault.recovery, fault.recovered_at) == (Recovery.WORKERS_RUNNING, T0 + 23.1)
    assert fault.lost_s == pytest.approx(3.1)
    # The training after the last commit (15 s) is repeated.
    assert fault.rework_s == pytest.approx(5.0)
    g = report.goodput
    assert (g.start, g.end) == (T0, T0 + 40.5)
    assert g.lost_s == pytest.approx(3.1) and g.lost_by_kind == {"worker_exit": g.lost_s}
    # Round 1 ran 2.1 -> 20 less 5 s repeated, round 2 from 23.1 until its last member was
    # done (40.2).
    assert g.productive_s == pytest.approx(17.9 - 5.0 + 17.1)
    parts_add_up(report)


def test_a_hang_is_named_by_its_attribution_and_counts_its_undetected_time():
    verdict = "rank 1 made no progress for 5.2 s after step 41 (hang timeout 5 s)"
    attributed = (f"rank 3 (node b) is in train.py:88 in next_batch while the 3 others wait in "
                  f"all_reduce (step 41) [{verdict}]")
    job = first_round(Job()).commit(5.0, "a", 1, 20)
    job.stop(20.0, "a", 1, attributed).stop(20.2, "b", 1, "round 2 replaces round 1: ...")
    job.formed(21.0, 2, ["a", "b"], f"round 1: restart requested by a: {attributed}; closing "
                                    "with 2 nodes (max reached)").run(22.0, 2, ["a", "b"])

    report = job.report(now=30.0)

    [fault] = report.faults
    assert (fault.kind, fault.rank, fault.node, fault.reported_by) == (FaultKind.HANG, 3, "b",
                                                                       "a")
    assert fault.cause == attributed and fault.undetected_s == pytest.approx(5.2)
    # Lost: from the last progress (20 - 5.2 s) until round 2 ran (22.1 s).
    assert fault.lost_s == pytest.approx(5.2 + 2.1)
    assert fault.rework_s == pytest.approx(20.0 - 5.2 - 5.0)
    assert report.rounds[-1].end is RoundEnd.CURRENT and report.state == "running"
    parts_add_up(report)


def test_a_lost_node_is_the_cause_not_the_survivors_failed_workers():
    job = first_round(Job())
    job.stop(10.0, "a", 1, "worker rank 0 (pid 7) exited with 1 (log: x)")  # gloo: peer gone
    job.formed(14.0, 2, ["a"], "round 1: lost b; restart requested by a: worker rank 0 (pid 7) "
                               "exited with 1 (log: x); closing with 1 node")
    job.run(15.0, 2, ["a"])

    [fault] = job.report(now=20.0).faults

    assert (fault.kind, fault.node, fault.rank, fault.reported_by) == (FaultKind.NODE_LOST, "b",
                                                                       None, "a")
    assert fault.cause == "lost b" and fault.time == T0 + 10.0
    assert fault.lost_s == pytest.approx(5.0)


def test_a_frozen_node_revoked_by_the_leader_is_the_cause():
    job = first_round(Job())
    job.at(9.0, "a", 1, "frozen", "revoking the lease of b: its agent answered no probe for "
                                  "3.1 s (reported by a, confirmed by a)")
    job.formed(9.5, 2, ["a"], "round 1: lost b; closing with 1 node").run(10.0, 2, ["a"])

    [fault] = job.report(now=20.0).faults

    assert (fault.kind, fault.node, fault.time) == (FaultKind.NODE_FROZEN, "b", T0 + 9.0)
    assert "answered no probe" in fault.cause


def test_a_join_and_an_operator_restart_are_not_faults():
    job = first_round(Job(), ["a"])
    job.formed(10.0, 2, ["a", "b"], "round 1: joined b; closing with 2 nodes").run(11.0, 2,
                                                                                   ["a", "b"])
    job.formed(20.0, 3, ["a", "b"], "round 2: restart requested by elasticctl: requested by an "
                                    "operator; closing with 2 nodes").run(21.0, 3, ["a", "b"])

    report = job.report(now=30.0)

    assert [r.end for r in report.rounds] == [RoundEnd.MEMBERSHIP, RoundEnd.REQUESTED,
                                              RoundEnd.CURRENT]
    assert report.faults == () and report.goodput.lost_s == 0.0
    parts_add_up(report)


def test_a_round_written_again_continues_its_workers():
    job = first_round(Job())
    job.at(10.0, "a", 2, "round", "round 2: round 1 written again: a malformed record replaced "
                                  "it (the workers of round 1 run on)")

    report = job.report(now=20.0)

    assert [r.end for r in report.rounds] == [RoundEnd.CONTINUED, RoundEnd.CURRENT]
    assert report.faults == ()
    assert report.goodput.productive_s == pytest.approx(20.0 - 2.1)


def test_a_job_failed_on_its_budget_ends_its_last_fault_with_the_job():
    job = first_round(Job(), ["a"])
    job.stop(10.0, "a", 1, CRASH)
    job.at(10.5, "a", 2, "outcome", f"job failed: round 1: restart requested by a: {CRASH}; "
                                    "restart budget spent: 4 failures within 3600 s (max "
                                    "restarts 3)")

    report = job.report(now=99.0)

    assert report.state == "failed" and report.rounds[-1].end is RoundEnd.FAILED
    [fault] = report.faults
    assert (fault.recovery, fault.lost_s) == (Recovery.JOB_ENDED, pytest.approx(0.5))
    assert report.goodput.end == T0 + 10.5
    parts_add_up(report)


def test_a_fault_not_recovered_yet_is_lost_until_now():
    job = first_round(Job()).stop(10.0, "b", 1, CRASH)

    report = job.report(now=16.0)

    [fault] = report.faults
    assert (fault.recovery, fault.lost_s) == (Recovery.NOT_YET, pytest.approx(6.0))
    assert report.rounds[0].end is RoundEnd.FAULT and report.rounds[0].ended_at is None


def test_checkpoints_list_commits_failed_saves_the_latest_record_and_memory_snapshots():
    job = first_round(Job()).commit(5.0, "a", 1, 100)
    job.at(6.0, "a", 1, "checkpoint", "checkpoint of step 200 failed (reported by rank 0): "
                                      "ENOSPC; the latest committed checkpoint stays step 100")
    latest = CommitEntry(step=300, round=1, world_size=4, path="step-000000000300",
                         time=T0 + 7.0)
    status = dataclasses.replace(
        StatusRecord.of("b", "RUNNING", 1, 1, (), 0, ""),
        memory_tier=MemoryTierRow(newest_own_step=305))

    report = job.report(now=10.0, latest=latest, statuses=[status])

    assert [(c.step, c.tier, c.ok, c.node) for c in report.checkpoints] == [
        (100, "disk", True, "a"), (200, "disk", False, "a"), (300, "disk", True, ""),
        (305, "memory", True, "b")]
    assert report.checkpoints[-1].time is None


def test_stragglers_are_listed_with_the_rank_and_node_they_name():
    job = first_round(Job())
    job.at(8.0, "a", 1, "straggler", "rank 5 (node b) is persistently slower: step time 0.31 s, "
                                     "median 0.20 s over 50 steps")
    job.at(9.0, "a", 1, "straggler", "someone is slow")  # a wording the report does not know

    report = job.report(now=10.0)

    assert [(s.rank, s.node, s.reported_by) for s in report.stragglers] == [
        (5, "b", "a"), (None, None, "a")]


def test_a_full_ring_and_missing_rounds_make_the_history_incomplete():
    job = Job()
    # Node a's ring is full: its round 1 and 2 events were overwritten.
    job.formed(100.0, 3, ["a"], "round 2: restart requested by a: worker rank 0 (pid 1) exited "
                                "with 1; closing with 1 node").run(101.0, 3, ["a"], nproc=1)
    for i in range(EVENTS_PER_WRITER - len(job.events)):
        job.commit(102.0 + i, "a", 3, i)

    report = job.report(now=200.0)

    assert not report.history.complete
    assert any("node a's ring of 64 events is full" in g for g in report.history.gaps)
    assert "rounds 1 to 2 not in the history" in report.history.gaps
    assert report.history.complete_from == T0 + 100.0
    assert report.goodput.start == T0 + 100.0
    assert "INCOMPLETE" in report_text.render(report)
    # The fault that ended round 2 is not in the history: none is made up.
    assert report.faults == ()


def test_unreadable_records_and_a_current_round_without_its_event_are_gaps():
    job = first_round(Job(), ["a"])
    current = Round(number=2, members=(Member("a", 0, "127.0.0.1", 2),), master_addr="127.0.0.1",
                    master_port=1, reason="", leader="a", created_at=T0 + 9.0)

    report = job.report(now=10.0, current=current, unreadable=["/elastic/v1/j/events/a/0007"])

    assert report.history.gaps == (
        "round 2, the job's current round, not in the history",
        "1 unreadable record(s) skipped: /elastic/v1/j/events/a/0007")


def test_an_empty_job_reports_nothing_and_says_so():
    report = Job().report(now=5.0)

    assert (report.state, report.rounds, report.faults, report.history.events) == (
        "not started", (), (), 0)
    assert report.goodput.ratio is None
    assert "no events" in report_text.render(report)
    assert "No round formed." in report_html.render(report)
    json.dumps(report.to_dict())


def test_a_job_that_never_formed_a_round_waited_the_whole_span():
    job = Job().join(0.0, "a")
    job.at(1.0, "a", 0, "state", "JOINING -> JOINING: waiting for 1 more node (min 2)")

    report = job.report(now=60.0)

    assert report.state == "not started" and report.rounds == ()
    g = report.goodput
    assert (g.span_s, g.productive_s, g.other_s, g.ratio) == (60.0, 0.0, 60.0, 0.0)


def test_json_is_the_model_with_a_schema_version():
    report = crashed_job().report(now=50.0)

    data = json.loads(json.dumps(report.to_dict()))

    assert data["schema"] == 1 and data["job_id"] == "j"
    assert set(data) == {"schema"} | {f.name for f in dataclasses.fields(JobReport)}
    assert data["faults"][0]["kind"] == "worker_exit"
    assert data["faults"][0]["recovery"] == "workers_running"
    assert data["rounds"][0]["members"] == ["a", "b"]
    assert data["goodput"]["source"] == "timeline"


def test_text_names_the_fault_and_fits_100_columns():
    text = report_text.render(crashed_job().report(now=50.0))

    assert "worker_exit" in text and "cause: worker rank 3 (pid 4242) exited with 13" in text
    assert "GOODPUT" in text and "ROUNDS" in text and "CHECKPOINTS" in text
    assert max(len(line) for line in text.splitlines()) <= 100, text


def test_html_is_self_contained_and_shows_hostile_text_as_text():
    hostile = "worker rank 1 (pid 9) exited with 1: <script>alert('x')</script> & \"quoted\""
    job = first_round(Job()).stop(10.0, "b", 1, hostile)
    job.formed(11.0, 2, ["a", "b"], f"round 1: restart requested by b: {hostile}; closing "
                                    "with 2 nodes").run(12.0, 2, ["a", "b"])

    page = report_html.render(job.report(now=20.0))

    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quoted&quot;" in page
    # Nothing fetched from anywhere, nothing run: the policy says so too.
    assert not re.search(r"\b(src|href)=|https?://(?!www\.w3\.org/2000/svg)|@import|url\(",
                         page)
    assert "default-src 'none'" in page
    assert page.count('class="fault"') == 1 and page.count('class="round"') == 2


@pytest.mark.parametrize("why,stop,kind,node", [
    ("round 1: registered again: b; closing with 2 nodes", None, FaultKind.AGENT_RESTARTED, "b"),
    ("round 1: b did not start workers within 60 s; closing with 1 node", None,
     FaultKind.NO_START, "b"),
    ("round 1: restart requested by b: cut off from etcd for 1.5 s while ...; closing with 2 "
     "nodes", "cut off from etcd for 1.5 s while the lease was unconfirmed: stopping the workers "
     "before this node's lease can expire", FaultKind.CUT_OFF, "b"),
    ("round 1: restart requested by a: peer b has reported its workers unhealthy (NOT_SERVING) "
     "for over 2 s; closing with 2 nodes", None, FaultKind.PEER_UNHEALTHY, "b"),
])
def test_each_cause_a_round_gives_is_a_kind_of_fault_naming_its_node(why, stop, kind, node):
    job = first_round(Job())
    if stop:
        job.stop(9.0, "b", 1, stop)
    job.formed(10.0, 2, ["a", "b"], why).run(11.0, 2, ["a", "b"])

    [fault] = job.report(now=20.0).faults

    assert (fault.kind, fault.node) == (kind, node)
    assert fault.time == T0 + (9.0 if stop else 10.0)


def test_the_report_read_from_a_store_names_its_unreadable_records_and_reads_the_rest():
    clock = FakeClock(wall_s=T0)
    store, keys = MemoryStore(clock=clock), JobKeys("report-" + uuid.uuid4().hex[:8])
    store.txn([], [event_op(keys, clock, "a", 1, KIND_ROUND,
                            "round 1 formed with ['a']: first round: 1 node registered")])
    store.put(keys.events + "a/0063", b"not json")
    store.put(keys.round, b'{"number": "one"}')

    report = read_report(store, keys.job_id, T0 + 5.0)

    assert [r.number for r in report.rounds] == [1]
    assert report.history.gaps == (f"2 unreadable record(s) skipped: {keys.events}a/0063, "
                                   f"{keys.round}",)
