"""A deterministic simulated cluster: N real agents (``agent.daemon.Agent`` over
real ``RendezvousNode``s) with fake workers over one in-memory etcd, a fake
clock and a fault schedule, all in one thread.

``run(seed)`` builds the cluster and the schedule from the seed, runs it in
steps of ``DT`` simulated seconds, and checks after every step:

* at most one round's workers train at any moment (no zombie group);
* the committed checkpoint never goes back (an older round's or an older
  step's) and never disappears;
* when the job ends in success, every member's workers exited 0 on their own
  (none was stopped or killed); a failure says why;
* after the last fault, the job ends within the horizon (no deadlock, no
  livelock) and every agent exits;
* no round forms once the failures it counts exceed the restart budget, and
  a job failed for its budget counts one failure more than the budget;
* no worker is started for a round that continues another's workers (the
  round written again after garbage replaced it);
* with the memory tier on (:mod:`tests.sim.memory`, which checks these at
  each restore): the memory set restored is complete, of one round and of
  complete slots; never of an older round or an older step than the disk's
  latest commit; a state its round's group trained; and, when at most one
  node of the previous group is missing and replication was current for it,
  at most one snapshot interval behind where that group got.

Profiles (``run(seed, profile=...)``) draw different clusters and schedules:
``mixed`` (every kind of fault, see :func:`tests.sim.faults.make_schedule`),
``budget`` (more failures than a small restart budget allows: the job-failure
path), ``partition`` (nodes or whole rounds cut off from etcd, with
standbys that keep it, and no leader's fence: the cut-off nodes' stop rule
alone must keep a zombie group from training) and ``memory`` (the memory tier
always on, faults that lose or keep a node's memory, see
:func:`tests.sim.faults.make_memory_schedule`). The memory tier runs in
:data:`MEMORY_SHARE` of the other profiles' seeds, with a snapshot interval
and a replication lag drawn per seed. Odd seeds keep every round's roster out of
its record, as a large job's rounds do (:mod:`elastic.rendezvous.round_record`).

The same seed gives the same run, bit for bit: replay a failure with
``python -m tests.sim --seed N -v``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import random
import traceback
from dataclasses import dataclass, field

from agent.config import AgentConfig
from agent.daemon import TICK_S, Agent, RoundChanged
from elastic.errors import ElasticError, MalformedRecordError, exit_code_for
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import NodeInfo, Outcome, Round
from elastic.rendezvous.node import SESSION_CHECK_S, RendezvousNode
from elastic.rendezvous import buckets, round_record
from elastic.rendezvous.round_record import from_reads, parse_head
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore
from tests.sim.faults import (
    Fault,
    make_budget_schedule,
    make_memory_schedule,
    make_partition_schedule,
    make_schedule,
)
from tests.sim.memory import Choose, draw_memory_tier
from tests.sim.world import FakeMesh, FakeServer, FakeSupervisor, Network, NodeStore, Workers

DT = 0.25
HORIZON_S = 240.0
JOB = "sim"
# systemd's Restart=on-failure with RestartPreventExitStatus=0 1 2 4.
NO_RESTART_CODES = (0, 1, 2, 4)
PROFILES = ("mixed", "budget", "partition", "memory")
MEMORY_SHARE = 0.5  # of the mixed schedules, those that run with the memory tier


def agent_config(node_id: str, min_nodes: int, max_nodes: int, max_restarts: int
                 ) -> AgentConfig:
    """A simulated node's agent configuration (short timeouts: simulated seconds)."""
    return AgentConfig(
        job_id=JOB, etcd="sim", standalone=False, min_nodes=min_nodes,
        max_nodes=max_nodes, nproc_per_node=2, node_id=node_id, max_restarts=max_restarts,
        restart_window_s=3600.0, checkpoint_dir=None, hang_timeout_s=4.0, lease_ttl_s=3.0,
        settle_s=0.5, join_timeout_s=600.0, start_timeout_s=12.0,
        exit_barrier_timeout_s=20.0, scale_up_wait_s=0.0, listen="sim:0",
        advertise_addr=f"host-{node_id}", state_dir="/nonexistent", log_dir="/nonexistent",
        log_format="text", metrics_port=0, stop_grace_s=1.0, drain_exit_code=0,
        prestart=False, warm_sets=1, connect_timeout_s=1.0, script="train.py", module=None,
        script_args=())


