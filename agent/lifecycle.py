"""The agent's lifecycle: its states, the table of allowed transitions, and
the checker and publisher of the transitions the reactor decides.

::

    INIT -> JOINING -> STANDBY | STARTING -> RUNNING -> STOPPING -> JOINING ...
                                               RUNNING -> DONE -> SUCCEEDED | FAILED
    any live state -> DRAINING -> (exit)   any state -> FAILED

The agent's state is the reactor's (:attr:`agent.reactor.AgentView.state`).
Each reaction's Transition commands are checked against the table before
any is applied (:func:`check_path`: they must lead from the state before to
the state after), then each is logged with its reason and handed to the
publisher (status key and event in etcd) as the loop applies it.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

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
    """A bug: the reactor decided a transition the table does not allow."""


def check_path(before: AgentState, states: Iterable[AgentState], after: AgentState) -> None:
    """Check that moving from ``before`` through ``states`` in order follows
    the table and ends in ``after``. Raises IllegalTransition (a bug, never
    bad input)."""
    at = before
    for state in states:
        if state not in ALLOWED[at]:
            raise IllegalTransition(f"{at.value} -> {state.value}")
        at = state
    if at is not after:
        raise IllegalTransition(f"the transitions end in {at.value}, the state in {after.value}")


class Lifecycle:
    """Publishes the reactor's transitions in order, each checked against the table.

    :attr:`published` is the last state published: the reactor's state as far
    as the loop has applied its commands (STOPPING while a stop is under way),
    what the status RPC reports. Nothing decides on it."""

    def __init__(self, job_id: str, node_id: str,
                 publish: Callable[[Transition], None] | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        self.job_id = job_id
        self.node_id = node_id
        self._log = JobLogger(log, job_id, node_id)
        self._publish = publish
        self._clock = clock
        self._published = AgentState.INIT
        self._lock = threading.Lock()
        self.history: list[Transition] = []

    @property
    def published(self) -> AgentState:
        return self._published

    def publish(self, after: AgentState, reason: str, round_number: int = 0) -> Transition:
        """Log and publish the move from the last published state to ``after``.
        Raises IllegalTransition for a move the table does not allow."""
        with self._lock:
            before = self._published
            if after not in ALLOWED[before]:
                raise IllegalTransition(f"{before.value} -> {after.value} ({reason})")
            self._published = after
            t = Transition(before, after, reason, round_number, self._clock.wall())
            self.history.append(t)
        self._log.at_round(round_number).info("%s -> %s: %s", before.value, after.value, reason)
        if self._publish is not None:
            self._publish(t)
        return t
