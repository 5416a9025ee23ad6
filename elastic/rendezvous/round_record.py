"""The ``round`` record as etcd holds it: a small head every node watches, and
the members as a roster (:mod:`elastic.rendezvous.roster`).

Every node watches ``round``, so its size is paid once per node per round.
The head holds every field of a :class:`~elastic.rendezvous.api.Round` but
the members, plus ``nnodes``, ``world_size`` and ``roster`` (the digest of the
member list), and at most one of:

* ``delta``: how the roster follows from the one before (``base``), when a
  few members left or joined: a node that holds that one rebuilds it with no
  read, so such a round costs O(1) bytes per node at any size;
* ``packed``: else the roster itself (zlib, base64), in the round that
  introduces it, when it is at most INLINE_BYTES: a job of up to about
  1,300 nodes reads nothing else.

A round that keeps the roster of the round before (a restart) carries
neither: every node that followed holds it. Every roster is also kept under
``rosters/<digest>/``, for whoever reads it whole: as carried (zlib) when it
fits inline, else packed densely (xz), in chunks of at most CHUNK_BYTES. A
roster that does not fit inline is also kept in buckets by node id under
``roster-buckets/<digest>/`` (:mod:`elastic.rendezvous.buckets`), and a head
that introduces it names them (``buckets``: their count and hash-tree root):
a node that holds neither the roster nor the delta's base reads its own
bucket and the head in one transaction (:func:`bucket_reads`), about 2 KB at
any size, and is handed a round that knows its own line
(:class:`~elastic.rendezvous.buckets.BucketRoster`); whoever uses the list
whole reads it whole (:func:`reads`, in one transaction with the head), once.
What a round stores is written with the head in its one fenced transaction
when it fits in TXN_ROSTER_BYTES and TXN_ROSTER_PUTS, else in fenced
transactions just before it. Nothing refers to a roster until a head naming
it commits, and the head that replaces it deletes it, so at every revision
the current head's roster is there: a half-written round is invisible.

Resolving a head whose roster is carried costs a node C-speed passes over
the roster's bytes, not one object per member: the round's ``members`` is a
:class:`~elastic.rendezvous.roster.Roster` that finds the node itself
without building the others, and builds them all when the list is first
used whole (an agent does, once per round). Nothing here is cached across
nodes: each parses and resolves what it got, as an agent alone on its
machine does.

Records of the whole form (``members`` as a list of objects, as
:meth:`Round.to_json` writes them) are read as they are.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.records import cap_text, int_field, load_object, text_field, typed_field
from elastic.rendezvous import buckets, roster
from elastic.rendezvous.api import Member, Outcome, Round
from elastic.store.api import Delete, Get, KeyValue, Op, Put, Store

# A roster sits in the head up to this many bytes of base64 (about 1,300
# members of regular names). Pushed on the watch every node has, it saves
# each node a read; but each node then inflates, hashes and searches the
# whole roster, and past this size one read of its ~1 KB bucket costs a node
# less CPU (at 4,096 members: 0.3 ms against 1.2 ms) and etcd fewer bytes.
INLINE_BYTES = 16 * 1024
# A stored roster's chunks, and how much of it goes in the head's own
# transaction: etcd refuses requests over 1.5 MiB (--max-request-bytes).
CHUNK_BYTES = 512 * 1024
TXN_ROSTER_BYTES = 1024 * 1024
# etcd refuses transactions of more than 128 operations (--max-txn-ops): the
# head's own carries a roster's writes only up to this many, and an earlier
# transaction at most EARLIER_TXN_PUTS (the head's has room for the served
# requests and the event beside them).
TXN_ROSTER_PUTS = 8
EARLIER_TXN_PUTS = 100


@dataclass(frozen=True, eq=False)
class RoundHead:
    """The ``round`` record read at ``key`` (etcd version ``version``),
    members not yet resolved. ``whole``: the round, when the record lists its
    members itself (whole form)."""

    key: str
    version: int
    fields: dict
    number: int
    roster: str
    nnodes: int
    outcome: Outcome = Outcome.NONE
    reason: str = ""
    packed: bytes | None = None
    delta: dict | None = None
    whole: Round | None = None
    buckets: tuple[int, str] | None = None  # (count, root) of the roster's buckets

    @property
    def workers_round(self) -> int:
        return int(self.fields.get("continues") or 0) or self.number


def parse_head(key: str, value: bytes, version: int) -> RoundHead:
    """The head record ``value`` at ``key``. Raises MalformedRecordError naming
    the key and field when it is not a head (or a whole round), its number is
    not ``version``, its roster digest or inline roster is not valid, or its
    delta names no valid base. Not cached: every node parses what it gets,
    as an agent alone on its machine does (a cache shared by the nodes of
    one process would hide that cost from the bench and the simulator)."""
    obj = load_object(key, value)
    number = int_field(key, obj, "number", 1)
    if number != version:
        raise MalformedRecordError(
            key, f"round number {number} does not match the key's version {version}")
    if "members" in obj:
        whole = Round.from_json(key, value, version)
        return RoundHead(key, version, obj, number, roster_of(whole), len(whole.members),
                         whole.outcome, whole.reason, whole=whole)
    outcome = typed_field(key, obj, "outcome", str, "")
    if outcome not in tuple(Outcome):
        raise MalformedRecordError(key, f"field 'outcome' is {cap_text(outcome, 64)!r}")
    digest = typed_field(key, obj, "roster", str)
    if not roster.valid_digest(digest):
        raise MalformedRecordError(key, "field 'roster' is not a roster's digest")
    nnodes = int_field(key, obj, "nnodes", 1)
    packed = None
    if "packed" in obj:
        try:
            packed = base64.b64decode(typed_field(key, obj, "packed", str), validate=True)
        except binascii.Error as exc:
            raise MalformedRecordError(key, f"field 'packed' is not base64: {exc}") from exc
    change = typed_field(key, obj, "delta", dict, None)
    if change is not None and not roster.valid_digest(change.get("base")):
        raise MalformedRecordError(key, "field 'delta.base' is not a roster's digest")
    return RoundHead(key, version, obj, number, digest, nnodes, Outcome(outcome),
                     text_field(key, obj, "reason"), packed, change,
                     buckets=_buckets_field(key, obj))


def _buckets_field(key: str, obj: dict) -> tuple[int, str] | None:
    """The head's ``buckets`` ({count, root}), if it names them."""
    named = typed_field(key, obj, "buckets", dict, None)
    if named is None:
        return None
    count, root = named.get("count"), named.get("root")
    if type(count) is not int or not 1 <= count <= buckets.MAX_BUCKETS \
            or count & (count - 1) or not roster.valid_digest(root):
        raise MalformedRecordError(key, "field 'buckets' is not {count: a power of two, "
                                        "root: a digest}")
    return count, root


