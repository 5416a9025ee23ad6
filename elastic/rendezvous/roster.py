"""A round's members as one compact, content-addressed value: the roster.

The watched ``round`` record must stay small at any job size (it is sent to
every node at every round), so the member list travels apart from it, as a
roster: one line per member in node-rank order, ``node_id TAB host TAB nproc
TAB addr TAB rack LF``, UTF-8, compressed. Its digest (of the uncompressed
bytes) names it: a round record says which roster it has, a reader checks
what it got against that, and equal lists have equal digests whatever round
wrote them.

Reading a roster costs a node what finding itself costs, not what building
every member does: :func:`unpack` checks the digest and that the text is
UTF-8 lines, and gives a :class:`Roster`, whose
:meth:`Roster.member` finds one node's line with a search of the text and
checks that line alone. Every member is built and checked (ids unique, each
field as :func:`~elastic.rendezvous.api.member_from_json` checks it) the first
time the list is used whole (iterated, indexed); a roster that fails raises
MalformedRecordError naming the key there. The rendezvous itself only ever
asks for one node, so a node of a 16,384-node job pays for C-speed passes
over the text (decompress, hash, count, find), not for 16,384 objects.

A round that changes few members carries a :func:`delta` from the roster
before it (members left, members joined at the end): a node that holds that
roster rebuilds the new one with no read (:func:`apply_delta`, on the text),
which is what keeps a failure's round O(1) bytes per node. Where a roster is
kept, inline in the record or under ``rosters/<digest>/``, is
:mod:`elastic.rendezvous.round_record`'s.

Rosters of the first form (a JSON list of ``[node_id, host, nproc, addr,
rack]`` rows) are still read, whole. Every value read is hostile input
(MalformedRecordError naming the key, never a crash, and no bomb:
decompression is bounded).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import zlib
from typing import Any, Iterator, Sequence

from elastic.errors import ConfigError, MalformedRecordError
from elastic.records import MAX_NPROC, cap_text, valid_addr, valid_host, validate_id
from elastic.rendezvous.api import MAX_RACK_CHARS, Member, member_from_json

# The uncompressed roster a reader accepts at most (about 200,000 members of
# generous names): a compressed value is never inflated past it.
MAX_UNPACKED_BYTES = 64 << 20
DIGEST_CHARS = 32  # 128 bits of sha256, in hex
# A delta is carried in the round record only up to this many bytes of JSON
# (about 100 joiners): beyond it, nodes read the roster.
MAX_DELTA_BYTES = 16 * 1024
_XZ_MAGIC = b"\xfd7zXZ\x00"
# What an xz roster may take to inflate (the dictionary of preset 1 is 1 MiB,
# of preset 6, which earlier rosters used, 8 MiB): a value that asks for more
# is no roster this module wrote.
_XZ_MEMLIMIT = 64 << 20
# A line's fields: node_id, host, nproc, addr, rack. Valid ids, hosts,
# addresses and racks hold no tab or line feed (records.py's rules), so the
# separators need no escaping.
FIELDS = 5
_SEP, _END = "\t", "\n"


def canonical(members: Sequence[Member]) -> bytes:
    """The roster's uncompressed bytes: one line per member, in node-rank
    order. Deterministic: the digest of equal lists is equal on every node.
    Raises ValueError for a field that holds a tab or a line feed (no valid
    member does)."""
    if isinstance(members, Roster):
        return members.raw
    text = "".join(_line(m) for m in members)
    if text.count(_SEP) != (FIELDS - 1) * len(members) or text.count(_END) != len(members):
        raise ValueError("a member's field holds a tab or a line feed")
    return text.encode()


def _line(m: Member) -> str:
    return f"{m.node_id}\t{m.host}\t{m.nproc}\t{m.addr}\t{m.rack}\n"


def own_members(raw: bytes) -> list[Member]:
    """The members of ``raw``, a roster this process made (:func:`canonical`),
    built without the checks a roster read from etcd gets."""
    rows = (line.split(_SEP) for line in raw.decode().split(_END)[:-1])
    return [Member(node_id, rank, host, int(nproc), addr, rack)
            for rank, (node_id, host, nproc, addr, rack) in enumerate(rows)]


def digest(raw: bytes) -> str:
    """The name of the roster whose uncompressed bytes are ``raw``."""
    return hashlib.sha256(raw).hexdigest()[:DIGEST_CHARS]


def valid_digest(text: Any) -> bool:
    return (isinstance(text, str) and len(text) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in text))


def pack(members: Sequence[Member], dense: bool = False) -> tuple[str, bytes]:
    """``(digest, compressed bytes)`` of the roster of ``members``
    (:func:`compress`)."""
    raw = canonical(members)
    return digest(raw), compress(raw, dense)


def compress(raw: bytes, dense: bool = False) -> bytes:
    """The roster ``raw`` compressed with zlib, or ``dense``: with xz at
    preset 1, for a roster stored apart (16,384 members: 130 KB instead of
    zlib's 163 KB, written in 60 ms of the leader's CPU at every round that
    introduces a roster). Agents run their rounds from their bucket, so only
    an occasional user of the whole list reads it: preset 6 would save that
    reader a third of the bytes and cost every such round 0.5 s of the
    leader's time. :func:`unpack` reads both."""
    if dense:
        return lzma.compress(raw, format=lzma.FORMAT_XZ, preset=1)
    return zlib.compress(raw, 6)


