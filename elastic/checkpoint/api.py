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
from typing import Any

from elastic.errors import CheckpointError

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
            raise CheckpointError(f"commit record is not an object: {record!r}")
        try:
            entry = cls(step=record["step"], round=record["round"],
                        world_size=record["world_size"], path=record["path"],
                        time=float(record["time"]), save_s=float(record.get("save_s", 0.0)),
                        size_bytes=record.get("size_bytes", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed commit record {record!r}: {exc!r}") from exc
        ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                      for v in (entry.step, entry.round, entry.world_size, entry.size_bytes))
        if not ints_ok or not math.isfinite(entry.save_s) or entry.save_s < 0 \
                or not isinstance(entry.path, str) or not entry.path \
                or "/" in entry.path or entry.path.startswith("."):
            raise CheckpointError(f"malformed commit record {record!r}")
        return entry


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
