"""An agent's part in straggler detection, run by its loop: publish, and as leader, judge and act.

Every agent keeps its ranks' step times, wall and busy, from their heartbeats
(:class:`agent.step_times.StepTimes`, fed by the worker channel) and writes
them to ``step-times/<node>`` under its lease when they changed, at most once
per period (:class:`agent.step_times.PublishRule`). The leader reads that
prefix once per period, passes the members' times for the running round to
the pure rule (:func:`agent.stragglers.judge`) and reports each rank it
names, once per episode:

* a warning in its log and a ``straggler`` event (:mod:`elastic.events`),
  both saying what was done, and again when the episode ends;
* ``elasticd_stragglers{action}`` and ``elasticd_straggler_slowdown{rank,
  straggler_node}`` (:mod:`agent.metrics`);
* its status record, so ``elasticctl status`` lists the stragglers named now.

With ``--straggler-action replace`` the leader also drains the straggler's
node (the path ``elasticctl drain`` takes) when a standby waits to take its
place, once per node and round; without a standby it only reports, and says
so. A new round renumbers the ranks: what was judged of the last one is
dropped. Off (nothing published, nothing read) without a policy.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from agent import reactor
from agent.metrics import NoMetrics
from agent.peers import request_drain
from agent.status_record import StragglerRow
from agent.step_times import PublishRule, StepTimeRecord, StepTimes
from agent.stragglers import RankTime, Straggler, StragglerPolicy, StragglerState, judge
from agent.tls import AgentTLS
from elastic.clock import Clock
from elastic.errors import ElasticError, MalformedRecordError
from elastic.events import KIND_STRAGGLER
from elastic.joblog import JobLogger
from elastic.keyspace import JobKeys
from elastic.records import id_in_key
from elastic.rendezvous.api import Member, Round
from elastic.store.api import Store

# drain(member, reason): make that member's node leave the job for a standby.
Drain = Callable[[Member, str], None]
# event(round, kind, message): queue an event of this node.
Event = Callable[[int, str, str], None]


def drain_as_asked(own_id: str, inbox: queue.Queue, tls: AgentTLS | None,
                   log: JobLogger) -> Drain:
    """The drain the leader asks for, as ``elasticctl drain`` does it: of its
    own node through its loop's inbox, of another through that agent's Drain
    call, on a thread of its own (the loop never waits on a peer)."""
    def drain(member: Member, reason: str) -> None:
        if member.node_id == own_id:
            inbox.put(reactor.DrainRequested(reason))
            return

        def ask() -> None:
            try:
                request_drain(member.addr, reason, tls=tls)
            except ElasticError as exc:
                log.warning("could not drain straggler node %s: %s", member.node_id, exc)

        threading.Thread(target=ask, name="elasticd-straggler-drain", daemon=True).start()

    return drain


class StragglerWatch:
    """Driven by the agent's loop (:meth:`run`); :attr:`times` is fed from any thread."""

    def __init__(self, policy: StragglerPolicy | None, store: Store, keys: JobKeys,
                 node_id: str, clock: Clock, *, event: Event, drain: Drain,
                 metrics: NoMetrics, log: JobLogger, timeout_s: float):
        self.policy = policy
        self.times = StepTimes()
        self._store = store
        self._keys = keys
        self._node_id = node_id
        self._clock = clock
        self._event = event
        self._drain = drain
        self._metrics = metrics
        self._log = log
        self._timeout_s = timeout_s
        period = policy.period_s() if policy else math.inf
        self._publish = PublishRule(period)
        self._lease: int | None = None
        self._judged_round = 0  # the workers' round judged; 0: none
        self._next_judge_at = -math.inf
        self._state = StragglerState()
        self._actions: dict[int, str] = {}  # rank named -> what was done
        self._drained: set[str] = set()  # nodes drained in the round judged
        self._bad_keys: set[str] = set()  # malformed records reported in it
        # key -> what its record said at its mod revision; kept across rounds.
        self._records: dict[str, _Parsed] = {}

    def run(self, now: float, *, lease: int | None, running: Round | None,
            leading: Round | None, standbys: tuple[str, ...]) -> None:
        """One pass: publish this node's step times for ``running`` (the round
        its workers run, under ``lease``); with ``leading`` (the latest round,
        when this agent leads), judge the members' times when the period is
        due. Raises StoreError (the next pass tries again)."""
        if self.policy is None:
            return
        if lease is not None and running is not None:
            self._publish_times(now, lease, running)
        if leading is None or leading.outcome:
            self._forget()
        elif now >= self._next_judge_at:
            self._next_judge_at = now + self.policy.period_s()
            self._judge(now, leading, standbys)

    def rows(self) -> tuple[StragglerRow, ...]:
        """The stragglers named now, for the status record (any thread)."""
        now, named, actions = self._clock.monotonic(), self._state.named, self._actions
        return tuple(StragglerRow(s.rank, s.node_id, round(s.step_s, 6), round(s.peers_s, 6),
                                  round(max(0.0, now - s.slow_since), 1),
                                  actions.get(s.rank, "reported"), s.measure)
                     for _, s in sorted(named.items()))

    def _publish_times(self, now: float, lease: int, running: Round) -> None:
        if lease != self._lease:  # a new lease: the key went with the old one
            self._lease = lease
            self._publish.forget()
        record = self.times.record()
        if record.round != running.workers_round or not self._publish.due(record, now):
            return
        self._store.put(self._keys.step_times_of(self._node_id), record.to_json(), lease=lease,
                        timeout_s=self._timeout_s)
        self._publish.written(record, now)

    def _forget(self) -> None:
        """Drop what was judged: another round, or no longer leading."""
        if self._state.named:
            self._metrics.stragglers_now(())
        self._state, self._actions, self._drained, self._bad_keys = (
            StragglerState(), {}, set(), set())
        self._judged_round = 0
        self._next_judge_at = -math.inf

    def _judge(self, now: float, latest: Round, standbys: tuple[str, ...]) -> None:
        if latest.workers_round != self._judged_round:
            self._forget()
            self._judged_round = latest.workers_round
        kvs, _ = self._store.get_prefix(self._keys.step_times, timeout_s=self._timeout_s)
        if len(self._records) > len(kvs):  # records of nodes gone: forget them
            present = {kv.key for kv in kvs}
            self._records = {k: v for k, v in self._records.items() if k in present}
        times = self._times_of(kvs, latest)
        verdict = judge(self._state, times, now, self.policy)
        self._state = verdict.state
        for s in verdict.named:
            self._name(s, now, latest, standbys)
        for s in verdict.cleared:
            message = (f"rank {s.rank} (node {s.node_id}) is no longer a straggler: "
                       f"{s.took()}, its peers' {s.peers_s:.3f} s")
            self._actions.pop(s.rank, None)
            self._log.info("%s.", message)
            self._event(latest.number, KIND_STRAGGLER, message)
        if verdict.named or verdict.cleared or verdict.state.named:
            self._metrics.stragglers_now((s.rank, s.node_id, s.ratio())
                                         for s in verdict.state.named.values())

    def _name(self, s: Straggler, now: float, latest: Round, standbys: tuple[str, ...]) -> None:
        """Report ``s`` everywhere, and drain its node when the policy says so."""
        outcome, action = "reported", "reported"
        if self.policy.action == "replace":
            member = latest.member(s.node_id)
            if s.node_id in self._drained:
                action = f"reported; node {s.node_id} is being drained already"
            elif not standbys:
                action = "reported; not replaced: no standby is waiting"
            elif member is not None:
                self._drained.add(s.node_id)
                outcome, action = "drained", (f"drained node {s.node_id}: a standby waits to "
                                              "take its place")
                self._drain(member, f"straggler: {s.reason(now)}")
        self._actions[s.rank] = action
        message = f"{s.reason(now)}; {action}"
        self._log.warning("%s.", message)
        self._event(latest.number, KIND_STRAGGLER, message)
        self._metrics.straggler_named(outcome)

    def _parsed(self, kv) -> _Parsed:
        """What ``kv`` says, parsed again only when it was written again: in a
        steady job most records stay as they were. Raises MalformedRecordError."""
        cached = self._records.get(kv.key)
        if cached is None or cached.revision != kv.mod_revision:
            node_id = id_in_key(kv.key, self._keys.step_times)
            record = StepTimeRecord.from_json(kv.key, kv.value)
            busy = record.busy_s
            cached = _Parsed(kv.mod_revision, node_id, record.round, tuple(
                RankTime(rank, node_id, step_s, busy.get(rank, 0.0))
                for rank, step_s in record.step_s.items()))
            self._records[kv.key] = cached
        return cached

    def _times_of(self, kvs: list, latest: Round) -> list[RankTime]:
        """The members' step times for ``latest``'s workers, one per rank; a
        record that is malformed, not a member's, of another round or naming
        a rank outside the world counts for nothing (a malformed one is
        logged once per round)."""
        times: dict[int, RankTime] = {}
        world, members = latest.world_size, frozenset(latest.node_ids)
        for kv in kvs:
            try:
                parsed = self._parsed(kv)
            except MalformedRecordError as exc:
                if kv.key not in self._bad_keys:
                    self._bad_keys.add(kv.key)
                    self._log.warning("ignores a step-time record: %s.", exc)
                continue
            if parsed.node_id not in members or parsed.round != latest.workers_round:
                continue
            for t in parsed.times:
                if t.rank < world:
                    times.setdefault(t.rank, t)
        return list(times.values())


@dataclass(frozen=True)
class _Parsed:
    """A node's step-time record as the leader keeps it between passes."""

    revision: int  # the key's mod revision
    node_id: str
    round: int
    times: tuple[RankTime, ...]
