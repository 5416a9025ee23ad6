"""elasticd: the per-node agent.

The agent is a thin loop around the pure :func:`agent.reactor.react`: what
happens (a round committed, a worker exited, a peer's health, the lease, a
drain, a signal, time passing) arrives in its inbox as a typed event; ``react``
returns the commands, and the loop applies them through the one state machine
(:mod:`agent.lifecycle`), the worker supervisor, the rendezvous and the peer
mesh. Its parts are passed in (``Agent.from_config`` wires the real ones), so
the fault simulator runs whole clusters of agents in one process.

Commands that must reach etcd exactly once (restart requests, reports to the
leader) are intents: kept and retried on every pass of the loop until etcd
takes them, and dropped once a newer round has made them moot. Nothing the
agent must do is lost to a transient etcd error, and a stop of the workers
never waits on etcd.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import logging.handlers
import math
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol

from agent import config as agent_config
from agent import gpu_health, grpc_input, hardening, localfiles, reactor
from agent.assign import startup_env, worker_envs
from agent.gpu_health import NO_GPU_READER, GpuAction, GpuObservation, GpuReader, NvmlReading
from agent.grpc_server import AgentServer
from agent.health import WorkerHealth, hung_workers, last_sign_of_life, next_hang_verdict_at
from agent.lifecycle import AgentState, Lifecycle, Transition
from agent.metrics import NO_METRICS, AgentMetrics, NoMetrics
from agent.nvml import NvmlReader
from agent.peers import GrpcPeerMesh
from agent.reactor import AgentView, Settings
from agent.sdnotify import SystemdNotifier
from agent.tls import etcd_bypass_warning
from agent.supervisor import Entrypoint, WorkerExit, WorkerSupervisor
from elastic import __version__, errorfile, events
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    EXIT_INTERNAL,
    EXIT_JOB_FAILED,
    EXIT_NODE_UNFIT,
    EXIT_OK,
    ElasticError,
    FencedError,
    GpuError,
    NodeUnfitError,
    InvalidRequestError,
    JobEndedError,
    MalformedRecordError,
    StoreError,
    exit_code_for,
)
from elastic.joblog import JobLogger, JsonFormatter
from elastic.net import free_port, relax_grpc_blocking_waits
from elastic.rendezvous.api import (
    DrainRequest,
    NodeInfo,
    ReportKind,
    RestartRequest,
    Round,
)
from elastic.rendezvous.node import RendezvousNode
from elastic.rendezvous.operator import request_operator_restart
from elastic.store import PASSWORD_ENV, open_store
from elastic.store.api import Put, Store
from elastic.v1 import agent_pb2

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
# The status key is rewritten at once when its meaning changes (state, round,
# failure, worker states), and for the step alone at most this often: a node's
# progress is read live from its agent, the record is the fallback for one that
# cannot be reached, and a write a few seconds per node would fill etcd at
# 1,000 nodes (and wake an idle agent for nothing).
STATUS_PROGRESS_S = 30.0
# Transitions kept for etcd while it cannot be reached; older ones are dropped.
_MAX_QUEUED_EVENTS = 50


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
    def answers(self, addr: str) -> bool: ...
    def check_store(self, addrs: tuple[str, ...], on_answer) -> None: ...
    def fence(self, addrs: tuple[str, ...], asker: str) -> bool: ...


@dataclasses.dataclass(frozen=True)
class RoundChanged:
    """Posted by the rendezvous (its ``on_round``); the loop reads the latest round itself."""


class _Handlers:
    """The gRPC services' view of the agent, which is built after its server."""

    agent: "Agent | None" = None

    def __getattr__(self, name: str):
        return getattr(self.agent, name)


