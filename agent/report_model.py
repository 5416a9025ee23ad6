"""The job report's model: a job's timeline as typed records, and its one JSON schema.

:func:`agent.report.build_report` makes a :class:`JobReport`;
``elasticctl report`` renders it as text (:mod:`agent.report_text`), as JSON
(:meth:`JobReport.to_dict`: the field names below are the schema's names,
written nowhere else) or as an HTML page with an SVG timeline
(:mod:`agent.report_html`). Times are wall-clock seconds since the epoch;
durations are seconds.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

# Bumped when a field changes meaning or goes away (new fields may be added).
SCHEMA_VERSION = 1


class RoundEnd(str, enum.Enum):
    """How a round ended, as the history tells it."""

    FAULT = "fault"  # a failure broke it (a worker, a hang, a node): see the round's fault
    MEMBERSHIP = "membership"  # a node joined or was drained: planned, not a fault
    REQUESTED = "requested"  # a restart asked for without a failure (an operator)
    CONTINUED = "continued"  # written again as a new round whose workers run on
    SUCCEEDED = "succeeded"  # the job ended in it, every worker exited 0
    FAILED = "failed"  # the job ended in it as failed
    CURRENT = "current"  # it is the job's round now
    UNKNOWN = "unknown"  # a later round exists, but no event says why this one ended


class FaultKind(str, enum.Enum):
    """What broke, read from the fault's cause (OTHER: a cause the report does not know)."""

    WORKER_EXIT = "worker_exit"  # a worker exited non-zero or was killed by a signal
    HANG = "hang"  # a worker made no progress or sent no heartbeat within its timeout
    NODE_LOST = "node_lost"  # a member's lease expired (its agent died or was cut off)
    NODE_FROZEN = "node_frozen"  # a member's agent answered no probe; its lease was revoked
    NO_START = "no_start"  # a member did not start its workers within the start deadline
    AGENT_RESTARTED = "agent_restarted"  # a member's agent registered again
    CUT_OFF = "cut_off"  # a node cut off from etcd stopped its workers
    PEER_UNHEALTHY = "peer_unhealthy"  # a peer's agent reported its workers unhealthy
    GPU = "gpu"  # a GPU check failed
    OTHER = "other"


class Recovery(str, enum.Enum):
    """Where a fault's lost time ends."""

    WORKERS_RUNNING = "workers_running"  # every member of the next round ran its workers
    ROUND_FORMED = "round_formed"  # the next round formed (its workers' start is not known)
    JOB_ENDED = "job_ended"  # the job ended without running again
    NOT_YET = "not_yet"  # not recovered when the report was made: counted until then


@dataclass(frozen=True)
class RoundBand:
    """One round: who was in it, when its workers ran and how it ended.

    ``running_at``: when the last member's workers started (None: no member's
    start is in the history); ``stopped_at``: when the first member stopped
    them, or the last finished (None: still running, or not known);
    ``ended_at``: when the next round formed or the job ended."""

    number: int
    formed_at: float
    members: tuple[str, ...]
    world_size: int | None
    running_at: float | None
    stopped_at: float | None
    ended_at: float | None
    end: RoundEnd
    end_reason: str


@dataclass(frozen=True)
class Fault:
    """One failure, the one that ended its round (the first seen, or the node
    whose loss made the others fail).

    ``cause`` is the failure's reason as its reporter wrote it (for a hang,
    the attribution that names the rank and where it was); ``rank`` and
    ``node`` are those it names (None where it names none). ``lost_s`` runs
    from the moment the fault began (``time`` less ``undetected_s``, the part
    before its detection, e.g. a hang timeout) to ``recovered_at``
    (``recovery`` says which moment that is). ``rework_s``: at most this much
    training before the fault is repeated, the part after the last checkpoint
    committed in its round (less when the memory tier held a newer step)."""

    time: float
    round: int
    kind: FaultKind
    cause: str
    rank: int | None
    node: str | None
    reported_by: str
    undetected_s: float
    recovered_at: float
    recovery: Recovery
    lost_s: float
    rework_s: float


# Checkpoint.tier: committed for the job on disk, or a node's memory-tier snapshot.
TIER_DISK = "disk"
TIER_MEMORY = "memory"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint saved (``ok``) or a save that failed: its step, and where
    it lies (``tier``: TIER_DISK, committed for the job, or TIER_MEMORY, a
    node's newest memory-tier snapshot, whose time the history does not hold)."""

    step: int
    time: float | None
    tier: str
    round: int
    node: str
    ok: bool
    message: str


@dataclass(frozen=True)
class Straggler:
    """A rank named as persistently slower than its peers (a ``straggler`` event)."""

    time: float
    round: int
    reported_by: str
    rank: int | None
    node: str | None
    message: str


@dataclass(frozen=True)
class Goodput:
    """Where the report's span went, as the timeline can tell it; computed by
    ``elasticctl report`` from the events (``source``), not the agents'
    goodput metric.

    The parts add up to ``span_s``: ``productive_s`` (workers running, less
    the two below), ``rework_s`` (training after a failed round's last
    commit: repeated), ``lost_s`` (each fault's lost time: undetected, then
    until the workers ran again; ``lost_by_kind`` splits it by FaultKind) and
    ``other_s`` (starting up, waiting for nodes, planned reconfigurations).
    ``ratio``: productive_s / span_s (None for an empty span)."""

    source: str
    start: float | None
    end: float | None
    span_s: float
    productive_s: float
    rework_s: float
    lost_s: float
    other_s: float
    ratio: float | None
    lost_by_kind: dict[str, float]


@dataclass(frozen=True)
class History:
    """How much of the job's history the report saw. ``complete`` is False
    when events may be gone (``gaps`` says which and why); the report then
    counts goodput from ``complete_from``, the first moment from which no
    event is missing."""

    events: int
    complete: bool
    complete_from: float | None
    gaps: tuple[str, ...]


@dataclass(frozen=True)
class JobReport:
    """A job's timeline: its rounds, faults, checkpoints, stragglers and goodput.

    ``state``: "succeeded", "failed", "running", or "not started" (no round
    formed); ``made_at``: the report's "now"."""

    job_id: str
    made_at: float
    state: str
    history: History
    rounds: tuple[RoundBand, ...]
    faults: tuple[Fault, ...]
    checkpoints: tuple[Checkpoint, ...]
    stragglers: tuple[Straggler, ...]
    goodput: Goodput

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON data (``elasticctl report --json``), with
        ``schema`` (:data:`SCHEMA_VERSION`) first."""
        return {"schema": SCHEMA_VERSION, **_plain(dataclasses.asdict(self))}


def _plain(value: Any) -> Any:
    """``value`` with enum members as their values and tuples as lists."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
