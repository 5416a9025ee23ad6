"""Taking a save's snapshot of the training state: at once, or copied in the background.

A synchronous save writes from the live tensors, which stay still because the
caller blocks until the save is done. An async save copies at ``save()`` only
what forward and backward may change (buffers, non-tensor values) and leaves
the parameters and the optimizer state, with their in-place counters
(``_version``), to :meth:`SnapshotTaker.complete` in the background thread,
ordered after what the caller's CUDA stream had queued when ``save()`` was
called. A step pre-hook on every optimizer makes ``optimizer.step()`` wait for
that copy; a tensor changed in place by anything else fails the save.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Sequence

import torch

from elastic.checkpoint import state
from elastic.checkpoint.environment import SavingNotice
from elastic.checkpoint.group import CheckpointGroup
from elastic.checkpoint.staging import Stager, local_tensor
from elastic.errors import CheckpointError
from elastic.failpoints import failpoint

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Pending:
    """An async save's copy still to make in the background."""

    later: dict[str, dict[str, Any]]  # live parameters and optimizer state, by group
    queued: Any                       # a CUDA event after the caller's queued work, or None
    now: dict[str, Any]               # the rest, copied in save()
    order: dict[str, list[str] | None]  # the state dict's keys per group (None: not a dict)
    versions: list[tuple[str, Any, int]]  # (name, live tensor, _version at save())


@dataclasses.dataclass
class Snapshot:
    """What one save writes: the tensors' state dict and this rank's other state."""

    step: int
    state_dict: dict[str, Any]  # a CPU copy owned by the save (async), or the live state
    local: bytes                # this rank's serialized non-tensor state
    nbytes: int
    started_at: float = 0.0     # monotonic, when save() began taking it
    pending: Pending | None = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)


def split_state(state_dict: dict[str, Any], parameters: set[int]
                ) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``(later, now)``: parameters and optimizer-state tensors, which only
    ``optimizer.step()`` changes, and everything else (buffers, which forward
    changes, and non-tensor values). ``parameters``: the data pointers of the
    model's parameters."""
    later: dict[str, dict[str, Any]] = {}
    now: dict[str, Any] = {}
    for group, values in state_dict.items():
        if not isinstance(values, dict):
            now[group] = values
            continue
        later[group], now[group] = {}, {}
        for key, value in values.items():
            late = isinstance(value, torch.Tensor) and (
                group == "optim" or local_tensor(value).data_ptr() in parameters)
            (later if late else now)[group][key] = value
    return later, now


class SnapshotTaker:
    """Takes snapshots of ``chunks`` and ``schedulers`` for saves; holds each
    optimizer's ``step()`` until the background copy of the last async snapshot
    is done (a step pre-hook, removed by :meth:`close`)."""

    def __init__(self, chunks: Sequence[state.Chunk], schedulers: Sequence[Any],
                 stager: Stager, group: CheckpointGroup, round_: int, notice: SavingNotice):
        self._chunks = chunks
        self._schedulers = schedulers
        self._stager = stager
        self._group = group
        self._round = round_
        self._notice = notice
        self._copying: threading.Event | None = None  # set once the async copy is done
        self._hooks = [opt.register_step_pre_hook(self._before_step)
                       for opt in dict.fromkeys(o for c in chunks for o in c.optimizers)]

    def take(self, step: int, data_state: Any, extras: Any, copy: bool) -> Snapshot:
        """The state to save as of ``step``, announced to the saving hook (which
        hears 0 again if this raises). ``copy`` (async): buffers and non-tensors
        are copied now, the rest is left pending for :meth:`complete`, and the
        next ``optimizer.step()`` waits for it; otherwise the live tensors, and
        the snapshot is ready at once. Raises what collecting the state raises."""
        tensors = state.collect(self._chunks)
        nbytes = state.local_nbytes(tensors.state_dict)
        self._notice.started(nbytes)
        try:
            started = time.monotonic()
            local = state.capture_local(step=step, rank=self._group.rank,
                                        world_size=self._group.size, schedulers=self._schedulers,
                                        data_state=data_state, extras=extras)
            snapshot = Snapshot(step=step, state_dict=tensors.state_dict, local=local,
                                nbytes=nbytes, started_at=started)
            if copy:
                snapshot.pending = self._pending(tensors.state_dict)
                snapshot.state_dict = {}
                self._copying = snapshot.ready
            else:
                snapshot.ready.set()
        except BaseException:
            self._notice.ended()
            raise
        log.debug("Rank %d took %d bytes for checkpoint step %d of round %d in %.3f s.",
                  self._group.rank, nbytes, step, self._round, time.monotonic() - started)
        return snapshot

    def _pending(self, state_dict: dict[str, Any]) -> Pending:
        """Copy the early part now (the stager keeps its buffers for the next save,
        so this is one copy of the shard, allocated once); leave the rest."""
        later, now = split_state(state_dict, self._parameter_pointers())
        queued = self._stager.mark()
        return Pending(
            later=later, queued=queued,
            now=self._stager.stage(now, after=queued, prefix=("now",)),
            order={group: list(values) if isinstance(values, dict) else None
                   for group, values in state_dict.items()},
            versions=[(f"{group}.{key}", tensor, tensor._version)
                      for group, values in later.items() for key, tensor in values.items()])

    def complete(self, snapshot: Snapshot) -> None:
        """Background, first thing of an async save: copy the parameters and the
        optimizer state, then check that nothing but the copy touched them.
        Always marks the snapshot ready. Raises CheckpointError when a tensor was
        modified in place meanwhile (the copy may be torn)."""
        try:
            pending = snapshot.pending
            if pending is None:
                return
            snapshot.pending = None  # no reference to live tensors beyond this call
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
            snapshot.state_dict = _merged(pending, copied)
        finally:
            snapshot.ready.set()

    def close(self) -> None:
        """Remove the optimizers' step pre-hooks."""
        for hook in self._hooks:
            hook.remove()

    def _parameter_pointers(self) -> set[int]:
        return {local_tensor(p).data_ptr() for chunk in self._chunks
                for p in chunk.model.parameters()}

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: the step changes what the background copy reads; wait for it."""
        ready = self._copying
        if ready is not None:
            ready.wait()
            self._copying = None


def _merged(pending: Pending, copied: dict[str, Any]) -> dict[str, Any]:
    """The state dict in its own key order, from the early and the late copies."""
    merged: dict[str, Any] = {}
    for group, keys in pending.order.items():
        if keys is None:
            merged[group] = pending.now[group]
            continue
        done, early = copied.get(group, {}), pending.now.get(group, {})
        merged[group] = {key: done[key] if key in done else early[key] for key in keys}
    return merged