def unpack(key: str, packed: bytes, expected: str) -> Sequence[Member]:
    """The members of the compressed roster ``packed`` read at ``key``, which
    must be the roster named ``expected``: a :class:`Roster` (a tuple for a
    roster of the first form).

    Raises MalformedRecordError naming the key when it does not decompress
    (or would exceed MAX_UNPACKED_BYTES), is not the roster ``expected``
    names, is not UTF-8, or (first form) a row is not a
    valid member. A field of the line form is checked when it is first used
    (see :class:`Roster`)."""
    raw = _inflated(key, packed)
    if digest(raw) != expected:
        raise MalformedRecordError(key, f"the roster is not the one named {expected}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedRecordError(key, f"the roster is not UTF-8: {exc}") from exc
    if raw.startswith(b"["):
        return _first_form(key, text)
    return Roster(key, raw, expected)


def _inflated(key: str, packed: bytes) -> bytes:
    """``packed`` decompressed (xz when it starts as xz does, else zlib), at
    most MAX_UNPACKED_BYTES of it."""
    try:
        if packed.startswith(_XZ_MAGIC):
            xz = lzma.LZMADecompressor(lzma.FORMAT_XZ, memlimit=_XZ_MEMLIMIT)
            raw = xz.decompress(packed, MAX_UNPACKED_BYTES)
            whole = xz.eof and not xz.unused_data
        else:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(packed, MAX_UNPACKED_BYTES)
            whole = inflater.eof and not inflater.unconsumed_tail and not inflater.unused_data
    except (zlib.error, lzma.LZMAError) as exc:
        raise MalformedRecordError(key, f"the roster does not decompress: {exc}") from exc
    if not whole:
        raise MalformedRecordError(key, "the roster is truncated or larger than "
                                        f"{MAX_UNPACKED_BYTES} bytes uncompressed")
    return raw


def _first_form(key: str, text: str) -> tuple[Member, ...]:
    """A roster written as a JSON list of rows (before the line form); JSON
    that starts with "[" and parses is a list."""
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedRecordError(key, f"the roster is not JSON: {exc}") from exc
    return tuple(_member(key, i, row) for i, row in enumerate(rows))


def _member(key: str, rank: int, row: Any) -> Member:
    """Row ``rank`` of a roster (or of a delta's joiners, ranked from ``rank``)."""
    if not isinstance(row, list) or len(row) != FIELDS:
        raise MalformedRecordError(key, f"field 'members[{rank}]' is not a row of "
                                        "[node_id, host, nproc, addr, rack]")
    node_id, host, nproc, addr, rack = row
    if _plainly_valid(node_id, host, nproc, addr, rack):
        return Member(node_id, rank, host, nproc, addr, rack)
    # The one reader of a member's fields: raises naming the field, or gives
    # the member with its rack made printable.
    return member_from_json(key, rank, {"node_id": node_id, "node_rank": rank, "host": host,
                                        "nproc": nproc, "addr": addr, "rack": rack})


def _plainly_valid(node_id: Any, host: Any, nproc: Any, addr: Any, rack: Any) -> bool:
    """Whether :func:`member_from_json` takes these fields as they are: the
    same checks, at most as lenient, without its renamed copy of the row
    (a roster of 16,384 members is built at a third of the cost). Anything
    else goes to it."""
    if not (type(node_id) is str and type(host) is str and type(nproc) is int
            and type(addr) is str and type(rack) is str):
        return False
    try:
        validate_id("node id", node_id)
    except ConfigError:
        return False
    return ((not host or valid_host(host)) and 1 <= nproc <= MAX_NPROC
            and (not addr or valid_addr(addr)) and cap_text(rack, MAX_RACK_CHARS) == rack)


def parse_line(key: str, rank: int, line: str) -> Member:
    """The member of rank ``rank`` whose roster line (without its LF) is
    ``line``, read at ``key``. Raises MalformedRecordError naming the key and
    the field when it is not a valid member."""
    fields: list[Any] = line.split(_SEP)
    if len(fields) != FIELDS or not fields[2].isascii() or not fields[2].isdigit():
        raise MalformedRecordError(key, f"field 'members[{rank}]' is not a line of "
                                        "node_id, host, nproc, addr, rack")
    fields[2] = int(fields[2])
    return _member(key, rank, fields)


class Roster(Sequence[Member]):
    """The members of the roster of the line form ``raw`` (UTF-8, checked by
    :func:`unpack`), read at ``key`` and named ``name``, built as they are
    asked for. Raises MalformedRecordError when its last line is not ended.

    Its lines are checked as they are first used: :meth:`member` checks one
    line, and the first use of the list whole (``len`` aside: iterating,
    indexing, slicing, comparing to a tuple) builds and checks every member
    and that no id repeats. Both raise MalformedRecordError naming the key
    and the field (``members[3].host``). Immutable; two rosters are equal
    when their names are (the names are digests of the text)."""

    def __init__(self, key: str, raw: bytes, name: str):
        self.key, self.raw, self.name = key, raw, name
        # Searched and counted as bytes (a pass of memchr): UTF-8 never puts a
        # tab or a line feed inside a character, so lines are where they are.
        self._count = raw.count(b"\n")
        if raw and not raw.endswith(b"\n"):
            raise MalformedRecordError(key, "the roster's last line is not ended")
        self._members: tuple[Member, ...] | None = None
        self._by_id: dict[str, Member] | None = None  # once built whole
        self._found: dict[str, Member | None] = {}  # members looked up before that

    def __len__(self) -> int:
        return self._count

    def member(self, node_id: str) -> Member | None:
        """The member ``node_id`` (None: not in the roster): one search of the
        text and one line checked. Raises MalformedRecordError when its
        line is not a valid member."""
        if self._by_id is not None:
            return self._by_id.get(node_id)
        if node_id not in self._found:  # a node asks for itself several times a round
            at = _line_of(self.raw, node_id)
            self._found[node_id] = None if at < 0 else self._row(
                self.raw.count(b"\n", 0, at), self.raw[at:self.raw.index(b"\n", at)].decode())
        return self._found[node_id]

    def _row(self, rank: int, line: str) -> Member:
        return parse_line(self.key, rank, line)

    @property
    def members(self) -> tuple[Member, ...]:
        """Every member, built and checked once."""
        if self._members is None:
            built = tuple(self._row(rank, line)
                          for rank, line in enumerate(self.raw.decode().split(_END)[:-1]))
            if len({m.node_id for m in built}) != len(built):
                raise MalformedRecordError(self.key, "field 'members' names a node twice")
            self._members, self._by_id = built, {m.node_id: m for m in built}
        return self._members

    def __getitem__(self, index):  # type: ignore[override]
        return self.members[index]

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Roster):
            return other.name == self.name
        return isinstance(other, tuple) and self.members == other

    def __hash__(self) -> int:
        return hash(self.members)

    def __add__(self, other: tuple) -> tuple[Member, ...]:
        return self.members + other

    def __repr__(self) -> str:
        return f"Roster({self.name}, {self._count} members)"


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
    """One ``[node_id, host, nproc, addr, rack]`` row per member: a delta's
    joiners' shape (and the first form's)."""
    return [[m.node_id, m.host, m.nproc, m.addr, m.rack] for m in members]


