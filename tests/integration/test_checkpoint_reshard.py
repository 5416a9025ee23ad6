"""Resharding on restore: FSDP2 state saved by 2 ranks loads into 1 and 3 ranks (and
the one rank checks the CRC-32 of the other rank's items it reads); pipeline stages,
keyed by fully qualified names, saved by 2 ranks load into 1 and back.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.checkpointing import Worker, fingerprint, fsdp2_on_cpu, launch, run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def task_fsdp(w: Worker, root, save, saves: int = 1):
    """Restore, then (``save``) train and save ``saves`` steps, 1 to ``saves``; the
    full state as a fingerprint per key, after each save (``full_at``) and at the end."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if save else 4242)
    # 7 output rows: shards of uneven size at world sizes 2 and 3
    model = nn.Sequential(nn.Linear(8, 18), nn.ReLU(), nn.Linear(18, 7))
    mesh = init_device_mesh("cpu", (w.world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ckpt = w.checkpointer(root, model, opt)
    start = ckpt.restore()
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)

    def fingerprints() -> dict:
        state = {**{f"model.{k}": v
                    for k, v in get_model_state_dict(model, options=full).items()},
                 **{f"optim.{k}": v for k, v in
                    get_optimizer_state_dict(model, opt, options=full).items()}}
        return {k: fingerprint(v) for k, v in state.items()}

    full_at = {}
    for step in range(1, saves + 1) if save else ():
        torch.manual_seed(step + w.rank)
        w.train(model, opt, steps=2, in_features=8)
        ckpt.save(step, async_=True)
        full_at[step] = fingerprints()
    ckpt.close()
    return {"start": start, "full": fingerprints(), "full_at": full_at}


@fsdp2_on_cpu
def test_fsdp2_reshards_from_2_to_1_and_3_ranks(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": task_fsdp, "root": root, "save": True})
    assert saved[0]["start"] == 0 and saved[0]["full"] == saved[1]["full"]
    loaded = (run(tmp_path, 1, {"task": task_fsdp, "root": root, "save": False})
              + run(tmp_path, 3, {"task": task_fsdp, "root": root, "save": False}))
    assert len(loaded) == 4
    for rank in loaded:
        assert rank["start"] == 2
        assert rank["full"] == saved[0]["full"]


@fsdp2_on_cpu
def test_fsdp_restore_with_resharding_checks_the_items_it_reads(tmp_path):
    """Saved by 2 ranks, loaded by 1: the one rank reads rank 1's items too, and a byte
    flipped inside one of them (the file's size unchanged) is caught as it is read."""
    from elastic.checkpoint import layout

    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": task_fsdp, "root": root, "save": True, "saves": 2})
    directory = os.path.join(root, "step-000000000002")
    manifests, problems = layout.read_manifests(directory)
    assert problems == []
    shard = os.path.join(directory, "__1_0.distcp")
    item = max(manifests[1].files["__1_0.distcp"].items, key=lambda i: i.length)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.seek(item.offset + item.length // 2)
        byte = f.read(1)[0]
        f.seek(item.offset + item.length // 2)
        f.write(bytes([byte ^ 0x08]))
    assert os.path.getsize(shard) == size

    ranks = launch(tmp_path, 1, [{"id": "load", "task": task_fsdp, "root": root, "save": False}])
    loaded = ranks[0].results["load"]
    assert loaded["start"] == 2, "the damaged step 2 was loaded"
    assert loaded["full"] == saved[0]["full_at"]["1"]
    warnings = [line for line in ranks[0].stderr.splitlines()
                if line.startswith("WARNING") and shard in line]
    assert warnings and "corrupt: CRC-32" in warnings[0], ranks[0].stderr[-3000:]
    assert f"bytes {item.offset}..{item.offset + item.length} (one item)" in warnings[0]


def task_pipeline(w: Worker, root, chunks_per_rank, save):
    """Stages are copies of one model that keep only their layers, so FQNs are
    global; rank r owns stages r*c .. r*c+c-1 of world_size*c stages, each with its
    own optimizer and scheduler."""
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_optimizer_state_dict)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            for layer in self.layers.values():
                x = torch.tanh(layer(x))
            return self.head(x) if self.head is not None else x

    stages = w.world_size * chunks_per_rank
    chunks, opts, scheds = [], [], []
    for stage in range(w.rank * chunks_per_rank, (w.rank + 1) * chunks_per_rank):
        torch.manual_seed(3 if save else 333)
        chunk = Net()
        for i in range(4):
            if i * stages // 4 != stage:
                del chunk.layers[str(i)]
        if stage != stages - 1:
            chunk.head = None
        chunks.append(chunk)
        opts.append(torch.optim.AdamW(chunk.parameters(), lr=0.02))
        scheds.append(torch.optim.lr_scheduler.StepLR(opts[-1], step_size=1, gamma=0.9))
    ckpt = w.checkpointer(root, chunks, opts, scheds)
    start = ckpt.restore()
    if save:
        torch.manual_seed(5 + w.rank)
        for chunk, opt, sched in zip(chunks, opts, scheds):
            w.train(chunk, opt, sched, steps=2, in_features=8)
        ckpt.save(4, async_=False)
    ckpt.close()
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    owned = {}
    for chunk, opt in zip(chunks, opts):
        owned.update({f"model.{k}": fingerprint(v) for k, v in chunk.state_dict().items()})
        owned.update({f"optim.{k}": fingerprint(v) for k, v in
                      get_optimizer_state_dict(chunk, opt, options=flat).items()})
    return {"start": start, "owned": owned}


def union(ranks: list[dict]) -> dict:
    merged = {}
    for rank in ranks:
        assert not merged.keys() & rank["owned"].keys(), "stages must own disjoint FQNs"
        merged.update(rank["owned"])
    return merged


def test_pipeline_2_stages_load_into_1_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = union(run(tmp_path, 2, {"task": task_pipeline, "root": root, "chunks_per_rank": 1,
                                    "save": True}))
    assert any(k.startswith("model.head.") for k in saved)
    assert any(k.startswith("optim.state.layers.") for k in saved)
    loaded = run(tmp_path, 1, {"task": task_pipeline, "root": root, "chunks_per_rank": 2,
                               "save": False})
    assert loaded[0]["start"] == 5
    assert union(loaded) == saved


def test_pipeline_1_rank_loads_into_2_stages(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = union(run(tmp_path, 1, {"task": task_pipeline, "root": root, "chunks_per_rank": 2,
                                    "save": True}))
    loaded = run(tmp_path, 2, {"task": task_pipeline, "root": root, "chunks_per_rank": 1,
                               "save": False})
    assert [r["start"] for r in loaded] == [5, 5]
    assert all(r["owned"] for r in loaded)
    assert union(loaded) == saved