def stored_rosters(keys: JobKeys, kvs: Sequence[KeyValue]) -> dict[str, bytes]:
    """The rosters under ``rosters/`` in ``kvs`` (in key order; other keys
    are skipped), each its chunks joined, by digest. A chunk whose key is not
    ``<digest>/<index>`` is left out (the digest check then refuses a roster
    it belonged to)."""
    chunks: dict[str, list[bytes]] = {}
    for kv in kvs:
        if not kv.key.startswith(keys.rosters):
            continue
        name, _, index = kv.key[len(keys.rosters):].partition("/")
        if roster.valid_digest(name) and index.isdigit() \
                and int(index) == len(chunks.setdefault(name, [])):
            chunks[name].append(kv.value)
    return {name: b"".join(parts) for name, parts in chunks.items()}


def resolve(head: RoundHead, known: Round | None, known_roster: str,
            stored: dict[str, bytes] | None = None, bucket: dict[str, bytes | None] | None = None,
            me: str = "") -> Round | None:
    """The round ``head`` is, its members taken from what the reader has:
    ``known`` (whose roster is named ``known_roster``), the head itself,
    ``stored`` (the rosters read with the head, at its revision), or
    ``bucket`` (roster digest -> what the reader ``me`` read at its own
    bucket of that roster with the head; None: nothing there). None when none
    of them has its roster and nothing was read for it (the reader then reads).

    Raises MalformedRecordError naming the key when the roster or bucket read
    with the head is missing or is not the one it names, or a field is invalid."""
    members: Sequence[Member] | None = None
    if head.whole is not None:
        return head.whole
    if known is not None and known_roster == head.roster:
        members = known.members
    elif head.packed is not None:
        members = roster.unpack(head.key, head.packed, head.roster)
    elif head.delta is not None and known is not None and known_roster == head.delta["base"] \
            and not isinstance(known.members, buckets.BucketRoster):
        members = roster.apply_delta(head.key, known.members, head.delta, head.roster)
    if members is None and stored is not None and head.roster in stored:
        members = roster.unpack(head.key, stored[head.roster], head.roster)
    elif members is None and bucket is not None and head.roster in bucket \
            and head.buckets is not None:
        members = _bucket_roster(head, bucket[head.roster], me)
    elif members is None:
        if stored is None:
            return None  # nothing read for this head's roster
        raise MalformedRecordError(head.key, f"its roster {head.roster} is not stored")
    if len(members) != head.nnodes:
        raise MalformedRecordError(head.key, f"field 'nnodes' is {head.nnodes}, its roster "
                                             f"lists {len(members)}")
    return Round.from_fields(head.key, head.fields, head.version, members)


