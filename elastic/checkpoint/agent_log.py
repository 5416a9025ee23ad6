"""The commit log kept by the node agent: ``checkpoint/latest`` in etcd,
advanced by a transaction fenced by the job's round (see :mod:`agent.daemon`).

A worker of an older round (a zombie that outlived its group) is refused with
:class:`FencedError`, so it can never make its checkpoint the latest.
"""

from __future__ import annotations

import logging

from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.checkpoint.commit import FileCommitLog
from elastic.errors import AgentUnreachableError, FencedError
from elastic.worker.channel import WorkerChannelClient
from elastic.worker_env import WorkerEnv

log = logging.getLogger(__name__)


class AgentCommitLog(CommitLog):
    """The job's commit log, through the local agent's Unix socket."""

    def __init__(self, socket_path: str):
        self._client = WorkerChannelClient(socket_path)

    def commit(self, entry: CommitEntry) -> None:
        """Raises FencedError when the agent refuses (the round moved on) and
        AgentUnreachableError when it cannot be asked."""
        committed, why = self._client.commit_checkpoint(**entry.to_dict())
        if not committed:
            raise FencedError(f"checkpoint commit of step {entry.step} in round {entry.round} "
                              f"refused: {why}")

    def latest(self) -> CommitEntry | None:
        record = self._client.latest_checkpoint()
        return CommitEntry.from_dict(record) if record is not None else None

    def report_failure(self, step: int, round_: int, rank: int, message: str) -> None:
        """Ask the agent to record the failed save in the job's events (it names
        the checkpoint that stays). Best effort: when the agent cannot be asked
        within a short timeout, a warning is logged instead; never raises."""
        try:
            self._client.report_checkpoint_failure(step=step, round=round_, rank=rank,
                                                   message=message)
        except AgentUnreachableError as exc:
            log.warning("Rank %d: checkpoint of step %d failed in round %d (%s), and %s.",
                        rank, step, round_, message, exc)


    def report_restore(self, step: int, round_: int, rank: int, seconds: float,
                       size_bytes: int) -> None:
        """Tell the agent, for its metrics; a failure is logged at debug level
        (nothing but a metric is lost). Never raises."""
        try:
            self._client.report_restore(step=step, round=round_, rank=rank, restore_s=seconds,
                                        size_bytes=size_bytes)
        except AgentUnreachableError as exc:
            log.debug("Rank %d: the restore of checkpoint step %d in round %d was not "
                      "reported: %s.", rank, step, round_, exc)


def default_commit_log(root: str, file_mode: int = 0o600) -> CommitLog:
    """The agent's fenced log under elasticd, a file beside the checkpoints otherwise
    (torchrun, or no launcher), of mode ``file_mode``."""
    socket_path = WorkerEnv().agent_socket
    return AgentCommitLog(socket_path) if socket_path else FileCommitLog(root, file_mode)
