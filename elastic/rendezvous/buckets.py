"""A stored roster's members in small buckets by node id: what one node reads
to find itself.

A roster too large for the round record is stored whole (every member, for
whoever uses the list whole: the leader, ``elasticctl status``, a hang report) and
again split into buckets: member ``node_id`` sits in bucket
:func:`bucket_of` (a CRC-32 of the id, modulo a power of two), one line per
member in rank order: ``node_rank TAB`` the roster's own line, then ``TAB``
and the member's :class:`~elastic.rendezvous.placement.Placement` (its first
rank, then its ring peer, buddy and source, each ``node_id TAB addr``). A
node that does not hold the roster reads its one bucket (about
BUCKET_MEMBERS lines): it finds there its line and everything else it needs
to run the round (its ranks, the peer it probes, the nodes it replicates to
and from), or learns that it is no member, at the same cost in a job of any
size. A line of the earlier form (no placement) still reads; it places
nobody, and its reader reads the round whole.

The round record names the buckets by the root of a hash tree over them
(:func:`index`): each stored bucket carries the path that proves it belongs
to that root (:func:`seal`), so a bucket written by anything but the round's
leader, or one of another roster, is refused (:func:`open_bucket`), and the
record stays a few dozen bytes whatever the number of buckets.

Every value read is hostile input: MalformedRecordError naming the key,
never a crash, and no bomb (decompression is bounded).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Iterator, Sequence

from elastic.errors import ConfigError, MalformedRecordError
from elastic.records import valid_addr, validate_id
from elastic.rendezvous import roster
from elastic.rendezvous.api import Member
from elastic.rendezvous.placement import Peer, Placement, placements

# Members per bucket, about: what a node reads to find itself (about 10 KB of
# lines with their placements, under 3 KB compressed).
BUCKET_MEMBERS = 64
# The most buckets a record may ask for (about 4 million members).
MAX_BUCKETS = 1 << 16
_HASH_BYTES = 16
_HEX = _HASH_BYTES * 2
# A bucket as stored: its proof (hex, LF-ended), then its lines, zlib-compressed.
_MAX_BUCKET_BYTES = 4 << 20


def count_for(members: int) -> int:
    """How many buckets a roster of ``members`` members is split into: a
    power of two, about BUCKET_MEMBERS members each."""
    wanted = max(1, -(-members // BUCKET_MEMBERS))
    return 1 << (wanted - 1).bit_length()


def bucket_of(node_id: str, count: int) -> int:
    """The bucket that holds ``node_id``'s line among ``count`` buckets."""
    return zlib.crc32(node_id.encode()) & (count - 1)


def split(raw: bytes, count: int) -> list[bytes]:
    """The roster ``raw`` (its uncompressed lines, :func:`roster.canonical`,
    made by this process's leader) as ``count`` buckets of
    ``rank TAB line TAB placement`` lines, uncompressed."""
    members = roster.own_members(raw)
    placed = placements(members)
    parts: list[list[bytes]] = [[] for _ in range(count)]
    for line, m in zip(raw.split(b"\n"), members):
        where = _placement_text(placed[m.node_id]).encode()
        parts[bucket_of(m.node_id, count)].append(b"%d\t%s\t%s\n" % (m.node_rank, line, where))
    return [b"".join(p) for p in parts]


def _placement_text(p: Placement) -> str:
    peers = (p.ring_next, p.buddy, p.source)
    return "\t".join([str(p.first_rank)] + [f"{q.node_id}\t{q.addr}" if q else "\t"
                                             for q in peers])


# A line's fields: the rank, the roster's line, then the placement's (the
# first rank, then the ring peer, buddy and source: an id and an address each).
_ROSTER_FIELDS = slice(1, 1 + roster.FIELDS)
_PLACED_FIELDS = 1 + roster.FIELDS + 1 + 3 * 2


def _leaf(text: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + text).digest()[:_HASH_BYTES]


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()[:_HASH_BYTES]


