"""RendezvousNode against the in-memory store: behaviour that needs no real etcd."""

from __future__ import annotations

import json
import logging
import queue
import time

import pytest

from elastic.errors import ConfigError, StoreUnavailableError
from elastic.events import read_events
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import FrozenReport, NodeInfo, ReportKind
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.inbox import Changed, Inbox, PartName, WatchEnded
from elastic.rendezvous.node import SETTLED_CHECK_S, RendezvousNode
from elastic.store.api import EventType, KeyValue, WatchEvent
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore


def test_a_node_joining_after_compaction_watches_from_the_present(caplog):
    # etcd compacts old history; a node whose job keys were never written
    # watches from the present, never from revisions that are gone.
    store = MemoryStore()
    for i in range(20):
        store.put(f"/other/{i}", b"x")
    store.compact(store.revision)
    node = RendezvousNode(store, RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1,
                                                  settle_s=0.0),
                          NodeInfo(node_id="a", host="127.0.0.1"))
    with caplog.at_level(logging.WARNING):
        node.start()
        try:
            r = node.wait_for_round(timeout_s=5)
        finally:
            node.stop()
    assert r.node_ids == ("a",)
    assert "compacted" not in caplog.text


def test_a_settled_follower_whose_lease_is_lost_registers_again_without_waiting_for_a_poll():
    # Settled, the loop thread sleeps SETTLED_CHECK_S between passes, and a
    # follower watches no key that its lease's loss deletes: only the
    # session's loss can wake it.
    store = MemoryStore()
    config = RendezvousConfig(job_id="j", min_nodes=2, max_nodes=2, settle_s=0.0,
                              lease_ttl_s=30.0)
    nodes = [RendezvousNode(store, config, NodeInfo(node_id=n, host="127.0.0.1")).start()
             for n in ("a", "b")]
    try:
        for node in nodes:
            node.wait_for_round(timeout_s=5)
        follower = next(node for node in nodes if not node.is_leader)
        time.sleep(0.2)  # past the passes that followed the round
        old = follower.lease_id

        store.revoke_lease(old)
        revoked_at = time.monotonic()
        while not (follower.registered and follower.lease_id not in (None, old)):
            assert time.monotonic() - revoked_at < SETTLED_CHECK_S / 2, "still not registered"
            time.sleep(0.01)
        assert store.get(JobKeys("j").node(follower.node_id)).lease == follower.lease_id
    finally:
        for node in nodes:
            node.stop()


# -- Driven step by step: a synchronous store, a fake clock, pump() ---------


BLIP = StoreUnavailableError("etcd did not answer (injected)")


class Cluster:
    """Rendezvous nodes over one synchronous MemoryStore, moved by hand."""

    def __init__(self, *ids, min_nodes=1, max_nodes=None, scale_up_wait_s=0.0,
                 freeze_timeout_s=0.0):
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock, synchronous=True)
        self.config = RendezvousConfig(job_id="j", min_nodes=min_nodes,
                                       max_nodes=max_nodes or len(ids), settle_s=0.0,
                                       lease_ttl_s=3.0, scale_up_wait_s=scale_up_wait_s,
                                       freeze_timeout_s=freeze_timeout_s)
        self.inboxes: dict[str, Inbox] = {}
        self.nodes = {i: self.add(i) for i in ids}

    def add(self, node_id, fence=None, on_round=None, inbox=None, probe=None,
            ready_to_join=lambda: True):
        self.inboxes[node_id] = inbox or Inbox()
        node = RendezvousNode(self.store, self.config,
                              NodeInfo(node_id=node_id, host="h", addr=f"{node_id}:1"),
                              clock=self.clock, port_picker=lambda _h: 1, fence=fence,
                              on_round=on_round, inbox=self.inboxes[node_id], probe=probe,
                              ready_to_join=ready_to_join)
        return node.start(thread=False)

    def settle(self, passes=4):
        for _ in range(passes):
            self.store.deliver_pending()
            for node in self.nodes.values():
                node.pump()
        self.store.deliver_pending()

    def round(self):
        return self.nodes[next(iter(self.nodes))].latest_round


