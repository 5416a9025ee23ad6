"""Where each tensor of a rank's state lies in its slot's ``data.bin``, and what is not a tensor.

The state dict is the checkpoint's (:func:`elastic.checkpoint.state.collect`:
``{"model": {fqn: ...}, "optim": {key: ...}}``); an item's name is DCP's
flattened key for it (``model.<fqn>``, ``optim.state.<fqn>.<name>``), so a DCP
storage reader over the memory tier finds it under the name a load asks for.
A DTensor's item is this rank's chunk of the global tensor (its offsets and
shape, from DTensor's chunk list, the one DCP's planner uses); a plain tensor's
is the whole tensor. Tensor bytes start on :data:`ALIGN`-byte boundaries so
that each can be viewed in place with its own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from elastic.checkpoint.memory.layout import TensorItem
from elastic.checkpoint.staging import local_tensor
from elastic.errors import CheckpointError

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class SlotPlan:
    """A state dict laid out for a slot: ``items`` (with ``tensors``, the live
    tensors in the same order), ``objects`` (the non-tensor values by name),
    ``data_bytes`` (the size of ``data.bin``). ``objects_key``, when the maker
    has one: a tuple whose first item is the objects' names, equal for two
    plans only when their objects are (pickle to the same bytes), so that a
    writer compares it rather than the objects."""

    items: tuple[TensorItem, ...]
    tensors: tuple[torch.Tensor, ...]
    objects: dict[str, Any]
    data_bytes: int
    objects_key: tuple | None = None

    @property
    def signature(self) -> tuple:
        """What must stay equal for a slot's ``data.bin`` to be reused as it is."""
        return tuple((i.fqn, i.dtype, i.shape, i.offset) for i in self.items)


def plan_slot(state_dict: dict[str, Any], chunks: dict | None = None) -> SlotPlan:
    """Lay out ``state_dict``'s tensors in ``data.bin``, in its order. ``chunks``:
    a dict kept between calls by the caller, where DTensors' chunks are
    remembered (computing one costs tens of microseconds, a snapshot has
    hundreds). Raises CheckpointError for a DTensor whose chunk cannot be described."""
    items, tensors, objects = [], [], {}
    offset = 0
    for group, values in state_dict.items():
        if not isinstance(values, dict):
            objects[group] = values
            continue
        for key, value in values.items():
            name = f"{group}.{key}"
            if not isinstance(value, torch.Tensor):
                objects[name] = value
                continue
            local = local_tensor(value)
            offsets, global_shape = chunk_of(value, name, chunks)
            nbytes = local.numel() * local.element_size()
            items.append(TensorItem(name, dtype_name(local.dtype), global_shape, offsets,
                                    tuple(local.shape), offset, nbytes))
            tensors.append(value)
            offset += -(-nbytes // ALIGN) * ALIGN
    return SlotPlan(tuple(items), tuple(tensors), objects, offset)


def chunk_of(tensor: torch.Tensor, name: str, chunks: dict | None = None
             ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, global shape)`` of this rank's part of ``tensor`` (remembered in
    ``chunks`` by what determines it: shapes, placements and mesh)."""
    global_shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return (0,) * len(global_shape), global_shape
    local_shape = tuple(tensor.to_local().shape)
    if chunks is None:
        return _dtensor_chunk(tensor, name, global_shape, local_shape)
    key = (global_shape, local_shape, tuple(tensor.placements), tensor.device_mesh)
    found = chunks.get(key)
    if found is None:
        found = chunks[key] = _dtensor_chunk(tensor, name, global_shape, local_shape)
    return found


def _dtensor_chunk(tensor: DTensor, name: str, global_shape: tuple[int, ...],
                   local_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    chunks = getattr(tensor, "__create_chunk_list__", None)
    if chunks is not None:
        found = chunks()
        if len(found) == 1 and tuple(found[0].sizes) == local_shape:
            return tuple(found[0].offsets), global_shape
    if local_shape == global_shape:  # replicated
        return (0,) * len(global_shape), global_shape
    raise CheckpointError(f"cannot tell where this rank's shard of {name} (placements "
                          f"{tensor.placements}) lies in the whole tensor")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a manifest names; raises CheckpointError for another name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a memory snapshot names dtype {name[:40]!r}, not a torch dtype")
    return dtype
