"""elasticd: the per-node agent.

The agent is a thin loop around the pure :func:`agent.reactor.react`: what
happens (a round committed, a worker exited, a peer's health, the lease, a
drain, a signal, time passing) arrives in its inbox as a typed event; ``react``
returns the agent's next view, which holds its one state, and the commands.
The loop has :mod:`agent.lifecycle` check the reaction's transitions, then
applies the commands in order: transitions published, the worker supervisor,
the rendezvous, the peer mesh, the GPU gate (:mod:`agent.gpu_gate`). Its parts
are passed in (``Agent.from_config`` wires the real ones), so the fault
simulator runs whole clusters of agents in one process.

What the agent must get into etcd is retried on every pass of the loop until
etcd takes it (:mod:`agent.intents`, :mod:`agent.publishing`): nothing it must
do is lost to a transient etcd error, and a stop of the workers never waits on
etcd. The gRPC services (:mod:`agent.services`) answer from the view on their
own threads and post what must change the agent to its inbox.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import sys
import time
from typing import Any, Callable, Protocol

from agent import config as agent_config
from agent import hardening, localfiles, reactor
from agent.assign import startup_env, worker_envs
from agent.goodput import GoodputTracker, row as goodput_row
from agent.gpu_gate import GpuGate
from agent.gpu_health import NO_GPU_READER, GpuReader
from agent.grpc_server import AgentServer
from agent.hang_report import HangReporter, VerdictOnly
from agent.health import PeerHealth, WorkerTable, hung_workers, last_sign_of_life
from agent.health import next_hang_verdict_at
from agent.intents import DrainKey, Intents
from agent.lifecycle import AgentState, Lifecycle, check_path
from agent.memory_node import MemoryTier
from agent.logsetup import LogSetup, keep_secrets
from agent.metrics import NO_METRICS, AgentMetrics, NoMetrics
from agent.nvml import NvmlReader
from agent.peers import GrpcPeerMesh
from agent.probe import LEADER_CHECK_S
from agent.publishing import Publisher, StatusDigest, status_of, summary_line
from agent.reactor import AgentView
from agent.sdnotify import SystemdNotifier
from agent.stack_dumps import LocalWorker, StackCollector
from agent.services import AgentService, WorkerChannel
from agent.status_record import StatusRecord
from agent.straggler_watch import StragglerWatch, drain_as_asked
from agent.supervisor import WorkerExit, WorkerSupervisor
from elastic import __version__, errorfile
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    EXIT_INTERNAL,
    EXIT_JOB_FAILED,
    EXIT_NODE_UNFIT,
    EXIT_OK,
    ElasticError,
    JobEndedError,
    StoreError,
    exit_code_for,
)
from elastic.hostport import HostPort
from elastic.joblog import JobLogger
from elastic.net import free_port, relax_grpc_blocking_waits
from elastic.rendezvous.api import NodeInfo, Round
from elastic.rendezvous.node import RendezvousNode
from elastic.store import PASSWORD_ENV, open_store
from elastic.store.api import Store

S = AgentState
# How often the loop looks at worker health and the lease when nothing else wakes
# it, while time matters at every pass (a round starting, the lease in doubt) or
# a write waits for etcd.
TICK_S = 0.5
# Otherwise it sleeps until the reactor's next deadline (reactor.next_tick_at),
# at most this long: the status key and the systemd status lag by no more.
STEADY_TICK_S = 2.0
# The liveness health service (elastic.v1.Liveness) says NOT_SERVING once the
# loop has not completed a pass this long (plus the workers' stop grace, the
# longest a pass may legitimately take).
LOOP_STALL_S = 30.0
# A failure's restart request is sent at once, before the workers are stopped (the
# reactor puts it first), so that the leader forms the round and the other members
# stop their workers meanwhile; it holds the stop up for no longer than this when
# etcd is slow or out of reach (it then goes with the pass's flush, after the stop).
REQUEST_AT_ONCE_S = 0.25
# A node that joins a running job registers once its warm workers are ready
# (the round that admits it stops every member's workers until its own start),
# or after this long (a pool that cannot warm must not keep it out).
JOIN_WARM_WAIT_S = 60.0


class Supervisor(Protocol):
    """What the agent needs of :class:`agent.supervisor.WorkerSupervisor`."""

    def warm_up(self) -> None: ...
    def start_round(self, round_number: int, envs: list[dict[str, str]]) -> None: ...
    def stop(self, timeout_s: float | None = None) -> list[WorkerExit]: ...
    def shutdown(self) -> None: ...
    def workers(self) -> list: ...
    def warm_workers(self) -> list: ...


class Server(Protocol):
    """What the agent needs of :class:`agent.grpc_server.AgentServer`."""

    def set_serving(self, serving: bool) -> None: ...
    def stop(self) -> None: ...


class PeerMesh(Protocol):
    """What the agent needs to reach its peers (see :class:`agent.peers.GrpcPeerMesh`)."""

    def watch(self, addr: str, on_change) -> Any: ...
    def probe(self, addr: str, on_silent) -> Any: ...
    def answers(self, addr: str, timeout_s: float = ...) -> bool: ...
    def check_store(self, addrs: tuple[str, ...], on_answer) -> None: ...
    def fence(self, addrs: tuple[str, ...], asker: str) -> bool: ...


@dataclasses.dataclass(frozen=True)
class RoundChanged:
    """Posted by the rendezvous (its ``on_round``); the loop reads the latest round itself."""


class _Later:
    """Calls to a part of the agent, which is built after the server that takes them."""

    def __init__(self, part: Callable[[], Any]):
        self._part = part

    def __getattr__(self, name: str):
        return getattr(self._part(), name)


class Agent:
    """A node agent for one job. ``run()`` returns the process exit code."""

    def __init__(self, config: agent_config.AgentConfig, store: Store,
                 rendezvous: RendezvousNode, supervisor: Supervisor, server: Server,
                 peers: PeerMesh, *, inbox: queue.Queue, socket_path: str = "",
                 heartbeat_socket: str = "", clock: Clock = SYSTEM_CLOCK,
                 notifier: SystemdNotifier | None = None, metrics: NoMetrics = NO_METRICS,
                 gpus: GpuReader = NO_GPU_READER, sleep: Callable[[float], None] = time.sleep,
                 memory: MemoryTier | None = None,
                 hang_reporter: HangReporter | VerdictOnly | None = None):
        self.config = config
        self.memory = memory  # the memory tier (--memory-tier), None when off
        self.metrics = metrics
        self.store = store
        self.rdzv = rendezvous
        self.supervisor = supervisor
        self.server = server
        self.peers = peers
        self.inbox = inbox
        self.socket_path = socket_path
        self.heartbeat_socket = heartbeat_socket
        self.clock = clock
        self.settings = config.reactor_settings()
        self.view = AgentView(state=S.INIT, waiting_since=clock.monotonic())
        self.log = JobLogger(logging.getLogger("elasticd"), config.job_id, config.node_id,
                             lambda: self.view.round_number)
        # Calls from the loop are short: a node cut off from etcd must keep
        # judging its lease and its workers.
        timeout_s = min(1.0, config.lease_ttl_s / 4)
        self.publisher = Publisher(store, rendezvous.keys, config.node_id, clock, metrics,
                                   timeout_s)
        self.lifecycle = Lifecycle(config.job_id, config.node_id,
                                   publish=self.publisher.transition, clock=clock)
        self.intents = Intents(rendezvous, timeout_s)
        self.drain_key = DrainKey(store, rendezvous.keys, config.node_id, timeout_s, self.log)
        self.gpus = GpuGate(config, gpus, supervisor, clock, sleep, self.log)
        self.commit_log = EtcdCommitLog(store, rendezvous.keys, clock, config.node_id)
        self.workers = WorkerTable()
        # Where the job's time goes, as this node sees it (fed in _react and by heartbeats).
        self.goodput = GoodputTracker(clock.monotonic(), config.goodput_window_s)
        # Who broke the job, read from every member's stacks at a hang verdict.
        self.hang_reporter = hang_reporter or VerdictOnly()
        # Which rank is persistently slower than its peers (--straggler-*).
        self.stragglers = StragglerWatch(config.stragglers, store, rendezvous.keys,
                                         config.node_id, clock, event=self.publisher.event,
                                         drain=drain_as_asked(config.node_id, inbox,
                                                              config.tls, self.log),
                                         metrics=metrics, log=self.log, timeout_s=timeout_s)
        self.channel = WorkerChannel(self)  # the workers' gRPC service
        self.service = AgentService(self)  # operators' and peers'
        self._peer_watch: Any = None
        self._peer_probe: Any = None
        self._last_tick: tuple[reactor.Tick, float] | None = None  # and when it was measured
        metrics.count_workers_with(lambda: [w.state for w in self.status_record().workers]
                                   if self.view.running_round else [])
        if memory is not None:
            metrics.watch_memory_tier(memory.status)
        metrics.watch_goodput(lambda: self.goodput.snapshot(self.clock.monotonic()))
        self.notifier = notifier or SystemdNotifier(environ={})
        self._last_pass = clock.monotonic()

    @classmethod
    def from_config(cls, config: agent_config.AgentConfig, store: Store,
                    clock: Clock = SYSTEM_CLOCK,
                    notifier: SystemdNotifier | None = None) -> "Agent":
        """Wire the real parts: gRPC server (bound here, so the rendezvous can
        advertise its address), worker supervisor, rendezvous node, peers."""
        inbox: queue.Queue = queue.Queue()
        built: list[Agent] = []  # the agent, once built (after the parts that call it)
        # The node's private directory (0700), its worker socket and rank logs.
        files = localfiles.prepare(config.state_dir, config.log_dir, config.job_id,
                                   config.node_id)
        # Before anything serves: a memory root that cannot be used ends the start here.
        memory = _open_memory_tier(config, built, clock)
        metrics = _serve_metrics(config)
        server = AgentServer(config.listen, files.socket_path,
                             control=_Later(lambda: built[0].service if built else None),
                             heartbeats=_Later(lambda: built[0].channel if built else None),
                             liveness=lambda: not built or built[0].loop_alive(),
                             tls=config.tls, probe_listen=config.probe_listen)
        server.start()
        peers = GrpcPeerMesh(config.tls)
        host = config.advertise_addr
        addr = str(HostPort(host, HostPort.parse(server.address).port))
        info = NodeInfo(node_id=config.node_id, host=host, nproc=config.nproc_per_node,
                        addr=addr, master_port=free_port(host), version=__version__,
                        rack=config.rack)
        rendezvous = RendezvousNode(
            store, config.rendezvous(), info, clock=clock,
            on_round=lambda _r: inbox.put(RoundChanged()),
            # The previous agent of this id is provably gone when it ran on
            # this host and its address no longer answers (systemd restart).
            takeover=lambda old: old.host == host and old.addr != addr
            and not peers.answers(old.addr),
            fence=lambda addrs: peers.fence(addrs, config.node_id),
            running_round=lambda: built[0].view.running_round if built else 0,
            probe=lambda addr: peers.answers(addr, LEADER_CHECK_S),
            ready_to_join=_join_gate(lambda: supervisor, clock))
        supervisor = WorkerSupervisor(
            **config.supervisor_options(), log_dir=files.log_dir,
            on_exit=lambda e: inbox.put(_exit_event(e)),
            worker_env=startup_env(config.nproc_per_node, dict(os.environ),
                                   config.advertise_addr),
            clock=clock)
        reporter = HangReporter(
            StackCollector(files.log_dir, config.node_id), peers, config.node_id,
            workers_of=lambda: [LocalWorker(w.rank, w.pid) for w in supervisor.workers()
                                if w.alive],
            health_of=lambda: built[0].workers.snapshot() if built else [], clock=clock,
            log=JobLogger(logging.getLogger("elasticd.hangs"), config.job_id, config.node_id,
                          lambda: built[0].view.round_number if built else 0),
            read_whole=lambda: rendezvous.latest_round)
        built.append(cls(config, store, rendezvous, supervisor, server, peers, inbox=inbox,
                         socket_path=files.socket_path,
                         heartbeat_socket=server.heartbeat_socket or "", clock=clock,
                         notifier=notifier, metrics=metrics,
                         gpus=NvmlReader() if config.gpu_check != "off" else NO_GPU_READER,
                         memory=memory, hang_reporter=reporter))
        return built[0]

    # ------------------------------------------------------------ running

    def run(self) -> int:
        """Take part in the job until it ends or this node leaves; returns the exit code."""
        try:
            self.start()
            while not self.state.final:
                self.step(self.next_pass_in())
        except ElasticError as exc:
            self.fail(exc)
            raise
        finally:
            self.shutdown()
        return self.exit_code

    def start(self, *, threaded: bool = True) -> None:
        """Join the rendezvous (``threaded=False``: the caller pumps it).
        Raises NodeUnfitError, before joining, when this node's GPUs fail
        ``--gpu-check enforce``."""
        self.gpus.before_joining()
        # A drain request is for the agent it was made for: one left behind by an
        # earlier agent of this node (killed before it could leave) must not drain
        # this one, so it goes before this agent registers.
        self.drain_key.withdraw()
        self.rdzv.start(thread=threaded)
        self.supervisor.warm_up()
        self._react(reactor.Joined("registered with the rendezvous" if self.rdzv.registered
                                   else f"joined the rendezvous; {self.rdzv.registration.problem}"))
        self.inbox.put(RoundChanged())

    @property
    def state(self) -> AgentState:
        """The agent's state: the reactor's (any thread)."""
        return self.view.state

    def running_round(self) -> int:
        """The round whose workers run here now (0: none); any thread."""
        return self.view.running_round

    @property
    def exit_code(self) -> int:
        if self.view.exit_code is not None:
            return self.view.exit_code
        return EXIT_OK if self.state is S.SUCCEEDED else EXIT_JOB_FAILED

    @property
    def outcome_reason(self) -> str:
        return self.view.outcome_reason

    def fail(self, exc: ElasticError) -> None:
        """The agent cannot go on: it ends FAILED, ``exc`` its reason (an agent
        that has ended already stays as it ended)."""
        self._react(reactor.GaveUp(str(exc)))

    def step(self, block_s: float) -> None:
        """React to what arrived (waiting up to ``block_s`` for the first
        event), then to the passing of time; then retry pending intents and
        publish the status. Raises ElasticError when the agent cannot go on."""
        pending = []
        try:
            pending.append(self.inbox.get(timeout=block_s) if block_s > 0
                           else self.inbox.get_nowait())
            while True:
                pending.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        pending.append(None)  # the tick
        for item in pending:
            if self.state.final:
                break
            try:
                event = self._tick() if item is None else (
                    self._round_event() if isinstance(item, RoundChanged) else item)
                if event is not None:
                    self._react(event)
            except StoreError as exc:
                # etcd blips must not stop training: look again on the next pass.
                self.log.warning("store error, retrying: %s", exc)
                self.metrics.store_error("round_read" if isinstance(item, RoundChanged)
                                         else "react")
                if isinstance(item, RoundChanged):
                    self.inbox.put(item)
        self._watch_stragglers()
        self.flush()
        self._pass_done()

    def loop_alive(self) -> bool:
        """Whether the loop completed a pass recently (any thread): what the
        liveness health service and systemd's watchdog report."""
        stall = LOOP_STALL_S + self.config.stop_grace_s
        return self.clock.monotonic() - self._last_pass < stall

    def _pass_done(self) -> None:
        """A pass of the loop is complete: note it for the liveness probe, ping
        systemd's watchdog, and tell systemd the state (READY=1 the first time
        the node is registered with the rendezvous)."""
        self._last_pass = self.clock.monotonic()
        self.notifier.watchdog()
        status = summary_line(self.lifecycle.published, self.view)
        (self.notifier.ready if self.rdzv.registered else self.notifier.status)(status)

    def flush(self) -> None:
        """Tell etcd what is pending: intents first, then the events and the status (when
        due), under this node's lease. Each call is short (a fraction of the lease TTL) and a
        pass stops at the first failure, so a node cut off from etcd is never held up by it:
        whatever did not go through waits for the next pass."""
        try:
            self.intents.flush(self.view)
            lease = self.rdzv.lease_id
            if lease is not None:
                self.publisher.flush(lease, self._status_digest(), self.status_record)
        except StoreError as exc:
            self.log.debug("etcd did not take everything yet (will retry): %s", exc)
            self.metrics.store_error("flush")

    def _watch_stragglers(self) -> None:
        """Publish this node's step times; as leader, judge every member's."""
        rdzv = self.rdzv
        try:
            self.stragglers.run(self.clock.monotonic(), lease=rdzv.lease_id,
                                running=self.view.round if self.view.running_round else None,
                                leading=rdzv.latest_round if rdzv.is_leader else None,
                                standbys=rdzv.standby_addrs)
        except StoreError as exc:
            self.log.debug("step times not exchanged with etcd yet (will retry): %s", exc)
            self.metrics.store_error("flush")

    def status_record(self) -> StatusRecord:
        """This agent's status as published (any thread)."""
        now, pids = self.clock.monotonic(), {w.local_rank: w.pid for w in self.supervisor.workers()}
        record = status_of(self.config.node_id, self.lifecycle.published, self.view,
                           self.workers.snapshot(), pids, now)
        return dataclasses.replace(
            record, goodput=goodput_row(self.goodput.snapshot(now)),
            stragglers=self.stragglers.rows(),
            memory_tier=self.memory.status() if self.memory is not None else None)

    def _status_digest(self) -> StatusDigest:
        """What decides whether :meth:`status_record` is worth a write now."""
        return StatusDigest.of(self.lifecycle.published, self.view, self.workers.steps(),
                               self.stragglers.rows())

    def _react(self, event: reactor.Event) -> None:
        """React to ``event``: the transitions checked before any command is
        applied (IllegalTransition: a bug in the reactor)."""
        before, now = self.view, self.clock.monotonic()
        after, commands = reactor.react(before, event, now, self.settings)
        check_path(before.state, (c.to for c in commands if isinstance(c, reactor.Transition)),
                   after.state)
        self.view = after
        self.metrics.observe(event, after, commands, now)
        self.goodput.observe(commands, now)
        for command in commands:
            self._apply(command)

    def _round_event(self) -> reactor.RoundCommitted | None:
        latest = self.rdzv.placed_round
        if latest is None:
            return None
        drain = (latest.member(self.config.node_id) is None and not latest.outcome
                 and self.drain_key.requested())
        return reactor.RoundCommitted(latest, drain, self.rdzv.registration.after)

    def _tick(self) -> reactor.Tick:
        now = self.clock.monotonic()
        workers = self.workers.snapshot()
        timeouts, count_from = self.config.hang_timeouts(), reactor.hangs_count_from(self.view, now)
        hung = hung_workers(workers, now, timeouts, count_from)
        signs = [t for w, _ in hung
                 if (t := last_sign_of_life(w, now, timeouts, count_from)) is not None]
        tick = reactor.Tick(
            hung=tuple(reason for _, reason in hung),
            hung_since=min(signs, default=None),
            next_hang_at=next_hang_verdict_at(workers, timeouts, count_from),
            lease_unconfirmed_s=reactor.lease_unconfirmed_s(self.rdzv.lease_confirmed_at, now),
            workers_stepped=bool(workers) and all(w.step >= 0 for w in workers),
            registration_problem=self.rdzv.registration.problem,
            standby_addrs=self.rdzv.standby_addrs)
        self._last_tick = (tick, now)
        return tick

    def next_pass_in(self) -> float:
        """How long the next pass may wait for an event: :data:`TICK_S` while
        writes wait for etcd or time matters at every pass; else until the
        reactor's next deadline, from :data:`TICK_S` to :data:`STEADY_TICK_S`."""
        if self._last_tick is None or self.intents \
                or self.publisher.pending(self.rdzv.lease_id, self._status_digest()):
            return TICK_S
        tick, measured_at = self._last_tick
        wake_at = reactor.next_tick_at(self.view, tick, measured_at, self.settings)
        return min(STEADY_TICK_S, max(TICK_S, wake_at - self.clock.monotonic()))

    # ---------------------------------------------------------- commands

    def _apply(self, command: reactor.Command) -> None:
        if isinstance(command, reactor.Transition):
            self.lifecycle.publish(command.to, command.reason, command.round)
        elif isinstance(command, reactor.StartWorkers):
            self._start_workers(command.round, command.restart_count)
        elif isinstance(command, reactor.StopWorkers):
            self.server.set_serving(False)
            if command.grace is reactor.StopGrace.DRAIN and self.memory is not None:
                self.memory.before_planned_stop(self.supervisor.workers())
            self.supervisor.stop(timeout_s=command.grace_s(self.config.stop_grace_s,
                                                          self.config.failure_stop_grace_s))
        elif isinstance(command, (reactor.RequestRestart, reactor.Report)):
            self.intents.add(command)
            if isinstance(command, reactor.RequestRestart) and command.failure:
                # Before the stop that follows it (see REQUEST_AT_ONCE_S).
                self.intents.try_now(self.view, REQUEST_AT_ONCE_S)
        elif isinstance(command, reactor.WatchPeer):
            self._watch_peer(command.node_id, command.addr)
        elif isinstance(command, reactor.CheckPeersStore):
            asked = len(command.addrs)
            self.peers.check_store(command.addrs, lambda ages, answered: self.inbox.put(
                reactor.LeaseState(reactor.lease_unconfirmed_s(self.rdzv.lease_confirmed_at,
                                                               self.clock.monotonic()),
                                   ages, asked, answered)))
        elif isinstance(command, reactor.AnnounceDrain):
            self.drain_key.announce(command.reason)
        elif isinstance(command, reactor.Leave):
            self.flush()  # why it leaves (events, status), while its lease lasts
            self.rdzv.stop()  # the lease revoked: everyone sees it gone
            self.drain_key.withdraw()
        elif isinstance(command, reactor.CheckGpus):
            self.inbox.put(self.gpus.check(command, self.publisher.event))
        elif isinstance(command, reactor.AttributeHang):
            r = self.view.round
            if r is None:
                self.inbox.put(reactor.HangAttributed(command.round, command.verdict))
            else:
                self.hang_reporter.report(r, command.verdict, lambda found: self.inbox.put(
                    reactor.HangAttributed(command.round, found.reason, found.kind)))
        elif isinstance(command, reactor.Note):
            self.log.warning("%s", command.message)
        elif isinstance(command, reactor.Fail):
            raise command.error
        else:
            raise TypeError(f"not an agent command: {command!r}")

    def _start_workers(self, r: Round, restart_count: int) -> None:
        envs = worker_envs(r, self.config.node_id, job_id=self.config.job_id,
                           restart_count=restart_count, max_restarts=self.config.max_restarts,
                           agent_socket=self.socket_path,
                           heartbeat_socket=self.heartbeat_socket,
                           checkpoint_dir=self.config.checkpoint_dir,
                           hang_timeout_s=self.config.hang_timeout_s,
                           lease_ttl_s=self.config.lease_ttl_s, role=self.config.role,
                           memory_dir=self.memory.path if self.memory else None)
        self.workers.reset([int(env["RANK"]) for env in envs], self.clock.monotonic())
        # Before the start, which may wait for the template: peers fail a member not serving.
        self.server.set_serving(True)
        self.supervisor.start_round(r.number, envs)

    def _watch_peer(self, node_id: str | None, addr: str) -> None:
        """Follow the peer's health, and probe it when --freeze-timeout is on."""
        for part in (self._peer_watch, self._peer_probe):
            if part is not None:
                part.stop()
        self._peer_watch = self._peer_probe = None
        if node_id is not None:
            self._peer_watch = self.peers.watch(addr, lambda health: self.inbox.put(
                reactor.PeerHealthChanged(node_id, PeerHealth(health))))
            if self.settings.freeze_timeout_s > 0:
                self._peer_probe = self.peers.probe(addr, lambda silent_s: self.inbox.put(
                    reactor.PeerSilent(node_id, silent_s)))

    def shutdown(self) -> None:
        self.flush()  # the final state, if etcd can be reached
        self._watch_peer(None, "")
        self.supervisor.shutdown()
        self.rdzv.stop()
        self.server.stop()
        if self.memory is not None:
            self.memory.close()  # no snapshot outlives the agent (the job's end included)
        self.metrics.close()
        self.gpus.close()


