"""The settings of a job's rendezvous: their defaults, torchrun's ``--nnodes``
syntax, and :class:`RendezvousConfig`, validated on construction.

Read by the leader's decisions, the node and its parts, the torchrun backend
and the agent's configuration; the records these settings produce live in
:mod:`elastic.rendezvous.api`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from elastic.errors import ConfigError, MalformedRecordError
from elastic.records import cap_text, int_field, load_object, typed_field, validate_id

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
# How long a member's agent may answer no probe of its ring peer before the
# leader ends its lease (elastic.rendezvous.decisions.revoke_frozen); 0: never,
# the lease alone decides. The shortest other than 0: a garbage collection or
# a busy moment of a live agent lasts less.
DEFAULT_FREEZE_TIMEOUT_S = 1.0
MIN_FREEZE_TIMEOUT_S = 0.5


def default_freeze_timeout_s(lease_ttl_s: float) -> float:
    """The freeze timeout when none is given: DEFAULT_FREEZE_TIMEOUT_S, or half
    the lease TTL when that is shorter (never below MIN_FREEZE_TIMEOUT_S)."""
    return max(MIN_FREEZE_TIMEOUT_S, min(DEFAULT_FREEZE_TIMEOUT_S, lease_ttl_s / 2))


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
    ``freeze_timeout_s``: 0 (the default here) leaves a frozen member to its
    lease; above 0, a member whose agent answered no probe for this long is
    proven frozen and its lease revoked (``revoke_frozen`` in
    :mod:`elastic.rendezvous.decisions`).
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
    freeze_timeout_s: float = 0.0

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
        if self.freeze_timeout_s != 0 and not (
                MIN_FREEZE_TIMEOUT_S <= self.freeze_timeout_s < self.lease_ttl_s):
            raise ConfigError(
                f"freeze timeout {self.freeze_timeout_s:g} s must be 0 (off: the lease alone "
                f"decides) or from {MIN_FREEZE_TIMEOUT_S:g} s to below the lease TTL "
                f"({self.lease_ttl_s:g} s)")

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
