"""The memory tier of one agent, wired: its directory, reaper, receiver and replicator.

:meth:`MemoryTier.open` (``--memory-tier``) prepares the node's directory
(:func:`agent.memory_tier.prepare`), starts its reaper, says how much room
the memory root and the agent's memory cgroup leave (a warning below
``--memory-min-free``), and starts the :class:`~agent.memory_replication.Replicator`.
:meth:`MemoryTier.close` stops replication, removes the directory and lets the
reaper go; the agent calls it on every exit, the job's end included.
"""

from __future__ import annotations

import threading
from typing import Callable

from agent import memory_tier
from agent.memory_client import ReplicaClient
from agent.memory_reaper import Reaper
from agent.memory_receiver import ReplicaReceiver
from agent.memory_replication import Replicator, SnapshotsTaken
from agent.status_record import MemoryTierRow, human_bytes
from agent.supervisor import WorkerStatus
from agent.tls import AgentTLS
from elastic.checkpoint.memory import capacity
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Round
from elastic.v1 import agent_pb2


class MemoryTier:
    """This node's memory tier while the agent runs."""

    def __init__(self, memory: memory_tier.MemoryDir, reaper: Reaper,
                 receiver: ReplicaReceiver, replicator: Replicator):
        self.memory = memory
        self.reaper = reaper
        self.receiver = receiver
        self.replicator = replicator

    @classmethod
    def open(cls, *, root: str, job_id: str, node_id: str, nproc: int, min_free_bytes: int,
             tls: AgentTLS | None, round_of: Callable[[], Round | None],
             workers_running: Callable[[], bool], logger: JobLogger,
             clock: Clock = SYSTEM_CLOCK) -> "MemoryTier":
        """Prepare the directory, start the reaper and the replicator. Raises
        ConfigError when the root cannot be used (:func:`memory_tier.prepare`)."""
        memory = memory_tier.prepare(root, job_id, node_id)
        reaper = memory_tier.watch_over(memory)
        try:
            _say_room(memory, min_free_bytes, logger)
            lock = threading.Lock()
            receiver = ReplicaReceiver(memory.path, job_id, node_id, round_of,
                                       lambda: memory_tier.free_bytes(memory.path), lock)
            replicator = Replicator(memory, node_id, nproc, round_of, workers_running,
                                    ReplicaClient(job_id, node_id, tls), lock, logger,
                                    clock=clock)
            replicator.start()
        except BaseException:
            memory_tier.free(memory)
            reaper.close()
            raise
        logger.info("memory tier at %s (reaper pid %d).", memory.path, reaper.pid)
        return cls(memory, reaper, receiver, replicator)

    @property
    def path(self) -> str:
        """The node's memory directory: the workers' ``ELASTIC_MEMORY_DIR``."""
        return self.memory.path

    def receive(self, request: agent_pb2.AgentReplicateRequest) -> int:
        """A buddy's ``Replicate`` request (:meth:`ReplicaReceiver.receive`)."""
        return self.receiver.receive(request)

    def heard(self, taken: SnapshotsTaken) -> None:
        """A worker's heartbeat told its snapshot count (:meth:`Replicator.heard`)."""
        self.replicator.heard(taken)

    def before_planned_stop(self, workers: list[WorkerStatus]) -> bool:
        """Before a planned stop of ``workers`` (a scale-up, a drain): let them
        train on to their next snapshot, which the next round resumes from,
        rather than redo the steps since the last one
        (:meth:`SnapshotPace.wait_for_next`). Whether they all took it."""
        return any(w.alive for w in workers) and self.replicator.pace.wait_for_next()

    def status(self) -> MemoryTierRow:
        return self.replicator.status()

    def close(self) -> None:
        """Stop replicating, free the directory, let the reaper go. Idempotent."""
        self.replicator.stop()
        memory_tier.free(self.memory)
        self.reaper.close()


def _say_room(memory: memory_tier.MemoryDir, min_free_bytes: int, logger: JobLogger) -> None:
    free = memory_tier.free_bytes(memory.path)
    cgroup = capacity.cgroup_free()
    room = free if cgroup is None else min(free, cgroup)
    where = (f"{human_bytes(free)} free on {memory.root}"
             + (f", {human_bytes(cgroup)} left in this agent's memory cgroup"
                if cgroup is not None else ", no memory cgroup limit"))
    if room < min_free_bytes:
        logger.warning("memory tier: only %s (below --memory-min-free %s): snapshots of this "
                       "node and its buddy's replica need twice their size each.", where,
                       human_bytes(min_free_bytes))
    else:
        logger.info("memory tier: %s.", where)
