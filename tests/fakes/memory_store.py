"""An in-memory :class:`~elastic.store.api.Store` with etcd v3 semantics, for unit tests.

It passes the same contract suite as the etcd backend (``tests/contract``):
one global revision advanced once per successful write (a transaction is one
revision), per-key create/mod revisions and versions, watch history that can be
replayed from any revision not compacted away, and leases that delete their
keys when they expire or are revoked.

Time comes from an injected clock. Sessions are kept alive automatically until
closed; a test takes a session's liveness away with :meth:`MemoryStore.suspend_keepalive`
(the lease then expires ``ttl_s`` later) or :meth:`MemoryStore.expire_session`
(at once). Expiry is checked on every store call and on :meth:`MemoryStore.tick`;
with the system clock a background ticker also runs, with a :class:`FakeClock`
nothing happens until the test advances the clock and calls the store::

    clock = FakeClock()
    store = MemoryStore(clock=clock)
    session = store.session(ttl_s=5)
    store.suspend_keepalive(session.lease_id)
    clock.advance(6)
    store.tick()            # the lease expires: its keys are deleted, session.lost is set

Watch callbacks run on one delivery thread per watch, in revision order, never
while the store's lock is held, so a callback may call the store.

Failure injection for unit tests of retry and blip handling:
:meth:`MemoryStore.set_unavailable` makes every call raise
:class:`~elastic.errors.StoreUnavailableError` (and stops keep-alives, so leases
run out as they would for a node cut off from etcd), and
:meth:`MemoryStore.fail_next` makes the next calls of one kind raise a given error.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    LeaseLostError,
    StoreError,
    StoreUnavailableError,
    WatchCompactedError,
)
from elastic.store.api import (
    Compare,
    Delete,
    ErrorCallback,
    EventsCallback,
    EventType,
    Get,
    KeyValue,
    Op,
    Put,
    Session,
    Store,
    TxnResult,
    Watch,
    WatchEvent,
)

log = logging.getLogger(__name__)

# Lease ids look like etcd's (large, unrelated to revisions), so a test that
# confuses a lease id with a revision fails loudly.
_FIRST_LEASE_ID = 0x694D_7A3C_0000_0001
_DEFAULT_TICK_INTERVAL_S = 0.05
_CANCEL_JOIN_TIMEOUT_S = 5.0

@dataclass
class _Lease:
    lease_id: int
    ttl_s: float
    deadline: float
    last_keepalive: float
    session: "MemorySession"
    keys: set[str] = field(default_factory=set)
    kept_alive: bool = True


class MemorySession(Session):
    """A lease of a :class:`MemoryStore`; kept alive by the store until closed."""

    def __init__(self, store: "MemoryStore", lease_id: int, ttl_s: float):
        super().__init__(lease_id, ttl_s)
        self._store = store
        self.last_confirmed = store.clock.monotonic()

    def close(self) -> None:
        self._store._close_session(self)

    @property
    def confirmed_at(self) -> float:
        return self._store._confirmed_at(self)

    def __repr__(self) -> str:
        return f"MemorySession(lease_id={self.lease_id:#x}, ttl_s={self.ttl_s}, lost={self.lost.is_set()})"


class _MemoryWatch(Watch):
    """One watch: a queue filled under the store lock, drained by its own thread."""

    def __init__(
        self,
        store: "MemoryStore",
        watch_id: int,
        key: str,
        prefix: bool,
        on_events: EventsCallback,
        on_error: ErrorCallback | None,
    ):
        self._store = store
        self.watch_id = watch_id
        self.key = key
        self.prefix = prefix
        self._on_events = on_events
        self._on_error = on_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(
            target=self._deliver, name=f"memory-store-watch-{watch_id}", daemon=True
        )

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key

    def push_events(self, events: list[WatchEvent]) -> None:
        self._queue.put(("events", events))

    def push_error(self, exc: Exception) -> None:
        self._queue.put(("error", exc))

    def start(self) -> None:
        if not self._store.synchronous:
            self._thread.start()

    def peek(self, key: str) -> KeyValue | None:
        """Read ``key`` as the store holds it, whatever faults are switched on:
        for test oracles, never for the code under test."""
        with self._lock:
            return self._kvs.get(key)

    def deliver_pending(self) -> int:
        """Synchronous mode: run the callbacks for what is queued; returns how many batches."""
        delivered = 0
        # qsize() first: most calls find nothing, and a raised queue.Empty
        # costs several times more (the simulator asks every watch each step).
        while self._queue.qsize() and not self._cancelled.is_set():
            kind, item = self._queue.get_nowait()
            delivered += 1
            if not self._dispatch(kind, item):
                break
        return delivered

    def cancel(self) -> None:
        """Stop delivery; once it returns no callback runs (unless called from one)."""
        self._cancelled.set()
        self._store._unregister_watch(self)
        self._queue.put(("stop", None))
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(_CANCEL_JOIN_TIMEOUT_S)

    def _deliver(self) -> None:
        while True:
            kind, item = self._queue.get()
            if not self._dispatch(kind, item):
                return

    def _dispatch(self, kind: str, item) -> bool:
        """Run one callback; False once the watch has ended."""
        if kind == "stop" or self._cancelled.is_set():
            return False
        if kind == "error":
            self._store._unregister_watch(self)
            if self._on_error is None:
                log.warning("Watch on %r ended without an error callback: %s", self.key, item)
            else:
                try:
                    self._on_error(item)
                except Exception:
                    log.exception("Error callback of the watch on %r raised.", self.key)
            return False
        self._store.ops.add("watch_event", len(item))
        try:
            self._on_events(item)
        except Exception:
            log.exception("Events callback of the watch on %r raised; delivery goes on.", self.key)
        return True


class MemoryStore(Store):
    """Thread-safe in-memory store with the exact revision, lease and watch semantics of etcd v3.

    ``clock`` drives lease expiry (the system clock by default).
    ``tick_interval_s`` runs a background thread that checks expiry that often;
    it defaults to 0.05 s with the system clock and to none with an injected
    clock, so tests with a fake clock stay deterministic.
    """

    def __init__(self, clock: Clock | None = None, *, tick_interval_s: float | None = None,
                 synchronous: bool = False):
        super().__init__()
        # Synchronous: no delivery threads; deliver_pending() runs the callbacks
        # (the deterministic simulator's mode).
        self.synchronous = synchronous
        self._outage = False
        self.clock: Clock = clock if clock is not None else SYSTEM_CLOCK
        if tick_interval_s is None and clock is None:
            tick_interval_s = _DEFAULT_TICK_INTERVAL_S
        self._lock = threading.Lock()
        self._revision = 1  # etcd's revision of an empty store
        self._compact_revision = 0
        self._kvs: dict[str, KeyValue] = {}
        self._history_revisions: list[int] = []
        self._history_events: list[list[WatchEvent]] = []
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(_FIRST_LEASE_ID)
        self._watches: dict[int, _MemoryWatch] = {}
        self._watch_ids = itertools.count(1)
        self._closed = False
        self._unavailable = False
        self._failures: dict[str, list[Exception]] = {}
        self._ticker_stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if tick_interval_s:
            self._ticker = threading.Thread(
                target=self._tick_loop, args=(tick_interval_s,), name="memory-store-ticker", daemon=True
            )
            self._ticker.start()

    # ------------------------------------------------------------------ Store

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        with self._request("get"):
            return self._kvs.get(key)

    def get_prefix(
        self, prefix: str, *, timeout_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        with self._request("get_prefix"):
            return self._range_locked(prefix, prefix=True), self._revision

    def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None
    ) -> int:
        with self._request("put"):
            ops = [Put(key, value, lease)]
            self._check_ops_locked(ops)
            self._apply_locked(ops)
            return self._revision

    def delete(
        self, key: str, *, prefix: bool = False, timeout_s: float | None = None
    ) -> int:
        with self._request("delete"):
            (deleted,) = self._apply_locked([Delete(key, prefix)])
            return deleted

    def _run_txn(self, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op], timeout_s: float | None) -> TxnResult:
        with self._request("txn"):
            # etcd refuses a request with overlapping writes in either branch
            # before it evaluates anything.
            _check_no_duplicate_writes(success)
            _check_no_duplicate_writes(failure)
            succeeded = all(self._holds_locked(c) for c in compares)
            ops = list(success if succeeded else failure)
            self._check_ops_locked(ops)
            results = self._apply_locked(ops)
            return TxnResult(succeeded, self._revision, tuple(results))

    def session(self, ttl_s: float) -> Session:
        if ttl_s <= 0:
            raise ValueError(f"a session needs a positive TTL, not {ttl_s}")
        with self._request("lease_grant"):
            lease_id = next(self._lease_ids)
            now = self.clock.monotonic()
            session = MemorySession(self, lease_id, ttl_s)
            self._leases[lease_id] = _Lease(lease_id, ttl_s, now + ttl_s, now, session)
            return session

    def lease_time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        with self._request("lease_ttl"):
            lease = self._leases.get(lease_id)
            if lease is None:
                return -1
            return lease.deadline - self.clock.monotonic()

    def resume_session(self, lease_id: int, ttl_s: float) -> Session | None:
        with self._request("lease_ttl"):
            lease = self._leases.get(lease_id)
            if lease is None:
                return None
            lease.session = MemorySession(self, lease_id, lease.ttl_s)
            lease.kept_alive = True
            return lease.session

    def revoke_lease(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        with self._request("lease_revoke"):
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._remove_lease_locked(lease)

    def _start_watch(self, key: str, prefix: bool, start_revision: int | None,
                     on_events: EventsCallback, on_error: ErrorCallback | None) -> Watch:
        with self._request("watch_create"):
            watch = _MemoryWatch(self, next(self._watch_ids), key, prefix, on_events, on_error)
            if start_revision is not None and start_revision < self._compact_revision:
                watch.push_error(
                    WatchCompactedError(
                        f"cannot watch {key!r} from revision {start_revision}: "
                        f"history before revision {self._compact_revision} is compacted",
                        self._compact_revision,
                    )
                )
            else:
                if start_revision is not None:
                    first = bisect.bisect_left(self._history_revisions, start_revision)
                    for events in self._history_events[first:]:
                        matched = [e for e in events if watch.matches(e.kv.key)]
                        if matched:
                            watch.push_events(matched)
                self._watches[watch.watch_id] = watch
        watch.start()
        return watch

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches = list(self._watches.values())
            sessions = [lease.session for lease in self._leases.values()]
        self._ticker_stop.set()
        for watch in watches:
            watch.cancel()
        for session in sessions:
            session.close()
        if self._ticker is not None:
            self._ticker.join(_CANCEL_JOIN_TIMEOUT_S)

    # ------------------------------------------------------------ test hooks

    @property
    def revision(self) -> int:
        """The current store revision (the revision of the last write)."""
        with self._lock:
            return self._revision

    def tick(self) -> None:
        """Refresh kept-alive leases and expire the ones past their deadline."""
        with self._lock:
            self._expire_due_leases_locked()

    def peek(self, key: str) -> KeyValue | None:
        """Read ``key`` as the store holds it, whatever faults are switched on:
        for test oracles, never for the code under test."""
        with self._lock:
            return self._kvs.get(key)

    def peek_prefix(self, prefix: str) -> list[KeyValue]:
        """The keys under ``prefix``, in key order, as :meth:`peek` reads one."""
        with self._lock:
            return self._range_locked(prefix, prefix=True)

    def deliver_pending(self, *, hold: str | None = None) -> int:
        """Synchronous mode: run every queued watch callback, in watch order,
        until none is left; returns how many batches ran. Watches on the key
        ``hold`` keep theirs queued: their events arrive late, when a later
        call delivers them."""
        total = 0
        while True:
            with self._lock:
                watches = [self._watches[i] for i in sorted(self._watches)
                           if hold is None or self._watches[i].key != hold]
            ran = sum(w.deliver_pending() for w in watches)
            if not ran:
                return total
            total += ran

    @property
    def outage(self) -> bool:
        return self._outage

    def set_outage(self, down: bool) -> None:
        """etcd itself is down (for everyone): every call fails and no lease
        expires meanwhile; when it is back, every lease gets a full TTL again,
        as etcd's lessor does when a leader takes office."""
        with self._lock:
            if self._outage and not down:
                now = self.clock.monotonic()
                for lease in self._leases.values():
                    lease.deadline = now + lease.ttl_s
                    lease.last_keepalive = now if lease.kept_alive else lease.last_keepalive
            self._outage = down

    def compact(self, revision: int) -> None:
        """Forget history before ``revision``, as etcd's compaction does.

        Watches from an older revision then end with WatchCompactedError.
        Raises StoreError for a future revision or one already compacted.
        """
        with self._lock:
            if revision > self._revision:
                raise StoreError(f"cannot compact to future revision {revision} (now {self._revision})")
            if revision <= self._compact_revision:
                raise StoreError(f"revision {revision} is already compacted")
            self._compact_revision = revision
            cut = bisect.bisect_left(self._history_revisions, revision)
            del self._history_revisions[:cut]
            del self._history_events[:cut]

    def suspend_keepalive(self, lease_id: int) -> None:
        """Stop keeping the lease alive: it expires ``ttl_s`` after now
        (when the clock passes that and the store is next called or ticked)."""
        with self._lock:
            lease = self._lease_locked(lease_id)
            now = self.clock.monotonic()
            lease.last_keepalive = now
            lease.deadline = now + lease.ttl_s
            lease.kept_alive = False

    def resume_keepalive(self, lease_id: int) -> None:
        """Keep the lease alive again (if it has not expired meanwhile)."""
        with self._lock:
            self._expire_due_leases_locked()
            self._lease_locked(lease_id).kept_alive = True

    def expire_session(self, lease_id: int) -> None:
        """Expire the lease now: its keys are deleted (one revision) and its session is lost."""
        with self._lock:
            self._remove_lease_locked(self._lease_locked(lease_id))

    def set_unavailable(self, unavailable: bool) -> None:
        """While set, every call raises StoreUnavailableError and no lease is kept alive."""
        with self._lock:
            self._expire_due_leases_locked()
            self._unavailable = unavailable

    def fail_next(self, kind: str, error: Exception, times: int = 1) -> None:
        """Make the next ``times`` calls of op kind ``kind`` (e.g. "txn") raise ``error``."""
        with self._lock:
            self._failures.setdefault(kind, []).extend([error] * times)

    def clear_failures(self) -> None:
        """Forget every failure queued by :meth:`fail_next`."""
        with self._lock:
            self._failures.clear()

    # -------------------------------------------------------------- internals

    @contextlib.contextmanager
    def _request(self, kind: str) -> Iterator[None]:
        self.ops.add(kind)
        with self._lock:
            if self._closed:
                raise StoreError("the memory store is closed")
            if self._outage:
                raise StoreUnavailableError("etcd is down (simulated outage)")
            # Leases expire on the server whether or not this client can reach it.
            self._expire_due_leases_locked()
            if self._unavailable:
                raise StoreUnavailableError("the memory store is marked unavailable")
            pending = self._failures.get(kind)
            if pending:
                raise pending.pop(0)
            yield

    def _tick_loop(self, interval_s: float) -> None:
        while not self._ticker_stop.wait(interval_s):
            with self._lock:
                if self._closed:
                    return
                self._expire_due_leases_locked()

    def _lease_locked(self, lease_id: int) -> _Lease:
        try:
            return self._leases[lease_id]
        except KeyError:
            raise LeaseLostError(f"lease {lease_id:#x} not found") from None

    def _range_locked(self, key: str, *, prefix: bool) -> list[KeyValue]:
        if not prefix:
            kv = self._kvs.get(key)
            return [] if kv is None else [kv]
        return [self._kvs[k] for k in sorted(k for k in self._kvs if k.startswith(key))]

    def _holds_locked(self, compare: Compare) -> bool:
        return compare.holds(self._kvs.get(compare.key))

    def _check_ops_locked(self, ops: Sequence[Op]) -> None:
        """Refuse the whole request before any op runs (a txn is all or nothing)."""
        for op in ops:
            if isinstance(op, Put):
                if not isinstance(op.value, (bytes, bytearray)):
                    raise TypeError(f"value for {op.key!r} must be bytes, not {type(op.value).__name__}")
                if op.lease and op.lease not in self._leases:
                    raise LeaseLostError(f"cannot put {op.key!r}: lease {op.lease:#x} not found")
            elif not isinstance(op, (Get, Delete)):
                raise TypeError(f"unknown op {op!r}")

    def _apply_locked(self, ops: Sequence[Op]) -> list:
        """Run ops in order at the next revision; the revision advances only if something changed."""
        revision = self._revision + 1
        events: list[WatchEvent] = []
        results: list = []
        for op in ops:
            if isinstance(op, Get):
                results.append(self._range_locked(op.key, prefix=op.prefix))
            elif isinstance(op, Put):
                self._put_locked(op, revision, events)
                results.append(None)
            else:
                results.append(self._delete_locked(op, revision, events))
        if events:
            self._revision = revision
            self._history_revisions.append(revision)
            self._history_events.append(events)
            for watch in self._watches.values():
                matched = [e for e in events if watch.matches(e.kv.key)]
                if matched:
                    watch.push_events(matched)
        return results

    def _put_locked(self, op: Put, revision: int, events: list[WatchEvent]) -> None:
        prev = self._kvs.get(op.key)
        if prev is not None and prev.lease and prev.lease != op.lease and prev.lease in self._leases:
            self._leases[prev.lease].keys.discard(op.key)
        kv = KeyValue(
            key=op.key,
            value=bytes(op.value),
            create_revision=revision if prev is None else prev.create_revision,
            mod_revision=revision,
            version=1 if prev is None else prev.version + 1,
            lease=op.lease,
        )
        self._kvs[op.key] = kv
        if op.lease:
            self._leases[op.lease].keys.add(op.key)
        events.append(WatchEvent(EventType.PUT, kv))

    def _delete_locked(self, op: Delete, revision: int, events: list[WatchEvent]) -> int:
        doomed = [kv.key for kv in self._range_locked(op.key, prefix=op.prefix)]
        for key in doomed:
            kv = self._kvs.pop(key)
            if kv.lease and kv.lease in self._leases:
                self._leases[kv.lease].keys.discard(key)
            events.append(WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, revision, 0, 0)))
        return len(doomed)

    def _expire_due_leases_locked(self) -> None:
        if self._outage:
            return
        now = self.clock.monotonic()
        for lease in list(self._leases.values()):
            if lease.kept_alive and not self._unavailable:
                if now - lease.last_keepalive >= lease.ttl_s / 3:
                    self.ops.add("lease_keepalive")
                    lease.last_keepalive = now
                    lease.deadline = now + lease.ttl_s
            elif now >= lease.deadline:
                log.info("Lease %#x expired (ttl %.1f s); deleting its %d keys.", lease.lease_id, lease.ttl_s, len(lease.keys))
                self._remove_lease_locked(lease)

    def _remove_lease_locked(self, lease: _Lease) -> None:
        """Drop the lease and delete its keys in one revision, as etcd's lessor does."""
        del self._leases[lease.lease_id]
        if lease.keys:
            self._apply_locked([Delete(key) for key in sorted(lease.keys)])
        lease.session.lost.set()

    def _confirmed_at(self, session: MemorySession) -> float:
        with self._lock:
            self._expire_due_leases_locked()
            lease = self._leases.get(session.lease_id)
            if lease is not None and lease.session is session:
                session.last_confirmed = lease.last_keepalive
        return session.last_confirmed

    def _close_session(self, session: MemorySession) -> None:
        with self._lock:
            lease = self._leases.get(session.lease_id)
            if lease is not None and lease.session is session:
                self.ops.add("lease_revoke")
                self._remove_lease_locked(lease)
        session.lost.set()

    def _unregister_watch(self, watch: _MemoryWatch) -> None:
        with self._lock:
            self._watches.pop(watch.watch_id, None)


def _check_no_duplicate_writes(ops: Sequence[Op]) -> None:
    """etcd's rule: a key may be put at most once per branch, and not also deleted in it."""
    put_keys: set[str] = set()
    for op in ops:
        if isinstance(op, Put):
            if op.key in put_keys:
                raise StoreError(f"duplicate key given in txn request: {op.key!r}")
            put_keys.add(op.key)
    for op in ops:
        if isinstance(op, Delete):
            for key in put_keys:
                if key.startswith(op.key) if op.prefix else key == op.key:
                    raise StoreError(f"duplicate key given in txn request: {key!r} is put and deleted")
