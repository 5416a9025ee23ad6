"""Goodput accounting (agent/goodput.py) driven with explicit times: the
accountant's rules, the ETTR window, the reactor's commands as its events,
and what the metrics, the status record and ``elasticctl status`` show."""

from __future__ import annotations

import json

import pytest

from agent import goodput
from agent.goodput import (
    ENDED,
    STANDBY,
    STARTUP,
    STEPS,
    Accountant,
    GoodputTracker,
    Kind,
    LeftJob,
    Stepped,
    Window,
    WorkersStarted,
    WorkersStopped,
    events_of,
)
from agent.lifecycle import AgentState as S
from agent.metrics import AgentMetrics
from agent.reactor import (
    AgentView,
    RoundCommitted,
    Settings,
    StartWorkers,
    StopCause,
    StopGrace,
    StopWorkers,
    WorkerExited,
    react,
)
from agent.status import job_goodput, render
from agent.status_record import GoodputRow, StatusRecord
from elastic.errors import MalformedRecordError
from elastic.rendezvous.api import Member, Round

EXIT = StopCause.WORKER_EXIT.value
HANG = StopCause.WORKER_HANG.value
JOINED = StopCause.NODE_JOINED.value


def steps(acct: Accountant, first: int, last: int, at: float, step_s: float,
          every: int = 1) -> float:
    """Heartbeats of steps ``first..last`` (one per ``every`` steps, and the
    last), the first at ``at``, a step each ``step_s``; returns the last's time."""
    t = at
    for s in range(first, last + 1):
        if (s - first) % every == 0 or s == last:
            acct.feed(Stepped(s), at + (s - first) * step_s)
        t = at + (s - first) * step_s
    return t


def totals(acct: Accountant) -> dict:
    return {(k.value, c): round(s, 6) for (k, c), s in acct.totals.items()}


