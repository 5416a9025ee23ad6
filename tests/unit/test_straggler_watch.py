"""An agent's part in straggler detection over the in-memory store, with a fake clock.

Two agents' watches share one store: each publishes its ranks' step times
from their heartbeats, the leader's judges them and reports (log, event,
metrics, status rows) and, with ``replace``, drains a straggler's node when
a standby waits.
"""

from __future__ import annotations

import logging
import math
import queue
import time

import pytest

from agent.grpc_input import check_heartbeat
from agent.metrics import AgentMetrics
from agent.step_times import (CHANGE, MAX_STEP_S, MIN_SAMPLES, PublishRule, StepTimeRecord,
                              StepTimes)
from agent.reactor import DrainRequested
from agent.straggler_watch import StragglerWatch, drain_as_asked
from agent.stragglers import StragglerPolicy
from elastic.errors import InvalidRequestError, MalformedRecordError
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.net import free_port
from elastic.rendezvous.api import Member, Round
from elastic.v1 import agent_pb2
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

KEYS = JobKeys("j")
POLICY = StragglerPolicy(threshold=1.2, window_s=6.0)  # judged every 1 s
ROUND = Round(number=3, members=(Member("a", 0, "h", 2, addr="a:1"),
                                 Member("b", 1, "h", 2, addr="b:1")),
              master_addr="h", master_port=1, reason="", leader="a", created_at=0.0)


class Agent:
    """One agent's watch, the events and drains it asked for, its metrics."""

    def __init__(self, node_id: str, store: MemoryStore, clock: FakeClock,
                 policy: StragglerPolicy = POLICY):
        self.node_id = node_id
        self.clock = clock
        self.events: list[tuple[int, str, str]] = []
        self.drains: list[tuple[str, str]] = []
        self.metrics = AgentMetrics("j", node_id)
        self.lease = store.session(10.0).lease_id
        self.watch = StragglerWatch(
            policy, store, KEYS, node_id, clock,
            event=lambda r, kind, message: self.events.append((r, kind, message)),
            drain=lambda member, reason: self.drains.append((member.node_id, reason)),
            metrics=self.metrics, log=JobLogger(logging.getLogger("test"), "j", node_id),
            timeout_s=1.0)

    def beats(self, ranks_s: dict[int, float], n: int = MIN_SAMPLES,
              busy_s: dict[int, float] | None = None) -> None:
        for _ in range(n):
            for rank, seconds in ranks_s.items():
                self.watch.times.observe(ROUND.number, rank, seconds, (busy_s or {}).get(rank, 0))

    def run(self, leading: bool = False, standbys: tuple[str, ...] = ()) -> None:
        self.watch.run(self.clock.monotonic(), lease=self.lease, running=ROUND,
                       leading=ROUND if leading else None, standbys=standbys)

    def metric(self, name: str, **labels) -> float | None:
        return self.metrics.registry.get_sample_value(
            name, {"job_id": "j", "node_id": self.node_id, **labels})


@pytest.fixture
def cluster():
    clock = FakeClock()
    store = MemoryStore(clock)
    return Agent("a", store, clock), Agent("b", store, clock), clock, store


def play(cluster, seconds: float, b_rank_3_s: float = 0.2, standbys=()) -> None:
    """Both agents' loops, once a second for ``seconds``: rank 3 (node b)
    steps in ``b_rank_3_s``, the others in 0.1 s."""
    a, b, clock, _ = cluster
    for _ in range(int(seconds)):
        a.beats({0: 0.1, 1: 0.1})
        b.beats({2: 0.1, 3: b_rank_3_s})
        b.run()
        a.run(leading=True, standbys=standbys)
        clock.advance(1.0)


def test_the_leader_names_a_slow_rank_once_with_its_node_everywhere_it_reports(cluster):
    a, b, clock, _ = cluster

    play(cluster, 5)
    assert a.events == [] and a.watch.rows() == ()  # not a whole window yet
    play(cluster, 3)

    [(round_number, kind, message)] = a.events
    assert (round_number, kind) == (3, "straggler")
    assert message.startswith("rank 3 (node b) is a straggler: its steps take 0.200 s, 2.00x "
                              "its peers' median of 0.100 s, for 6 s; reported")
    [row] = a.watch.rows()
    assert (row.rank, row.node_id, row.step_s, row.peers_s, row.action) == (
        3, "b", 0.2, 0.1, "reported")
    assert a.metric("elasticd_stragglers_total", action="reported") == 1
    assert a.metric("elasticd_straggler_slowdown", rank="3", straggler_node="b") == 2.0
    assert b.events == [] and b.watch.rows() == (), "only the leader judges"

    play(cluster, 10)
    assert len(a.events) == 1, "named once per episode"

    play(cluster, 4, b_rank_3_s=0.1)  # it recovers (its median moves back in a few beats)
    assert a.events[-1][2] == ("rank 3 (node b) is no longer a straggler: its steps take "
                               "0.100 s, its peers' 0.100 s")
    assert a.watch.rows() == ()
    assert a.metric("elasticd_straggler_slowdown", rank="3", straggler_node="b") is None