def test_a_node_joins_a_running_job_once_ready_and_the_first_round_at_once():
    # Not ready (its workers still warming): a first round still waits for it...
    warm = {"b": False, "c": False}
    c = Cluster(min_nodes=2, max_nodes=3)
    c.nodes = {"a": c.add("a"), "b": c.add("b", ready_to_join=lambda: warm["b"])}
    c.settle()
    assert c.round().node_ids == ("a", "b")
    # ...but a round that runs goes on without it until it is ready: the round
    # that admits it would stop every member's workers until its own start.
    c.nodes["c"] = c.add("c", ready_to_join=lambda: warm["c"])
    c.settle()
    assert not c.nodes["c"].registered and "ready" in c.nodes["c"].registration.problem
    assert c.round().node_ids == ("a", "b")
    warm["c"] = True
    c.settle()
    assert c.nodes["c"].registered and c.round().node_ids == ("a", "b", "c")


def test_a_node_knows_which_round_was_committed_when_it_registered():
    # Rounds up to that one were formed for an earlier registration of its id.
    c = Cluster(min_nodes=2, max_nodes=3)
    c.nodes = {"a": c.add("a"), "b": c.add("b")}
    c.settle()
    assert c.round().number == 1
    assert c.nodes["a"].registration.after == c.nodes["b"].registration.after == 0
    ready = [False]
    c.nodes["c"] = c.add("c", ready_to_join=lambda: ready[0])
    c.settle()
    assert c.nodes["c"].registration.after is None  # not registered yet
    ready[0] = True
    c.settle()
    assert c.nodes["c"].registration.after == 1 and c.round().number == 2


def test_a_store_error_while_taking_over_as_leader_is_retried_until_it_leads():
    # Before: the takeover's failed read left a leader with no watches whose
    # key lived on (kept alive by its lease): no round ever formed again.
    c = Cluster("a")
    c.store.fail_next("get_prefix", BLIP, times=3)
    c.settle(passes=8)
    assert c.nodes["a"].is_leader
    assert c.round() is not None and c.round().node_ids == ("a",)


def test_a_leader_that_cannot_take_over_for_a_ttl_steps_down_then_leads_again():
    c = Cluster("a")
    c.store.fail_next("get_prefix", BLIP, times=1000)
    c.settle(passes=2)
    leader_key = c.nodes["a"].keys.leader
    assert c.store.peek(leader_key) is not None and c.round() is None
    c.clock.advance(3.5)
    c.settle(passes=2)
    assert c.store.peek(leader_key) is None  # stepped down: another node may lead
    c.store.clear_failures()
    c.settle(passes=2)
    assert c.store.peek(leader_key) is None  # and it waits a TTL before trying again
    c.clock.advance(3.5)
    c.settle(passes=6)
    assert c.round() is not None and c.round().node_ids == ("a",)


def test_a_watch_ended_by_compaction_is_recreated_even_if_the_first_reread_fails():
    c = Cluster("a", "b", min_nodes=2)
    c.settle()
    first = c.round().number
    c.store.compact(c.store.revision)
    # The round watch of b ends (as etcd ends a compacted watch); the re-read fails once.
    c.store.fail_next("txn", BLIP, times=1)
    c.inboxes["b"].post(WatchEnded(PartName.ROUND, RuntimeError("compacted")))
    c.settle()
    c.nodes["a"].request_restart("operator", first, failure=False)
    c.settle()
    assert c.nodes["b"].latest_round.number == first + 1


def test_the_master_port_is_advertised_after_the_round_is_handed_on_and_retried():
    seen = []
    clock = FakeClock()
    store = MemoryStore(clock=clock, synchronous=True)
    config = RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1, settle_s=0.0)
    ports = iter(range(2000, 3000))
    node = RendezvousNode(store, config, NodeInfo(node_id="a", host="h"), clock=clock,
                          on_round=seen.append, port_picker=lambda _h: next(ports)).start(
        thread=False)
    store.fail_next("put", BLIP, times=1)  # the advertisement fails once
    for _ in range(4):
        store.deliver_pending()
        node.pump()
    assert [r.number for r in seen] == [1]  # the round reached the agent regardless
    advertised = NodeInfo.from_json(node.keys.node("a"), store.peek(node.keys.node("a")).value)
    assert advertised.master_port >= 2000  # and the fresh port got out on a later pass


