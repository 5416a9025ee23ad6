"""Leading a job's rendezvous: the leader's view, its decisions, its commits.

The leader alone follows ``nodes/``, ``requests/`` and ``checkpoint/latest``
(its :class:`~elastic.rendezvous.view.LeaderView`, fed by the follower's
table through :meth:`Leader.parts`), hands what it sees to the pure
:func:`~elastic.rendezvous.decisions.decide` and commits a new ``round``
record with :func:`elastic.fence.fenced_txn` on the round key's version (the
round number: the fencing token) and its own leadership, so a deposed leader
or a stale view can never overwrite a newer round. It also publishes the
``standbys`` record. The timed rules of its own waits (the fence on lost
members, resigning after a failed takeover) are pure functions in
:mod:`elastic.rendezvous.decisions`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from elastic import events
from elastic.clock import Clock
from elastic.fence import current_round_number, fenced_txn
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.rendezvous import decisions, round_record
from elastic.rendezvous.api import Member, Outcome, Round, Standbys
from elastic.rendezvous.committed import CommittedRound
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.decisions import Action, Decision
from elastic.rendezvous.election import Election
from elastic.rendezvous.follower import BadRecords, Part, value_of
from elastic.rendezvous.inbox import PartName
from elastic.rendezvous.revoke import FrozenRevoker
from elastic.rendezvous.view import LeaderView
from elastic.store.api import Delete, EventType, KeyValue, Store, WatchEvent

# How often a leader asks lost members again whether their workers stopped.
FENCE_RETRY_S = 0.25
# Served restart requests deleted with one commit, at most.
_SERVED_PER_COMMIT = 100

# Tells the agents at these addresses that the leader reaches etcd; True once
# none of them runs workers any more (see decisions.fence_lost_members).
Fence = Callable[[tuple[str, ...]], bool]


class Leader:
    """The leading half of one node; used by its loop thread only."""

    def __init__(self, store: Store, config: RendezvousConfig, node_id: str, clock: Clock,
                 rounds: CommittedRound, read_round: Callable[[], None],
                 report_bad: BadRecords, log: JobLogger, fence: Fence | None = None,
                 revoker: FrozenRevoker | None = None):
        self.store = store
        self.config = config
        self.keys = JobKeys(config.job_id)
        self.node_id = node_id
        self.election = Election(store, self.keys, node_id,
                                 round_of=lambda: rounds.latest.number if rounds.latest else 0)
        self._clock = clock
        self._rounds = rounds
        self._read_round = read_round
        self._report_bad = report_bad
        self._log = log
        self._fence = fence
        self._revoker = revoker
        self.leading = False  # leader with its view loaded and watched
        self.view = LeaderView(self.keys, report_bad)
        self._standbys_written: Standbys | None = None  # as this node last wrote it
        self._last_reason = ""
        self._fencing_since: float | None = None
        self._takeover_failing_since: float | None = None
        self._campaign_after = 0.0  # monotonic; set after resigning

    # ------------------------------------------------------- leadership

    def campaign(self, lease_id: int) -> str | None:
        """Campaign unless this node resigned less than a TTL ago; returns who
        leads now (None: nobody yet, or not campaigning)."""
        if self._clock.monotonic() < self._campaign_after:
            return None
        holder = self.election.campaign(lease_id)
        if holder == self.node_id:
            self._log.info("elected leader")
        return holder

    def took_over(self) -> None:
        """The view is loaded and watched: this node leads from now on."""
        self.leading = True
        self._takeover_failing_since = None

    def takeover_failed(self) -> decisions.TakeoverVerdict:
        """A leader that cannot load its view keeps trying; the verdict says
        when it steps down (see decisions.takeover_failed, and :meth:`resign`)."""
        verdict = decisions.takeover_failed(self._takeover_failing_since,
                                            self._clock.monotonic(), self.config.lease_ttl_s)
        self._takeover_failing_since = verdict.failing_since
        if verdict.resign:
            self._log.warning("%s", verdict.reason)
        return verdict

    def resign(self, campaign_after: float) -> bool:
        """Give up the leader key so a node that can lead wins; campaign again
        only from ``campaign_after``. Returns whether this node held the key."""
        if not self.election.resign():
            return False
        self._campaign_after = campaign_after
        return True

    def step_down(self) -> None:
        """Forget the view (the follower stops its watches)."""
        self.leading = False
        self._standbys_written = None
        self.view = LeaderView(self.keys, self._report_bad)

    def parts(self) -> tuple[Part, ...]:
        """The follower's rows for the parts only the leader follows."""
        keys = self.keys
        return (
            Part(PartName.NODES, keys.nodes, True, True, self._load_nodes, self._apply_nodes),
            Part(PartName.REQUESTS, keys.requests, True, True, self._load_requests,
                 self._apply_requests),
            Part(PartName.CHECKPOINT, keys.checkpoint_latest, False, True,
                 self._load_checkpoint, self._apply_checkpoint),
        )

    # ------------------------------------------------------------ leading

    def lead(self) -> float | None:
        """Decide and apply; returns when to look again if nothing changes."""
        now = self._clock.wall()
        current = self._rounds.latest
        version = self._rounds.version
        if current is not None and not current.outcome and version > current.number:
            return None if self._continue_round(current) else now + FENCE_RETRY_S
        self._revoke_frozen(current)
        decision = decisions.decide(self.view.observed(current, self._rounds.revision), now,
                                    self.config)
        if decision.reason != self._last_reason:
            self._log.info("leader: %s", decision.reason)
            self._last_reason = decision.reason
        for node_id in decision.suspects:
            registered = self.view.nodes.get(node_id, (None, 0))[1]
            self.view.suspect(node_id, now, registered + 1)
        if decision.action is Action.CLOSE_ROUND:
            if not self._fence_lost(current):
                return now + FENCE_RETRY_S
            # A commit that lost its fence re-read the round: decide again on
            # what it read, even if no watch event comes to say it changed.
            return None if self._commit_round(decision) else now + FENCE_RETRY_S
        if decision.action in (Action.FAIL_JOB, Action.SUCCEED_JOB) and current is not None:
            outcome = Outcome.FAILED if decision.action is Action.FAIL_JOB else Outcome.SUCCEEDED
            return None if self._end_job(current, outcome, decision) else now + FENCE_RETRY_S
        return decision.wake_at

    def publish_standbys(self, lease_id: int) -> None:
        """Keep ``standbys`` up to date (under the leader's lease: a new leader
        rewrites it). Not fenced: it only says whom to ask about etcd."""
        current = self._rounds.latest
        members = frozenset(current.node_ids) if current is not None else frozenset()
        wanted = Standbys(self.view.standby_addrs(members))
        if wanted != self._standbys_written:
            self.store.put(self.keys.standbys, wanted.to_json(), lease=lease_id)
            self._standbys_written = wanted

    def _revoke_frozen(self, current: Round | None) -> None:
        """Revoke the lease of each member the freeze rule finds frozen (see
        :mod:`elastic.rendezvous.revoke`); the deletion of its registration
        then forms the next round."""
        if self._revoker is None or current is None:
            return
        for node_id, report in self.view.frozen_reports().items():
            info, registered = self.view.nodes[node_id]
            target = self._revoker.member(node_id, info.addr, registered, self.election.holds())
            others = len([n for n in self.view.nodes
                          if n != node_id and n not in self.view.draining])
            confirmed = self._revoker.consider(target, report, current, others)
            if confirmed is not None:
                # Known before the watch says so: the fence must skip this node
                # even if its registration's deletion arrives first.
                self.view.frozen[node_id] = (*confirmed, self._clock.wall())

    def _fence_lost(self, current: Round | None) -> bool:
        """Whether the workers of the members ``current`` would leave out
        (their lease expired) stopped, or the leader waited long enough:
        see decisions.fence_lost_members. Members revoked as frozen were
        proven unanswering: not asked."""
        revoked = self.view.revoked_as_frozen(current) if current else frozenset()
        lost = tuple(m.addr for m in (current.members if current else ())
                     if m.node_id not in self.view.nodes and m.node_id not in revoked
                     and m.addr)
        if not lost or self._fence is None:
            return True
        now = self._clock.monotonic()
        verdict = decisions.fence_lost_members(lost, self._fence(lost), self._fencing_since, now,
                                               self.config.lease_ttl_s)
        self._fencing_since = verdict.since
        if verdict.overdue:
            self._log.warning("leader: %s", verdict.reason)
        elif not verdict.proceed:
            self._log.info("leader: %s", verdict.reason)
        return verdict.proceed

    def _commit_round(self, decision: Decision) -> bool:
        """Commit the round ``decision`` closes; False if its fence failed."""
        number = self._rounds.version + 1
        infos = {info.node_id: info for info, _ in self.view.nodes.values()}
        members = tuple(
            Member(node_id=n, node_rank=i, host=infos[n].host, nproc=infos[n].nproc,
                   addr=infos[n].addr, rack=infos[n].rack)
            for i, n in enumerate(decision.members)
        )
        rank0 = infos[decision.members[0]]
        record = Round(
            number=number, members=members, master_addr=rank0.host,
            master_port=rank0.master_port, reason=decision.reason, leader=self.node_id,
            created_at=self._clock.wall(), failures=decision.failures,
        )
        # Served and stale restart requests go in the same transaction: a
        # request is consumed exactly by the round that answers it.
        served = [Delete(k) for k, r in self.view.restarts.items()
                  if r.round <= number - 1][:_SERVED_PER_COMMIT]
        ops = [events.event_op(self.keys, self._clock, self.node_id, number, events.KIND_ROUND,
                               f"round {number} formed with {list(decision.members)}: "
                               f"{decision.reason}")]
        if not self._commit(number, record, ops + served):
            return False
        self._log.info("leader: committed round %d with %s", number, list(decision.members))
        for op in served:
            self.view.restarts.pop(op.key, None)
        if number % 100 == 0:
            events.prune(self.store, self.keys)
        return True

    def _continue_round(self, current: Round) -> bool:
        """A malformed record replaced ``current`` in the round key: write it
        again on top, as a round that continues its workers (the agents keep
        them running), so that a write of garbage restarts nothing. False if
        its fence failed."""
        number = self._rounds.version + 1
        reason = (f"round {current.number} written again: a malformed record replaced it "
                  f"(the workers of round {current.workers_round} run on)")
        record = current.continued(number, reason, self.node_id, self._clock.wall())
        ops = [events.event_op(self.keys, self._clock, self.node_id, number, events.KIND_ROUND,
                               f"round {number}: {reason}")]
        if not self._commit(number, record, ops):
            return False
        self._log.warning("leader: %s; committed as round %d", reason, number)
        return True

    def _end_job(self, current: Round, outcome: Outcome, decision: Decision) -> bool:
        """Commit the job's final round: the current one with an outcome;
        False if its fence failed."""
        number = current.number + 1
        final = dataclasses.replace(current, number=number, outcome=outcome,
                                    reason=decision.reason, leader=self.node_id,
                                    created_at=self._clock.wall(), failures=decision.failures)
        ops = [events.event_op(self.keys, self._clock, self.node_id, number, events.KIND_OUTCOME,
                               f"job {outcome}: {decision.reason}")]
        if not self._commit(number, final, ops):
            return False
        self._log.info("leader: job %s in round %d: %s", outcome, number, decision.reason)
        return True

    def _commit(self, number: int, record: Round, ops: list) -> bool:
        """Write round ``number`` (its head, its roster: see
        :mod:`elastic.rendezvous.round_record`) and ``ops``, fenced by the round
        before it and this node's leadership; apply it at once on success (the
        watch echo is then a no-op)."""
        earlier, with_head, roster = round_record.commit_ops(
            self.keys, record, self._rounds.latest, self._rounds.roster)
        also = [self.election.holds()]
        result = None
        for chunk in earlier:  # a roster too large for the head's transaction
            result = fenced_txn(self.store, self.keys, number - 1, chunk, also=also)
            if not result.succeeded:
                break
        if result is None or result.succeeded:
            result = fenced_txn(self.store, self.keys, number - 1, with_head + ops, also=also)
        if not result.succeeded:
            self._log.info("round %d was not committed (the job is in round %d, or "
                           "leadership moved); re-reading", number,
                           current_round_number(result))
            self._read_round()
            return False
        self._rounds.committed(record, roster, result.revision)
        return True

    # ------------------------------------------------ the leader's parts

    def _load_nodes(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        self.view.reset_nodes(kvs, now)

    def _apply_nodes(self, evs: Sequence[WatchEvent], now: float) -> None:
        for ev in evs:
            left = self.view.apply_node(ev.kv.key, value_of(ev), ev.kv.create_revision, now)
            if left is not None:
                self._log.info("node %s left", left)

    def _load_requests(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        self.view.reset_requests(kvs, now)

    def _apply_requests(self, evs: Sequence[WatchEvent], now: float) -> None:
        for ev in evs:
            self.view.apply_request(ev.kv.key, value_of(ev), ev.kv.mod_revision, now)

    def _load_checkpoint(self, kvs: list[KeyValue], revision: int, now: float) -> None:
        self.view.checkpoint_revision = kvs[0].mod_revision if kvs else 0

    def _apply_checkpoint(self, evs: Sequence[WatchEvent], now: float) -> None:
        for ev in evs:
            self.view.checkpoint_revision = ev.kv.mod_revision if ev.type is EventType.PUT else 0
