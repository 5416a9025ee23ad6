"""What the job's event messages say, read back for the job report (pure).

Events are records for people (:mod:`elastic.events`): the kind is the
contract, the message is prose. The report reads a few things back from that
prose: the members of a round, a world size, a transition's reason, the step
of a checkpoint, the rank and node a failure names, and what kind of failure
it was. Each reader is forgiving: a message that does not have the expected
shape gives None (or :attr:`FaultKind.OTHER`), never an error, and the
message itself is still shown as it was written.

The wording read here is written by the agent's lifecycle (``state``:
``BEFORE -> AFTER: reason``), the leader's rendezvous (``round``: ``round N
formed with [...]: why``; ``outcome``: ``job succeeded|failed: why``; the
triggers of ``elastic.rendezvous.decisions``), the revoker (``frozen``), the
checkpoint commit log (``checkpoint``) and the worker health rules
(:mod:`agent.health`). A test per shape (tests/unit/test_report.py) keeps
the two sides together.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.report_model import FaultKind
from elastic.events import KIND_STATE, Event


_TRANSITION = re.compile(r"^([A-Z_]+) -> ([A-Z_]+): (.*)$", re.S)
_MEMBERS = re.compile(r"formed with \[([^\]]*)\]")
_QUOTED = re.compile(r"'([^']*)'")
_WORLD = re.compile(r"\bworld size (\d+)")
_RANK = re.compile(r"\brank (\d+)")
_NODE = re.compile(r"\(node ([^)\s]+)\)")
_PEER = re.compile(r"\bpeer (\S+) has reported")
_UNDETECTED = re.compile(r"(?:made no progress|sent no heartbeat) for (\d+(?:\.\d+)?) s")
_CHECKPOINT = re.compile(r"^checkpoint of step (\d+) (committed|failed)")
_OUTCOME = re.compile(r"^job (succeeded|failed)\b")
# The triggers of a round's reason (decisions.py), each naming nodes or a request.
_LOST = re.compile(r"(?:^|: |; )lost ([^;]+)")
_REJOINED = re.compile(r"(?:^|: |; )registered again: ([^;]+)")
_NO_START = re.compile(r"(?:^|: |; )([^;:]+) did not start workers within")
_JOINED = re.compile(r"(?:^|: |; )joined ")
_DRAINED = re.compile(r"(?:^|: |; )drained ")
_REQUEST = re.compile(r"restart requested by (\S+): (.*?)(?=; restart requested by |; joined |"
                      r"; left out |; closing with |; restart budget spent|, but only |"
                      r"; \d+ nodes? ready|$)", re.S)
_REVOKED = re.compile(r"revoking the lease of (\S+):")
# Causes, in the order they are tried: the first that matches names the kind.
_CAUSES = (
    (re.compile(r"cut off from etcd"), FaultKind.CUT_OFF),
    (re.compile(r"has reported its workers unhealthy"), FaultKind.PEER_UNHEALTHY),
    (re.compile(r"made no progress|sent no heartbeat|\bhung\b|\bhang\b"), FaultKind.HANG),
    (re.compile(r"exited with|killed by signal"), FaultKind.WORKER_EXIT),
    (re.compile(r"GPU check"), FaultKind.GPU),
)


@dataclass(frozen=True)
class Transition:
    """A ``state`` event read back: ``before -> after: reason``."""

    before: str
    after: str
    reason: str


@dataclass(frozen=True)
class Trigger:
    """One reason a round gave for replacing the one before it."""

    kind: FaultKind | None  # None: not a failure (a join, a drain, a requested restart)
    cause: str
    node: str | None  # the node it names (lost, restarted, not started)
    by: str | None  # who asked for the restart, for a request


def transition(event: Event) -> Transition | None:
    """The transition of a ``state`` event; None for another kind or shape."""
    if event.kind != KIND_STATE:
        return None
    found = _TRANSITION.match(event.message)
    return Transition(*found.groups()) if found else None


def round_members(message: str) -> tuple[str, ...]:
    """The node ids of ``round N formed with ['a', 'b']: ...`` (empty when not said)."""
    found = _MEMBERS.search(message)
    return tuple(_QUOTED.findall(found.group(1))) if found else ()


def round_reason(message: str) -> str:
    """Why a round formed: what follows its member list (the whole message otherwise)."""
    found = _MEMBERS.search(message)
    rest = message[found.end():] if found else message
    return rest[2:] if rest.startswith(": ") else rest


def continues(message: str) -> bool:
    """Whether a ``round`` event is a round written again whose workers run on."""
    return "written again" in message


def world_size(message: str) -> int | None:
    """The world size a message states (``node rank 0 of 2, world size 8``)."""
    found = _WORLD.search(message)
    return int(found.group(1)) if found else None


def outcome(message: str) -> str | None:
    """"succeeded" or "failed" from an ``outcome`` event's message."""
    found = _OUTCOME.match(message)
    return found.group(1) if found else None


def checkpoint(message: str) -> tuple[int, bool] | None:
    """(step, committed) of a ``checkpoint`` event; None for another shape."""
    found = _CHECKPOINT.match(message)
    return (int(found.group(1)), found.group(2) == "committed") if found else None


def named_rank(text: str) -> int | None:
    """The first rank a text names (``rank 3``), else None."""
    found = _RANK.search(text)
    return int(found.group(1)) if found else None


def named_node(text: str) -> str | None:
    """The node a text names: ``(node b)``, or the peer of ``peer b has reported``."""
    found = _NODE.search(text) or _PEER.search(text)
    return found.group(1) if found else None


def undetected_s(cause: str) -> float:
    """How long a hang went undetected, as its verdict says (the longest, if
    several); 0.0 for a failure seen at once."""
    return max((float(s) for s in _UNDETECTED.findall(cause)), default=0.0)


def fault_kind(cause: str) -> FaultKind | None:
    """The kind of failure a stop's or a request's reason describes; None when
    it describes none (a restart an operator asked for, a job's end)."""
    return next((kind for pattern, kind in _CAUSES if pattern.search(cause)), None)


def is_first_hand(t: Transition) -> bool:
    """Whether a stop's reason is a failure this node saw itself, rather than
    its following a new round, the job's end or a drain."""
    return (t.after == "STOPPING" and not t.reason.startswith(("round ", "job "))
            and fault_kind(t.reason) is not None)


def revoked_node(message: str) -> str | None:
    """The node of a ``frozen`` event that revoked a lease (``revoking the lease of b:``)."""
    found = _REVOKED.search(message)
    return found.group(1) if found else None


def triggers(reason: str) -> list[Trigger]:
    """The triggers of a round's (or a failed outcome's) reason, failures first."""
    found: list[Trigger] = []
    for pattern, kind in ((_LOST, FaultKind.NODE_LOST), (_REJOINED, FaultKind.AGENT_RESTARTED),
                          (_NO_START, FaultKind.NO_START)):
        for match in pattern.finditer(reason):
            text = match.group(0).lstrip(":; ")
            for node in match.group(1).split(", "):
                found.append(Trigger(kind, text, node.strip(), None))
    for match in _REQUEST.finditer(reason):
        by, cause = match.group(1), match.group(2)
        found.append(Trigger(fault_kind(cause), cause, named_node(cause), by))
    if _JOINED.search(reason) or _DRAINED.search(reason):
        found.append(Trigger(None, reason, None, None))
    return sorted(found, key=lambda t: t.kind is None)
