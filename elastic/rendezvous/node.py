"""One node's side of the rendezvous: register, elect a leader, follow the rounds.

Protocol (keys in :mod:`elastic.rendezvous.keys`):

1. A node opens a session (an etcd lease kept alive) and registers
   ``nodes/<node_id>`` under it with a create-only transaction: a second live
   agent with the same id is refused.
2. Every node campaigns for ``leader`` (create-only, under its lease). The
   leader alone watches ``nodes/`` and ``requests/``; followers watch only
   ``leader`` and ``round``. A round therefore costs O(members) etcd
   operations and events, not O(members^2).
3. The leader feeds what it sees to :func:`elastic.rendezvous.decisions.decide`
   and commits a new ``round`` record with a transaction that compares the
   round key's version (the round number: the fencing token) and its own
   leadership, so a deposed leader or a stale view can never overwrite a newer
   round.
4. Every node sees the committed round through its watch; nodes not in it wait
   as standbys for a later round.
5. The job ends with a final round record carrying an ``outcome``: written by
   the leader when the restart budget is spent, or by any member whose workers
   all succeeded (:meth:`RendezvousNode.finish`), fenced like every round.

All I/O happens on one loop thread per node; watch callbacks only post to its
inbox. A lost session (e.g. the process was frozen past its TTL) is replaced by
a new one and the node registers again, as a newcomer.
"""

from __future__ import annotations

import dataclasses
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
    FencedError,
    MalformedRecordError,
    RendezvousTimeoutError,
    StoreError,
)
from elastic.rendezvous.api import (
    Action,
    Decision,
    Member,
    NodeInfo,
    Observed,
    RendezvousConfig,
    RestartRequest,
    Round,
)
from elastic.rendezvous.decisions import decide
from elastic.rendezvous.keys import JobKeys
from elastic.net import free_port
from elastic.store.api import (Compare, Delete, EventType, Get, KeyValue, Put, Session,
                               Store, Watch)

log = logging.getLogger(__name__)

# How often the loop looks at its session even when nothing else happens; a
# lost lease is noticed within this long.
_SESSION_CHECK_S = 0.5


