"""Rendezvous nodes over rounds whose roster is carried once in the watched
record, or only stored apart from it (a large job's): each node reads a roster
at most once (a large job's node its own bucket of it, and the whole roster
only once it uses the list whole), a round that keeps or replaces a node
reaches the others with no read and no roster, and a roster or bucket that
cannot be read never passes for the round."""

from __future__ import annotations

import logging

import pytest

from elastic.errors import StoreError
from elastic.keyspace import JobKeys
from elastic.rendezvous import round_record
from elastic.rendezvous.api import NodeInfo
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.node import RendezvousNode
from elastic.store.api import Delete, Get
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

KEYS = JobKeys("j")


class RosterReads:
    """One node's door to the shared store, counting the node's reads that
    got a roster (``count``) or a bucket of one (``buckets``); everything
    goes through unchanged."""

    def __init__(self, store: MemoryStore):
        self._store = store
        self.count = 0
        self.buckets = 0

    def txn(self, compares, success, failure=(), **kwargs):
        result = self._store.txn(compares, success, failure, **kwargs)
        ops = success if result.succeeded else failure
        got = [op.key for op, kvs in zip(ops, result.results) if isinstance(op, Get) and kvs]
        self.count += sum(1 for key in got if key.startswith(KEYS.rosters))
        self.buckets += sum(1 for key in got if key.startswith(KEYS.roster_buckets))
        return result

    def __getattr__(self, name):
        return getattr(self._store, name)


class Job:
    """Nodes of job "j" over one synchronous store, moved by hand."""

    def __init__(self, nodes: int):
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock, synchronous=True)
        self.config = RendezvousConfig(job_id="j", min_nodes=nodes, max_nodes=nodes,
                                       settle_s=0.0, lease_ttl_s=3.0)
        self.doors: dict[str, RosterReads] = {}
        self.nodes: dict[str, RendezvousNode] = {}

    def join(self, node_id: str, on_round=None) -> RendezvousNode:
        self.doors[node_id] = RosterReads(self.store)
        node = RendezvousNode(self.doors[node_id], self.config,
                              NodeInfo(node_id=node_id, host="h", addr=f"{node_id}:1"),
                              clock=self.clock, port_picker=lambda _h: 1, on_round=on_round)
        self.nodes[node_id] = node.start(thread=False)
        return node

    def leave(self, node_id: str) -> None:
        self.nodes.pop(node_id).stop()

    def settle(self, passes: int = 6) -> None:
        for _ in range(passes):
            self.store.deliver_pending()
            for node in self.nodes.values():
                node.pump()
        self.store.deliver_pending()

    def rounds(self):
        return {n: node.latest_round for n, node in self.nodes.items()}

    def stored(self) -> set[str]:
        return {kv.key.split("/")[-2] for kv in self.store.get_prefix(KEYS.rosters)[0]}


@pytest.fixture
def stored_rosters(monkeypatch):
    """Rounds of any size behave as a large job's: no roster in the record."""
    monkeypatch.setattr(round_record, "INLINE_BYTES", 0)


@pytest.fixture(params=["inline", "stored"])
def roster_kept(request, monkeypatch):
    """Rounds whose roster fits in the record, and rounds whose roster does not."""
    if request.param == "stored":
        monkeypatch.setattr(round_record, "INLINE_BYTES", 0)


def test_each_node_reads_the_roster_once_and_a_replacement_round_with_no_read(roster_kept):
    job = Job(3)
    for n in ("a", "b", "c"):
        job.join(n)
    job.settle()
    first = job.rounds()["a"]
    assert first.node_ids == ("a", "b", "c")
    assert set(job.rounds().values()) == {first}
    leader = next(n for n, node in job.nodes.items() if node.is_leader)
    reads = {n: door.count for n, door in job.doors.items()}
    assert reads[leader] == 0 and all(reads[n] <= 1 for n in reads)

    gone = next(n for n in ("c", "b") if n != leader)
    job.leave(gone)
    job.join("d")  # a spare takes the place
    job.settle()
    second = job.rounds()["d"]
    assert second.number > first.number
    assert second.node_ids == tuple(n for n in first.node_ids if n != gone) + ("d",)
    assert set(job.rounds().values()) == {second}
    # The nodes that held the first round rebuilt the second from its delta.
    assert {n: job.doors[n].count for n in reads if n in job.nodes} == \
        {n: c for n, c in reads.items() if n in job.nodes}
    assert job.doors["d"].count == 1  # the newcomer read it once
    assert b'"packed"' not in job.store.get(KEYS.round).value  # a delta, at any size
    assert job.stored() == {round_record.roster_of(second)}  # the first one's is gone


def test_a_restart_with_the_same_members_sends_no_roster(roster_kept):
    job = Job(2)
    for n in ("a", "b"):
        job.join(n)
    job.settle()
    first = job.rounds()["a"]
    reads = {n: door.count for n, door in job.doors.items()}
    job.nodes["b"].request_restart("a worker failed", first.number, failure=True)
    job.settle()
    again = job.rounds()["b"]
    assert again.number == first.number + 1 and again.members == first.members
    assert {n: door.count for n, door in job.doors.items()} == reads
    head = job.store.get(KEYS.round).value
    assert b'"delta"' not in head and b'"packed"' not in head  # its roster is known
    assert job.stored() == {round_record.roster_of(again)}


