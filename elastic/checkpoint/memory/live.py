"""The state a snapshot copies, collected once and reused while the live objects keep their tensors.

Collecting the state through DCP's helpers (:func:`elastic.checkpoint.state.collect`)
costs about 0.4 ms even for a small model, most of a snapshot's cost at a short
step. Between steps an optimizer updates parameters and its state in place, so
the tensors of one collection are still the state's tensors at the next step.
:class:`LiveState` collects once, lays the state out once
(:func:`~elastic.checkpoint.memory.items.plan_slot`) and, at each snapshot,
reuses that plan when the *fingerprint* of the live objects is unchanged, else
collects again.

The rules:

* **The fingerprint** (:func:`fingerprint`) covers everything a collection's
  tensors come from: every parameter and buffer of each model chunk, and of
  each optimizer its ``param_groups`` (each group, its parameter list and its
  tensor values) and its ``state`` (each parameter's state dict, nested dicts
  included, its keys and its tensors). A tensor counts by its object and, for
  its bytes, where they lie and their shape (a DTensor: its local shard's), so
  a tensor replaced, a ``.data`` swapped or resized, optimizer state appearing
  or removed, a parameter group added or changed in its parameters all change
  it. The objects it names are kept referenced, so their ids are not reused.
* **Values that are not tensors** (hyperparameters that a scheduler sets every
  step, an int step) are read again at every snapshot from the dict they came
  from, each dict entry once (a group's options are the values of every one
  of its parameters' names); while they pickle to the same bytes, the plan
  keeps the objects' dict and a key (:attr:`SlotPlan.objects_key`) that the
  writer compares instead of the objects.
* **No reuse at all**, a full collection at every snapshot, when a collection
  cannot be explained by the live objects: a model tensor whose bytes are not
  a live parameter's or buffer's (a copy made by a state-dict hook), a model
  value that is not a tensor (a module's extra state), or an optimizer value
  that is not the very object of the optimizer's state or groups in DCP's order
  (a state-dict hook, another flattening). Correct always; only the saving is lost.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Sequence

import torch

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import state
from elastic.checkpoint.memory.items import SlotPlan, plan_slot
from elastic.checkpoint.staging import local_tensor

# Where a non-tensor value is read from at each snapshot: (container, key).
Source = tuple[Any, Any]


@dataclasses.dataclass
class _Reuse:
    plan: SlotPlan
    sources: dict[str, Source]  # the plan's objects, by name
    fingerprint: list
    pinned: list  # the objects the fingerprint names by id, kept alive
    distinct: list[Source] = dataclasses.field(default_factory=list)  # each source once
    layout: tuple = ()  # (the objects' names, the index in distinct of each)
    last: tuple[bytes, dict[str, Any]] | None = None  # (pickle of the values, the objects)

    def __post_init__(self) -> None:
        # A group's options are one source for all its parameters' names: read once.
        index: dict[tuple[int, Any], int] = {}
        slots = []
        for container, key in self.sources.values():
            at = index.setdefault((id(container), key), len(self.distinct))
            if at == len(self.distinct):
                self.distinct.append((container, key))
            slots.append(at)
        self.layout = (tuple(self.sources), tuple(slots))

    def objects(self) -> tuple[dict[str, Any], tuple | None]:
        """The objects as of now, and their key for :class:`SlotPlan`: the last
        dict again while the values pickle to the same bytes."""
        values = [container[key] for container, key in self.distinct]
        try:
            pickled = pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - what cannot be pickled is never reused
            pickled = None
        if pickled is not None and self.last is not None and self.last[0] == pickled:
            return self.last[1], (*self.layout, pickled)
        names, slots = self.layout
        objects = {name: values[at] for name, at in zip(names, slots)}
        self.last = None if pickled is None else (pickled, objects)
        return objects, None if pickled is None else (*self.layout, pickled)


class LiveState:
    """The :class:`SlotPlan` of ``chunks``' state for the next snapshot.
    ``collect`` is the full collection (a test may count its calls); ``chunk_cache``
    the DTensor chunks remembered between layouts (:func:`plan_slot`)."""

    def __init__(self, chunks: Sequence[state.Chunk],
                 collect: Callable[[Sequence[state.Chunk]], state.TensorState] = state.collect):
        self._chunks = chunks
        self._collect = collect
        self._chunk_cache: dict = {}
        self._reuse: _Reuse | None = None
        self.collections = 0  # full collections so far

    def plan(self) -> SlotPlan:
        """The state as of now, laid out: the kept plan with its non-tensor values
        read afresh when the fingerprint is unchanged, else a new collection.
        Raises what :func:`state.collect` and :func:`plan_slot` raise."""
        reuse = self._reuse
        if reuse is not None:
            if fingerprint(self._chunks, []) == reuse.fingerprint:
                kept = reuse.plan
                objects, key = reuse.objects()
                return SlotPlan(kept.items, kept.tensors, objects, kept.data_bytes, key)
        self._reuse = None
        collected = self._collect(self._chunks)
        self.collections += 1
        plan = plan_slot(collected.state_dict, self._chunk_cache)
        sources = explain(self._chunks, collected.state_dict)
        if sources is not None:
            pinned = []
            self._reuse = _Reuse(plan, sources, fingerprint(self._chunks, pinned), pinned)
        return plan


def fingerprint(chunks: Sequence[state.Chunk], pinned: list) -> list:
    """What must stay equal for a collection of ``chunks`` to hold the same
    tensors (the module docstring's rule), as ids, keys, data pointers and
    shapes; the objects named by id are appended to ``pinned``."""
    out: list = []
    for chunk in chunks:
        for tensor in compat.module_tensors(chunk.model):
            _tensor(tensor, out, pinned)
        out.append(None)
        for optimizer in chunk.optimizers:
            groups = optimizer.param_groups
            pinned.append(groups)
            out += (id(groups), len(groups))
            for group in groups:
                params = group["params"]
                pinned += (group, params, *params)
                out += (id(group), id(params), len(params), len(group))
                out += map(id, params)  # their bytes: the model's parameters above
                for key, value in group.items():
                    if isinstance(value, torch.Tensor):
                        out.append(key)
                        _tensor(value, out, pinned)
            states = optimizer.state
            pinned.append(states)
            out += (id(states), len(states))
            for param, param_state in states.items():
                pinned.append(param)
                out.append(id(param))
                _nested(param_state, out, pinned)
    return out


def _nested(values: Any, out: list, pinned: list) -> None:
    if not isinstance(values, dict):
        out.append(type(values))
        return
    pinned.append(values)
    out += (id(values), len(values))
    for key, value in values.items():
        out.append(key)
        if isinstance(value, torch.Tensor):
            _tensor(value, out, pinned)
        elif isinstance(value, dict):
            _nested(value, out, pinned)


def _tensor(tensor: torch.Tensor, out: list, pinned: list) -> None:
    pinned.append(tensor)
    local = local_tensor(tensor)  # _bytes_of, inlined: a snapshot calls this for every tensor
    out += (id(tensor), local.data_ptr(), local.shape, local.dtype)


def explain(chunks: Sequence[state.Chunk], state_dict: dict[str, Any]
            ) -> dict[str, Source] | None:
    """Where each non-tensor value of a collection (``state_dict``, from
    :func:`state.collect`) is read at the next snapshots, by its slot name; None
    when the collection cannot be reused (the module docstring's rule)."""
    live = set()
    for chunk in chunks:
        for tensor in (*chunk.model.parameters(), *chunk.model.buffers()):
            live.add(_bytes_of(tensor))
    for value in state_dict["model"].values():
        if not isinstance(value, torch.Tensor) or _bytes_of(value) not in live:
            return None
    expected = _optimizer_sources(chunks)
    flat = state_dict["optim"]
    if len(expected) != len(flat):
        return None
    sources = {}
    for (key, value), (suffix, container, name) in zip(flat.items(), expected):
        if value is not container[name] or not key.endswith(suffix):
            return None
        if not isinstance(value, torch.Tensor):
            sources[f"optim.{key}"] = (container, name)
    return sources


def _bytes_of(tensor: torch.Tensor) -> tuple:
    local = local_tensor(tensor)
    return local.data_ptr(), local.shape, local.dtype


def _optimizer_sources(chunks: Sequence[state.Chunk]) -> list[tuple[str, Any, Any]]:
    """Each value of DCP's flattened optimizer state, in its order, as (the end
    of its key, its container, its key there): per chunk, every optimizer's
    state (nested dicts flattened with dots), then every optimizer's groups,
    each group's options once per parameter."""
    out: list[tuple[str, Any, Any]] = []
    for chunk in chunks:
        for optimizer in chunk.optimizers:
            for param_state in optimizer.state.values():
                _leaves(param_state, "", out)
        for optimizer in chunk.optimizers:
            for group in optimizer.param_groups:
                for _ in group["params"]:
                    out += [(f".{key}", group, key) for key in group if key != "params"]
    return out


def _leaves(values: dict, prefix: str, out: list) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _leaves(value, f"{prefix}.{key}", out)
        else:
            out.append((f"{prefix}.{key}", values, key))