def test_reports_are_written_under_the_reporters_lease():
    c = Cluster("a", "b")
    c.settle()
    c.nodes["a"].report(ReportKind.DONE, c.round().number)
    c.nodes["a"].report(ReportKind.SUSPECT, c.round().number, about="b")
    keys = c.nodes["a"].keys
    assert c.store.peek(keys.done_report("a")).lease == c.nodes["a"].lease_id
    assert c.store.peek(keys.suspect_report("b")).lease == c.nodes["a"].lease_id


def test_a_joiner_waits_for_a_checkpoint_committed_after_it_registered():
    c = Cluster("a", min_nodes=1, max_nodes=2, scale_up_wait_s=600.0)
    c.store.put(c.nodes["a"].keys.checkpoint_latest, b"step 9")  # before b: does not count
    c.settle()
    assert c.round().node_ids == ("a",)
    c.nodes["b"] = c.add("b")
    c.settle()
    assert c.round().node_ids == ("a",)  # b waits for the next checkpoint
    c.store.put(c.nodes["a"].keys.checkpoint_latest, b"step 19")
    c.settle()
    assert c.round().node_ids == ("a", "b")


class Fence:
    """The leader's fence (RendezvousNode's ``fence``): records whom it told,
    and answers that their workers stopped only once ``stopped`` is set."""

    def __init__(self):
        self.told: list[tuple[str, ...]] = []
        self.stopped = False

    def __call__(self, addrs):
        self.told.append(addrs)
        return self.stopped


def fenced_cluster():
    """Members a (the leader, with the fence) and b, b's lease lost and b silent."""
    fence = Fence()
    c = Cluster(min_nodes=1, max_nodes=2)
    c.nodes = {"a": c.add("a", fence=fence)}
    c.settle()
    c.nodes["b"] = c.add("b")
    c.settle()
    assert c.nodes["a"].is_leader and c.round().node_ids == ("a", "b")
    first = c.round().number
    lost = c.nodes.pop("b")
    c.store.revoke_lease(lost.lease_id)
    c.settle()
    return c, fence, first


def test_a_leader_leaving_out_a_lost_member_waits_until_its_workers_stopped():
    c, fence, first = fenced_cluster()
    for _ in range(4):
        c.clock.advance(1.0)  # past the fence retry (FENCE_RETRY_S): asked again, still running
        c.settle()
    assert c.round().number == first  # no round without b while b's workers may run
    assert fence.told and set(fence.told) == {("b:1",)}
    fence.stopped = True
    c.clock.advance(1.0)
    c.settle()
    assert c.round().number == first + 1 and c.round().node_ids == ("a",)


def test_a_leader_goes_on_three_ttls_after_it_began_fencing_a_member_that_never_stops(caplog):
    c, fence, first = fenced_cluster()
    ttl = c.config.lease_ttl_s
    with caplog.at_level(logging.WARNING):
        c.clock.advance(3 * ttl - 0.5)
        c.settle()
        assert c.round().number == first
        c.clock.advance(1.0)
        c.settle()
    assert c.round().number == first + 1 and c.round().node_ids == ("a",)
    assert "lost members at b:1 still report running workers" in caplog.text


def test_a_leader_forms_a_round_that_loses_nobody_without_fencing():
    c, fence, first = fenced_cluster()
    fence.stopped = True
    c.clock.advance(1.0)
    c.settle()
    told = len(fence.told)
    c.nodes["a"].request_restart("operator", c.round().number, failure=False)
    c.settle()
    assert c.round().number == first + 2 and len(fence.told) == told


# -- Frozen members (the freeze rule: decisions.revoke_frozen) ---------


class Probe:
    """A leader's own check of an agent: answered unless its address is frozen."""

    def __init__(self):
        self.frozen: set[str] = set()
        self.asked: list[str] = []

    def __call__(self, addr):
        self.asked.append(addr)
        return addr not in self.frozen


