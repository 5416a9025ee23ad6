"""One node's side of the rendezvous: register, elect a leader, follow the rounds.

Protocol (keys in :mod:`elastic.keyspace`):

1. A node opens a session (an etcd lease kept alive) and registers
   ``nodes/<node_id>`` under it with a create-only transaction. If a previous
   agent with the same id still holds it (an agent restarted by systemd
   before its old lease ran out), the node takes the registration over when
   the ``takeover`` check proves that agent gone (same host, its address does
   not answer) by revoking the old lease, and otherwise waits, retrying,
   until the old lease expires.
2. Every node campaigns for ``leader`` (:class:`~elastic.rendezvous.election.Election`).
   The leader alone watches ``nodes/``, ``requests/`` and ``checkpoint/latest``
   (whether a joiner has seen a checkpoint since); followers watch only
   ``leader``, ``round`` and ``standbys``. A round therefore costs O(members) etcd
   operations and events, not O(members^2).
3. The leader feeds what it sees (:class:`~elastic.rendezvous.view.LeaderView`)
   to :func:`elastic.rendezvous.decisions.decide` and commits a new ``round``
   record with :func:`elastic.fence.fenced_txn` on the round key's version
   (the round number: the fencing token) and its own leadership, so a deposed
   leader or a stale view can never overwrite a newer round.
4. Every node sees the committed round through its watch; nodes not in it wait
   as standbys for a later round.
5. Nodes report to the leader under ``requests/``: restart requests, that
   they started a round's workers, that their workers all exited 0 (the exit
   barrier), that a peer's agent does not answer, or answered no probe for
   the freeze timeout (the leader may then revoke its lease:
   :mod:`elastic.rendezvous.revoke`; a node that reports the leader itself
   frozen applies that rule in the leader's place). The job ends with a
   final round record carrying an ``outcome``, written by the leader.

The node is three parts driven by one loop, as etcd's client splits session,
watch and election: :class:`~elastic.rendezvous.membership.Membership`
(session, registration, takeover; step 1), the
:class:`~elastic.rendezvous.follower.Follower` (one table of parts it reads and
watches; steps 2 and 4) and the :class:`~elastic.rendezvous.leader.Leader`
(view, ``decide``, commit; step 3). All I/O happens on one loop thread per
node; watch callbacks only post to its :class:`~elastic.rendezvous.inbox.Inbox`,
and each pass of the loop (:meth:`RendezvousNode.pump`) first applies what
arrived, then brings the node's standing duties up to date: a session,
a registration, a leader, the leader's watches, re-reads after a compaction,
the advertised master port. A duty whose store call fails stays pending and
is tried again on the next pass, so a transient etcd error delays, and never
loses, any of them. A lost session whose lease etcd kept (an outage of etcd
itself) is resumed; a lease etcd dropped means registering again, as a
newcomer.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, NamedTuple

from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    DuplicateNodeError,
    MalformedRecordError,
    RendezvousTimeoutError,
    StoreError,
)
from elastic.fence import fenced_put
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.net import free_port
from elastic.rendezvous import round_record
from elastic.rendezvous.api import (
    FrozenReport,
    NodeInfo,
    Report,
    ReportKind,
    RestartRequest,
    Round,
)
from elastic.rendezvous.committed import CommittedRound
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.follower import BadRecords, Follower
from elastic.rendezvous.inbox import (
    Changed,
    Inbox,
    LeaderFrozen,
    Message,
    PartName,
    SessionLost,
    Stop,
    WatchEnded,
)
from elastic.rendezvous.leader import Fence, Leader
from elastic.rendezvous.membership import Membership, MembershipSettings, Takeover
from elastic.rendezvous.revoke import FrozenRevoker, Probe
from elastic.store.api import Store

__all__ = ["RendezvousNode", "Fence", "Probe", "Takeover", "SESSION_CHECK_S", "SETTLED_CHECK_S"]

log = logging.getLogger(__name__)

# How often the loop passes while a standing duty is undone (a session to
# open, registering, campaigning, a view to read again), even when nothing
# else happens.
SESSION_CHECK_S = 0.5
# Once all are done, only an event, a leader's deadline or the session's loss
# (which posts to the inbox) needs a pass: this is a safety net, not a duty.
SETTLED_CHECK_S = 5.0
# After a store error the thread waits this long before the next pass.
_ERROR_BACKOFF_S = 0.2


class Registration(NamedTuple):
    """``after``: the round number committed when the node registered (rounds up
    to it were formed for an earlier registration of its id), None while it is
    not registered; ``problem``: why it is not registered yet ("" once it is),
    for errors."""

    after: int | None
    problem: str


class RendezvousNode:
    """A node taking part in a job's rendezvous: a :class:`Membership`, a
    :class:`Follower` and a :class:`Leader` driven by one loop.

    Thread-safe: ``wait_for_round`` and friends may be called from any thread
    while the node's loop runs in the background (:meth:`start`), or while a
    simulator drives it with :meth:`pump` (:meth:`start` with ``thread=False``).
    ``job_flag``: the flag its user gave the job id with, as errors name it
    (torchrun's users know ``--rdzv-id``).
    """

    def __init__(
        self,
        store: Store,
        config: RendezvousConfig,
        info: NodeInfo,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_round: Callable[[Round], None] | None = None,
        takeover: Takeover | None = None,
        port_picker: Callable[[str], int] = free_port,
        fence: Fence | None = None,
        running_round: Callable[[], int] = lambda: 0,
        job_flag: str = "--job-id",
        inbox: Inbox | None = None,
        probe: Probe | None = None,
        ready_to_join: Callable[[], bool] = lambda: True,
    ):
        """``on_round``: called on the node's loop thread with each new
        round, which may hold this node's line alone (see
        :attr:`Round.holds_members`; :attr:`latest_round` has the list whole).
        ``inbox``: where watches and the session post (a fresh one unless
        given). ``probe``: whether an agent answers a health check now, for
        the freeze rule (None: this node confirms no report made by another).
        ``ready_to_join``: whether this node could start its workers at once
        (an agent's are warm): a node that joins a job whose round runs
        registers only once it is, since the round that admits it stops every
        member's workers until its own start; with no round running (the
        first round waits for every node anyway) it registers at once."""
        self.store = store
        self.config = config
        self.keys = JobKeys(config.job_id)
        self.clock = clock
        self._inbox = inbox if inbox is not None else Inbox()
        # Lines name the latest committed round this node has seen.
        self.log = JobLogger(log, config.job_id, info.node_id,
                             lambda: self._rounds.latest.number if self._rounds.latest else 0)
        report_bad = BadRecords(self.log)
        self._membership = Membership(
            store, config, info, MembershipSettings(
                takeover, port_picker, running_round, job_flag,
                lambda: not self._rounds.running or ready_to_join()),
            self.log, lambda: self._inbox.post(SessionLost()))
        self._rounds = CommittedRound(
            clock, info.node_id, self.log, report_bad,
            [f for f in (on_round, self._membership.round_committed) if f is not None],
            lambda: round_record.read_round(store, self.keys, round_record.READ_TIMEOUT_S))
        self._follower = Follower(store, self.keys, info.node_id, clock, self._rounds,
                                  self._inbox.post, report_bad, self.log)
        self._revoker = FrozenRevoker(store, config, info.node_id, clock, self.log, probe,
                                      lambda: (self.lease_id, self.lease_confirmed_at))
        self._frozen_leader: LeaderFrozen | None = None  # reported, the rule not yet applied
        self._leader = Leader(store, config, info.node_id, clock, self._rounds,
                              self._follower.read_round, report_bad, self.log, fence,
                              self._revoker)
        self._follower.add_leader_parts(self._leader.parts(), self._leader.step_down)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_at: float | None = None
        self._changed = True  # the leader's picture changed since it last decided

    # ----------------------------------------------------------------- public

    @property
    def node_id(self) -> str:
        return self._membership.node_id

    @property
    def lease_id(self) -> int | None:
        """The lease of this node's live session (None while it has none)."""
        return self._membership.lease_id

    @property
    def lease_confirmed_at(self) -> float | None:
        """Monotonic time etcd last confirmed this node's lease (None: no session)."""
        session = self._membership.session
        return session.confirmed_at if session is not None else None

    @property
    def standby_addrs(self) -> tuple[str, ...]:
        """Agent addresses of the registered nodes outside the round, as the
        leader last published them."""
        return self._follower.standbys.addrs

    @property
    def registered(self) -> bool:
        return self._membership.registered and self.lease_id is not None

    @property
    def registration(self) -> Registration:
        """Where this node's registration stands."""
        return Registration(self._membership.registered_after if self.registered else None,
                            self._membership.problem)

    @property
    def leader_id(self) -> str | None:
        """The node that leads the job as this node last saw (None: nobody)."""
        return self._follower.leader_id

    @property
    def is_leader(self) -> bool:
        return self._follower.is_leader

    @property
    def latest_round(self) -> Round | None:
        """The latest round, every member checked (callers use the list
        whole): a round whose roster fails is refused here, reported, and the
        last round that passed is the latest again. What :meth:`wait_for_round`
        returns had only this node's own line checked."""
        return self._rounds.checked()

    @property
    def placed_round(self) -> Round | None:
        """The latest round as this node runs it: its own line and placement
        (first rank, ring peer, buddy, source) checked, and the rest of the
        list only when it is held anyway (a small job's), so that a node of a
        large job reads its bucket and no more. A round from a bucket of an
        earlier form, which places nobody, is read whole (:attr:`latest_round`).
        Raises the store's errors when it reads."""
        current = self._rounds.latest
        if current is None or current.holds_members:
            return self._rounds.checked()
        try:
            if current.member(self.node_id) is None or current.placement(self.node_id):
                return current
        except MalformedRecordError as exc:
            self.log.warning("round %d: this node's line in its bucket does not read (%s); "
                             "reading the round whole", current.number, exc)
        return self._rounds.checked()

    def start(self, *, thread: bool = True) -> "RendezvousNode":
        """Check the job's settings, try to register, and start following the
        job's rounds (in a background thread, or, with ``thread=False``, in
        :meth:`pump` calls made by the caller).

        Raises ConfigError if the job already runs with other settings,
        JobEndedError if it has ended, and the store errors if etcd cannot be reached. A node id
        still held by another agent does not raise here: see
        :meth:`wait_registered`.
        """
        self._membership.open()
        for part in (PartName.ROUND, PartName.LEADER, PartName.STANDBYS):
            self._follower.resync(part)
        self._membership.try_register()  # knowing whether a round runs
        if thread:
            self._thread = threading.Thread(target=self._run, name=f"rendezvous-{self.node_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Leave the rendezvous: stop the loop, cancel watches, revoke the lease
        (so peers see this node leave at once). Idempotent."""
        self._stopping.set()
        self._inbox.post(Stop())
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._follower.stop()
        self._membership.close()

    def has_news(self) -> bool:
        """Whether something arrived that the loop has not applied yet: what
        wakes the loop's thread before its next timed pass."""
        return self._inbox.has_news()

    def pump(self) -> float | None:
        """Apply everything that arrived, then do one pass of the loop's duties.

        Returns when the node wants to look again if nothing arrives (None:
        only on the next event). The background thread calls this; a
        deterministic simulator calls it instead. Never raises StoreError: a
        failed duty stays pending for the next pass.
        """
        for message in self._inbox.take():
            self._apply(message)
        if self._stopping.is_set():
            return None
        try:
            self._maintain()
            self._revoke_frozen_leader()
            if not (self.is_leader and self._leader.leading):
                self._wake_at = None
            elif self._changed or (self._wake_at is not None
                                   and self.clock.wall() >= self._wake_at):
                # Decide again only when something changed or a deadline came,
                # on a round whose members were all checked (the leader uses them).
                self._rounds.checked()
                self._changed = False
                self._wake_at = self._leader.lead()
                self._leader.publish_standbys(self._membership.session.lease_id)
        except StoreError as exc:
            self._changed = True
            self.log.warning("store error in the rendezvous loop, will retry: %s", exc)
            return self.clock.wall() + _ERROR_BACKOFF_S
        return self._wake_at

    def wait_registered(self, timeout_s: float) -> None:
        """Block until this node is registered. Raises DuplicateNodeError
        naming the live holder when the id is still taken after ``timeout_s``."""
        deadline = self.clock.monotonic() + timeout_s
        while not self.registered and self.clock.monotonic() < deadline:
            self._stopping.wait(0.05)
        if not self.registered:
            raise DuplicateNodeError(
                f"job {self.config.job_id}: {self.registration.problem or 'not registered'} "
                f"after {timeout_s:g} s")

    def wait_for_round(self, after: int = 0, timeout_s: float | None = None) -> Round:
        """Block until a round numbered above ``after`` that includes this node
        is committed, or the job has ended, and return that round (check its
        ``outcome``).

        Raises RendezvousTimeoutError after ``timeout_s`` (default: the join
        timeout), saying what this node saw meanwhile.
        """
        timeout = self.config.join_timeout_s if timeout_s is None else timeout_s

        def wanted(r: Round | None) -> bool:
            return r is not None and (bool(r.outcome) or (
                r.number > after and r.member(self.node_id) is not None))

        r = self._rounds.wait(wanted, timeout, self._stopping)
        if not wanted(r):
            latest = self.latest_round
            seen = (f"latest round {latest.number} has {list(latest.node_ids)}"
                    if latest else "no round has been committed yet")
            raise RendezvousTimeoutError(
                f"job {self.config.job_id}: node {self.node_id} was not included in a round "
                f"after round {after} within {timeout:.1f} s ({seen})"
            )
        return r

    def wait_for_change(self, known: int, timeout_s: float) -> Round | None:
        """Block until a round other than ``known`` is committed, or the
        timeout passes; return the latest round either way."""
        return self._rounds.wait(lambda r: r is not None and r.number != known, timeout_s,
                                 self._stopping)

    def request_restart(self, reason: str, round_number: int, *, failure: bool,
                        timeout_s: float | None = None) -> None:
        """Ask the leader for a new round with the same members. ``failure``
        counts it against the restart budget (a worker crashed or hung).
        Requests about an older round are ignored by the leader. Idempotent
        (one key per node and round); raises the store's errors."""
        req = RestartRequest(node_id=self.node_id, round=round_number, reason=reason,
                             failure=failure)
        self.store.put(f"{self.keys.restart_requests}{round_number:012d}-{self.node_id}",
                       req.to_json(), timeout_s=timeout_s)

    def report(self, kind: ReportKind, round_number: int, about: str | None = None, *,
               silent_s: float = 0.0, timeout_s: float | None = None) -> None:
        """Tell the leader this node started ``round_number``'s workers, that
        they all exited 0, (SUSPECT) that node ``about``'s agent does not
        answer, or (FROZEN) that it answered no probe for ``silent_s``.
        Idempotent; held under this node's lease; raises the store's errors
        (StoreError, or LeaseLostError without a live session)."""
        lease = self.lease_id
        if lease is None:
            raise StoreError(f"node {self.node_id} has no live lease to report under")
        if kind is ReportKind.FROZEN:
            frozen = FrozenReport(round=round_number, by=self.node_id, silent_s=silent_s)
            self.store.put(self.keys.frozen_report(about), frozen.to_json(), lease=lease,
                           timeout_s=timeout_s)
            if about == self.leader_id and not self.is_leader:
                self._inbox.post(LeaderFrozen(about, frozen))
            return
        key = {ReportKind.STARTED: self.keys.started_report,
               ReportKind.DONE: self.keys.done_report,
               ReportKind.SUSPECT: self.keys.suspect_report}[kind](about or self.node_id)
        self.store.put(key, Report(round=round_number, by=self.node_id).to_json(), lease=lease,
                       timeout_s=timeout_s)

    def fenced_put(self, key: str, value: bytes, round_number: int) -> int:
        """Write ``key`` only if ``round_number`` is still the current round.

        Returns the revision of the write; raises FencedError otherwise.
        """
        return fenced_put(self.store, self.keys, key, value, round_number)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self._stopping.is_set():
            wake_at = self.pump()
            settled = self._membership.settled and self._follower.settled
            timeout = SETTLED_CHECK_S if settled else SESSION_CHECK_S
            if wake_at is not None:
                timeout = max(0.0, min(timeout, wake_at - self.clock.wall()))
            if isinstance(self._inbox.wait(timeout), Stop):
                return

    def _apply(self, message: Message) -> None:
        """Apply one message to what this node knows; no store calls (a
        failure here would lose the events)."""
        self._changed = True
        if isinstance(message, Changed):
            self._follower.apply(message, self.clock.wall())
        elif isinstance(message, WatchEnded):
            self._follower.watch_ended(message)
        elif isinstance(message, LeaderFrozen):
            self._frozen_leader = message
        # SessionLost: this pass's _maintain renews it; Stop: pump returns.

    def _revoke_frozen_leader(self) -> None:
        """The freeze rule for the leader this node reported frozen, applied
        here since the leader cannot apply it to itself; dropped once applied
        or once another node leads (kept on a store error, for the next pass)."""
        claim = self._frozen_leader
        if claim is None:
            return
        current = self._rounds.checked()
        if self._follower.leader_id == claim.node_id and not self.is_leader \
                and current is not None:
            # The members but the leader, and the standbys the leader last published.
            others = len(current.members) - 1 + len(self._follower.standbys.addrs)
            self._revoker.consider(self._revoker.leader(claim.node_id), claim.report, current,
                                   others)
        self._frozen_leader = None

    def _maintain(self) -> None:
        """The standing duties, each retried on the next pass if it fails:
        a session, a registration, a leader, the parts to read again (the
        leader's view when taking over), the advertised master port."""
        membership, follower, leader = self._membership, self._follower, self._leader
        if not membership.session_live and not membership.resume_session():
            follower.stop_leading()
            follower.leader_id = None
            membership.start_over()
        if not membership.registered:
            membership.try_register()
            if not membership.registered:
                return
        if follower.leader_id is None:
            follower.leader_id = leader.campaign(membership.session.lease_id)
        taking_over = follower.is_leader and not leader.leading
        if taking_over:
            follower.read_leader_parts()
        try:
            if follower.pending:
                self._changed = True
            follower.resync_pending()
        except StoreError:
            verdict = leader.takeover_failed() if taking_over else None
            if verdict is not None and verdict.resign:
                follower.stop_leading()
                if leader.resign(verdict.campaign_after):
                    follower.leader_id = None
            raise
        if taking_over:
            leader.took_over()
        if membership.advertise_pending:
            membership.advertise_fresh_master_port()
