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
   ``leader`` and ``round``. A round therefore costs O(members) etcd
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
   barrier), that a peer's agent does not answer. The job ends with a final
   round record carrying an ``outcome``, written by the leader.

All I/O happens on one loop thread per node; watch callbacks only post to its
inbox, and each pass of the loop (:meth:`RendezvousNode.pump`) first applies
what arrived, then brings the node's standing duties up to date: a session,
a registration, a leader, the leader's watches, re-reads after a compaction,
the advertised master port. A duty whose store call fails stays pending and
is tried again on the next pass, so a transient etcd error delays, and never
loses, any of them. A lost session whose lease etcd kept (an outage of etcd
itself) is resumed; a lease etcd dropped means registering again, as a
newcomer.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import queue
import threading
from typing import Callable

from elastic import events
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    ConfigError,
    DuplicateNodeError,
    JobEndedError,
    MalformedRecordError,
    RendezvousTimeoutError,
    StoreError,
)
from elastic.fence import current_round_number, fenced_put, fenced_txn
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.net import free_port
from elastic.rendezvous.api import (
    Action,
    Decision,
    Member,
    NodeInfo,
    RendezvousConfig,
    Report,
    ReportKind,
    RestartRequest,
    Round,
    Standbys,
    cap_text,
)
from elastic.rendezvous.decisions import decide
from elastic.rendezvous.election import Election, leader_in
from elastic.rendezvous.view import LeaderView
from elastic.store.api import Compare, Delete, EventType, Get, KeyValue, Put, Session, Store, Watch

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
# How often a leader asks lost members again whether their workers stopped.
_FENCE_RETRY_S = 0.25
# The parts of the job only the leader watches (its LeaderView).
_LEADER_PARTS = frozenset({"nodes", "requests", "checkpoint"})

Takeover = Callable[[NodeInfo], bool]
# Tells the agents at these addresses that the leader reaches etcd; True once
# none of them runs workers any more (see RendezvousNode._fence_lost).
Fence = Callable[[tuple[str, ...]], bool]


@functools.lru_cache(maxsize=4)
def _parse_round(key: str, value: bytes, version: int) -> Round:
    """``Round.from_json``, once per record in a process: nodes that share one
    (tests, the simulator, bench/rendezvous.py's 128 per process) get the same
    bytes, and a 1,024-member round takes ~7 ms to check. Rounds are immutable;
    a malformed record raises each time (exceptions are not cached)."""
    return Round.from_json(key, value, version)


