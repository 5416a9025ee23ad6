"""The event history stays bounded per writer at all times, and reads back in time order."""

from __future__ import annotations

import uuid

from elastic.events import EVENTS_PER_WRITER, WriterSlots, event_op, prune, read_events
from elastic.keyspace import JobKeys
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore


def fresh_keys() -> JobKeys:
    # Ring positions are kept per (job, node) for the whole process: a job id
    # of its own keeps each test independent of the others.
    return JobKeys("events-" + uuid.uuid4().hex[:8])


def write(store, keys, clock, node_id, n, step_s=1.0):
    for i in range(n):
        store.txn([], [event_op(keys, clock, node_id, i, "state", f"{node_id} event {i}")])
        clock.advance(step_s)


def test_a_thousand_events_from_one_writer_keep_only_its_newest_ring():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)

    write(store, keys, clock, "a", 1000)

    kvs, _ = store.get_prefix(keys.events)
    assert len(kvs) == EVENTS_PER_WRITER
    assert all(kv.key.startswith(keys.events + "a/") for kv in kvs)
    history = read_events(store, keys)
    assert [e.message for e in history] == [f"a event {i}"
                                            for i in range(1000 - EVENTS_PER_WRITER, 1000)]


def test_writers_interleave_in_time_order_each_within_its_own_ring():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)

    for i in range(3 * EVENTS_PER_WRITER):
        for node_id in ("b", "a"):  # same time for both: node id breaks the tie
            store.txn([], [event_op(keys, clock, node_id, i, "state", f"{node_id}{i}")])
        clock.advance(1.0)

    history = read_events(store, keys)
    assert len(store.get_prefix(keys.events)[0]) == 2 * EVENTS_PER_WRITER
    newest = range(2 * EVENTS_PER_WRITER, 3 * EVENTS_PER_WRITER)
    assert [e.message for e in history] == [f"{n}{i}" for i in newest for n in ("a", "b")]


def test_a_restarted_writer_does_not_start_at_slot_zero_every_time():
    clock, keys = FakeClock(), fresh_keys()
    first_slots = []
    for _ in range(3):
        process = WriterSlots()  # a new agent process
        first_slots.append(event_op(keys, clock, "a", 1, "state", "started", process).key)
        clock.advance(17)

    assert all(key.startswith(keys.events + "a/") for key in first_slots)
    assert len(set(first_slots)) == 3


def test_prune_keeps_the_newest_across_writers_and_drops_unreadable_entries():
    clock, keys = FakeClock(), fresh_keys()
    store = MemoryStore(clock=clock)
    write(store, keys, clock, "gone", 10)
    write(store, keys, clock, "live", 5)
    store.put(keys.events + "junk", b"{not json")

    assert prune(store, keys, keep=5) == 11

    assert [e.message for e in read_events(store, keys)] == [f"live event {i}" for i in range(5)]
    assert len(store.get_prefix(keys.events)[0]) == 5
