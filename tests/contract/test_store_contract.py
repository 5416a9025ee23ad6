"""The store contract: one set of test bodies that every Store backend must pass.

:class:`StoreContract` holds the bodies. A backend's test class subclasses it
and supplies fixtures:

``store``
    the Store under test, closed after the test.
``compact``
    ``compact(revision)``: compact the store's history up to ``revision``.
``unkept_lease``
    ``unkept_lease(ttl_s) -> lease_id``: a lease that nobody keeps alive.
``advance_time``
    ``advance_time(seconds)``: let that much lease time pass.
``lose_lease``
    ``lose_lease(lease_id)``: the lease disappears on the server, behind the
    back of the session that holds it (as when it expires during a partition).

Every test works under its own random key prefix, so tests never see each
other's keys, even on a shared etcd. Waiting is always bounded: events are
awaited with a timeout, and "nothing more arrives" is checked by waiting for a
later fence event on a second watch rather than by sleeping.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import uuid
from typing import Callable

import pytest

from elastic.errors import StoreError, StoreUnavailableError, WatchCompactedError
from elastic.store.api import (
    Compare,
    CompareTarget,
    Delete,
    EventType,
    Get,
    Put,
    Store,
    WatchEvent,
)
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

WAIT_S = 5.0
# A lease of 1 s may live up to ~2 s on etcd (its minimum TTL and 0.5 s expiry sweep).
LEASE_EXPIRY_WAIT_S = 6.0



class EventSink:
    """Collects what a watch delivers; every wait is bounded."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[WatchEvent] = []
        self.batches = 0
        self.errors: list[Exception] = []
        self.threads: set[threading.Thread] = set()

    def on_events(self, events) -> None:
        with self._cond:
            self.events.extend(events)
            self.batches += 1
            self.threads.add(threading.current_thread())
            self._cond.notify_all()

    def on_error(self, exc: Exception) -> None:
        with self._cond:
            self.errors.append(exc)
            self._cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout=timeout_s):
                raise AssertionError(
                    f"timed out after {timeout_s} s waiting for {what}; "
                    f"got events {self.describe()} and errors {self.errors}"
                )

    def wait_count(self, n: int, timeout_s: float = WAIT_S) -> list[WatchEvent]:
        self.wait_until(lambda: len(self.events) >= n, f"{n} events", timeout_s)
        return self.snapshot()

    def wait_key(
        self, key: str, type: EventType = EventType.PUT, timeout_s: float = WAIT_S
    ) -> WatchEvent:
        def seen() -> bool:
            return any(e.kv.key == key and e.type is type for e in self.events)

        self.wait_until(seen, f"{type.name} of {key!r}", timeout_s)
        return next(e for e in self.snapshot() if e.kv.key == key and e.type is type)

    def wait_error(self, timeout_s: float = WAIT_S) -> Exception:
        self.wait_until(lambda: bool(self.errors), "an error", timeout_s)
        return self.errors[0]

    def snapshot(self) -> list[WatchEvent]:
        with self._cond:
            return list(self.events)

    def describe(self) -> list[tuple[str, str, int]]:
        return [(e.type.name, e.kv.key, e.revision) for e in self.events]


def _keys(kvs) -> list[str]:
    return [kv.key for kv in kvs]


def _rel(events: list[WatchEvent], prefix: str) -> list[tuple[str, str]]:
    return [(e.type.name, e.kv.key[len(prefix):]) for e in events]


