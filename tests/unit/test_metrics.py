"""The agent's metrics (agent/metrics.py), fed typed events with a fake clock
and read back from the agent's own registry; then the same metrics wired into
a real agent loop (fake workers, in-memory store), served over HTTP, and the
Grafana dashboard's queries checked against the names the module defines."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request

import pytest

from agent import metrics as metrics_mod
from agent.hang_attribution import HangKind
from agent.health import PeerHealth, WorkerHealth, hung_workers, last_sign_of_life
from agent.lifecycle import AgentState as S
from agent.metrics import AgentMetrics, NoMetrics
from agent.reactor import (
    AgentView,
    DrainRequested,
    HangAttributed,
    LeaseState,
    PeerHealthChanged,
    RoundCommitted,
    Settings,
    Tick,
    Transition,
    WorkerExited,
    react,
)
from elastic.errors import ConfigError
from elastic.net import free_port
from elastic.rendezvous.api import Member, Round
from tests.fakes.clock import FakeClock

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "elasticd.json")
SETTINGS = Settings(node_id="a", nproc=2, lease_ttl_s=4.0, join_timeout_s=60.0, job_id="j")
IDS = {"job_id": "j", "node_id": "a"}


def round_of(number, *ids, failures=(), outcome=""):
    return Round(number=number,
                 members=tuple(Member(i, r, "127.0.0.1", 2, addr=f"{i}:1")
                               for r, i in enumerate(ids)),
                 master_addr="127.0.0.1", master_port=1, reason="free text, never read",
                 leader=ids[0], created_at=0.0, failures=failures, outcome=outcome)


class Node:
    """The loop's part in feeding the metrics, without the loop: react, then
    observe the reaction and the transitions it makes (as Agent._react and
    the lifecycle's publisher do), all at the fake clock's time."""

    def __init__(self):
        self.clock = FakeClock()
        self.metrics = AgentMetrics("j", "a")
        self.view = AgentView(waiting_since=self.clock.monotonic())
        self.metrics.observe_transition(S.JOINING, self.clock.monotonic())

    def feed(self, event):
        now = self.clock.monotonic()
        before = self.view
        self.view, commands = react(before, event, now, SETTINGS)
        self.metrics.observe(event, self.view, commands, now)
        for c in commands:
            if isinstance(c, Transition):
                self.metrics.observe_transition(c.to, now)
        return commands

    def value(self, name, **labels):
        return self.metrics.registry.get_sample_value(name, {**IDS, **labels})

    def restarts(self):
        return {r: self.value("elasticd_restarts_total", reason=r)
                for r in metrics_mod.RESTART_REASONS}


def running_node(*ids):
    node = Node()
    node.feed(RoundCommitted(round_of(1, *(ids or ("a", "b")))))
    node.clock.advance(1.0)
    node.feed(Tick(workers_stepped=True))
    return node


def only(reason, n=1.0):
    return {r: (n if r == reason else 0.0) for r in metrics_mod.RESTART_REASONS}


class TestRestartsDetectRecover:
    def test_a_worker_exit_counts_a_restart_detected_at_once_and_recovered_at_the_first_step(
            self):
        node = running_node()
        node.feed(WorkerExited(round=1, local_rank=1, rank=1, pid=7, exit_code=1))
        assert node.restarts() == only("worker_exit")
        assert node.value("elasticd_detect_seconds_count", reason="worker_exit") == 1
        assert node.value("elasticd_detect_seconds_sum", reason="worker_exit") == 0.0
        stopped_at = node.clock.monotonic()
        node.clock.advance(1.0)
        # The old round's workers had stepped: not a recovery while joining.
        node.feed(Tick(workers_stepped=True))
        node.clock.advance(2.0)
        node.feed(RoundCommitted(round_of(2, "a", "b", failures=(5.0,))))
        node.clock.advance(1.5)
        node.feed(Tick(workers_stepped=False))  # started, not every worker stepped yet
        assert node.value("elasticd_recover_seconds_count", reason="worker_exit") is None
        node.clock.advance(0.5)
        node.feed(Tick(workers_stepped=True))
        assert node.value("elasticd_recover_seconds_count", reason="worker_exit") == 1
        assert node.value("elasticd_recover_seconds_sum", reason="worker_exit") == \
            pytest.approx(node.clock.monotonic() - stopped_at) == 5.0
        node.clock.advance(1.0)
        node.feed(Tick(workers_stepped=True))  # once per stop
        assert node.value("elasticd_recover_seconds_count", reason="worker_exit") == 1
        # The new round, started while joining, is not a second restart.
        assert node.restarts() == only("worker_exit")
        assert node.value("elasticd_rounds_started_total") == 2
        assert node.value("elasticd_round") == 2
        assert node.value("elasticd_world_size") == 4

    def test_an_exit_0_or_an_exit_the_agent_asked_for_is_no_restart(self):
        node = running_node()
        node.feed(WorkerExited(round=1, local_rank=0, rank=0, pid=7, exit_code=0))
        node.feed(WorkerExited(round=1, local_rank=1, rank=1, pid=8, exit_code=-15,
                               stopped=True))
        assert node.restarts() == only(None)

    def test_a_hang_is_detected_from_the_workers_last_sign_of_life(self):
        node = running_node()
        node.clock.advance(40.0)
        now = node.clock.monotonic()
        node.feed(Tick(hung=("rank 1 made no progress",), hung_since=now - 31.5))
        assert node.restarts() == only(None), "nothing stops before the stacks are read"
        node.feed(HangAttributed(1, "rank 1 (node a) is in t.py:3 in f while ... [...]",
                                 HangKind.RANK_ELSEWHERE))
        assert node.restarts() == only("worker_hang")
        assert node.value("elasticd_detect_seconds_sum", reason="worker_hang") == 31.5
        assert node.value("elasticd_hang_attributions_total", kind="rank_elsewhere") == 1

    def test_a_peer_unhealthy_for_a_ttl_is_detected_from_its_first_not_serving(self):
        node = running_node()
        node.feed(PeerHealthChanged("b", PeerHealth.NOT_SERVING))
        node.clock.advance(2.0)
        node.feed(PeerHealthChanged("b", PeerHealth.NOT_SERVING))  # still since the first
        node.clock.advance(2.5)
        node.feed(Tick(workers_stepped=True))
        assert node.restarts() == only("peer_unhealthy")
        assert node.value("elasticd_detect_seconds_sum", reason="peer_unhealthy") == 4.5

    def test_a_node_cut_off_from_etcd_is_detected_from_its_lease_last_confirmed(self):
        node = running_node()
        node.feed(LeaseState(unconfirmed_s=3.0, peer_ages=(("b:1", 0.1),), peers_asked=1))
        assert node.restarts() == only("store_cut_off")
        assert node.value("elasticd_detect_seconds_sum", reason="store_cut_off") == 3.0

    @pytest.mark.parametrize("new, reason", [
        (round_of(2, "a"), "node_left"),
        (round_of(2, "a", "b", failures=(9.0,)), "peer_failure"),
        (round_of(2, "a", "b", "c"), "node_joined"),
        (round_of(2, "b", "a"), "requested"),
    ])
    def test_a_new_round_is_classified_by_its_members_and_failures(self, new, reason):
        node = running_node("a", "b")
        node.feed(RoundCommitted(new))
        assert node.restarts() == only(reason)
        # Nothing this node saw tells when the fault happened elsewhere.
        assert node.value("elasticd_detect_seconds_count", reason=reason) is None

    def test_a_node_left_out_of_the_next_round_observes_no_recovery(self):
        node = running_node("a", "b")
        node.feed(RoundCommitted(round_of(2, "b")))  # full without this node: standby
        assert node.view.state is S.STANDBY
        node.feed(RoundCommitted(round_of(3, "a", "b")))
        node.clock.advance(1.0)
        node.feed(Tick(workers_stepped=True))
        assert node.value("elasticd_rounds_started_total") == 2
        assert node.value("elasticd_recover_seconds_count", reason="node_left") is None

    def test_a_crash_loop_recovers_from_its_first_stop(self):
        node = running_node()
        first = node.clock.monotonic()
        node.feed(WorkerExited(round=1, local_rank=1, rank=1, pid=7, exit_code=1))
        node.clock.advance(1.0)
        node.feed(RoundCommitted(round_of(2, "a", "b", failures=(1.0,))))
        node.clock.advance(1.0)
        node.feed(WorkerExited(round=2, local_rank=0, rank=0, pid=9, exit_code=1))
        node.clock.advance(1.0)
        node.feed(RoundCommitted(round_of(3, "a", "b", failures=(1.0, 2.0))))
        node.clock.advance(1.0)
        node.feed(Tick(workers_stepped=True))
        assert node.restarts() == only("worker_exit", 2.0)
        assert node.value("elasticd_recover_seconds_sum", reason="worker_exit") == \
            node.clock.monotonic() - first

    def test_the_end_of_the_job_and_a_drain_stop_workers_without_a_restart(self):
        node = running_node()
        node.feed(RoundCommitted(round_of(2, "a", "b", outcome="succeeded")))
        assert node.restarts() == only(None)
        node = running_node()
        node.feed(DrainRequested("operator"))
        assert node.restarts() == only(None)
        node = running_node("a", "b")
        node.feed(RoundCommitted(round_of(2, "b"), drain_requested=True))  # left out, leaving
        assert node.restarts() == only(None)


class TestHangEvidence:
    def test_a_stalled_worker_counts_from_its_last_progress_a_silent_one_from_its_last_beat(
            self):
        w = WorkerHealth(local_rank=0, rank=0, started_at=0.0)
        assert last_sign_of_life(w, 100.0, 30.0) is None  # never spoke
        w.on_heartbeat(1.0, 5, 0.0)
        w.on_heartbeat(20.0, 5, 0.0)  # alive, but no step since 1.0
        assert [reason for _, reason in hung_workers([w], 32.0, 30.0)]  # judged hung
        assert last_sign_of_life(w, 32.0, 30.0) == 1.0
        assert last_sign_of_life(w, 51.0, 30.0) == 20.0  # silent since 20.0


class TestStateAndRendezvous:
    def test_the_state_gauge_is_1_for_the_current_state_only(self):
        node = running_node()
        states = {s: node.value("elasticd_agent_state", state=s.value) for s in S}
        assert states == {s: (1.0 if s is S.RUNNING else 0.0) for s in S}

    def test_rendezvous_latency_runs_from_joining_to_starting(self):
        node = Node()
        node.clock.advance(2.5)
        node.feed(RoundCommitted(round_of(1, "a", "b")))
        assert node.value("elasticd_rendezvous_seconds_count") == 1
        assert node.value("elasticd_rendezvous_seconds_sum") == 2.5
        node.feed(WorkerExited(round=1, local_rank=1, rank=1, pid=7, exit_code=1))
        node.clock.advance(4.0)
        node.feed(RoundCommitted(round_of(2, "a", "b")))
        assert node.value("elasticd_rendezvous_seconds_count") == 2
        assert node.value("elasticd_rendezvous_seconds_sum") == 6.5

    def test_a_standby_waits_for_room_not_for_a_rendezvous(self):
        node = Node()
        node.feed(RoundCommitted(round_of(1, "b")))
        node.clock.advance(30.0)
        node.feed(RoundCommitted(round_of(2, "b", "a")))
        assert node.view.state is S.RUNNING
        assert node.value("elasticd_rendezvous_seconds_count") == 0


class TestWorkersAndCheckpoints:
    def test_heartbeats_set_the_step_and_the_step_rate(self):
        m = AgentMetrics("j", "a")
        m.observe_heartbeat(-1, 0.0)
        assert m.registry.get_sample_value("elasticd_step", IDS) == 0
        m.observe_heartbeat(41, 2.5)
        m.observe_heartbeat(42, float("nan"))
        assert m.registry.get_sample_value("elasticd_step", IDS) == 42
        assert m.registry.get_sample_value("elasticd_step_rate", IDS) == 0.0
        m.observe_heartbeat(43, 2.5)
        assert m.registry.get_sample_value("elasticd_step_rate", IDS) == 2.5
        assert m.registry.get_sample_value("elasticd_worker_heartbeats_total", IDS) == 4

    def test_saves_and_restores_count_time_and_bytes(self):
        m = AgentMetrics("j", "a")
        m.observe_save(9, 1.5, 1000)
        m.observe_save(19, 0.0, 0)  # not measured (an older library): only the step
        m.observe_restore(0.75, 4000)
        get = m.registry.get_sample_value
        assert get("elasticd_checkpoint_step", IDS) == 19
        assert get("elasticd_checkpoint_save_seconds_count", IDS) == 1
        assert get("elasticd_checkpoint_save_seconds_sum", IDS) == 1.5
        assert get("elasticd_checkpoint_save_bytes_total", IDS) == 1000
        assert get("elasticd_checkpoint_restore_seconds_sum", IDS) == 0.75
        assert get("elasticd_checkpoint_restore_bytes_total", IDS) == 4000

    def test_workers_by_state_are_read_at_each_scrape(self):
        m = AgentMetrics("j", "a")
        states = ["running", "running", "succeeded"]
        m.count_workers_with(lambda: states)
        get = m.registry.get_sample_value
        assert get("elasticd_workers", {**IDS, "state": "running"}) == 2
        assert get("elasticd_workers", {**IDS, "state": "succeeded"}) == 1
        assert get("elasticd_workers", {**IDS, "state": "starting"}) == 0
        states.clear()
        assert get("elasticd_workers", {**IDS, "state": "running"}) == 0

    def test_etcd_errors_are_counted_by_operation(self):
        m = AgentMetrics("j", "a")
        m.store_error("flush")
        m.store_error("flush")
        m.store_error("round_read")
        get = m.registry.get_sample_value
        assert get("elasticd_etcd_errors_total", {**IDS, "op": "flush"}) == 2
        assert get("elasticd_etcd_errors_total", {**IDS, "op": "round_read"}) == 1
        assert get("elasticd_etcd_errors_total", {**IDS, "op": "react"}) == 0


class TestRegistryAndServing:
    def test_agents_in_one_process_have_registries_of_their_own(self):
        a, b = AgentMetrics("j", "a"), AgentMetrics("j", "b")
        a.store_error("flush")
        assert a.registry is not b.registry
        assert b.registry.get_sample_value("elasticd_etcd_errors_total",
                                           {"job_id": "j", "node_id": "b", "op": "flush"}) == 0

    def test_no_metrics_offers_every_method_of_agent_metrics(self):
        public = {n for n in vars(AgentMetrics) if not n.startswith("_")}
        assert public <= set(vars(NoMetrics)), public - set(vars(NoMetrics))

    def test_metrics_are_served_over_http_until_closed(self):
        m = AgentMetrics("j", "a")
        m.store_error("flush")
        port = free_port("127.0.0.1")
        url = m.serve("127.0.0.1", port)
        try:
            assert url == f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
            assert 'elasticd_etcd_errors_total{job_id="j",node_id="a",op="flush"} 1.0' in text
        finally:
            m.close()
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=2)
        m.close()  # idempotent

    def test_a_port_in_use_is_a_config_error(self):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(ConfigError, match=f"--metrics-port {port}"):
                AgentMetrics("j", "a").serve("127.0.0.1", port)


# ---------------------------------------------------------------- in the agent


def test_a_real_agent_loop_feeds_its_metrics():
    from tests.unit.test_agent_loop import OneNode

    metrics = AgentMetrics("j", "a")
    node = OneNode(metrics=metrics)
    get = metrics.registry.get_sample_value
    node.run(6)
    assert node.agent.state is S.RUNNING
    assert get("elasticd_agent_state", {**IDS, "state": "RUNNING"}) == 1
    assert get("elasticd_rounds_started_total", IDS) == 1
    assert get("elasticd_rendezvous_seconds_count", IDS) == 1
    assert get("elasticd_world_size", IDS) == 2
    assert get("elasticd_step", IDS) > 5
    assert get("elasticd_step_rate", IDS) > 0
    assert get("elasticd_workers", {**IDS, "state": "running"}) == 2
    crashed = next(w for w in node.supervisor.current if w.alive)
    node.workers.end(crashed, 1, node.clock.monotonic())
    node.run(0.25)
    assert get("elasticd_restarts_total", {**IDS, "reason": "worker_exit"}) == 1
    assert get("elasticd_workers", {**IDS, "state": "running"}) == 0  # none runs meanwhile
    node.run(8)
    assert get("elasticd_rounds_started_total", IDS) == 2
    assert get("elasticd_recover_seconds_count", {**IDS, "reason": "worker_exit"}) == 1
    assert get("elasticd_recover_seconds_sum", {**IDS, "reason": "worker_exit"}) > 0


def test_a_hang_in_a_real_agent_loop_is_detected_from_the_last_heartbeat():
    from tests.unit.test_agent_loop import OneNode

    metrics = AgentMetrics("j", "a")
    node = OneNode(metrics=metrics)  # hang timeout 30 s
    node.run(4)
    next(w for w in node.supervisor.current if w.alive).hung = True  # no more heartbeats
    node.run(35)
    get = metrics.registry.get_sample_value
    assert get("elasticd_restarts_total", {**IDS, "reason": "worker_hang"}) == 1
    assert get("elasticd_detect_seconds_count", {**IDS, "reason": "worker_hang"}) == 1
    # Judged at the first tick past the timeout after its last heartbeat.
    assert 30.0 < get("elasticd_detect_seconds_sum", {**IDS, "reason": "worker_hang"}) <= 30.75


def test_a_commit_through_the_agent_counts_the_save_and_keeps_it_in_the_record():
    from elastic.v1 import agent_pb2
    from tests.unit.test_agent_loop import OneNode

    metrics = AgentMetrics("j", "a")
    node = OneNode(metrics=metrics)
    node.run(3)
    number = node.round().number
    ok, _ = node.agent.channel.commit_checkpoint(agent_pb2.CheckpointEntry(
        step=99, round=number, world_size=2, path="step-000000000099", time=1.0,
        save_s=2.5, size_bytes=12345))
    assert ok
    latest = node.agent.channel.latest_checkpoint()
    assert (latest.step, latest.save_s, latest.size_bytes) == (99, 2.5, 12345)
    get = metrics.registry.get_sample_value
    assert get("elasticd_checkpoint_save_seconds_sum", IDS) == 2.5
    assert get("elasticd_checkpoint_save_bytes_total", IDS) == 12345
    # A fenced commit (an older round) counts nothing.
    ok, _ = node.agent.channel.commit_checkpoint(agent_pb2.CheckpointEntry(
        step=109, round=number - 1, world_size=2, path="step-000000000109", time=1.0,
        save_s=1.0, size_bytes=1))
    assert not ok and get("elasticd_checkpoint_save_bytes_total", IDS) == 12345
    node.agent.channel.report_restore(agent_pb2.WorkerChannelReportRestoreRequest(
        step=99, round=number, rank=0, restore_s=0.5, size_bytes=12345))
    assert get("elasticd_checkpoint_restore_seconds_sum", IDS) == 0.5
    assert get("elasticd_checkpoint_restore_bytes_total", IDS) == 12345


# ---------------------------------------------------------------- the dashboard


def exposed_names(families) -> set[str]:
    """Every sample name these metric families can expose."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created")}
    return {family.name + s for family in families for s in suffixes[family.type]}


def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def test_the_dashboard_queries_only_metrics_the_agent_defines():
    """Renaming a metric in agent/metrics.py breaks the dashboard: this test."""
    defined = exposed_names(AgentMetrics("j", "a").registry.collect())
    with open(DASHBOARD) as f:
        used = set(re.findall(r"elasticd_\w+", f.read()))  # panels and variables alike
    assert used, "the dashboard queries no elasticd metric"
    assert used <= defined, f"not defined in agent/metrics.py: {sorted(used - defined)}"


def test_the_dashboard_shows_every_metric_and_takes_its_datasource_as_an_input():
    board = dashboard()
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    used = {name for q in queries for name in re.findall(r"elasticd_\w+", q)}
    unshown = {family.name for family in AgentMetrics("j", "a").registry.collect()
               if not used & exposed_names([family])}
    assert unshown == set(), f"metrics without a panel: {sorted(unshown)}"
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
            assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}"
                       for t in panel["targets"]), panel["title"]