def frozen_cluster():
    """a (the leader, with its fence and probe), b and c in one round; a freeze timeout of 1 s."""
    fence, probe = Fence(), Probe()
    c = Cluster(min_nodes=1, max_nodes=3, freeze_timeout_s=1.0)
    c.nodes = {"a": c.add("a", fence=fence, probe=probe)}
    c.settle()
    for n in ("b", "c"):
        c.nodes[n] = c.add(n, probe=Probe())
        c.settle()
    assert c.nodes["a"].is_leader and c.round().node_ids == ("a", "b", "c")
    return c, fence, probe


def test_a_leader_that_reports_its_ring_peer_frozen_revokes_its_lease(caplog):
    c, fence, probe = frozen_cluster()
    first = c.round().number
    frozen = c.nodes.pop("b")
    old_lease = frozen.lease_id

    with caplog.at_level(logging.WARNING):
        c.nodes["a"].report(ReportKind.FROZEN, first, "b", silent_s=1.1)  # a watches b
        c.settle()

    assert probe.asked == []  # a's own failed probes are the leader's check
    assert frozen.lease_id is None  # its lease is gone: it fail-stops when it thaws
    assert c.store.peek(JobKeys("j").node("b")) is None
    assert c.round().number == first + 1 and c.round().node_ids == ("a", "c")
    assert fence.told == []  # proven unanswering: the fence does not wait for it
    assert ("revoked the lease of b: its agent answered no probe for 1.1 s (reported and "
            "confirmed by a)") in caplog.text
    frozen_events = [e for e in read_events(c.store, JobKeys("j")) if e.kind == "frozen"]
    assert [e.message for e in frozen_events] == [
        "revoking the lease of b: its agent answered no probe for 1.1 s (reported and "
        "confirmed by a)"]

    c.nodes["b"] = frozen  # it thaws: its session is lost, it registers again as a newcomer
    c.settle(passes=6)
    assert frozen.registered and frozen.lease_id not in (None, old_lease)
    assert c.round().number == first + 1  # kept out for suspect_s, as a suspect is
    c.clock.advance(c.config.suspect_s + 0.1)
    c.settle(passes=6)
    assert c.round().number == first + 2 and c.round().node_ids == ("a", "c", "b")


def test_a_member_reported_frozen_that_answers_the_leader_keeps_its_place(caplog):
    c, fence, probe = frozen_cluster()
    first = c.round().number

    with caplog.at_level(logging.INFO):
        c.nodes["b"].report(ReportKind.FROZEN, first, "c", silent_s=1.5)  # b watches c
        c.settle()

    assert probe.asked == ["c:1"]  # the leader a checks it itself
    assert c.round().number == first and c.nodes["c"].lease_id is not None
    assert "its agent answered a, so it is alive" in caplog.text
    c.clock.advance(1.0)
    c.settle()
    assert probe.asked == ["c:1"]  # judged once


def test_a_member_reported_frozen_and_silent_to_the_leader_too_is_revoked(caplog):
    c, fence, probe = frozen_cluster()
    first = c.round().number
    frozen = c.nodes.pop("c")
    probe.frozen.add("c:1")

    with caplog.at_level(logging.WARNING):
        c.nodes["b"].report(ReportKind.FROZEN, first, "c", silent_s=1.2)
        c.settle()

    assert frozen.lease_id is None and c.round().node_ids == ("a", "b")
    report = c.store.peek(JobKeys("j").frozen_report("c"))
    assert FrozenReport.from_json(report.key, report.value) == FrozenReport(
        round=first, by="b", silent_s=1.2, confirmed_by="a")
    assert "(reported by b, confirmed by a)" in caplog.text


def test_a_member_that_reports_the_leader_frozen_revokes_its_lease_in_its_place():
    c, fence, probe = frozen_cluster()
    first = c.round().number
    leader = c.nodes.pop("a")

    c.nodes["c"].report(ReportKind.FROZEN, first, "a", silent_s=1.0)  # c watches a
    c.settle(passes=6)

    assert leader.lease_id is None
    assert c.round().number == first + 1 and c.round().node_ids == ("b", "c")
    assert "a" not in c.round().node_ids and c.round().leader in ("b", "c")


