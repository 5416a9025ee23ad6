"""The job's event history under ``events/``: what happened, when, to whom.

Every writer (a node id) owns a ring of :data:`EVENTS_PER_WRITER` keys,
``events/<node_id>/<slot>``, and writes each event into the next slot,
overwriting the one written a ring's length before, so the history is bounded
at all times: a thousand nodes cannot fill
etcd's quota between two prunes. :func:`read_events` sorts the rings into one
history by time; :func:`prune` trims it further (the rings of departed
writers stay until then).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, fields

from elastic.clock import Clock
from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.records import (
    cap_text,
    id_field,
    int_field,
    load_object,
    time_field,
    typed_field,
)
from elastic.store.api import Delete, KeyValue, Put, Store

log = logging.getLogger(__name__)

EVENTS_PER_WRITER = 64
MAX_EVENTS = 1000  # what prune keeps by default

# Kinds of events, each written in one place and read back by ``elasticctl
# report`` (agent/report_reading.py): the leader's new round and the job's end,
# an agent's lifecycle transition, a revoked lease, a rank named as slow.
# (Checkpoints: elastic.checkpoint.etcd_log.EVENT_KIND; GPU checks:
# agent.gpu_health.EVENT_KINDS.)
KIND_ROUND = "round"
KIND_OUTCOME = "outcome"
KIND_STATE = "state"
KIND_FROZEN = "frozen"
KIND_STRAGGLER = "straggler"


@dataclass(frozen=True)
class Event:
    """One entry of the history. ``message`` is made printable and capped at
    MAX_REASON_CHARS on construction (``kind`` at 64 characters), so no event
    written or read can be large or drive a terminal, whatever it quotes."""

    time: float  # wall-clock seconds
    node_id: str
    round: int
    kind: str  # e.g. "round", "state", "failure", "request"
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", cap_text(self.message))
        object.__setattr__(self, "kind", cap_text(self.kind, 64))

    def to_json(self) -> bytes:
        # Not dataclasses.asdict, which deep-copies every field on the way.
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Event":
        """Parse the event at ``key``. Raises MalformedRecordError naming the key
        and the field when a field is missing or mistyped, ``time`` is not
        finite, ``node_id`` is not a valid id or ``round`` is negative."""
        obj = load_object(key, raw)
        return cls(
            time=time_field(key, obj, "time"),
            node_id=id_field(key, obj, "node_id"),
            round=int_field(key, obj, "round", 0),
            kind=typed_field(key, obj, "kind", str),
            message=typed_field(key, obj, "message", str),
        )


class WriterSlots:
    """The next ring slot of each (job, node) writing from one process.

    One is shared by everything in the process that writes as one node (the
    agent and its rendezvous: :func:`event_op`'s default), so they never
    overwrite each other's newest events. A new one is what a restarted
    process has: its first slot follows the wall clock, not slot 0.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[tuple[str, str], int] = {}

    def take(self, job_id: str, node_id: str, now: float) -> int:
        """The slot for ``node_id``'s next event in ``job_id`` at wall time ``now``."""
        with self._lock:
            # A restarted agent starts where the wall clock points rather than at
            # slot 0, so an agent that restarts often does not overwrite the same
            # few slots each time and leave the rest of its ring stale forever.
            slot = self._next.get((job_id, node_id), int(now) % EVENTS_PER_WRITER)
            self._next[(job_id, node_id)] = (slot + 1) % EVENTS_PER_WRITER
            return slot


_SLOTS = WriterSlots()


def event_op(keys: JobKeys, clock: Clock, node_id: str, round_number: int, kind: str,
             message: str, slots: WriterSlots | None = None) -> Put:
    """A Put that records one event in ``node_id``'s ring (overwriting its oldest
    event once the ring is full); put it in the transaction whose effect it
    describes, so the history never claims what did not happen. ``message`` is
    capped at MAX_REASON_CHARS (by :class:`Event`). ``slots``: whose ring
    positions to take (None: this process's)."""
    now = clock.wall()
    event = Event(time=now, node_id=node_id, round=round_number, kind=kind, message=message)
    slot = (_SLOTS if slots is None else slots).take(keys.job_id, node_id, now)
    return Put(f"{keys.events}{node_id}/{slot:04d}", event.to_json())


def parse_events(keys: JobKeys, kvs: list[KeyValue]) -> tuple[list[tuple[str, Event]], list[str]]:
    """(key, event) of each readable event in ``kvs``, in their order, and the
    keys of the unreadable ones (each logged once, as skipped)."""
    parsed, unreadable = [], []
    for kv in kvs:
        try:
            parsed.append((kv.key, Event.from_json(kv.key, kv.value)))
        except MalformedRecordError as exc:
            log.warning("Skipping an unreadable event of job %s: %s", keys.job_id, exc)
            unreadable.append(kv.key)
    return parsed, unreadable


def _parse_all(store: Store, keys: JobKeys) -> tuple[list[tuple[str, Event]], list[str]]:
    """(key, event) of every readable event, oldest first, and the unreadable keys."""
    parsed, unreadable = parse_events(keys, store.get_prefix(keys.events)[0])
    parsed.sort(key=lambda item: (item[1].time, item[1].node_id))
    return parsed, unreadable


def read_events(store: Store, keys: JobKeys) -> list[Event]:
    """The job's history sorted by (time, node id), oldest first; malformed
    entries are logged and skipped."""
    return [event for _, event in _parse_all(store, keys)[0]]


def prune(store: Store, keys: JobKeys, keep: int = MAX_EVENTS) -> int:
    """Delete all but the newest ``keep`` events, and every unreadable one;
    returns how many were deleted. Live writers' rings bound themselves: this
    is for the rings that departed nodes leave behind."""
    parsed, unreadable = _parse_all(store, keys)
    excess = unreadable + [key for key, _ in parsed[: max(0, len(parsed) - keep)]]
    # etcd refuses transactions of more than 128 operations (--max-txn-ops).
    for start in range(0, len(excess), 100):
        store.txn([], [Delete(key) for key in excess[start : start + 100]])
    return len(excess)