def _serve_metrics(config: agent_config.AgentConfig) -> NoMetrics:
    """The agent's metrics, served at ``--metrics-port`` (none without one)."""
    if not config.metrics_port:
        return NO_METRICS
    metrics = AgentMetrics(config.job_id, config.node_id)
    metrics.serve(HostPort.parse(config.listen).host, config.metrics_port)
    return metrics


def _join_gate(supervisor: Callable[[], WorkerSupervisor], clock: Clock) -> Callable[[], bool]:
    """Whether this node joins a running job now: its warm workers are ready,
    or JOIN_WARM_WAIT_S passed since this gate was made."""
    made_at = clock.monotonic()
    return lambda: (supervisor().ready_for_a_round()
                    or clock.monotonic() - made_at > JOIN_WARM_WAIT_S)


def _open_memory_tier(config: agent_config.AgentConfig, built: list["Agent"],
                      clock: Clock) -> MemoryTier | None:
    """The node's memory tier with --memory-tier (None without); it reads the
    agent's view, once the agent is built. Raises ConfigError."""
    if not config.memory_tier:
        return None
    return MemoryTier.open(
        root=config.memory_root, job_id=config.job_id, node_id=config.node_id,
        nproc=config.nproc_per_node, min_free_bytes=config.memory_min_free_bytes,
        tls=config.tls, round_of=lambda: built[0].view.round if built else None,
        workers_running=lambda: bool(built and built[0].view.running_round),
        logger=JobLogger(logging.getLogger("elasticd"), config.job_id, config.node_id,
                         lambda: built[0].view.round_number if built else 0),
        clock=clock)


