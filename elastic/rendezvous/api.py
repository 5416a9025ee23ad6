"""Rendezvous data types: the settings of a job's rendezvous, the records kept in
etcd, and the decision a leader takes about the next round.

Records are JSON objects in etcd; ``from_json`` validates them and raises
:class:`~elastic.errors.MalformedRecordError` naming the key, so garbage written
by hand or by an incompatible version is reported rather than crashing a node.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from elastic.errors import ConfigError, MalformedRecordError

DEFAULT_SETTLE_S = 1.0
DEFAULT_LEASE_TTL_S = 5.0
MIN_LEASE_TTL_S = 1.0  # etcd's smallest lease TTL
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_MAX_RESTARTS = 3
DEFAULT_RESTART_WINDOW_S = 3600.0
DEFAULT_START_TIMEOUT_S = 60.0
# torchrun's default: how long the job waits for the other members once one
# node's workers have all exited 0.
DEFAULT_EXIT_BARRIER_TIMEOUT_S = 300.0

# Free text (reasons, event messages) is cut to this many characters wherever it
# enters a record: a round transaction carries the round's reason and an event,
# and etcd refuses requests over 1.5 MiB, so one huge reason would make every
# round commit fail and the leader retry forever.
MAX_REASON_CHARS = 1024
MAX_PORT = 65535
# A record read from etcd larger than this is refused unparsed, naming its key:
# none the project writes comes near it (a round of 1,000 members is ~100 KB),
# and etcd's own request limit is 1.5 MiB by default.
MAX_RECORD_BYTES = 1 << 20
# Wall times in records (seconds since the epoch) beyond this (the year 5138)
# are refused: time.localtime and strftime fail on them when a command prints them.
MAX_WALL_TIME_S = 1e11
# Host names and HOST:PORT addresses: what DNS names, IPv4 and bracketed IPv6
# literals (with a %zone) are made of; nothing that would select another gRPC
# transport ("unix:/path"), and no space or control character for a log line.
MAX_HOST_CHARS = 253
# More workers than this on one node is not a configuration but a typo or an
# attack (a world size in the billions would make every rank's env absurd).
MAX_NPROC = 1 << 16
_HOST_RE = re.compile(r"[A-Za-z0-9._:%\[\]-]*")

# fullmatch, never match with "$": "$" also matches before a final newline ("a\n").
_JOB_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def validate_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a usable job or node id, else raise ConfigError."""
    if not isinstance(value, str) or not _JOB_ID_RE.fullmatch(value):
        raise ConfigError(
            f"invalid {kind} {cap_text(repr(value), 80)}: use 1-128 letters, digits, '.', "
            "'_' or '-', "
            "starting with a letter or digit"
        )
    return value


# What must not reach a log line or a terminal as it is: C0 and C1 control
# characters (escape sequences that drive the terminal, carriage returns and
# newlines that overwrite or forge a line), DEL, the invisible format characters
# that reorder or hide text (bidirectional overrides and isolates, zero-width
# characters, line and paragraph separators) and lone surrogates (which cannot
# even be encoded to print: a UnicodeEncodeError at the terminal).
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff"
    r"\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in "\t\n\r":
        return " "  # a traceback or a multi-line message stays readable on one line
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable_text(text: str) -> str:
    """``text`` safe to log or print: tabs and line breaks become spaces, and
    every other control or invisible format character (see ``_UNPRINTABLE``)
    becomes its escape (``\\x1b``, ``\\u202e``), so it is seen, not obeyed.

    The one sanitiser of free text from outside (etcd records, gRPC requests,
    worker error files); :func:`cap_text` applies it. Idempotent.
    """
    if not _UNPRINTABLE.search(text):
        return text
    return _UNPRINTABLE.sub(_escape, text)


