"""Restore from the memory tier: choose the snapshot, bring each rank its slots, load them.

Every rank of the new group, together (the rule is
:func:`~elastic.checkpoint.memory.choice.choose`):

1. each rank lists the complete slots its node holds (own and replicas) and
   names its node, and rank 0 adds the disk tier's latest commit; one gather,
   and every rank computes the same choice. Disk wins: return None, the disk
   restore runs. The ranks named on this node share its CPUs for the copy
   (:func:`.slotfile.copy_threads`).
2. Which old ranks' slots each rank needs: at the snapshot's world size its
   own old rank's; at another, those that its load reads (the load is planned
   here, once, over every old rank's manifest, gathered:
   :class:`reader.PlannedLoad`) and old rank 0's (for its ``local.pt``). A
   slot on the rank's node is read in place; the others are sent by a rank of
   a node that holds one (:mod:`.fetch`).
3. Load, each rank alone (no collective): the live state dict is collected
   once; at the same world size, each tensor is read from the slot straight
   into its live tensor (shapes, dtypes and chunks must match the manifest:
   :func:`copy_slot`), no DCP; at another, by the plan of step 2 through
   :class:`reader.MemoryStorageReader`; slot files on this node read by the
   rank's share of the node's threads. Non-tensor values and ``local.pt`` are
   read through :mod:`elastic.checkpoint.trust`'s allow-lists (a replica came
   over the network: nothing of it runs). A slot read on this node must still
   be the one its manifest vouched for after the reads (``layout.still_same``).
4. The outcomes (and where the slots came from, for rank 0's report) are
   gathered once: if any rank failed, every rank returns None (the caller
   falls back to the disk restore, rank 0 warning why); otherwise each
   restores its schedulers and RNGs as the disk restore does
   (:mod:`elastic.checkpoint.state`: its own old rank's at the same world
   size, old rank 0's and derived seeds at another).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Sequence

import torch

from elastic.checkpoint import state, timing, trust
from elastic.checkpoint.api import CommitLog
from elastic.checkpoint.dcp_io import LoadPlanner
from elastic.checkpoint.failures import describe_failure
from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.choice import (
    DISK,
    MEMORY,
    Choice,
    DiskLatest,
    SlotSeen,
    choose,
    plan_transfers,
)
from elastic.checkpoint.memory.fetch import Fetched, exchange, open_local, unchanged
from elastic.checkpoint.memory.items import dtype_of, plan_slot
from elastic.checkpoint.memory.reader import (
    PlannedLoad,
    SlotData,
    byte_tensor,
    load_objects,
    put_objects,
)
from elastic.checkpoint.memory.slotfile import SlotFile, copy_threads, fillable
from elastic.checkpoint.restore import Restored
from elastic.checkpoint.staging import local_tensor
from elastic.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Attempt:
    """One rank's restore of the chosen snapshot so far."""

    choice: Choice
    held: dict[int, layout.SlotInfo]          # old rank -> its slot on this node, as listed
    in_full: set[int] = dataclasses.field(default_factory=set)  # held ones read in full
    fetched: dict[int, Fetched] = dataclasses.field(default_factory=dict)
    manifests: dict[int, layout.Manifest] = dataclasses.field(default_factory=dict)
    tensors: state.TensorState | None = None  # the live state, collected once
    planned: PlannedLoad | None = None       # at another world size
    threads: int = 1                         # this rank's threads for reading slot files
    failure: str = ""