class TestAccountant:
    def test_start_up_then_steps_are_productive_to_the_last_heartbeat(self):
        acct = Accountant(start=100.0)
        acct.feed(WorkersStarted(), 102.0)
        acct.feed(Stepped(0), 105.0)  # the first step ends the start-up
        steps(acct, 1, 20, 105.1, 0.1, every=5)
        assert totals(acct) == {("other", STARTUP): 5.0, ("productive", STEPS): 2.0}
        # Time after the last heartbeat waits for the next one.
        acct.settle(110.0)
        assert acct.total() == pytest.approx(7.0)

    def test_a_failure_after_the_last_checkpoint_makes_the_steps_done_again_repeated(self):
        """Steps 0..30 done, the worker killed; the new round restores step 20
        (its first step is 21): steps 21..30 are done twice, and the second
        time is repeated, charged to the kill."""
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(0), 1.0)
        last = steps(acct, 1, 30, 1.1, 0.1, every=10)  # 30 steps, 3.0 s
        acct.feed(WorkersStopped(EXIT, restart=True), last + 0.05)  # killed mid-step 31
        acct.feed(WorkersStarted(), last + 0.5)
        acct.feed(Stepped(21), last + 2.0)  # restored step 20: recovery ends here
        again = steps(acct, 22, 40, last + 2.1, 0.1, every=6)
        got = totals(acct)
        assert got[("other", STARTUP)] == 1.0
        # From the last step heard to the first after, less that step's own 0.1 s.
        assert got[("recovery", EXIT)] == pytest.approx(1.9)
        assert got[("repeated", EXIT)] == pytest.approx(1.0)  # steps 21..30, again
        assert got[("productive", STEPS)] == pytest.approx(3.0 + 1.0)  # 1..30, then 31..40
        assert acct.total() == pytest.approx(again)

    def test_a_heartbeat_shared_by_new_and_repeated_steps_is_split_evenly(self):
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(10), 0.0)
        acct.feed(Stepped(20), 1.0)
        acct.feed(WorkersStopped(HANG, restart=True), 1.0)
        acct.feed(WorkersStarted(), 1.0)
        acct.feed(Stepped(15), 2.0)
        acct.feed(Stepped(25), 3.0)  # 16..20 again, 21..25 new
        # Step 15's own 0.1 s (a step's time as last heard), then half of the second.
        assert acct.totals[(Kind.REPEATED, HANG)] == pytest.approx(0.1 + 0.5)
        assert acct.totals[(Kind.PRODUCTIVE, STEPS)] == pytest.approx(1.5)

    def test_recovery_is_charged_to_each_restart_s_cause_and_a_crash_loop_to_the_latest(self):
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(0), 0.0)
        acct.feed(Stepped(10), 1.0)
        acct.feed(WorkersStopped(EXIT, restart=True), 2.0)  # 1 s since the last step
        acct.feed(WorkersStarted(), 3.0)
        acct.feed(WorkersStopped(HANG, restart=True), 4.0)  # the new round hangs at once
        acct.feed(WorkersStarted(), 5.0)
        acct.feed(Stepped(11), 7.0)  # step 11's own 0.1 s is productive
        assert totals(acct) == pytest.approx({("productive", STEPS): 1.1,
                                              ("recovery", EXIT): 3.0, ("recovery", HANG): 2.9})

    def test_heartbeats_of_stopped_workers_start_nothing(self):
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(5), 0.0)
        acct.feed(WorkersStopped(EXIT, restart=True), 1.0)
        acct.feed(Stepped(6), 1.5)  # a survivor of the old round, still beating
        acct.settle(2.0)
        # The tail (0 to 1 s) waits for the next round's first step.
        assert totals(acct) == {("recovery", EXIT): 1.0}
        acct.feed(WorkersStarted(), 2.0)
        acct.feed(Stepped(6), 3.0)
        assert totals(acct) == {("recovery", EXIT): 3.0}

    def test_a_standby_is_other_and_its_return_is_recovery_of_the_scale_up(self):
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(0), 1.0)
        acct.feed(Stepped(10), 2.0)
        acct.feed(WorkersStopped(StopCause.NODE_LEFT.value, restart=True), 3.0)
        acct.feed(LeftJob(STANDBY), 3.5)
        acct.feed(WorkersStarted(), 10.0)
        acct.feed(Stepped(50), 12.0)  # the job went on without this node: nothing repeated
        acct.feed(Stepped(60), 13.0)
        assert totals(acct) == pytest.approx({
            ("other", STARTUP): 1.0, ("productive", STEPS): 1.0 + 0.1 + 1.0,
            ("recovery", "node_left"): 1.5, ("other", STANDBY): 6.5, ("recovery", JOINED): 1.9})

    def test_steps_unheard_before_a_kill_that_the_restore_keeps_are_productive(self):
        """Heard up to step 10; steps 11..15 made before the kill but never
        heard; the memory tier restores step 15: the next round starts at 16."""
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(0), 0.0)
        acct.feed(Stepped(10), 1.0)
        acct.feed(WorkersStopped(EXIT, restart=True), 1.5)
        acct.feed(WorkersStarted(), 2.0)
        acct.feed(Stepped(16), 3.0)
        assert totals(acct) == pytest.approx({("productive", STEPS): 1.0 + 0.5 + 0.1,
                                              ("recovery", EXIT): 1.4})
        acct.feed(Stepped(17), 3.1)  # step 16's was not a repeat, nor is 17
        assert totals(acct)[("productive", STEPS)] == pytest.approx(1.7)
        assert ("repeated", EXIT) not in totals(acct)

    def test_the_end_of_the_job_is_other(self):
        acct = Accountant(start=0.0)
        acct.feed(WorkersStarted(), 0.0)
        acct.feed(Stepped(0), 0.0)
        acct.feed(Stepped(5), 1.0)
        acct.feed(LeftJob(ENDED), 1.5)
        acct.settle(3.0)
        assert totals(acct) == {("productive", STEPS): 1.0, ("other", ENDED): 2.0}

    def test_time_is_never_charged_backwards(self):
        acct = Accountant(start=10.0)
        acct.feed(WorkersStarted(), 9.0)  # a clock read before the agent's start
        acct.feed(Stepped(0), 11.0)
        acct.feed(Stepped(1), 10.5)  # a heartbeat thread's late report
        assert all(s >= 0 for s in acct.totals.values())
        assert acct.total() == pytest.approx(1.0)