def index(texts: Sequence[bytes]) -> tuple[str, list[bytes]]:
    """``(root, proofs)`` of the buckets ``texts`` (a power of two of them):
    the hex root a round record names them by, and each bucket's proof."""
    level = [_leaf(t) for t in texts]
    proofs: list[list[bytes]] = [[] for _ in texts]
    spans = [[i] for i in range(len(texts))]  # the buckets under each node of the level
    while len(level) > 1:
        for i in range(0, len(level), 2):
            for b in spans[i]:
                proofs[b].append(level[i + 1])
            for b in spans[i + 1]:
                proofs[b].append(level[i])
        level = [_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        spans = [spans[i] + spans[i + 1] for i in range(0, len(spans), 2)]
    return level[0].hex(), [b"".join(p) for p in proofs]


def seal(text: bytes, proof: bytes) -> bytes:
    """The bucket ``text`` as stored: its proof, then its lines compressed."""
    return proof.hex().encode() + b"\n" + zlib.compress(text, 6)


def open_bucket(key: str, stored: bytes, number: int, count: int, root: str) -> bytes:
    """The lines of bucket ``number`` (of ``count``) read at ``key``, proven
    to belong to the buckets named ``root``. Raises MalformedRecordError
    naming the key when it is not a sealed bucket, does not decompress (or
    would exceed its bound) or is not that bucket of that root."""
    proof_hex, sep, packed = stored.partition(b"\n")
    depth = count.bit_length() - 1
    if not sep or len(proof_hex) != depth * _HEX:
        raise MalformedRecordError(key, "the roster bucket does not start with its proof")
    try:
        proof = bytes.fromhex(proof_hex.decode("ascii"))
        inflater = zlib.decompressobj()
        text = inflater.decompress(packed, _MAX_BUCKET_BYTES)
    except (ValueError, zlib.error) as exc:
        raise MalformedRecordError(key, f"the roster bucket does not decode: {exc}") from exc
    if not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise MalformedRecordError(key, "the roster bucket is truncated or too large")
    h, at = _leaf(text), number
    for i in range(depth):
        sibling = proof[i * _HASH_BYTES:(i + 1) * _HASH_BYTES]
        h = _node(h, sibling) if at % 2 == 0 else _node(sibling, h)
        at //= 2
    if h.hex() != root:
        raise MalformedRecordError(key, f"the roster bucket is not bucket {number} of {root}")
    return text


class BucketRoster(Sequence[Member]):
    """What a node knows of a roster it did not read whole: its name, its
    length, the world size, and the members of one bucket (node ``me``'s).

    :meth:`member` answers for the ids of that bucket (None: not a member);
    asking about another id, or using the list whole, raises
    :class:`NotHeldError`: a caller that uses the members whole asks
    :meth:`elastic.rendezvous.committed.CommittedRound.checked` first,
    which reads the whole roster."""

    whole = False  # see Round.holds_members

    def __init__(self, key: str, name: str, nnodes: int, world_size: int, number: int,
                 count: int, text: bytes, delta: dict | None = None):
        """Raises MalformedRecordError naming the key when the bucket ``text``
        is not UTF-8 lines, or an id in it repeats or belongs to another
        bucket; a line is checked whole when :meth:`member` finds it.
        ``delta``: the round record's (:func:`roster.delta`), if it carries one."""
        self.key, self.name, self.world_size = key, name, world_size
        self._delta = delta
        self._count, self._bucket, self._buckets = nnodes, number, count
        if text and not text.endswith(b"\n"):
            raise MalformedRecordError(key, "the roster bucket's last line is not ended")
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedRecordError(key, f"the roster bucket is not UTF-8: {exc}") from exc
        # A line's id is its second field: ``rank TAB node_id TAB ...``.
        self._lines: dict[bytes, bytes] = {}
        for line in text.split(b"\n")[:-1]:
            node_id = line.split(b"\t", 2)[1] if line.count(b"\t") >= 2 else b""
            if node_id in self._lines or zlib.crc32(node_id) & (count - 1) != number:
                raise MalformedRecordError(key, "a roster bucket's line repeats an id, has "
                                                "none, or belongs to another bucket")
            self._lines[node_id] = line
        self._found: dict[str, Member | None] = {}
        self._placed: dict[str, Placement | None] = {}

    def _fields(self, node_id: str) -> list[str] | None:
        line = self._lines.get(node_id.encode())
        if line is None:
            return None
        fields = line.decode().split("\t")
        rank = fields[0]
        if not rank.isascii() or not rank.isdigit() or int(rank) >= self._count:
            raise MalformedRecordError(self.key, "a roster bucket's line has no rank within "
                                                 f"the roster's {self._count} members")
        if len(fields) not in (1 + roster.FIELDS, _PLACED_FIELDS):
            raise MalformedRecordError(self.key, f"a roster bucket's line for {node_id} has "
                                                 f"{len(fields)} fields")
        return fields

    def __len__(self) -> int:
        return self._count

    def holds(self, node_id: str) -> bool:
        """Whether :meth:`member` can answer for ``node_id``."""
        return bucket_of(node_id, self._buckets) == self._bucket

    def member(self, node_id: str) -> Member | None:
        """The member ``node_id`` (None: not in the roster). Raises
        MalformedRecordError when its line is not a valid member, and
        NotHeldError when the id is not of this bucket."""
        if not self.holds(node_id):
            raise NotHeldError(f"roster {self.name}: node {node_id} is in a bucket this node "
                               "did not read")
        if node_id not in self._found:  # a node asks for itself several times a round
            fields = self._fields(node_id)
            self._found[node_id] = None if fields is None else roster.parse_line(
                self.key, int(fields[0]), "\t".join(fields[_ROSTER_FIELDS]))
        return self._found[node_id]

    def placement(self, node_id: str) -> Placement | None:
        """Member ``node_id``'s placement (None: not in the roster, or its line
        is of the earlier form, which places nobody). Raises as :meth:`member`
        does, and MalformedRecordError when the placement is not valid."""
        if node_id not in self._placed:
            fields = self._fields(node_id) if self.member(node_id) is not None else None
            self._placed[node_id] = (self._placement(node_id, fields[1 + roster.FIELDS:])
                                     if fields and len(fields) == _PLACED_FIELDS else None)
        return self._placed[node_id]

    def _placement(self, node_id: str, fields: list[str]) -> Placement:
        first = fields[0]
        if not first.isascii() or not first.isdigit() or int(first) >= self.world_size:
            raise MalformedRecordError(self.key, f"node {node_id}'s first rank is not within "
                                                 f"the world of {self.world_size}")
        peers = [self._peer(node_id, fields[i], fields[i + 1]) for i in (1, 3, 5)]
        if peers.count(None) != (3 if self._count < 2 else 0):
            raise MalformedRecordError(self.key, f"node {node_id}'s peers are not those of a "
                                                 f"roster of {self._count} members")
        return Placement(int(first), *peers)

    def _peer(self, node_id: str, peer_id: str, addr: str) -> Peer | None:
        if not peer_id and not addr:
            return None
        try:
            validate_id("node id", peer_id)
        except ConfigError as exc:
            raise MalformedRecordError(self.key, f"node {node_id}'s placement: {exc}") from None
        if addr and not valid_addr(addr):
            raise MalformedRecordError(self.key, f"node {node_id}'s placement names peer "
                                                 f"{peer_id} at no valid address")
        return Peer(peer_id, addr)

    def change_from(self, base: str) -> tuple[bool, bool] | None:
        """``(left, joined)`` from the roster named ``base`` to this one, when
        the round carries its delta from ``base`` (None: it does not)."""
        d = self._delta
        if d is None or d.get("base") != base or not isinstance(d.get("left"), list) \
                or not isinstance(d.get("joined"), list):
            return None
        return bool(d["left"]), bool(d["joined"])

    def held(self) -> list[Member]:
        """The members of this node's bucket, in node-rank order: a sample of
        the roster that costs nothing more to read. Raises as :meth:`member`."""
        found = [self.member(node_id.decode()) for node_id in self._lines]
        return sorted((m for m in found if m is not None), key=lambda m: m.node_rank)

    def __getitem__(self, index):  # type: ignore[override]
        raise NotHeldError(f"roster {self.name} is not held whole here")

    def __iter__(self) -> Iterator[Member]:
        raise NotHeldError(f"roster {self.name} is not held whole here")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BucketRoster) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"BucketRoster({self.name}, bucket {self._bucket} of {self._buckets})"


class NotHeldError(RuntimeError):
    """A roster held as one bucket was used whole: a caller skipped
    ``CommittedRound.checked`` (a bug, not bad input)."""
