"""The agent's lifecycle: one state machine, one place that changes state.

::

    INIT -> JOINING -> STANDBY | STARTING -> RUNNING -> STOPPING -> JOINING ...
                                               RUNNING -> DONE -> SUCCEEDED | FAILED
    any live state -> DRAINING -> (exit)   any state -> FAILED

Every transition is checked against the table below, logged with its reason,
and handed to the publisher (status key and event in etcd).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable

from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.joblog import JobLogger

log = logging.getLogger(__name__)


class AgentState(enum.Enum):
    INIT = "INIT"  # starting up: config read, nothing registered yet
    JOINING = "JOINING"  # registered; waiting for a round that includes this node
    STANDBY = "STANDBY"  # registered, but the current round is full without this node
    STARTING = "STARTING"  # a round includes this node; its workers are being started
    RUNNING = "RUNNING"  # the workers run; the agent watches them and its peers
    DONE = "DONE"  # this node's workers all exited 0; waiting at the exit barrier for the rest
    STOPPING = "STOPPING"  # the round is over for this node; its workers are being stopped
    DRAINING = "DRAINING"  # leaving the job gracefully on request
    SUCCEEDED = "SUCCEEDED"  # the job finished successfully (final)
    FAILED = "FAILED"  # the job failed, or this agent cannot go on (final)

    @property
    def final(self) -> bool:
        return self in (AgentState.SUCCEEDED, AgentState.FAILED)


S = AgentState
ALLOWED: dict[AgentState, frozenset[AgentState]] = {
    S.INIT: frozenset({S.JOINING, S.FAILED}),
    S.JOINING: frozenset({S.STANDBY, S.STARTING, S.SUCCEEDED, S.FAILED, S.DRAINING}),
    S.STANDBY: frozenset({S.STARTING, S.JOINING, S.SUCCEEDED, S.FAILED, S.DRAINING}),
    S.STARTING: frozenset({S.RUNNING, S.STOPPING, S.FAILED, S.DRAINING}),
    S.RUNNING: frozenset({S.STOPPING, S.DONE, S.SUCCEEDED, S.FAILED, S.DRAINING}),
    S.DONE: frozenset({S.STOPPING, S.SUCCEEDED, S.FAILED, S.DRAINING}),
    S.STOPPING: frozenset({S.JOINING, S.SUCCEEDED, S.FAILED, S.DRAINING}),
    S.DRAINING: frozenset({S.SUCCEEDED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
}


@dataclass(frozen=True)
class Transition:
    before: AgentState
    after: AgentState
    reason: str
    round: int
    at: float  # wall clock


class IllegalTransition(RuntimeError):
    """A bug: the agent tried a transition the table does not allow."""


class Lifecycle:
    """Holds the agent's state; :meth:`to` is the only way to change it."""

    def __init__(self, job_id: str, node_id: str,
                 publish: Callable[[Transition], None] | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self.job_id = job_id
        self.node_id = node_id
        self._log = JobLogger(log, job_id, node_id)
        self._publish = publish
        self._clock = clock
        self._state = AgentState.INIT
        self._lock = threading.Lock()
        self.history: list[Transition] = []

    @property
    def state(self) -> AgentState:
        return self._state

    def to(self, after: AgentState, reason: str, round_number: int = 0) -> Transition:
        """Move to ``after``; log and publish it. Raises IllegalTransition for a
        move the table does not allow (a bug, never bad input)."""
        with self._lock:
            before = self._state
            if after not in ALLOWED[before]:
                raise IllegalTransition(f"{before.value} -> {after.value} ({reason})")
            self._state = after
            t = Transition(before, after, reason, round_number, self._clock.wall())
            self.history.append(t)
        self._log.at_round(round_number).info("%s -> %s: %s", before.value, after.value, reason)
        if self._publish is not None:
            self._publish(t)
        return t
