"""The agent's gRPC services, as the server calls them (any thread).

:class:`WorkerChannel` is what this node's workers ask of the agent
(``elastic.v1.WorkerChannel``, :class:`agent.grpc_server.HeartbeatSink`):
heartbeats, checkpoint commits and reports. :class:`AgentService` is what
operators and peer agents ask (``elastic.v1.Agent``,
:class:`agent.grpc_server.AgentControl`): status, drain, restart, and whether
this agent reaches etcd. Both read the agent's view and answer by the
reactor's pure rules; what must change the agent is posted to its loop.
"""

from __future__ import annotations

import queue
from typing import Protocol

from agent import grpc_input, reactor
from agent.config import AgentConfig
from agent.goodput import GoodputTracker
from agent.hang_report import HangReporter, VerdictOnly
from agent.health import WorkerTable
from agent.memory_node import MemoryTier
from agent.memory_replication import SnapshotsTaken
from agent.metrics import NoMetrics
from agent.peers import rank_stacks_to_pb
from agent.status_record import StatusRecord
from agent.straggler_watch import StragglerWatch
from elastic import __version__
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.clock import Clock
from elastic.errors import FencedError, InvalidRequestError, StoreError
from elastic.rendezvous.api import RestartRequest
from elastic.rendezvous.node import RendezvousNode
from elastic.rendezvous.operator import request_operator_restart
from elastic.store.api import Store
from elastic.v1 import agent_pb2


class Served(Protocol):
    """What the services read of the agent (:class:`agent.daemon.Agent`)."""

    config: AgentConfig
    settings: reactor.Settings
    clock: Clock
    view: reactor.AgentView
    workers: WorkerTable
    metrics: NoMetrics
    goodput: GoodputTracker
    commit_log: EtcdCommitLog
    inbox: queue.Queue
    store: Store
    rdzv: RendezvousNode

    hang_reporter: HangReporter | VerdictOnly
    stragglers: StragglerWatch

    def status_record(self) -> StatusRecord: ...

    @property
    def memory(self) -> MemoryTier | None: ...


class WorkerChannel:
    """What this node's workers ask of the agent."""

    def __init__(self, agent: Served):
        self._agent = agent

    def heartbeat(self, req: agent_pb2.WorkerChannelHeartbeatRequest) -> tuple[bool, bool]:
        """(stop_requested, hold), by :func:`agent.reactor.heartbeat_reply`; a
        heartbeat of the round running here is recorded. Raises
        InvalidRequestError for a local rank this node does not run."""
        a = self._agent
        if req.local_rank >= a.config.nproc_per_node:
            raise InvalidRequestError(f"Heartbeat: field 'local_rank' is {req.local_rank}, but "
                                      f"node {a.config.node_id} runs "
                                      f"{a.config.nproc_per_node} worker(s)")
        now = a.clock.monotonic()
        reply = reactor.heartbeat_reply(a.view, req.round, a.rdzv.lease_confirmed_at, now,
                                        a.settings)
        if reply.current:
            progress = a.workers.beat(req.local_rank, now, req.step, req.saving_for_s,
                                      req.exiting)
            a.stragglers.times.observe(req.round, req.rank, req.step_time_s, req.step_busy_s)
            if progress is not None:
                a.metrics.observe_heartbeat(*progress)
                a.goodput.stepped(progress[0], now)
        memory = a.memory
        if memory is not None and req.snapshots:
            memory.heard(SnapshotsTaken(req.local_rank, req.pid, req.snapshots))
        return reply.stop, reply.hold

    def commit_checkpoint(self, entry: agent_pb2.CheckpointEntry) -> tuple[bool, str]:
        """Advance ``checkpoint/latest`` through the fenced commit log (which
        logs the commit): a worker of an older round can never commit."""
        # Validated like the record it becomes (InvalidRequestError otherwise):
        # its path a plain name in the checkpoint root; how the save went is the
        # worker's word, and only what can be true is kept.
        commit = grpc_input.commit_entry(entry)
        a = self._agent
        view = a.view
        fence = commit.round
        if view.round is not None and commit.round == view.round.workers_round:
            # Workers of a round written again (Round.continues) commit in the
            # round that continues theirs: its number is the fence now; the
            # record keeps their round, which their memory snapshots carry too.
            fence = view.round.number
        try:
            a.commit_log.commit(commit, fence_round=fence)
        except FencedError as exc:
            return False, str(exc)
        except StoreError:
            a.metrics.store_error("checkpoint_commit")
            raise
        a.metrics.observe_save(entry.step, commit.save_s, commit.size_bytes)
        return True, ""

    def latest_checkpoint(self) -> agent_pb2.CheckpointEntry | None:
        latest = self._agent.commit_log.latest()
        if latest is None:
            return None
        return agent_pb2.CheckpointEntry(step=latest.step, round=latest.round,
                                         world_size=latest.world_size, path=latest.path,
                                         time=latest.time, save_s=latest.save_s,
                                         size_bytes=latest.size_bytes)

    def report_restore(self, req: agent_pb2.WorkerChannelReportRestoreRequest) -> None:
        """Rank 0 restored a checkpoint: counted in the metrics (nothing else)."""
        self._agent.metrics.observe_restore(req.restore_s, req.size_bytes)

    def report_checkpoint_failure(self, step: int, round_: int, rank: int,
                                  message: str) -> None:
        """A worker's save failed: a ``checkpoint`` event through the commit log
        (best effort; it never raises)."""
        self._agent.commit_log.report_failure(step, round_, rank, message)