class StoreContract:
    """Test bodies shared by every backend; see the module docstring for the fixtures."""

    @pytest.fixture
    def prefix(self) -> str:
        return f"/contract/{uuid.uuid4().hex[:12]}/"

    @pytest.fixture
    def watches(self):
        """Watches registered here are cancelled after the test, even if it fails."""
        started = []
        yield started
        for watch in started:
            watch.cancel()

    @pytest.fixture
    def watch(self, store, watches):
        def start(key: str, *, prefix: bool = False, start_revision: int | None = None) -> EventSink:
            sink = EventSink()
            watches.append(
                store.watch(
                    key,
                    sink.on_events,
                    prefix=prefix,
                    start_revision=start_revision,
                    on_error=sink.on_error,
                )
            )
            return sink

        return start

    # ---------------------------------------------------------------- keys

    def test_get_of_a_missing_key_is_none(self, store: Store, prefix):
        assert store.get(prefix + "missing") is None

    def test_put_and_get_round_trip_with_revisions(self, store: Store, prefix):
        key = prefix + "k"
        first = store.put(key, b"one")
        kv = store.get(key)
        assert (kv.key, kv.value) == (key, b"one")
        assert kv.create_revision == kv.mod_revision == first
        assert kv.version == 1
        assert kv.lease == 0

        second = store.put(key, b"two")
        assert second > first
        kv = store.get(key)
        assert kv.value == b"two"
        assert kv.create_revision == first
        assert kv.mod_revision == second
        assert kv.version == 2

        third = store.put(key, b"two")  # the same value is still a write
        assert third > second
        assert store.get(key).version == 3

    def test_a_recreated_key_starts_a_new_life(self, store: Store, prefix):
        key = prefix + "k"
        store.put(key, b"a")
        store.put(key, b"b")
        assert store.delete(key) == 1
        again = store.put(key, b"c")
        kv = store.get(key)
        assert kv.create_revision == kv.mod_revision == again
        assert kv.version == 1

    def test_get_prefix_is_sorted_and_scoped_to_the_prefix(self, store: Store, prefix):
        for name in ("a/bc", "a0", "a/b", "a", "a/a/deep", "a/", "b/x"):
            store.put(prefix + name, name.encode())
        last = store.put(prefix + "a/0", b"a/0")

        kvs, revision = store.get_prefix(prefix + "a/")
        assert _keys(kvs) == [prefix + k for k in ("a/", "a/0", "a/a/deep", "a/b", "a/bc")]
        assert [kv.value for kv in kvs] == [b"a/", b"a/0", b"a/a/deep", b"a/b", b"a/bc"]
        assert revision >= last

        kvs, _ = store.get_prefix(prefix + "a/b")
        assert _keys(kvs) == [prefix + "a/b", prefix + "a/bc"]

        kvs, _ = store.get_prefix(prefix + "a")
        assert _keys(kvs) == [prefix + k for k in ("a", "a/", "a/0", "a/a/deep", "a/b", "a/bc", "a0")]

        kvs, revision = store.get_prefix(prefix + "nothing/")
        assert kvs == []
        assert revision >= last

    def test_get_prefix_revision_is_where_a_watch_misses_nothing(self, store: Store, prefix, watch):
        store.put(prefix + "x", b"1")
        kvs, revision = store.get_prefix(prefix)
        assert _keys(kvs) == [prefix + "x"]
        later = store.put(prefix + "y", b"2")
        sink = watch(prefix, prefix=True, start_revision=revision + 1)
        event = sink.wait_key(prefix + "y")
        assert event.revision == later
        fence = store.put(prefix + "fence", b"")
        events = sink.wait_count(2)
        assert [(e.kv.key, e.revision) for e in events] == [(prefix + "y", later), (prefix + "fence", fence)]

    def test_delete_and_delete_prefix_return_counts(self, store: Store, prefix):
        assert store.delete(prefix + "missing") == 0
        assert store.delete(prefix + "missing/", prefix=True) == 0

        store.put(prefix + "one", b"1")
        assert store.delete(prefix + "one") == 1
        assert store.get(prefix + "one") is None
        assert store.delete(prefix + "one") == 0

        for name in ("d/1", "d/2", "d/3/x", "d0", "d"):
            store.put(prefix + name, b"")
        assert store.delete(prefix + "d/", prefix=True) == 3
        kvs, _ = store.get_prefix(prefix)
        assert _keys(kvs) == [prefix + "d", prefix + "d0"]

    def test_writes_that_change_nothing_do_not_advance_the_revision(self, store: Store, prefix):
        key = prefix + "k"
        before = store.put(key, b"v")
        assert store.delete(prefix + "missing") == 0
        failed = store.txn([Compare.absent(key)], [Put(key, b"never")])
        assert not failed.succeeded
        assert failed.revision == before
        read_only = store.txn([], [Get(key)])
        assert read_only.succeeded and read_only.revision == before
        empty_delete = store.txn([], [Delete(prefix + "missing/", prefix=True)])
        assert empty_delete.results == (0,)
        assert empty_delete.revision == before
        assert store.put(key, b"w") == before + 1

    # ---------------------------------------------------------------- txn

    @pytest.mark.parametrize("op", ["==", "!=", "<", ">"])
    @pytest.mark.parametrize("target", list(CompareTarget), ids=lambda t: t.value)
    def test_txn_compare(self, store: Store, prefix, target: CompareTarget, op: str):
        key, branch = prefix + "k", prefix + "branch"
        store.put(prefix + "other", b"")  # so create_revision, mod_revision and version differ
        store.put(key, b"v1")
        store.put(key, b"v2")
        kv = store.get(key)
        if target is CompareTarget.VALUE:
            actual, operands = kv.value, [b"v1", b"v2", b"v3"]
        else:
            actual = getattr(kv, target.value)
            operands = [actual - 1, actual, actual + 1]

        for operand in operands:
            compare = Compare(key, target, op, operand)
            expected = compare.holds(kv)  # the rule as api.py writes it down; etcd must agree
            result = store.txn(
                [compare],
                [Put(branch, b"success"), Get(key)],
                [Put(branch, b"failure"), Get(key)],
            )
            why = f"{target.value} {actual!r} {op} {operand!r}"
            assert result.succeeded is expected, why
            written = store.get(branch)
            assert written.value == (b"success" if expected else b"failure"), why
            assert result.revision == written.mod_revision, why
            assert result.results[0] is None
            assert [(g.key, g.value, g.version) for g in result.results[1]] == [(key, b"v2", 2)]

    def test_txn_compare_on_an_absent_key(self, store: Store, prefix):
        key = prefix + "absent"

        def holds(compare: Compare) -> bool:
            return store.txn([compare], []).succeeded

        assert holds(Compare.absent(key))
        assert holds(Compare.version(key, "==", 0))
        assert holds(Compare.create_revision(key, "==", 0))
        assert holds(Compare.mod_revision(key, "<", 1))
        assert not holds(Compare.version(key, ">", 0))
        # etcd: a value compare on an absent key fails whatever the operator.
        assert not holds(Compare.value(key, "==", b""))
        assert not holds(Compare.value(key, "!=", b"x"))

        created = store.txn([Compare.absent(key)], [Put(key, b"mine")], [Get(key)])
        assert created.succeeded
        lost_race = store.txn([Compare.absent(key)], [Put(key, b"theirs")], [Get(key)])
        assert not lost_race.succeeded
        assert [kv.value for kv in lost_race.results[0]] == [b"mine"]
        assert store.get(key).value == b"mine"

    def test_txn_all_compares_must_hold(self, store: Store, prefix):
        a, b = prefix + "a", prefix + "b"
        ra = store.put(a, b"1")
        store.put(b, b"2")
        both = [Compare.mod_revision(a, "==", ra), Compare.value(b, "==", b"2")]
        assert store.txn(both, []).succeeded
        one_wrong = [Compare.mod_revision(a, "==", ra), Compare.value(b, "==", b"3")]
        assert not store.txn(one_wrong, []).succeeded

    def test_txn_ops_return_results_in_order(self, store: Store, prefix):
        for name in ("g/1", "g/2", "h"):
            store.put(prefix + name, name.encode())
        result = store.txn(
            [],
            [
                Get(prefix + "g/", prefix=True),
                Get(prefix + "missing"),
                Put(prefix + "new", b"n"),
                Get(prefix + "new"),  # sees the put before it in the same txn
                Delete(prefix + "g/", prefix=True),
                Get(prefix + "g/", prefix=True),
            ],
        )
        assert result.succeeded
        got_prefix, got_missing, put, got_new, deleted, got_after = result.results
        assert _keys(got_prefix) == [prefix + "g/1", prefix + "g/2"]
        assert [kv.value for kv in got_prefix] == [b"g/1", b"g/2"]
        assert got_missing == []
        assert put is None
        assert [(kv.value, kv.mod_revision) for kv in got_new] == [(b"n", result.revision)]
        assert deleted == 2
        assert got_after == []

    def test_a_txn_with_several_writes_is_one_revision(self, store: Store, prefix, watch):
        store.put(prefix + "gone", b"")
        before = store.put(prefix + "kept", b"old")
        sink = watch(prefix, prefix=True)
        result = store.txn(
            [Compare.value(prefix + "kept", "==", b"old")],
            [Put(prefix + "kept", b"new"), Put(prefix + "added", b"a"), Delete(prefix + "gone")],
        )
        assert result.succeeded
        assert result.revision == before + 1
        assert store.get(prefix + "kept").mod_revision == result.revision
        assert store.get(prefix + "added").mod_revision == result.revision
        events = sink.wait_count(3)
        assert _rel(events, prefix) == [("PUT", "kept"), ("PUT", "added"), ("DELETE", "gone")]
        assert {e.revision for e in events} == {result.revision}

    def test_a_txn_with_overlapping_writes_is_refused_whole(self, store: Store, prefix):
        key = prefix + "k"
        with pytest.raises(StoreError):
            store.txn([], [Put(prefix + "first", b""), Put(key, b"1"), Put(key, b"2")])
        with pytest.raises(StoreError):
            store.txn([], [Put(key, b"1"), Delete(prefix, prefix=True)])
        assert store.get_prefix(prefix)[0] == []

    # ---------------------------------------------------------------- leases

    def test_a_leased_key_names_its_lease(self, store: Store, prefix):
        session = store.session(5)
        try:
            store.put(prefix + "k", b"v", lease=session.lease_id)
            assert store.get(prefix + "k").lease == session.lease_id
            store.put(prefix + "k", b"w")  # a put without a lease detaches it
            assert store.get(prefix + "k").lease == 0
        finally:
            session.close()
        assert store.get(prefix + "k").value == b"w"

    def test_closing_a_session_deletes_its_keys_in_one_revision(self, store: Store, prefix, watch):
        session = store.session(5)
        store.put(prefix + "s/1", b"", lease=session.lease_id)
        store.put(prefix + "s/2", b"", lease=session.lease_id)
        store.put(prefix + "free", b"")
        assert not session.lost.is_set()
        sink = watch(prefix, prefix=True)

        session.close()

        assert session.lost.is_set()
        gone1 = sink.wait_key(prefix + "s/1", EventType.DELETE)
        gone2 = sink.wait_key(prefix + "s/2", EventType.DELETE)
        assert gone1.revision == gone2.revision
        assert gone1.kv.value == b""
        assert _keys(store.get_prefix(prefix)[0]) == [prefix + "free"]
        assert store.lease_time_to_live(session.lease_id) == -1
        with pytest.raises(StoreError):
            store.put(prefix + "late", b"", lease=session.lease_id)
        session.close()  # closing twice is harmless

    def test_a_lease_not_kept_alive_expires(self, store: Store, prefix, watch, unkept_lease, advance_time):
        lease_id = unkept_lease(1)
        store.put(prefix + "k", b"v", lease=lease_id)
        store.put(prefix + "free", b"")
        sink = watch(prefix, prefix=True)
        # etcd reports whole seconds, truncated: a live 1 s lease reads 0; only -1 means gone.
        assert store.lease_time_to_live(lease_id) >= 0

        advance_time(1.5)

        event = sink.wait_key(prefix + "k", EventType.DELETE, timeout_s=LEASE_EXPIRY_WAIT_S)
        assert event.kv.value == b""
        assert store.get(prefix + "k") is None
        assert store.get(prefix + "free") is not None
        assert store.lease_time_to_live(lease_id) == -1

    def test_a_session_outlives_its_ttl_while_kept_alive(self, store: Store, prefix, advance_time):
        session = store.session(1)
        try:
            store.put(prefix + "k", b"v", lease=session.lease_id)
            advance_time(2.5)
            assert store.get(prefix + "k") is not None
            assert not session.lost.is_set()
            assert store.lease_time_to_live(session.lease_id) >= 0  # whole seconds on etcd
        finally:
            session.close()

    def test_a_session_whose_lease_vanishes_is_lost(self, store: Store, prefix, watch, lose_lease):
        session = store.session(1)
        try:
            store.put(prefix + "k", b"v", lease=session.lease_id)
            sink = watch(prefix, prefix=True)
            lose_lease(session.lease_id)
            sink.wait_key(prefix + "k", EventType.DELETE)
            assert session.lost.wait(LEASE_EXPIRY_WAIT_S), "the session did not notice its lease was gone"
            assert store.get(prefix + "k") is None
        finally:
            session.close()

    def test_lease_time_to_live(self, store: Store):
        session = store.session(5)
        left = store.lease_time_to_live(session.lease_id)
        assert 0 < left <= 5
        session.close()
        assert store.lease_time_to_live(session.lease_id) == -1
        assert store.lease_time_to_live(0x7A11_0000_DEAD_BEEF) == -1

    def test_revoking_another_owners_lease_deletes_its_keys(self, store: Store, prefix, watch):
        # What a restarted agent does to the registration of its dead predecessor.
        session = store.session(5)
        store.put(prefix + "node", b"old agent", lease=session.lease_id)
        sink = watch(prefix, prefix=True)
        told = []
        session.lost.when_set(lambda: told.append("lost"))  # its owner's wake-up

        store.revoke_lease(session.lease_id)

        sink.wait_key(prefix + "node", EventType.DELETE)
        assert store.get(prefix + "node") is None
        assert session.lost.wait(LEASE_EXPIRY_WAIT_S)
        assert told == ["lost"]
        session.lost.when_set(lambda: told.append("already lost"))  # at once
        assert told == ["lost", "already lost"]
        store.revoke_lease(session.lease_id)  # already gone: not an error
        session.close()

    def test_a_lease_etcd_still_has_can_be_resumed_and_a_gone_one_cannot(self, store: Store,
                                                                          prefix):
        session = store.session(5)
        store.put(prefix + "k", b"v", lease=session.lease_id)

        resumed = store.resume_session(session.lease_id, 5)

        assert resumed is not None and resumed.lease_id == session.lease_id
        assert not resumed.lost.is_set()
        assert store.get(prefix + "k").lease == session.lease_id
        resumed.close()
        assert store.get(prefix + "k") is None
        assert store.resume_session(session.lease_id, 5) is None
        session.close()

    def test_confirmation_of_a_kept_alive_lease_advances(self, store: Store, advance_time):
        # An agent judges "cut off from etcd" by how old this confirmation is.
        session = store.session(1)
        try:
            first = session.confirmed_at
            advance_time(1.5)
            assert session.confirmed_at > first
        finally:
            session.close()

    def test_many_concurrent_sessions(self, store: Store, prefix, watch):
        n = 50

        def join(i: int):
            session = store.session(5)
            store.put(f"{prefix}nodes/{i:03d}", str(i).encode(), lease=session.lease_id)
            return session

        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
            sessions = list(pool.map(join, range(n)))
        try:
            kvs, _ = store.get_prefix(prefix + "nodes/")
            assert _keys(kvs) == [f"{prefix}nodes/{i:03d}" for i in range(n)]
            assert [kv.lease for kv in kvs] == [s.lease_id for s in sessions]
            assert len({s.lease_id for s in sessions}) == n
            sink = watch(prefix + "nodes/", prefix=True)
        finally:
            with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
                list(pool.map(lambda s: s.close(), sessions))
        events = sink.wait_count(n)
        assert all(e.type is EventType.DELETE for e in events)
        assert sorted(e.kv.key for e in events) == [f"{prefix}nodes/{i:03d}" for i in range(n)]
        assert store.get_prefix(prefix + "nodes/")[0] == []
        assert all(s.lost.is_set() for s in sessions)

    # ---------------------------------------------------------------- watches

    def test_watch_replays_history_then_live_events_in_order_once(self, store: Store, prefix, watch):
        r1 = store.put(prefix + "a", b"1")
        r2 = store.put(prefix + "b", b"2")
        r3 = store.put(prefix + "a", b"3")
        assert store.delete(prefix + "b") == 1
        r4 = store.get_prefix(prefix)[1]

        sink = watch(prefix, prefix=True, start_revision=r1)
        history = sink.wait_count(4)
        assert _rel(history, prefix) == [("PUT", "a"), ("PUT", "b"), ("PUT", "a"), ("DELETE", "b")]
        assert [e.revision for e in history] == [r1, r2, r3, r4]
        assert [e.kv.value for e in history] == [b"1", b"2", b"3", b""]
        assert (history[2].kv.create_revision, history[2].kv.version) == (r1, 2)

        r5 = store.put(prefix + "c", b"5")
        r6 = store.txn([], [Put(prefix + "a", b"6"), Put(prefix + "d", b"6")]).revision
        events = sink.wait_count(7)
        assert [e.revision for e in events] == [r1, r2, r3, r4, r5, r6, r6]
        assert _rel(events[4:], prefix) == [("PUT", "c"), ("PUT", "a"), ("PUT", "d")]
        assert events[5].kv == store.get(prefix + "a")

        fence = store.put(prefix + "fence", b"")
        events = sink.wait_count(8)
        assert len(events) == 8, f"duplicate or extra events: {sink.describe()}"
        assert events[-1].revision == fence
        assert sink.errors == []

    def test_watch_without_start_revision_sees_only_later_changes(self, store: Store, prefix, watch):
        store.put(prefix + "k", b"old")
        sink = watch(prefix + "k")
        new = store.put(prefix + "k", b"new")
        events = sink.wait_count(1)
        fence = store.put(prefix + "k", b"fence")
        events = sink.wait_count(2)
        assert [(e.kv.value, e.revision) for e in events] == [(b"new", new), (b"fence", fence)]

    def test_watch_of_a_prefix_sees_only_that_prefix(self, store: Store, prefix, watch):
        sink = watch(prefix + "a/", prefix=True)
        for name in ("a/1", "ab", "a", "b/a/1", "a/2/x"):
            store.put(prefix + name, b"")
        store.delete(prefix + "ab")
        store.delete(prefix + "a/1")
        store.put(prefix + "a/fence", b"")
        sink.wait_key(prefix + "a/fence")
        assert _rel(sink.snapshot(), prefix) == [
            ("PUT", "a/1"),
            ("PUT", "a/2/x"),
            ("DELETE", "a/1"),
            ("PUT", "a/fence"),
        ]

    def test_watch_of_a_key_sees_only_that_key(self, store: Store, prefix, watch):
        sink = watch(prefix + "a")
        for name in ("ab", "a/1", "a", "b"):
            store.put(prefix + name, b"")
        store.delete(prefix + "a")
        sink.wait_count(2)
        fence_sink = watch(prefix, prefix=True)
        store.put(prefix + "a", b"fence")
        fence_sink.wait_count(1)
        events = sink.wait_count(3)
        assert _rel(events, prefix) == [("PUT", "a"), ("DELETE", "a"), ("PUT", "a")]

    def test_cancel_stops_delivery(self, store: Store, prefix, watch):
        stopped = EventSink()
        cancelled = store.watch(prefix, stopped.on_events, prefix=True, on_error=stopped.on_error)
        control = watch(prefix, prefix=True)
        store.put(prefix + "before", b"")
        stopped.wait_key(prefix + "before")
        control.wait_key(prefix + "before")

        cancelled.cancel()
        cancelled.cancel()  # twice is harmless
        after = store.put(prefix + "after", b"")
        fence = store.put(prefix + "fence", b"")
        # Once the control watch has seen the fence, the cancelled one would
        # have had its chance to (wrongly) deliver "after".
        control.wait_key(prefix + "fence")
        assert all(e.revision < after for e in stopped.snapshot()), stopped.describe()
        assert [e.revision for e in control.snapshot()][-2:] == [after, fence]
        assert stopped.errors == []

    def test_watch_from_a_compacted_revision_fails(self, store: Store, prefix, watch, compact):
        r1 = store.put(prefix + "k", b"1")
        r2 = store.put(prefix + "k", b"2")
        r3 = store.put(prefix + "k", b"3")
        compact(r2)

        too_old = watch(prefix, prefix=True, start_revision=r1)
        error = too_old.wait_error()
        assert isinstance(error, WatchCompactedError)
        assert error.compact_revision >= r2
        assert too_old.snapshot() == []

        still_there = watch(prefix, prefix=True, start_revision=r2)
        events = still_there.wait_count(2)
        assert [(e.kv.value, e.revision) for e in events] == [(b"2", r2), (b"3", r3)]
        assert still_there.errors == []

    def test_watch_refuses_a_start_revision_below_one(self, store: Store, prefix):
        with pytest.raises(ValueError):
            store.watch(prefix, lambda events: None, start_revision=0)

    def test_callbacks_run_on_a_background_thread_and_may_call_the_store(self, store: Store, prefix, watches):
        seen = EventSink()
        read_back = []

        def on_events(events):
            read_back.append(store.get(events[-1].kv.key))  # must not deadlock
            seen.on_events(events)

        watches.append(store.watch(prefix, on_events, prefix=True))
        store.put(prefix + "k", b"v")
        seen.wait_key(prefix + "k")
        assert threading.current_thread() not in seen.threads
        assert read_back[0].value == b"v"

    def test_cancelling_one_of_several_watches_stops_only_its_deliveries(self, store: Store,
                                                                         prefix, watch):
        key = prefix + "k"
        kept = [watch(prefix, prefix=True), watch(key)]
        stopped = EventSink()
        cancelled = store.watch(prefix, stopped.on_events, prefix=True, on_error=stopped.on_error)
        kept.append(watch(prefix, prefix=True))  # a neighbour started after it, too
        before = store.put(key, b"before")
        for sink in kept + [stopped]:
            sink.wait_key(key)

        cancelled.cancel()
        after = store.put(key, b"after")
        fence = store.put(key, b"fence")

        for sink in kept:
            assert [e.revision for e in sink.wait_count(3)] == [before, after, fence], \
                sink.describe()
        assert [e.revision for e in stopped.snapshot()] == [before]
        assert not any(sink.errors for sink in kept + [stopped])

    def test_a_compacted_start_revision_ends_only_that_watch(self, store: Store, prefix, watch,
                                                             compact):
        key = prefix + "k"
        r1 = store.put(key, b"1")
        live = watch(prefix, prefix=True, start_revision=r1)
        r2 = store.put(key, b"2")
        live.wait_count(2)
        compact(r2)

        too_old = watch(prefix, prefix=True, start_revision=r1)
        assert isinstance(too_old.wait_error(), WatchCompactedError)
        later = watch(key, start_revision=r2)
        r3 = store.put(key, b"3")
        fence = store.put(prefix + "fence", b"")

        assert [e.revision for e in live.wait_count(4)] == [r1, r2, r3, fence], live.describe()
        assert [e.revision for e in later.wait_count(2)] == [r2, r3], later.describe()
        assert live.errors == [] and later.errors == []
        assert too_old.snapshot() == [] and len(too_old.errors) == 1

    def test_a_callback_may_cancel_watches_and_start_new_ones(self, store: Store, prefix, watch,
                                                              watches):
        other = EventSink()
        other_watch = store.watch(prefix, other.on_events, prefix=True, on_error=other.on_error)
        watches.append(other_watch)
        mine = EventSink()
        started: dict[str, EventSink] = {}
        done = threading.Event()

        def on_events(events) -> None:
            mine.on_events(events)
            if done.is_set():
                return
            other_watch.cancel()  # another watch's
            own.cancel()  # its own, twice
            own.cancel()
            started["from the next revision"] = watch(prefix, prefix=True,
                                                      start_revision=events[-1].revision + 1)
            started["from now"] = watch(prefix, prefix=True)
            done.set()

        own = store.watch(prefix, on_events, prefix=True)
        watches.append(own)
        trigger = store.put(prefix + "trigger", b"")
        assert done.wait(WAIT_S), "a callback that cancels watches and starts new ones hung"

        after = store.put(prefix + "after", b"")
        fence = store.put(prefix + "fence", b"")
        for what, sink in started.items():
            assert [e.revision for e in sink.wait_count(2)] == [after, fence], what
            assert sink.errors == []
        assert [e.revision for e in mine.snapshot()] == [trigger]
        assert all(e.revision < after for e in other.snapshot()), other.describe()

    def test_cancel_waits_for_the_callback_that_runs(self, store: Store, prefix, watches):
        entered, release, finished = threading.Event(), threading.Event(), threading.Event()

        def on_events(events) -> None:
            entered.set()
            release.wait(WAIT_S)
            finished.set()

        w = store.watch(prefix, on_events, prefix=True)
        watches.append(w)
        store.put(prefix + "k", b"")
        assert entered.wait(WAIT_S)
        timer = threading.Timer(0.2, release.set)
        timer.start()
        try:
            w.cancel()
            assert finished.is_set(), "cancel() returned while the watch's callback still ran"
        finally:
            release.set()
            timer.cancel()

    def test_a_raising_callback_is_logged_and_its_watch_goes_on(self, store: Store, prefix,
                                                                watch, watches, caplog):
        sink = EventSink()
        bug = RuntimeError("a bug in the callback")

        def on_events(events) -> None:
            first = sink.batches == 0
            sink.on_events(events)
            if first:
                raise bug

        watches.append(store.watch(prefix, on_events, prefix=True, on_error=sink.on_error))
        neighbour = watch(prefix, prefix=True)
        r1 = store.put(prefix + "a", b"")
        sink.wait_count(1)
        r2 = store.put(prefix + "b", b"")
        fence = store.put(prefix + "fence", b"")

        for s in (sink, neighbour):
            assert [e.revision for e in s.wait_count(3)] == [r1, r2, fence], s.describe()
            assert s.errors == []
        assert any(r.exc_info and r.exc_info[1] is bug for r in caplog.records)

    # ---------------------------------------------------------------- ops

    def test_ops_are_counted_by_kind(self, store: Store, prefix, watches):
        key = prefix + "k"
        before = store.ops.snapshot()
        store.get(key)
        store.get_prefix(prefix)
        store.put(key, b"1")
        store.delete(key)
        store.txn([Compare.absent(key)], [Put(key, b"2")])
        session = store.session(5)
        store.lease_time_to_live(session.lease_id)
        sink = EventSink()
        watches.append(store.watch(key, sink.on_events))
        store.put(key, b"3")
        sink.wait_count(1)
        session.close()
        after = store.ops.snapshot()

        delta = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in after}
        expected = {
            "get": 1,
            "get_prefix": 1,
            "put": 2,
            "delete": 1,
            "txn": 1,
            "lease_grant": 1,
            "lease_ttl": 1,
            "lease_revoke": 1,
            "watch_create": 1,
        }
        assert {kind: delta.get(kind, 0) for kind in expected} == expected
        assert delta.get("watch_event", 0) >= 1


