"""elasticd: the per-node agent.

One loop thread owns the agent's state. Everything else only posts to its
inbox: the rendezvous (a new round), the supervisor (a worker exited), the
gRPC server (drain, restart), the peer health watcher, and signals. The loop
observes, calls the pure decisions (:mod:`agent.health`,
:mod:`elastic.rendezvous.decisions`) and applies the result through the one
state machine (:mod:`agent.lifecycle`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import signal
import sys
import tempfile
import threading

from agent import config as agent_config
from agent.assign import startup_env, worker_envs
from agent.grpc_server import AgentServer
from agent.health import WorkerHealth, hung_workers
from agent.lifecycle import AgentState, Lifecycle, Transition
from agent.peers import HealthWatcher
from agent.supervisor import Entrypoint, WorkerExit, WorkerSupervisor
from elastic import __version__, events
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import (
    EXIT_JOB_FAILED,
    EXIT_OK,
    ElasticError,
    MalformedRecordError,
    RendezvousTimeoutError,
    StoreError,
    exit_code_for,
)
from elastic.net import free_port
from elastic.rendezvous.api import NodeInfo, Round
from elastic.rendezvous.node import RendezvousNode
from elastic.store import open_store
from elastic.store.api import Compare, Put, Store
from elastic.v1 import agent_pb2

log = logging.getLogger("elasticd")

S = AgentState
# How often the loop looks at worker health and publishes progress when
# nothing else wakes it.
_TICK_S = 0.5
_STATUS_EVERY_S = 2.0
# Scripts that never report a step get their next warm set after this long.
_WARM_DELAY_S = 10.0


def _socket_path(job_id: str, node_id: str) -> str:
    # Unix socket paths are limited to ~108 bytes: hash rather than nest.
    digest = hashlib.sha1(f"{job_id}/{node_id}/{os.getpid()}".encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"elasticd-{digest}.sock")


class Agent:
    """A node agent for one job. ``run()`` returns the process exit code."""

    def __init__(self, config: agent_config.AgentConfig, store: Store,
                 clock: Clock = SYSTEM_CLOCK):
        self.config = config
        self.store = store
        self.clock = clock
        self.inbox: queue.Queue = queue.Queue()
        self.lifecycle = Lifecycle(config.job_id, config.node_id, publish=self._publish,
                                   clock=clock)
        self.socket_path = _socket_path(config.job_id, config.node_id)
        self.supervisor = WorkerSupervisor(
            job_id=config.job_id, node_id=config.node_id, nproc=config.nproc_per_node,
            entrypoint=Entrypoint(script=config.script, module=config.module,
                                  args=config.script_args),
            log_dir=config.log_dir, stop_grace_s=config.stop_grace_s,
            prestart=config.prestart, on_exit=lambda e: self.inbox.put(("exit", e)),
            worker_env=startup_env(config.nproc_per_node, dict(os.environ)))
        self.server = AgentServer(config.listen, self.socket_path, control=self, heartbeats=self)
        self.rdzv: RendezvousNode | None = None
        self.round: Round | None = None  # the round this node's workers belong to
        self.workers: dict[int, WorkerHealth] = {}
        self.exits: dict[int, WorkerExit] = {}
        self.rounds_started = 0
        self.warm_pending = False
        self.last_failure = ""
        self.outcome_reason = ""
        self.peer_watcher: HealthWatcher | None = None
        self.peer_unhealthy: tuple[str, float] | None = None  # (node, since) NOT_SERVING
        self.joining_since = clock.monotonic()
        self._workers_lock = threading.Lock()
        self._last_status_at = 0.0
        self._last_status: bytes = b""
        self._signal_exit: int | None = None

    # ------------------------------------------------------------ running

    def run(self) -> int:
        """Take part in the job until it ends or this node leaves; returns the exit code."""
        try:
            self.server.start()
            self.supervisor.warm_up()
            host = self.config.advertise_addr
            info = NodeInfo(node_id=self.config.node_id, host=host,
                            nproc=self.config.nproc_per_node,
                            addr=f"{host}:{self.server.address.rsplit(':', 1)[1]}",
                            master_port=free_port(host), version=__version__)
            self.rdzv = RendezvousNode(self.store, self.config.rendezvous(), info,
                                       clock=self.clock,
                                       on_round=lambda r: self.inbox.put(("round", r)))
            self.rdzv.start()
            self.lifecycle.to(S.JOINING, "registered with the rendezvous")
            self._loop()
        except ElasticError as exc:
            self.outcome_reason = str(exc)
            if not self.lifecycle.state.final:
                self.lifecycle.to(S.FAILED, str(exc), self._round_number())
            raise
        finally:
            self._shutdown()
        if self._signal_exit is not None:
            return self._signal_exit
        return EXIT_OK if self.lifecycle.state is S.SUCCEEDED else EXIT_JOB_FAILED

    def _loop(self) -> None:
        self._on_round(self.rdzv.latest_round)
        while not self.lifecycle.state.final:
            try:
                kind, payload = self.inbox.get(timeout=_TICK_S)
            except queue.Empty:
                kind, payload = "tick", None
            try:
                if kind == "round":
                    self._on_round(self.rdzv.latest_round)
                elif kind == "exit":
                    self._on_exit(payload)
                elif kind == "peer":
                    self._on_peer(*payload)
                elif kind == "drain":
                    self._drain(payload)
                elif kind == "signal":
                    self._on_signal(payload)
                self._check_workers()
                self._publish_status()
            except StoreError as exc:
                # etcd blips must not stop training: the next tick tries again.
                log.warning("job %s node %s round %d: store error, retrying: %s",
                            self.config.job_id, self.config.node_id, self._round_number(), exc)

    def _round_number(self) -> int:
        return self.round.number if self.round else 0

    # ------------------------------------------------------------ events

    def _on_round(self, latest: Round | None) -> None:
        state = self.lifecycle.state
        if latest is None or state.final or state is S.DRAINING:
            return
        if latest.outcome:
            self._finish(latest)
            return
        if self.round is not None and latest.number == self.round.number:
            return
        if state in (S.RUNNING, S.STARTING):
            self._stop_workers(f"round {latest.number} replaces round {self.round.number}: "
                               f"{latest.reason}")
        me = latest.member(self.config.node_id)
        if me is None:
            if self._drain_requested():
                self._drain("drain requested")
            elif self.lifecycle.state is not S.STANDBY:
                self.lifecycle.to(S.STANDBY, f"round {latest.number} is full without this node",
                                  latest.number)
            return
        self._start_workers(latest)

    def _start_workers(self, r: Round) -> None:
        self.lifecycle.to(S.STARTING, f"node rank {r.member(self.config.node_id).node_rank} of "
                          f"{len(r.members)}, world size {r.world_size}", r.number)
        self.round = r
        self.rounds_started += 1
        envs = worker_envs(r, self.config.node_id, job_id=self.config.job_id,
                           restart_count=self.rounds_started - 1,
                           max_restarts=self.config.max_restarts,
                           agent_socket=self.socket_path,
                           checkpoint_dir=self.config.checkpoint_dir,
                           hang_timeout_s=self.config.hang_timeout_s)
        now = self.clock.monotonic()
        with self._workers_lock:
            self.workers = {i: WorkerHealth(local_rank=i, rank=int(env["RANK"]), started_at=now)
                            for i, env in enumerate(envs)}
            self.exits = {}
        # The next warm set waits until this round trains (see _check_workers):
        # importing torch meanwhile would slow this round's start on small nodes.
        self.supervisor.start_round(r.number, envs, warm_next=False)
        self.warm_pending = True
        self.server.set_serving(True)
        self._watch_peer(r)
        self.lifecycle.to(S.RUNNING, f"{len(envs)} workers started", r.number)

    def _stop_workers(self, reason: str) -> None:
        self.lifecycle.to(S.STOPPING, reason, self._round_number())
        self.server.set_serving(False)
        self._watch_peer(None)
        self.supervisor.stop()
        self.lifecycle.to(S.JOINING, "workers stopped", self._round_number())
        self.joining_since = self.clock.monotonic()

    def _on_exit(self, e: WorkerExit) -> None:
        if (self.round is None or e.round != self.round.number or e.stopped
                or self.lifecycle.state is not S.RUNNING):
            # A worker of a round already given up, one we stopped, or one that
            # died on its own while this round was being stopped anyway.
            return
        self.exits[e.local_rank] = e
        if e.exit_code != 0:
            how = f"was killed by signal {e.signal}" if e.signal else f"exited with {e.exit_code}"
            self._fail_round(f"worker rank {e.rank} (pid {e.pid}) {how}")
            return
        if len(self.exits) == len(self.workers) and self.lifecycle.state is S.RUNNING:
            reason = f"all {len(self.workers)} workers of node {self.config.node_id} exited 0"
            if self.rdzv.finish(self.round, "succeeded", reason):
                self.outcome_reason = reason
            # Either way the final round (ours or another's) arrives by watch.
            self._on_round(self.rdzv.latest_round)

    def _fail_round(self, reason: str) -> None:
        """A local failure: ask for a new round (counted against the budget) and
        stop this node's workers without waiting for it."""
        self.last_failure = reason
        log.warning("job %s node %s round %d: %s; requesting a restart", self.config.job_id,
                    self.config.node_id, self._round_number(), reason)
        self.rdzv.request_restart(reason, self._round_number(), failure=True)
        self._stop_workers(reason)

    def _check_workers(self) -> None:
        state = self.lifecycle.state
        if state is S.RUNNING:
            self._warm_next_set()
            with self._workers_lock:
                verdicts = hung_workers(list(self.workers.values()), self.clock.monotonic(),
                                        self.config.hang_timeout_s)
            if verdicts:
                self._fail_round("; ".join(reason for _, reason in verdicts))
                return
            if self.peer_unhealthy is not None:
                peer, since = self.peer_unhealthy
                if self.clock.monotonic() - since > self.config.lease_ttl_s:
                    self._fail_round(f"peer {peer} has reported its workers unhealthy "
                                     f"(NOT_SERVING) for over {self.config.lease_ttl_s:g} s")
        elif state in (S.JOINING,) and self.rounds_started == 0:
            waited = self.clock.monotonic() - self.joining_since
            if waited > self.config.join_timeout_s:
                raise RendezvousTimeoutError(
                    f"job {self.config.job_id}: node {self.config.node_id} was not included "
                    f"in a round within {self.config.join_timeout_s:.0f} s")

    def _warm_next_set(self) -> None:
        """Warm the next workers once this round's workers all made a step, or
        after a while for scripts that never report one."""
        if not self.warm_pending:
            return
        with self._workers_lock:
            workers = list(self.workers.values())
        now = self.clock.monotonic()
        if all(w.step >= 0 for w in workers) or any(now - w.started_at > _WARM_DELAY_S
                                                    for w in workers):
            self.warm_pending = False
            self.supervisor.warm_up()

    def _on_peer(self, node_id: str, status: str) -> None:
        # Agents are briefly NOT_SERVING at every round change while their
        # workers restart: only a peer that stays so for a lease TTL is unhealthy.
        if status == "NOT_SERVING":
            self.peer_unhealthy = self.peer_unhealthy or (node_id, self.clock.monotonic())
        else:
            self.peer_unhealthy = None

    def _watch_peer(self, r: Round | None) -> None:
        """Watch the health of the next node in the ring (O(1) checks per node)."""
        self.peer_unhealthy = None
        if self.peer_watcher is not None:
            self.peer_watcher.stop()
            self.peer_watcher = None
        if r is None or len(r.members) < 2:
            return
        me = r.member(self.config.node_id)
        peer = r.members[(me.node_rank + 1) % len(r.members)]
        if peer.addr:
            self.peer_watcher = HealthWatcher(
                peer.addr, lambda status, n=peer.node_id: self.inbox.put(("peer", (n, status)))
            ).start()

    def _finish(self, final: Round) -> None:
        if self.lifecycle.state in (S.RUNNING, S.STARTING):
            self.lifecycle.to(S.STOPPING, f"job {final.outcome}", final.number)
            self.server.set_serving(False)
            self._watch_peer(None)
            # Workers of a succeeded job are finishing on their own: give them
            # the grace period before stopping them.
            self.supervisor.stop()
        self.outcome_reason = final.reason
        self.lifecycle.to(S.SUCCEEDED if final.outcome == "succeeded" else S.FAILED,
                          f"job {final.outcome}: {final.reason}", final.number)

    def _drain_requested(self) -> bool:
        return self.store.get(self.rdzv.keys.drain_request(self.config.node_id)) is not None

    def _drain(self, reason: str) -> None:
        if self.lifecycle.state.final or self.lifecycle.state is S.DRAINING:
            return
        self.store.put(self.rdzv.keys.drain_request(self.config.node_id),
                       json.dumps({"by": self.config.node_id, "reason": reason}).encode())
        self.lifecycle.to(S.DRAINING, reason, self._round_number())
        self.server.set_serving(False)
        self._watch_peer(None)
        self.supervisor.stop()
        self.rdzv.stop()  # the leader sees this node go and forms a round without it
        self.store.delete(self.rdzv.keys.drain_request(self.config.node_id))
        self.outcome_reason = f"drained: {reason}"
        self.lifecycle.to(S.SUCCEEDED, "left the job after draining", self._round_number())

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self.outcome_reason = f"stopped by {name}"
        self._signal_exit = 128 + signum
        self.lifecycle.to(S.FAILED, f"received {name}: leaving the job", self._round_number())

    # ------------------------------------------------------ gRPC handlers
    # Called from gRPC threads: read-only or posted to the loop.

    def heartbeat(self, req: agent_pb2.WorkerChannelHeartbeatRequest) -> bool:
        with self._workers_lock:
            w = self.workers.get(req.local_rank)
            current = self.round is not None and req.round == self.round.number
            if w is not None and current:
                w.on_heartbeat(self.clock.monotonic(), req.step, req.saving_for_s, req.exiting)
        return not current or self.lifecycle.state is not S.RUNNING

    def commit_checkpoint(self, entry: agent_pb2.CheckpointEntry) -> tuple[bool, str]:
        """Advance ``checkpoint/latest`` in one transaction fenced by the round
        (the entry's round must still be the job's round): a worker of an older
        round can never commit."""
        keys = self.rdzv.keys
        record = {"step": entry.step, "round": entry.round, "world_size": entry.world_size,
                  "path": entry.path, "time": entry.time}
        result = self.store.txn(
            [Compare.version(keys.round, "==", entry.round)],
            [Put(keys.checkpoint_latest, json.dumps(record, sort_keys=True).encode()),
             events.event_op(keys, self.clock, self.config.node_id, entry.round, "checkpoint",
                             f"checkpoint of step {entry.step} committed ({entry.path})")])
        if result.succeeded:
            log.info("job %s node %s round %d: checkpoint of step %d committed (%s)",
                     self.config.job_id, self.config.node_id, entry.round, entry.step, entry.path)
            return True, ""
        latest = self.rdzv.latest_round
        return False, (f"round {entry.round} is no longer current (the job is in round "
                       f"{latest.number if latest else '?'})")

    def latest_checkpoint(self) -> agent_pb2.CheckpointEntry | None:
        kv = self.store.get(self.rdzv.keys.checkpoint_latest)
        if kv is None:
            return None
        try:
            r = json.loads(kv.value)
            return agent_pb2.CheckpointEntry(step=int(r["step"]), round=int(r["round"]),
                                             world_size=int(r["world_size"]),
                                             path=str(r["path"]), time=float(r["time"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise MalformedRecordError(kv.key, f"not a checkpoint record ({exc})") from exc

    def status(self) -> agent_pb2.AgentStatusResponse:
        me = self.round.member(self.config.node_id) if self.round else None
        return agent_pb2.AgentStatusResponse(
            job_id=self.config.job_id, node_id=self.config.node_id,
            state=self.lifecycle.state.value, round=self._round_number(),
            node_rank=me.node_rank if me else -1,
            world_size=self.round.world_size if self.round else 0,
            workers=[agent_pb2.WorkerStatus(**w) for w in self._worker_rows()],
            restarts=max(0, self.rounds_started - 1), last_failure=self.last_failure,
            version=__version__)

    def drain(self, reason: str) -> tuple[bool, str]:
        self.inbox.put(("drain", reason or "drain requested over gRPC"))
        return True, f"node {self.config.node_id} will leave the job"

    def request_restart(self, reason: str) -> tuple[bool, int]:
        number = self._round_number()
        self.rdzv.request_restart(reason or "restart requested over gRPC", number, failure=False)
        return True, number

    # ------------------------------------------------------------ status

    def _worker_rows(self) -> list[dict]:
        now = self.clock.monotonic()
        pids = {local_rank: pid for local_rank, _, pid, _ in self.supervisor.workers()}
        rows = []
        with self._workers_lock:
            for i, w in sorted(self.workers.items()):
                e = self.exits.get(i)
                state = ("succeeded" if e.exit_code == 0 else "failed") if e else (
                    "running" if w.last_heartbeat_at is not None or
                    self.lifecycle.state is S.RUNNING else "starting")
                rows.append({
                    "local_rank": i, "rank": w.rank, "pid": pids.get(i, 0), "state": state,
                    "last_step": w.step, "step_rate": round(w.step_rate(), 3),
                    "heartbeat_age_s": round(now - w.last_heartbeat_at, 2)
                    if w.last_heartbeat_at is not None else -1.0,
                    "exit_code": e.exit_code if e else 0})
        return rows

    def _status_record(self) -> bytes:
        me = self.round.member(self.config.node_id) if self.round else None
        rows = self._worker_rows()
        return json.dumps({
            "node_id": self.config.node_id, "state": self.lifecycle.state.value,
            "round": self._round_number(), "node_rank": me.node_rank if me else None,
            "workers": rows,
            "last_step": max((r["last_step"] for r in rows), default=-1),
            "step_rate": min((r["step_rate"] for r in rows), default=0.0),
            "restarts": max(0, self.rounds_started - 1), "last_failure": self.last_failure,
        }, sort_keys=True).encode()

    def _publish(self, t: Transition) -> None:
        """Publish a transition: the status key and an event, in one transaction."""
        if self.rdzv is None or self.rdzv.lease_id is None:
            return
        try:
            self.store.txn([], [
                Put(self.rdzv.keys.status_of(self.config.node_id), self._status_record(),
                    lease=self.rdzv.lease_id),
                events.event_op(self.rdzv.keys, self.clock, self.config.node_id, t.round,
                                "state", f"{t.before.value} -> {t.after.value}: {t.reason}"),
            ])
        except StoreError as exc:
            log.warning("job %s node %s round %d: could not publish %s: %s", self.config.job_id,
                        self.config.node_id, t.round, t.after.value, exc)

    def _publish_status(self) -> None:
        """Refresh the status key when something changed, at most every few seconds."""
        now = self.clock.monotonic()
        if now - self._last_status_at < _STATUS_EVERY_S or self.rdzv.lease_id is None:
            return
        record = self._status_record()
        if record != self._last_status:
            self.store.put(self.rdzv.keys.status_of(self.config.node_id), record,
                           lease=self.rdzv.lease_id)
            self._last_status = record
        self._last_status_at = now

    def _shutdown(self) -> None:
        self._watch_peer(None)
        self.supervisor.shutdown()
        if self.rdzv is not None:
            self.rdzv.stop()
        self.server.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("ELASTIC_LOG_LEVEL", "INFO").upper(),
                        stream=sys.stderr,
                        format="%(asctime)s elasticd %(levelname)s: %(message)s")
    server = None
    try:
        config = agent_config.load(argv)
        endpoint = config.etcd
        if config.standalone:
            from elastic.store.server import EtcdServer

            server = EtcdServer().start()
            endpoint = server.endpoint
            log.info("job %s node %s: started a private etcd at %s", config.job_id,
                     config.node_id, endpoint)
        with open_store(endpoint, connect_timeout_s=config.connect_timeout_s) as store:
            agent = Agent(config, store)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, _f: agent.inbox.put(("signal", signum)))
            code = agent.run()
            if code != EXIT_OK:
                print(f"elasticd: job {config.job_id} failed: {agent.outcome_reason}",
                      file=sys.stderr)
            return code
    except ElasticError as exc:
        print(f"elasticd: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