class AgentService:
    """What operators (elasticctl) and peer agents ask of the agent."""

    def __init__(self, agent: Served):
        self._agent = agent

    def status(self) -> agent_pb2.AgentStatusResponse:
        a = self._agent
        view = a.view
        return a.status_record().to_pb(a.config.job_id,
                                       view.round.world_size if view.round else 0, __version__)

    def drain(self, reason: str) -> tuple[bool, str]:
        self._agent.inbox.put(reactor.DrainRequested(reason or "drain requested over gRPC"))
        return True, f"node {self._agent.config.node_id} will leave the job"

    def request_restart(self, reason: str) -> tuple[bool, int]:
        """An operator's restart: taken at most once per
        --operator-restart-interval for the whole job; raises RateLimitedError
        when too soon, StoreError when etcd does not take it."""
        a = self._agent
        number = a.view.round_number
        request = RestartRequest(node_id=a.config.node_id, round=number,
                                 reason=reason or "restart requested over gRPC")
        request_operator_restart(a.store, a.rdzv.keys, request,
                                 interval_s=a.config.operator_restart_interval_s,
                                 now=a.clock.wall())
        return True, number

    def replicate(self, request: agent_pb2.AgentReplicateRequest) -> int:
        """A buddy's part of a memory-tier snapshot (:mod:`agent.memory_receiver`);
        InvalidRequestError when this agent runs without --memory-tier."""
        memory = self._agent.memory
        if memory is None:
            raise InvalidRequestError(f"Replicate: node {self._agent.config.node_id} runs "
                                      "without --memory-tier")
        return memory.receive(request)

    def collect_stacks(self, round_number: int) -> list[agent_pb2.RankStack]:
        """This node's workers' stacks, summarised, when they belong to round
        ``round_number`` (a peer judged a hang in it; stopped since: the stacks
        read last); none otherwise."""
        a = self._agent
        view = a.view
        if view.round is None or round_number != view.round_number or round_number <= 0:
            return []
        return rank_stacks_to_pb(a.hang_reporter.local(view.round.workers_round))

    def store_health(self, asker_has_store: bool = False, asker: str = ""
                     ) -> tuple[bool, float, bool]:
        """(etcd confirmed this agent's lease within half a TTL, seconds since,
        workers running), by :func:`agent.reactor.store_health`; a peer that
        proves this agent cut off from etcd is posted to the loop, which stops
        the workers."""
        a = self._agent
        reply = reactor.store_health(a.view, a.rdzv.registered, a.rdzv.lease_confirmed_at,
                                     asker_has_store, asker, a.clock.monotonic(), a.settings)
        if reply.cut_off is not None:
            a.inbox.put(reply.cut_off)
        return reply.reachable, reply.lease_age_s, reply.running