class _Later:
    """The agent, for callbacks of parts built before it."""

    agent: Agent | None = None

    def running_round(self) -> int:
        return self.agent.running_round() if self.agent is not None else 0


@dataclass
class Proc:
    """One elasticd process (an incarnation of a node)."""

    node_id: str
    incarnation: int
    conn: NodeStore
    server: FakeServer
    supervisor: FakeSupervisor
    rdzv: RendezvousNode
    agent: Agent
    exit_code: int | None = None  # set once it exited
    killed: bool = False
    stalled: bool = False  # its loops make no progress (slow etcd calls, or frozen)
    frozen: bool = False  # SIGSTOP of the whole process (its memory tier's thread too)
    # When each loop's thread wakes next with nothing arriving (simulated time;
    # the rendezvous loop's in wall time, as it computes it).
    agent_wakes_at: float = 0.0
    rdzv_wakes_at: float = 0.0


@dataclass
class Node:
    node_id: str
    proc: Proc | None = None
    incarnations: int = 0
    restart_at: float | None = None  # systemd brings it back then
    gone: bool = False  # drained, or exited for good


@dataclass
class Result:
    seed: int
    violations: list[str] = field(default_factory=list)
    outcome: Outcome = Outcome.NONE
    reason: str = ""
    ended_at: float | None = None
    rounds: int = 0
    steps_committed: int = 0
    schedule: list[Fault] = field(default_factory=list)
    memory: str = ""  # the memory tier's settings ("" when off)
    restored_from_memory: int = 0  # groups that resumed from a memory snapshot

    @property
    def ok(self) -> bool:
        return not self.violations