def test_a_roster_deleted_by_hand_is_reported_and_the_next_round_is_read(stored_rosters, caplog):
    job = Job(2)
    for n in ("a", "b"):
        job.join(n)
    job.settle()
    first = job.rounds()["a"]
    job.store.txn([], [Delete(KEYS.rosters, prefix=True)])
    with caplog.at_level(logging.ERROR):
        late = job.join("late")  # a standby: the round has its two members already
        job.settle()
    assert late.latest_round is None  # never a round it could not check
    assert f"its roster {round_record.roster_of(first)} is not stored" in caplog.text
    job.nodes["a"].request_restart("operator", first.number, failure=False)
    job.settle()
    assert late.latest_round == job.rounds()["a"] and late.latest_round.number > first.number


def test_a_large_jobs_node_joins_on_its_bucket_and_reads_the_roster_whole_once_used_whole(
        stored_rosters):
    job = Job(3)
    for n in ("a", "b", "c"):
        job.join(n)
    job.settle()
    leader = next(n for n, node in job.nodes.items() if node.is_leader)
    followers = [n for n in job.nodes if n != leader]
    for n in followers:
        mine = job.nodes[n].wait_for_round(timeout_s=0)
        assert mine.member(n).node_rank == ("a", "b", "c").index(n)
        assert (job.doors[n].buckets, job.doors[n].count) == (1, 0)  # its bucket alone
    whole = job.nodes[followers[0]].latest_round  # used whole: read whole, once
    assert whole.node_ids == ("a", "b", "c") and whole.world_size == 3
    assert job.nodes[followers[0]].latest_round is whole
    assert job.doors[followers[0]].count == 1

    job.leave(followers[1])
    job.join("d")
    job.settle()
    # The node that held the roster whole rebuilt the next from its delta; the
    # one that held a bucket read its bucket of the new roster.
    assert job.doors[followers[0]].count == 1 and job.doors[followers[0]].buckets == 1
    assert job.doors[leader].count == 0
    second = job.nodes[followers[0]].latest_round
    assert second.node_ids == tuple(n for n in ("a", "b", "c") if n != followers[1]) + ("d",)
    assert job.nodes["d"].wait_for_round(timeout_s=0).member("d").node_rank == 2


def test_a_round_taken_from_a_bucket_says_so_to_its_listener(stored_rosters):
    job = Job(2)
    seen = {"a": [], "b": []}
    for n in ("a", "b"):
        job.join(n, on_round=seen[n].append)
    job.settle()
    follower = next(n for n, node in job.nodes.items() if not node.is_leader)
    taken = seen[follower][-1]
    assert not taken.holds_members and taken.member(follower) is not None
    assert job.nodes[follower].latest_round.holds_members
    assert job.nodes[follower].latest_round.node_ids == ("a", "b")


def test_a_round_replaced_while_read_whole_is_read_again_not_taken_for_the_newer_one(
        stored_rosters):
    job = Job(2)
    for n in ("a", "b"):
        job.join(n)
    job.settle()
    leader = next(n for n, node in job.nodes.items() if node.is_leader)
    follower = job.nodes[next(n for n in job.nodes if n != leader)]
    first = follower.wait_for_round(timeout_s=0)
    job.nodes[leader].request_restart("operator", first.number, failure=False)
    job.store.deliver_pending()
    job.nodes[leader].pump()  # round 2 committed; the follower has not applied it
    assert job.store.get(KEYS.round).version == first.number + 1
    with pytest.raises(StoreError, match="replaced"):
        follower.latest_round
    job.settle()
    assert follower.latest_round.number == first.number + 1
    assert follower.latest_round.node_ids == ("a", "b")


def test_a_bucket_deleted_by_hand_is_reported_and_never_passes_for_the_round(
        stored_rosters, caplog):
    job = Job(2)
    for n in ("a", "b"):
        job.join(n)
    while job.store.get(KEYS.round) is None:  # until the leader commits, no further
        job.store.deliver_pending()
        for node in job.nodes.values():
            node.pump()
    job.store.txn([], [Delete(KEYS.roster_buckets, prefix=True)])
    with caplog.at_level(logging.ERROR):
        job.settle()
    follower = next(node for node in job.nodes.values() if not node.is_leader)
    assert "bucket" in caplog.text and "is not stored" in caplog.text
    assert follower.latest_round is None  # never a round it could not check


def test_a_large_jobs_node_runs_each_round_from_its_bucket_and_never_reads_the_list_whole(
        stored_rosters):
    job = Job(4)
    for n in ("a", "b", "c", "d"):
        job.join(n)
    job.settle()
    leader = next(n for n, node in job.nodes.items() if node.is_leader)
    whole = job.nodes[leader].latest_round
    followers = [n for n in job.nodes if n != leader]
    first = {n: job.nodes[n].placed_round for n in followers}
    for n, r in first.items():
        assert not r.holds_members
        # What an agent needs of the round: its ranks, its ring peer, its buddy, its source.
        assert r.placement(n) == whole.placement(n)
        assert (job.doors[n].buckets, job.doors[n].count) == (1, 0)

    # A member leaves and a spare takes its place: the survivors read their
    # bucket of the new roster, and tell from the round's delta what changed.
    gone = followers[-1]
    job.leave(gone)
    job.join("e")
    job.settle()
    for n in followers[:-1]:
        second = job.nodes[n].placed_round
        assert second.number > first[n].number and not second.holds_members
        assert second.membership_change(first[n]) == (True, True)
        assert second.placement(n) == job.nodes[leader].latest_round.placement(n)
        assert (job.doors[n].buckets, job.doors[n].count) == (2, 0)
