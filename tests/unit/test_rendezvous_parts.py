"""The rendezvous node's parts on their own: the inbox's order, the follower's
table of parts. No threads, no sleeping: messages are posted and taken by hand."""

from __future__ import annotations

import logging

from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import Standbys
from elastic.rendezvous.committed import CommittedRound
from elastic.rendezvous.follower import BadRecords, Follower, Part
from elastic.rendezvous.inbox import Changed, Inbox, PartName, SessionLost, Stop, WatchEnded
from elastic.store.api import EventType, KeyValue, WatchEvent
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

KEYS = JobKeys("j")
LOG = JobLogger(logging.getLogger(__name__), "j", "a")


def put(key, value, revision, lease=7):
    return WatchEvent(EventType.PUT, KeyValue(key, value, revision, revision, 1, lease))


def delete(key, revision):
    return WatchEvent(EventType.DELETE, KeyValue(key, b"", revision, revision, 0, 0))


# -- Inbox ----------------------------------------------------------------------


def test_messages_are_taken_in_the_order_they_were_posted():
    inbox = Inbox()
    messages = [SessionLost(), WatchEnded(PartName.ROUND, RuntimeError("compacted")), Stop()]
    for m in messages:
        inbox.post(m)
    assert inbox.has_news()
    assert list(inbox.take()) == messages
    assert not inbox.has_news() and list(inbox.take()) == []


def test_the_message_that_ended_a_wait_is_taken_first():
    inbox = Inbox()
    inbox.post(SessionLost())
    assert inbox.wait(timeout_s=0.0) == SessionLost()
    inbox.post(Stop())  # arrived while the waiter woke
    assert inbox.has_news()
    assert list(inbox.take()) == [SessionLost(), Stop()]


def test_a_wait_with_nothing_posted_returns_none():
    inbox = Inbox()
    assert inbox.wait(timeout_s=0.0) is None and not inbox.has_news()


# -- The follower's table ---------------------------------------------------------


class Recorder:
    """A leader-only row that records what it was given."""

    def __init__(self):
        self.loaded, self.applied = [], []

    def part(self) -> Part:
        return Part(PartName.NODES, KEYS.nodes, True, True,
                    lambda kvs, rev, now: self.loaded.append((kvs, rev)),
                    lambda evs, now: self.applied.append(list(evs)))


def follower(node_id="a"):
    clock = FakeClock()
    bad = BadRecords(LOG)
    f = Follower(MemoryStore(clock=clock, synchronous=True), KEYS, node_id, clock,
                 CommittedRound(clock, node_id, LOG, bad), lambda m: None, bad, LOG)
    recorder, stops = Recorder(), []
    f.add_leader_parts([recorder.part()], lambda: stops.append(True))
    return f, recorder, stops


def test_a_leader_only_part_is_applied_only_while_this_node_leads():
    f, recorder, _ = follower()
    events = (put(KEYS.node("b"), b"{}", 5),)
    f.apply(Changed(PartName.NODES, events), 0.0)
    assert recorder.applied == []
    f.apply(Changed(PartName.LEADER, (put(KEYS.leader, b"a", 6),)), 0.0)
    assert f.is_leader
    f.apply(Changed(PartName.NODES, events), 0.0)
    assert recorder.applied == [list(events)]


def test_the_leader_key_naming_another_node_stops_the_leaders_parts_once_per_batch():
    f, _, stops = follower()
    f.apply(Changed(PartName.LEADER, (put(KEYS.leader, b"b", 6), put(KEYS.leader, b"a", 7))),
            0.0)
    assert f.is_leader and stops == []  # the batch ends with this node leading
    f.pending.add(PartName.NODES)
    f.apply(Changed(PartName.LEADER, (delete(KEYS.leader, 8),)), 0.0)
    assert f.leader_id is None and stops == [True]
    assert PartName.NODES not in f.pending  # nothing of the leader's is read again


def test_a_leader_key_without_a_lease_names_no_leader():
    f, _, _ = follower()
    f.apply(Changed(PartName.LEADER, (put(KEYS.leader, b"a", 6, lease=0),)), 0.0)
    assert f.leader_id is None


def test_an_ended_watch_leaves_its_part_pending_until_read_again():
    f, _, _ = follower()
    f.watch_ended(WatchEnded(PartName.STANDBYS, RuntimeError("compacted")))
    assert f.pending == {PartName.STANDBYS} and not f.settled
    f.resync_pending()
    assert f.pending == set()


def test_standbys_are_applied_and_a_malformed_record_keeps_the_last_good_one():
    f, _, _ = follower()
    good = Standbys(("10.0.0.1:29400",))
    f.apply(Changed(PartName.STANDBYS, (put(KEYS.standbys, good.to_json(), 3),)), 0.0)
    assert f.standbys == good
    f.apply(Changed(PartName.STANDBYS, (put(KEYS.standbys, b"garbage", 4),)), 0.0)
    assert f.standbys == good
    f.apply(Changed(PartName.STANDBYS, (delete(KEYS.standbys, 5),)), 0.0)
    assert f.standbys == Standbys()
