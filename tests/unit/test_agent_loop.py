"""The agent's loop in-process: a real Agent and RendezvousNode over the
synchronous in-memory store and fake workers (the simulator's parts), moved by
a fake clock. Each test: a scenario, a fault, what the agent must do."""

from __future__ import annotations

import base64
import json
import zlib

from agent.daemon import STEADY_TICK_S, TICK_S
from agent.lifecycle import AgentState as S
from agent.metrics import NO_METRICS
from agent.publishing import STATUS_PROGRESS_S
from elastic.errors import StoreUnavailableError
from elastic.rendezvous import roster, round_record
from elastic.rendezvous.api import Round
from elastic.store.api import EventType
from tests.fakes.agent_config import one_node_config
from tests.sim.one_node import OneNode as OneNodeHarness

BLIP = StoreUnavailableError("etcd did not answer (injected)")


class OneNode(OneNodeHarness):
    """One agent with two fake workers; ``run(seconds)`` moves everything."""

    def __init__(self, total_steps=1000, metrics=NO_METRICS, lease_ttl_s=3.0):
        super().__init__(one_node_config(lease_ttl_s=lease_ttl_s), total_steps=total_steps,
                         metrics=metrics)
        self.status_writes = 0
        self.store.watch(self.rdzv.keys.status_of("a"), self._count, start_revision=1)
        self.agent.start(threaded=False)

    def _count(self, events):
        self.status_writes += sum(e.type is EventType.PUT for e in events)

    def round(self) -> Round | None:
        return self.rdzv.latest_round


def test_status_is_rewritten_at_once_for_a_change_of_meaning_and_for_progress_alone_every_30_s():
    node = OneNode()
    node.run(5)
    assert node.agent.state is S.RUNNING
    settled = node.status_writes
    node.run(STATUS_PROGRESS_S - 6)  # steps and heartbeats only: the record's step may lag
    assert node.status_writes == settled, "status rewritten for progress alone within 30 s"
    node.run(8)  # 30 s since it was written, with a newer step: rewritten once
    assert node.status_writes == settled + 1
    crashed = next(w for w in node.supervisor.current if w.alive)
    node.workers.end(crashed, 1, node.clock.monotonic())
    node.run(0.5)  # a failure changes the meaning: written at the next pass
    assert node.status_writes >= settled + 2
    record = json.loads(node.store.get(node.rdzv.keys.status_of("a")).value)
    assert "exited with 1" in record["last_failure"]


def test_a_worker_that_finishes_first_is_written_at_once_as_succeeded():
    node = OneNode()
    node.run(5)
    settled = node.status_writes
    done = next(w for w in node.supervisor.current if w.alive)
    node.workers.end(done, 0, node.clock.monotonic())  # its peer still trains
    node.run(0.5)
    assert node.status_writes == settled + 1
    record = json.loads(node.store.get(node.rdzv.keys.status_of("a")).value)
    assert [w["state"] for w in record["workers"]].count("succeeded") == 1, record["workers"]
    node.run(5)
    assert node.status_writes == settled + 1, "rewritten with nothing new to say"


def test_a_crash_stops_the_workers_at_once_even_while_etcd_refuses_the_restart_request():
    node = OneNode()
    node.run(3)
    first = node.round().number
    crashed = next(w for w in node.supervisor.current if w.alive)
    node.store.fail_next("put", BLIP, times=6)  # the restart request fails six times
    node.workers.end(crashed, 1, node.clock.monotonic())
    node.run(0.25)
    assert node.agent.state is not S.RUNNING
    assert not any(w.alive for w in node.supervisor.current), "workers left running"
    node.run(5)  # the request is retried until etcd takes it, and a new round forms
    assert node.round().number == first + 1
    assert node.agent.state is S.RUNNING