def _bucket_roster(head: RoundHead, stored: bytes | None, me: str) -> buckets.BucketRoster:
    """The roster of ``head`` as node ``me`` knows it from its own bucket
    (``stored``: what was read there, None when nothing was)."""
    count, root = head.buckets  # type: ignore[misc]
    number = buckets.bucket_of(me, count)
    if stored is None:
        raise MalformedRecordError(head.key, f"its roster {head.roster}'s bucket {number} "
                                             "is not stored")
    text = buckets.open_bucket(head.key, stored, number, count, root)
    world_size = int_field(head.key, head.fields, "world_size", 1)
    return buckets.BucketRoster(head.key, head.roster, head.nnodes, world_size, number, count,
                                text, head.delta)


def bucket_reads(keys: JobKeys, head: RoundHead, me: str) -> list[Op]:
    """The reads of one transaction that has what node ``me`` needs of the
    round ``head`` names buckets for: the head (still it, or a newer one) and
    ``me``'s bucket of its roster."""
    count, _ = head.buckets  # type: ignore[misc]
    return [Get(keys.round), Get(keys.roster_bucket(head.roster, buckets.bucket_of(me, count)))]


def head_of(record: Round, previous: Round | None, previous_roster: str
            ) -> tuple[bytes, str, bytes]:
    """``(head, roster digest, roster to store)`` for committing ``record``
    after ``previous`` (whose roster is ``previous_roster``). The roster is
    always stored (zlib when it fits inline, else xz); the head carries
    nothing of it when it is ``previous``'s, a delta from ``previous`` when
    there is one, else the roster itself when it fits; a new roster that
    does not fit is also split in buckets (:func:`roster_buckets`), which the
    head names."""
    raw = roster.canonical(record.members)
    name = roster.digest(raw)
    obj: dict[str, Any] = asdict(replace(record, members=()))
    del obj["members"]
    obj.update(nnodes=len(record.members), world_size=record.world_size, roster=name)
    packed = roster.compress(raw)
    text = base64.b64encode(packed).decode()
    inline = len(text) <= INLINE_BYTES
    # Every node that followed the round before holds its roster: a round that
    # keeps the members (a restart) sends each node its head alone, one that
    # swaps a few of them a delta, whatever the roster's size.
    change = (roster.delta(previous.members, record.members)
              if previous is not None and previous_roster not in ("", name) else None)
    if change is not None:
        obj["delta"] = {"base": previous_roster, **change}
    elif previous_roster != name and inline:
        obj["packed"] = text
    if previous_roster != name and not inline:
        # Whoever holds neither this roster nor the delta's base reads its bucket.
        count, root, _ = roster_buckets(raw)
        obj["buckets"] = {"count": count, "root": root}
    stored = packed if inline else _dense(raw)  # read whole by few: xz, quick to write
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode(), name, stored


@functools.lru_cache(maxsize=2)
def roster_buckets(raw: bytes) -> tuple[int, str, tuple[bytes, ...]]:
    """``(count, root, sealed buckets)`` of the roster ``raw``, once per
    roster and process (the leader writes them with every round that
    introduces it)."""
    texts = buckets.split(raw, buckets.count_for(raw.count(b"\n")))
    root, proofs = buckets.index(texts)
    return len(texts), root, tuple(buckets.seal(t, p) for t, p in zip(texts, proofs))


