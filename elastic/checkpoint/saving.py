"""The save's collective sequence: stage, write, verify, commit (the protocol of
:mod:`elastic.checkpoint`, steps 1 to 4).

Every rank runs the same collectives in the same order, whatever fails
locally: a local failure travels as a value in the next collective
(:mod:`elastic.checkpoint.failures`), so every rank ends a save with the same
outcome, raised from :meth:`SavePipeline.persist` on every rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch.distributed.checkpoint as dcp

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import layout, timing
from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.checkpoint.dcp_io import ChecksummingWriter
from elastic.checkpoint.environment import SavingNotice
from elastic.checkpoint.failures import capture
from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.root import CheckpointRoot
from elastic.checkpoint.snapshot import Snapshot, SnapshotTaker
from elastic.errors import CheckpointError, CheckpointWriteError, ElasticError, FencedError
from elastic.failpoints import failpoint

log = logging.getLogger(__name__)


class RecordingWriter(ChecksummingWriter):
    """DCP's file writer computing CRC-32s as it writes (for this rank's manifest),
    hosting the write-path failpoints."""

    def write_data(self, plan, planner):
        failpoint("ckpt.write")
        future = super().write_data(plan, planner)
        if future.value():
            failpoint("ckpt.mid_write")
        return future


class SavePipeline:
    """Writes, verifies and commits snapshots under ``root`` over ``group``,
    committing to ``commit_log``."""

    def __init__(self, root: CheckpointRoot, group: CheckpointGroup, commit_log: CommitLog,
                 snapshots: SnapshotTaker, notice: SavingNotice):
        self._root = root
        self._group = group
        self._commit_log = commit_log
        self._snapshots = snapshots
        self._notice = notice

    @timing.timed("persist")
    def persist(self, snapshot: Snapshot) -> None:
        """Every rank: finish the snapshot's copy, write, verify and commit it; the
        saving hook hears 0 at the end, whatever the outcome.

        Raises, on every rank alike: :class:`CheckpointWriteError` when the write
        or its verification fails (the temporary directory is removed),
        :class:`FencedError` when the commit is fenced off, and
        :class:`CheckpointError` for other failures (rank 0 reports those to the
        commit log).
        """
        step, rank, group = snapshot.step, self._group.rank, self._group
        tmp = self._root.join(layout.tmp_dir_name(step, self._root.round))
        started = time.monotonic()
        try:
            failure = capture(rank, lambda: self._snapshots.complete(snapshot))
            failures = [f for f in group.all_gather(failure, "staging") if f]
            if failures:
                raise CheckpointError(f"checkpoint step {step} was not saved: rank "
                                      f"{failures[0].rank}: {failures[0].message}")
            failpoint("ckpt.before_shards")
            failure = capture(rank, lambda: self._root.make_temporary(tmp, step)) \
                if rank == 0 else None
            failure = group.broadcast(failure, "preparing the save")
            if failure is not None:
                raise failure.error(step, tmp)
            failure = capture(rank, lambda: self._write(snapshot, tmp))
            gathered = group.all_gather(failure, "collecting write results")
            failures = list(dict.fromkeys(f for f in gathered if f))  # one DCP failure shows on all
            if failures:
                self._discard(tmp)
                raise failures[0].error(step, tmp, more=len(failures) - 1)
            failpoint("ckpt.after_shards_before_commit")
            self._verify(tmp, step)
            failure = capture(rank, lambda: self._commit(snapshot, tmp)) if rank == 0 else None
            failure = group.broadcast(failure, "committing")
            if failure is not None:
                self._discard(tmp)  # still there when the rename was not reached
                raise failure.error(step, tmp)
            log.log(group.news_level, "Rank %d saved checkpoint step %d in round %d (%d bytes "
                    "of its own) in %.2f s.", rank, step, self._root.round, snapshot.nbytes,
                    time.monotonic() - started)
        except BaseException as exc:
            log.error("Rank %d failed to save checkpoint step %d in round %d: %s", rank, step,
                      self._root.round, exc)
            self._report_failure(step, exc)
            raise
        finally:
            self._notice.ended()

    def _verify(self, tmp: str, step: int) -> None:
        """Every rank checks its share; raises CheckpointWriteError on every rank when
        any share fails. No file is read back: a read right after the write comes
        from the page cache, so it shows what was written, which the CRC-32s
        already are (taken from the very bytes DCP wrote). What is checked across
        ranks: every manifest, every file's presence and size, items that agree
        with files."""
        problems, _ = layout.verify_structure(tmp, part=self._group.rank,
                                              parts=self._group.size)
        problems = [p for ps in self._group.all_gather(problems, "verifying") for p in ps]
        if problems:
            self._discard(tmp)
            raise CheckpointWriteError(
                f"checkpoint step {step} written to {tmp} failed verification: "
                f"{'; '.join(map(str, problems[:5]))}", tmp)

    def _discard(self, tmp: str) -> None:
        if self._group.rank == 0:
            self._root.discard(tmp)

    @timing.timed("write")
    def _write(self, snapshot: Snapshot, tmp: str) -> None:
        """Every rank: DCP shards, then this rank's state file and manifest, all fsynced."""
        writer = RecordingWriter(tmp, self._root.mode)
        with timing.phase("dcp_save"):
            dcp.save(snapshot.state_dict, storage_writer=writer, process_group=self._group.pg,
                     **compat.single_process(self._group.pg is None))
        rank = self._group.rank
        local_name = layout.rank_state_name(rank)
        layout.write_durably(os.path.join(tmp, local_name), snapshot.local, self._root.file_mode)
        # Digests of the bytes as written (DCP's shards and, on rank 0, .metadata,
        # item by item), not of a read back: see dcp_io.
        files = writer.digests()
        files[local_name] = layout.bytes_digest(snapshot.local)
        layout.write_manifest(tmp, layout.Manifest(
            rank=rank, world_size=self._group.size, step=snapshot.step, round=self._root.round,
            files=files), self._root.file_mode)
        layout.fsync_dir(tmp)

    @timing.timed("commit")
    def _commit(self, snapshot: Snapshot, tmp: str) -> None:
        """Rank 0: rename into place, record in the commit log, mark, prune.

        Raises :class:`FencedError` when the commit log refuses this round, or
        when a directory of this step written by a newer round is in the way
        (this saver is then a zombie: that directory is left as it is).
        """
        name = layout.step_dir_name(snapshot.step)
        final = self._root.join(name)
        previous = self._latest_before_commit(final, snapshot.step)
        manifests, _ = layout.read_manifests(tmp)  # verified: every rank's files are there
        if os.path.lexists(final):
            self._root.make_way(final, snapshot.step, previous, tmp)
        os.rename(tmp, final)
        layout.fsync_dir(self._root.path)
        failpoint("ckpt.after_rename_before_commit_log")
        entry = CommitEntry(step=snapshot.step, round=self._root.round,
                            world_size=self._group.size, path=name, time=time.time(),
                            save_s=time.monotonic() - snapshot.started_at,
                            size_bytes=layout.manifest_bytes(manifests))
        try:
            self._commit_log.commit(entry)
        except FencedError:
            # Leave the directory as it is, unmarked: after losing the fence, removing a
            # path could remove what the current round has put there in the meantime.
            log.error("Rank 0: the commit of checkpoint step %d in round %d was fenced off; %s "
                      "stays without a COMMITTED marker and is never restored.",
                      snapshot.step, self._root.round, final)
            raise
        failpoint("ckpt.after_commit_log_before_marker")
        self._root.mark(final, entry)
        if previous is not None and previous.path != name:
            self._root.repair_marker(previous)
        self._root.retain(entry)

    def _latest_before_commit(self, final: str, step: int) -> CommitEntry | None:
        """Rank 0, before its commit: the commit log's latest entry, or None when
        it cannot be read (garbage in ``checkpoint/latest``) and no directory of
        this step is in the way. The fenced commit replaces the unreadable
        record, so it does not fail every save until someone mends it. With a
        directory in the way the error stands: whether it may be moved aside
        depends on that entry (see :meth:`CheckpointRoot.make_way`). A log that
        cannot be reached at all fails the commit that follows instead."""
        try:
            return self._commit_log.latest()
        except ElasticError as exc:
            if os.path.lexists(final):
                raise
            log.warning("Rank 0: the latest entry of the commit log cannot be read (%s); the "
                        "commit of checkpoint step %d in round %d replaces it.",
                        exc, step, self._root.round)
            return None

    def _report_failure(self, step: int, exc: BaseException) -> None:
        """Rank 0 tells the commit log that the save of ``step`` failed, so that the
        operator sees it (the agent records an event). Every rank has the same
        outcome, so one report is enough; a fenced save is no failure to report
        (it is a zombie's). A failed report never changes the save's outcome, nor
        delays it: the report goes from a thread of its own, so that the other
        ranks never wait for rank 0 on a commit log that is down."""
        if self._group.rank != 0 or not isinstance(exc, CheckpointError):
            return
        round_ = self._root.round

        def report() -> None:
            try:
                self._commit_log.report_failure(step, round_, 0, str(exc))
            except Exception as report_exc:  # noqa: BLE001 - best effort, see above
                log.warning("Rank 0 could not report the failed save of checkpoint step %d in "
                            "round %d: %s", step, round_, report_exc)

        threading.Thread(target=report, name="elastic-ckpt-report", daemon=True).start()