class RendezvousNode:
    """A node taking part in a job's rendezvous.

    Thread-safe: ``wait_for_round`` and friends may be called from any thread
    while the node's loop runs in the background.
    """

    def __init__(
        self,
        store: Store,
        config: RendezvousConfig,
        info: NodeInfo,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_round: Callable[[Round], None] | None = None,
    ):
        self.store = store
        self.config = config
        self.info = info
        self.keys = JobKeys(config.job_id)
        self.clock = clock
        self._on_round = on_round

        self._inbox: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._round: Round | None = None  # latest valid committed round
        self._round_version = 0  # version of the round key as last seen (0: absent)
        self._session: Session | None = None
        self._leader: str | None = None
        self._leader_watches: list[Watch] = []
        self._watches: list[Watch] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._fatal: BaseException | None = None

        # Leader-only view, rebuilt on election.
        self._nodes: dict[str, tuple[NodeInfo, int]] = {}  # id -> (info, create revision)
        self._first_seen: dict[str, float] = {}
        self._restarts: dict[str, RestartRequest] = {}
        self._draining: set[str] = set()
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
    def is_leader(self) -> bool:
        return self._leader == self.node_id

    def start(self) -> "RendezvousNode":
        """Register this node and start following the job's rounds.

        Raises ConfigError if the job already runs with other settings or has
        finished, DuplicateNodeError if a live agent already holds this node
        id, and the store errors if etcd cannot be reached.
        """
        self._check_job_settings()
        self._register()
        self._watches.append(
            self.store.watch(self.keys.round, self._poster("round"), start_revision=self._load_round() + 1,
                             on_error=self._error_poster("round"))
        )
        leader_rev = self._load_leader()
        self._watches.append(
            self.store.watch(self.keys.leader, self._poster("leader"), start_revision=leader_rev + 1,
                             on_error=self._error_poster("leader"))
        )
        self._thread = threading.Thread(
            target=self._run, name=f"rendezvous-{self.node_id}", daemon=True
        )
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

    @property
    def latest_round(self) -> Round | None:
        with self._cond:
            return self._round

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

    def request_restart(self, reason: str, round_number: int, *, failure: bool) -> None:
        """Ask the leader for a new round with the same members. ``failure``
        counts it against the restart budget (a worker crashed or hung).
        Requests about an older round are ignored by the leader."""
        req = RestartRequest(node_id=self.node_id, round=round_number, reason=reason,
                             failure=failure)
        self.store.put(f"{self.keys.restart_requests}{round_number:012d}-{self.node_id}",
                       req.to_json())

    def finish(self, current: Round, outcome: str, reason: str) -> bool:
        """End the job: commit a final round after ``current`` with ``outcome``.

        Returns False (and changes nothing) if ``current`` is no longer the
        latest round: the job moved on, so this node's view was stale.
        """
        final = dataclasses.replace(current, number=current.number + 1, outcome=outcome,
                                    reason=reason, leader=self.node_id,
                                    created_at=self.clock.wall())
        result = self.store.txn(
            [Compare.version(self.keys.round, "==", current.number)],
            [Put(self.keys.round, final.to_json()),
             events.event_op(self.keys, self.clock, self.node_id, final.number, "outcome",
                             f"job {outcome}: {reason}")],
        )
        if result.succeeded:
            log.info("job %s node %s: job %s in round %d: %s", self.config.job_id,
                     self.node_id, outcome, final.number, reason)
        return result.succeeded

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
        wake_at: float | None = None
        self._campaign()
        while not self._stopping.is_set():
            timeout = _SESSION_CHECK_S
            if wake_at is not None:
                timeout = max(0.0, min(timeout, wake_at - self.clock.wall()))
            try:
                tag, payload = self._inbox.get(timeout=timeout)
            except queue.Empty:
                tag, payload = "tick", None
            if tag == "stop":
                return
            try:
                self._handle(tag, payload)
                if self._session is not None and self._session.lost.is_set():
                    self._renew_session()
                if self.is_leader:
                    wake_at = self._lead()
                else:
                    wake_at = None
            except StoreError as exc:
                # A store blip must not kill the node: log, and look again soon.
                log.warning("job %s node %s: store error in the rendezvous loop, will retry: %s",
                            self.config.job_id, self.node_id, exc)
                self._stopping.wait(0.2)
            except Exception:  # a bug: keep the node alive and visible in the log
                log.exception("job %s node %s: unexpected error in the rendezvous loop",
                              self.config.job_id, self.node_id)
                self._stopping.wait(0.5)

    def _handle(self, tag: str, payload) -> None:
        if tag == "round":
            for ev in payload:
                self._apply_round(ev.kv.key, ev.kv.value if ev.type is EventType.PUT else None,
                                  ev.kv.version)
        elif tag == "leader":
            for ev in payload:
                self._leader = ev.kv.value.decode(errors="replace") if ev.type is EventType.PUT else None
            if self._leader is None:
                self._campaign()
            elif not self.is_leader:
                self._drop_leadership()
        elif tag == "nodes":
            for ev in payload:
                self._apply_node(ev.kv.key, ev.kv.value if ev.type is EventType.PUT else None,
                                 ev.kv.create_revision)
        elif tag == "requests":
            for ev in payload:
                self._apply_request(ev.kv.key, ev.kv.value if ev.type is EventType.PUT else None)
        elif tag == "error":
            which, exc = payload
            log.warning("job %s node %s: watch on %s ended (%s); re-reading state",
                        self.config.job_id, self.node_id, which, exc)
            self._resync(which)

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
            stored = json.loads(stored_kv.value) if stored_kv else {}
        except ValueError:
            stored = None
        if stored is not None and stored != mine:
            diff = ", ".join(f"{k} {stored.get(k)!r} (this agent: {mine[k]!r})" for k in mine
                             if stored.get(k) != mine[k])
            raise ConfigError(
                f"job {self.config.job_id} is already running with other settings: {diff}; "
                "start this agent with the same settings or use another --job-id")
        if stored is None:
            log.error("job %s node %s: ignoring malformed record at key %r; overwriting it",
                      self.config.job_id, self.node_id, self.keys.config)
            self.store.put(self.keys.config, json.dumps(mine, sort_keys=True).encode())
        if round_kvs:
            try:
                last = Round.from_json(self.keys.round, round_kvs[0].value, round_kvs[0].version)
            except MalformedRecordError:
                return
            if last.outcome:
                raise ConfigError(
                    f"job {self.config.job_id} has already {last.outcome} (round {last.number}: "
                    f"{last.reason}); use a new --job-id to run again")

    def _register(self) -> None:
        self._session = self.store.session(self.config.lease_ttl_s)
        key = self.keys.node(self.node_id)
        result = self.store.txn(
            [Compare.absent(key)],
            [Put(key, self.info.to_json(), lease=self._session.lease_id)],
            [Get(key)],
        )
        if not result.succeeded:
            existing = result.results[0][0] if result.results and result.results[0] else None
            self._session.close()
            raise DuplicateNodeError(
                f"job {self.config.job_id}: node id {self.node_id!r} is already registered by "
                f"a live agent (lease {existing.lease if existing else '?'}); use another "
                f"--node-id, or wait {self.config.lease_ttl_s:.0f} s for the old lease to expire"
            )
        log.info("job %s node %s: registered (nproc %d, host %s)",
                 self.config.job_id, self.node_id, self.info.nproc, self.info.host)

    def _renew_session(self) -> None:
        log.warning("job %s node %s: lease lost (frozen or cut off longer than %.0f s); "
                    "registering again", self.config.job_id, self.node_id, self.config.lease_ttl_s)
        self._drop_leadership()
        self._leader = None
        # If the lease only looked lost (keep-alives failed, yet etcd kept it),
        # revoke it, or the old registration would block the new one.
        self._session.close()
        self._register()
        self._campaign()

    def _campaign(self) -> None:
        """Try to become leader; learn who is if someone else is."""
        assert self._session is not None
        result = self.store.txn(
            [Compare.absent(self.keys.leader)],
            [Put(self.keys.leader, self.node_id.encode(), lease=self._session.lease_id)],
            [Get(self.keys.leader)],
        )
        if result.succeeded:
            self._leader = self.node_id
            log.info("job %s node %s: elected leader", self.config.job_id, self.node_id)
            self._take_leadership()
        else:
            kvs = result.results[0] if result.results else []
            self._leader = kvs[0].value.decode(errors="replace") if kvs else None

    def _take_leadership(self) -> None:
        self._first_seen = {}
        for which in ("nodes", "requests"):
            self._resync(which)

    def _drop_leadership(self) -> None:
        for w in self._leader_watches:
            w.cancel()
        self._leader_watches = []
        self._nodes, self._restarts, self._draining = {}, {}, set()

    # ------------------------------------------------------ state loading

    def _resync(self, which: str) -> None:
        """(Re)load one part of the state and watch it from the revision read."""
        if which == "round":
            rev = self._load_round()
            self._watches.append(self.store.watch(
                self.keys.round, self._poster("round"), start_revision=rev + 1,
                on_error=self._error_poster("round")))
        elif which == "leader":
            rev = self._load_leader()
            self._watches.append(self.store.watch(
                self.keys.leader, self._poster("leader"), start_revision=rev + 1,
                on_error=self._error_poster("leader")))
            if self._leader is None:
                self._campaign()
        elif which in ("nodes", "requests") and self.is_leader:
            prefix = self.keys.nodes if which == "nodes" else self.keys.requests
            kvs, rev = self.store.get_prefix(prefix)
            if which == "nodes":
                self._nodes = {}
                for kv in kvs:
                    self._apply_node(kv.key, kv.value, kv.create_revision)
            else:
                self._restarts, self._draining = {}, set()
                for kv in kvs:
                    self._apply_request(kv.key, kv.value)
            self._leader_watches.append(self.store.watch(
                prefix, self._poster(which), prefix=True, start_revision=rev + 1,
                on_error=self._error_poster(which)))

    def _read(self, key: str) -> tuple[KeyValue | None, int]:
        """The key and the store revision it was read at: watching from that
        revision + 1 misses nothing and never asks for compacted history."""
        result = self.store.txn([], [Get(key)])
        kvs = result.results[0]
        return (kvs[0] if kvs else None), result.revision

    def _load_round(self) -> int:
        kv, revision = self._read(self.keys.round)
        self._apply_round(self.keys.round, kv.value if kv else None, kv.version if kv else 0)
        return revision

    def _load_leader(self) -> int:
        kv, revision = self._read(self.keys.leader)
        self._leader = kv.value.decode(errors="replace") if kv else None
        return revision

    def _report_bad(self, exc: MalformedRecordError, revision: int) -> None:
        """Log a malformed record once per (key, revision): loud, but no log storm."""
        if (exc.key, revision) not in self._reported_bad:
            self._reported_bad.add((exc.key, revision))
            log.error("job %s node %s: ignoring %s", self.config.job_id, self.node_id, exc)

    def _apply_round(self, key: str, value: bytes | None, version: int) -> None:
        parsed = None
        if value is not None:
            try:
                parsed = Round.from_json(key, value, version)
            except MalformedRecordError as exc:
                self._report_bad(exc, version)
        with self._cond:
            if (parsed is not None and self._round is not None
                    and parsed.number == self._round.number):
                return  # our own commit, applied already, now echoed by the watch
            self._round_version = version if value is not None else 0
            if parsed is not None or value is None:
                self._round = parsed
            elif self._round is not None and self._round.number < version:
                # Garbage replaced the round: it is no longer current. The
                # leader will commit a fresh round on top of it.
                self._round = None
            self._cond.notify_all()
        if parsed is not None:
            me = parsed.member(self.node_id)
            log.info("job %s node %s: round %d committed (%s); %s", self.config.job_id,
                     self.node_id, parsed.number, parsed.reason,
                     f"node rank {me.node_rank} of {len(parsed.members)}" if me else "standby")
            if me is not None and me.node_rank == 0:
                self._advertise_fresh_master_port()
            if self._on_round is not None:
                self._on_round(parsed)

    def _advertise_fresh_master_port(self) -> None:
        """Offer a new free port for the next round's MASTER_PORT: a restarted
        group never races the old group's sockets for the same port."""
        if self._session is None or self._session.lost.is_set():
            return
        self.info = NodeInfo(**{**self.info.__dict__, "master_port": free_port(self.info.host)})
        self.store.put(self.keys.node(self.node_id), self.info.to_json(),
                       lease=self._session.lease_id)

    def _apply_node(self, key: str, value: bytes | None, create_revision: int) -> None:
        node_id = self.keys.node_id_of(key)
        if value is None:
            if self._nodes.pop(node_id, None) is not None:
                log.info("job %s node %s: node %s left", self.config.job_id, self.node_id, node_id)
            self._first_seen.pop(node_id, None)
            return
        try:
            info = NodeInfo.from_json(key, value)
        except MalformedRecordError as exc:
            self._report_bad(exc, create_revision)
            self._nodes.pop(node_id, None)
            return
        if node_id not in self._nodes:
            self._first_seen.setdefault(node_id, self.clock.wall())
        self._nodes[node_id] = (info, create_revision)

    def _apply_request(self, key: str, value: bytes | None) -> None:
        if key.startswith(self.keys.drain_requests):
            node_id = self.keys.node_id_of(key)
            (self._draining.add if value is not None else self._draining.discard)(node_id)
            return
        if value is None:
            self._restarts.pop(key, None)
            return
        try:
            self._restarts[key] = RestartRequest.from_json(key, value)
        except MalformedRecordError as exc:
            self._report_bad(exc, 0)

    # ----------------------------------------------------------- leading

    def _observed(self) -> Observed:
        alive = tuple(info for info, _ in sorted(self._nodes.values(), key=lambda p: p[1]))
        return Observed(
            current=self._round,
            alive=alive,
            first_seen=dict(self._first_seen),
            restart_requests=tuple(self._restarts.values()),
            draining=frozenset(self._draining),
        )

    def _lead(self) -> float | None:
        """Decide and apply; returns when to look again if nothing changes."""
        decision = decide(self._observed(), self.clock.wall(), self.config)
        if decision.reason != self._last_reason:
            log.info("job %s node %s (leader): %s", self.config.job_id, self.node_id,
                     decision.reason)
            self._last_reason = decision.reason
        if decision.action is Action.CLOSE_ROUND:
            self._commit_round(decision)
            return None
        if decision.action is Action.FAIL_JOB and self._round is not None:
            if not self.finish(dataclasses.replace(self._round, failures=decision.failures),
                               "failed", decision.reason):
                self._load_round()
            return None
        return decision.wake_at

    def _commit_round(self, decision: Decision) -> None:
        number = self._round_version + 1
        infos = {info.node_id: info for info, _ in self._nodes.values()}
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
        served = [Delete(k) for k, r in self._restarts.items() if r.round <= number - 1]
        ops = [Put(self.keys.round, record.to_json()),
               events.event_op(self.keys, self.clock, self.node_id, number, "round",
                               f"round {number} formed with {list(decision.members)}: "
                               f"{decision.reason}")]
        result = self.store.txn(
            [Compare.version(self.keys.round, "==", self._round_version),
             Compare.value(self.keys.leader, "==", self.node_id.encode())],
            ops + served[:100],
        )
        if not result.succeeded:
            log.info("job %s node %s: round %d was not committed (someone else moved first); "
                     "re-reading", self.config.job_id, self.node_id, number)
            self._load_round()
            return
        log.info("job %s node %s (leader): committed round %d with %s", self.config.job_id,
                 self.node_id, number, list(decision.members))
        for op in served[:100]:
            self._restarts.pop(op.key, None)
        # Apply our own write now rather than waiting for the watch, so the
        # next decision sees it; the watch event for it is then idempotent.
        self._apply_round(self.keys.round, record.to_json(), number)
        if number % 100 == 0:
            events.prune(self.store, self.keys)

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


def fenced_put(store: Store, keys: JobKeys, key: str, value: bytes, round_number: int) -> int:
    """Write ``key`` only while ``round_number`` is the job's current round.

    This is how everything that matters is written (checkpoint commits, round
    status): a process of an older round is refused. Returns the revision of
    the write; raises FencedError when the round has moved on.
    """
    result = store.txn([Compare.version(keys.round, "==", round_number)], [Put(key, value)],
                       [Get(keys.round)])
    if not result.succeeded:
        kvs = result.results[0] if result.results else []
        now = kvs[0].version if kvs else 0
        raise FencedError(
            f"job {keys.job_id}: refused to write {key!r} for round {round_number}: "
            f"the current round is {now}"
        )
    return result.revision
