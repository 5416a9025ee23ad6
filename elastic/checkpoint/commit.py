"""FileCommitLog: the commit log as a file beside the checkpoints (torchrun, or no agent).

``<root>/latest`` holds the latest :class:`CommitEntry` as json (a file of
mode ``file_mode``, 0o600 by default); a commit
replaces it atomically (tmp file, fsync, rename, fsync of the root), so a
crash leaves the old entry or the new one.

Fencing is best-effort here: an entry whose round is older than the recorded
latest's round is refused with :class:`FencedError`, but the check and the
rename are not one atomic step. Under torchrun there are no zombies (every
worker is killed before a restart, and the round stays 0); under the agent,
the etcd-backed log is the real fence.
"""

from __future__ import annotations

import json
import logging
import os

from elastic.checkpoint import layout
from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.errors import CheckpointError, FencedError

log = logging.getLogger(__name__)

LATEST_FILE = "latest"
_MAX_RECORD_BYTES = 1 << 16  # a commit record is ~200 bytes


class FileCommitLog(CommitLog):
    """The latest committed checkpoint recorded in ``<root>/latest``."""

    def __init__(self, root: str, file_mode: int = layout.FILE_MODE):
        self.root = root
        self.path = os.path.join(root, LATEST_FILE)
        self.file_mode = file_mode

    def latest(self) -> CommitEntry | None:
        """The recorded entry; None when there is none.

        An unreadable record (edited or damaged by hand: a commit itself never
        leaves a torn file) is logged as a warning and reads as None, so
        restore falls back to the checkpoints' markers instead of failing.
        """
        try:
            with open(self.path, "rb") as f:
                data = f.read(_MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        try:
            if len(data) > _MAX_RECORD_BYTES:
                raise CheckpointError(f"larger than {_MAX_RECORD_BYTES} bytes")
            return CommitEntry.from_dict(json.loads(data))
        # RecursionError: JSON nested thousands deep (json recurses per level).
        except (ValueError, RecursionError, CheckpointError) as exc:
            log.warning("The commit log %s is unreadable (%s); treating it as empty, so restore "
                        "falls back to checkpoints that carry a COMMITTED marker.", self.path, exc)
            return None

    def commit(self, entry: CommitEntry) -> None:
        """Record ``entry`` as the latest, durably and atomically.

        Raises :class:`FencedError` when the recorded latest is of a newer
        round than ``entry``, and ``OSError`` when the file cannot be written
        (the old record then stays).
        """
        current = self.latest()
        if current is not None and entry.round < current.round:
            raise FencedError(
                f"checkpoint commit of step {entry.step} in round {entry.round} refused: "
                f"{self.path} already records step {current.step} of newer round {current.round}")
        layout.write_atomically(self.path, json.dumps(entry.to_dict()).encode(),
                                self.file_mode)
