"""Checkpointer: sharded, verified, fenced, optionally asynchronous saves, and restore.

The commit protocol and the restore rule are written down once, in the
docstring of :mod:`elastic.checkpoint`; this module implements them.

Every rank runs the same sequence of checkpoint-group collectives in the same
order, whatever fails locally: a local failure travels as a value in the next
collective (never as a skipped call), so ranks cannot fall out of step, and
every rank ends a save or a restore with the same outcome.

Why ``dcp.save`` in a thread of our own instead of ``dcp.async_save``: the
verification and the commit must follow the write in the same background
task, with collectives of their own, and a failure anywhere must surface
once, from :meth:`Checkpointer.wait` or the next :meth:`Checkpointer.save`.
Staging is our own (:mod:`elastic.checkpoint.staging`: buffers kept between
saves, public torch API only), in that same background thread: ``save()``
copies only what forward and backward may change (buffers, non-tensor values)
and returns; parameters and optimizer state are copied in the background,
after everything the training stream had queued when ``save()`` was called,
and a step pre-hook on every optimizer
makes ``optimizer.step()`` wait for that copy. Each such tensor's ``_version``
(in-place modification counter) is recorded at ``save()`` and checked after
the copy, so an in-place change by anything else fails the save instead of
committing a torn copy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import errno as errno_module
import importlib.util
import logging
import os
import pickle
import shutil
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import layout, state, trust
from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.checkpoint.agent_log import default_commit_log
from elastic.checkpoint.dcp_io import ChecksummingWriter, LoadPlanner, VerifyingReader
from elastic.checkpoint.staging import CudaOps, Stager
from elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    ElasticError,
    FencedError,
)
from elastic.failpoints import failpoint

log = logging.getLogger(__name__)

ENV_CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"
ENV_CHECKPOINT_MODE = "ELASTIC_CHECKPOINT_MODE"
# A save's duration announced to the agent: a fixed allowance for collectives,
# fsync and commit plus the shard at a pessimistic per-rank write rate.
_SAVE_FIXED_S = 60.0
_SAVE_BYTES_PER_S = 100 * 2**20


def _mode_from_env() -> int:
    """``$ELASTIC_CHECKPOINT_MODE`` (octal, e.g. 750) or the private default.
    Raises ConfigError for a value that is not octal digits."""
    raw = os.environ.get(ENV_CHECKPOINT_MODE, "").strip()
    if not raw:
        return layout.DIR_MODE
    try:
        return int(raw.removeprefix("0o"), 8)
    except ValueError:
        raise ConfigError(f"{ENV_CHECKPOINT_MODE}={raw[:20]!r}: expected an octal mode such "
                          f"as 700 or 750") from None


def _default_on_saving() -> Callable[[float], None]:
    try:
        from elastic.worker import runtime
    except ImportError:
        return lambda seconds: None
    return runtime.saving


class Checkpointer:
    """Saves and restores a training job's state under one checkpoint root.

    Construct it on every rank, after the process group is initialized and in
    the same order relative to other ``new_group`` calls: it creates a gloo
    group of its own (over the ranks of ``process_group`` when given, else of
    the world) so checkpoint collectives never interleave with training
    collectives. Without an
    initialized process group it runs as a single rank.

    ``model`` is a module or a list of chunks (pipeline stages); ``optimizer``
    an optimizer or, for several chunks, one per chunk; ``scheduler`` a
    scheduler or a list. ``root`` defaults to ``$ELASTIC_CHECKPOINT_DIR``;
    ``commit_log`` to the agent's fenced log under elasticd, else a
    :class:`~elastic.checkpoint.commit.FileCommitLog` in the root; rank 0 also
    reports each failed save to it (under the agent, an event in the job's
    history; otherwise a warning), best effort. ``on_saving(s)``
    is called with an estimate in seconds when a save starts and with 0 when
    it ends (default: ``elastic.worker.runtime.saving``, which suspends the
    agent's hang detection). ``verify_checksums`` makes restore compare the
    CRC-32s of what it reads, not only sizes (saves always record CRC-32s,
    computed as they write). ``timeout_s`` bounds each collective of
    the group this object creates. ``root`` must be one file system shared by
    all ranks (every rank verifies files that others wrote, and resharding
    reads any rank's shards).

    The contract of an async save: between ``save()`` and the next
    ``optimizer.step()`` the model's parameters (and the optimizer's state)
    must not be modified in place except by the optimizer, e.g. no EMA or
    clipping of the weights themselves in between: their copy to CPU runs in
    the background until that step (which waits for it, through a step
    pre-hook this object registers on each of its optimizers). A violation is
    detected through the tensors' in-place counters (``_version``; changes
    through ``.data`` escape it) and fails that save with
    :class:`CheckpointError`; the previous checkpoint stays the latest.
    Buffers (e.g. BatchNorm statistics) are copied before ``save()`` returns.

    ``device`` is the CUDA device this rank trains on (default: the one the
    model's parameters are on; None without CUDA): the checkpoint thread
    works on it, never on device 0 by default. ``cuda_ops`` replaces the CUDA
    calls of the staging copy (tests inject a recording fake).

    Restore never runs code from a checkpoint (:mod:`elastic.checkpoint.trust`):
    its pickles are read through allow-lists, and one that needs a type outside
    them fails the restore with :class:`CheckpointError` naming it.
    ``safe_globals`` adds classes (e.g. the type of ``extras``) to the
    allow-lists; ``trust_checkpoint=True`` reads them as
    ``torch.load(weights_only=False)`` would (default: ``$ELASTIC_CHECKPOINT_TRUST``,
    else False), only for a checkpoint directory nobody untrusted can write.
    ``mode`` is the mode of every directory a save creates, its files getting
    the same without execute bits (default: ``$ELASTIC_CHECKPOINT_MODE``,
    octal, else 0o700: files 0o600), set whatever the umask; e.g. 0o750 lets
    the group read the checkpoints. The root, when this creates it, gets it too.

    Raises :class:`ConfigError` for a missing root or bad arguments, and
    :class:`CheckpointError` when torch's object collectives cannot work
    (they need numpy). Not thread-safe: call it from the training thread.
    """

    def __init__(self, root: str | None = None, *, model: nn.Module | Sequence[nn.Module],
                 optimizer: Any = None, scheduler: Any = None, keep: int = 3,
                 commit_log: CommitLog | None = None, process_group: Any = None,
                 on_saving: Callable[[float], None] | None = None,
                 verify_checksums: bool = True, timeout_s: float = 1800.0,
                 device: torch.device | int | None = None, cuda_ops: CudaOps | None = None,
                 trust_checkpoint: bool | None = None, safe_globals: Sequence[Any] = (),
                 mode: int | None = None):
        root = root or os.environ.get(ENV_CHECKPOINT_DIR)
        if not root:
            raise ConfigError(f"no checkpoint directory: pass root= or set {ENV_CHECKPOINT_DIR}")
        if keep < 1:
            raise ConfigError(f"keep must be at least 1, got {keep}")
        try:
            self._chunks = state.make_chunks(model, optimizer)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad checkpoint arguments: {exc}") from exc
        if scheduler is None:
            self._schedulers: list[Any] = []
        else:
            self._schedulers = (list(scheduler) if isinstance(scheduler, (list, tuple))
                                else [scheduler])
        self.root = os.path.abspath(root)
        self.keep = keep
        self.verify_checksums = verify_checksums
        # The environment is read here, and only where the argument is not given.
        self.policy = trust.LoadPolicy(
            trusted=trust.trust_from_env() if trust_checkpoint is None else trust_checkpoint,
            safe_globals=safe_globals)
        self.mode = layout.check_mode(_mode_from_env() if mode is None else mode)
        self._file_mode = layout.file_mode(self.mode)
        self._commit_log = (commit_log if commit_log is not None
                            else default_commit_log(self.root, self._file_mode))
        self._on_saving = on_saving if on_saving is not None else _default_on_saving()
        try:
            # The agent's round names temporaries and is the fencing token of commits.
            self._round = int(os.environ.get("ELASTIC_ROUND", "0") or 0)
        except ValueError as exc:
            raise ConfigError(f"ELASTIC_ROUND must be an integer: {exc}") from exc
        self._group = _Group.create(process_group, timeout_s)
        self.device = _cuda_index(device) if device is not None else _training_device(
            self._chunks)
        self._stager = Stager(self.device, cuda_ops)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="elastic-checkpoint",
            initializer=self._stager.bind)
        self._inflight: concurrent.futures.Future | None = None
        self._staging: threading.Event | None = None  # set once the async copy is done
        self._hooks = [opt.register_step_pre_hook(self._before_step)
                       for opt in dict.fromkeys(o for c in self._chunks for o in c.optimizers)]
        self._unusable: set[str] = set()  # directories the last restore skipped as unverifiable
        self._closed = False
        self.data_state: Any = None
        self.extras: Any = None
        self.restored_path: str | None = None
        self._restored_bytes = 0  # the size of the checkpoint restored last
        self._prepare_root()

    # --- public API ---------------------------------------------------------------------------

    def save(self, step: int, *, data_state: Any = None, extras: Any = None,
             async_: bool = True) -> None:
        """Checkpoint the state as of ``step`` (the step just completed); every rank calls it.

        First waits for the previous save and re-raises its failure (this
        save is then not started). With ``async_``, copies this rank's shard
        to CPU memory in the background (the next ``optimizer.step()`` waits
        for the copy; see the class docstring for the contract) and writes,
        verifies and commits it in the background; otherwise writes from the
        live tensors and returns when it is committed. ``data_state`` (e.g. a
        sampler's state_dict) and ``extras`` are small picklable objects
        restored per rank.

        Raises :class:`CheckpointWriteError` when the write or its
        verification fails (the temporary directory is removed; the previous
        checkpoint stays the latest; training can go on and save again) or
        when ``step`` is already the latest committed checkpoint,
        :class:`elastic.errors.FencedError` when the commit log refuses this
        round, and :class:`CheckpointError` for other failures, e.g. when a
        parameter was modified in place (not by the optimizer) during the
        background copy.
        """
        self._check_open()
        self.wait()
        staged = self._stage(int(step), data_state, extras, copy=async_)
        if async_:
            self._staging = staged.ready
            self._inflight = self._executor.submit(self._persist, staged)
        else:
            self._persist(staged)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the save in flight (if any) finished; re-raise its failure once.

        Raises :class:`CheckpointError` when it is still running after
        ``timeout_s`` (it stays in flight), or the save's own error.
        """
        future = self._inflight
        if future is None:
            return
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise CheckpointError(f"rank {self._group.rank}: the checkpoint save in flight "
                                  f"did not finish within {timeout_s} s") from None
        finally:
            if future.done():
                self._inflight = None

    def restore(self) -> int:
        """Load the latest committed checkpoint that verifies; every rank calls it.

        Returns the step to resume from: the saved step + 1, or 0 when there
        is no committed checkpoint (a fresh start). Sets :attr:`data_state`,
        :attr:`extras` and :attr:`restored_path`. Candidates that fail
        verification are logged (naming the file) and skipped for the
        previous committed one. At the saved world size every rank gets its
        own RNG states, data position and extras back; at another one, see
        :mod:`elastic.checkpoint.state` for what each rank gets.

        CRC-32s are checked as the load reads (item by item), so a
        candidate's state is put into the model and optimizer before it is
        known to verify; a candidate that fails is then overwritten by the
        next one.
        The model's and optimizer's state is only valid once ``restore()``
        returns (after an error it is undefined).

        Raises :class:`CheckpointCorruptError` when committed checkpoints
        exist but none verifies (starting from scratch is not silently done),
        and :class:`CheckpointError` when loading a verified one fails (e.g.
        the model's parameters do not match the checkpoint's).
        """
        self._check_open()
        self.wait()
        started = time.monotonic()
        candidates = self._choose()
        for index, name in enumerate(candidates):
            fallback = (f"falling back to {candidates[index + 1]}" if index + 1 < len(candidates)
                        else "no older committed checkpoint is left")
            step = self._load(name, fallback)
            if step is None:
                self._unusable.add(name)
                continue
            seconds = time.monotonic() - started
            log.log(self._level, "Rank %d restored checkpoint step %d from %s in round %d in "
                    "%.2f s; resuming at step %d.", self._group.rank, step, name, self._round,
                    seconds, step + 1)
            self._report_restore(step, seconds)
            return step + 1
        self.data_state = self.extras = self.restored_path = None
        if candidates:
            raise CheckpointCorruptError(
                f"rank {self._group.rank}: none of the committed checkpoints under "
                f"{self.root} verifies ({', '.join(candidates)}); see the warnings above "
                f"for the files at fault")
        log.log(self._level, "Rank %d found no committed checkpoint under %s in round %d; "
                "starting from step 0.", self._group.rank, self.root, self._round)
        return 0

    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure) and release the
        background thread and the staging memory. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            for hook in self._hooks:
                hook.remove()
            self._executor.shutdown(wait=True)
            self._stager.close()

    def _prepare_root(self) -> None:
        """Make the root (private, or the group's with ``mode``) when missing; rank 0
        warns about a trusted root and about one that others may write."""
        if not os.path.isdir(self.root):
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            try:
                layout.make_dir(self.root, self.mode)
            except FileExistsError:  # another rank made it first
                pass
        if self._group.rank == 0:
            if self.policy.trusted:
                log.warning("Rank 0 restores checkpoints under %s trusting them: their pickles "
                            "may run code (trust_checkpoint / %s); only for a directory that "
                            "nobody untrusted can write.", self.root, trust.ENV_CHECKPOINT_TRUST)
            exposure = layout.root_exposure(self.root)
            if exposure is not None:
                log.warning("Rank 0: the checkpoint root %s %s: whoever can write it can "
                            "replace the model's weights (restore runs no code from it, but a "
                            "manifest's CRC-32s can be recomputed); make it the job user's own, "
                            "not writable by others.", self.root, exposure)

    # --- save, in the caller's thread ---------------------------------------------------------

    def _stage(self, step: int, data_state: Any, extras: Any, copy: bool) -> "_Staged":
        """Take the state to save. ``copy`` (async): copy now to CPU what forward and
        backward may change (buffers, non-tensors), and leave parameters and optimizer
        state, with their in-place counters, for :meth:`_finish_staging` in the
        background, ordered after what the caller's CUDA stream has queued so far (the
        stager keeps its buffers for the next save, so this is one copy of the shard,
        allocated once). Otherwise the live tensors, which stay still because the
        caller blocks until the save is done."""
        tensors = state.collect(self._chunks)
        nbytes = state.local_nbytes(tensors.state_dict)
        self._announce(_SAVE_FIXED_S + nbytes / _SAVE_BYTES_PER_S)
        try:
            started = time.monotonic()
            local = state.capture_local(step=step, rank=self._group.rank,
                                        world_size=self._group.size, schedulers=self._schedulers,
                                        data_state=data_state, extras=extras)
            staged = _Staged(step=step, state_dict=tensors.state_dict, local=local,
                             nbytes=nbytes, started_at=started)
            if copy:
                later, now = _split(tensors.state_dict, self._parameter_pointers())
                queued = self._stager.mark()
                staged.pending = _Pending(
                    later=later, queued=queued,
                    now=self._stager.stage(now, after=queued, prefix=("now",)),
                    order={group: list(values) if isinstance(values, dict) else None
                           for group, values in tensors.state_dict.items()},
                    versions=[(f"{group}.{key}", tensor, tensor._version)
                              for group, values in later.items()
                              for key, tensor in values.items()])
                staged.state_dict = {}
            else:
                staged.ready.set()
        except BaseException:
            self._announce(0.0)
            raise
        log.debug("Rank %d took %d bytes for checkpoint step %d of round %d in %.3f s.",
                  self._group.rank, nbytes, step, self._round, time.monotonic() - started)
        return staged

    def _parameter_pointers(self) -> set[int]:
        return {_local(p).data_ptr() for chunk in self._chunks
                for p in chunk.model.parameters()}

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: the step changes what the background copy reads; wait for it."""
        ready = self._staging
        if ready is not None:
            ready.wait()
            self._staging = None

    def _finish_staging(self, staged: "_Staged") -> None:
        """Background, first thing of an async save: copy the parameters and the
        optimizer state, then check that nothing but the copy touched them."""
        try:
            pending = staged.pending
            if pending is None:
                return
            staged.pending = None  # no reference to live tensors beyond this call
            failpoint("ckpt.stage")
            copied = self._stager.stage(pending.later, after=pending.queued, prefix=("later",))
            changed = [name for name, tensor, version in pending.versions
                       if tensor._version != version]
            if changed:
                raise CheckpointError(
                    f"{len(changed)} tensor(s) of the state (e.g. "
                    f"{', '.join(changed[:3])}) were modified in place after save() and "
                    f"before their copy to CPU ended, so the copy may be torn and is not "
                    f"written: between save() and the next optimizer.step() the model's "
                    f"parameters and the optimizer's state must not be modified in place "
                    f"except by the optimizer (e.g. an EMA or clipping of the weights "
                    f"themselves belongs after the step)")
            merged: dict[str, Any] = {}
            for group, keys in pending.order.items():
                if keys is None:
                    merged[group] = pending.now[group]
                    continue
                done, early = copied.get(group, {}), pending.now.get(group, {})
                merged[group] = {key: done[key] if key in done else early[key] for key in keys}
            staged.state_dict = merged
        finally:
            staged.ready.set()

    # --- save, in the background (or the caller's thread when synchronous) --------------------

    def _persist(self, staged: "_Staged") -> None:
        step, rank = staged.step, self._group.rank
        tmp = os.path.join(self.root, layout.tmp_dir_name(step, self._round))
        started = time.monotonic()
        try:
            failure = self._capture(lambda: self._finish_staging(staged))
            failures = [f for f in self._group.all_gather(failure, "staging") if f]
            if failures:
                raise CheckpointError(f"checkpoint step {step} was not saved: rank "
                                      f"{failures[0].rank}: {failures[0].message}")
            failpoint("ckpt.before_shards")
            failure = self._capture(lambda: self._prepare(tmp, step)) if rank == 0 else None
            failure = self._group.broadcast(failure, "preparing the save")
            if failure is not None:
                raise failure.error(step, tmp)
            failure = self._capture(lambda: self._write(staged, tmp))
            gathered = self._group.all_gather(failure, "collecting write results")
            failures = list(dict.fromkeys(f for f in gathered if f))  # one DCP failure shows on all
            if failures:
                self._discard_on_rank0(tmp)
                raise failures[0].error(step, tmp, more=len(failures) - 1)
            failpoint("ckpt.after_shards_before_commit")
            # No file is read back: a read right after the write comes from the page
            # cache, so it shows what was written, which the CRC-32s already are (taken
            # from the very bytes DCP wrote). What is checked across ranks: every
            # manifest, every file's presence and size, items that agree with files.
            problems, _ = layout.verify_structure(tmp, part=rank, parts=self._group.size)
            problems = [p for ps in self._group.all_gather(problems, "verifying") for p in ps]
            if problems:
                self._discard_on_rank0(tmp)
                raise CheckpointWriteError(
                    f"checkpoint step {step} written to {tmp} failed verification: "
                    f"{'; '.join(map(str, problems[:5]))}", tmp)
            failure = self._capture(lambda: self._commit(staged, tmp)) if rank == 0 else None
            failure = self._group.broadcast(failure, "committing")
            if failure is not None:
                self._discard_on_rank0(tmp)  # still there when the rename was not reached
                raise failure.error(step, tmp)
            log.log(self._level, "Rank %d saved checkpoint step %d in round %d (%d bytes of its "
                    "own) in %.2f s.", rank, step, self._round, staged.nbytes,
                    time.monotonic() - started)
        except BaseException as exc:
            log.error("Rank %d failed to save checkpoint step %d in round %d: %s", rank, step,
                      self._round, exc)
            self._report_failure(step, exc)
            raise
        finally:
            self._announce(0.0)

    def _report_failure(self, step: int, exc: BaseException) -> None:
        """Rank 0 tells the commit log that the save of ``step`` failed, so that the
        operator sees it (the agent records an event). Every rank has the same
        outcome, so one report is enough; a fenced save is no failure to report
        (it is a zombie's). A failed report never changes the save's outcome, nor
        delays it: the report goes from a thread of its own, because a save that
        failed for want of etcd would wait on etcd again while the other ranks,
        their save over, wait for rank 0 in the next step (and look hung)."""
        if self._group.rank != 0 or not isinstance(exc, CheckpointError):
            return

        def report() -> None:
            try:
                self._commit_log.report_failure(step, self._round, 0, str(exc))
            except Exception as report_exc:  # noqa: BLE001 - best effort, see above
                log.warning("Rank 0 could not report the failed save of checkpoint step %d in "
                            "round %d: %s", step, self._round, report_exc)

        threading.Thread(target=report, name="elastic-ckpt-report", daemon=True).start()

    def _report_restore(self, step: int, seconds: float) -> None:
        """Rank 0 tells the commit log (the agent, for its metrics) how long the
        restore took and how large the checkpoint is; from a thread of its own,
        so that an agent slow to answer never delays training."""
        if self._group.rank != 0:
            return
        size_bytes = self._restored_bytes

        def report() -> None:
            try:
                self._commit_log.report_restore(step, self._round, 0, seconds, size_bytes)
            except Exception as exc:  # noqa: BLE001 - best effort: only a metric is lost
                log.debug("Rank 0 could not report the restore of checkpoint step %d: %s",
                          step, exc)

        threading.Thread(target=report, name="elastic-ckpt-restored", daemon=True).start()

    def _prepare(self, tmp: str, step: int) -> None:
        """Rank 0: remove stale temporaries (this job's saves are serialized, so no
        save in flight owns them) and create this save's directory afresh."""
        for name in layout.stale_temporaries(os.listdir(self.root), step, self._round):
            log.info("Rank 0 removes %s, left by a crashed or abandoned save, before saving "
                     "step %d in round %d.", name, step, self._round)
            self._remove(os.path.join(self.root, name))
        layout.make_dir(tmp, self.mode)

    def _write(self, staged: "_Staged", tmp: str) -> None:
        """Every rank: DCP shards, then this rank's state file and manifest, all fsynced."""
        writer = _RecordingWriter(tmp, self.mode)
        dcp.save(staged.state_dict, storage_writer=writer, process_group=self._group.pg,
                 **compat.single_process(self._group.pg is None))
        rank = self._group.rank
        local_name = layout.rank_state_name(rank)
        layout.write_durably(os.path.join(tmp, local_name), staged.local, self._file_mode)
        # Digests of the bytes as written (DCP's shards and, on rank 0, .metadata,
        # item by item), not of a read back: see dcp_io.
        files = writer.digests()
        files[local_name] = layout.bytes_digest(staged.local)
        layout.write_manifest(tmp, layout.Manifest(
            rank=rank, world_size=self._group.size, step=staged.step, round=self._round,
            files=files), self._file_mode)
        layout.fsync_dir(tmp)

    def _commit(self, staged: "_Staged", tmp: str) -> None:
        """Rank 0: rename into place, record in the commit log, mark, prune.

        Raises :class:`FencedError` when the commit log refuses this round, or
        when a directory of this step written by a newer round is in the way
        (this saver is then a zombie: that directory is left as it is).
        """
        name = layout.step_dir_name(staged.step)
        final = os.path.join(self.root, name)
        previous = self._latest_before_commit(final, staged.step)
        manifests, _ = layout.read_manifests(tmp)  # verified: every rank's files are there
        if os.path.lexists(final):
            self._make_way(final, staged.step, previous, tmp)
        os.rename(tmp, final)
        layout.fsync_dir(self.root)
        failpoint("ckpt.after_rename_before_commit_log")
        entry = CommitEntry(step=staged.step, round=self._round, world_size=self._group.size,
                            path=name, time=time.time(),
                            save_s=time.monotonic() - staged.started_at,
                            size_bytes=layout.manifest_bytes(manifests))
        try:
            self._commit_log.commit(entry)
        except FencedError:
            # Leave the directory as it is, unmarked: after losing the fence, removing a
            # path could remove what the current round has put there in the meantime.
            log.error("Rank 0: the commit of checkpoint step %d in round %d was fenced off; %s "
                      "stays without a COMMITTED marker and is never restored.",
                      staged.step, self._round, final)
            raise
        failpoint("ckpt.after_commit_log_before_marker")
        try:
            layout.write_marker(final, entry, self._file_mode)
        except OSError as exc:
            log.warning("Rank 0 committed checkpoint step %d in round %d but could not write its "
                        "COMMITTED marker (%s); the commit log still names it.",
                        staged.step, self._round, exc)
        if previous is not None and previous.path != name:
            self._repair_marker(previous)
        self._retain(entry)

    def _latest_before_commit(self, final: str, step: int) -> CommitEntry | None:
        """Rank 0, before its commit: the commit log's latest entry, or None when
        it cannot be read (garbage in ``checkpoint/latest``) and no directory of
        this step is in the way. The fenced commit replaces the unreadable
        record, so it does not fail every save until someone mends it. With a
        directory in the way the error stands: whether it may be moved aside
        depends on that entry (see :meth:`_make_way`). A log that cannot be
        reached at all fails the commit that follows instead."""
        try:
            return self._commit_log.latest()
        except ElasticError as exc:
            if os.path.lexists(final):
                raise
            log.warning("Rank 0: the latest entry of the commit log cannot be read (%s); the "
                        "commit of checkpoint step %d in round %d replaces it.",
                        exc, step, self._round)
            return None

    def _make_way(self, final: str, step: int, latest: CommitEntry | None, tmp: str) -> None:
        """Rank 0: move aside the directory of this step that is in the way, when it
        is a leftover: a save that crashed after its rename, a fenced one, or one that
        this process's restore found unusable (which it skipped for an older one).

        Raises :class:`FencedError` when a newer round wrote it (this saver is a
        zombie, and the directory may be committed or about to be), and
        :class:`CheckpointWriteError` when it holds a committed checkpoint that
        restore may load (the latest entry's, or a marked one that is not newer
        than the latest). Either way the directory is left untouched.
        """
        name = os.path.basename(final)
        owner = layout.directory_round(final)
        if owner is not None and owner > self._round:
            raise FencedError(
                f"checkpoint step {step} of round {self._round} refused: {final} was written "
                f"by newer round {owner}, so this worker's round is no longer current; "
                f"leaving that directory as it is")
        if name not in self._unusable:
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
                    "step) to commit step %d in round %d.", final, step, self._round)
        # Between the checks above and this rename, only a newer round's save of the
        # very same step could put a directory here; that window is a few system calls.
        self._remove(final)

    def _repair_marker(self, previous: CommitEntry) -> None:
        """Rank 0, after a commit: give the previous latest entry's directory the
        ``COMMITTED`` marker that a crash between its commit and its marker left
        out, so that it stays a committed fallback for restore and retention."""
        directory = os.path.join(self.root, previous.path)
        if previous.path in self._unusable or not os.path.isdir(directory) \
                or layout.read_marker(directory) is not None:
            return
        try:
            layout.write_marker(directory, previous, self._file_mode)
        except OSError as exc:
            log.warning("Rank 0 could not write the missing COMMITTED marker of %s (%s) in "
                        "round %d; it is no longer a fallback for restore.", directory, exc,
                        self._round)
            return
        log.info("Rank 0 wrote the missing COMMITTED marker of %s (step %d, committed in round "
                 "%d) in round %d.", directory, previous.step, previous.round, self._round)

    def _retain(self, latest: CommitEntry) -> None:
        victims = layout.retention_victims(layout.list_checkpoints(self.root), self.keep, latest,
                                           unusable=self._unusable)
        for name in victims:
            log.info("Rank 0 removes checkpoint %s (keeping the last %d committed) after "
                     "committing step %d in round %d.", name, self.keep, latest.step, self._round)
            try:
                self._remove(os.path.join(self.root, name), between="ckpt.mid_prune")
            except OSError as exc:
                log.warning("Rank 0 could not remove old checkpoint %s (%s); it will be retried "
                            "after the next commit.", name, exc)

    def _remove(self, path: str, between: str | None = None) -> None:
        """Take a directory out of view atomically (rename to ``.trash-*``), then delete it;
        a crash in between leaves only trash, which the next save removes. ``between``
        names a failpoint to run in between."""
        trash = os.path.join(self.root, f"{layout.TRASH_PREFIX}{os.path.basename(path)}-"
                                        f"{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        if between is not None:
            failpoint(between)
        shutil.rmtree(trash, ignore_errors=True)

    def _discard_on_rank0(self, tmp: str) -> None:
        if self._group.rank != 0 or not os.path.lexists(tmp):
            return
        try:
            self._remove(tmp)
        except OSError as exc:
            log.warning("Rank 0 could not remove the failed save's directory %s (%s); the next "
                        "save removes it.", tmp, exc)

    # --- restore ------------------------------------------------------------------------------

    def _choose(self) -> list[str]:
        """Rank 0 lists the candidates in order and broadcasts them, so every rank
        tries the same ones in the same order (see :meth:`_load`)."""
        rank = self._group.rank
        self._unusable = set()
        listing: Any = None
        if rank == 0:
            try:
                latest = self._commit_log.latest()
                listing = layout.restore_candidates(layout.list_checkpoints(self.root), latest)
            except Exception as exc:  # noqa: BLE001 - sent to all ranks, re-raised below
                listing = f"reading the commit log failed: {exc!r}"
        listing = self._group.broadcast(listing, "choosing a checkpoint")
        if isinstance(listing, str):
            raise CheckpointError(f"rank {rank}: cannot choose a checkpoint under {self.root}: "
                                  f"{listing}")
        return listing

    def _load(self, name: str, fallback: str) -> int | None:
        """Verify and load one candidate; its step, or None when it fails verification.

        All ranks together: the structure and sizes first (cheap; each rank its
        share of the files, gathered), then ``dcp.load`` through a reader that
        checks each item's CRC-32 as it reads it (and ``.metadata`` and the
        rank's state file whole); shard files without item CRC-32s (older
        manifests) are checked whole instead, each rank its share, in the
        background thread while ``dcp.load`` runs. The outcomes are gathered,
        so every rank accepts or rejects the same candidate; only an accepted
        one's schedulers, RNGs, data position and extras are restored (a
        rejected one's tensors are overwritten by the next candidate's load).
        """
        path = os.path.join(self.root, name)
        rank = self._group.rank
        # The name comes from the commit log (etcd, or a file in the root):
        # nothing outside the root is ever read, not even its manifests.
        escape = layout.outside_root(self.root, name)
        listing: tuple[list[layout.Manifest], list[layout.Problem]] = ([], [])
        if escape is not None:
            problems, share = ([escape] if rank == 0 else []), []
        else:
            listing = layout.read_manifests(path)  # once: checked here, used below
            problems, share = layout.verify_structure(path, part=rank, parts=self._group.size,
                                                      manifests=listing)
        problems = [p for ps in self._group.all_gather(problems, "verifying") for p in ps]
        if problems:
            self._reject(name, problems, fallback)
            return None
        failure: str | None = None
        local: Any = None
        reader: VerifyingReader | None = None
        crc: concurrent.futures.Future | None = None
        try:
            manifests = listing[0]
            files = {n: digest for m in manifests for n, digest in m.files.items()}
            saved_world, step = manifests[0].world_size, manifests[0].step
            same_world = saved_world == self._group.size
            reader = VerifyingReader(path, files, checksums=self.verify_checksums,
                                     policy=self.policy)
            if self.verify_checksums:
                whole = [(p, digest) for p, digest in share
                         if digest.items is None and layout.is_shard_file(os.path.basename(p))]
                if whole:
                    crc = self._executor.submit(layout.verify_checksums, whole)
            tensors = state.collect(self._chunks)
            dcp.load(tensors.state_dict, storage_reader=reader,
                     planner=LoadPlanner(policy=self.policy), process_group=self._group.pg,
                     **compat.single_process(self._group.pg is None))
            state.apply(self._chunks, tensors)
            local_name = layout.rank_state_name(rank if same_world else 0)
            if self.verify_checksums:
                data = reader.verified_bytes(local_name)
            else:
                with open(os.path.join(path, local_name), "rb") as f:
                    data = f.read()
            local = state.load_local(data, self.policy, os.path.join(path, local_name))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - gathered below
            if reader is not None and reader.refusal is not None:
                exc = reader.refusal
            failure = f"loading checkpoint {path} failed: {describe_failure(exc)}"
        problems = list(reader.problems) if reader is not None else []
        if crc is not None:
            try:
                problems += crc.result()
            except Exception as exc:  # noqa: BLE001 - a verification that cannot run fails
                problems.append(layout.Problem(path, f"cannot verify ({exc!r})"))
        gathered = self._group.all_gather((problems, failure), "verifying and loading")
        problems = [p for ps, _ in gathered for p in ps]
        if problems:
            self._reject(name, problems, fallback)
            return None
        failures = [(r, f) for r, (_, f) in enumerate(gathered) if f]
        if failures:
            origin, message = failures[0]
            raise CheckpointError(f"rank {rank}: {message}" if failure else
                                  f"rank {rank}: rank {origin}: {message}")
        try:
            state.restore_schedulers(self._schedulers, local["schedulers"])
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            raise CheckpointError(f"rank {rank}: loading checkpoint {path} failed: "
                                  f"{describe_failure(exc)}") from exc
        if same_world:
            state.restore_rng(local["rng"])
        else:
            state.seed_rng(state.derived_seed(local["seed_base"], step, rank))
            log.info("Rank %d resumes step %d of a checkpoint saved by %d ranks with %d ranks in "
                     "round %d: its RNGs are seeded from (saved seed, step, rank), and the data "
                     "position and extras are rank 0's.", rank, step, saved_world,
                     self._group.size, self._round)
        self.data_state = local["data_state"]
        self.extras = local["extras"]
        self.restored_path = path
        self._restored_bytes = layout.manifest_bytes(manifests)
        return step

    def _reject(self, name: str, problems: list[layout.Problem], fallback: str) -> None:
        if self._group.rank == 0:
            for problem in problems:
                log.warning("Rank 0 skips checkpoint %s in round %d: %s; %s.", name,
                            self._round, problem, fallback)

    # --- helpers ------------------------------------------------------------------------------

    def _capture(self, action: Callable[[], None]) -> "_Failure | None":
        """Run a local step; turn its failure into a value that can travel in a
        collective, so that every rank still makes the next collective call."""
        try:
            action()
        except FencedError as exc:
            return _Failure(self._group.rank, str(exc), None, fenced=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - re-raised on every rank
            return _Failure.of(self._group.rank, exc)
        return None

    def _announce(self, seconds: float) -> None:
        try:
            self._on_saving(seconds)
        except Exception as exc:  # noqa: BLE001 - a telemetry hook must not break a save
            log.warning("Rank %d: the on_saving hook failed (%s); the save goes on.",
                        self._group.rank, exc)

    @property
    def _level(self) -> int:
        """Routine news at INFO from rank 0 only: one line per event, not one per rank."""
        return logging.INFO if self._group.rank == 0 else logging.DEBUG

    @property
    def process_group(self) -> Any:
        """The group this checkpointer's collectives and DCP's run on: a gloo group
        of its own over the ranks of the one given (or of the world); None when
        it runs as a single rank."""
        return self._group.pg

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")


@dataclasses.dataclass
class _Pending:
    """An async save's copy still to make in the background."""

    later: dict[str, dict[str, Any]]  # live parameters and optimizer state, by group
    queued: Any                       # a CUDA event after the caller's queued work, or None
    now: dict[str, Any]               # the rest, copied in save()
    order: dict[str, list[str] | None]  # the state dict's keys per group (None: not a dict)
    versions: list[tuple[str, Any, int]]  # (name, live tensor, _version at save())


@dataclasses.dataclass
class _Staged:
    step: int
    state_dict: dict[str, Any]  # a CPU copy owned by the save (async), or the live state
    local: bytes                # this rank's serialized non-tensor state
    nbytes: int
    started_at: float = 0.0     # monotonic, when save() began staging
    pending: _Pending | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _cuda_index(device: torch.device | int) -> int | None:
    """A CUDA device's index (the current one for a bare ``cuda``); None for another type."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _training_device(chunks: Sequence[state.Chunk]) -> int | None:
    """The CUDA device the model's parameters are on (the first one found), so the
    checkpoint thread works on it rather than on device 0; None when none is on CUDA."""
    for chunk in chunks:
        for parameter in chunk.model.parameters():
            if _local(parameter).is_cuda:
                return _local(parameter).device.index
    return None


def _split(state_dict: dict[str, Any], parameters: set[int]
           ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``(later, now)``: parameters and optimizer-state tensors, which only
    ``optimizer.step()`` changes, and everything else (buffers, which forward
    changes, and non-tensor values)."""
    later: dict[str, dict[str, Any]] = {}
    now: dict[str, Any] = {}
    for group, values in state_dict.items():
        if not isinstance(values, dict):
            now[group] = values
            continue
        later[group], now[group] = {}, {}
        for key, value in values.items():
            late = isinstance(value, torch.Tensor) and (
                group == "optim" or _local(value).data_ptr() in parameters)
            (later if late else now)[group][key] = value
    return later, now


@dataclasses.dataclass(frozen=True)
class _Failure:
    """A failure on one rank, in a form that pickles through an object collective."""

    rank: int
    message: str
    errno: int | None
    fenced: bool = False

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> "_Failure":
        """Describe ``exc`` as seen on ``rank``; when it wraps another rank's OS
        error (DCP spreads one rank's failure to all), name that rank."""
        found = _find_os_error(exc, rank)
        if found is not None:
            origin, os_error = found
            where = f" ({os_error.filename})" if os_error.filename else ""
            code = errno_module.errorcode.get(os_error.errno, os_error.errno)
            return cls(origin, f"[Errno {os_error.errno} {code}] {os_error.strerror}{where}",
                       os_error.errno)
        return cls(rank, describe_failure(exc), None)

    def error(self, step: int, directory: str, more: int = 0) -> Exception:
        if self.fenced:
            return FencedError(self.message)
        others = f" (and on {more} more rank(s))" if more else ""
        return CheckpointWriteError(f"saving checkpoint step {step} into {directory} failed on "
                                    f"rank {self.rank}{others}: {self.message}",
                                    directory, self.errno)


def _find_os_error(exc: BaseException, rank: int) -> tuple[int, OSError] | None:
    """The first OSError in an exception's cause chain or in DCP's per-rank
    failures, with the rank it happened on."""
    seen = set()
    pending: list[tuple[int, BaseException | None]] = [(rank, exc)]
    while pending:
        origin, current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return origin, current
        if isinstance(current, CheckpointException):
            pending.extend((r, failure[0]) for r, failure in sorted(current.failures.items()))
        pending.extend([(origin, current.__cause__), (origin, current.__context__)])
    return None


def describe_failure(exc: BaseException) -> str:
    """One line for a rank's failure: our own errors by their message, others
    with their type too; for DCP's CheckpointException, the first inner error."""
    if isinstance(exc, CheckpointException):
        inner = [failure[0] for _, failure in sorted(exc.failures.items())]
        if inner:
            return f"{type(inner[0]).__name__}: {describe_failure(inner[0])}"
    text = str(exc).strip().splitlines()
    if isinstance(exc, ElasticError):
        return text[0] if text else type(exc).__name__
    # Not ours: its type says what went wrong when its text does not (a torch
    # error whose message is only "<class 'type'>").
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _RecordingWriter(ChecksummingWriter):
    """DCP's file writer computing CRC-32s as it writes (for this rank's manifest),
    hosting the write-path failpoints."""

    def write_data(self, plan, planner):
        failpoint("ckpt.write")
        future = super().write_data(plan, planner)
        if future.value():
            failpoint("ckpt.mid_write")
        return future


# The object collectives below take one round when every payload fits in a frame
# (the usual case: a candidate list, a few problems, a failure), a second only when
# one does not. torch's all_gather_object / broadcast_object_list always take two
# (the sizes, then the payloads), and a round costs about 0.7 ms between two gloo
# processes on one host: three object collectives were 5 ms of a 0.1 s restore.
_FRAME = 8192
_HEADER = 8  # the payload's length, little-endian


def _frame(data: bytes) -> torch.Tensor:
    """A frame carrying ``data``'s length, and ``data`` itself when it fits."""
    frame = torch.zeros(_FRAME, dtype=torch.uint8)
    frame[:_HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(_HEADER, "little")),
                                       dtype=torch.uint8)
    if 0 < len(data) <= _FRAME - _HEADER:
        frame[_HEADER:_HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def _length(frame: torch.Tensor) -> int:
    return int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")


class _Group:
    """The checkpoint process group and the object collectives run over it.

    Always a gloo group of the checkpointer's own, also when the caller gives
    one: the collectives run from the background thread while the training
    thread runs its own, and two threads' collectives on one group pair up
    wrongly (on NCCL they also need a device). Frames are CPU tensors.
    """

    def __init__(self, pg: Any, rank: int, size: int):
        self.pg = pg
        self.rank = rank
        self.size = size

    @classmethod
    def create(cls, process_group: Any, timeout_s: float) -> "_Group":
        if not (dist.is_available() and dist.is_initialized()):
            # DCP warns at every call that it runs in a single process; that is the intent here.
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message="torch.distributed is disabled, unavailable or uninit")
            return cls(None, 0, 1)
        if importlib.util.find_spec("numpy") is None:
            # torch's object collectives, which DCP uses, call tensor.numpy() on receipt.
            raise CheckpointError("distributed checkpoints need numpy: torch's object "
                                  "collectives, which DCP uses, fail without it")
        timeout = datetime.timedelta(seconds=timeout_s)
        if process_group is None:
            pg = dist.new_group(backend="gloo", timeout=timeout)
        else:
            # Only the group's members call this (each rank may be in another subgroup).
            pg = dist.new_group(ranks=dist.get_process_group_ranks(process_group),
                                backend="gloo", timeout=timeout,
                                use_local_synchronization=True)
        return cls(pg, dist.get_rank(pg), dist.get_world_size(pg))

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order. Raises CheckpointError when the
        group fails (a peer died, or the collective timed out)."""
        if self.pg is None:
            return [obj]
        data = pickle.dumps(obj)
        try:
            frames = [torch.empty(_FRAME, dtype=torch.uint8) for _ in range(self.size)]
            dist.all_gather(frames, _frame(data), group=self.pg)
            lengths = [_length(frame) for frame in frames]
            if max(lengths) <= _FRAME - _HEADER:
                payloads = [frame[_HEADER:_HEADER + n] for frame, n in zip(frames, lengths)]
            else:  # a second round, every rank taking it: all saw the same lengths
                padded = torch.zeros(max(lengths), dtype=torch.uint8)
                padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                payloads = [torch.empty(max(lengths), dtype=torch.uint8)
                            for _ in range(self.size)]
                dist.all_gather(payloads, padded, group=self.pg)
                payloads = [payload[:n] for payload, n in zip(payloads, lengths)]
        except RuntimeError as exc:
            raise self._lost(what, exc) from exc
        return [pickle.loads(payload.numpy().tobytes()) for payload in payloads]

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (the others' is ignored). Raises
        CheckpointError when the group fails."""
        if self.pg is None:
            return obj
        data = pickle.dumps(obj) if self.rank == 0 else b""
        try:
            frame = _frame(data)
            dist.broadcast(frame, group=self.pg, group_src=0)
            length = _length(frame)
            if length <= _FRAME - _HEADER:
                payload = frame[_HEADER:_HEADER + length]
            else:
                payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                           else torch.empty(length, dtype=torch.uint8))
                dist.broadcast(payload, group=self.pg, group_src=0)
        except RuntimeError as exc:
            raise self._lost(what, exc) from exc
        return pickle.loads(payload.numpy().tobytes())

    def _lost(self, what: str, exc: BaseException) -> CheckpointError:
        return CheckpointError(f"rank {self.rank}: the checkpoint group failed while {what} "
                               f"(a peer probably died): {describe_failure(exc)}")