def cap_text(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """``text`` made printable (:func:`printable_text`) if that has at most
    ``limit`` characters, else its start followed by ``"... [N more
    characters]"``, the whole at most ``limit`` characters long.

    Idempotent: a capped text is returned unchanged. A ``limit`` too small to
    hold the marker cuts without it.
    """
    text = printable_text(text)
    if len(text) <= limit:
        return text
    # The marker for N = len(text) is the longest it can be, so using its length
    # guarantees the result fits whatever N turns out to be.
    longest_marker = len(f"... [{len(text)} more characters]")
    if limit < longest_marker:
        return text[:max(0, limit)]
    kept = limit - longest_marker
    return f"{text[:kept]}... [{len(text) - kept} more characters]"


def parse_nnodes(text: str) -> tuple[int, int]:
    """Parse torchrun's ``--nnodes`` syntax: ``N`` or ``MIN:MAX``.

    Raises ConfigError with the offending value for anything else, including
    ``0``, negative counts and ``MIN > MAX``.
    """
    parts = str(text).strip().split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isascii() and p.strip().isdigit()
                                           and len(p.strip()) <= 9 for p in parts):
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
    ``scale_up_wait_s``: 0 grows a running round as soon as a node joins; above
    0, a joining node waits for the next committed checkpoint (so the restart
    that grows the round redoes no work), at most this long.
    """

    job_id: str
    min_nodes: int
    max_nodes: int
    settle_s: float = DEFAULT_SETTLE_S
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    max_restarts: int = DEFAULT_MAX_RESTARTS
    restart_window_s: float = DEFAULT_RESTART_WINDOW_S
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    exit_barrier_timeout_s: float = DEFAULT_EXIT_BARRIER_TIMEOUT_S
    scale_up_wait_s: float = 0.0

    @property
    def suspect_s(self) -> float:
        """How long a node reported unreachable is left out of new rounds: by
        then a dead node's lease has expired, and a live one is let back in."""
        return 2 * self.lease_ttl_s

    def __post_init__(self) -> None:
        validate_id("job id", self.job_id)
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ConfigError(
                f"nnodes {self.min_nodes}:{self.max_nodes}: need 1 <= MIN <= MAX"
            )
        if self.settle_s < 0:
            raise ConfigError(f"settle window {self.settle_s} s must not be negative")
        if self.lease_ttl_s < MIN_LEASE_TTL_S:
            raise ConfigError(f"lease TTL {self.lease_ttl_s} s must be at least "
                              f"{MIN_LEASE_TTL_S:g} s")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"join timeout {self.join_timeout_s} s must be positive")
        if self.max_restarts < 0:
            raise ConfigError(f"max restarts {self.max_restarts} must not be negative")
        if self.restart_window_s <= 0:
            raise ConfigError(f"restart window {self.restart_window_s} s must be positive")
        if self.start_timeout_s <= 0:
            raise ConfigError(f"start timeout {self.start_timeout_s} s must be positive")
        if self.exit_barrier_timeout_s <= 0:
            raise ConfigError(
                f"exit barrier timeout {self.exit_barrier_timeout_s} s must be positive")
        if self.scale_up_wait_s < 0:
            raise ConfigError(f"scale-up wait {self.scale_up_wait_s} s must not be negative")

    def job_settings(self) -> dict[str, Any]:
        """The settings every agent of a job must agree on (stored under ``config``)."""
        return {"min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "max_restarts": self.max_restarts, "restart_window_s": self.restart_window_s,
                "exit_barrier_timeout_s": self.exit_barrier_timeout_s,
                "scale_up_wait_s": self.scale_up_wait_s}

    @staticmethod
    def settings_from_json(key: str, raw: bytes) -> dict[str, Any]:
        """The ``config`` record: the settings :meth:`job_settings` wrote.

        Raises MalformedRecordError naming the key and the field when it is not
        a JSON object or a known setting is not a number of its kind (counts:
        non-negative ints; seconds: finite, non-negative). Settings this
        version does not know (a newer writer's) are returned as short
        printable text (their repr), name and value: enough to compare and show.
        """
        obj = load_object(key, raw)
        settings: dict[str, Any] = {}
        for name, value in obj.items():
            if name in _COUNT_SETTINGS:
                settings[name] = int_field(key, obj, name, 0)
            elif name in _SECONDS_SETTINGS:
                seconds = typed_field(key, obj, name, (int, float))
                if not (isinstance(seconds, int) or math.isfinite(seconds)) or seconds < 0:
                    raise MalformedRecordError(key, f"field {name!r} is {seconds!r}, expected "
                                                    "a finite number of seconds >= 0")
                settings[name] = seconds
            else:
                settings[cap_text(name, 64)] = cap_text(repr(value), 64)
        return settings


_COUNT_SETTINGS = frozenset({"min_nodes", "max_nodes", "max_restarts"})
_SECONDS_SETTINGS = frozenset({"restart_window_s", "exit_barrier_timeout_s", "scale_up_wait_s"})


