"""Resharding from memory: FSDP2 model and optimizer state of 2 ranks, snapshotted into
memory-tier slots (data.bin, objects.pt, manifest.json per rank), loads through
``MemoryStorageReader`` into 1 rank and into 3 ranks, bitwise equal to the full
tensors saved; each rank maps only the old slots ``needed_ranks`` names.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.checkpointing import Worker, fsdp2_on_cpu, run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Rows of the two Linear layers' weights: uneven shards at world sizes 2 and 3.
ROWS = (18, 7)


def _fsdp_model(w: Worker, seed: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, ROWS[0]), nn.ReLU(), nn.Linear(ROWS[0], ROWS[1]))
    mesh = init_device_mesh("cpu", (w.world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _flat(model, opt) -> dict:
    """The checkpoint's state dict (``state.collect``), keyed as DCP flattens it."""
    from elastic.checkpoint import state

    collected = state.collect(state.make_chunks(model, opt)).state_dict
    return {f"{group}.{key}": value for group, values in collected.items()
            for key, value in values.items()}


def _full(value):
    """A value as a whole (a DTensor gathered: a collective, same order on every rank)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def task_snapshot(w: Worker, workdir):
    """Train, then write this rank's slot and (rank 0) the full state to compare with."""
    import torch

    from elastic.checkpoint.memory import layout
    from tests.unit.test_memory_reader import write_slot

    model, opt = _fsdp_model(w, seed=0)
    w.train(model, opt, steps=2, in_features=8)
    flat = _flat(model, opt)
    slot = write_slot(w.rank, w.world_size, flat)
    directory = os.path.join(workdir, f"slot-{w.rank}")
    os.makedirs(directory)
    for name, content in ((layout.DATA, slot.data), (layout.OBJECTS, slot.objects),
                          (layout.MANIFEST, slot.manifest.to_json())):
        with open(os.path.join(directory, name), "wb") as f:
            f.write(content)
    full = {key: _full(value) for key, value in flat.items()}
    if w.rank == 0:
        torch.save(full, os.path.join(workdir, "full.pt"))
    return sorted(flat)


def task_restore(w: Worker, workdir, old_world: int, collectives: bool):
    """A fresh model at this world size, loaded from the slots of the ranks that
    ``needed_ranks`` names (the others given as manifests only), then put into the
    live model and optimizer; the keys whose full value differs from the saved one.
    Without ``collectives`` each rank's ``dcp.load`` plans alone (``no_dist``): a
    load from memory needs no global plan."""
    import mmap

    import torch
    import torch.distributed.checkpoint as dcp

    from elastic._compat import torch_checkpoint as compat
    from elastic.checkpoint import dcp_io, state
    from elastic.checkpoint.memory import layout
    from elastic.checkpoint.memory.reader import MemoryStorageReader, SlotData, needed_ranks
    from tests.unit.test_memory_reader import same_bits

    model, opt = _fsdp_model(w, seed=4242)
    chunks = state.make_chunks(model, opt)
    tensors = state.collect(chunks)
    paths = [os.path.join(workdir, f"slot-{r}") for r in range(old_world)]
    manifests = {}
    for rank, path in enumerate(paths):
        with open(os.path.join(path, layout.MANIFEST), "rb") as f:
            manifests[rank] = layout.Manifest.from_json(f.read())
    needed = needed_ranks(tensors.state_dict, manifests)
    sources, files = {}, []
    for rank, path in enumerate(paths):
        if rank not in needed:
            sources[rank] = SlotData(manifests[rank])
            continue
        files.append(open(os.path.join(path, layout.DATA), "rb"))
        with open(os.path.join(path, layout.OBJECTS), "rb") as f:
            objects = f.read()
        data = mmap.mmap(files[-1].fileno(), 0, access=mmap.ACCESS_READ)
        sources[rank] = SlotData(manifests[rank], data, objects)
    dcp.load(tensors.state_dict, storage_reader=MemoryStorageReader(sources),
             planner=dcp_io.LoadPlanner(), **compat.single_process(not collectives))
    state.apply(chunks, tensors)
    saved = torch.load(os.path.join(workdir, "full.pt"), weights_only=True)
    live = {key: _full(value) for key, value in _flat(model, opt).items()}
    differ = sorted(key for key in saved if key not in live or not (
        same_bits(live[key], saved[key]) if isinstance(saved[key], torch.Tensor)
        else live[key] == saved[key]))
    for source in sources.values():
        if source.data is not None:
            source.data.close()
    for f in files:
        f.close()
    return {"needed": sorted(needed), "differ": differ, "keys": sorted(live)}


@fsdp2_on_cpu
def test_fsdp2_state_of_2_ranks_reshards_from_memory_into_1_and_3_ranks(tmp_path):
    workdir = str(tmp_path)
    keys = run(tmp_path, 2, {"task": task_snapshot, "workdir": workdir})[0]
    assert any(".exp_avg_sq" in key for key in keys) and any(".lr" in key for key in keys)
    one = run(tmp_path, 1, {"task": task_restore, "workdir": workdir, "old_world": 2,
                            "collectives": True})
    three = run(tmp_path, 3, {"task": task_restore, "workdir": workdir, "old_world": 2,
                              "collectives": False})
    for rank in one + three:
        assert rank["differ"] == [] and rank["keys"] == keys
    assert [rank["needed"] for rank in one] == [[0, 1]]
    # New shards of 18 rows: 0-5, 6-11, 12-17 (old: 0-8, 9-17); of 7 rows: 0-2, 3-5, 6.
    assert [rank["needed"] for rank in three] == [[0], [0, 1], [1]]