def apply_delta(key: str, base: Sequence[Member], change: Any,
                expected: str) -> Sequence[Member] | None:
    """The members ``change`` (a :func:`delta` read at ``key``) makes of
    ``base``, if they are the roster named ``expected``; None if they are
    not (the reader then reads that roster). The lines of ``base`` are
    kept as they are, never rebuilt as members: a node of a large job pays
    for a pass over the text. Raises MalformedRecordError naming the key
    when ``change`` is not a delta or a joiner is invalid."""
    if not isinstance(change, dict) or not isinstance(change.get("left"), list) \
            or not isinstance(change.get("joined"), list) \
            or not all(isinstance(n, str) for n in change["left"]):
        raise MalformedRecordError(key, "field 'delta' is not {left: [ids], joined: [rows]}")
    raw = canonical(base)
    for node_id in change["left"]:
        raw = _without(raw, node_id)
    kept = raw.count(b"\n")
    joined = [_member(key, kept + i, row) for i, row in enumerate(change["joined"])]
    raw += "".join(_line(m) for m in joined).encode()
    if digest(raw) != expected:
        return None
    return Roster(key, raw, expected)


def _line_of(raw: bytes, node_id: str) -> int:
    """Where the line of ``node_id`` starts in ``raw`` (-1: it has none)."""
    needle = node_id.encode() + b"\t"
    if raw.startswith(needle):
        return 0
    at = raw.find(b"\n" + needle)
    return at + 1 if at >= 0 else -1


def _without(raw: bytes, node_id: str) -> bytes:
    """``raw`` without the line of ``node_id`` (unchanged if it has none)."""
    at = _line_of(raw, node_id)
    return raw if at < 0 else raw[:at] + raw[raw.index(b"\n", at) + 1:]