def test_a_short_silence_or_an_old_round_revokes_nothing():
    c, fence, probe = frozen_cluster()
    first = c.round().number
    probe.frozen.add("b:1")
    probe.frozen.add("c:1")
    c.nodes["a"].report(ReportKind.FROZEN, first, "b", silent_s=0.9)
    c.nodes["b"].report(ReportKind.FROZEN, first - 1, "c", silent_s=5.0)
    c.settle()
    assert c.round().number == first and c.nodes["b"].lease_id is not None
    assert c.nodes["c"].lease_id is not None


# -- Hostile records (see also tests/integration/test_hostile_input.py) ---------


def test_a_leader_key_that_no_leader_wrote_is_taken_back():
    # Garbage, a huge value, an id with a newline, a valid id without a lease
    # (which no lease expiry would ever delete): none is a leader.
    c = Cluster("a")
    c.settle()
    keys = c.nodes["a"].keys
    for value in (b"\xff\xfe", b"x" * 100_000, b"a\n", b"evil"):
        c.store.put(keys.leader, value)
        c.settle(passes=2)
        assert c.store.peek(keys.leader).value == b"a"
        assert c.store.peek(keys.leader).lease == c.nodes["a"].lease_id
        assert c.nodes["a"].is_leader


def test_watch_events_are_applied_in_the_order_they_arrived():
    # The message that wakes the loop thread is applied before those that
    # arrived while it woke: else a node could apply a leader key's old value
    # last and believe in a leader long replaced.
    class Arrivals(queue.Queue):
        """The first blocking get() wakes the loop with ours; a newer event arrives at once."""

        woke = False

        def get(self, block=True, timeout=None):
            if block and not self.woke:  # the loop's wait (take() gets without blocking)
                self.woke = True
                self.put(put(b"evil", 101))  # posted by the watch thread meanwhile
                return put(b"a", 100, lease=node.lease_id)
            return super().get(block, timeout)

    def put(value, revision, lease=0):
        return Changed(PartName.LEADER, (WatchEvent(
            EventType.PUT, KeyValue(keys.leader, value, 1, revision, revision, lease)),))

    c = Cluster(max_nodes=1)
    c.nodes = {"a": c.add("a", inbox=Inbox(Arrivals()))}
    c.settle()
    node, keys = c.nodes["a"], c.nodes["a"].keys
    c.store.fail_next("txn", BLIP, times=1000)  # no campaign: only the events are under test
    # One pass of the node's loop thread: wait for news, then pump.
    assert c.inboxes["a"].wait(timeout_s=1.0) == put(b"a", 100, lease=node.lease_id)
    node.pump()
    assert node.leader_id is None  # evil (no lease) arrived last: nobody leads


def test_a_garbage_round_event_delivered_after_the_leaders_commit_does_not_stall_later_rounds():
    # Garbage written to the round key, its watch event arriving after the
    # leader re-read the key and committed a round on top: a late event must
    # not set back the version the leader fences on, or every later round
    # fails its fence and a restart request is never served.
    c = Cluster("a")
    c.settle()
    node, keys = c.nodes["a"], c.nodes["a"].keys
    first = c.round()
    c.store.put(keys.round, b"garbage")
    node.request_restart("first request", first.number, failure=False)
    for _ in range(3):  # the round watch's garbage event stays queued
        c.store.deliver_pending(hold=keys.round)
        node.pump()  # fence fails on the garbage, re-read; then commit on top of it
        c.clock.advance(1.0)
    on_top = node.latest_round
    assert on_top.number == c.store.peek(keys.round).version == first.number + 2
    assert on_top.continues == first.number  # the round written again, its workers kept
    c.settle()  # the garbage's event arrives now, late; the request about round 1 is served
    served = c.round()
    assert served.number == on_top.number + 1 and "first request" in served.reason
    node.request_restart("second request", served.number, failure=False)
    c.settle()
    assert c.round().number == served.number + 1
    assert "second request" in c.round().reason


