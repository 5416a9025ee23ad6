"""Where each member of a round sits beyond its node rank: its first global
rank, the member after it (whose agent it probes), its buddy (the node it
replicates its memory-tier snapshots to) and its source (the node whose
replicas it holds).

Every one of them follows from the whole member list, so whoever holds the
list decides them, for everyone at once and in O(members)
(:func:`placements`): the leader writes each member's beside its line in
its roster bucket (:mod:`elastic.rendezvous.buckets`), so that a node of a
large job learns its own from its ~2 KB bucket instead of reading the list
whole, and a round that holds its members whole computes them the same way
(:meth:`elastic.rendezvous.api.Round.placement`).

The rules:

* **First rank**: global ranks are dense and follow node ranks; a node's
  first is the number of workers on the nodes before it (nodes may differ in
  nproc).
* **Ring peer**: the next member in node-rank order, the last's is the
  first: each node watches one peer, so health checks cost O(1) per node.
* **Buddy and source** (:func:`ring_order`): the members form a second ring,
  in node-rank order unless some share a rack; then it is reordered so that
  neighbours sit on different racks wherever the racks' sizes allow it, and
  losing one rack loses no snapshot together with its replica. A node
  without a rack counts as a rack of its own. A node's buddy is the next in
  that ring, its source the one before it.

A round of one member places it with no peer, buddy or source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence


class _Placed(Protocol):
    """What placing a member reads of it (an api.Member)."""

    node_id: str
    nproc: int
    addr: str
    rack: str


@dataclass(frozen=True)
class Peer:
    """Another member, as a node needs it: its id and its agent's address
    ("" when it gave none)."""

    node_id: str
    addr: str


@dataclass(frozen=True)
class Placement:
    """One member's place in its round (see the module docstring); the peers
    are None in a round of one member."""

    first_rank: int
    ring_next: Peer | None
    buddy: Peer | None
    source: Peer | None


def ring_order(members: Sequence[str], racks: Mapping[str, str]) -> list[str]:
    """The replication ring: ``members`` (node ids in node-rank order) as they
    are when no two share a rack. Else the nodes, grouped by rack (largest
    rack first, ties in order of first appearance; node-rank order within a
    rack), are dealt to the ring's even places, then to its odd ones: two
    neighbours then share a rack only when one rack holds more than half of
    the ring, and then no more often than that forces (``2 * largest - n``)."""
    groups: dict[str, list[str]] = {}
    for node in members:
        # A node without a rack is a rack of its own ("\0" never starts a rack's name).
        groups.setdefault(racks.get(node) or f"\0{node}", []).append(node)
    if len(groups) == len(members):
        return list(members)
    dealt = [node for group in sorted(groups.values(), key=len, reverse=True)
             for node in group]
    places = list(range(0, len(dealt), 2)) + list(range(1, len(dealt), 2))
    order = [""] * len(dealt)
    for place, node in zip(places, dealt):
        order[place] = node
    return order


def placements(members: Sequence[_Placed]) -> dict[str, Placement]:
    """Every member's placement, by node id, for ``members`` in node-rank order."""
    ids = [m.node_id for m in members]
    peers = {m.node_id: Peer(m.node_id, m.addr) for m in members}
    order = ring_order(ids, {m.node_id: m.rack for m in members if m.rack})
    buddy = dict(zip(order, order[1:] + order[:1]))
    source = {b: n for n, b in buddy.items()}
    alone = len(members) < 2
    placed: dict[str, Placement] = {}
    first = 0
    for rank, m in enumerate(members):
        after = ids[(rank + 1) % len(ids)]
        placed[m.node_id] = Placement(
            first, None if alone else peers[after], None if alone else peers[buddy[m.node_id]],
            None if alone else peers[source[m.node_id]])
        first += m.nproc
    return placed
