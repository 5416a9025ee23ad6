"""The checkpoint root as rank 0 changes it: temporaries, moving aside, markers, retention.

Deletion is a rename to ``.trash-*`` first, so a half-deleted directory is
never mistaken for a checkpoint. Every method here runs on rank 0 only, except
:meth:`CheckpointRoot.prepare`, which every rank calls once.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid

from elastic import worker_env
from elastic.checkpoint import layout, timing
from elastic.checkpoint.api import CommitEntry
from elastic.errors import CheckpointWriteError, FencedError
from elastic.failpoints import failpoint

log = logging.getLogger(__name__)


class CheckpointRoot:
    """The directory ``path`` of one Checkpointer, written by round ``round_``:
    new directories get ``mode``, files ``file_mode``; retention keeps ``keep``.

    ``unusable`` holds the directories the last restore skipped as unverifiable
    (the restore replaces it): they are leftovers a save may move aside, never
    fallbacks.
    """

    def __init__(self, path: str, mode: int, file_mode: int, keep: int, round_: int):
        self.path = path
        self.mode = mode
        self.file_mode = file_mode
        self.keep = keep
        self.round = round_
        self.unusable: set[str] = set()

    def prepare(self, rank: int, trusted: bool) -> None:
        """Make the root (with ``mode``) when missing; rank 0 warns about a trusted
        root and about one that others may write. Raises OSError when it cannot
        be made."""
        if not os.path.isdir(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                layout.make_dir(self.path, self.mode)
            except FileExistsError:  # another rank made it first
                pass
        if rank != 0:
            return
        if trusted:
            log.warning("Rank 0 restores checkpoints under %s trusting them: their pickles "
                        "may run code (trust_checkpoint / %s); only for a directory that "
                        "nobody untrusted can write.", self.path, worker_env.CHECKPOINT_TRUST)
        exposure = layout.root_exposure(self.path)
        if exposure is not None:
            log.warning("Rank 0: the checkpoint root %s %s: whoever can write it can "
                        "replace the model's weights (restore runs no code from it, but a "
                        "manifest's CRC-32s can be recomputed); make it the job user's own, "
                        "not writable by others.", self.path, exposure)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    @timing.timed("prepare")
    def make_temporary(self, tmp: str, step: int) -> None:
        """Remove stale temporaries (this job's saves are serialized, so no save in
        flight owns them) and create ``tmp``, this save's directory, afresh.
        Raises OSError."""
        for name in layout.stale_temporaries(os.listdir(self.path), step, self.round):
            log.info("Rank 0 removes %s, left by a crashed or abandoned save, before saving "
                     "step %d in round %d.", name, step, self.round)
            self.remove(self.join(name))
        layout.make_dir(tmp, self.mode)

    def make_way(self, final: str, step: int, latest: CommitEntry | None, tmp: str) -> None:
        """Move aside the directory of this step that is in the way, when it is a
        leftover: a save that crashed after its rename, a fenced one, or one that
        this process's restore found unusable (which it skipped for an older one).

        Raises :class:`FencedError` when a newer round wrote it (this saver is a
        zombie, and the directory may be committed or about to be), and
        :class:`CheckpointWriteError` when it holds a committed checkpoint that
        restore may load (the latest entry's, or a marked one that is not newer
        than the latest). Either way the directory is left untouched.
        """
        name = os.path.basename(final)
        owner = layout.directory_round(final)
        if owner is not None and owner > self.round:
            raise FencedError(
                f"checkpoint step {step} of round {self.round} refused: {final} was written "
                f"by newer round {owner}, so this worker's round is no longer current; "
                f"leaving that directory as it is")
        if name not in self.unusable:
            if latest is not None and latest.path == name:
                raise CheckpointWriteError(f"checkpoint step {step} is already the latest "
                                           f"committed one ({final}); not replacing it", tmp)
            # A marked directory newer than the latest entry is of an abandoned line of
            # saves (the log went back to an older step) and is never restored.
            marked = layout.read_marker(final) is not None
            if marked and (latest is None or step < latest.step):
                raise CheckpointWriteError(f"checkpoint step {step} is already committed "
                                           f"({final}) and restore may load it; not replacing "
                                           f"it", tmp)
        log.warning("Rank 0 moves aside %s (an uncommitted or unusable checkpoint of the same "
                    "step) to commit step %d in round %d.", final, step, self.round)
        # Between the checks above and this rename, only a newer round's save of the
        # very same step could put a directory here; that window is a few system calls.
        self.remove(final)

    def mark(self, final: str, entry: CommitEntry) -> None:
        """Write the ``COMMITTED`` marker of ``entry``, just committed, into ``final``;
        a failure is a warning (the commit log still names it)."""
        try:
            layout.write_marker(final, entry, self.file_mode)
        except OSError as exc:
            log.warning("Rank 0 committed checkpoint step %d in round %d but could not write its "
                        "COMMITTED marker (%s); the commit log still names it.",
                        entry.step, self.round, exc)

    def repair_marker(self, previous: CommitEntry) -> None:
        """After a commit: give the previous latest entry's directory the
        ``COMMITTED`` marker that a crash between its commit and its marker left
        out, so that it stays a committed fallback for restore and retention.
        Never raises OSError (a failure is a warning)."""
        directory = self.join(previous.path)
        if previous.path in self.unusable or not os.path.isdir(directory) \
                or layout.read_marker(directory) is not None:
            return
        try:
            layout.write_marker(directory, previous, self.file_mode)
        except OSError as exc:
            log.warning("Rank 0 could not write the missing COMMITTED marker of %s (%s) in "
                        "round %d; it is no longer a fallback for restore.", directory, exc,
                        self.round)
            return
        log.info("Rank 0 wrote the missing COMMITTED marker of %s (step %d, committed in round "
                 "%d) in round %d.", directory, previous.step, previous.round, self.round)

    def retain(self, latest: CommitEntry) -> None:
        """Delete what retention no longer keeps after committing ``latest`` (see
        :func:`layout.retention_victims`); a failed deletion is retried after the
        next commit."""
        victims = layout.retention_victims(layout.list_checkpoints(self.path), self.keep, latest,
                                           unusable=self.unusable)
        for name in victims:
            log.info("Rank 0 removes checkpoint %s (keeping the last %d committed) after "
                     "committing step %d in round %d.", name, self.keep, latest.step, self.round)
            try:
                self.remove(self.join(name), between="ckpt.mid_prune")
            except OSError as exc:
                log.warning("Rank 0 could not remove old checkpoint %s (%s); it will be retried "
                            "after the next commit.", name, exc)

    def discard(self, tmp: str) -> None:
        """Remove a failed save's directory if it is there; a failure is a warning
        (the next save removes it)."""
        if not os.path.lexists(tmp):
            return
        try:
            self.remove(tmp)
        except OSError as exc:
            log.warning("Rank 0 could not remove the failed save's directory %s (%s); the next "
                        "save removes it.", tmp, exc)

    def remove(self, path: str, between: str | None = None) -> None:
        """Take a directory out of view atomically (rename to ``.trash-*``), then delete
        it; a crash in between leaves only trash, which the next save removes.
        ``between`` names a failpoint to run in between. Raises OSError when the
        rename fails."""
        trash = self.join(f"{layout.TRASH_PREFIX}{os.path.basename(path)}-"
                          f"{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        if between is not None:
            failpoint(between)
        shutil.rmtree(trash, ignore_errors=True)