class Agent:
    """A node agent for one job. ``run()`` returns the process exit code."""

    def __init__(self, config: agent_config.AgentConfig, store: Store,
                 rendezvous: RendezvousNode, supervisor: Supervisor, server: Server,
                 peers: PeerMesh, *, inbox: queue.Queue, socket_path: str = "",
                 heartbeat_socket: str = "", clock: Clock = SYSTEM_CLOCK,
                 notifier: SystemdNotifier | None = None, metrics: NoMetrics = NO_METRICS,
                 gpus: GpuReader = NO_GPU_READER, sleep: Callable[[float], None] = time.sleep):
        self.config = config
        self.gpus = gpus  # read before a round's workers start (--gpu-check)
        self._sleep = sleep  # only between GPU reads before joining (--gpu-check enforce)
        self.metrics = metrics  # before the lifecycle, which feeds it
        self.store = store
        self.rdzv = rendezvous
        self.supervisor = supervisor
        self.server = server
        self.peers = peers
        self.inbox = inbox
        self.socket_path = socket_path
        self.heartbeat_socket = heartbeat_socket
        self.clock = clock
        self.settings = Settings(node_id=config.node_id, nproc=config.nproc_per_node,
                                 lease_ttl_s=config.lease_ttl_s,
                                 join_timeout_s=config.join_timeout_s, job_id=config.job_id,
                                 drain_exit_code=config.drain_exit_code,
                                 gpu_check=config.gpu_check)
        self.view = AgentView(waiting_since=clock.monotonic())
        self.log = JobLogger(logging.getLogger("elasticd"), config.job_id, config.node_id,
                             lambda: self.view.round_number)
        self.lifecycle = Lifecycle(config.job_id, config.node_id, publish=self._publish,
                                   clock=clock)
        self.commit_log = EtcdCommitLog(store, rendezvous.keys, clock, config.node_id)
        self.workers: dict[int, WorkerHealth] = {}
        self._workers_lock = threading.Lock()
        self._intents: list[reactor.RequestRestart | reactor.Report] = []
        self._events: list[Put] = []  # transitions not yet written to etcd
        self._reports_lease: int | None = None  # the lease the reports were made under
        # Calls from the loop are short: a node cut off from etcd must keep
        # judging its lease and its workers.
        self._store_timeout_s = min(1.0, config.lease_ttl_s / 4)
        self._peer_watch: Any = None
        self._last_status_meaning: tuple | None = None
        self._last_status_step = -1  # the step the status record last carried
        self._last_status_at = -math.inf  # and when it was written
        self._last_tick: tuple[reactor.Tick, float] | None = None  # and when it was measured
        metrics.count_workers_with(self._worker_states)
        self.notifier = notifier or SystemdNotifier(environ={})
        self._last_pass = clock.monotonic()

    @classmethod
    def from_config(cls, config: agent_config.AgentConfig, store: Store,
                    clock: Clock = SYSTEM_CLOCK,
                    notifier: SystemdNotifier | None = None) -> "Agent":
        """Wire the real parts: gRPC server (bound here, so the rendezvous can
        advertise its address), worker supervisor, rendezvous node, peers."""
        inbox: queue.Queue = queue.Queue()
        handlers = _Handlers()
        # The node's private directory (0700), its worker socket and rank logs.
        files = localfiles.prepare(config.state_dir, config.log_dir, config.job_id,
                                   config.node_id)
        socket_path = files.socket_path
        metrics: NoMetrics = NO_METRICS
        if config.metrics_port:
            metrics = AgentMetrics(config.job_id, config.node_id)
            metrics.serve(config.listen.rpartition(":")[0], config.metrics_port)
        server = AgentServer(config.listen, socket_path, control=handlers, heartbeats=handlers,
                             liveness=lambda: handlers.agent is None
                             or handlers.agent.loop_alive(),
                             tls=config.tls, probe_listen=config.probe_listen)
        server.start()
        peers = GrpcPeerMesh(config.tls)
        host = config.advertise_addr
        addr = f"{host}:{server.address.rsplit(':', 1)[1]}"
        info = NodeInfo(node_id=config.node_id, host=host, nproc=config.nproc_per_node,
                        addr=addr, master_port=free_port(host), version=__version__)
        rendezvous = RendezvousNode(
            store, config.rendezvous(), info, clock=clock,
            on_round=lambda _r: inbox.put(RoundChanged()),
            # The previous agent of this id is provably gone when it ran on
            # this host and its address no longer answers (systemd restart).
            takeover=lambda old: old.host == host and old.addr != addr
            and not peers.answers(old.addr),
            fence=lambda addrs: peers.fence(addrs, config.node_id),
            running_round=lambda: handlers.agent.running_round() if handlers.agent else 0)
        supervisor = WorkerSupervisor(
            job_id=config.job_id, node_id=config.node_id, nproc=config.nproc_per_node,
            entrypoint=Entrypoint(script=config.script, module=config.module,
                                  args=config.script_args, no_python=config.no_python),
            log_dir=files.log_dir, stop_grace_s=config.stop_grace_s,
            prestart=config.prestart, warm_sets=config.warm_sets,
            on_exit=lambda e: inbox.put(_exit_event(e)),
            worker_env=startup_env(config.nproc_per_node, dict(os.environ),
                                   config.advertise_addr),
            console=config.console)
        agent = cls(config, store, rendezvous, supervisor, server, peers, inbox=inbox,
                    socket_path=socket_path, heartbeat_socket=server.heartbeat_socket or "",
                    clock=clock, notifier=notifier, metrics=metrics,
                    gpus=NvmlReader() if config.gpu_check != "off" else NO_GPU_READER)
        handlers.agent = agent
        return agent

    # ------------------------------------------------------------ running

    def run(self) -> int:
        """Take part in the job until it ends or this node leaves; returns the exit code."""
        try:
            self.start()
            while not self.lifecycle.state.final:
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
        self._check_gpus_before_joining()
        self.rdzv.start(thread=threaded)
        self.supervisor.warm_up()
        self.lifecycle.to(S.JOINING, "registered with the rendezvous" if self.rdzv.registered
                          else f"joined the rendezvous; {self.rdzv.registration_problem}")
        self.inbox.put(RoundChanged())

    def running_round(self) -> int:
        """The round whose workers run here now (0: none); any thread. Not
        while STARTING: the GPU check comes before the workers."""
        view = self.view
        return view.round_number if view.state in (S.RUNNING, S.DONE) else 0

    @property
    def exit_code(self) -> int:
        if self.view.exit_code is not None:
            return self.view.exit_code
        return EXIT_OK if self.lifecycle.state is S.SUCCEEDED else EXIT_JOB_FAILED

    @property
    def outcome_reason(self) -> str:
        return self.view.outcome_reason

    def fail(self, exc: ElasticError) -> None:
        """The agent cannot go on: record why and end in FAILED."""
        self.view = dataclasses.replace(self.view, outcome_reason=str(exc), state=S.FAILED)
        if not self.lifecycle.state.final:
            self.lifecycle.to(S.FAILED, str(exc), self.view.round_number)

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
            if self.lifecycle.state.final:
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
        view = self.view
        status = f"{self.lifecycle.state.value} in round {view.round_number}"
        if view.round is not None:
            status += f", world size {view.round.world_size}"
        if view.last_failure:
            status += f"; last failure: {view.last_failure}"
        if self.rdzv.registered:
            self.notifier.ready(status)
        else:
            self.notifier.status(status)

    def flush(self) -> None:
        """Tell etcd what is pending: intents first, then the status and
        events. Each call is short (a fraction of the lease TTL) and a pass
        stops at the first failure, so a node cut off from etcd is never held
        up by it: whatever did not go through waits for the next pass."""
        try:
            self._flush_intents()
            self._flush_publications()
        except StoreError as exc:
            self.log.debug("etcd did not take everything yet (will retry): %s", exc)
            self.metrics.store_error("flush")

    def _react(self, event: reactor.Event) -> None:
        before, now = self.view, self.clock.monotonic()
        self.view, commands = reactor.react(before, event, now, self.settings)
        self.metrics.observe(before, event, self.view, commands, now)
        for command in commands:
            self._apply(command)

    def _round_event(self) -> reactor.RoundCommitted | None:
        latest = self.rdzv.latest_round
        if latest is None:
            return None
        drain = (latest.member(self.config.node_id) is None and not latest.outcome
                 and self._drain_requested())
        return reactor.RoundCommitted(latest, drain_requested=drain)

    def _drain_requested(self) -> bool:
        """Whether etcd holds a valid drain request for this node (garbage at
        the key is logged and drains nothing, as the leader ignores it too)."""
        kv = self.store.get(self.rdzv.keys.drain_request(self.config.node_id),
                            timeout_s=self._store_timeout_s)
        if kv is None:
            return False
        try:
            DrainRequest.from_json(kv.key, kv.value)
        except MalformedRecordError as exc:
            self.log.warning("ignoring %s", exc)
            return False
        return True

    def _tick(self) -> reactor.Tick:
        now = self.clock.monotonic()
        with self._workers_lock:
            workers = list(self.workers.values())
        confirmed = self.rdzv.lease_confirmed_at
        hung = hung_workers(workers, now, self.config.hang_timeout_s)
        signs = [t for w, _ in hung
                 if (t := last_sign_of_life(w, now, self.config.hang_timeout_s)) is not None]
        tick = reactor.Tick(
            hung=tuple(reason for _, reason in hung),
            hung_since=min(signs, default=None),
            next_hang_at=next_hang_verdict_at(workers, self.config.hang_timeout_s),
            lease_unconfirmed_s=0.0 if confirmed is None else max(0.0, now - confirmed),
            workers_stepped=bool(workers) and all(w.step >= 0 for w in workers),
            registration_problem=self.rdzv.registration_problem,
            standby_addrs=self.rdzv.standby_addrs)
        self._last_tick = (tick, now)
        return tick

    def next_pass_in(self) -> float:
        """How long the next pass may wait for an event: :data:`TICK_S` while
        writes wait for etcd or time matters at every pass; else until the
        reactor's next deadline, from :data:`TICK_S` to :data:`STEADY_TICK_S`."""
        if self._last_tick is None or self._writes_pending():
            return TICK_S
        tick, measured_at = self._last_tick
        wake_at = reactor.next_tick_at(self.view, tick, measured_at, self.settings)
        return min(STEADY_TICK_S, max(TICK_S, wake_at - self.clock.monotonic()))

    def _writes_pending(self) -> bool:
        """Whether intents, events or a changed status still wait for etcd."""
        return bool(self._intents or self._events) or (
            self.rdzv.lease_id is not None and self._status_due())

    # ---------------------------------------------------------- commands

    def _apply(self, command: reactor.Command) -> None:
        if isinstance(command, reactor.Transition):
            self.lifecycle.to(command.to, command.reason, command.round)
        elif isinstance(command, reactor.StartWorkers):
            self._start_workers(command.round, command.restart_count)
        elif isinstance(command, reactor.StopWorkers):
            self.server.set_serving(False)
            self.supervisor.stop(timeout_s=command.grace_s(self.config.stop_grace_s,
                                                          self.config.failure_stop_grace_s))
        elif isinstance(command, (reactor.RequestRestart, reactor.Report)):
            self._intents.append(command)
        elif isinstance(command, reactor.WatchPeer):
            self._watch_peer(command.node_id, command.addr)
        elif isinstance(command, reactor.CheckPeersStore):
            asked = len(command.addrs)
            self.peers.check_store(command.addrs, lambda ages, answered: self.inbox.put(
                reactor.LeaseState(self._lease_unconfirmed_s(), ages, asked, answered)))
        elif isinstance(command, reactor.AnnounceDrain):
            self._announce_drain(command.reason)
        elif isinstance(command, reactor.Leave):
            self._leave(command.reason)
        elif isinstance(command, reactor.CheckGpus):
            self._check_gpus(command)
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
                           lease_ttl_s=self.config.lease_ttl_s, role=self.config.role)
        now = self.clock.monotonic()
        with self._workers_lock:
            self.workers = {i: WorkerHealth(local_rank=i, rank=int(env["RANK"]), started_at=now)
                            for i, env in enumerate(envs)}
        self.supervisor.start_round(r.number, envs)
        self.server.set_serving(True)

    def _read_gpus(self) -> NvmlReading:
        try:
            return self.gpus.read()
        except GpuError as exc:
            return NvmlReading(unavailable=str(exc))

    def _check_gpus_before_joining(self) -> None:
        """With ``--gpu-check enforce``, a node whose GPUs are unfit does not
        join at all: joining only to leave before the first round would
        restart the others' workers twice (each time systemd or Kubernetes
        starts the agent again). Waits, as before a round, for processes to
        let go of the GPUs (those of this node's previous agent, killed with
        it). Raises NodeUnfitError."""
        expected = self.config.gpu_expectation
        if self.config.gpu_check != "enforce" or not expected.selectors:
            return
        decision = gpu_health.decide_when_settled(
            lambda: GpuObservation(self._read_gpus()), expected, "enforce", self._sleep)
        if decision.action is GpuAction.LEAVE:
            raise NodeUnfitError(f"job {self.config.job_id}: node {self.config.node_id} does not "
                                 f"join: GPU check failed (--gpu-check enforce): "
                                 f"{decision.reason}")
        self.log.info("GPU check passed before joining: %s", decision.reason)

    def _check_gpus(self, command: reactor.CheckGpus) -> None:
        """Read the GPUs (NVML is not read when none is expected) and what is
        left of the last round's workers, judge them (agent.gpu_health.decide)
        and post the answer to the loop. A verdict is recorded as an event
        (elasticctl events and status) unless it says to wait, or passes a
        node that expects no GPU."""
        expected = self.config.gpu_expectation
        reading = (self._read_gpus() if expected.selectors
                   else NvmlReading(unavailable="not read: no GPUs expected"))
        last = self.supervisor.workers()
        ours = frozenset(w.pid for w in last)
        warm = frozenset(w.pid for w in self.supervisor.warm_workers())
        observed = GpuObservation(
            reading, leftovers=tuple(w.pid for w in last if w.alive), last_round_pids=ours,
            warm_pids=warm, foreign_pids=_live_pids_among(
                (p.pid for g in reading.gpus for p in g.processes), exclude=ours | warm))
        decision = gpu_health.decide(observed, expected, self.config.gpu_check, command.since,
                                     self.clock.monotonic())
        if decision.action is not GpuAction.WAIT and (
                decision.action is not GpuAction.PASS or expected.selectors):
            if decision.action is GpuAction.PASS:
                self.log.info("GPU check passed: %s", decision.reason)
            self._events.append(events.event_op(
                self.rdzv.keys, self.clock, self.config.node_id, command.round,
                gpu_health.EVENT_KINDS[decision.action], decision.reason))
            del self._events[:-_MAX_QUEUED_EVENTS]
        self.inbox.put(reactor.GpuChecked(command.round, decision))

    def _watch_peer(self, node_id: str | None, addr: str) -> None:
        if self._peer_watch is not None:
            self._peer_watch.stop()
            self._peer_watch = None
        if node_id is not None:
            self._peer_watch = self.peers.watch(
                addr, lambda status: self.inbox.put(reactor.PeerHealth(node_id, str(status))))

    def _announce_drain(self, reason: str) -> None:
        """Write this node's drain request (best effort: without it, leaving
        still works, by the lease's revocation)."""
        try:
            self.store.put(self.rdzv.keys.drain_request(self.config.node_id),
                           DrainRequest(by=self.config.node_id, reason=reason).to_json(),
                           timeout_s=self._store_timeout_s)
        except StoreError as exc:
            self.log.warning("could not record the drain (leaving anyway): %s", exc)

    def _leave(self, reason: str) -> None:
        """Leave for good: the drain request (AnnounceDrain) keeps the leader
        from choosing this node meanwhile; revoking the lease shows everyone
        it is gone."""
        keys = self.rdzv.keys
        self.flush()  # why it leaves (events, status), while its lease lasts
        self.rdzv.stop()
        try:
            self.store.delete(keys.drain_request(self.config.node_id),
                              timeout_s=self._store_timeout_s)
        except StoreError as exc:
            self.log.warning("could not remove the drain request: %s", exc)

    def _flush_intents(self) -> None:
        """Send the pending intents in order; drop those a newer round has
        made moot. Raises StoreError at the first that etcd does not take."""
        lease = self.rdzv.lease_id
        if lease is not None and lease != self._reports_lease:
            # Reports live under the lease: a new one (the old ran out) needs
            # them again, or the leader would wait for this node's "done".
            self._reports_lease = lease
            view = self.view
            if view.state is S.DONE:
                self._intents.append(reactor.Report(ReportKind.DONE, view.round_number))
        latest = self.rdzv.latest_round
        # About the round a newer one continues (Round.continues): still current.
        newest = latest.workers_round if latest else 0
        self._intents = [i for i in self._intents if i.round >= newest]
        while self._intents:
            intent = self._intents[0]
            if isinstance(intent, reactor.RequestRestart):
                self.rdzv.request_restart(intent.reason, intent.round, failure=intent.failure,
                                          timeout_s=self._store_timeout_s)
            else:
                self.rdzv.report(intent.kind, intent.round, intent.about,
                                 timeout_s=self._store_timeout_s)
            self._intents.pop(0)

    def _lease_unconfirmed_s(self) -> float:
        confirmed = self.rdzv.lease_confirmed_at
        return 0.0 if confirmed is None else max(0.0, self.clock.monotonic() - confirmed)

    # ------------------------------------------------------ gRPC handlers
    # Called from gRPC threads: read-only or posted to the loop.

    def heartbeat(self, req: agent_pb2.WorkerChannelHeartbeatRequest) -> tuple[bool, bool]:
        """(stop_requested, hold). Hold while this node's lease is unconfirmed
        and no etcd outage is proven: a node resumed after a freeze longer than
        its lease must not let its workers step before it learns whether a
        newer round has formed meanwhile."""
        if req.local_rank >= self.config.nproc_per_node:
            raise InvalidRequestError(f"Heartbeat: field 'local_rank' is {req.local_rank}, but "
                                      f"node {self.config.node_id} runs "
                                      f"{self.config.nproc_per_node} worker(s)")
        view = self.view
        current = view.round is not None and req.round == view.round.workers_round
        with self._workers_lock:
            w = self.workers.get(req.local_rank)
            if w is not None and current:
                w.on_heartbeat(self.clock.monotonic(), req.step, req.saving_for_s, req.exiting)
                step = max(x.step for x in self.workers.values())
                rate = min(x.step_rate() for x in self.workers.values())
        if w is not None and current:
            self.metrics.observe_heartbeat(step, rate)
        hold = (view.state is S.RUNNING and not view.store_down_noted
                and self._lease_unconfirmed_s() > self.config.lease_ttl_s / 2)
        return not current or view.state not in (S.RUNNING, S.DONE), hold

    def commit_checkpoint(self, entry: agent_pb2.CheckpointEntry) -> tuple[bool, str]:
        """Advance ``checkpoint/latest`` through the fenced commit log: a
        worker of an older round can never commit."""
        # Validated like the record it becomes (InvalidRequestError otherwise):
        # its path a plain name in the checkpoint root; how the save went is the
        # worker's word, and only what can be true is kept.
        commit = grpc_input.commit_entry(entry)
        view = self.view
        if view.round is not None and commit.round == view.round.workers_round:
            # Workers of a round written again (Round.continues) commit in the
            # round that continues theirs: its number is the fence now.
            commit = dataclasses.replace(commit, round=view.round.number)
        save_s, size_bytes = commit.save_s, commit.size_bytes
        try:
            self.commit_log.commit(commit)
        except FencedError as exc:
            return False, str(exc)
        except StoreError:
            self.metrics.store_error("checkpoint_commit")
            raise
        self.metrics.observe_save(entry.step, save_s, size_bytes)
        self.log.info("checkpoint of step %d committed (%s)", entry.step, entry.path)
        return True, ""

    def latest_checkpoint(self) -> agent_pb2.CheckpointEntry | None:
        latest = self.commit_log.latest()
        if latest is None:
            return None
        return agent_pb2.CheckpointEntry(step=latest.step, round=latest.round,
                                         world_size=latest.world_size, path=latest.path,
                                         time=latest.time, save_s=latest.save_s,
                                         size_bytes=latest.size_bytes)

    def report_restore(self, req: agent_pb2.WorkerChannelReportRestoreRequest) -> None:
        """Rank 0 restored a checkpoint: counted in the metrics (nothing else)."""
        self.metrics.observe_restore(req.restore_s, req.size_bytes)

    def report_checkpoint_failure(self, step: int, round_: int, rank: int,
                                  message: str) -> None:
        """A worker's save failed: a ``checkpoint`` event through the commit log
        (best effort; it never raises)."""
        self.commit_log.report_failure(step, round_, rank, message)

    def status(self) -> agent_pb2.AgentStatusResponse:
        view = self.view
        me = view.round.member(self.config.node_id) if view.round else None
        return agent_pb2.AgentStatusResponse(
            job_id=self.config.job_id, node_id=self.config.node_id,
            state=self.lifecycle.state.value, round=view.round_number,
            node_rank=me.node_rank if me else -1,
            world_size=view.round.world_size if view.round else 0,
            workers=[agent_pb2.WorkerStatus(**w) for w in self._worker_rows()],
            restarts=max(0, view.rounds_started - 1), last_failure=view.last_failure,
            version=__version__)

    def drain(self, reason: str) -> tuple[bool, str]:
        self.inbox.put(reactor.DrainRequested(reason or "drain requested over gRPC"))
        return True, f"node {self.config.node_id} will leave the job"

    def request_restart(self, reason: str) -> tuple[bool, int]:
        """An operator's restart (gRPC): taken at most once per
        --operator-restart-interval for the whole job; raises RateLimitedError
        when too soon, StoreError when etcd does not take it."""
        number = self.view.round_number
        request = RestartRequest(node_id=self.config.node_id, round=number,
                                 reason=reason or "restart requested over gRPC")
        request_operator_restart(self.store, self.rdzv.keys, request,
                                 interval_s=self.config.operator_restart_interval_s,
                                 now=self.clock.wall())
        return True, number

    def store_health(self, asker_has_store: bool = False, asker: str = ""
                     ) -> tuple[bool, float, bool]:
        """(etcd confirmed this agent's lease within half a TTL, seconds since,
        workers running). A peer that says it reaches etcd while this agent's
        lease goes unconfirmed proves this agent is the one cut off: the loop
        is told, and stops the workers."""
        confirmed = self.rdzv.lease_confirmed_at
        age = -1.0 if confirmed is None else max(0.0, self.clock.monotonic() - confirmed)
        reachable = self.rdzv.registered and 0 <= age <= self.config.lease_ttl_s / 2
        running = self.view.state in (S.STARTING, S.RUNNING)
        if asker_has_store and not reachable and running:
            # The asker confirmed its lease just now: it forms rounds.
            self.inbox.put(reactor.LeaseState(age, ((asker or "a peer", 0.0),), 1))
        return reachable, age, running

    # ------------------------------------------------------------ status

    def _worker_rows(self) -> list[dict]:
        now = self.clock.monotonic()
        pids = {w.local_rank: w.pid for w in self.supervisor.workers()}
        view = self.view
        rows = []
        with self._workers_lock:
            for i, w in sorted(self.workers.items()):
                exited = i in view.exited_ok
                state = "succeeded" if exited else (
                    "running" if w.last_heartbeat_at is not None or view.state is S.RUNNING
                    else "starting")
                rows.append({
                    "local_rank": i, "rank": w.rank, "pid": pids.get(i, 0), "state": state,
                    "last_step": w.step, "step_rate": round(w.step_rate(), 3),
                    "heartbeat_age_s": round(now - w.last_heartbeat_at, 2)
                    if w.last_heartbeat_at is not None else -1.0,
                    "exit_code": 0})
        return rows

    def _status_meaning(self) -> tuple:
        """What, changed, makes the status worth a write at once."""
        view = self.view
        return (self.lifecycle.state.value, view.round_number, view.last_failure,
                view.exited_ok)

    def _last_step(self) -> int:
        with self._workers_lock:
            return max((w.step for w in self.workers.values()), default=-1)

    def _status_due(self) -> bool:
        """Whether the status record is worth a write now: its meaning changed,
        or the step did and the record is :data:`STATUS_PROGRESS_S` old."""
        if self._status_meaning() != self._last_status_meaning:
            return True
        return (self._last_step() != self._last_status_step
                and self.clock.monotonic() - self._last_status_at >= STATUS_PROGRESS_S)

    def _status_record(self, rows: list[dict]) -> bytes:
        view = self.view
        me = view.round.member(self.config.node_id) if view.round else None
        last_step = max((r["last_step"] for r in rows), default=-1)
        return json.dumps({
            "node_id": self.config.node_id, "state": self.lifecycle.state.value,
            "round": view.round_number, "node_rank": me.node_rank if me else None,
            "workers": rows, "last_step": last_step,
            "step_rate": min((r["step_rate"] for r in rows), default=0.0),
            "restarts": max(0, view.rounds_started - 1), "last_failure": view.last_failure,
        }, sort_keys=True).encode()

    def _publish(self, t: Transition) -> None:
        """Queue a transition's event; the loop's flush writes it with the status."""
        self.metrics.observe_transition(t.after, self.clock.monotonic())
        self._events.append(events.event_op(
            self.rdzv.keys, self.clock, self.config.node_id, t.round, "state",
            f"{t.before.value} -> {t.after.value}: {t.reason}"))
        del self._events[:-_MAX_QUEUED_EVENTS]

    def _flush_publications(self) -> None:
        """Write the queued events, and the status key when its meaning changed
        (not for every heartbeat: at 1,000 nodes a write every few seconds
        each would fill etcd), in one transaction under this node's lease."""
        lease = self.rdzv.lease_id
        if lease is None:
            return
        queued = list(self._events)
        ops = list(queued)
        status = None
        if self._status_due():
            meaning, rows = self._status_meaning(), self._worker_rows()
            status = (meaning, max((r["last_step"] for r in rows), default=-1))
            ops.append(Put(self.rdzv.keys.status_of(self.config.node_id),
                           self._status_record(rows), lease=lease))
        if not ops:
            return
        self.store.txn([], ops, timeout_s=self._store_timeout_s)
        del self._events[:len(queued)]
        if status is not None:
            self._last_status_meaning, self._last_status_step = status
            self._last_status_at = self.clock.monotonic()

    def shutdown(self) -> None:
        self.flush()  # the final state, if etcd can be reached
        self._watch_peer(None, "")
        self.supervisor.shutdown()
        self.rdzv.stop()
        self.server.stop()
        self.metrics.close()
        self.gpus.close()

    def _worker_states(self) -> list[str]:
        """The state of each worker of the round running here (any thread)."""
        if self.running_round() == 0:
            return []
        return [row["state"] for row in self._worker_rows()]


