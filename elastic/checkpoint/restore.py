"""Restore: choose the candidates, verify and load the first that verifies (the
rule "What restore trusts" of :mod:`elastic.checkpoint`).

All ranks together: rank 0 lists the candidates and broadcasts them; the
cheap checks and the load's own checks are gathered, so every rank accepts or
rejects the same candidate.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Sequence

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import layout, state, timing, trust
from elastic.checkpoint.api import CommitLog
from elastic.checkpoint.dcp_io import LoadPlanner, VerifyingReader
from elastic.checkpoint.failures import describe_failure
from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.root import CheckpointRoot
from elastic.errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint restored: its step, directory and size, and this rank's share
    of its non-tensor state."""

    step: int
    path: str
    size_bytes: int
    data_state: Any
    extras: Any


@dataclasses.dataclass
class _Loaded:
    """One rank's outcome of loading a candidate, before the ranks agree on it."""

    local: Any = None
    failure: str | None = None
    problems: list[layout.Problem] = dataclasses.field(default_factory=list)


class Restorer:
    """Restores ``chunks`` and ``schedulers`` from the checkpoints under ``root``
    that ``commit_log`` and the markers vouch for. ``checksums``: compare the
    CRC-32s of what the load reads (else only the cheap checks); ``policy``: what
    the load may unpickle; ``executor``: where whole-file checks run meanwhile."""

    def __init__(self, root: CheckpointRoot, group: CheckpointGroup, commit_log: CommitLog, *,
                 chunks: Sequence[state.Chunk], schedulers: Sequence[Any], checksums: bool,
                 policy: trust.LoadPolicy, executor: concurrent.futures.Executor):
        self._root = root
        self._group = group
        self._commit_log = commit_log
        self._chunks = chunks
        self._schedulers = schedulers
        self._checksums = checksums
        self._policy = policy
        self._executor = executor

    def restore(self) -> Restored | None:
        """Load the latest committed checkpoint that verifies; None when there is none.

        Candidates that fail verification are logged, added to the root's
        ``unusable`` set and skipped. Raises :class:`CheckpointCorruptError` when
        committed checkpoints exist but none verifies, and
        :class:`CheckpointError` when the commit log cannot be read or loading
        a verified one fails.
        """
        started = time.monotonic()
        candidates = self._choose()
        rank, round_ = self._group.rank, self._root.round
        for index, name in enumerate(candidates):
            fallback = (f"falling back to {candidates[index + 1]}" if index + 1 < len(candidates)
                        else "no older committed checkpoint is left")
            restored = self._load(name, fallback)
            if restored is None:
                self._root.unusable.add(name)
                continue
            seconds = time.monotonic() - started
            log.log(self._group.news_level, "Rank %d restored checkpoint step %d from %s in "
                    "round %d in %.2f s; resuming at step %d.", rank, restored.step, name,
                    round_, seconds, restored.step + 1)
            self._report_restore(restored, seconds)
            return restored
        if candidates:
            raise CheckpointCorruptError(
                f"rank {rank}: none of the committed checkpoints under "
                f"{self._root.path} verifies ({', '.join(candidates)}); see the warnings above "
                f"for the files at fault")
        log.log(self._group.news_level, "Rank %d found no committed checkpoint under %s in "
                "round %d; starting from step 0.", rank, self._root.path, round_)
        return None

    @timing.timed("choose")
    def _choose(self) -> list[str]:
        """Rank 0 lists the candidates in order and broadcasts them, so every rank
        tries the same ones in the same order (see :meth:`_load`)."""
        rank = self._group.rank
        self._root.unusable = set()
        listing: Any = None
        if rank == 0:
            try:
                latest = self._commit_log.latest()
                listing = layout.restore_candidates(layout.list_checkpoints(self._root.path),
                                                    latest)
            except Exception as exc:  # noqa: BLE001 - sent to all ranks, re-raised below
                listing = f"reading the commit log failed: {exc!r}"
        listing = self._group.broadcast(listing, "choosing a checkpoint")
        if isinstance(listing, str):
            raise CheckpointError(f"rank {rank}: cannot choose a checkpoint under "
                                  f"{self._root.path}: {listing}")
        return listing

    @timing.timed("load")
    def _load(self, name: str, fallback: str) -> Restored | None:
        """Verify and load one candidate; None when it fails verification.

        The structure and sizes first (cheap; each rank its share of the files,
        gathered), then the load with its own checks (:meth:`_read`). The
        outcomes are gathered, so every rank accepts or rejects the same
        candidate; only an accepted one's schedulers, RNGs, data position and
        extras are restored (a rejected one's tensors are overwritten by the
        next candidate's load). Raises CheckpointError when a verified candidate
        fails to load on any rank.
        """
        path = self._root.join(name)
        rank = self._group.rank
        # The name comes from the commit log (etcd, or a file in the root):
        # nothing outside the root is ever read, not even its manifests.
        escape = layout.outside_root(self._root.path, name)
        manifests: list[layout.Manifest] = []
        if escape is not None:
            problems, share = ([escape] if rank == 0 else []), []
        else:
            listing = layout.read_manifests(path)  # once: checked here, used below
            manifests = listing[0]
            problems, share = layout.verify_structure(path, part=rank, parts=self._group.size,
                                                      manifests=listing)
        problems = [p for ps in self._group.all_gather(problems, "verifying") for p in ps]
        if problems:
            self._reject(name, problems, fallback)
            return None
        loaded = self._read(path, manifests, share)
        gathered = self._group.all_gather((loaded.problems, loaded.failure),
                                          "verifying and loading")
        problems = [p for ps, _ in gathered for p in ps]
        if problems:
            self._reject(name, problems, fallback)
            return None
        failures = [(r, f) for r, (_, f) in enumerate(gathered) if f]
        if failures:
            origin, message = failures[0]
            raise CheckpointError(f"rank {rank}: {message}" if loaded.failure else
                                  f"rank {rank}: rank {origin}: {message}")
        return self._accept(path, manifests, loaded.local)

    def _read(self, path: str, manifests: list[layout.Manifest],
              share: list[tuple[str, layout.FileDigest]]) -> _Loaded:
        """This rank's load of a candidate whose structure verified: ``dcp.load``
        through a reader that checks each item's CRC-32 as it reads it (and
        ``.metadata`` and the rank's state file whole); shard files without item
        CRC-32s (older manifests) are checked whole instead, this rank's
        ``share``, in the background meanwhile. Never raises: a failure and the
        problems found are the outcome's."""
        loaded = _Loaded()
        reader: VerifyingReader | None = None
        crc: concurrent.futures.Future | None = None
        rank = self._group.rank
        try:
            files = {n: digest for m in manifests for n, digest in m.files.items()}
            reader = VerifyingReader(path, files, checksums=self._checksums, policy=self._policy)
            whole = [(p, digest) for p, digest in share
                     if digest.items is None and layout.is_shard_file(os.path.basename(p))]
            if self._checksums and whole:
                crc = self._executor.submit(layout.verify_checksums, whole)
            tensors = state.collect(self._chunks)
            with timing.phase("dcp_load"):
                dcp.load(tensors.state_dict, storage_reader=reader,
                         planner=LoadPlanner(policy=self._policy), process_group=self._group.pg,
                         **compat.single_process(self._group.pg is None))
            state.apply(self._chunks, tensors)
            same_world = manifests[0].world_size == self._group.size
            local_name = layout.rank_state_name(rank if same_world else 0)
            if self._checksums:
                data = reader.verified_bytes(local_name)
            else:
                with open(os.path.join(path, local_name), "rb") as f:
                    data = f.read()
            loaded.local = state.load_local(data, self._policy, os.path.join(path, local_name))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - gathered by the caller
            if reader is not None and reader.refusal is not None:
                exc = reader.refusal
            loaded.failure = f"loading checkpoint {path} failed: {describe_failure(exc)}"
        loaded.problems = list(reader.problems) if reader is not None else []
        if crc is not None:
            try:
                loaded.problems += crc.result()
            except Exception as exc:  # noqa: BLE001 - a verification that cannot run fails
                loaded.problems.append(layout.Problem(path, f"cannot verify ({exc!r})"))
        return loaded

    def _accept(self, path: str, manifests: list[layout.Manifest], local: Any) -> Restored:
        """Restore the accepted candidate's schedulers and RNGs (at another world
        size, RNGs seeded from (saved seed, step, rank)). Raises CheckpointError
        when the schedulers do not take their state."""
        rank = self._group.rank
        saved_world, step = manifests[0].world_size, manifests[0].step
        try:
            state.restore_schedulers(self._schedulers, local["schedulers"])
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            raise CheckpointError(f"rank {rank}: loading checkpoint {path} failed: "
                                  f"{describe_failure(exc)}") from exc
        if saved_world == self._group.size:
            state.restore_rng(local["rng"])
        else:
            state.seed_rng(state.derived_seed(local["seed_base"], step, rank))
            log.info("Rank %d resumes step %d of a checkpoint saved by %d ranks with %d ranks in "
                     "round %d: its RNGs are seeded from (saved seed, step, rank), and the data "
                     "position and extras are rank 0's.", rank, step, saved_world,
                     self._group.size, self._root.round)
        return Restored(step=step, path=path, size_bytes=layout.manifest_bytes(manifests),
                        data_state=local["data_state"], extras=local["extras"])

    def _reject(self, name: str, problems: list[layout.Problem], fallback: str) -> None:
        if self._group.rank == 0:
            for problem in problems:
                log.warning("Rank 0 skips checkpoint %s in round %d: %s; %s.", name,
                            self._root.round, problem, fallback)

    def _report_restore(self, restored: Restored, seconds: float) -> None:
        """Rank 0 tells the commit log (the agent, for its metrics) how long the
        restore took and how large the checkpoint is; from a thread of its own,
        so that an agent slow to answer never delays training."""
        if self._group.rank != 0:
            return
        step, round_ = restored.step, self._root.round

        def report() -> None:
            try:
                self._commit_log.report_restore(step, round_, 0, seconds, restored.size_bytes)
            except Exception as exc:  # noqa: BLE001 - best effort: only a metric is lost
                log.debug("Rank 0 could not report the restore of checkpoint step %d: %s",
                          step, exc)

        threading.Thread(target=report, name="elastic-ckpt-restored", daemon=True).start()