# Readers of record fields, shared by every record kept in etcd (events too).
# Each returns a value of the promised type and range or raises
# MalformedRecordError naming the key and the field: records are hostile input.

def load_object(key: str, raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object; MalformedRecordError if it is not one,
    or if it is larger than MAX_RECORD_BYTES (refused before it is parsed)."""
    if len(raw) > MAX_RECORD_BYTES:
        raise MalformedRecordError(key, f"{len(raw)} bytes, more than the {MAX_RECORD_BYTES} "
                                        "a record may have")
    try:
        obj = json.loads(raw.decode("utf-8"))
    # ValueError also covers bad UTF-8 and integers of more than 4300 digits;
    # RecursionError, arrays nested thousands deep (json recurses per level).
    except (ValueError, RecursionError) as exc:
        raise MalformedRecordError(key, f"not JSON ({cap_text(str(exc), 200)})") from exc
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"expected a JSON object, got {type(obj).__name__}")
    return obj


_MISSING = object()


def typed_field(key: str, obj: dict, name: str, kind: type | tuple[type, ...],
                default: Any = _MISSING) -> Any:
    """``obj[name]`` if it is a ``kind`` (a bool is never an int here), ``default``
    when absent and a default is given; else MalformedRecordError naming the field."""
    if name not in obj:
        if default is _MISSING:
            raise MalformedRecordError(key, f"missing field {name!r}")
        return default
    value = obj[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise MalformedRecordError(key, f"field {name!r} has the wrong type: {value!r}")
    if not isinstance(value, kind):
        raise MalformedRecordError(
            key, f"field {name!r} has the wrong type: {type(value).__name__}")
    return value


def int_field(key: str, obj: dict, name: str, low: int, high: int | None = None,
              default: Any = _MISSING) -> int:
    """An int field within ``low..high``; MalformedRecordError naming the field if not."""
    value = typed_field(key, obj, name, int, default)
    if value < low or (high is not None and value > high):
        bounds = f"{low}..{high}" if high is not None else f"at least {low}"
        raise MalformedRecordError(key, f"field {name!r} is {value}, expected {bounds}")
    return value


def port_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> int:
    """A TCP port, 0..65535 (0: none)."""
    return int_field(key, obj, name, 0, MAX_PORT, default)


def time_field(key: str, obj: dict, name: str, value: Any = _MISSING) -> float:
    """A wall time, 0..MAX_WALL_TIME_S seconds since the epoch, as a float:
    ``obj[name]``, or ``value`` when given (an element of a list field). JSON
    has no NaN, but Python's json reads one."""
    if value is _MISSING:
        value = typed_field(key, obj, name, (int, float))
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedRecordError(key, f"field {name!r} holds a non-number: {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        seconds = math.inf
    if not math.isfinite(seconds):
        raise MalformedRecordError(key, f"field {name!r} is not a finite number")
    if not 0 <= seconds <= MAX_WALL_TIME_S:
        raise MalformedRecordError(key, f"field {name!r} is {seconds:g}, not a time "
                                        f"(0..{MAX_WALL_TIME_S:g} s since the epoch)")
    return seconds


def valid_host(host: str) -> bool:
    """Whether ``host`` is a host name or an IP address: 1..MAX_HOST_CHARS of
    what those are made of (letters, digits, '.', '-', '_', ':', '%', brackets)."""
    return 0 < len(host) <= MAX_HOST_CHARS and bool(_HOST_RE.fullmatch(host))


def host_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> str:
    """A host name or address ("" allowed): at most MAX_HOST_CHARS of what host
    names and IP literals are made of."""
    value = typed_field(key, obj, name, str, default)
    if value and not valid_host(value):
        raise MalformedRecordError(key, f"field {name!r} is not a host name or address: "
                                        f"{cap_text(value, 64)!r}")
    return value


def valid_addr(addr: str) -> bool:
    """Whether ``addr`` is HOST:PORT (a host as :func:`host_field` takes it, a
    port 1..65535): what a peer may dial, nothing else (no ``unix:`` path)."""
    host, sep, port = addr.rpartition(":")
    return (bool(sep) and valid_host(host)
            and port.isascii() and port.isdigit() and len(port) <= 5
            and 0 < int(port) <= MAX_PORT)


def addr_field(key: str, obj: dict, name: str, default: Any = _MISSING) -> str:
    """An agent's gRPC address: "" (none) or HOST:PORT (:func:`valid_addr`)."""
    value = typed_field(key, obj, name, str, default)
    if value and not valid_addr(value):
        raise MalformedRecordError(key, f"field {name!r} is not HOST:PORT: "
                                        f"{cap_text(value, 64)!r}")
    return value


def id_field(key: str, obj: dict, name: str, kind: str = "node id") -> str:
    """A string that passes :func:`validate_id`."""
    value = typed_field(key, obj, name, str)
    try:
        return validate_id(kind, value)
    except ConfigError as exc:
        raise MalformedRecordError(key, f"field {name!r}: {exc}") from None


def text_field(key: str, obj: dict, name: str, default: str = "",
               limit: int = MAX_REASON_CHARS) -> str:
    """A free-text field, made printable and capped (:func:`cap_text`): a
    record someone else wrote may hold anything of any size."""
    return cap_text(typed_field(key, obj, name, str, default), limit)


def id_in_key(key: str, prefix: str) -> str:
    """The node id that ``key`` names right under ``prefix`` (``nodes/<id>``,
    ``requests/drain/<id>``...); MalformedRecordError when what follows the
    prefix is not one valid id (``nodes/../round``, ``nodes/a/b``)."""
    rest = key[len(prefix):] if key.startswith(prefix) else key
    try:
        return validate_id("node id", rest)
    except ConfigError as exc:
        raise MalformedRecordError(key, f"the key does not end in a node id: {exc}") from None


@dataclass(frozen=True)
class NodeInfo:
    """What an agent registers about itself under ``nodes/<node_id>`` (with its lease)."""

    node_id: str
    host: str
    nproc: int = 1
    addr: str = ""  # host:port of the agent's gRPC server, "" if it serves none
    master_port: int = 0  # a port free on ``host`` for the workers' rendezvous if rank 0
    version: str = ""
    # The round whose workers this agent still runs when it registers (again,
    # after its lease ran out during an etcd outage); 0 when it runs none.
    running_round: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "NodeInfo":
        """Parse the record at ``key`` (``.../nodes/<node_id>``).

        Raises MalformedRecordError naming the key and the field when it is not
        a JSON object of correctly typed fields, ``nproc`` < 1, a port is outside
        0..65535, ``host`` is not a host name or ``addr`` not HOST:PORT, or
        ``node_id`` is not a valid id or not the key's.
        """
        obj = load_object(key, raw)
        info = cls(
            node_id=id_field(key, obj, "node_id"),
            host=host_field(key, obj, "host"),
            nproc=int_field(key, obj, "nproc", 1, MAX_NPROC),
            addr=addr_field(key, obj, "addr", ""),
            master_port=port_field(key, obj, "master_port", 0),
            version=text_field(key, obj, "version", "", limit=64),
            running_round=int_field(key, obj, "running_round", 0, default=0),
        )
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
    starts workers for it, and agents exit. ``continues``: the number of the
    round whose workers this one keeps running, unchanged (0: a round of its
    own). The leader writes such a round when a malformed record replaced the
    round key: the write moved the fencing token on, but not the workers.
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
    continues: int = 0

    def __post_init__(self) -> None:
        # Capped here, not only where reasons come from, so that no round written
        # can outgrow etcd's request limit whatever produced its reason.
        object.__setattr__(self, "reason", cap_text(self.reason))

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def workers_round(self) -> int:
        """The round number this round's workers were started with (their
        ``ELASTIC_ROUND``): ``continues``, or this round's own number."""
        return self.continues or self.number

    def continued(self, number: int, reason: str, leader: str, created_at: float) -> "Round":
        """This round written again as round ``number``, its workers kept."""
        return replace(self, number=number, reason=reason, leader=leader,
                       created_at=created_at, continues=self.workers_round)

    def continued_by(self, other: "Round") -> bool:
        """Whether ``other`` keeps the workers of this round running: it
        continues them, with the same members, ranks and rank 0's address."""
        return (other.continues == self.workers_round and not other.outcome
                and (other.members, other.master_addr, other.master_port)
                == (self.members, self.master_addr, self.master_port))

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
        """Parse the round record stored at ``key`` whose etcd version is ``version``.

        Raises MalformedRecordError naming the key and the field when a field
        is missing or mistyped, ``number`` differs from ``version``, a member id
        is invalid or repeated, node ranks are not 0..n-1 in order, ``nproc`` <
        1, a port is outside 0..65535, a time is not finite, or ``outcome`` is
        not one of OUTCOMES. ``reason`` is capped at MAX_REASON_CHARS.
        """
        obj = load_object(key, raw)
        number = int_field(key, obj, "number", 1)
        if number != version:
            raise MalformedRecordError(
                key, f"round number {number} does not match the key's version {version}"
            )
        members = tuple(_member(key, i, m)
                        for i, m in enumerate(typed_field(key, obj, "members", list)))
        if [m.node_rank for m in members] != list(range(len(members))):
            raise MalformedRecordError(key, "node ranks are not 0..n-1 in order")
        if len({m.node_id for m in members}) != len(members):
            raise MalformedRecordError(key, "field 'members' names a node twice")
        leader = typed_field(key, obj, "leader", str, "")
        if leader:  # "" in records written before the leader was recorded
            leader = id_field(key, obj, "leader")
        continues = int_field(key, obj, "continues", 0, number - 1, default=0)
        outcome = typed_field(key, obj, "outcome", str, "")
        if outcome not in OUTCOMES:
            raise MalformedRecordError(key, f"field 'outcome' is {cap_text(outcome, 64)!r}, "
                                            f"expected one of {OUTCOMES}")
        return cls(
            number=number,
            members=members,
            master_addr=host_field(key, obj, "master_addr"),
            master_port=port_field(key, obj, "master_port"),
            reason=text_field(key, obj, "reason"),
            leader=leader,
            created_at=time_field(key, obj, "created_at") if "created_at" in obj else 0.0,
            failures=tuple(time_field(key, obj, f"failures[{i}]", t)
                           for i, t in enumerate(typed_field(key, obj, "failures", list, []))),
            outcome=outcome,
            continues=continues,
        )


OUTCOMES = ("", "succeeded", "failed")  # a round's outcome; "" while the job runs


def _member(key: str, index: int, obj: Any) -> Member:
    """Member ``index`` of the round record at ``key``; MalformedRecordError if invalid."""
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"field 'members[{index}]' is not an object")
    # Renamed so that errors name the field as it sits in the record: members[2].nproc.
    named = {f"members[{index}].{name}": value for name, value in obj.items()}

    def name(field_name: str) -> str:
        return f"members[{index}].{field_name}"

    return Member(
        node_id=id_field(key, named, name("node_id")),
        node_rank=int_field(key, named, name("node_rank"), 0),
        host=host_field(key, named, name("host")),
        nproc=int_field(key, named, name("nproc"), 1, MAX_NPROC),
        addr=addr_field(key, named, name("addr"), ""),
    )


@dataclass(frozen=True)
class Standbys:
    """The ``standbys`` record: agent addresses of registered non-members (the
    leader publishes the STANDBY_WITNESSES longest registered)."""

    addrs: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"addrs": list(self.addrs)}).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Standbys":
        """Raises MalformedRecordError naming the key when invalid: ``addrs`` is
        not a list of HOST:PORT addresses (which members dial), or has more
        than MAX_STANDBYS of them."""
        addrs = typed_field(key, load_object(key, raw), "addrs", list)
        if len(addrs) > MAX_STANDBYS:
            raise MalformedRecordError(key, f"field 'addrs' lists {len(addrs)} addresses, "
                                            f"more than {MAX_STANDBYS}")
        for i, addr in enumerate(addrs):
            if not isinstance(addr, str) or not valid_addr(addr):
                shown = cap_text(addr, 64) if isinstance(addr, str) else type(addr).__name__
                raise MalformedRecordError(key, f"field 'addrs[{i}]' is not HOST:PORT: "
                                                f"{shown!r}")
        return cls(tuple(addrs))


