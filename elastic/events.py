"""The job's event history under ``events/``: what happened, when, to whom.

Keys sort by time (``events/<wall ns>-<node_id>``), so a prefix read returns
the history in order. The history is bounded: :func:`prune` keeps the newest
``MAX_EVENTS``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from elastic.clock import Clock
from elastic.errors import MalformedRecordError
from elastic.rendezvous.keys import JobKeys
from elastic.store.api import Delete, Put, Store

log = logging.getLogger(__name__)

MAX_EVENTS = 1000


@dataclass(frozen=True)
class Event:
    time: float  # wall-clock seconds
    node_id: str
    round: int
    kind: str  # e.g. "round", "state", "failure", "request"
    message: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Event":
        try:
            obj = json.loads(raw)
            return cls(
                time=float(obj["time"]),
                node_id=str(obj["node_id"]),
                round=int(obj["round"]),
                kind=str(obj["kind"]),
                message=str(obj["message"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedRecordError(key, f"not an event ({exc})") from exc


def event_op(keys: JobKeys, clock: Clock, node_id: str, round_number: int, kind: str,
             message: str) -> Put:
    """A Put that records one event; put it in the transaction whose effect it
    describes, so the history never claims what did not happen."""
    now = clock.wall()
    event = Event(time=now, node_id=node_id, round=round_number, kind=kind, message=message)
    return Put(f"{keys.events}{int(now * 1e9):020d}-{node_id}", event.to_json())


def read_events(store: Store, keys: JobKeys) -> list[Event]:
    """The job's history, oldest first; malformed entries are logged and skipped."""
    kvs, _ = store.get_prefix(keys.events)
    events = []
    for kv in kvs:
        try:
            events.append(Event.from_json(kv.key, kv.value))
        except MalformedRecordError as exc:
            log.warning("Skipping an unreadable event of job %s: %s", keys.job_id, exc)
    return events


def prune(store: Store, keys: JobKeys, keep: int = MAX_EVENTS) -> int:
    """Delete all but the newest ``keep`` events; returns how many were deleted."""
    kvs, _ = store.get_prefix(keys.events)
    excess = kvs[: max(0, len(kvs) - keep)]
    # etcd refuses transactions of more than 128 operations (--max-txn-ops).
    for start in range(0, len(excess), 100):
        store.txn([], [Delete(kv.key) for kv in excess[start : start + 100]])
    return len(excess)