def _live_pids_among(pids: Iterable[int], exclude: frozenset[int]) -> frozenset[int]:
    """Those of ``pids`` (NVML's, for GPU memory holders) that are live processes
    here and not in ``exclude``. In a container without the host's pid
    namespace NVML gives host pids, which are not found here: those count as
    possibly ours, and the check waits for them as for the last round's."""
    return frozenset(pid for pid in pids
                     if pid not in exclude and os.path.exists(f"/proc/{pid}"))


def _exit_event(e: WorkerExit) -> reactor.WorkerExited:
    """The reactor's event for a reaped worker, with its root cause when it
    failed and left one (read here, off the loop: the reactor does no I/O)."""
    cause = None
    if e.exit_code != 0 and not e.stopped and e.error_file:
        cause = errorfile.read_root_cause(e.error_file)
    return reactor.WorkerExited(round=e.round, local_rank=e.local_rank, rank=e.rank, pid=e.pid,
                                exit_code=e.exit_code, signal=e.signal, stopped=e.stopped,
                                cause=cause.message if cause else "", log_path=e.log_path)


class _LogSetup:
    """The agent's one log handler (stderr). Until the configuration is read
    (which itself logs, e.g. the advertised address) lines are held, then
    written in the format it asks for: text, or with ``--log-format json`` one
    JSON object per line (:class:`elastic.joblog.JsonFormatter`). The level
    comes from ELASTIC_LOG_LEVEL."""

    def __init__(self) -> None:
        self.stream = logging.StreamHandler(sys.stderr)
        self.stream.setFormatter(logging.Formatter(
            "%(asctime)s elasticd %(levelname)s: %(message)s"))
        self.held = logging.handlers.MemoryHandler(capacity=10_000,
                                                   flushLevel=logging.CRITICAL + 1)
        root = logging.getLogger()
        root.addHandler(self.held)
        level = os.environ.get("ELASTIC_LOG_LEVEL", "INFO").upper()
        root.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)

    def configured(self, config: agent_config.AgentConfig | None) -> None:
        """Write the held lines and all later ones in ``config``'s format
        (text when there is no valid configuration). Idempotent."""
        if self.held is None:
            return
        if config is not None and config.log_format == "json":
            self.stream.setFormatter(JsonFormatter(config.job_id, config.node_id))
        root = logging.getLogger()
        root.addHandler(self.stream)
        root.removeHandler(self.held)
        self.held.setTarget(self.stream)
        self.held.close()  # flushes to the target
        self.held = None

    def follow_round(self, round_of) -> None:
        """JSON lines that do not name their round get ``round_of()``."""
        if isinstance(self.stream.formatter, JsonFormatter):
            self.stream.formatter.round_of = round_of

    def close(self) -> None:
        logging.getLogger().removeHandler(self.stream)


