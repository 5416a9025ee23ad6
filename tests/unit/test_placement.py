"""Each member's place in a round: dense first ranks, a ring peer by node
rank, and the memory tier's buddy and source on a ring of the members with
racks interleaved."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elastic.rendezvous.api import Member
from elastic.rendezvous.placement import Peer, placements, ring_order


def placed(members, racks=None, nproc=None):
    """The placements of the members named ``members`` (node-rank order)."""
    racks, nproc = racks or {}, nproc or {}
    return placements([Member(n, i, "h", nproc.get(n, 1), f"{n}:1", racks.get(n, ""))
                       for i, n in enumerate(members)])


def buddy_of(node, members, racks):
    return placed(members, racks)[node].buddy.node_id


def source_of(node, members, racks):
    return placed(members, racks)[node].source.node_id


def test_one_member_has_no_peer_buddy_or_source():
    alone = placed(["a"])["a"]
    assert (alone.first_rank, alone.ring_next, alone.buddy, alone.source) == (0, None, None, None)


def test_first_ranks_are_dense_in_node_rank_order_whatever_each_node_runs():
    ranks = {n: p.first_rank for n, p in placed(["a", "b", "c", "d"],
                                                nproc={"a": 8, "b": 1, "c": 4, "d": 2}).items()}
    assert ranks == {"a": 0, "b": 8, "c": 9, "d": 13}


def test_the_ring_peer_is_the_next_by_node_rank_with_its_address_even_across_racks():
    racks = {"a": "A", "b": "A", "c": "B"}
    assert [placed(["a", "b", "c"], racks)[n].ring_next for n in "abc"] == [
        Peer("b", "b:1"), Peer("c", "c:1"), Peer("a", "a:1")]


def test_two_members_are_each_others_buddy():
    assert buddy_of("a", ["a", "b"], {}) == "b"
    assert buddy_of("b", ["a", "b"], {}) == "a"
    assert source_of("a", ["a", "b"], {}) == "b"


def test_without_racks_the_ring_is_node_rank_order():
    members = ["n0", "n1", "n2", "n3"]
    assert [buddy_of(n, members, {}) for n in members] == ["n1", "n2", "n3", "n0"]
    assert [source_of(n, members, {}) for n in members] == ["n3", "n0", "n1", "n2"]


def test_racks_are_interleaved_so_no_buddy_shares_its_nodes_rack():
    # In node-rank order the first two and the last two share a rack.
    members = ["a1", "a2", "b1", "b2"]
    racks = {"a1": "A", "a2": "A", "b1": "B", "b2": "B"}
    assert ring_order(members, racks) == ["a1", "b1", "a2", "b2"]
    for node in members:
        assert racks[buddy_of(node, members, racks)] != racks[node]


def test_three_racks_of_unequal_size():
    members = ["a1", "a2", "a3", "b1", "b2", "c1"]
    racks = {"a1": "A", "a2": "A", "a3": "A", "b1": "B", "b2": "B", "c1": "C"}
    order = ring_order(members, racks)
    assert sorted(order) == sorted(members)
    assert all(racks[x] != racks[y] for x, y in zip(order, order[1:] + order[:1]))


def test_a_rack_holding_most_nodes_puts_some_next_to_each_other_only_then():
    members = ["a1", "a2", "a3", "b1"]
    racks = {"a1": "A", "a2": "A", "a3": "A", "b1": "B"}
    order = ring_order(members, racks)
    same = sum(racks[x] == racks[y] for x, y in zip(order, order[1:] + order[:1]))
    assert same == 2  # three of rack A around one of B: two A-A neighbours are unavoidable


def test_a_node_without_a_rack_counts_as_a_rack_of_its_own():
    members = ["a1", "a2", "x"]
    racks = {"a1": "A", "a2": "A"}
    order = ring_order(members, racks)
    assert order == ["a1", "x", "a2"]


@given(st.lists(st.sampled_from("ABC"), min_size=2, max_size=12))
def test_every_member_has_one_buddy_never_itself_and_is_one_buddy(rack_list):
    members = [f"n{i}" for i in range(len(rack_list))]
    racks = dict(zip(members, rack_list))
    buddies = [buddy_of(n, members, racks) for n in members]
    assert all(b is not None and b != n for n, b in zip(members, buddies))
    assert sorted(buddies) == sorted(members)  # a permutation: each node holds one replica
    assert all(source_of(b, members, racks) == n for n, b in zip(members, buddies))
    # Neighbours share a rack only where one rack holds more than half the ring.
    order = ring_order(members, racks)
    biggest = max(rack_list.count(r) for r in set(rack_list))
    same = sum(racks[x] == racks[y] for x, y in zip(order, order[1:] + order[:1]))
    assert same <= max(0, 2 * biggest - len(members))