class MemoryRestore:
    """Restores ``chunks`` and ``schedulers`` from the snapshots in ``memory_dir``
    (this rank's node's, ``node_id``) and its peers', as rank ``group.rank`` of
    ``round_``."""

    def __init__(self, memory_dir: str, group: CheckpointGroup, *,
                 chunks: Sequence[state.Chunk], schedulers: Sequence[Any],
                 policy: trust.LoadPolicy, round_: int, node_id: str):
        self.memory_dir = memory_dir
        self._node_id = node_id
        self._group = group
        self._chunks = chunks
        self._schedulers = schedulers
        self._policy = policy
        self._round = round_
        self._shards: dict = {}  # DTensors' chunks, remembered (items.plan_slot)

    def restore(self, commit_log: CommitLog) -> Restored | None:
        """The snapshot restored, or None when the disk tier is to be used (disk
        is newer, no complete snapshot, or the memory restore failed on some
        rank: rank 0 logs why). Raises CheckpointError when the group fails."""
        started = time.monotonic()
        attempt = self._choose(commit_log)
        if attempt.choice.source != MEMORY:
            log.log(self._group.news_level, "Rank 0 restores from disk in round %d: %s.",
                    self._round, attempt.choice.reason)
            return None
        self._bring(attempt)
        # No rank waits for another before its load: each loads alone.
        local = None if attempt.failure else self._load(attempt)
        origins = self._agree(attempt)
        if origins is None:
            return None
        restored = self._accept(attempt, local)
        self._report(attempt, origins, time.monotonic() - started)
        return restored

    @timing.timed("memory_agree")
    def _agree(self, attempt: _Attempt) -> dict[str, int] | None:
        """How many slots came from each origin, over every rank, when every rank
        loaded; else None, and rank 0 warns about the first failure."""
        mine = (attempt.failure, sorted(f.origin for f in attempt.fetched.values()))
        gathered = self._group.all_gather(mine, "agreeing on the memory restore")
        failures = [(r, failure) for r, (failure, _) in enumerate(gathered) if failure]
        if failures:
            if self._group.rank == 0:
                log.warning("Rank 0 cannot restore %s in round %d (rank %d: %s); restoring "
                            "from disk instead.", attempt.choice.label, self._round,
                            *failures[0])
            return None
        counts: dict[str, int] = {}
        for _, origins in gathered:
            for origin in origins:
                counts[origin] = counts.get(origin, 0) + 1
        return counts

    @timing.timed("memory_choose")
    def _choose(self, commit_log: CommitLog) -> _Attempt:
        """Step 1 of the module docstring: the inventory, gathered, and the choice."""
        # Tensor items are read only for the slots this rank uses (below).
        slots = layout.list_slots(self.memory_dir, tensors=False)
        disk: DiskLatest | None | str = None
        if self._group.rank == 0:
            try:
                latest = commit_log.latest()
                disk = DiskLatest(latest.step, latest.round) if latest is not None else None
            except Exception as exc:  # noqa: BLE001 - the disk restore reports it
                disk = f"the commit log cannot be read: {describe_failure(exc)}"
        seen = [SlotSeen(self._group.rank, s.key, s.manifest.step, s.manifest.world_size)
                for s in slots]
        gathered = self._group.all_gather((seen, disk, self._node_id),
                                          "listing memory snapshots")
        disk = gathered[0][1]
        if isinstance(disk, str):
            return _Attempt(Choice(DISK, disk), {})
        choice = choose([s for ranks, _, _ in gathered for s in ranks], disk)
        held = {}
        if choice.source == MEMORY:
            for slot in slots:
                keys = choice.holders.get(slot.key.rank, {})
                if keys.get(self._group.rank) == slot.key and slot.key.rank not in held:
                    held[slot.key.rank] = slot
        here = sum(1 for _, _, node in gathered if node == self._node_id)
        return _Attempt(choice, held, threads=copy_threads(here))

    def _in_full(self, attempt: _Attempt, ranks: Iterable[int]) -> dict[int, layout.SlotInfo]:
        """The held slots of ``ranks`` read in full (the listing skipped their tensor
        items); a slot that changed since it was listed, or is damaged, fails the attempt."""
        found = {}
        for rank in ranks:
            if rank in attempt.in_full:
                found[rank] = attempt.held[rank]
                continue
            full = layout.with_tensors(attempt.held[rank])
            if full is None:
                attempt.failure = attempt.failure or (
                    f"the slot {attempt.held[rank].key.name} on this node changed or is damaged")
            else:
                found[rank] = attempt.held[rank] = full
                attempt.in_full.add(rank)
        return found

    @timing.timed("memory_bring")
    def _bring(self, attempt: _Attempt) -> None:
        """Step 2: open the needed slots held here, receive the others, send what
        peers need. Every rank runs every collective, failed or not."""
        choice = attempt.choice
        same_world = choice.world_size == self._group.size
        manifests: dict[int, layout.Manifest] = {}
        if not same_world:
            mine = {r: s.manifest for r, s in self._in_full(
                attempt, [r for r in attempt.held if min(choice.holders[r]) == self._group.rank]
            ).items()}
            for part in self._group.all_gather(mine, "gathering memory snapshot manifests"):
                manifests.update(part)
        needs: set[int] = {self._group.rank} if same_world else set()
        if not same_world:
            try:
                attempt.tensors = state.collect(self._chunks)
                attempt.planned = PlannedLoad(attempt.tensors.state_dict, manifests,
                                              LoadPlanner(policy=self._policy))
                needs = attempt.planned.ranks(prefer=attempt.held) | {0}
            except CheckpointError as exc:
                attempt.failure = str(exc)
        every = ([[r] for r in range(self._group.size)] if same_world else
                 self._group.all_gather(sorted(needs), "planning the memory restore"))
        plan = plan_transfers(dict(enumerate(every)), choice.holders)
        expected = {r: (choice.round, choice.step) for r in range(choice.world_size)}
        received, problems = exchange(self._group, plan, attempt.held, expected)
        attempt.fetched.update(received)
        try:
            local = needs - set(received)
            full = self._in_full(attempt, local & set(attempt.held))
            for rank in local:
                attempt.fetched[rank] = open_local(full[rank])
        except (OSError, KeyError) as exc:
            problems.append(f"cannot open a slot held on this node: {exc!r}")
        attempt.failure = attempt.failure or "; ".join(problems)
        attempt.manifests = manifests

    @timing.timed("memory_load")
    def _load(self, attempt: _Attempt) -> Any:
        """Step 3; returns the ``local.pt`` record to restore, or None with
        ``attempt.failure`` set."""
        choice = attempt.choice
        same_world = choice.world_size == self._group.size
        rank = self._group.rank
        try:
            tensors = attempt.tensors or state.collect(self._chunks)
            if same_world:
                copy_slot(tensors.state_dict, attempt.fetched[rank].slot, self._policy,
                          self._shards, attempt.threads)
            else:
                self._reshard(tensors.state_dict, attempt)
            state.apply(self._chunks, tensors)
            source = attempt.fetched[rank if same_world else 0]
            local = state.load_local(source.local, self._policy,
                                     f"{layout.LOCAL} of old rank {source.slot.manifest.rank}")
            changed = [r for r, f in attempt.fetched.items() if not unchanged(f)]
            if changed:
                raise CheckpointError(f"the slots of old rank(s) {changed} were rewritten "
                                      f"while they were read")
            return local
        except Exception as exc:  # noqa: BLE001 - gathered: every rank falls back together
            attempt.failure = f"loading {choice.label} failed: {describe_failure(exc)}"
            return None

    def _reshard(self, state_dict: dict[str, Any], attempt: _Attempt) -> None:
        """The planned load (step 2), from the slots now here; the non-tensor
        values set as :func:`copy_slot` sets them (no pickling round trip each)."""
        assert attempt.planned is not None  # planned in _bring, or failed there
        sources = {r: attempt.fetched[r].slot if r in attempt.fetched else SlotData(m)
                   for r, m in attempt.manifests.items()}
        put_objects(state_dict, attempt.planned.run(sources, self._policy, attempt.threads))

    def _accept(self, attempt: _Attempt, local: Any) -> Restored:
        """Step 4: schedulers and RNGs, as the disk restore does. Raises
        CheckpointError when the schedulers do not take their state."""
        choice = attempt.choice
        try:
            state.restore_schedulers(self._schedulers, local["schedulers"])
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            raise CheckpointError(f"rank {self._group.rank}: restoring {choice.label} failed: "
                                  f"{describe_failure(exc)}") from exc
        if choice.world_size == self._group.size:
            state.restore_rng(local["rng"])
        else:
            state.seed_rng(state.derived_seed(local["seed_base"], choice.step, self._group.rank))
        size = sum(f.slot.manifest.nbytes for f in attempt.fetched.values())
        return Restored(step=choice.step, path=choice.label, size_bytes=size,
                        data_state=local["data_state"], extras=local["extras"])

    def _report(self, attempt: _Attempt, counts: dict[str, int], seconds: float) -> None:
        """Rank 0 says, in one line, where the shards came from and how long it took."""
        choice = attempt.choice
        log.log(self._group.news_level, "Rank 0 restored %s (%d ranks) with %d ranks in round %d "
                "in %.3f s: slots from own memory %d, replicas %d, sent by peers %d; resuming at "
                "step %d.", choice.label, choice.world_size, self._group.size, self._round,
                seconds, counts.get("own", 0), counts.get("replica", 0), counts.get("peer", 0),
                choice.step + 1)


