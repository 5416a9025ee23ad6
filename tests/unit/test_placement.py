"""The memory tier's buddy rule: a ring of the round's members, racks interleaved."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.memory_rules import buddy_of, ring_order, source_of


def test_one_member_has_no_buddy():
    assert buddy_of("a", ["a"], {}) is None
    assert source_of("a", ["a"], {}) is None


def test_a_node_outside_the_round_has_no_buddy():
    assert buddy_of("z", ["a", "b"], {}) is None


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