# A member cut off from etcd asks every standby at once: more than this is no
# list the leader wrote.
MAX_STANDBYS = 4096
# How many standbys the leader publishes: a handful of witnesses tells a
# member whether etcd answers outside its partition, and a short list that
# stops changing once that many nodes registered keeps the record from being
# rewritten to every node at every registration (N^2 watch events at start).
STANDBY_WITNESSES = 8


@dataclass(frozen=True)
class DrainRequest:
    """``requests/drain/<node_id>``: take that node out at the next round
    (written by the node itself on SIGTERM, or by ``elasticctl drain``)."""

    by: str  # a node id, or "elasticctl"
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", cap_text(self.reason))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "DrainRequest":
        """Raises MalformedRecordError naming the key and the field when ``by``
        is not a valid id or ``reason`` not text (capped at MAX_REASON_CHARS)."""
        obj = load_object(key, raw)
        return cls(by=id_field(key, obj, "by"), reason=text_field(key, obj, "reason"))


@dataclass(frozen=True)
class RestartRequest:
    """Someone asks for a new round with the same members (e.g. a worker failed)."""

    node_id: str  # who asks: a node id, or "elasticctl"
    round: int  # the round it is about; requests about older rounds are stale
    reason: str
    failure: bool = False  # counts against the restart budget (a crash, a hang)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", cap_text(self.reason))

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "RestartRequest":
        """Parse the request at ``key``. Raises MalformedRecordError naming the key
        and the field when a field is missing or mistyped, ``node_id`` is not a
        valid id or ``round`` is negative. ``reason`` is capped at MAX_REASON_CHARS."""
        obj = load_object(key, raw)
        return cls(
            node_id=id_field(key, obj, "node_id"),
            round=int_field(key, obj, "round", 0),
            reason=text_field(key, obj, "reason"),
            failure=typed_field(key, obj, "failure", bool, False),
        )