def test_in_lockstep_the_leader_names_the_rank_busier_than_its_peers(cluster):
    a, b, clock, _ = cluster
    # Every rank's steps take 0.11 s; rank 3 is busy 0.1 s of it, the others 0.02 s.
    for _ in range(8):
        a.beats({0: 0.11, 1: 0.11}, busy_s={0: 0.02, 1: 0.02})
        b.beats({2: 0.11, 3: 0.11}, busy_s={2: 0.02, 3: 0.1})
        b.run()
        a.run(leading=True)
        clock.advance(1.0)

    [(_, _, message)] = a.events
    assert message == ("rank 3 (node b) is a straggler: busy 0.100 s per step, 5.00x its "
                       "peers' median of 0.020 s, for 6 s; reported")
    [row] = a.watch.rows()
    assert (row.rank, row.measure, row.step_s, row.peers_s) == (3, "busy", 0.1, 0.02)
    assert row.line().startswith("straggler: rank 3 (node b), busy 0.100 s per step, 5.00x")
    assert a.metric("elasticd_straggler_slowdown", rank="3", straggler_node="b") == 5.0

    for _ in range(4):  # it recovers
        a.beats({0: 0.11, 1: 0.11}, busy_s={0: 0.02, 1: 0.02})
        b.beats({2: 0.11, 3: 0.11}, busy_s={2: 0.02, 3: 0.02})
        b.run()
        a.run(leading=True)
        clock.advance(1.0)
    assert a.events[-1][2] == ("rank 3 (node b) is no longer a straggler: busy 0.020 s per "
                               "step, its peers' 0.020 s")


def test_replace_drains_the_node_only_when_a_standby_waits(cluster):
    a, b, clock, store = cluster
    a.watch.policy = StragglerPolicy(threshold=1.2, window_s=6.0, action="replace")

    play(cluster, 8)
    assert a.drains == []
    assert a.events[0][2].endswith("; reported; not replaced: no standby is waiting")

    a2 = Agent("a", store, clock, StragglerPolicy(window_s=6.0, action="replace"))
    cluster = (a2, b, clock, store)
    play(cluster, 8, standbys=("c:1",))
    [(node, reason)] = a2.drains
    assert node == "b" and reason.startswith("straggler: rank 3 (node b) is a straggler")
    assert a2.events[0][2].endswith("; drained node b: a standby waits to take its place")
    assert a2.metric("elasticd_stragglers_total", action="drained") == 1


def test_a_new_round_or_losing_the_lead_forgets_what_was_judged(cluster):
    a, b, clock, _ = cluster
    play(cluster, 8)
    assert a.watch.rows() != ()

    a.run(leading=False)

    assert a.watch.rows() == ()
    assert a.metric("elasticd_straggler_slowdown", rank="3", straggler_node="b") is None


def test_records_of_strangers_other_rounds_or_garbage_count_for_nothing(cluster, caplog):
    a, b, clock, store = cluster
    store.put(KEYS.step_times_of("stranger"), StepTimeRecord(3, {1: 9.0}).to_json())
    play(cluster, 2, b_rank_3_s=0.1)
    # b writes again only when its times change: these stay what the leader reads.
    store.put(KEYS.step_times_of("b"), b"{not json")
    play(cluster, 4, b_rank_3_s=0.1)
    store.put(KEYS.step_times_of("b"), StepTimeRecord(2, {2: 9.0, 3: 9.0}).to_json())
    play(cluster, 8, b_rank_3_s=0.1)

    assert a.events == []
    assert caplog.text.count("ignores a step-time record") == 1, "logged once a round"


def test_a_node_writes_its_times_only_when_they_changed_and_at_most_once_a_period():
    rule, r1 = PublishRule(period_s=1.0), StepTimeRecord(3, {0: 0.100, 1: 0.100})
    assert rule.due(r1, 0.0)
    rule.written(r1, 0.0)
    moved = StepTimeRecord(3, {0: 0.100, 1: 0.100 * (1 + 2 * CHANGE)})
    assert not rule.due(moved, 0.5), "within the period"
    assert not rule.due(StepTimeRecord(3, {0: 0.1, 1: 0.1 * (1 + CHANGE / 2)}), 5.0)
    assert rule.due(moved, 1.0)
    assert rule.due(StepTimeRecord(4, r1.step_s), 1.0), "another round"
    assert not rule.due(StepTimeRecord(3, {}), 9.0), "nothing to say"