class TestMemoryStore(StoreContract):
    """The contract against the in-memory fake, with a fake clock: no waiting on real time."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    def store(self, clock):
        store = MemoryStore(clock=clock)
        yield store
        store.close()

    @pytest.fixture
    def compact(self, store):
        return store.compact

    @pytest.fixture
    def advance_time(self, store, clock):
        def advance(seconds: float) -> None:
            clock.advance(seconds)
            store.tick()

        return advance

    @pytest.fixture
    def unkept_lease(self, store):
        def grant(ttl_s: float) -> int:
            lease_id = store.session(ttl_s).lease_id
            store.suspend_keepalive(lease_id)
            return lease_id

        return grant

    @pytest.fixture
    def lose_lease(self, store):
        return store.expire_session

    # -- the fake's own test hooks ------------------------------------------

    def test_suspended_session_expires_only_after_its_ttl(self, store, clock, prefix, watch):
        session = store.session(5)
        store.put(prefix + "k", b"", lease=session.lease_id)
        sink = watch(prefix, prefix=True)
        clock.advance(100)  # kept alive: nothing happens
        store.tick()
        assert not session.lost.is_set()
        store.suspend_keepalive(session.lease_id)
        clock.advance(4.9)
        assert store.get(prefix + "k") is not None
        assert store.lease_time_to_live(session.lease_id) == pytest.approx(0.1)
        clock.advance(0.2)
        assert store.get(prefix + "k") is None  # any call notices the expiry
        assert session.lost.is_set()
        sink.wait_key(prefix + "k", EventType.DELETE)

    def test_resumed_keepalive_saves_the_session(self, store, clock, prefix):
        session = store.session(5)
        store.suspend_keepalive(session.lease_id)
        clock.advance(4)
        store.resume_keepalive(session.lease_id)
        clock.advance(10)
        store.tick()
        assert not session.lost.is_set()
        assert store.lease_time_to_live(session.lease_id) == pytest.approx(5)

    def test_keepalives_are_counted(self, store, clock):
        store.session(3)
        before = store.ops.snapshot().get("lease_keepalive", 0)
        for _ in range(3):
            clock.advance(1)
            store.tick()
        assert store.ops.snapshot().get("lease_keepalive", 0) - before == 3

    def test_unavailable_store_fails_calls_and_lets_leases_run_out(self, store, clock, prefix):
        session = store.session(5)
        store.put(prefix + "k", b"", lease=session.lease_id)
        store.set_unavailable(True)
        with pytest.raises(StoreUnavailableError):
            store.get(prefix + "k")
        clock.advance(6)
        store.tick()
        assert session.lost.is_set()
        store.set_unavailable(False)
        assert store.get(prefix + "k") is None

    def test_fail_next_injects_errors_by_kind(self, store, prefix):
        store.fail_next("txn", StoreError("injected"), times=2)
        for _ in range(2):
            with pytest.raises(StoreError, match="injected"):
                store.txn([], [Put(prefix + "k", b"")])
        assert store.get(prefix + "k") is None
        assert store.txn([], [Put(prefix + "k", b"")]).succeeded

    def test_compacting_the_future_or_the_past_is_refused(self, store, prefix):
        revision = store.put(prefix + "k", b"")
        with pytest.raises(StoreError):
            store.compact(revision + 1)
        store.compact(revision)
        with pytest.raises(StoreError):
            store.compact(revision)

    def test_closed_store_refuses_calls_and_closes_sessions(self, clock):
        store = MemoryStore(clock=clock)
        session = store.session(5)
        store.close()
        assert session.lost.is_set()
        with pytest.raises(StoreError):
            store.get("k")
        store.close()

    def test_system_clock_ticker_expires_leases_in_real_time(self, prefix):
        with MemoryStore() as store:
            session = store.session(0.2)
            store.put(prefix + "k", b"", lease=session.lease_id)
            store.suspend_keepalive(session.lease_id)
            assert session.lost.wait(WAIT_S)
            assert store.get(prefix + "k") is None

    def test_fake_clock(self):
        clock = FakeClock()
        m, w = clock.monotonic(), clock.wall()
        assert clock.advance(2.5) == m + 2.5
        assert (clock.monotonic(), clock.wall()) == (m + 2.5, w + 2.5)
        with pytest.raises(ValueError):
            clock.advance(-1)


class RawEtcd:
    """Direct etcd gRPC stubs on ``channel`` for what the Store interface
    deliberately lacks: compaction, and leases nobody keeps alive. With
    ``token`` (used right away: it outlives no TTL) every call carries it."""

    def __init__(self, channel, token: str | None = None):
        from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc

        self.kv = rpc_pb2_grpc.KVStub(channel)
        self.lease = rpc_pb2_grpc.LeaseStub(channel)
        self.pb = rpc_pb2
        self.md = (("token", token),) if token else None


class RawEtcdHooks:
    """The contract's hooks for a real etcd (compaction, leases nobody keeps
    alive, the system clock) on the ``raw_etcd`` fixture (a :class:`RawEtcd`)
    that a subclass provides."""

    @pytest.fixture
    def compact(self, raw_etcd: RawEtcd):
        def compact(revision: int) -> None:
            raw_etcd.kv.Compact(raw_etcd.pb.CompactionRequest(revision=revision, physical=True),
                                timeout=WAIT_S, metadata=raw_etcd.md)

        return compact

    @pytest.fixture
    def advance_time(self):
        return time.sleep

    @pytest.fixture
    def unkept_lease(self, raw_etcd: RawEtcd):
        def grant(ttl_s: float) -> int:
            return raw_etcd.lease.LeaseGrant(raw_etcd.pb.LeaseGrantRequest(TTL=math.ceil(ttl_s)),
                                             timeout=WAIT_S, metadata=raw_etcd.md).ID

        return grant

    @pytest.fixture
    def lose_lease(self, raw_etcd: RawEtcd):
        def revoke(lease_id: int) -> None:
            raw_etcd.lease.LeaseRevoke(raw_etcd.pb.LeaseRevokeRequest(ID=lease_id),
                                       timeout=WAIT_S, metadata=raw_etcd.md)

        return revoke


@pytest.mark.integration
class TestEtcdStore(RawEtcdHooks, StoreContract):
    """The contract against a real etcd server (the session's ``etcd_server``)."""

    @pytest.fixture
    def store(self, etcd_store):
        return etcd_store

    @pytest.fixture
    def raw_etcd(self, etcd_server):
        channel = etcd_server.channel()
        yield RawEtcd(channel)
        channel.close()
