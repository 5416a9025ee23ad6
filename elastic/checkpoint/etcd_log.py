"""EtcdCommitLog: the commit log as the job's ``checkpoint/latest`` key in etcd.

A commit advances ``checkpoint/latest`` and records a ``checkpoint`` event in
one transaction fenced by the entry's round (:func:`elastic.fence.fenced_txn`):
it takes effect only while ``entry.round`` is the job's current round, so a
worker of an older round (a zombie that outlived its group) can never make its
checkpoint the latest, and the history never claims a commit that did not
happen. A failed save that a worker reports (:meth:`EtcdCommitLog.report_failure`)
becomes a ``checkpoint`` event too, naming the checkpoint that stays. This is
the log the agent keeps for its workers (they reach it through
:class:`elastic.checkpoint.agent_log.AgentCommitLog`).

Imports without torch, like the rest of the control plane's checkpoint code.
"""

from __future__ import annotations

import json
import logging

from elastic.checkpoint.api import CommitEntry, CommitLog, failure_message
from elastic.clock import Clock
from elastic.errors import CheckpointError, ElasticError, FencedError, MalformedRecordError
from elastic.events import event_op
from elastic.fence import current_round_number, fenced_txn
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.records import load_object
from elastic.store.api import Put, Store

log = logging.getLogger(__name__)

EVENT_KIND = "checkpoint"
# A failure report is written from a gRPC thread the worker waits on: keep it short.
REPORT_TIMEOUT_S = 2.0


class EtcdCommitLog(CommitLog):
    """The job's latest committed checkpoint, fenced by the job's round.

    ``writer`` names who commits (the node id) in the event history and in
    the log lines (``job J node N round R: ...``, R the entry's round);
    ``clock`` dates the events.
    """

    def __init__(self, store: Store, keys: JobKeys, clock: Clock, writer: str):
        self.store = store
        self.keys = keys
        self.clock = clock
        self.writer = writer
        self._log = JobLogger(log, keys.job_id, writer)

    def commit(self, entry: CommitEntry, *, fence_round: int | None = None) -> None:
        """Make ``entry`` the latest, with a ``checkpoint`` event, in one transaction.

        It succeeds only while ``fence_round`` (default: ``entry.round``) is the
        job's current round (the version of the ``round`` key; round 0 means no
        round has been committed yet). The record keeps ``entry.round``, the
        round the saving workers were started in: the round a restore compares
        with its memory snapshots' (a round written again, ``Round.continues``,
        fences its workers' commits under its own number). Raises
        :class:`FencedError` naming the rounds when the fence fails (older or
        newer alike): then neither the record nor the event is written. Raises
        the store's errors (:class:`elastic.errors.StoreError`) otherwise; the
        transaction is never retried, since it may have taken effect.
        """
        fence = entry.round if fence_round is None else fence_round
        record = encode_latest(entry)
        committed = f"checkpoint of step {entry.step} committed ({entry.path})"
        event = event_op(self.keys, self.clock, self.writer, fence, EVENT_KIND, committed)
        result = fenced_txn(self.store, self.keys, fence,
                            [Put(self.keys.checkpoint_latest, record), event])
        if not result.succeeded:
            current = current_round_number(result)
            raise FencedError(
                f"job {self.keys.job_id}: the commit of checkpoint step {entry.step} by "
                f"{self.writer} in round {fence} was refused: the current round is "
                f"{current}")
        self._log.at_round(fence).info("%s", committed)

    def report_failure(self, step: int, round_: int, rank: int, message: str) -> None:
        """Record a worker's failed save of ``step`` as a ``checkpoint`` event of
        ``round_`` that names the latest committed checkpoint (which stays).

        Not fenced: a failure happened whatever the round is now. Never raises:
        a store error or an unreadable latest record is logged as a warning
        (the event is then lost; training goes on either way).
        """
        try:
            text = failure_message(step, rank, message, self.latest(REPORT_TIMEOUT_S))
            self.store.txn([], [event_op(self.keys, self.clock, self.writer, round_, EVENT_KIND,
                                         text)], timeout_s=REPORT_TIMEOUT_S)
        except ElasticError as exc:
            self._log.at_round(round_).warning(
                "the failed save of checkpoint step %d (%s) could not be recorded in the "
                "job's events: %s", step, message, exc)
            return
        self._log.at_round(round_).warning("%s.", text)

    def latest(self, timeout_s: float | None = None) -> CommitEntry | None:
        """The recorded entry, or None when nothing was committed yet
        (``timeout_s``: the store's request timeout unless given).

        Raises :class:`MalformedRecordError` (naming the key) when the record
        is not JSON or not a commit entry: unlike the file log, this key is
        only ever written whole by :meth:`commit`, so garbage there is a bug
        or a hand edit that must not pass for "no checkpoint". Raises the
        store's errors otherwise.
        """
        kv = self.store.get(self.keys.checkpoint_latest, timeout_s=timeout_s)
        return None if kv is None else decode_latest(kv.key, kv.value)


def encode_latest(entry: CommitEntry) -> bytes:
    """The ``checkpoint/latest`` record: the one codec, with :func:`decode_latest`."""
    return json.dumps(entry.to_dict(), sort_keys=True).encode()


def decode_latest(key: str, raw: bytes) -> CommitEntry:
    """Parse a ``checkpoint/latest`` record; MalformedRecordError naming ``key``
    if it is not a JSON object (or larger than MAX_RECORD_BYTES) or not a
    valid commit entry (its ``path`` a plain directory name: see
    :meth:`CommitEntry.from_dict`)."""
    obj = load_object(key, raw)
    try:
        return CommitEntry.from_dict(obj)
    except CheckpointError as exc:
        raise MalformedRecordError(key, f"not a checkpoint commit record ({exc})") from exc
