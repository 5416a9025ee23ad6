"""A round's members as one compact, content-addressed value: the roster.

Every node needs the whole member list of its round, but the watched
``round`` record must stay small at any job size (it is sent to every node at
every round). So the list travels apart from it, as a roster: one row per
member in node-rank order (``[node_id, host, nproc, addr, rack]``), as compact
JSON, compressed. Its digest (of the uncompressed bytes) names it: a round
record says which roster it has, a reader checks what it got against that,
and equal lists have equal digests whatever round wrote them.

A round that changes few members carries a :func:`delta` from the roster
before it (members left, members joined at the end): a node that holds that
roster rebuilds the new one with no read (:func:`apply_delta`), which is what
keeps a failure's round O(1) bytes per node. Where a roster is kept, inline in
the record or under ``rosters/<digest>/``, is :mod:`elastic.rendezvous.round_record`'s.

Pure functions; every value read is hostile input (MalformedRecordError
naming the key, never a crash, and no bomb: decompression is bounded).
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from typing import Any, Sequence

from elastic.errors import MalformedRecordError
from elastic.rendezvous.api import Member, member_from_json

# The uncompressed roster a reader accepts at most (about 200,000 members of
# generous names): a compressed value is never inflated past it.
MAX_UNPACKED_BYTES = 64 << 20
DIGEST_CHARS = 32  # 128 bits of sha256, in hex
# A delta is carried in the round record only up to this many bytes of JSON
# (about 100 joiners): beyond it, nodes read the roster.
MAX_DELTA_BYTES = 16 * 1024


def canonical(members: Sequence[Member]) -> bytes:
    """The roster's uncompressed bytes: one row per member, in node-rank order.
    Deterministic: the digest of equal lists is equal on every node."""
    return json.dumps(_rows(members), separators=(",", ":")).encode()


def digest(raw: bytes) -> str:
    """The name of the roster whose uncompressed bytes are ``raw``."""
    return hashlib.sha256(raw).hexdigest()[:DIGEST_CHARS]


def valid_digest(text: Any) -> bool:
    return (isinstance(text, str) and len(text) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in text))


def pack(members: Sequence[Member]) -> tuple[str, bytes]:
    """``(digest, compressed bytes)`` of the roster of ``members``."""
    raw = canonical(members)
    return digest(raw), zlib.compress(raw, 6)


@functools.lru_cache(maxsize=8)
def unpack(key: str, packed: bytes, expected: str) -> tuple[Member, ...]:
    """The members of the compressed roster ``packed`` read at ``key``, which
    must be the roster named ``expected``.

    Raises MalformedRecordError naming the key when it does not decompress
    (or would exceed MAX_UNPACKED_BYTES), is not the roster ``expected``
    names, or a row is not a valid member. Cached per process (nodes that
    share a process read the same bytes; a roster is immutable)."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(packed, MAX_UNPACKED_BYTES)
    except zlib.error as exc:
        raise MalformedRecordError(key, f"the roster does not decompress: {exc}") from exc
    if inflater.unconsumed_tail or not inflater.eof:
        raise MalformedRecordError(key, "the roster is truncated or larger than "
                                        f"{MAX_UNPACKED_BYTES} bytes uncompressed")
    if digest(raw) != expected:
        raise MalformedRecordError(key, f"the roster is not the one named {expected}")
    try:
        rows = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedRecordError(key, f"the roster is not JSON: {exc}") from exc
    if not isinstance(rows, list):
        raise MalformedRecordError(key, "the roster is not a list of members")
    return tuple(_member(key, i, row) for i, row in enumerate(rows))


def _member(key: str, rank: int, row: Any) -> Member:
    """Row ``rank`` of a roster (or of a delta's joiners, ranked from ``rank``)."""
    if not isinstance(row, list) or len(row) != 5:
        raise MalformedRecordError(key, f"field 'members[{rank}]' is not a row of "
                                        "[node_id, host, nproc, addr, rack]")
    node_id, host, nproc, addr, rack = row
    return member_from_json(key, rank, {"node_id": node_id, "node_rank": rank, "host": host,
                                        "nproc": nproc, "addr": addr, "rack": rack})


def delta(old: Sequence[Member], new: Sequence[Member]) -> dict | None:
    """How ``new`` follows from ``old``: ``{"left": [ids], "joined": [rows]}``
    when ``new`` is ``old`` without the members that left, in their order,
    followed by the joiners (the order :func:`elastic.rendezvous.decisions.decide`
    keeps); None when it is not, or the delta is over MAX_DELTA_BYTES."""
    new_ids = {m.node_id for m in new}
    kept = [m for m in old if m.node_id in new_ids]
    if _rows(kept) != _rows(new[:len(kept)]):
        return None
    left = [m.node_id for m in old if m.node_id not in new_ids]
    joined = _rows(new[len(kept):])
    result = {"left": left, "joined": joined}
    if len(json.dumps(result, separators=(",", ":"))) > MAX_DELTA_BYTES:
        return None
    return result


def _rows(members: Sequence[Member]) -> list[list]:
    """One ``[node_id, host, nproc, addr, rack]`` row per member: a roster's
    (and a delta's joiners') one shape."""
    return [[m.node_id, m.host, m.nproc, m.addr, m.rack] for m in members]


def apply_delta(key: str, base: tuple[Member, ...], base_digest: str, change: Any,
                expected: str) -> tuple[Member, ...] | None:
    """The members ``change`` (a :func:`delta` read at ``key``) makes of
    ``base`` (the roster named ``base_digest``), if they are the roster named
    ``expected``; None if they are not (the reader then reads that roster).
    Raises MalformedRecordError naming the key when ``change`` is not a delta
    or a joiner is invalid. Cached per process by the digests and the delta."""
    if not isinstance(change, dict) or not isinstance(change.get("left"), list) \
            or not isinstance(change.get("joined"), list) \
            or not all(isinstance(n, str) for n in change["left"]):
        raise MalformedRecordError(key, "field 'delta' is not {left: [ids], joined: [rows]}")
    return _applied(key, Named(base, base_digest), tuple(change["left"]),
                    json.dumps(change["joined"], separators=(",", ":")), expected)


class Named:
    """Members keyed by their roster's digest alone, as a cache key (hashing
    the members would cost what the cache saves)."""

    def __init__(self, members: tuple[Member, ...], name: str):
        self.members, self.name = members, name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Named) and other.name == self.name


@functools.lru_cache(maxsize=8)
def _applied(key: str, base: Named, left: tuple[str, ...], joined_json: str,
             expected: str) -> tuple[Member, ...] | None:
    gone = set(left)
    kept = [m for m in base.members if m.node_id not in gone]
    members = [Member(node_id=m.node_id, node_rank=i, host=m.host, nproc=m.nproc, addr=m.addr,
                      rack=m.rack) for i, m in enumerate(kept)]
    members += [_member(key, len(kept) + i, row)
                for i, row in enumerate(json.loads(joined_json))]
    result = tuple(members)
    return result if digest(canonical(result)) == expected else None
