"""Rendezvous data types: the settings of a job's rendezvous, the records kept in
etcd, and the decision a leader takes about the next round.

Records are JSON objects in etcd; ``from_json`` validates them and raises
:class:`~elastic.errors.MalformedRecordError` naming the key, so garbage written
by hand or by an incompatible version is reported rather than crashing a node.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic.errors import ConfigError, MalformedRecordError

DEFAULT_SETTLE_S = 1.0
DEFAULT_LEASE_TTL_S = 5.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 3600.0

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a usable job or node id, else raise ConfigError."""
    if not isinstance(value, str) or not _JOB_ID_RE.match(value):
        raise ConfigError(
            f"invalid {kind} {value!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse torchrun's ``--nnodes`` syntax: ``N`` or ``MIN:MAX``.

    Raises ConfigError with the offending value for anything else, including
    ``0``, negative counts and ``MIN > MAX``.
    """
    parts = str(text).strip().split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(
            f"--nnodes {text!r}: expected a node count N or a range MIN:MAX, e.g. 2 or 2:4"
        )
    low, high = (int(parts[0]), int(parts[-1]))
    if low < 1:
        raise ConfigError(f"--nnodes {text!r}: the minimum number of nodes must be at least 1")
    if low > high:
        raise ConfigError(
            f"--nnodes {text!r}: MIN ({low}) must not be greater than MAX ({high})"
        )
    return low, high


@dataclass(frozen=True)
class RendezvousConfig:
    """How a job's rounds are formed. Validated on construction.

    ``settle_s``: a round that could grow closes once ``min_nodes`` are present
    and no new node has arrived for this long. ``lease_ttl_s``: a node that
    stops renewing its lease is considered gone after this long. The restart
    budget: the job fails when more than ``max_restarts`` failures (worker
    crashes, hangs; not membership changes) happen within ``restart_window_s``.
    """

    job_id: str
    min_nodes: int
    max_nodes: int
    settle_s: float = DEFAULT_SETTLE_S
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S

    def __post_init__(self) -> None:
        validate_id("job id", self.job_id)
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(
                f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX"
            )
        if self.settle_s < 0:
            raise ConfigError(f"settle window {self.settle_s} s must not be negative")
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease TTL {self.lease_ttl_s} s must be at least 1 s")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"join timeout {self.join_timeout_s} s must be positive")
        if self.max_restarts < 0:
            raise ConfigError(f"max restarts {self.max_restarts} must not be negative")
        if self.restart_window_s <= 0:
            raise ConfigError(f"restart window {self.restart_window_s} s must be positive")

    def job_settings(self) -> dict[str, Any]:
        """The settings every agent of a job must agree on (stored under ``config``)."""
        return {"min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "max_restarts": self.max_restarts, "restart_window_s": self.restart_window_s}


def _load_object(key: str, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedRecordError(key, f"not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _field(key: str, obj: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in obj:
        raise MalformedRecordError(key, f"missing field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise MalformedRecordError(key, f"field {name!r} has the wrong type")
    return value


@dataclass(frozen=True)
class NodeInfo:
    """What an agent registers about itself under ``nodes/<node_id>`` (with its lease)."""

    node_id: str
    host: str
    nproc: int = 1
    addr: str = ""  # host:port of the agent's gRPC server, "" if it serves none
    master_port: int = 0  # a port free on ``host`` for the workers' rendezvous if rank 0
    version: str = ""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "NodeInfo":
        obj = _load_object(key, raw)
        info = cls(
            node_id=_field(key, obj, "node_id", str),
            host=_field(key, obj, "host", str),
            nproc=_field(key, obj, "nproc", int),
            addr=str(obj.get("addr", "")),
            master_port=int(obj.get("master_port", 0) or 0),
            version=str(obj.get("version", "")),
        )
        if info.nproc < 1:
            raise MalformedRecordError(key, "field 'nproc' must be at least 1")
        if not key.endswith("/" + info.node_id):
            raise MalformedRecordError(key, f"node_id {info.node_id!r} does not match the key")
        return info


@dataclass(frozen=True)
class Member:
    """A node's place in a round: its dense ``node_rank`` and first global rank."""

    node_id: str
    node_rank: int
    host: str
    nproc: int
    addr: str = ""


@dataclass(frozen=True)
class Round:
    """A committed round: who trains, in what order, and where rank 0 listens.

    ``number`` equals the version of the ``round`` key in etcd (the fencing
    token): every round write increments it by exactly one. ``failures`` holds
    the wall times of the failures counted against the restart budget. A round
    with an ``outcome`` ("succeeded" or "failed") is the job's last: nobody
    starts workers for it, and agents exit.
    """

    number: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    reason: str
    leader: str
    created_at: float  # wall-clock seconds, for humans
    failures: tuple[float, ...] = ()
    outcome: str = ""

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    def member(self, node_id: str) -> Member | None:
        for m in self.members:
            if m.node_id == node_id:
                return m
        return None

    def to_json(self) -> bytes:
        obj = asdict(self)
        obj["world_size"] = self.world_size
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes, version: int) -> "Round":
        """Parse the round record stored at ``key`` whose etcd version is ``version``."""
        obj = _load_object(key, raw)
        number = _field(key, obj, "number", int)
        if number != version:
            raise MalformedRecordError(
                key, f"round number {number} does not match the key's version {version}"
            )
        raw_members = _field(key, obj, "members", list)
        members = []
        for i, m in enumerate(raw_members):
            if not isinstance(m, dict):
                raise MalformedRecordError(key, f"member {i} is not an object")
            members.append(
                Member(
                    node_id=_field(key, m, "node_id", str),
                    node_rank=_field(key, m, "node_rank", int),
                    host=_field(key, m, "host", str),
                    nproc=_field(key, m, "nproc", int),
                    addr=str(m.get("addr", "")),
                )
            )
        if [m.node_rank for m in members] != list(range(len(members))):
            raise MalformedRecordError(key, "node ranks are not 0..n-1 in order")
        return cls(
            number=number,
            members=tuple(members),
            master_addr=_field(key, obj, "master_addr", str),
            master_port=_field(key, obj, "master_port", int),
            reason=str(obj.get("reason", "")),
            leader=str(obj.get("leader", "")),
            created_at=float(obj.get("created_at", 0.0)),
            failures=tuple(float(t) for t in obj.get("failures", ())),
            outcome=str(obj.get("outcome", "")),
        )