def test_garbage_over_the_round_is_overwritten_by_the_same_round_and_restarts_nothing():
    seen = []
    c = Cluster(max_nodes=2)
    c.nodes = {"a": c.add("a"), "b": c.add("b", on_round=seen.append)}
    c.settle()
    first = c.round()
    seen.clear()  # only the rounds after the first count here
    keys = c.nodes["a"].keys
    for write in range(3):  # each write of garbage: the round written again, nothing more
        c.store.put(keys.round, b"garbage")
        c.settle()
        again = c.round()
        assert again.number == c.store.peek(keys.round).version == first.number + 2 * (write + 1)
        assert again.continues == first.number and again.workers_round == first.number
        assert first.continued_by(again)
        assert (again.members, again.master_port) == (first.members, first.master_port)
        assert "a malformed record replaced it" in again.reason
    assert [r.continues for r in seen] == [first.number] * 3
    # Reports and requests about the round it continues count for it.
    c.nodes["b"].request_restart("worker died", first.number, failure=True)
    c.settle()
    assert c.round().continues == 0 and "restart requested by b" in c.round().reason


@pytest.mark.parametrize("stored", [
    b"[" * 50_000 + b"]" * 50_000,  # nested past the parser's recursion limit: malformed
    b"\xff\xfe",
    b'{"min_nodes": "1", "max_nodes": [], "max_restarts": NaN}',
    b'"a string"',
])
def test_a_malformed_config_record_is_overwritten_and_the_node_joins(stored, caplog):
    store = MemoryStore()
    store.put(JobKeys("j").config, stored)
    node = RendezvousNode(store, RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1,
                                                  settle_s=0.0),
                          NodeInfo(node_id="a", host="127.0.0.1"))
    with caplog.at_level(logging.ERROR):
        node.start()
        try:
            assert node.wait_for_round(timeout_s=5).node_ids == ("a",)
        finally:
            node.stop()
    assert "malformed record at key '/elastic/v1/j/config'" in caplog.text
    assert json.loads(store.get(JobKeys("j").config).value)["max_nodes"] == 1


def test_other_settings_in_the_config_record_are_named_short_and_printable():
    store = MemoryStore()
    store.put(JobKeys("j").config, json.dumps(
        {"min_nodes": 1, "max_nodes": 2, "max_restarts": 3, "restart_window_s": 3600.0,
         "exit_barrier_timeout_s": 300.0, "scale_up_wait_s": 0.0,
         "future\x1b[2J": "x" * 100_000}).encode())
    node = RendezvousNode(store, RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1),
                          NodeInfo(node_id="a", host="127.0.0.1"))
    with pytest.raises(ConfigError) as info:
        node.start()
    message = str(info.value)
    assert "max_nodes 2 (this agent: 1)" in message and "future\\x1b[2J" in message
    assert "\x1b" not in message and len(message) < 1000


def test_the_leader_publishes_a_few_long_registered_standbys_not_every_node_on_every_join():
    # Before: every registration rewrote the standbys record with all N
    # registered nodes, and every node's watch got it: N^2 events of O(N)
    # bytes before the first round (18 s for 256 nodes in bench/rendezvous.py).
    from elastic.rendezvous.api import STANDBY_WITNESSES

    clock = FakeClock()
    store = MemoryStore(clock=clock, synchronous=True)
    config = RendezvousConfig(job_id="j", min_nodes=40, max_nodes=40, settle_s=0.0,
                              lease_ttl_s=3.0)
    nodes = []
    for i in range(30):  # fewer than min_nodes: no round, every node a standby
        info = NodeInfo(node_id=f"n{i:02d}", host="h", addr=f"10.0.0.{i}:29400")
        nodes.append(RendezvousNode(store, config, info, clock=clock,
                                    port_picker=lambda _h: 1).start(thread=False))
        for _ in range(3):
            store.deliver_pending()
            for node in nodes:
                node.pump()
    record = store.peek(nodes[0].keys.standbys)
    assert json.loads(record.value)["addrs"] == [f"10.0.0.{i}:29400"
                                                 for i in range(STANDBY_WITNESSES)]
    assert record.version <= STANDBY_WITNESSES  # written while the list filled, then left alone
    assert nodes[-1].standby_addrs == tuple(f"10.0.0.{i}:29400" for i in range(STANDBY_WITNESSES))