class TestWindow:
    def test_the_ettr_covers_the_window_only(self):
        """An hour of recovery, then a window of steps: the ETTR over the
        window forgets the hour; over the whole time it would be a half."""
        tracker = GoodputTracker(start=0.0, window_s=600.0)
        tracker.observe([StopWorkers("killed", StopGrace.FAILURE, StopCause.WORKER_EXIT)], 0.0)
        for t in range(0, 600, 10):
            tracker.snapshot(float(t))  # scrapes during the recovery
        tracker.observe([start_command()], 600.0)
        tracker.stepped(0, 600.0)
        for i in range(1, 601):
            tracker.stepped(i, 600.0 + i)
        snap = tracker.snapshot(1200.0)
        assert snap.kind_s(Kind.PRODUCTIVE) == pytest.approx(600.0)
        assert snap.kind_s(Kind.RECOVERY) == pytest.approx(600.0)
        assert snap.ettr == pytest.approx(1.0, abs=600.0 / goodput.WINDOW_SAMPLES / 600.0)
        assert tracker.snapshot(1200.0).window_s == 600.0

    def test_half_productive_in_the_window(self):
        w = Window(100.0)
        for t in range(0, 301):
            productive = t / 2  # half of every second
            w.add(float(t), productive, float(t))
        assert w.ettr(150.0, 300.0) == pytest.approx(0.5)

    def test_nothing_accounted_has_no_ettr(self):
        assert Window(10.0).ettr(0.0, 0.0) is None
        assert GoodputTracker(0.0, 10.0).snapshot(0.0).ettr is None


def round_of(number, *ids):
    return Round(number=number,
                 members=tuple(Member(i, r, "127.0.0.1", 1, addr=f"{i}:1")
                               for r, i in enumerate(ids)),
                 master_addr="127.0.0.1", master_port=1, reason="", leader=ids[0],
                 created_at=0.0)


SETTINGS = Settings(node_id="a", nproc=1, lease_ttl_s=4.0, join_timeout_s=60.0, job_id="j")


def test_the_reactor_s_commands_feed_the_tracker_with_their_causes():
    """A round, a worker killed, the next round: the tracker hears the start,
    the stop with its typed cause and the restart from the reactor itself."""
    tracker = GoodputTracker(start=0.0)
    view = AgentView(state=S.JOINING, waiting_since=0.0)
    for event, now in ((RoundCommitted(round_of(1, "a", "b")), 1.0),):
        view, commands = react(view, event, now, SETTINGS)
        tracker.observe(commands, now)
    tracker.stepped(0, 2.0)
    tracker.stepped(10, 3.0)
    view, commands = react(view, WorkerExited(1, 0, 0, 99, exit_code=-9, signal=9), 3.5,
                           SETTINGS)
    tracker.observe(commands, 3.5)
    assert [type(e) for e in events_of(commands)] == [WorkersStopped]
    view, commands = react(view, RoundCommitted(round_of(2, "a", "b")), 4.0, SETTINGS)
    tracker.observe(commands, 4.0)
    tracker.stepped(6, 5.0)
    tracker.stepped(12, 6.0)
    snap = tracker.snapshot(6.0)
    # The last step heard to the first after, less that one's own time.
    assert snap.totals[(Kind.RECOVERY, EXIT)] == pytest.approx(1.9)
    assert snap.totals[(Kind.REPEATED, EXIT)] == pytest.approx(0.1 + 4 / 6)
    assert snap.totals[(Kind.PRODUCTIVE, STEPS)] == pytest.approx(1.0 + 2 / 6)
    assert snap.lost_by_cause() == {EXIT: pytest.approx(2.0 + 4 / 6)}


