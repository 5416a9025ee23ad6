"""Ending the lease of a frozen member: the I/O around the freeze rule.

The rule is :func:`elastic.rendezvous.decisions.revoke_frozen`. A
:class:`FrozenRevoker` feeds it a ``frozen/`` report, checks the reported
node itself when the rule asks (its ``probe``), and carries out a revocation
as one fenced transaction followed by the revocation of the lease:

1. The transaction holds only while the job is still in the reported round
   and the decider still may decide: the leader still leads and the node's
   registration is the one reported (a member revoking the leader: the
   leader key still names it). It marks the report confirmed (the leader's
   fence then skips the node), records a ``frozen`` event, and reads the key
   that carries the node's lease.
2. Revoking that lease deletes every key under it (registration, status,
   leadership), so the node is lost as if its lease had expired, and the
   usual path forms the next round. When the node thaws, its keep-alive finds
   the lease gone and it fail-stops its workers before it registers again.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from elastic import events
from elastic.clock import Clock
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.rendezvous import decisions
from elastic.rendezvous.api import FrozenReport, Round
from elastic.rendezvous.config import RendezvousConfig
from elastic.store.api import Compare, Get, Put, Store

# Whether the agent at an address answers a health check now (within a short
# deadline); never raises.
Probe = Callable[[str], bool]


@dataclasses.dataclass(frozen=True)
class Target:
    """Whom a revocation is about, and the compares that must hold for it:
    a member seen by the leader (its registration key and revision), or the
    leader seen by a member (the leader key naming it)."""

    node_id: str
    addr: str
    lease_key: str  # the key whose lease is the node's
    holds: tuple[Compare, ...]


class FrozenRevoker:
    """Applies the freeze rule for one node (the decider); used by its
    rendezvous loop thread only."""

    def __init__(self, store: Store, config: RendezvousConfig, node_id: str, clock: Clock,
                 log: JobLogger, probe: Probe | None,
                 lease: Callable[[], tuple[int | None, float | None]]):
        """``lease``: this node's live lease id and when etcd last confirmed it
        (monotonic; None, None without a session). Without ``probe`` no
        report another node made is ever confirmed here."""
        self.store = store
        self.config = config
        self.keys = JobKeys(config.job_id)
        self.node_id = node_id
        self._clock = clock
        self._log = log
        self._probe = probe
        self._lease = lease
        self._checked: set[tuple[str, FrozenReport]] = set()  # answered this node's check

    def member(self, node_id: str, addr: str, registered_revision: int,
               leading: Compare) -> Target:
        """A member as the leader sees it: ``leading`` holds while it leads."""
        key = self.keys.node(node_id)
        return Target(node_id, addr, key,
                      (leading, Compare.create_revision(key, "==", registered_revision)))

    def leader(self, node_id: str) -> Target:
        """The leader ``node_id``, as a member that reported it sees it."""
        return Target(node_id, "", self.keys.leader,
                      (Compare.value(self.keys.leader, "==", node_id.encode()),))

    def consider(self, target: Target, report: FrozenReport, current: Round | None,
                 others: int) -> tuple[FrozenReport, int] | None:
        """Apply the freeze rule to ``report`` about ``target`` (``others``:
        the nodes that could form a round without it); revoke when it says
        so. Returns the report as confirmed and the revision it was written
        at when this call revoked the lease, else None. Raises the store's
        errors (the caller retries on its next pass)."""
        lease_id, confirmed_at = self._lease()
        now = self._clock.monotonic()
        unconfirmed = float("inf") if confirmed_at is None else max(0.0, now - confirmed_at)
        if (target.node_id, report) in self._checked:
            return None
        verdict = self._verdict(target, report, current, None, unconfirmed, others)
        if verdict.check:
            answered = self._probe is None or not target.addr or self._probe(target.addr)
            verdict = self._verdict(target, report, current, answered, unconfirmed, others)
            if answered:
                self._checked.add((target.node_id, report))
                self._log.info("%s", verdict.reason)
        if not verdict.revoke or lease_id is None:
            return None
        return self._revoke(target, report, current, verdict.reason, lease_id)

    def _verdict(self, target: Target, report: FrozenReport, current: Round | None,
                 answered: bool | None, unconfirmed_s: float,
                 others: int) -> decisions.RevokeVerdict:
        return decisions.revoke_frozen(target.node_id, report, current, decider=self.node_id,
                                       decider_answered=answered,
                                       lease_unconfirmed_s=unconfirmed_s, others=others,
                                       config=self.config)

    def _revoke(self, target: Target, report: FrozenReport, current: Round, reason: str,
                lease_id: int) -> tuple[FrozenReport, int] | None:
        confirmed = dataclasses.replace(report, confirmed_by=self.node_id)
        number = current.number
        result = self.store.txn(
            [Compare.version(self.keys.round, "==", number), *target.holds],
            [Put(self.keys.frozen_report(target.node_id), confirmed.to_json(), lease=lease_id),
             Get(target.lease_key),
             events.event_op(self.keys, self._clock, self.node_id, number, events.KIND_FROZEN,
                             reason)])
        if not result.succeeded:
            self._log.info("not revoking the lease of %s: the round, its registration or the "
                           "leadership changed meanwhile", target.node_id)
            return None
        kvs = result.results[1]
        if not kvs or not kvs[0].lease:
            return None
        self.store.revoke_lease(kvs[0].lease)
        self._log.warning("%s", reason.replace("revoking", "revoked", 1))
        return confirmed, result.revision
