"""EtcdCommitLog: the commit log as the job's ``checkpoint/latest`` key in etcd.

A commit advances ``checkpoint/latest`` and records a ``checkpoint`` event in
one transaction fenced by the entry's round (:func:`elastic.fence.fenced_txn`):
it takes effect only while ``entry.round`` is the job's current round, so a
worker of an older round (a zombie that outlived its group) can never make its
checkpoint the latest, and the history never claims a commit that did not
happen. This is the log the agent keeps for its workers (they reach it through
:class:`elastic.checkpoint.agent_log.AgentCommitLog`).

Imports without torch, like the rest of the control plane's checkpoint code.
"""

from __future__ import annotations

import json
import logging

from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.clock import Clock
from elastic.errors import CheckpointError, FencedError, MalformedRecordError
from elastic.events import event_op
from elastic.fence import current_round_number, fenced_txn
from elastic.keyspace import JobKeys
from elastic.store.api import Put, Store

log = logging.getLogger(__name__)

EVENT_KIND = "checkpoint"


class EtcdCommitLog(CommitLog):
    """The job's latest committed checkpoint, fenced by the job's round.

    ``writer`` names who commits (the node id) in the event history; ``clock``
    dates the events.
    """

    def __init__(self, store: Store, keys: JobKeys, clock: Clock, writer: str):
        self.store = store
        self.keys = keys
        self.clock = clock
        self.writer = writer

    def commit(self, entry: CommitEntry) -> None:
        """Make ``entry`` the latest, with a ``checkpoint`` event, in one transaction.

        It succeeds only while ``entry.round`` is the job's current round (the
        version of the ``round`` key; round 0 means no round has been
        committed yet). Raises :class:`FencedError` naming the entry's round
        and the current one when it is not (older or newer alike): then
        neither the record nor the event is written. Raises the store's
        errors (:class:`elastic.errors.StoreError`) otherwise; the
        transaction is never retried, since it may have taken effect.
        """
        record = encode_latest(entry)
        event = event_op(self.keys, self.clock, self.writer, entry.round, EVENT_KIND,
                         f"checkpoint of step {entry.step} committed ({entry.path})")
        result = fenced_txn(self.store, self.keys, entry.round,
                            [Put(self.keys.checkpoint_latest, record), event])
        if not result.succeeded:
            current = current_round_number(result)
            raise FencedError(
                f"job {self.keys.job_id}: the commit of checkpoint step {entry.step} by "
                f"{self.writer} in round {entry.round} was refused: the current round is "
                f"{current}")
        log.info("Job %s node %s round %d: checkpoint step %d committed (%s).",
                 self.keys.job_id, self.writer, entry.round, entry.step, entry.path)

    def latest(self) -> CommitEntry | None:
        """The recorded entry, or None when nothing was committed yet.

        Raises :class:`MalformedRecordError` (naming the key) when the record
        is not JSON or not a commit entry: unlike the file log, this key is
        only ever written whole by :meth:`commit`, so garbage there is a bug
        or a hand edit that must not pass for "no checkpoint". Raises the
        store's errors otherwise.
        """
        kv = self.store.get(self.keys.checkpoint_latest)
        return None if kv is None else decode_latest(kv.key, kv.value)


def encode_latest(entry: CommitEntry) -> bytes:
    """The ``checkpoint/latest`` record: the one codec, with :func:`decode_latest`."""
    return json.dumps(entry.to_dict(), sort_keys=True).encode()


def decode_latest(key: str, raw: bytes) -> CommitEntry:
    """Parse a ``checkpoint/latest`` record; MalformedRecordError naming ``key`` if invalid."""
    try:
        return CommitEntry.from_dict(json.loads(raw))
    except (ValueError, CheckpointError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedRecordError(key, f"not a checkpoint commit record ({exc})") from exc