@functools.lru_cache(maxsize=2)
def _dense(raw: bytes) -> bytes:
    """``raw`` compressed densely, once per roster and process: every round
    that keeps the members writes its roster again; what it compresses is
    the leader's alone."""
    return roster.compress(raw, dense=True)


def commit_ops(keys: JobKeys, record: Round, previous: Round | None, previous_roster: str
               ) -> tuple[list[list[Op]], list[Op], str]:
    """What committing ``record`` writes: ``(earlier, with_head, digest)``.
    ``earlier``: transactions to apply (fenced, in order) before the head's,
    holding the roster's chunks and buckets (empty unless they exceed
    TXN_ROSTER_BYTES or TXN_ROSTER_PUTS); ``with_head``: the head's own ops
    (the head, the roster's writes otherwise, and the deletion of the
    previous roster and its buckets when it differs)."""
    head, name, stored = head_of(record, previous, previous_roster)
    ops: list[Op] = [Put(keys.round, head)]
    puts = [Put(keys.roster_chunk(name, i), stored[at:at + CHUNK_BYTES])
            for i, at in enumerate(range(0, len(stored), CHUNK_BYTES))]
    if b'"buckets":' in head:  # a top-level key (a string's quotes are escaped)
        _, _, sealed = roster_buckets(roster.canonical(record.members))
        puts += [Put(keys.roster_bucket(name, i), b) for i, b in enumerate(sealed)]
    earlier: list[list[Op]] = []
    if len(puts) <= TXN_ROSTER_PUTS and sum(len(p.value) for p in puts) <= TXN_ROSTER_BYTES:
        ops += puts
    else:
        earlier = _batches(puts)
    if previous_roster and previous_roster != name:
        ops += [Delete(keys.roster(previous_roster), prefix=True),
                Delete(keys.buckets_of(previous_roster), prefix=True)]
    return earlier, ops, name


def _batches(puts: list[Put]) -> list[list[Op]]:
    """``puts`` in order, as transactions of at most EARLIER_TXN_PUTS writes
    and TXN_ROSTER_BYTES (a chunk alone may fill one)."""
    batches: list[list[Op]] = []
    size = 0
    for put in puts:
        if not batches or len(batches[-1]) >= EARLIER_TXN_PUTS \
                or size + len(put.value) > TXN_ROSTER_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(put)
        size += len(put.value)
    return batches


def reads(keys: JobKeys) -> list[Op]:
    """The reads of one transaction that has the whole round: the head, and
    the rosters (normally one) at the same revision."""
    return [Get(keys.round), Get(keys.rosters, prefix=True)]


def stored_bucket(keys: JobKeys, head: RoundHead, kvs: Sequence[KeyValue], me: str
                  ) -> dict[str, bytes | None]:
    """What :func:`bucket_reads` for ``head`` found at ``me``'s bucket of its
    roster among ``kvs``, by the roster's digest (for :func:`resolve`)."""
    want = bucket_reads(keys, head, me)[1].key
    return {head.roster: next((kv.value for kv in kvs if kv.key == want), None)}


def from_reads(keys: JobKeys, head_kvs: Sequence[KeyValue], roster_kvs: Sequence[KeyValue]
               ) -> Round | None:
    """The round that :func:`reads` found (None: no round yet). Raises
    MalformedRecordError naming the key when it is not a valid round."""
    if not head_kvs:
        return None
    kv = head_kvs[0]
    head = parse_head(kv.key, kv.value, kv.version)
    return resolve(head, None, "", stored_rosters(keys, roster_kvs))


# A read of the round with its rosters: every node of a new job makes one at
# once (N reads of a roster of N members), which a loaded etcd serves in
# seconds; a short deadline would cancel them all and start them again.
READ_TIMEOUT_S = 30.0


def read_round(store: Store, keys: JobKeys, timeout_s: float | None = None) -> Round | None:
    """The job's current round, whole (None: none yet). For readers that do
    not follow the job (elasticctl, tests). Raises MalformedRecordError and
    the store's errors."""
    result = store.txn([], reads(keys), timeout_s=timeout_s)
    return from_reads(keys, result.results[0], result.results[1])


def roster_of(record: Round) -> str:
    """The digest of ``record``'s roster (what a head committing it names)."""
    return roster.digest(roster.canonical(record.members))
