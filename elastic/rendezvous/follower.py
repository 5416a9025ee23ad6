"""Following a job's state: read each part, watch it from the revision read,
apply what the watch delivers.

One table of :class:`Part` rows drives it: the key or prefix a part lives
at, whether only the leader follows it, how a read loads it and how a batch
of watch events applies. Every node follows ``round``, ``leader`` and
``standbys``; the leader also follows the rows :class:`~elastic.rendezvous.leader.Leader`
contributes (``nodes/``, ``requests/``, ``checkpoint/latest``). A part whose
read or watch fails stays pending and is read again on the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from elastic.clock import Clock
from elastic.errors import MalformedRecordError
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.rendezvous import round_record
from elastic.rendezvous.api import Standbys
from elastic.rendezvous.committed import CommittedRound
from elastic.rendezvous.election import leader_in
from elastic.rendezvous.inbox import Changed, Message, PartName, WatchEnded
from elastic.store.api import EventType, Get, KeyValue, Store, Watch, WatchEvent


@dataclass(frozen=True)
class Part:
    """One row of the table: where a part lives and how it is applied.

    ``load(kvs, revision, now)``: what a read found (for a key: at most one
    entry) at store ``revision``; ``apply(events, now)``: a batch of watch
    events. Neither calls the store. ``read``: how the part is read, when not
    as its key or prefix alone (the round: its head and rosters at once).
    """

    name: PartName
    key: str  # the key, or the prefix when ``prefix``
    prefix: bool
    leader_only: bool
    load: Callable[[list[KeyValue], int, float], None]
    apply: Callable[[Sequence[WatchEvent], float], None]
    read: Callable[[], tuple[list[KeyValue], int]] | None = None


def value_of(event: WatchEvent) -> bytes | None:
    """The value a watch event wrote (None: the key was deleted)."""
    return event.kv.value if event.type is EventType.PUT else None


class BadRecords:
    """Logs a malformed record once per (key, revision): loud, but no log storm."""

    def __init__(self, log: JobLogger):
        self._log = log
        self._seen: set[tuple[str, int]] = set()

    def __call__(self, exc: MalformedRecordError, revision: int) -> None:
        if (exc.key, revision) not in self._seen:
            self._seen.add((exc.key, revision))
            self._log.error("ignoring %s", exc)


class Follower:
    """What a node knows of the job's shared state; used by its loop thread."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, clock: Clock,
                 rounds: CommittedRound, post: Callable[[Message], None],
                 report_bad: BadRecords, log: JobLogger):
        self.store = store
        self.keys = keys
        self.node_id = node_id
        self.rounds = rounds
        self._clock = clock
        self._post = post
        self._report_bad = report_bad
        self._log = log
        self.leader_id: str | None = None
        self.standbys = Standbys()  # as last read from etcd
        self.pending: set[PartName] = set()
        self._watches: list[tuple[Part, Watch]] = []
        self._on_stop_leading: Callable[[], None] = lambda: None
        self._parts = {part.name: part for part in self._own_parts()}

    @property
    def is_leader(self) -> bool:
        return self.leader_id == self.node_id

    @property
    def settled(self) -> bool:
        """Whether a leader is known and no part waits to be read again."""
        return self.leader_id is not None and not self.pending and not self.rounds.awaiting

    def add_leader_parts(self, parts: Iterable[Part], on_stop_leading: Callable[[], None]
                         ) -> None:
        """The leader's rows, followed only while this node leads;
        ``on_stop_leading`` runs when it stops following them."""
        self._parts.update((part.name, part) for part in parts)
        self._on_stop_leading = on_stop_leading

    def leader_parts(self) -> frozenset[PartName]:
        return frozenset(name for name, part in self._parts.items() if part.leader_only)

    def read_leader_parts(self) -> None:
        """Mark the leader's parts to be read (unless a read of them is pending
        already): the next :meth:`resync_pending` loads the leader's view."""
        if not self.leader_parts() & self.pending:
            self.pending |= self.leader_parts()

    def resync(self, name: PartName) -> None:
        """(Re)load one part and watch it from the revision read. Stays
        pending (read again on the next pass) until it succeeds; raises the
        store's errors."""
        self.pending.add(name)
        part = self._parts[name]
        if part.read is not None:
            kvs, revision = part.read()
        elif part.prefix:
            kvs, revision = self.store.get_prefix(part.key)
        else:
            kvs, revision = self._read(part.key)
        part.load(kvs, revision, self._clock.wall())
        self._watches.append((part, self.store.watch(
            part.key, lambda evs: self._post(Changed(name, tuple(evs))), prefix=part.prefix,
            start_revision=revision + 1, on_error=lambda exc: self._post(WatchEnded(name, exc)))))
        self.pending.discard(name)

    def resync_pending(self) -> None:
        """Read again every pending part, and the round with what this node
        needs of its roster when a head came whose roster it lacks; raises
        the store's errors."""
        for name in sorted(self.pending):
            self.resync(name)
        head = self.rounds.awaiting_head
        if head is not None and head.buckets is not None:
            self._read_own_bucket(head)
        elif head is not None:
            self.read_round()

    def _read_own_bucket(self, head: round_record.RoundHead) -> None:
        """Read the round with this node's bucket of ``head``'s roster, in one
        transaction, and apply it (a newer head read instead waits to be
        read in its turn)."""
        result = self.store.txn([], round_record.bucket_reads(self.keys, head, self.node_id),
                                timeout_s=round_record.READ_TIMEOUT_S)
        kvs = result.results[0][:1]
        if not kvs:
            self.rounds.apply(self.keys.round, None, 0, result.revision)
            return
        kv = kvs[0]
        read_for = kv.version == head.version  # else the bucket read is another head's
        self.rounds.apply(kv.key, kv.value, kv.version, kv.mod_revision, bucket=(
            round_record.stored_bucket(self.keys, head, result.results[1], self.node_id)
            if read_for else None))

    def apply(self, changed: Changed, now: float) -> None:
        """Apply a batch of watch events; no store calls (a failure here would
        lose the events). Leader-only parts count only while this node leads."""
        part = self._parts[changed.part]
        if not part.leader_only or self.is_leader:
            part.apply(changed.events, now)

    def watch_ended(self, ended: WatchEnded) -> None:
        self._log.warning("watch on %s ended (%s); re-reading state", ended.part.value,
                          ended.error)
        self.pending.add(ended.part)

    def stop_leading(self) -> None:
        """Stop following the leader's parts (this node no longer leads, or
        lost its registration), and tell the leader so."""
        for part, watch in self._watches:
            if part.leader_only:
                watch.cancel()
        self._watches = [(part, w) for part, w in self._watches if not part.leader_only]
        self.pending -= self.leader_parts()
        self._on_stop_leading()

    def stop(self) -> None:
        for _, watch in self._watches:
            watch.cancel()
        self._watches = []

    def read_round(self) -> None:
        """Read the round again, head and rosters, and apply it (after a commit
        lost its fence, or for a head whose roster this node lacks)."""
        kvs, revision = self._read_round()
        self._load_round(kvs, revision, self._clock.wall())

    def _read_round(self) -> tuple[list[KeyValue], int]:
        """The head (if any) then the rosters, as one revision has them."""
        result = self.store.txn([], round_record.reads(self.keys),
                                timeout_s=round_record.READ_TIMEOUT_S)
        return [*result.results[0][:1], *result.results[1]], result.revision

    def _read(self, key: str) -> tuple[list[KeyValue], int]:
        """The key and the store revision it was read at: watching from that
        revision + 1 misses nothing and never asks for compacted history."""
        result = self.store.txn([], [Get(key)])
        return result.results[0][:1], result.revision

    def _own_parts(self) -> tuple[Part, ...]:
        keys = self.keys
        return (
            Part(PartName.ROUND, keys.round, False, False, self._load_round, self._apply_round,
                 self._read_round),
            Part(PartName.LEADER, keys.leader, False, False, self._load_leader,
                 self._apply_leader),
            Part(PartName.STANDBYS, keys.standbys, False, False, self._load_standbys,
                 self._apply_standbys),
        )

    def _load_round(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        head = [kv for kv in kvs if kv.key == self.keys.round]
        if head:
            self.rounds.apply(head[0].key, head[0].value, head[0].version, head[0].mod_revision,
                              round_record.stored_rosters(self.keys, kvs))
        else:
            self.rounds.apply(self.keys.round, None, 0, revision)

    def _apply_round(self, events: Sequence[WatchEvent], now: float) -> None:
        for ev in events:
            self.rounds.apply(ev.kv.key, value_of(ev), ev.kv.version, ev.kv.mod_revision)

    def _load_leader(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        self.leader_id = leader_in(kvs[0]) if kvs else None

    def _apply_leader(self, events: Sequence[WatchEvent], now: float) -> None:
        for ev in events:
            self.leader_id = leader_in(ev.kv) if ev.type is EventType.PUT else None
        if not self.is_leader:
            self.stop_leading()

    def _load_standbys(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        self._set_standbys(self.keys.standbys, kvs[0].value if kvs else None,
                           kvs[0].mod_revision if kvs else 0)

    def _apply_standbys(self, events: Sequence[WatchEvent], now: float) -> None:
        for ev in events:
            self._set_standbys(ev.kv.key, value_of(ev), ev.kv.mod_revision)

    def _set_standbys(self, key: str, value: bytes | None, revision: int) -> None:
        try:
            self.standbys = Standbys.from_json(key, value) if value is not None else Standbys()
        except MalformedRecordError as exc:
            self._report_bad(exc, revision)