def copy_slot(state_dict: dict[str, Any], slot: SlotData, policy: trust.LoadPolicy,
              chunks: dict | None = None, threads: int = 1) -> None:
    """Fill ``state_dict`` (this rank's live state) from its own old rank's slot:
    each tensor's bytes read from the slot into the tensor (one copy, batched
    for a slot file and read by ``threads`` threads: :class:`~.slotfile.SlotFile`),
    each other value set from ``objects.pt``. Raises CheckpointError when the
    slot does not hold exactly this state (a key missing or extra, another
    dtype, shape or chunk)."""
    live = plan_slot(state_dict, chunks)
    saved = {item.fqn: item for item in slot.manifest.tensors}
    if set(saved) != {item.fqn for item in live.items} or \
            set(slot.manifest.objects) != set(live.objects):
        missing = sorted(({i.fqn for i in live.items} | set(live.objects))
                         - set(saved) - set(slot.manifest.objects))
        raise CheckpointError(f"the snapshot holds other keys than this rank's state "
                              f"(e.g. missing {missing[:3]})")
    from_file = isinstance(slot.data, SlotFile)
    direct: list[tuple[int, torch.Tensor]] = []
    data: torch.Tensor | None = None
    with torch.no_grad():
        for item, tensor in zip(live.items, live.tensors):
            found = saved[item.fqn]
            if (found.dtype, found.shape, found.offsets, found.global_shape, found.nbytes) != \
                    (item.dtype, item.shape, item.offsets, item.global_shape, item.nbytes):
                raise CheckpointError(f"{item.fqn} is {found.dtype} {found.shape} at "
                                      f"{found.offsets} ({found.nbytes} bytes) in the snapshot, "
                                      f"{item.dtype} {item.shape} at {item.offsets} here")
            local = local_tensor(tensor)
            if from_file and fillable(local):
                direct.append((found.offset, local))
                continue
            if data is None:
                data = byte_tensor(slot)
            raw = data[found.offset:found.offset + found.nbytes]
            local.copy_(raw.view(dtype_of(found.dtype)).view(found.shape))
    if direct:
        slot.data.read_into(direct, threads)
    put_objects(state_dict, load_objects(slot.objects, policy, f"{layout.OBJECTS} of old "
                                                              f"rank {slot.manifest.rank}"))
