"""The commit log kept by the node agent: ``checkpoint/latest`` in etcd,
advanced by a transaction fenced by the job's round (see :mod:`agent.daemon`).

A worker of an older round (a zombie that outlived its group) is refused with
:class:`FencedError`, so it can never make its checkpoint the latest.
"""

from __future__ import annotations

import os

from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.checkpoint.commit import FileCommitLog
from elastic.errors import FencedError
from elastic.worker.channel import WorkerChannelClient

AGENT_SOCKET_ENV = "ELASTIC_AGENT_SOCKET"


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


def default_commit_log(root: str) -> CommitLog:
    """The agent's fenced log under elasticd, a file beside the checkpoints otherwise
    (torchrun, or no launcher)."""
    socket_path = os.environ.get(AGENT_SOCKET_ENV)
    return AgentCommitLog(socket_path) if socket_path else FileCommitLog(root)
