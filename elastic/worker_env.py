"""The environment contract between an agent and its workers: each ELASTIC_*
variable named once, with who writes it and who reads it.

Written for each worker of a round by :func:`agent.assign.worker_envs`:

* :data:`ROUND`: the round the worker was started in (the fencing token of its
  checkpoint commits). Read by the worker runtime's heartbeats and by the
  Checkpointer (temporaries, commits).
* :data:`JOB_ID`, :data:`NODE_ID`: the job and this node. Read by scripts.
* :data:`AGENT_SOCKET`: the agent's Unix socket (gRPC). Read by the worker
  runtime (heartbeats; none under plain torchrun) and by the Checkpointer
  (the agent's fenced commit log).
* :data:`HEARTBEAT_SOCKET`: the agent's heartbeat datagram socket, set only
  when it has one (:mod:`agent.heartbeat_socket`). Read by the worker runtime.
* :data:`HANG_TIMEOUT_S`: the agent's hang timeout (0: off); the runtime beats
  often enough to stay well within it.
* :data:`LEASE_TTL_S`: a worker whose agent has not vouched for its round this
  long waits before its next step (0: never).
* :data:`CHECKPOINT_DIR`: the checkpoint root, set when the agent has one.
  Read by the Checkpointer and by scripts.
* :data:`STACKS_FILE`: where the worker's Python stacks are dumped when the
  agent asks (:mod:`elastic.worker.stacks`), in the node's private rank-log
  directory. Read by the worker bootstrap.
* :data:`MEMORY_DIR`: this node's memory-tier directory (on a tmpfs, owned,
  replicated and freed by the agent), set when the agent runs with the memory
  tier on. Read by the Checkpointer (:mod:`elastic.checkpoint.memory`).

Set by the agent when it starts a worker process (:mod:`agent.spawn`), for
the worker bootstrap (:mod:`elastic.worker.bootstrap`):

* :data:`PRELOAD`: modules a warm worker imports ahead of need.
* :data:`BOOTSTRAP_STATUS_FD`, :data:`BOOTSTRAP_PARENT_PID`,
  :data:`BOOTSTRAP_TEMPLATE_FD`: the bootstrap's pipe to the agent, the
  agent's pid, and a template's socket (:mod:`elastic.worker.template`).

Inherited from the agent's own environment (an operator sets them), read by
the Checkpointer: :data:`CHECKPOINT_TRUST`, :data:`CHECKPOINT_MODE`.

:class:`WorkerEnv` reads, typed, what workers read. No torch here.
"""

from __future__ import annotations

import os
from typing import Mapping

from elastic.errors import ConfigError

ROUND = "ELASTIC_ROUND"
JOB_ID = "ELASTIC_JOB_ID"
NODE_ID = "ELASTIC_NODE_ID"
AGENT_SOCKET = "ELASTIC_AGENT_SOCKET"
HEARTBEAT_SOCKET = "ELASTIC_AGENT_HEARTBEAT_SOCKET"
HANG_TIMEOUT_S = "ELASTIC_HANG_TIMEOUT_S"
LEASE_TTL_S = "ELASTIC_LEASE_TTL_S"
CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"
MEMORY_DIR = "ELASTIC_MEMORY_DIR"
STACKS_FILE = "ELASTIC_STACKS_FILE"

PRELOAD = "ELASTIC_PRELOAD"
BOOTSTRAP_STATUS_FD = "ELASTIC_BOOTSTRAP_STATUS_FD"
BOOTSTRAP_PARENT_PID = "ELASTIC_BOOTSTRAP_PARENT_PID"
BOOTSTRAP_TEMPLATE_FD = "ELASTIC_BOOTSTRAP_TEMPLATE_FD"

CHECKPOINT_TRUST = "ELASTIC_CHECKPOINT_TRUST"
CHECKPOINT_MODE = "ELASTIC_CHECKPOINT_MODE"

# What an agent may find in its own environment that is no option of its own:
# the variables it sets for workers and those its workers inherit from it.
# The bootstrap's are left out: they are set in a worker's process only.
NOT_OPTIONS = frozenset({ROUND, JOB_ID, NODE_ID, AGENT_SOCKET, HEARTBEAT_SOCKET, HANG_TIMEOUT_S,
                         LEASE_TTL_S, CHECKPOINT_DIR, MEMORY_DIR, PRELOAD, CHECKPOINT_TRUST,
                         CHECKPOINT_MODE, STACKS_FILE})


class WorkerEnv:
    """What a worker reads of its environment (``environ``, default
    ``os.environ``), typed. A variable unset or empty reads as None (``round``:
    0, no agent). Text is read on construction; numbers when asked for, and
    one that does not parse raises ConfigError naming its variable."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        self._environ = os.environ if environ is None else environ
        self.job_id = self._text(JOB_ID)
        self.node_id = self._text(NODE_ID)
        self.agent_socket = self._text(AGENT_SOCKET)
        self.heartbeat_socket = self._text(HEARTBEAT_SOCKET)
        self.checkpoint_dir = self._text(CHECKPOINT_DIR)
        self.memory_dir = self._text(MEMORY_DIR)
        self.stacks_file = self._text(STACKS_FILE)

    def _text(self, name: str) -> str | None:
        return self._environ.get(name) or None

    def _seconds(self, name: str) -> float | None:
        raw = self._text(name)
        if raw is None:
            return None
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw[:20]!r}: expected a number of seconds") from None

    @property
    def round(self) -> int:
        """:data:`ROUND`; 0 without an agent."""
        raw = self._text(ROUND)
        try:
            return int(raw or 0)
        except ValueError as exc:
            raise ConfigError(f"{ROUND} must be an integer: {exc}") from exc

    @property
    def hang_timeout_s(self) -> float | None:
        return self._seconds(HANG_TIMEOUT_S)

    @property
    def lease_ttl_s(self) -> float | None:
        return self._seconds(LEASE_TTL_S)
