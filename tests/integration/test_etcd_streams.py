"""The etcd store's two long-lived streams (Watch, LeaseKeepAlive) on a real etcd.

They ride a ``grpc.aio`` channel so that an idle store costs no wake-ups
(:mod:`elastic.store.etcd_stream`):

* with a watch and a lease open, no thread of the store wakes while nothing
  happens, and gRPC's synchronous spin thread is not there at all;
* a stream closed here ends its reader with CANCELLED, and closing the store
  gives back its use of the process's shared event loop;
* a child forked after a store was closed and dropped can collect it (grpc's
  aio shutdown would otherwise wait there for a thread the child does not have).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import uuid

import grpc
import pytest

from elastic.loop_thread import shared_users
from elastic.store.etcd import EtcdStore
from tests.contract.test_store_contract import EventSink
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

QUIET_S = 1.0
# A synchronous stream's reader wakes every 0.1 s (10 in QUIET_S); a lease of
# 60 s has no keep-alive due in the window, and nothing else is.
MOST_WAKES = 3


def wakes(thread: threading.Thread) -> int:
    """The thread's voluntary context switches so far: one per wake-up from a wait."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError(f"no context switch count for {thread.name}")


def test_an_idle_watch_and_lease_wake_no_thread(etcd_endpoint):
    before = set(threading.enumerate())
    key = f"/etcd-streams/{uuid.uuid4().hex[:12]}"
    with EtcdStore(etcd_endpoint) as store:
        sink = EventSink()
        store.watch(key, sink.on_events, on_error=sink.on_error)
        session = store.session(ttl_s=60.0)  # a keep-alive every 20 s: none in the window
        store.put(key, b"created")
        sink.wait_count(1)
        time.sleep(0.3)  # the first keep-alive's answer
        assert session.confirmed_at > 0 and not session.lost.is_set()

        ours = [t for t in threading.enumerate() if t not in before]
        names = sorted(t.name for t in ours)
        assert {"etcd-watch", "etcd-keepalive", "etcd-keepalive-reader"} <= set(names), names
        assert "elastic-aio" in {t.name for t in threading.enumerate()}
        assert not any("channel_spin" in name for name in names), names

        at_start = {t: wakes(t) for t in ours}
        time.sleep(QUIET_S)
        woke = {t.name: wakes(t) - n for t, n in at_start.items()}
        assert all(n <= MOST_WAKES for n in woke.values()), woke
        assert sink.errors == []


def test_a_stream_closed_here_ends_its_reader_with_cancelled(etcd_store):
    stream = etcd_store.connection.streams.watch(metadata=None)
    read = []
    reader = threading.Thread(target=lambda: read.append(_drain(stream)))
    reader.start()
    stream.close()
    reader.join(5.0)
    assert not reader.is_alive(), "the reader still waits after close()"
    assert read == [grpc.StatusCode.CANCELLED]
    assert _drain(stream) == grpc.StatusCode.CANCELLED  # and again, for a second reader


def _drain(stream) -> grpc.StatusCode | None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_closing_the_store_gives_the_shared_loop_back_and_refuses_new_streams(etcd_endpoint):
    held = shared_users()
    store = EtcdStore(etcd_endpoint)
    store.watch(f"/etcd-streams/{uuid.uuid4().hex[:12]}", lambda events: None)
    wait_until(lambda: shared_users() == held + 1, 5.0, "the watch to open its stream")
    store.close()
    assert shared_users() == held
    with pytest.raises(ValueError):
        store.connection.streams.watch(metadata=None)


def test_a_child_forked_after_a_store_was_dropped_can_collect_it(etcd_endpoint):
    gc.disable()  # the dropped store stays garbage until the child collects it
    try:
        store = EtcdStore(etcd_endpoint)
        key, sink = f"/etcd-streams/{uuid.uuid4().hex[:12]}", EventSink()
        store.watch(key, sink.on_events)
        store.put(key, b"seen")
        sink.wait_count(1)  # so its aio channel exists
        store.close()
        del store  # a cycle (its streams refer back to it): garbage, not freed

        child = os.fork()
        if child == 0:
            gc.collect()  # frees the last aio channel here: grpc's aio shutdown
            os._exit(0)
        deadline = time.monotonic() + 10.0
        while (done := os.waitpid(child, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(child, 9)
                os.waitpid(child, 0)
                raise AssertionError("the forked child hung collecting the dropped store")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        gc.enable()