def test_a_crash_puts_its_restart_request_in_etcd_before_the_workers_are_stopped():
    # The leader then forms the next round, and the other members stop their
    # workers, while this node stops its own: the stops overlap.
    node = OneNode()
    node.run(3)
    requests_when_stopped = []
    stop = node.supervisor.stop

    def stop_and_look(timeout_s=None):
        requests_when_stopped.append(node.store.peek_prefix(node.rdzv.keys.restart_requests))
        return stop(timeout_s)

    node.supervisor.stop = stop_and_look
    crashed = next(w for w in node.supervisor.current if w.alive)
    node.workers.end(crashed, 1, node.clock.monotonic())
    node.run(0.25)
    assert len(requests_when_stopped) == 1
    assert [json.loads(kv.value)["reason"] for kv in requests_when_stopped[0]] == [
        f"worker rank {crashed.rank} (pid {crashed.pid}) exited with 1"]


def test_job_end_is_retried_through_store_errors_and_never_kills_a_worker():
    node = OneNode(total_steps=6)
    node.run(2)
    node.store.fail_next("txn", BLIP, times=4)  # the final round's commit fails at first
    node.run(10)
    assert node.agent.state is S.SUCCEEDED
    final = node.round()
    assert final.outcome == "succeeded"
    assert all(w.exit_code == 0 and not w.stopped for w, _ in node.workers.exits)


def test_workers_are_told_to_hold_while_the_lease_is_unconfirmed():
    # A node resumed after a freeze longer than its lease: its workers must not
    # step before the agent knows whether a newer round formed meanwhile.
    from elastic.v1 import agent_pb2

    node = OneNode()
    node.run(3)
    beat = agent_pb2.WorkerChannelHeartbeatRequest(rank=0, local_rank=0, round=node.round().number,
                                                   step=1)
    assert node.agent.channel.heartbeat(beat) == (False, False)
    node.store.suspend_keepalive(node.rdzv.lease_id)  # etcd stops confirming the lease
    node.clock.advance(1.6)  # more than half the 3 s TTL
    assert node.agent.channel.heartbeat(beat) == (False, True)


def test_a_steady_agent_sleeps_to_its_next_deadline_and_ticks_again_once_the_lease_is_in_doubt():
    node = OneNode(lease_ttl_s=12.0)  # keep-alives every 4 s; peers asked after 6 s without
    node.run(5)
    assert node.agent.state is S.RUNNING
    # Lease confirmed, workers stepping, nothing to write: the longest sleep.
    assert node.agent.next_pass_in() == STEADY_TICK_S
    node.store.suspend_keepalive(node.rdzv.lease_id)  # etcd stops confirming the lease
    node.run(4.5)
    assert TICK_S < node.agent.next_pass_in() < STEADY_TICK_S  # woken when it turns 6 s
    node.run(2.0)
    assert node.agent.next_pass_in() == TICK_S  # in doubt: every tick, as before


def test_a_round_whose_roster_fails_when_used_whole_is_refused_and_the_workers_run_on(caplog):
    node = OneNode()
    node.run(3)
    assert node.agent.state is S.RUNNING
    before = node.round()
    workers = [w for w in node.supervisor.current if w.alive]
    me = before.member("a")
    # Written by hand: a round whose roster holds this node's valid line and
    # a line that is not a member (its digest is its text's: only a field is wrong).
    text = f"a\t{me.host}\t{me.nproc}\t{me.addr}\t\nb\tno host!\t8\t\t\n".encode()
    head = json.loads(round_record.head_of(before, None, "")[0])
    head.update(number=before.number + 1, nnodes=2, roster=roster.digest(text),
                packed=base64.b64encode(zlib.compress(text)).decode())
    node.store.put(node.rdzv.keys.round, json.dumps(head).encode())
    node.run(2)
    # Refused where the members are used whole: reported, never raised; the
    # leader writes the round before it again on top, and its workers run on.
    assert "members[1].host" in caplog.text
    after = node.round()
    assert after.number > before.number + 1 and after.continues == before.workers_round
    assert after.members == before.members
    assert node.agent.state is S.RUNNING
    assert [w for w in node.supervisor.current if w.alive] == workers