class Cluster:
    """One run. ``memory``: the memory tier on or off (None: as the profile draws it);
    ``choose``: its restore rule (default: the real one)."""

    def __init__(self, seed: int, *, verbose: bool = False, profile: str = "mixed",
                 memory: bool | None = None, choose: Choose | None = None):
        if profile not in PROFILES:
            raise ValueError(f"no simulator profile {profile!r} (one of {', '.join(PROFILES)})")
        self.seed = seed
        self.profile = profile
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock, synchronous=True)
        self.keys = JobKeys(JOB)
        self.network = Network()
        self.max_restarts = 8
        if profile == "partition":
            # Standbys that keep etcd when a whole round is cut off from it.
            n = self.rng.choice((3, 4))
            self.max_nodes = self.rng.randint(1, n - 1)
            self.min_nodes = 1
        else:
            n = self.rng.choice((2, 3, 3, 4))
            # Sometimes fewer places than nodes: the rest wait as standbys.
            self.max_nodes = self.rng.choice((n, n, n - 1)) if n > 2 else n
            self.min_nodes = self.rng.randint(1, self.max_nodes)
        low, high = (40, 60) if profile == "budget" else (16, 30)
        self.workers = Workers(self.network, step_s=0.5, total_steps=self.rng.randint(low, high),
                               ckpt_every=4, init_timeout_s=30.0, crash_delay_s=0.5, form_s=0.5,
                               rng=random.Random(self.rng.random()),
                               latest_step=self._latest_checkpoint)
        self.nodes: dict[str, Node] = {f"n{i}": Node(f"n{i}") for i in range(n)}
        if profile == "budget":
            self.max_restarts = self.rng.randint(1, 3)
            self.schedule = make_budget_schedule(self.rng, sorted(self.nodes), self.max_restarts)
        elif profile == "partition":
            self.schedule = make_partition_schedule(self.rng, sorted(self.nodes))
        elif profile == "memory":
            self.schedule = make_memory_schedule(self.rng, sorted(self.nodes))
        else:
            self.schedule = make_schedule(self.rng, sorted(self.nodes), self.min_nodes)
        for name in self.nodes:
            self.workers.finish_delay[name] = self.rng.choice((0.0, 0.0, 1.0, 5.0))
        self.result = Result(seed, schedule=list(self.schedule))
        always = True if profile == "memory" else None
        self.workers.memory = draw_memory_tier(seed, always if memory is None else memory,
                                               MEMORY_SHARE, choose)
        self.result.memory = self.workers.memory.settings if self.workers.memory else ""
        self.latest_ckpt: tuple[int, int] | None = None
        self._parsed_latest: tuple[int, tuple[int, int]] = (0, (0, 0))
        self.final: Round | None = None
        self.cut_rounds: dict[Fault, list[Proc]] = {}
        self.continuations: set[int] = set()  # rounds that keep an earlier one's workers
        self.last_round: Round | None = None
        self.quiet_at = max((f.at + f.duration for f in self.schedule), default=0.0)

    # ------------------------------------------------------------ processes

    def now(self) -> float:
        return self.clock.monotonic()

    def start(self, node: Node) -> None:
        node.incarnations += 1
        node.restart_at = None
        config = agent_config(node.node_id, self.min_nodes, self.max_nodes, self.max_restarts)
        addr = f"{node.node_id}.{node.incarnations}:1"
        conn = NodeStore(self.store, random.Random(self.rng.random()))
        server = FakeServer(addr)
        self.network.servers[addr] = (node.node_id, server)
        mesh = FakeMesh(self.network, node.node_id)
        inbox: queue.Queue = queue.Queue()
        agent_of = _Later()
        info = NodeInfo(node_id=node.node_id, host=config.advertise_addr, nproc=2, addr=addr,
                        master_port=1)
        rdzv = RendezvousNode(conn, config.rendezvous(), info, clock=self.clock,
                              on_round=lambda _r: inbox.put(RoundChanged()),
                              takeover=lambda old: old.host == info.host and old.addr != addr
                              and not mesh.answers(old.addr),
                              port_picker=lambda _host: 1,
                              fence=None if self.profile == "partition"
                              else lambda addrs: mesh.fence(addrs, node.node_id),
                              running_round=lambda: agent_of.running_round())
        supervisor = FakeSupervisor(self.workers, node.node_id, self.now)
        agent = Agent(config, conn, rdzv, supervisor, server, mesh, inbox=inbox,
                      clock=self.clock)
        server.agent = agent
        agent_of.agent = agent
        proc = Proc(node.node_id, node.incarnations, conn, server, supervisor, rdzv, agent)
        node.proc = proc
        self.workers.on_exit[node.node_id] = inbox.put
        self.workers.agents[node.node_id] = agent
        try:
            agent.start(threaded=False)
        except ElasticError as exc:
            self.exited(node, exit_code_for(exc), f"could not start: {exc}")

    def exited(self, node: Node, code: int, why: str) -> None:
        proc = node.proc
        proc.exit_code = code
        self.say(f"{node.node_id}.{proc.incarnation} exited {code}: {why}")
        if not proc.killed:
            proc.agent.shutdown()
        proc.server.stop()
        proc.conn.kill()
        self.workers.agents.pop(node.node_id, None)
        self.workers.on_exit.pop(node.node_id, None)
        if self.workers.memory is not None:  # the agent removes its memory directory
            self.workers.memory.lose(node.node_id, self.now())
        if code in NO_RESTART_CODES:
            node.gone = True
        else:
            node.restart_at = self.now() + 1.0

    def kill(self, node: Node, restart_after: float) -> None:
        """SIGKILL: no clean-up at all; the lease lives on until its TTL."""
        proc = node.proc
        if proc is None or proc.exit_code is not None:
            return
        proc.killed = True
        self.workers.on_exit.pop(node.node_id, None)
        proc.supervisor.kill()
        proc.server.stop()
        proc.conn.kill()
        proc.exit_code = 137
        self.workers.agents.pop(node.node_id, None)
        if self.workers.memory is not None:  # its reaper removes its memory directory
            self.workers.memory.lose(node.node_id, self.now())
        node.restart_at = self.now() + restart_after

    def live_procs(self) -> list[Proc]:
        return [n.proc for n in self.nodes.values()
                if n.proc is not None and n.proc.exit_code is None]

    # --------------------------------------------------------------- faults

    def apply(self, fault: Fault) -> None:
        self.say(f"fault: {fault}")
        node = self.nodes.get(fault.node)
        proc = node.proc if node and node.proc and node.proc.exit_code is None else None
        kind = fault.kind
        if kind == "join":
            self.nodes[fault.node] = Node(fault.node)
            self.workers.finish_delay[fault.node] = 0.0
            self.start(self.nodes[fault.node])
        elif kind == "outage":
            self.store.set_outage(True)
        elif kind == "cut_round":
            # The last valid round (garbage may lie over it): its members run its workers.
            members = self.last_round.node_ids if self.last_round else ()
            self.cut_rounds[fault] = [self.nodes[m].proc for m in members
                                      if self.nodes[m].proc and self.nodes[m].proc.exit_code is None]
            for proc in self.cut_rounds[fault]:
                proc.conn.cut()
        elif kind == "leader_loss":
            kv = self.store.peek(self.keys.leader)
            if kv is not None and not self.store.outage:
                self.store.expire_session(kv.lease)
        elif kind == "garbage_round":
            # Not over the job's final round: no agent is left to write it again,
            # and a node joining later would wait out its join timeout.
            if not self.store.outage and self.final is None:
                self.store.put(self.keys.round, b"garbage")
        elif proc is None:
            return
        elif kind == "kill_agent":
            self.kill(node, fault.duration)
        elif kind == "crash_worker":
            live = [w for w in proc.supervisor.current if w.alive]
            if live:
                self.workers.end(live[0], 1, self.now())
        elif kind == "hang_worker":
            for w in proc.supervisor.current[:1]:
                w.hung = True
        elif kind in ("cut_store", "cut_both"):
            proc.conn.cut()
        if kind in ("cut_peers", "cut_both"):
            self.network.cut_off.add(fault.node)
        elif kind == "store_errors":
            proc.conn.error_rate = 0.3
        elif kind == "slow_store":
            proc.stalled = True
        elif kind == "freeze":
            proc.stalled = proc.frozen = True
            proc.conn.freeze()
            for w in proc.supervisor.current:
                w.frozen = True
        elif kind == "ambiguous":
            proc.conn.ambiguous_rate = 0.3
        elif self.store.outage:
            return  # etcd is down: nothing done to it lands
        elif kind == "expire_lease" and proc.rdzv.lease_id is not None:
            self.store.expire_session(proc.rdzv.lease_id)
        elif kind == "drain":
            self.store.put(self.keys.drain_request(fault.node), b'{"by": "elasticctl"}')

    def heal(self, fault: Fault) -> None:
        self.say(f"healed: {fault}")
        if fault.kind == "outage":
            self.store.set_outage(False)
        for proc in self.cut_rounds.pop(fault, []):
            if proc.exit_code is None:
                proc.conn.heal()
        if fault.kind in ("cut_peers", "cut_both"):
            self.network.cut_off.discard(fault.node)
        node = self.nodes.get(fault.node)
        proc = node.proc if node and node.proc and node.proc.exit_code is None else None
        if proc is None:
            return
        if fault.kind in ("cut_store", "cut_both"):
            proc.conn.heal()
        elif fault.kind == "store_errors":
            proc.conn.error_rate = 0.0
        elif fault.kind in ("slow_store", "freeze"):
            proc.stalled = proc.frozen = False
            if fault.kind == "freeze":
                proc.conn.thaw()
                for w in proc.supervisor.current:
                    w.frozen = False
        elif fault.kind == "ambiguous":
            proc.conn.ambiguous_rate = 0.0

    # ------------------------------------------------------------------ run

    def say(self, text: str) -> None:
        if self.verbose:
            print(f"[t={self.now() - 1000:7.2f}] {text}")

    def run(self) -> Result:
        for node in list(self.nodes.values()):
            self.start(node)
        due = sorted(self.schedule, key=lambda f: f.at)
        heals = sorted((f for f in self.schedule if f.duration and f.kind != "kill_agent"),
                       key=lambda f: f.at + f.duration)
        start = self.now()
        while self.now() - start < HORIZON_S:
            t = self.now() - start
            while due and due[0].at <= t:
                self.apply(due.pop(0))
            while heals and heals[0].at + heals[0].duration <= t:
                self.heal(heals.pop(0))
            for node in self.nodes.values():
                if node.restart_at is not None and self.now() >= node.restart_at:
                    self.start(node)
            try:
                self.step_all()
            except Exception:  # a bug in the agent or the rendezvous: the seed shows it
                self.result.violations.append("unexpected error: " + traceback.format_exc())
                return self.result
            self.check()
            if self.result.violations:
                return self.result
            if self.final is not None and not self.live_procs() and not due:
                break
            self.clock.advance(DT)
        self.check_end()
        return self.result

    def step_all(self) -> None:
        """One step of every process: rendezvous loops, then agent loops (each
        sees what the other wrote through the store), then the workers.

        A loop runs a pass when its thread would wake: something arrived, or
        its timer ran out (the agent's every TICK_S, the rendezvous loop's
        every SESSION_CHECK_S or at the time its last pass asked for)."""
        self.store.deliver_pending()
        for proc in self.live_procs():
            if not proc.stalled and (proc.rdzv.has_news()
                                     or self.clock.wall() >= proc.rdzv_wakes_at):
                wake_at = proc.rdzv.pump()
                proc.rdzv_wakes_at = self.clock.wall() + SESSION_CHECK_S
                if wake_at is not None:
                    proc.rdzv_wakes_at = min(proc.rdzv_wakes_at, wake_at)
        self.store.deliver_pending()
        self.network.update()
        for node in list(self.nodes.values()):
            proc = node.proc
            if proc is None or proc.exit_code is not None or proc.stalled:
                continue
            if proc.agent.inbox.empty() and self.now() < proc.agent_wakes_at:
                continue
            proc.agent_wakes_at = self.now() + TICK_S
            try:
                proc.agent.step(0)
            except ElasticError as exc:
                proc.agent.fail(exc)
                self.exited(node, exit_code_for(exc), str(exc))
                continue
            if proc.agent.state.final:
                self.exited(node, proc.agent.exit_code, proc.agent.outcome_reason)
        if self.workers.memory is not None:  # its thread runs beside the agent's loops
            self.workers.memory.replicate_all(
                {p.node_id: p.agent.view.round for p in self.live_procs() if not p.frozen},
                self.now(), self.network.connected)
        self.workers.advance(self.now())

    # ----------------------------------------------------------- invariants

    def _latest_checkpoint(self) -> tuple[int, int]:
        kv = self.store.peek(self.keys.checkpoint_latest)
        if kv is None:
            return (0, 0)
        if self._parsed_latest[0] != kv.mod_revision:  # parsed once per commit, not per step
            record = json.loads(kv.value)
            self._parsed_latest = (kv.mod_revision, (record["step"], record["round"]))
        return self._parsed_latest[1]

    @staticmethod
    def _workers_round(kv) -> int | None:
        """The round whose workers the round key's round runs (None: no readable round)."""
        if kv is None:
            return None
        try:
            return parse_head(kv.key, kv.value, kv.version).workers_round
        except MalformedRecordError:
            return None

    def check(self) -> None:
        v = self.result.violations
        if self.workers.memory is not None:  # what its restores found, as they happen
            self.workers.memory.report(self.result)
        training = self.workers.training()
        if len(training) > 1:
            v.append(f"rounds {[g.round for g in training]} train at the same time")
        started = {g.round for g in self.workers.groups.values()} & self.continuations
        if started:
            v.append(f"workers started for round(s) {sorted(started)}, which only continue "
                     "an earlier round's workers")
        latest = self._latest_checkpoint()
        if self.latest_ckpt is not None:
            if latest == (0, 0):
                v.append(f"committed checkpoint {self.latest_ckpt} disappeared")
            elif latest[0] < self.latest_ckpt[0] or latest[1] < self.latest_ckpt[1]:
                v.append(f"committed checkpoint went back from {self.latest_ckpt} to {latest}")
        kv = self.store.peek(self.keys.round)
        if latest != (0, 0) and latest != self.latest_ckpt:
            # Commits happen after the rendezvous moved in a step, so the round
            # is the one the commit was fenced by; the record keeps the workers'
            # round, which a round written again (Round.continues) continues.
            now_round = kv.version if kv else 0
            if latest[1] not in (now_round, self._workers_round(kv)):
                v.append(f"a checkpoint of round {latest[1]} (step {latest[0]}) was committed "
                         f"while the job was in round {now_round}")
            self.latest_ckpt = latest
            self.result.steps_committed = latest[0]
        if kv is None or self.final is not None or kv.version == self.result.rounds:
            return
        try:
            r = from_reads(self.keys, [kv], self.store.peek_prefix(self.keys.rosters))
        except MalformedRecordError as exc:
            if kv.value != b"garbage":  # not what a garbage_round fault wrote
                v.append(f"the round key holds garbage: {exc}")
            return
        self.result.rounds = r.number
        self.last_round = r
        self.check_buckets(kv, r, v)
        if r.continues:
            self.continuations.add(r.number)
        self.check_budget(r)
        if r.outcome:
            self.final = r
            self.result.outcome, self.result.reason = r.outcome, r.reason
            self.result.ended_at = self.now() - 1000
            self.check_outcome(r)

    def check_buckets(self, kv, r: Round, v: list[str]) -> None:
        """A round whose record names buckets of its roster: every member
        finds its own line, as the whole roster has it, in its bucket (what a
        node that lacks the roster takes the round from)."""
        head = parse_head(kv.key, kv.value, kv.version)
        if head.buckets is None:
            return
        count, root = head.buckets
        for m in r.members:
            number = buckets.bucket_of(m.node_id, count)
            stored = self.store.peek(self.keys.roster_bucket(head.roster, number))
            try:
                text = buckets.open_bucket(kv.key, stored.value if stored else b"", number,
                                           count, root)
                found = buckets.BucketRoster(kv.key, head.roster, len(r.members),
                                             r.world_size, number, count, text).member(m.node_id)
            except MalformedRecordError as exc:
                v.append(f"round {r.number}: bucket {number} of its roster is not the one "
                         f"its record names: {exc}")
                return
            if found != m:
                v.append(f"round {r.number}: node {m.node_id}'s bucket says {found}, the "
                         f"roster {m}")

    def check_budget(self, r: Round) -> None:
        """Failures are counted within the whole run (the window is an hour)."""
        spent = len(r.failures) > self.max_restarts
        if spent and r.outcome is not Outcome.FAILED:
            self.result.violations.append(
                f"round {r.number} ({r.outcome or 'no outcome'}) counts {len(r.failures)} "
                f"failures, over the budget of {self.max_restarts}")
        elif r.outcome is Outcome.FAILED and "restart budget spent" in r.reason \
                and len(r.failures) != self.max_restarts + 1:
            self.result.violations.append(
                f"the job failed for its budget ({self.max_restarts}) counting "
                f"{len(r.failures)} failures")

    def check_outcome(self, final: Round) -> None:
        v = self.result.violations
        if final.outcome is Outcome.FAILED:
            if not final.reason:
                v.append("the job failed without a reason")
            return
        last = final.continues or final.number - 1  # the round whose workers finished
        spawned = [w for w, _ in self.workers.exits if w.round == last]
        running = [w for g in self.workers.groups.values() if g.round == last
                   for w in g.workers if w.alive]
        if running:
            v.append(f"job declared succeeded while workers of round {last} still ran: "
                     f"{[(w.node_id, w.rank) for w in running]}")
        bad = [(w.node_id, w.rank, w.exit_code) for w in spawned
               if w.exit_code != 0 or w.stopped]
        if bad:
            v.append(f"job declared succeeded but workers of round {last} did not all exit 0 "
                     f"on their own: {bad}")
        members = set(final.node_ids)
        if {w.node_id for w in spawned} != members:
            v.append(f"job declared succeeded but not every member of round {last} ran: "
                     f"{sorted(members)} vs {sorted({w.node_id for w in spawned})}")

    def check_end(self) -> None:
        v = self.result.violations
        if self.final is None:
            v.append(f"no outcome {HORIZON_S:.0f} s in (faults ended at {self.quiet_at:.1f} s): "
                     f"round {self.result.rounds}, committed step {self.result.steps_committed}, "
                     f"agents {[(p.node_id, p.agent.state.value) for p in self.live_procs()]}")
        elif self.live_procs():
            v.append(f"job {self.final.outcome} but agents still run: "
                     f"{[(p.node_id, p.agent.state.value) for p in self.live_procs()]}")


def run(seed: int, *, verbose: bool = False, profile: str = "mixed",
        memory: bool | None = None, choose: Choose | None = None) -> Result:
    """Run one schedule of ``profile`` (one of PROFILES). Quiet unless
    ``verbose`` (then the agents log too). ``memory`` and ``choose``: see
    :class:`Cluster`."""
    if not verbose:
        logging.disable(logging.CRITICAL)
    try:
        with _rosters(stored=seed % 2 == 1):
            return Cluster(seed, verbose=verbose, profile=profile, memory=memory,
                           choose=choose).run()
    finally:
        if not verbose:
            logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _rosters(stored: bool):
    """Odd seeds run their rounds as a large job's are, whatever their size:
    no roster in the round record (stored, read by the nodes that lack it,
    rebuilt by the others from a delta). The parity draws nothing from the
    seed's generator, so schedules stay as they were."""
    inline = round_record.INLINE_BYTES
    round_record.INLINE_BYTES = 0 if stored else inline
    try:
        yield
    finally:
        round_record.INLINE_BYTES = inline