@dataclass(frozen=True)
class RestartRequest:
    """Someone asks for a new round with the same members (e.g. a worker failed)."""

    node_id: str  # who asks: a node id, or "elasticctl"
    round: int  # the round it is about; requests about older rounds are stale
    reason: str
    failure: bool = False  # counts against the restart budget (a crash, a hang)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "RestartRequest":
        obj = _load_object(key, raw)
        return cls(
            node_id=_field(key, obj, "node_id", str),
            round=_field(key, obj, "round", int),
            reason=str(obj.get("reason", "")),
            failure=bool(obj.get("failure", False)),
        )


class Action(enum.Enum):
    """What the leader does next."""

    WAIT = "wait"  # nothing to commit now; look again at ``wake_at`` or on the next change
    CLOSE_ROUND = "close_round"  # commit a new round with ``members``
    FAIL_JOB = "fail_job"  # the restart budget is spent: commit the job's failure


@dataclass(frozen=True)
class Decision:
    """The result of a pure decision: an action, its reason for the log, and when
    to look again even if nothing changes (None: only on the next change)."""

    action: Action
    reason: str
    members: tuple[str, ...] = ()
    wake_at: float | None = None
    failures: tuple[float, ...] = ()  # the budget history the new round carries


@dataclass(frozen=True)
class Observed:
    """What the leader knows when it decides.

    ``alive`` lists registered nodes in join order (etcd create revision).
    ``first_seen`` maps node ids to the leader's clock reading when it first
    saw them (nodes in the current round need no entry). ``current`` is None
    before the first round, or when the round key holds garbage.
    """

    current: Round | None
    alive: tuple[NodeInfo, ...]
    first_seen: dict[str, float] = field(default_factory=dict)
    restart_requests: tuple[RestartRequest, ...] = ()
    draining: frozenset[str] = frozenset()
