"""The leader's picture of a job: registered nodes, requests and reports.

Built from prefix reads and watch events of ``nodes/`` and ``requests/`` (and
the revision of ``checkpoint/latest``); no
I/O here, so the rendezvous node applies events to it and hands
:meth:`LeaderView.observed` to the pure :func:`~elastic.rendezvous.decisions.decide`.
Times are the leader's wall clock when it learnt a thing (never a clock of
another machine).
"""

from __future__ import annotations

import itertools
from typing import AbstractSet, Callable

from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.records import id_in_key
from elastic.rendezvous.api import (
    STANDBY_WITNESSES,
    DrainRequest,
    FrozenReport,
    NodeInfo,
    Report,
    RestartRequest,
    Round,
)
from elastic.rendezvous.decisions import Observed
from elastic.store.api import KeyValue

ReportBad = Callable[[MalformedRecordError, int], None]


class LeaderView:
    """Mutable; owned by the rendezvous loop thread."""

    def __init__(self, keys: JobKeys, report_bad: ReportBad):
        self.keys = keys
        self._report_bad = report_bad
        self.nodes: dict[str, tuple[NodeInfo, int]] = {}  # id -> (info, create revision)
        self.first_seen: dict[str, float] = {}
        self.restarts: dict[str, RestartRequest] = {}  # by key
        self.draining: set[str] = set()
        self.started: dict[str, int] = {}
        self.done: dict[str, tuple[int, float]] = {}
        # suspect -> (when learnt, revision of the report): a report older than
        # the node's registration is about a previous agent with that id.
        self.suspects: dict[str, tuple[float, int]] = {}
        # frozen node -> (the report, its revision, when learnt): same rule as
        # suspects, but a confirmed report (its lease revoked) is a suspicion
        # whatever its registration: a node that thaws is the same agent.
        self.frozen: dict[str, tuple[FrozenReport, int, float]] = {}
        self.checkpoint_revision = 0  # mod revision of checkpoint/latest (0: none)

    def reset_nodes(self, kvs: list[KeyValue], now: float) -> None:
        self.nodes = {}
        for kv in kvs:
            self.apply_node(kv.key, kv.value, kv.create_revision, now)

    def reset_requests(self, kvs: list[KeyValue], now: float) -> None:
        self.restarts, self.draining, self.started, self.done, self.suspects = {}, set(), {}, {}, {}
        self.frozen = {}
        for kv in kvs:
            self.apply_request(kv.key, kv.value, kv.mod_revision, now)

    def apply_node(self, key: str, value: bytes | None, create_revision: int, now: float
                   ) -> str | None:
        """Apply a put (``value``) or delete (None) of ``nodes/<id>``; returns
        the id of a node that left, else None. A key that does not end in one
        valid id (``nodes/../round``) is reported and ignored."""
        try:
            node_id = id_in_key(key, self.keys.nodes)
        except MalformedRecordError as exc:
            if value is not None:
                self._report_bad(exc, create_revision)
            return None
        if value is None:
            self.first_seen.pop(node_id, None)
            return node_id if self.nodes.pop(node_id, None) is not None else None
        try:
            info = NodeInfo.from_json(key, value)
        except MalformedRecordError as exc:
            self._report_bad(exc, create_revision)
            self.nodes.pop(node_id, None)
            return None
        if node_id not in self.nodes:
            self.first_seen.setdefault(node_id, now)
        self.nodes[node_id] = (info, create_revision)
        return None

    def apply_request(self, key: str, value: bytes | None, mod_revision: int, now: float) -> None:
        """Apply a put (``value``) or delete (None) of a key under ``requests/``;
        a malformed one (its record, or a report or drain key that does not
        end in a node id) is reported and counts for nothing."""
        k = self.keys
        if key.startswith(k.drain_requests):
            try:
                node_id = id_in_key(key, k.drain_requests)
                if value is not None:
                    DrainRequest.from_json(key, value)
            except MalformedRecordError as exc:
                if value is not None:
                    self._report_bad(exc, mod_revision)
                    self.draining.discard(k.node_id_of(key))  # a valid request replaced
                return
            (self.draining.add if value is not None else self.draining.discard)(node_id)
            return
        if key.startswith(k.frozen_reports):
            self._apply_frozen(key, value, mod_revision, now)
            return
        reports = {k.started_reports: self.started, k.done_reports: self.done,
                   k.suspect_reports: self.suspects}
        for prefix, table in reports.items():
            if key.startswith(prefix):
                try:
                    node_id = id_in_key(key, prefix)
                except MalformedRecordError as exc:
                    if value is not None:
                        self._report_bad(exc, mod_revision)
                    return
                if value is None:
                    table.pop(node_id, None)
                    return
                try:
                    report = Report.from_json(key, value)
                except MalformedRecordError as exc:
                    self._report_bad(exc, mod_revision)
                    table.pop(node_id, None)  # garbage replaced a report: it says nothing now
                    return
                if table is self.started:
                    self.started[node_id] = report.round
                elif table is self.done:
                    self.done[node_id] = (report.round, now)
                else:
                    self.suspects[node_id] = (now, mod_revision)
                return
        if value is None:
            self.restarts.pop(key, None)
            return
        try:
            self.restarts[key] = RestartRequest.from_json(key, value)
        except MalformedRecordError as exc:
            self._report_bad(exc, mod_revision)

    def _apply_frozen(self, key: str, value: bytes | None, mod_revision: int,
                      now: float) -> None:
        try:
            node_id = id_in_key(key, self.keys.frozen_reports)
            if value is None:
                self.frozen.pop(node_id, None)
                return
            self.frozen[node_id] = (FrozenReport.from_json(key, value), mod_revision, now)
        except MalformedRecordError as exc:
            if value is not None:
                self._report_bad(exc, mod_revision)
                self.frozen.pop(self.keys.node_id_of(key), None)

    def frozen_reports(self) -> dict[str, FrozenReport]:
        """The frozen reports about the registered nodes' current
        registrations (a report older than a registration is about a
        previous agent with that id)."""
        return {n: report for n, (report, rev, _) in self.frozen.items()
                if n in self.nodes and rev > self.nodes[n][1]}

    def revoked_as_frozen(self, current: Round) -> frozenset[str]:
        """The members of ``current`` whose lease was revoked as frozen in it
        (by any decider)."""
        rounds = (current.number, current.workers_round)
        return frozenset(n for n, (report, _, _) in self.frozen.items()
                         if report.confirmed_by and report.round in rounds)

    def suspect(self, node_id: str, now: float, revision: int) -> None:
        """The leader's own verdict (a member did not start in time)."""
        self.suspects[node_id] = (now, revision)

    def observed(self, current: Round | None, round_revision: int = 0) -> Observed:
        """What :func:`decide` needs; ``round_revision`` is the store revision
        ``current`` was written at: a node registered after it is a newcomer
        to that round, whatever its id, unless it says it still runs that
        round's workers (its lease ran out while etcd was down)."""
        joined = sorted(self.nodes.values(), key=lambda pair: pair[1])
        registered_at = {info.node_id: rev for info, rev in joined}
        return Observed(
            current=current,
            alive=tuple(info for info, _ in joined),
            first_seen=dict(self.first_seen),
            restart_requests=tuple(self.restarts.values()),
            draining=frozenset(self.draining),
            # A registration that says it runs a round's workers has started them.
            started={**self.started, **{info.node_id: max(info.running_round,
                                                          self.started.get(info.node_id, 0))
                                        for info, _ in joined if info.running_round}},
            done=dict(self.done),
            suspects=self._suspected_since(registered_at),
            registered_since_round=frozenset(
                info.node_id for info, rev in joined if rev > round_revision
                and (current is None
                     or info.running_round not in (current.number, current.workers_round))),
            checkpointed_since=frozenset(
                info.node_id for info, rev in joined if rev < self.checkpoint_revision),
        )

    def _suspected_since(self, registered_at: dict[str, int]) -> dict[str, float]:
        """When each suspect was last suspected: by an unreachable report about
        its current registration, or by a confirmed frozen report, whichever
        came later (an old revocation must not hide a new suspicion)."""
        since = {n: at for n, (at, rev) in self.suspects.items()
                 if rev > registered_at.get(n, 0)}
        for n, (report, _, at) in self.frozen.items():
            if report.confirmed_by:
                since[n] = max(at, since.get(n, at))
        return since

    def standby_addrs(self, members: AbstractSet[str]) -> tuple[str, ...]:
        """Agent addresses of the registered nodes that are not ``members``,
        the longest registered first, at most STANDBY_WITNESSES of them.
        ``members`` is a set: the leader asks after every decision, and a
        tuple's search made that O(N^2) in a round of N members."""
        addrs = (info.addr for info, _ in sorted(self.nodes.values(), key=lambda p: p[1])
                 if info.node_id not in members and info.addr)
        return tuple(itertools.islice(addrs, STANDBY_WITNESSES))