def _exit_event(e: WorkerExit) -> reactor.WorkerExited:
    """The reactor's event for a reaped worker, with its root cause when it
    failed and left one (read here, off the loop: the reactor does no I/O)."""
    cause = None
    if e.exit_code != 0 and not e.stopped and e.error_file:
        cause = errorfile.read_root_cause(e.error_file)
    return reactor.WorkerExited(round=e.round, local_rank=e.local_rank, rank=e.rank, pid=e.pid,
                                exit_code=e.exit_code, signal=e.signal, stopped=e.stopped,
                                cause=cause.message if cause else "", log_path=e.log_path)


def main(argv: list[str] | None = None) -> int:
    """elasticd's entry point; returns the exit code (:data:`EXIT_CODES_HELP`):
    an unexpected exception is logged with its traceback and gives
    EXIT_INTERNAL, never 1 (which says the job failed)."""
    logs = LogSetup()
    log = logging.getLogger("elasticd")
    server = None
    # First thing: /proc/<pid>/environ keeps the password whatever os.environ
    # says later, readable by the workers (same user) until this.
    hidden = PASSWORD_ENV in os.environ and hardening.make_non_dumpable()
    try:
        config = agent_config.load(argv)
        relax_grpc_blocking_waits()
        job_log = JobLogger(log, config.job_id, config.node_id)
        keep_secrets(config, hidden, job_log)
        logs.configured(config)
        endpoint = config.etcd
        if config.standalone:
            from elastic.store.server import EtcdServer

            # On Unix sockets in a 0700 directory: no other local user can
            # reach it (on loopback anyone could drain or restart the job).
            server = EtcdServer(private=True).start()
            endpoint = server.endpoint
            job_log.info("started a private etcd at %s (a socket only this user can reach)",
                         endpoint)
        # Before the workers' environment is copied from ours: they must not
        # talk to systemd in the agent's name.
        notifier = SystemdNotifier()
        with open_store(endpoint, connect_timeout_s=config.connect_timeout_s,
                        security=config.etcd_security) as store:
            agent = Agent.from_config(config, store, notifier=notifier)
            logs.follow_round(lambda: agent.view.round_number)

            def on_signal(signum: int, _frame) -> None:
                notifier.stopping(f"leaving the job: received {signal.Signals(signum).name}")
                agent.inbox.put(reactor.Signalled(signum))

            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, on_signal)
            code = agent.run()
            if agent.state is S.FAILED and agent.view.exit_code is None:
                print(f"elasticd: job {config.job_id} failed: {agent.outcome_reason}",
                      file=sys.stderr)
            elif code == EXIT_NODE_UNFIT:
                print(f"elasticd: {agent.outcome_reason}", file=sys.stderr)
            return code
    except JobEndedError as exc:
        logs.configured(None)  # the held lines first, in order
        print(f"elasticd: {exc}", file=sys.stderr)
        return exc.exit_code
    except ElasticError as exc:
        logs.configured(None)
        print(f"elasticd: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except Exception:  # noqa: BLE001 - a bug: say so, with its traceback, and a code of its own
        log.exception("elasticd stopped on an internal error (a bug: please report it with "
                      "this log)")
        return EXIT_INTERNAL
    finally:
        logs.configured(None)
        if server is not None:
            server.stop()
        logs.close()


if __name__ == "__main__":
    sys.exit(main())