class ReportKind(enum.Enum):
    """What a node reports to the leader (one key per kind and node under ``requests/``)."""

    STARTED = "started"  # this node started the workers of ``round``
    DONE = "done"  # this node's workers of ``round`` all exited 0
    SUSPECT = "suspect"  # the agent of the node named in the key did not answer ``by``


@dataclass(frozen=True)
class Report:
    """A node's report to the leader, written under the reporter's lease."""

    round: int
    by: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Report":
        """Raises MalformedRecordError naming the key and field when invalid."""
        obj = load_object(key, raw)
        return cls(round=int_field(key, obj, "round", 0), by=id_field(key, obj, "by"))


class Action(enum.Enum):
    """What the leader does next."""

    WAIT = "wait"  # nothing to commit now; look again at ``wake_at`` or on the next change
    CLOSE_ROUND = "close_round"  # commit a new round with ``members``
    FAIL_JOB = "fail_job"  # the restart budget is spent, or the exit barrier timed out
    SUCCEED_JOB = "succeed_job"  # every member's workers exited 0: commit the job's success


@dataclass(frozen=True)
class Decision:
    """The result of a pure decision: an action, its reason for the log, and when
    to look again even if nothing changes (None: only on the next change)."""

    action: Action
    reason: str
    members: tuple[str, ...] = ()
    wake_at: float | None = None
    failures: tuple[float, ...] = ()  # the budget history the new round carries
    # Members that did not start in time: the leader keeps them out for suspect_s.
    suspects: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observed:
    """What the leader knows when it decides.

    ``alive`` lists registered nodes in join order (etcd create revision).
    ``first_seen`` maps node ids to the leader's clock reading when it first
    saw them (nodes in the current round need no entry). ``current`` is None
    before the first round, or when the round key holds garbage.
    ``started`` maps node ids to the last round they reported starting
    workers for; ``done`` maps node ids whose workers all exited 0 to (round,
    the leader's clock when it learnt it); ``suspects`` maps node ids whose
    agent a peer found unreachable (this registration of it) to the leader's
    clock when it learnt it. ``registered_since_round`` names the nodes whose
    registration is newer than ``current`` (an agent that lost its lease, or
    was restarted, and came back): they are newcomers to that round.
    ``checkpointed_since`` names the nodes registered before the latest
    checkpoint commit: a checkpoint was committed since they joined.
    """

    current: Round | None
    alive: tuple[NodeInfo, ...]
    first_seen: dict[str, float] = field(default_factory=dict)
    restart_requests: tuple[RestartRequest, ...] = ()
    draining: frozenset[str] = frozenset()
    started: dict[str, int] = field(default_factory=dict)
    done: dict[str, tuple[int, float]] = field(default_factory=dict)
    suspects: dict[str, float] = field(default_factory=dict)
    registered_since_round: frozenset[str] = frozenset()
    checkpointed_since: frozenset[str] = frozenset()
