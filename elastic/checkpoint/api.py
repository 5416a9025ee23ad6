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
from typing import Any

from elastic.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class CommitEntry:
    """One committed checkpoint.

    ``path`` is the checkpoint's directory name relative to the checkpoint root
    (``step-000000000100``), so nodes that mount the root at different places
    agree on it. ``time`` is seconds since the epoch when rank 0 committed it.
    """

    step: int
    round: int
    world_size: int
    path: str
    time: float

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
                        time=float(record["time"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed commit record {record!r}: {exc!r}") from exc
        ints_ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                      for v in (entry.step, entry.round, entry.world_size))
        if not ints_ok or not isinstance(entry.path, str) or not entry.path \
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
