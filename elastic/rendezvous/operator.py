"""Operator restarts, at most one per interval for the whole job.

An operator restart (``elasticctl restart``, or ``RequestRestart`` over any
agent's gRPC) asks for a new round with the same members; it never counts
against the restart budget, so nothing else stops a loop (or anyone who
reaches an agent) from restarting the job over and over. The key
``operator-restart`` holds the last one taken (:class:`OperatorRestart`); a
request is written together with it in one transaction that compares the
key's revision, so two requests racing through different agents cannot both
be taken, and a request refused is not written at all.

:func:`decide_operator_restart` is the pure decision (``now`` is wall time:
requests come from different hosts); :func:`request_operator_restart` does the
I/O around it. Agent failures (crashes, hangs, a node cut off from etcd) do
not pass here: they go to the leader directly.

The limit is a guard against accidents and unauthenticated callers, not
against someone who may write the job's keys in etcd: whoever can do that can
write a request without this check.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from elastic.errors import MalformedRecordError, RateLimitedError
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.records import cap_text, int_field, load_object, text_field, time_field
from elastic.rendezvous.api import RestartRequest
from elastic.store.api import Compare, Put, Store

log = logging.getLogger(__name__)

DEFAULT_OPERATOR_RESTART_INTERVAL_S = 60.0
_ATTEMPTS = 3  # a lost race is re-decided on what the winner wrote


@dataclass(frozen=True)
class OperatorRestart:
    """The last operator restart taken: when (wall time), by whom, for which round."""

    at: float
    by: str
    round: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "OperatorRestart":
        """Raises MalformedRecordError naming the key and the field."""
        obj = load_object(key, raw)
        return cls(at=time_field(key, obj, "at"), by=text_field(key, obj, "by"),
                   round=int_field(key, obj, "round", 0))


@dataclass(frozen=True)
class RestartGate:
    """Whether an operator restart may be taken now, from when the next one
    may (wall time; ``now`` when allowed), and why, in an operator's words."""

    allowed: bool
    next_at: float
    reason: str


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


def decide_operator_restart(last: OperatorRestart | None, now: float,
                            interval_s: float) -> RestartGate:
    """Whether an operator restart may be taken at ``now`` (wall seconds),
    given the ``last`` one taken and the minimum ``interval_s`` between two
    (0: no limit).

    A ``last`` more than one interval in the future says a clock was wrong
    (this host's now, or the writer's then): it does not block, or a clock
    step could block restarts for as long as it was wrong.
    """
    if last is None or interval_s <= 0:
        return RestartGate(True, now, "no operator restart limit" if interval_s <= 0
                           else "no operator restart before")
    next_at = last.at + interval_s
    if now >= next_at:
        return RestartGate(True, now, f"the last operator restart was {now - last.at:.0f} s "
                                      f"ago (at least {interval_s:g} s apart)")
    if last.at - now > interval_s:
        return RestartGate(True, now, f"the last operator restart is dated {last.at - now:.0f} s "
                                      "in the future (a clock was wrong): not limiting")
    return RestartGate(
        False, next_at,
        f"an operator restart was taken {max(0.0, now - last.at):.0f} s ago (at {_clock(last.at)} "
        f"by {last.by}, for round {last.round}); the next is allowed from {_clock(next_at)}, "
        f"in {next_at - now:.0f} s (--operator-restart-interval {interval_s:g} s)")


def request_operator_restart(store: Store, keys: JobKeys, request: RestartRequest, *,
                             interval_s: float, now: float,
                             timeout_s: float | None = None) -> RestartGate:
    """Write ``request`` (a restart asked by ``request.node_id``) unless an
    operator restart of the job was taken less than ``interval_s`` before
    ``now`` (wall seconds); returns the gate that let it through.

    Raises:
        RateLimitedError: too soon; the message says since when and from
            when the next is allowed (``next_at``).
        StoreError: etcd did not take it.
    """
    for _ in range(_ATTEMPTS):
        kv = store.get(keys.operator_restart, timeout_s=timeout_s)
        last = None
        if kv is not None:
            try:
                last = OperatorRestart.from_json(kv.key, kv.value)
            except MalformedRecordError as exc:
                # Failing open: a bad record must not block every restart for good.
                JobLogger(log, keys.job_id, request.node_id, lambda: request.round).warning(
                    "ignoring the last operator restart record: %s", exc)
        gate = decide_operator_restart(last, now, interval_s)
        if not gate.allowed:
            raise RateLimitedError(f"restart of job {keys.job_id} refused: {gate.reason}",
                                   gate.next_at)
        taken = OperatorRestart(at=now, by=cap_text(request.node_id, 128), round=request.round)
        compare = (Compare.absent(keys.operator_restart) if kv is None
                   else Compare.mod_revision(keys.operator_restart, "==", kv.mod_revision))
        result = store.txn([compare], [
            Put(keys.operator_restart, taken.to_json()),
            Put(keys.restart_request(request.round, request.node_id), request.to_json())],
            timeout_s=timeout_s)
        if result.succeeded:
            return gate
    raise RateLimitedError(f"restart of job {keys.job_id} refused: other operator restarts "
                           "were being taken at the same time; try again")
