"""The etcd store's watches on a real etcd: what the store contract cannot ask
of every backend.

* All watches of a store ride one Watch stream, read by one thread named
  ``etcd-watch`` that runs every callback; each watch still sees exactly its
  own key's events, and the stream closes with the last watch.
* After etcd restarts, every watch resumes where it left off: events written
  while the watches reconnect are delivered, none is delivered twice.
* A callback may close the store.

What every store must do with several watches (cancelling one, a compacted
start revision, callbacks that cancel and start watches) is in the contract,
``tests/contract/test_store_contract.py``.
"""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

from elastic.store.etcd import EtcdStore
from tests.contract.test_store_contract import WAIT_S, EventSink

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix() -> str:
    return f"/etcd-watch/{uuid.uuid4().hex[:12]}/"


def _new_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before]


def _watch_threads(threads: list[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threads if t.name.startswith("etcd-watch")]


def test_fifty_watches_share_one_stream_and_one_thread_and_each_sees_only_its_key(
        etcd_store, prefix):
    before = set(threading.enumerate())
    keys = [f"{prefix}k{i}" for i in range(50)]  # k1 is no prefix of k10: key watches
    sinks = {key: EventSink() for key in keys}
    watches = [etcd_store.watch(key, sink.on_events, on_error=sink.on_error)
               for key, sink in sinks.items()]
    try:
        written: dict[str, list[int]] = {key: [] for key in keys}
        for value in (b"one", b"two", b"fence"):  # interleaved: neighbours change in between
            for key in keys:
                written[key].append(etcd_store.put(key, value))

        new = _new_threads(before)
        watch_threads = _watch_threads(new)
        assert [t.name for t in watch_threads] == ["etcd-watch"], [t.name for t in new]
        # gRPC adds a thread or two per stream, never one per watch.
        assert len(new) <= 5, [t.name for t in new]
        for key, sink in sinks.items():
            events = sink.wait_count(3)
            assert [(e.kv.key, e.revision) for e in events] == [(key, r) for r in written[key]]
            assert sink.threads == set(watch_threads)
            assert sink.errors == []
        assert etcd_store.watches.stream_open
    finally:
        for w in watches:
            w.cancel()
    assert not etcd_store.watches.stream_open  # closed with the last watch


def test_after_an_etcd_restart_every_watch_resumes_with_no_event_lost_or_repeated(
        own_etcd, prefix, caplog):
    caplog.set_level(logging.INFO, logger="elastic.store.etcd_watch")
    keys = [f"{prefix}k{i}" for i in range(10)]
    with EtcdStore(own_etcd.endpoint) as store:
        before = set(threading.enumerate())
        history = store.put(prefix + "history", b"")
        key_sinks = {key: EventSink() for key in keys}
        watches = [store.watch(key, sink.on_events, on_error=sink.on_error)
                   for key, sink in key_sinks.items()]
        # Prefix watches that replay history: a resume from their start
        # revision instead of their last event would repeat it.
        prefix_sinks = [EventSink() for _ in range(3)]
        watches += [store.watch(prefix, sink.on_events, prefix=True, start_revision=history,
                                on_error=sink.on_error) for sink in prefix_sinks]
        written = {key: [store.put(key, b"before")] for key in keys}
        for key, sink in key_sinks.items():
            sink.wait_count(1)
        for sink in prefix_sinks:
            sink.wait_count(1 + len(keys))
        reconnects = store.ops.snapshot().get("watch_reconnect", 0)

        own_etcd.restart()
        # Written at once: the watches are still reconnecting (backing off
        # while etcd was down), so these show that each resumes from where it
        # left off rather than from "now".
        for value in (b"after 1", b"after 2"):
            for key in keys:
                written[key].append(store.put(key, value))
        fence = store.put(prefix + "fence", b"")

        all_writes = sorted([history, fence] + [r for rs in written.values() for r in rs])
        for sink in prefix_sinks:
            sink.wait_key(prefix + "fence", timeout_s=WAIT_S * 2)
            assert [e.revision for e in sink.snapshot()] == all_writes, sink.describe()
        for key, sink in key_sinks.items():
            events = sink.wait_count(3, timeout_s=WAIT_S * 2)
            assert [e.revision for e in events] == written[key], sink.describe()
        assert not any(s.errors for s in [*key_sinks.values(), *prefix_sinks])
        assert store.ops.snapshot()["watch_reconnect"] - reconnects >= len(watches)
        assert "resumed from revision" in caplog.text
        assert [t.name for t in _watch_threads(_new_threads(before))] == ["etcd-watch"]
        for w in watches:
            w.cancel()


def test_a_callback_may_close_its_store(etcd_endpoint, prefix):
    store = EtcdStore(etcd_endpoint)
    closed = threading.Event()
    callback_threads = []

    def on_events(events) -> None:
        callback_threads.append(threading.current_thread())  # the store's watch thread
        store.close()
        closed.set()

    try:
        store.watch(prefix, on_events, prefix=True)
        store.put(prefix + "k", b"")
        assert closed.wait(WAIT_S), "close() from a callback hung"
        [thread] = callback_threads
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        store.close()