def test_the_metrics_show_every_kind_and_cause_from_the_start_and_then_the_tracker_s():
    metrics = AgentMetrics("j", "a")
    ids = {"job_id": "j", "node_id": "a"}
    for kind, cause in goodput.series():
        assert metrics.registry.get_sample_value(
            "elasticd_goodput_seconds_total", {**ids, "kind": kind.value, "cause": cause}) == 0
    tracker = GoodputTracker(start=0.0, window_s=60.0)
    now = [0.0]
    metrics.watch_goodput(lambda: tracker.snapshot(now[0]))
    assert metrics.registry.get_sample_value("elasticd_ettr", ids) == -1.0
    tracker.observe([start_command()], 0.0)
    tracker.stepped(0, 1.0)
    tracker.stepped(30, 4.0)
    now[0] = 4.0
    get = metrics.registry.get_sample_value
    assert get("elasticd_goodput_seconds_total",
               {**ids, "kind": "productive", "cause": STEPS}) == pytest.approx(3.0)
    assert get("elasticd_goodput_seconds_total",
               {**ids, "kind": "other", "cause": STARTUP}) == pytest.approx(1.0)
    assert get("elasticd_ettr", ids) == pytest.approx(0.75)


def start_command() -> StartWorkers:
    return StartWorkers(round_of(1, "a"), restart_count=0)


def record_with(row: GoodputRow | None) -> StatusRecord:
    return StatusRecord("a", "RUNNING", 3, 0, (), 10, 1.0, 2, "", goodput=row)


class TestStatus:
    ROW = GoodputRow(ettr=0.9612, window_s=3600.0, productive_s=583.2, repeated_s=2.1,
                     recovery_s=14.4, other_s=1.0,
                     lost_by_cause=(("worker_exit", 9.0), ("node_left", 7.5)))

    def test_the_record_carries_the_row_through_json(self):
        back = StatusRecord.from_json("/k/status/a", record_with(self.ROW).to_json())
        assert back.goodput == self.ROW
        assert "goodput" not in json.loads(record_with(None).to_json())
        assert StatusRecord.from_json("/k/status/a", record_with(None).to_json()).goodput is None

    @pytest.mark.parametrize("bad", [
        {"ettr": "high"}, {"productive_s": -1}, {"repeated_s": float("inf")},
        {"lost_by_cause": [["worker_exit"]]}, {"lost_by_cause": [[1, 2.0]]},
        {"lost_by_cause": [["x", 1.0]] * 17}, {"ettr": -2},
    ])
    def test_a_malformed_row_is_refused_naming_the_field(self, bad):
        obj = json.loads(record_with(self.ROW).to_json())
        obj["goodput"].update(bad)
        with pytest.raises(MalformedRecordError, match="goodput"):
            StatusRecord.from_json("/k/status/a", json.dumps(obj).encode())

    def test_elasticctl_status_shows_one_line_from_the_node_that_saw_the_most(self):
        short = GoodputRow(ettr=0.5, window_s=3600.0, productive_s=10.0, other_s=10.0)
        status = {"job_id": "j", "round": None, "leader": None, "nodes": [], "problems": [],
                  "checkpoint": None,
                  "goodput": {"node_id": "b", **record_with(self.ROW).summary("etcd")["goodput"]}}
        text = render(status, now=0.0)
        lines = [line for line in text.splitlines() if line.startswith("goodput")]
        assert lines == ["goodput (as node b sees it): ETTR 96.1 % over the last 60 min; "
                         "productive 583 s, repeated 2 s, recovery 14 s (worker_exit 9 s, "
                         "node_left 8 s), other 1 s"]
        published = {"a": record_with(short).summary("etcd"),
                     "b": record_with(self.ROW).summary("etcd"),
                     "c": record_with(None).summary("etcd")}
        assert job_goodput(published)["node_id"] == "b"
