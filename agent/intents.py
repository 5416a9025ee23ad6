"""What the agent must get into etcd: its intents, and its drain request.

Commands that must reach etcd exactly once (restart requests, reports to the
leader) are intents: kept in order and sent on every pass of the loop until
etcd takes them, and dropped once a newer round has made them moot. Nothing
the agent must do is lost to a transient etcd error, and a stop of the
workers never waits on etcd. Each call is short (a fraction of the lease
TTL): a node cut off from etcd must keep judging its lease and its workers.
"""

from __future__ import annotations

import logging

from agent import reactor
from elastic.errors import MalformedRecordError, StoreError
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import DrainRequest
from elastic.rendezvous.node import RendezvousNode
from elastic.store.api import Store

log = logging.getLogger(__name__)

Intent = reactor.RequestRestart | reactor.Report


class Intents:
    """The intents not yet taken by etcd, in order."""

    def __init__(self, rdzv: RendezvousNode, timeout_s: float):
        self._rdzv = rdzv
        self._timeout_s = timeout_s
        self._pending: list[Intent] = []
        self._lease: int | None = None  # the lease the reports were made under

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, intent: Intent) -> None:
        self._pending.append(intent)

    def try_now(self, view: reactor.AgentView, timeout_s: float) -> None:
        """:meth:`flush` with each call bounded by ``timeout_s``. What etcd
        does not take so soon stays pending for the next flush."""
        try:
            self.flush(view, timeout_s)
        except StoreError as exc:
            log.debug("intents wait for the next flush: %s", exc)

    def flush(self, view: reactor.AgentView, timeout_s: float | None = None) -> None:
        """Send the pending intents in order, after those a new lease needs
        again (:func:`agent.reactor.reports_for_new_lease`); drop those a
        newer round has made moot. Each call is bounded by ``timeout_s``
        (default: the one given at construction). Raises StoreError at the
        first that etcd does not take (it and those after it are kept)."""
        timeout_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        lease = self._rdzv.lease_id
        if lease is not None and lease != self._lease:
            self._lease = lease
            self._pending += reactor.reports_for_new_lease(view)
        latest = self._rdzv.placed_round
        # About the round a newer one continues (Round.continues): still current.
        newest = latest.workers_round if latest else 0
        self._pending = [i for i in self._pending if i.round >= newest]
        while self._pending:
            intent = self._pending[0]
            if isinstance(intent, reactor.RequestRestart):
                self._rdzv.request_restart(intent.reason, intent.round, failure=intent.failure,
                                           timeout_s=timeout_s)
            else:
                self._rdzv.report(intent.kind, intent.round, intent.about,
                                  silent_s=intent.silent_s, timeout_s=timeout_s)
            self._pending.pop(0)


class DrainKey:
    """This node's drain request in etcd: read when a round leaves this node
    out, written before its workers stop for a drain (its peers' failures are
    then the drain's doing), removed once it has left and, in case an earlier
    agent of this node could not remove it, when an agent starts."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, timeout_s: float,
                 log: logging.LoggerAdapter):
        self._store = store
        self._key = keys.drain_request(node_id)
        self._node_id = node_id
        self._timeout_s = timeout_s
        self._log = log

    def requested(self) -> bool:
        """Whether etcd holds a valid drain request for this node (garbage at
        the key is logged and drains nothing, as the leader ignores it too).
        Raises StoreError."""
        kv = self._store.get(self._key, timeout_s=self._timeout_s)
        if kv is None:
            return False
        try:
            DrainRequest.from_json(kv.key, kv.value)
        except MalformedRecordError as exc:
            self._log.warning("ignoring %s", exc)
            return False
        return True

    def announce(self, reason: str) -> None:
        """Write this node's drain request (best effort: without it, leaving
        still works, by the lease's revocation)."""
        try:
            self._store.put(self._key, DrainRequest(by=self._node_id, reason=reason).to_json(),
                            timeout_s=self._timeout_s)
        except StoreError as exc:
            self._log.warning("could not record the drain (leaving anyway): %s", exc)

    def withdraw(self) -> None:
        """Remove this node's drain request, if any (best effort)."""
        try:
            self._store.delete(self._key, timeout_s=self._timeout_s)
        except StoreError as exc:
            self._log.warning("could not remove the drain request: %s", exc)