def test_a_busy_time_is_written_again_when_it_moved_by_a_share_of_the_step():
    rule = PublishRule(period_s=1.0)
    wall = {0: 0.100, 1: 0.100}
    r1 = StepTimeRecord(3, wall, {0: 0.002, 1: 0.002})
    rule.written(r1, 0.0)
    # Doubled, but by 2 ms of a 100 ms step: the noise of a rank that mostly waits.
    assert not rule.due(StepTimeRecord(3, wall, {0: 0.002, 1: 0.004}), 5.0)
    assert rule.due(StepTimeRecord(3, wall, {0: 0.002, 1: 0.002 + 2 * CHANGE * 0.1}), 5.0)
    assert rule.due(StepTimeRecord(3, wall, {0: 0.002}), 5.0), "another rank measures it"


def test_a_rank_needs_a_few_beats_and_its_time_is_their_median():
    times = StepTimes()
    times.observe(3, 0, 0.1)
    times.observe(3, 0, 0.0)  # none timed: not a sample
    times.observe(3, 0, 5.0)  # one slow beat
    assert times.record() == StepTimeRecord(3, {})
    times.observe(3, 0, 0.1)
    assert times.record() == StepTimeRecord(3, {0: 0.1})
    times.observe(4, 1, 0.3)  # a new round starts afresh
    times.observe(3, 0, 0.1)  # a late beat of the old round is dropped
    assert times.record() == StepTimeRecord(4, {})


def test_a_rank_s_busy_time_is_the_median_of_the_beats_that_measured_it():
    times = StepTimes()
    for busy in (0.05, 0.07, 0.09, 0.06):
        times.observe(3, 0, 0.1, busy)
    for _ in range(3):
        times.observe(3, 1, 0.1)  # an older worker: wall time alone

    record = times.record()

    assert record == StepTimeRecord(3, {0: 0.1, 1: 0.1}, {0: 0.065})
    assert StepTimeRecord.from_json("k", record.to_json()) == record
    times.observe(3, 0, 0.1, 0.0)  # not measured any more: CUDA came into use
    times.observe(3, 0, 0.1, 0.03)
    assert times.record().busy_s == {}, "its old busy times are not judged as now"
    older = b'{"round": 3, "step_s": {"0": 0.1}}'  # an older agent's record
    assert StepTimeRecord.from_json("k", older) == StepTimeRecord(3, {0: 0.1}, {})


@pytest.mark.parametrize("raw, says", [
    (b'{"round": 1, "step_s": {"x": 0.1}}', "rank 'x'"),
    (b'{"round": 1, "step_s": {"0": -1}}', "expected seconds in (0, 86400]"),
    (b'{"round": 1, "step_s": {"0": true}}', "expected seconds"),
    (b'{"round": 1, "step_s": []}', "step_s"),
    (b'{"round": -1, "step_s": {}}', "round"),
    (b'{"round": 1, "step_s": {}, "busy_s": {"0": "x"}}', "field 'busy_s' gives rank 0"),
    (b'{"round": 1, "step_s": {}, "busy_s": 3}', "busy_s"),
])
def test_a_malformed_step_time_record_says_which_field(raw, says):
    with pytest.raises(MalformedRecordError, match="step_s|busy_s|round") as caught:
        StepTimeRecord.from_json("k", raw)
    assert says in str(caught.value)


@pytest.mark.parametrize("field_name", ["step_time_s", "step_busy_s"])
def test_a_heartbeat_s_step_time_is_bounded_as_the_record_that_carries_it_is(field_name):
    # What the worker channel lets in must be writable: the record refuses over MAX_STEP_S.
    at_most, over = MAX_STEP_S, math.nextafter(MAX_STEP_S, math.inf)
    check_heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(**{field_name: at_most}))
    StepTimeRecord.from_json("k", StepTimeRecord(1, {0: at_most}, {0: at_most}).to_json())
    with pytest.raises(InvalidRequestError, match=field_name):
        check_heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(**{field_name: over}))


def test_the_leader_drains_its_own_node_through_its_loop_and_another_through_its_agent(caplog):
    inbox: queue.Queue = queue.Queue()
    drain = drain_as_asked("a", inbox, None, JobLogger(logging.getLogger("test"), "j", "a"))

    drain(ROUND.members[0], "straggler: rank 1 (node a) ...")
    assert inbox.get_nowait() == DrainRequested("straggler: rank 1 (node a) ...")

    # Another node's agent is asked over gRPC; one that does not answer is logged.
    gone = Member("b", 1, "h", 2, addr=f"127.0.0.1:{free_port('127.0.0.1')}")
    with caplog.at_level(logging.WARNING):
        drain(gone, "straggler: rank 3 (node b) ...")
        deadline = time.monotonic() + 30
        while "could not drain straggler node b" not in caplog.text:
            assert time.monotonic() < deadline, "the failed drain was not logged"
            time.sleep(0.05)
    assert inbox.empty()