def _keep_secrets(config: agent_config.AgentConfig, hidden: bool, log: JobLogger) -> None:
    """Once the config is read: the workers (user code) inherit our environment and
    must not get the etcd password (it is in ``config.etcd_security`` now); an agent
    that holds one is non-dumpable (``hidden``: made so before the config was read);
    mutual TLS over an etcd anyone may write is warned about."""
    os.environ.pop(PASSWORD_ENV, None)
    if config.etcd_security.password is not None and (hidden or hardening.make_non_dumpable()):
        log.info("The etcd password is held in memory: the agent is non-dumpable, so no "
                 "process of this user (the workers included) can read it from /proc/%d.",
                 os.getpid())
    bypass = etcd_bypass_warning(config.tls, config.etcd,
                                 etcd_tls_client=config.etcd_security.cert is not None,
                                 etcd_user=config.etcd_security.user is not None)
    if bypass is not None:
        log.warning("%s", bypass)


def main(argv: list[str] | None = None) -> int:
    """elasticd's entry point; returns the exit code (:data:`EXIT_CODES_HELP`):
    an unexpected exception is logged with its traceback and gives
    EXIT_INTERNAL, never 1 (which says the job failed)."""
    logs = _LogSetup()
    log = logging.getLogger("elasticd")
    server = None
    # First thing: /proc/<pid>/environ keeps the password whatever os.environ
    # says later, readable by the workers (same user) until this.
    hidden = PASSWORD_ENV in os.environ and hardening.make_non_dumpable()
    try:
        config = agent_config.load(argv)
        relax_grpc_blocking_waits()
        job_log = JobLogger(log, config.job_id, config.node_id)
        _keep_secrets(config, hidden, job_log)
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
            if agent.lifecycle.state is S.FAILED and agent.view.exit_code is None:
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
