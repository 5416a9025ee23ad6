"""A node's membership in a job: its session, its registration, and taking
over a registration that a previous agent with the same id left behind.

The node opens a session (an etcd lease kept alive) and registers
``nodes/<node_id>`` under it with a create-only transaction. If a previous
agent with the same id still holds it (an agent restarted by systemd before
its old lease ran out), the node takes the registration over when the
``takeover`` check proves that agent gone (same host, its address does not
answer) by revoking the old lease, and otherwise waits, retrying, until the
old lease expires. A lost session whose lease etcd kept (an outage of etcd
itself) is resumed; a lease etcd dropped means registering again, as a
newcomer. The registration also carries the master port the node offers for
its next round as rank 0 (:meth:`Membership.advertise_fresh_master_port`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from elastic.errors import ConfigError, JobEndedError, MalformedRecordError
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.records import cap_text
from elastic.rendezvous.api import NodeInfo, Outcome, Round
from elastic.rendezvous.config import RendezvousConfig
from elastic.rendezvous.round_record import parse_head
from elastic.store.api import Compare, Get, KeyValue, Put, Session, Store

Takeover = Callable[[NodeInfo], bool]


@dataclasses.dataclass(frozen=True)
class MembershipSettings:
    """How a node joins: who decides a takeover, which port it offers, which
    round its workers run (for a registration after a lost lease), the flag
    its user gave the job id with, as errors name it, and whether it may
    register now (``may_join``: False defers the registration, see
    ``RendezvousNode``'s ``ready_to_join``)."""

    takeover: Takeover | None = None
    port_picker: Callable[[str], int] = lambda host: 0
    running_round: Callable[[], int] = lambda: 0
    job_flag: str = "--job-id"
    may_join: Callable[[], bool] = lambda: True


class Membership:
    """Session and registration of one node; used by its loop thread only."""

    def __init__(self, store: Store, config: RendezvousConfig, info: NodeInfo,
                 settings: MembershipSettings, log: JobLogger,
                 on_session_lost: Callable[[], None]):
        self.store = store
        self.config = config
        self.info = info
        self.keys = JobKeys(config.job_id)
        self._settings = settings
        self._log = log
        self._on_session_lost = on_session_lost
        self.session: Session | None = None
        self.registered = False
        # The round number committed when this registration was made: rounds up to it
        # were formed for an earlier registration of this id, never for this one.
        self.registered_after = 0
        self.problem = ""  # why the node is not registered yet, for errors
        self.advertise_pending = False

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def lease_id(self) -> int | None:
        """The lease of the live session (None while there is none)."""
        session = self.session
        return session.lease_id if session is not None and not session.lost.is_set() else None

    @property
    def session_live(self) -> bool:
        return self.session is not None and not self.session.lost.is_set()

    @property
    def settled(self) -> bool:
        """Whether the node holds a live session, is registered and has
        advertised its port: nothing left to do until something changes."""
        return self.session_live and self.registered and not self.advertise_pending

    def open(self) -> None:
        """Check the job's settings and open a session (the caller then
        registers, see :meth:`try_register`).

        Raises ConfigError if the job already runs with other settings,
        JobEndedError if it has ended, and the store's errors."""
        self._check_job_settings()
        self.session = self._told_when_lost(self.store.session(self.config.lease_ttl_s))

    def close(self) -> None:
        """Close the session (revoking its lease: peers see the node leave at once)."""
        if self.session is not None:
            self.session.close()

    def resume_session(self) -> bool:
        """After the session's loss: resume its lease if etcd kept it (etcd was
        down, not this node's lease) and return True; else close it and return
        False: the registration went with the lease (see :meth:`start_over`)."""
        old = self.session
        if old is None:
            return False
        resumed = self.store.resume_session(old.lease_id, self.config.lease_ttl_s)
        if resumed is not None:
            self._log.warning("etcd kept lease %x through the outage; resuming it", old.lease_id)
            self.session = self._told_when_lost(resumed)
            return True
        self._log.warning("lease lost (frozen or cut off longer than %.0f s); "
                          "registering again", self.config.lease_ttl_s)
        old.close()
        return False

    def start_over(self) -> None:
        """Open a new session, unregistered: the node registers as a newcomer."""
        self.registered = False
        self.session = self._told_when_lost(self.store.session(self.config.lease_ttl_s))

    def try_register(self) -> None:
        """Register under the current session, taking over or waiting out a
        previous agent's registration of this id (see the module docstring);
        not yet while ``may_join`` says no."""
        if not self._settings.may_join():
            self.problem = ("waiting for this node's workers to be ready before it joins the "
                            "running job")
            return
        key = self.keys.node(self.node_id)
        lease = self.session.lease_id
        self.info = dataclasses.replace(self.info, running_round=self._settings.running_round())
        result = self.store.txn([Compare.absent(key)],
                                [Put(key, self.info.to_json(), lease=lease), Get(self.keys.round)],
                                [Get(key)])
        existing = None if result.succeeded else (result.results[0] or [None])[0]
        if result.succeeded or (existing is not None and existing.lease == lease):
            # (The same lease: ours, resumed, and so is the round it registered after.)
            if result.succeeded:
                round_kv = (result.results[1] or [None])[0]
                self.registered_after = round_kv.version if round_kv is not None else 0
            self.registered = True
            self.problem = ""
            self._log.info("registered (nproc %d, host %s) after round %d", self.info.nproc,
                           self.info.host, self.registered_after)
            return
        if existing is not None and self._provably_gone(existing):
            self._log.warning("the agent that registered this id before (lease %x, "
                              "same host) does not answer; taking its place", existing.lease)
            self.store.revoke_lease(existing.lease)
            self.try_register()
            return
        problem = (f"node id {self.node_id!r} is already registered by a live agent (lease "
                   f"{existing.lease if existing else 0:x}); waiting for its lease "
                   f"({self.config.lease_ttl_s:g} s) to expire")
        if problem != self.problem:
            self._log.warning("%s", problem)
        self.problem = problem

    def round_committed(self, committed: Round) -> None:
        """Rank 0 of a round that goes on offers a fresh port for the next."""
        me = committed.member(self.node_id)
        if me is not None and me.node_rank == 0 and not committed.outcome:
            self.advertise_pending = True

    def advertise_fresh_master_port(self) -> None:
        """Offer a new free port for the next round's MASTER_PORT: a restarted
        group never races the old group's sockets for the same port."""
        lease = self.lease_id
        if lease is None:
            return
        self.info = dataclasses.replace(self.info,
                                        master_port=self._settings.port_picker(self.info.host))
        self.store.put(self.keys.node(self.node_id), self.info.to_json(), lease=lease)
        self.advertise_pending = False

    def _provably_gone(self, existing: KeyValue) -> bool:
        if self._settings.takeover is None or existing.lease == 0:
            return False
        try:
            info = NodeInfo.from_json(existing.key, existing.value)
        except MalformedRecordError:
            return False
        return self._settings.takeover(info)

    def _told_when_lost(self, session: Session) -> Session:
        """The loss of ``session`` wakes the loop thread, which then renews it."""
        session.lost.when_set(self._on_session_lost)
        return session

    def _check_job_settings(self) -> None:
        """The first agent records the job's settings; later ones must match."""
        mine = self.config.job_settings()
        result = self.store.txn([Compare.absent(self.keys.config)],
                                [Put(self.keys.config, json.dumps(mine, sort_keys=True).encode())],
                                [Get(self.keys.config), Get(self.keys.round)])
        if result.succeeded:
            return
        stored_kv = result.results[0][0] if result.results[0] else None
        try:
            stored = (RendezvousConfig.settings_from_json(stored_kv.key, stored_kv.value)
                      if stored_kv else {})
        except MalformedRecordError as exc:
            self._log.error("ignoring %s; overwriting it", exc)
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
                f"start this agent with the same settings or use another "
                f"{self._settings.job_flag}")
        self._refuse_an_ended_job(result.results[1])

    def _refuse_an_ended_job(self, round_kvs: list[KeyValue]) -> None:
        """Raises JobEndedError if the round read says the job has ended."""
        if not round_kvs:
            return
        try:
            last = parse_head(self.keys.round, round_kvs[0].value, round_kvs[0].version)
        except MalformedRecordError:
            return
        if last.outcome:
            flag = self._settings.job_flag
            raise JobEndedError(
                f"job {self.config.job_id} has already {last.outcome} (round {last.number}: "
                f"{last.reason}); nothing to do (use a new {flag} to run it again)",
                succeeded=last.outcome is Outcome.SUCCEEDED)