class RendezvousNode:
    """A node taking part in a job's rendezvous.

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
    ):
        self.store = store
        self.config = config
        self.info = info
        self.keys = JobKeys(config.job_id)
        self.clock = clock
        self._on_round = on_round
        self._takeover = takeover
        self._port_picker = port_picker
        self._fence = fence
        self._running_round = running_round
        self._job_flag = job_flag
        self._fencing_since: float | None = None
        self._election = Election(store, self.keys, info.node_id)
        # Lines name the latest committed round this node has seen.
        self.log = JobLogger(log, config.job_id, info.node_id,
                             lambda: self._round.number if self._round is not None else 0)

        self._inbox: queue.Queue = queue.Queue()
        self._woken_by: tuple | None = None  # taken from the inbox by the loop thread
        self._cond = threading.Condition()
        self._round: Round | None = None  # latest valid committed round
        self._round_version = 0  # version of the round key as last seen (0: absent)
        self._round_revision = 0  # the store revision that round was written at
        self._session: Session | None = None
        self._registered = False
        self.registration_problem = ""  # why the node is not registered yet, for errors
        self._leader: str | None = None
        self._leading = False  # leader with its watches in place
        self._takeover_failing_since: float | None = None
        self._campaign_after = 0.0  # monotonic; set after stepping down
        self._leader_watches: list[Watch] = []
        self._watches: list[Watch] = []
        self._pending_resync: set[str] = set()
        self._advertise_pending = False
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_at: float | None = None
        self._changed = True  # the leader's picture changed since it last decided

        self._view = LeaderView(self.keys, self._report_bad)
        self._standbys = Standbys()  # as last read from etcd
        self._standbys_written: Standbys | None = None  # as this node last wrote it as leader
        self._last_reason = ""
        self._reported_bad: set[tuple[str, int]] = set()

    # ----------------------------------------------------------------- public

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def lease_id(self) -> int | None:
        """The lease of this node's live session (None while it has none)."""
        session = self._session
        return session.lease_id if session is not None and not session.lost.is_set() else None

    @property
    def lease_confirmed_at(self) -> float | None:
        """Monotonic time etcd last confirmed this node's lease (None: no session)."""
        session = self._session
        return session.confirmed_at if session is not None else None

    @property
    def standby_addrs(self) -> tuple[str, ...]:
        """Agent addresses of the registered nodes outside the round, as the
        leader last published them."""
        return self._standbys.addrs

    @property
    def registered(self) -> bool:
        return self._registered and self.lease_id is not None

    @property
    def is_leader(self) -> bool:
        return self._leader == self.node_id

    def start(self, *, thread: bool = True) -> "RendezvousNode":
        """Check the job's settings, try to register, and start following the
        job's rounds (in a background thread, or, with ``thread=False``, in
        :meth:`pump` calls made by the caller).

        Raises ConfigError if the job already runs with other settings,
        JobEndedError if it has ended, and the store errors if etcd cannot be reached. A node id
        still held by another agent does not raise here: see
        :meth:`wait_registered`.
        """
        self._check_job_settings()
        self._session = self._told_when_lost(self.store.session(self.config.lease_ttl_s))
        self._try_register()
        for which in ("round", "leader", "standbys"):
            self._resync(which)
        if thread:
            self._thread = threading.Thread(target=self._run, name=f"rendezvous-{self.node_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Leave the rendezvous: stop the loop, cancel watches, revoke the lease
        (so peers see this node leave at once). Idempotent."""
        self._stopping.set()
        self._inbox.put(("stop", None))
        if self._thread and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for w in self._watches + self._leader_watches:
            w.cancel()
        self._watches, self._leader_watches = [], []
        if self._session is not None:
            self._session.close()

    def has_news(self) -> bool:
        """Whether something arrived that the loop has not applied yet: what
        wakes the loop's thread before its next timed pass."""
        return self._woken_by is not None or not self._inbox.empty()

    def pump(self) -> float | None:
        """Apply everything that arrived, then do one pass of the loop's duties.

        Returns when the node wants to look again if nothing arrives (None:
        only on the next event). The background thread calls this; a
        deterministic simulator calls it instead. Never raises StoreError: a
        failed duty stays pending for the next pass.
        """
        while True:
            if self._woken_by is not None:
                # The item that woke the loop thread comes first: it arrived first.
                (tag, payload), self._woken_by = self._woken_by, None
            else:
                try:
                    tag, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if tag != "stop":
                self._handle(tag, payload)
        if self._stopping.is_set():
            return None
        try:
            self._maintain()
            if not (self.is_leader and self._leading):
                self._wake_at = None
            elif self._changed or (self._wake_at is not None
                                   and self.clock.wall() >= self._wake_at):
                # Decide again only when something changed or a deadline came.
                self._changed = False
                self._wake_at = self._lead()
                self._publish_standbys()
        except StoreError as exc:
            self._changed = True
            self.log.warning("store error in the rendezvous loop, will retry: %s", exc)
            return self.clock.wall() + _ERROR_BACKOFF_S
        return self._wake_at

    @property
    def latest_round(self) -> Round | None:
        with self._cond:
            return self._round

    def wait_registered(self, timeout_s: float) -> None:
        """Block until this node is registered. Raises DuplicateNodeError
        naming the live holder when the id is still taken after ``timeout_s``."""
        deadline = self.clock.monotonic() + timeout_s
        while not self.registered and self.clock.monotonic() < deadline:
            self._stopping.wait(0.05)
        if not self.registered:
            raise DuplicateNodeError(
                f"job {self.config.job_id}: {self.registration_problem or 'not registered'} "
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

        r = self._wait(wanted, timeout)
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
        return self._wait(lambda r: r is not None and r.number != known, timeout_s)

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
               timeout_s: float | None = None) -> None:
        """Tell the leader this node started ``round_number``'s workers, that
        they all exited 0, or (SUSPECT) that node ``about``'s agent does not
        answer. Idempotent; held under this node's lease; raises the store's
        errors (StoreError, or LeaseLostError without a live session)."""
        lease = self.lease_id
        if lease is None:
            raise StoreError(f"node {self.node_id} has no live lease to report under")
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

    def _poster(self, tag: str):
        return lambda evs: self._inbox.put((tag, list(evs)))

    def _error_poster(self, tag: str):
        return lambda exc: self._inbox.put(("error", (tag, exc)))

    def _run(self) -> None:
        while not self._stopping.is_set():
            wake_at = self.pump()
            timeout = SETTLED_CHECK_S if self._settled() else SESSION_CHECK_S
            if wake_at is not None:
                timeout = max(0.0, min(timeout, wake_at - self.clock.wall()))
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                continue
            if item[0] == "stop":
                return
            # pump() applies it first, then whatever else arrived. (Put back in
            # the queue, it went behind newer events: a leader key written twice
            # in quick succession was then applied out of order, and the node
            # believed a leader long replaced.)
            self._woken_by = item

    def _handle(self, tag: str, payload) -> None:
        """Apply watch events to what this node knows; no store calls (a
        failure here would lose the event)."""
        now = self.clock.wall()
        self._changed = True
        if tag == "standbys":
            for ev in payload:
                self._apply_standbys(ev.kv.key, ev.kv.value if ev.type is EventType.PUT else None,
                                     ev.kv.mod_revision)
        elif tag == "round":
            for ev in payload:
                self._apply_round(ev.kv.key, ev.kv.value if ev.type is EventType.PUT else None,
                                  ev.kv.version, ev.kv.mod_revision)
        elif tag == "leader":
            for ev in payload:
                self._leader = leader_in(ev.kv) if ev.type is EventType.PUT else None
            if not self.is_leader:
                self._drop_leadership()
        elif tag == "nodes" and self.is_leader:
            for ev in payload:
                left = self._view.apply_node(ev.kv.key,
                                             ev.kv.value if ev.type is EventType.PUT else None,
                                             ev.kv.create_revision, now)
                if left is not None:
                    self.log.info("node %s left", left)
        elif tag == "checkpoint" and self.is_leader:
            for ev in payload:
                self._view.checkpoint_revision = (ev.kv.mod_revision
                                                  if ev.type is EventType.PUT else 0)
        elif tag == "requests" and self.is_leader:
            for ev in payload:
                self._view.apply_request(ev.kv.key,
                                         ev.kv.value if ev.type is EventType.PUT else None,
                                         ev.kv.mod_revision, now)
        elif tag == "session_lost":
            pass  # this pass's _maintain renews it
        elif tag == "error":
            which, exc = payload
            self.log.warning("watch on %s ended (%s); re-reading state", which, exc)
            self._pending_resync.add(which)

    def _settled(self) -> bool:
        """Whether every standing duty of :meth:`_maintain` is done."""
        return (self._session is not None and not self._session.lost.is_set()
                and self._registered and self._leader is not None
                and not self._pending_resync and not self._advertise_pending)

    def _maintain(self) -> None:
        """The standing duties, each retried on the next pass if it fails."""
        if self._session is None or self._session.lost.is_set():
            self._renew_session()
        if not self._registered:
            self._try_register()
            if not self._registered:
                return
        if self._leader is None and self.clock.monotonic() >= self._campaign_after:
            self._leader = self._election.campaign(self._session.lease_id)
            if self.is_leader:
                self.log.info("elected leader")
        taking_over = self.is_leader and not self._leading
        if taking_over and not _LEADER_PARTS & self._pending_resync:
            self._pending_resync |= _LEADER_PARTS  # load the leader's view
        try:
            for which in sorted(self._pending_resync):
                self._resync(which)
        except StoreError:
            if taking_over:
                self._takeover_failed()
            raise
        if taking_over:
            self._leading = True
            self._takeover_failing_since = None
        if self._advertise_pending:
            self._advertise_fresh_master_port()

    # ------------------------------------------------------- registration

    def _check_job_settings(self) -> None:
        """The first agent records the job's settings; later ones must match."""
        mine = self.config.job_settings()
        result = self.store.txn([Compare.absent(self.keys.config)],
                                [Put(self.keys.config, json.dumps(mine, sort_keys=True).encode())],
                                [Get(self.keys.config), Get(self.keys.round)])
        if result.succeeded:
            return
        stored_kv = result.results[0][0] if result.results[0] else None
        round_kvs = result.results[1]
        try:
            stored = (RendezvousConfig.settings_from_json(stored_kv.key, stored_kv.value)
                      if stored_kv else {})
        except MalformedRecordError as exc:
            self.log.error("ignoring %s; overwriting it", exc)
            self.store.put(self.keys.config, json.dumps(mine, sort_keys=True).encode())
            stored = mine
        if stored != mine:
            # Values from etcd are shown capped and printable: anyone may have written them.
            diff = ", ".join(f"{cap_text(str(k), 64)} {cap_text(repr(stored.get(k)), 64)} "
                             f"(this agent: {mine.get(k)!r})"
                             for k in sorted(set(stored) | set(mine), key=str)
                             if stored.get(k) != mine.get(k))
            raise ConfigError(
                f"job {self.config.job_id} is already running with other settings: {diff}; "
                f"start this agent with the same settings or use another {self._job_flag}")
        if round_kvs:
            try:
                last = Round.from_json(self.keys.round, round_kvs[0].value, round_kvs[0].version)
            except MalformedRecordError:
                return
            if last.outcome:
                raise JobEndedError(
                    f"job {self.config.job_id} has already {last.outcome} (round {last.number}: "
                    f"{last.reason}); nothing to do (use a new {self._job_flag} to run it again)",
                    succeeded=last.outcome == "succeeded")

    def _try_register(self) -> None:
        """Register under the current session, taking over or waiting out a
        previous agent's registration of this id (see the module docstring)."""
        key = self.keys.node(self.node_id)
        lease = self._session.lease_id
        self.info = dataclasses.replace(self.info, running_round=self._running_round())
        result = self.store.txn([Compare.absent(key)], [Put(key, self.info.to_json(), lease=lease)],
                                [Get(key)])
        existing = None if result.succeeded else (result.results[0] or [None])[0]
        if existing is not None and existing.lease == lease:
            result = dataclasses.replace(result, succeeded=True)  # ours: a resumed lease
        if result.succeeded:
            self._registered = True
            self.registration_problem = ""
            self.log.info("registered (nproc %d, host %s)", self.info.nproc, self.info.host)
            return
        if existing is not None and self._provably_gone(existing):
            self.log.warning("the agent that registered this id before (lease %x, "
                        "same host) does not answer; taking its place", existing.lease)
            self.store.revoke_lease(existing.lease)
            self._try_register()
            return
        problem = (f"node id {self.node_id!r} is already registered by a live agent (lease "
                   f"{existing.lease if existing else 0:x}); waiting for its lease "
                   f"({self.config.lease_ttl_s:g} s) to expire")
        if problem != self.registration_problem:
            self.log.warning("%s", problem)
        self.registration_problem = problem

    def _provably_gone(self, existing: KeyValue) -> bool:
        if self._takeover is None or existing.lease == 0:
            return False
        try:
            info = NodeInfo.from_json(existing.key, existing.value)
        except MalformedRecordError:
            return False
        return self._takeover(info)

    def _renew_session(self) -> None:
        """Replace a lost session: resume its lease if etcd kept it (etcd was
        down, not this node's lease), else open a new one and register again."""
        old = self._session
        if old is not None:
            resumed = self.store.resume_session(old.lease_id, self.config.lease_ttl_s)
            if resumed is not None:
                self.log.warning("etcd kept lease %x through the outage; resuming it", old.lease_id)
                self._session = self._told_when_lost(resumed)
                return
            self.log.warning("lease lost (frozen or cut off longer than %.0f s); "
                        "registering again",
                        self.config.lease_ttl_s)
            old.close()
        self._drop_leadership()
        self._leader = None
        self._registered = False
        self._session = self._told_when_lost(self.store.session(self.config.lease_ttl_s))

    def _told_when_lost(self, session: Session) -> Session:
        """The loss of ``session`` wakes the loop thread, which then renews it."""
        session.lost.when_set(lambda: self._inbox.put(("session_lost", None)))
        return session

    # ----------------------------------------------------------- leadership

    def _takeover_failed(self) -> None:
        """A leader that cannot load its view keeps trying; after a lease TTL
        of failures it resigns, so that a node that can lead does."""
        now = self.clock.monotonic()
        self._takeover_failing_since = self._takeover_failing_since or now
        if now - self._takeover_failing_since > self.config.lease_ttl_s:
            self.log.warning("could not take over as leader for %.0f s; "
                        "stepping down",
                        now - self._takeover_failing_since)
            self._drop_leadership()
            if self._election.resign():
                self._leader = None
                # Give a node that can lead a TTL to win before campaigning again.
                self._campaign_after = now + self.config.lease_ttl_s
            self._takeover_failing_since = None

    def _drop_leadership(self) -> None:
        for w in self._leader_watches:
            w.cancel()
        self._leader_watches = []
        self._leading = False
        self._standbys_written = None
        self._pending_resync -= _LEADER_PARTS
        self._view = LeaderView(self.keys, self._report_bad)

    # ------------------------------------------------------ state loading

    def _resync(self, which: str) -> None:
        """(Re)load one part of the state and watch it from the revision read.
        Stays pending (retried on the next pass) until it succeeds."""
        self._pending_resync.add(which)
        if which == "checkpoint":
            kv, rev = self._read(self.keys.checkpoint_latest)
            self._view.checkpoint_revision = kv.mod_revision if kv else 0
            self._leader_watches.append(self.store.watch(
                self.keys.checkpoint_latest, self._poster(which), start_revision=rev + 1,
                on_error=self._error_poster(which)))
        elif which in ("round", "leader", "standbys"):
            key = {"round": self.keys.round, "leader": self.keys.leader,
                   "standbys": self.keys.standbys}[which]
            kv, rev = self._read(key)
            if which == "round":
                self._apply_round(key, kv.value if kv else None, kv.version if kv else 0,
                                  kv.mod_revision if kv else rev)
            elif which == "leader":
                self._leader = leader_in(kv) if kv else None
            else:
                self._apply_standbys(key, kv.value if kv else None, kv.mod_revision if kv else 0)
            self._watches.append(self.store.watch(
                key, self._poster(which), start_revision=rev + 1,
                on_error=self._error_poster(which)))
        elif which in ("nodes", "requests"):
            prefix = self.keys.nodes if which == "nodes" else self.keys.requests
            kvs, rev = self.store.get_prefix(prefix)
            now = self.clock.wall()
            if which == "nodes":
                self._view.reset_nodes(kvs, now)
            else:
                self._view.reset_requests(kvs, now)
            self._leader_watches.append(self.store.watch(
                prefix, self._poster(which), prefix=True, start_revision=rev + 1,
                on_error=self._error_poster(which)))
        self._pending_resync.discard(which)
        self._changed = True

    def _read(self, key: str) -> tuple[KeyValue | None, int]:
        """The key and the store revision it was read at: watching from that
        revision + 1 misses nothing and never asks for compacted history."""
        result = self.store.txn([], [Get(key)])
        kvs = result.results[0]
        return (kvs[0] if kvs else None), result.revision

    def _report_bad(self, exc: MalformedRecordError, revision: int) -> None:
        """Log a malformed record once per (key, revision): loud, but no log storm."""
        if (exc.key, revision) not in self._reported_bad:
            self._reported_bad.add((exc.key, revision))
            self.log.error("ignoring %s", exc)

    def _apply_round(self, key: str, value: bytes | None, version: int, revision: int) -> None:
        parsed = None
        if value is not None:
            try:
                parsed = _parse_round(key, value, version)
            except MalformedRecordError as exc:
                self._report_bad(exc, version)
        with self._cond:
            if revision < self._round_revision:
                # Written before what this node applied already (a watch event
                # delivered after a commit or a re-read): applying it would set
                # the version back and fence every later commit on a stale one.
                return
            if (parsed is not None and self._round is not None
                    and parsed.number == self._round.number):
                return  # our own commit, applied already, now echoed by the watch
            if parsed is not None and self._round is not None and parsed.number < self._round.number:
                return  # a re-read racing a newer watch event: keep the newer
            self._round_version = version if value is not None else 0
            self._round_revision = revision
            if parsed is not None or value is None:
                self._round = parsed
            # Else garbage replaced the round: the last valid one stays, its
            # workers run on, and the leader writes it again on top
            # (see _continue_round).
            self._cond.notify_all()
        if parsed is not None:
            me = parsed.member(self.node_id)
            self.log.info("round %d committed (%s); %s", parsed.number, parsed.reason,
                     f"node rank {me.node_rank} of {len(parsed.members)}" if me else "standby")
            if self._on_round is not None:
                self._on_round(parsed)
            if me is not None and me.node_rank == 0 and not parsed.outcome:
                self._advertise_pending = True

    def _apply_standbys(self, key: str, value: bytes | None, revision: int) -> None:
        try:
            self._standbys = Standbys.from_json(key, value) if value is not None else Standbys()
        except MalformedRecordError as exc:
            self._report_bad(exc, revision)

    def _publish_standbys(self) -> None:
        """Keep ``standbys`` up to date (under the leader's lease: a new leader
        rewrites it). Not fenced: it only says whom to ask about etcd."""
        members = self._round.node_ids if self._round is not None else ()
        wanted = Standbys(self._view.standby_addrs(members))
        if wanted != self._standbys_written:
            self.store.put(self.keys.standbys, wanted.to_json(), lease=self._session.lease_id)
            self._standbys_written = wanted

    def _advertise_fresh_master_port(self) -> None:
        """Offer a new free port for the next round's MASTER_PORT: a restarted
        group never races the old group's sockets for the same port."""
        lease = self.lease_id
        if lease is None:
            return
        self.info = dataclasses.replace(self.info, master_port=self._port_picker(self.info.host))
        self.store.put(self.keys.node(self.node_id), self.info.to_json(), lease=lease)
        self._advertise_pending = False

    # ----------------------------------------------------------- leading

    def _lead(self) -> float | None:
        """Decide and apply; returns when to look again if nothing changes."""
        now = self.clock.wall()
        current = self._round
        if current is not None and not current.outcome and self._round_version > current.number:
            return None if self._continue_round(current) else now + _FENCE_RETRY_S
        decision = decide(self._view.observed(self._round, self._round_revision), now,
                          self.config)
        if decision.reason != self._last_reason:
            self.log.info("leader: %s",
                     decision.reason)
            self._last_reason = decision.reason
        for node_id in decision.suspects:
            registered = self._view.nodes.get(node_id, (None, 0))[1]
            self._view.suspect(node_id, now, registered + 1)
        if decision.action is Action.CLOSE_ROUND:
            if not self._fence_lost():
                return now + _FENCE_RETRY_S
            # A commit that lost its fence re-read the round: decide again on
            # what it read, even if no watch event comes to say it changed.
            return None if self._commit_round(decision) else now + _FENCE_RETRY_S
        if decision.action in (Action.FAIL_JOB, Action.SUCCEED_JOB) and self._round is not None:
            outcome = "failed" if decision.action is Action.FAIL_JOB else "succeeded"
            return None if self._end_job(outcome, decision) else now + _FENCE_RETRY_S
        return decision.wake_at

    def _fence_lost(self) -> bool:
        """Before a round leaves out members whose lease expired, make sure
        their workers stopped: a member cut off from etcd together with its
        peers, and unaware of this leader (it registered after the cut), would
        take etcd for down and train on. Told that the leader reaches etcd,
        it stops. An agent that does not answer counts as stopped; after
        three TTLs of trying the leader goes on regardless (liveness)."""
        current = self._round
        lost = tuple(m.addr for m in (current.members if current else ())
                     if m.node_id not in self._view.nodes and m.addr)
        if not lost or self._fence is None:
            return True
        now = self.clock.monotonic()
        self._fencing_since = self._fencing_since or now
        if self._fence(lost):
            self._fencing_since = None
            return True
        if now - self._fencing_since > 3 * self.config.lease_ttl_s:
            self.log.warning("leader: lost members at %s still report running "
                        "workers after %.0f s; forming the round anyway", ", ".join(lost), now - self._fencing_since)
            self._fencing_since = None
            return True
        self.log.info("leader: waiting for the workers of lost members at %s to "
                 "stop", ", ".join(lost))
        return False

    def _commit_round(self, decision: Decision) -> bool:
        """Commit the round ``decision`` closes; False if its fence failed."""
        number = self._round_version + 1
        infos = {info.node_id: info for info, _ in self._view.nodes.values()}
        members = tuple(
            Member(node_id=n, node_rank=i, host=infos[n].host, nproc=infos[n].nproc,
                   addr=infos[n].addr)
            for i, n in enumerate(decision.members)
        )
        rank0 = infos[decision.members[0]]
        record = Round(
            number=number, members=members, master_addr=rank0.host,
            master_port=rank0.master_port, reason=decision.reason, leader=self.node_id,
            created_at=self.clock.wall(), failures=decision.failures,
        )
        # Served and stale restart requests go in the same transaction: a
        # request is consumed exactly by the round that answers it.
        served = [Delete(k) for k, r in self._view.restarts.items() if r.round <= number - 1]
        ops = [Put(self.keys.round, record.to_json()),
               events.event_op(self.keys, self.clock, self.node_id, number, "round",
                               f"round {number} formed with {list(decision.members)}: "
                               f"{decision.reason}")]
        if not self._commit(number, record, ops + served[:100]):
            return False
        self.log.info("leader: committed round %d with %s", number, list(decision.members))
        for op in served[:100]:
            self._view.restarts.pop(op.key, None)
        if number % 100 == 0:
            events.prune(self.store, self.keys)
        return True

    def _continue_round(self, current: Round) -> bool:
        """A malformed record replaced ``current`` in the round key: write it
        again on top, as a round that continues its workers (the agents keep
        them running), so that a write of garbage restarts nothing. False if
        its fence failed."""
        number = self._round_version + 1
        reason = (f"round {current.number} written again: a malformed record replaced it "
                  f"(the workers of round {current.workers_round} run on)")
        record = current.continued(number, reason, self.node_id, self.clock.wall())
        ops = [Put(self.keys.round, record.to_json()),
               events.event_op(self.keys, self.clock, self.node_id, number, "round",
                               f"round {number}: {reason}")]
        if not self._commit(number, record, ops):
            return False
        self.log.warning("leader: %s; committed as round %d", reason, number)
        return True

    def _end_job(self, outcome: str, decision: Decision) -> bool:
        """Commit the job's final round: the current one with an outcome;
        False if its fence failed."""
        current = self._round
        number = current.number + 1
        final = dataclasses.replace(current, number=number, outcome=outcome,
                                    reason=decision.reason, leader=self.node_id,
                                    created_at=self.clock.wall(), failures=decision.failures)
        ops = [Put(self.keys.round, final.to_json()),
               events.event_op(self.keys, self.clock, self.node_id, number, "outcome",
                               f"job {outcome}: {decision.reason}")]
        if not self._commit(number, final, ops):
            return False
        self.log.info("leader: job %s in round %d: %s", outcome, number, decision.reason)
        return True

    def _commit(self, number: int, record: Round, ops: list) -> bool:
        """Write round ``number`` fenced by the round before it and this node's
        leadership; apply it at once on success (the watch echo is then a no-op)."""
        result = fenced_txn(self.store, self.keys, number - 1, ops, also=[self._election.holds()])
        if not result.succeeded:
            self.log.info("round %d was not committed (the job is in round %d, or "
                     "leadership moved); re-reading", number,
                     current_round_number(result))
            kv, rev = self._read(self.keys.round)
            self._apply_round(self.keys.round, kv.value if kv else None, kv.version if kv else 0,
                              kv.mod_revision if kv else rev)
            return False
        self._apply_round(self.keys.round, record.to_json(), number, result.revision)
        return True

    # ----------------------------------------------------------- waiting

    def _wait(self, predicate: Callable[[Round | None], bool], timeout_s: float) -> Round | None:
        deadline = self.clock.monotonic() + timeout_s
        with self._cond:
            while not predicate(self._round):
                left = deadline - self.clock.monotonic()
                if left <= 0 or self._stopping.is_set():
                    break
                self._cond.wait(min(left, 0.5))
            return self._round
