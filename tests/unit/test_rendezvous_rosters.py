"""Rendezvous nodes over rounds whose roster is carried once in the watched
record, or only stored apart from it (a large job's): each node reads a roster
at most once, a round that keeps or replaces a node reaches the others with
no read and no roster, and a roster that cannot be read never passes for the
round."""

from __future__ import annotations

import logging

import pytest

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
    got a roster (everything goes through unchanged)."""

    def __init__(self, store: MemoryStore):
        self._store = store
        self.count = 0

    def txn(self, compares, success, failure=(), **kwargs):
        result = self._store.txn(compares, success, failure, **kwargs)
        ops = success if result.succeeded else failure
        self.count += sum(1 for op, got in zip(ops, result.results)
                          if isinstance(op, Get) and op.key.startswith(KEYS.rosters) and got)
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

    def join(self, node_id: str) -> RendezvousNode:
        self.doors[node_id] = RosterReads(self.store)
        node = RendezvousNode(self.doors[node_id], self.config,
                              NodeInfo(node_id=node_id, host="h", addr=f"{node_id}:1"),
                              clock=self.clock, port_picker=lambda _h: 1)
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
