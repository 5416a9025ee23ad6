"""The checkpoint commit log: its interface and its record.

A checkpoint counts as committed when a :class:`CommitLog` has accepted its
:class:`CommitEntry`; the directory on disk alone does not make it so (see
the rule in :mod:`elastic.checkpoint`). Implementations:
:class:`elastic.checkpoint.commit.FileCommitLog` (a file beside the
checkpoints, for torchrun or no agent),
:class:`elastic.checkpoint.etcd_log.EtcdCommitLog` (the job's
``checkpoint/latest`` key, advanced by a transaction fenced by its ``round``
key: what the agent keeps) and
:class:`elastic.checkpoint.agent_log.AgentCommitLog` (that log, reached by a
worker through its agent).

This module imports without torch so the agent and elasticctl can read the log.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
import re
from typing import Any

from elastic.errors import CheckpointError
from elastic.records import cap_text

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CommitEntry:
    """One committed checkpoint.

    ``path`` is the checkpoint's directory name relative to the checkpoint root
    (``step-000000000100``), so nodes that mount the root at different places
    agree on it. ``time`` is seconds since the epoch when rank 0 committed it.
    ``save_s`` (seconds from ``save()`` to the commit) and ``size_bytes`` (all
    ranks' files) say how the save went; 0 when not measured (a record written
    before they existed).
    """

    step: int
    round: int
    world_size: int
    path: str
    time: float
    save_s: float = 0.0
    size_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: Any) -> "CommitEntry":
        """Parse a record written by :meth:`to_dict`.

        Raises :class:`CheckpointError` naming the problem when a field is
        missing or has the wrong type (unknown extra fields are ignored, so a
        newer writer can add some).
        """
        if not isinstance(record, dict):
            raise CheckpointError(f"commit record is not an object but a "
                                  f"{type(record).__name__}")
        for name, high in _INT_FIELDS.items():
            value = record.get(name, 0) if name == "size_bytes" else record.get(name)
            if type(value) is not int or not 0 <= value <= high:
                raise CheckpointError(f"commit record field {name!r} is {_shown(value)}, "
                                      f"expected an integer 0..{high}")
        for name in ("time", "save_s"):
            value = record.get(name, 0.0) if name == "save_s" else record.get(name)
            if (type(value) not in (int, float) or not math.isfinite(value)
                    or not 0 <= value <= _MAX_SECONDS):
                raise CheckpointError(f"commit record field {name!r} is {_shown(value)}, "
                                      f"expected a number of seconds 0..{_MAX_SECONDS:g}")
        path = record.get("path")
        if not isinstance(path, str) or not _CHECKPOINT_NAME.fullmatch(path):
            # The path is joined to the checkpoint root by every reader: only a
            # plain directory name may come in (no "..", no "/", no absolute path).
            raise CheckpointError(f"commit record field 'path' is {_shown(path)}, expected "
                                  "the name of a directory in the checkpoint root (letters, "
                                  "digits, '.', '_', '-', not starting with '.')")
        return cls(step=record["step"], round=record["round"],
                   world_size=record["world_size"], path=path, time=float(record["time"]),
                   save_s=float(record.get("save_s", 0.0)),
                   size_bytes=record.get("size_bytes", 0))


# What a commit record's numbers may be: int64 for what protobuf carries as
# int64 (the agent sends entries to its workers), int32 for the world size;
# times and durations up to MAX_WALL_TIME_S (the year 5138).
_INT_FIELDS = {"step": 2**63 - 1, "round": 2**63 - 1, "world_size": 2**31 - 1,
               "size_bytes": 2**63 - 1}
_MAX_SECONDS = 1e11
_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def _shown(value: Any) -> str:
    """A value from a record, short and printable, for an error message."""
    return cap_text(repr(value), 80)


class CommitLog(abc.ABC):
    """Where the job records its latest committed checkpoint.

    Implementations must make :meth:`commit` atomic (a reader sees the old
    entry or the new one, never a mix) and durable before it returns.
    """

    @abc.abstractmethod
    def commit(self, entry: CommitEntry) -> None:
        """Make ``entry`` the latest committed checkpoint.

        Raises :class:`elastic.errors.FencedError` when the writer's round is
        no longer current (a zombie of an older round); the latest entry is
        then unchanged. Other failures raise an :class:`elastic.errors.ElasticError`
        or ``OSError``; after such a failure the entry may or may not have
        been recorded, and the caller treats the save as failed.
        """

    @abc.abstractmethod
    def latest(self) -> CommitEntry | None:
        """The latest committed entry, or None when nothing was committed yet."""

    def report_failure(self, step: int, round_: int, rank: int, message: str) -> None:
        """Make a failed save of ``step`` visible to the operator; best effort.

        Called by rank 0 once the save's outcome is known on every rank (a
        fenced save is not a failure and is not reported). This default logs
        a warning naming the latest committed checkpoint, which stays in
        place; the agent's log records an event in the job's history instead.
        Must not raise for a failed report: training goes on either way.
        """
        try:
            latest = self.latest()
        except Exception as exc:  # noqa: BLE001 - only the log line's detail depends on it
            latest, why = None, f" (the commit log cannot be read: {exc})"
        else:
            why = ""
        log.warning("%s%s.", failure_message(step, rank, message, latest), why)

    def report_restore(self, step: int, round_: int, rank: int, seconds: float,
                       size_bytes: int) -> None:
        """Tell whoever keeps the log that rank ``rank`` restored the checkpoint of
        ``step`` (``size_bytes``, all ranks' files) in ``seconds``; for metrics.
        Best effort and never raises; this default does nothing."""


def failure_message(step: int, rank: int, message: str, latest: CommitEntry | None) -> str:
    """The one wording of a failed save, in logs and in the job's events: which
    save, who reports it, why (``message``: the save's error, which names the
    rank it happened on), and what stays committed."""
    stays = (f"the latest committed checkpoint stays step {latest.step}" if latest is not None
             else "no checkpoint is committed yet")
    return f"checkpoint of step {step} failed (reported by rank {rank}): {message}; {stays}"
