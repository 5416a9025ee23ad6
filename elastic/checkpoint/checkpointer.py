"""Checkpointer: sharded, verified, fenced, optionally asynchronous saves, and restore.

The commit protocol and the restore rule are written down once, in the
docstring of :mod:`elastic.checkpoint`; the modules beside this one implement
them, each one job:

* :mod:`~elastic.checkpoint.environment`: the root, mode, round and saving hook
  found in the environment where not given;
* :mod:`~elastic.checkpoint.group`: the checkpoint's own gloo group and its
  object collectives;
* :mod:`~elastic.checkpoint.snapshot`: what a save writes, copied at ``save()``
  or in the background;
* :mod:`~elastic.checkpoint.saving`: the save's collective sequence (write,
  verify, commit) and :mod:`~elastic.checkpoint.root`, rank 0's changes to the
  root (temporaries, markers, retention);
* :mod:`~elastic.checkpoint.restore`: choosing, verifying and loading;
* :mod:`~elastic.checkpoint.memory`: the memory tier under the disk tier
  (snapshots at ``elastic.step(n)``, restore from memory first).

This class wires them together and runs the async saves: one at a time, in a
background thread of its own, a failure surfacing once from :meth:`wait` or
the next :meth:`save`.

Why ``dcp.save`` in a thread of our own instead of ``dcp.async_save``: the
verification and the commit must follow the write in the same background
task, with collectives of their own, and a failure anywhere must surface
once, from :meth:`Checkpointer.wait` or the next :meth:`Checkpointer.save`.
Staging is our own (:mod:`elastic.checkpoint.staging`: buffers kept between
saves, public torch API only), in that same background thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

import torch
from torch import nn

from elastic.checkpoint import environment, layout, state, trust
from elastic.checkpoint.agent_log import default_commit_log
from elastic.checkpoint.api import CommitLog
from elastic.checkpoint.failures import describe_failure
from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.memory.cadence import AUTO, Cadence, parse_every
from elastic.checkpoint.memory.recovery import MemoryRestore
from elastic.checkpoint.memory.tier import SnapshotTier
from elastic.checkpoint.memory.writer import Identity
from elastic.checkpoint.restore import Restorer
from elastic.checkpoint.root import CheckpointRoot
from elastic.checkpoint.saving import SavePipeline
from elastic.checkpoint.snapshot import SnapshotTaker
from elastic.checkpoint.staging import CudaOps, Stager
from elastic.errors import CheckpointCorruptError, CheckpointError, ConfigError

__all__ = ["Checkpointer", "describe_failure"]


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

    The memory tier (:mod:`elastic.checkpoint.memory`) is on when ``memory_dir``
    is given or ``$ELASTIC_MEMORY_DIR`` is set (an agent run with
    ``--memory-tier``): at every ``elastic.step(n)`` that the cadence picks
    (``memory_every`` steps, or "auto": the fewest that keep the snapshot's cost
    within 1% of the step time) this rank's state, as a save would take it, is
    staged into that node-local directory, and :meth:`restore` restores from
    memory when a complete snapshot there is not older than the disk tier's
    latest commit. It needs ``data``: the object (an
    :class:`~elastic.data.ElasticSampler`, a stateful data loader) whose
    ``state_dict()`` each snapshot takes and whose ``load_state_dict()``
    restore calls; without the tier ``data`` is optional and does the same for
    disk saves that pass no ``data_state``. Each snapshot carries the
    ``extras`` of the last :meth:`save`.

    Raises :class:`ConfigError` for a missing root or bad arguments (the
    memory tier on without ``data``), and
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
                 mode: int | None = None, data: Any = None, memory_dir: str | None = None,
                 memory_every: int | str = AUTO):
        self.root = environment.root_from_env(root)
        self.memory_dir = environment.memory_dir_from_env(memory_dir)
        if self.memory_dir is not None and data is None:
            raise ConfigError("the memory tier snapshots every step: pass data=<your sampler or "
                              "data loader> (an object with state_dict() and load_state_dict()) "
                              "to Checkpointer, so that a restore from memory resumes the data "
                              "where the snapshot was taken")
        self._memory_every = parse_every(memory_every)
        self.data = data
        if keep < 1:
            raise ConfigError(f"keep must be at least 1, got {keep}")
        try:
            chunks = state.make_chunks(model, optimizer)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"bad checkpoint arguments: {exc}") from exc
        schedulers = ([] if scheduler is None else list(scheduler)
                      if isinstance(scheduler, (list, tuple)) else [scheduler])
        self.keep = keep
        self.verify_checksums = verify_checksums
        # The environment is read here, and only where the argument is not given.
        self.policy = trust.LoadPolicy(
            trusted=trust.trust_from_env() if trust_checkpoint is None else trust_checkpoint,
            safe_globals=safe_globals)
        self.mode = layout.check_mode(environment.mode_from_env() if mode is None else mode)
        file_mode = layout.file_mode(self.mode)
        commit_log = commit_log if commit_log is not None else default_commit_log(self.root,
                                                                                  file_mode)
        self._directory = CheckpointRoot(self.root, self.mode, file_mode, keep,
                                         environment.round_from_env())
        self._group = CheckpointGroup.create(process_group, timeout_s)
        self.device = (environment.cuda_index(device) if device is not None
                       else environment.training_device(chunks))
        self._stager = Stager(self.device, cuda_ops)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="elastic-checkpoint",
            initializer=self._stager.bind)
        self._inflight: concurrent.futures.Future | None = None
        self._closed = False
        self.data_state: Any = None
        self.extras: Any = None
        self.restored_path: str | None = None
        self._snapshot_extras: Any = None
        self._commit_log = commit_log
        self._start(chunks, schedulers, commit_log, on_saving)
        self._memory, self._tier, self._unhook = self._start_memory(chunks, schedulers)

    def _start(self, chunks: Sequence[state.Chunk], schedulers: Sequence[Any],
               commit_log: CommitLog, on_saving: Callable[[float], None] | None) -> None:
        """Build the snapshot taker, the save pipeline and the restorer, and prepare
        the root (every rank; rank 0 warns about an exposed or trusted root)."""
        notice = environment.SavingNotice(
            on_saving if on_saving is not None else environment.default_on_saving(),
            self._group.rank)
        self._snapshots = SnapshotTaker(chunks, schedulers, self._stager, self._group,
                                        self._directory.round, notice)
        self._saves = SavePipeline(self._directory, self._group, commit_log, self._snapshots,
                                   notice)
        self._restorer = Restorer(self._directory, self._group, commit_log, chunks=chunks,
                                  schedulers=schedulers, checksums=self.verify_checksums,
                                  policy=self.policy, executor=self._executor)
        self._directory.prepare(self._group.rank, self.policy.trusted)

    def _start_memory(self, chunks: Sequence[state.Chunk], schedulers: Sequence[Any]) -> tuple:
        """The memory tier's restore and snapshots, the latter hooked on
        ``elastic.step``; Nones when the tier is off."""
        if self.memory_dir is None:
            return None, None, None
        round_ = self._directory.round
        job_id, node_id = environment.job_and_node()
        memory = MemoryRestore(self.memory_dir, self._group, chunks=chunks,
                               schedulers=schedulers, policy=self.policy, round_=round_,
                               node_id=node_id)
        tier = SnapshotTier(
            self.memory_dir, Identity(job_id, node_id, round_, self._group.rank,
                                      self._group.size),
            chunks=chunks, schedulers=schedulers, data=self.data,
            cadence=Cadence(self._memory_every, self._agree_every),
            local_ranks=environment.local_world_size(), extras=lambda: self._snapshot_extras,
            news_level=self._group.news_level,
            on_written=environment.default_snapshot_notice())
        hook = environment.default_step_hook()
        return memory, tier, hook(tier.on_step) if hook is not None else None

    def _agree_every(self, proposal: int) -> int:
        """Every rank's largest proposed snapshot interval (one collective, once),
        after the save in flight: its collectives run on the same group."""
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
        return max(self._group.all_gather(proposal, "agreeing on the memory snapshot interval"))

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
        if data_state is None and self.data is not None:
            data_state = self.data.state_dict()
        self._snapshot_extras = extras
        snapshot = self._snapshots.take(int(step), data_state, extras, copy=async_)
        if async_:
            self._inflight = self._executor.submit(self._saves.persist, snapshot)
        else:
            self._saves.persist(snapshot)

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
        :attr:`extras` and :attr:`restored_path` (and loads ``data``'s state).
        With the memory tier on, a complete memory snapshot not older than
        the latest commit is restored first (:mod:`elastic.checkpoint.memory.choice`;
        :attr:`restored_path` is then ``memory:round-<R>/step-<S>``); when that
        fails on any rank, every rank warns and restores from disk. Candidates that fail
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
        restored = self._memory.restore(self._commit_log) if self._memory is not None else None
        try:
            restored = restored or self._restorer.restore()
        except CheckpointCorruptError:
            self.data_state = self.extras = self.restored_path = None
            raise
        if restored is None:
            self.data_state = self.extras = self.restored_path = None
            return 0
        self.data_state = restored.data_state
        self.extras = restored.extras
        self.restored_path = restored.path
        if self.data is not None and restored.data_state is not None:
            self.data.load_state_dict(restored.data_state)
        return restored.step + 1

    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure) and release the
        background thread and the staging memory. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._unhook is not None:
                self._unhook()
            if self._tier is not None:
                self._tier.close()
            self._snapshots.close()
            self._executor.shutdown(wait=True)
            self._stager.close()

    @property
    def process_group(self) -> Any:
        """The group this checkpointer's collectives and DCP's run on: a gloo group
        of its own over the ranks of the one given (or of the world); None when
        it runs as a single rank."""
        return self._group.pg

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
