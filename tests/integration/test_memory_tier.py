"""The memory tier end to end: 4 ranks on 2 simulated nodes (two memory directories,
ranks 0-1 on node-a, 2-3 on node-b), a disk checkpoint far away (or none), and a
bitwise oracle for each failure: the run that resumes from memory ends with exactly
the state of a run that never stopped (or, across world sizes, of a run that resumed
from disk at the same step)."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.fakes.data_position import Position
from tests.integration.checkpointing import Worker, fsdp2_on_cpu, launch, seed_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300), fsdp2_on_cpu]

TWO_NODES = ["node-a", "node-a", "node-b", "node-b"]
STEPS = 8


def task_train(w: Worker, root, mem, nodes, steps=STEPS, kind="fsdp", fresh=True, crash=None,
               disk_at=(), memory=True):
    """Restore, then train to ``steps``, a memory snapshot at every ``elastic.step``;
    ``crash`` = (rank, step): that rank dies in that step before its snapshot, the
    others right after theirs. A fresh run and a resumed one start from other
    inits and RNG seeds (only the restore can make them meet).

    FSDP2 by default: its reduce-scatter has the same layout at every step, so a
    run resumed mid-way sums gradients in the same order as one that never
    stopped. DDP reorders its gradient bucket after its first step, which at
    more than 2 ranks changes the order of the all-reduce's additions: bitwise
    oracles with DDP need 2 ranks (tests/integration/test_checkpoint_resume.py)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    from elastic.worker import runtime
    from tests.integration.checkpointing import fingerprint

    node = nodes[w.rank]
    os.environ.update(ELASTIC_NODE_ID=node, LOCAL_WORLD_SIZE=str(nodes.count(node)))
    model, opt, sched = build(w, kind, init_seed=0 if fresh else 777)
    seed_all((100 if fresh else 900) + w.rank)
    data = Position()
    ckpt = w.checkpointer(root, model, opt, sched, data=data, memory_every=1,
                          memory_dir=os.path.join(mem, node) if memory else None)
    start = ckpt.restore()
    restored = {"start": start, "path": ckpt.restored_path, "samples": data.samples}
    for step in range(start, steps):
        w.train(model, opt, sched)
        data.samples += 8
        if crash is not None and crash[1] == step and crash[0] == w.rank:
            os._exit(13)
        runtime.step(step)
        if crash is not None and crash[1] == step:
            os._exit(13)
        if step in disk_at:
            ckpt.save(step, async_=False)
    ckpt.close()
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    digest = fingerprint([get_model_state_dict(model, options=full),
                          get_optimizer_state_dict(model, opt, options=full),
                          sched.state_dict(), torch.rand(2)])
    dist.barrier()
    return {**restored, "digest": digest}


def build(w: Worker, kind, init_seed):
    import torch
    from torch import nn

    if kind == "ddp":
        return w.ddp(init_seed=init_seed)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(init_seed)
    # 7 output rows: shards of uneven size at 2 and 4 ranks
    model = nn.Sequential(nn.Linear(16, 18), nn.Tanh(), nn.Dropout(0.2), nn.Linear(18, 7))
    mesh = init_device_mesh("cpu", (w.world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(tmp_path, world, round_number=0, crash_expected=False, **args):
    """One run of ``task_train``: its ranks' results (None for a rank that crashed)."""
    return train_logged(tmp_path, world, round_number, crash_expected, **args)[0]


def train_logged(tmp_path, world, round_number=0, crash_expected=False, **args):
    """:func:`train`, and rank 0's log (it says where the restored slots came from)."""
    ranks = launch(tmp_path, world, [{"task": task_train, "id": "t", **args}],
                   round_number=round_number, crash_expected=crash_expected)
    return [r.results.get("t") for r in ranks], ranks[0].stderr


def dirs(tmp_path):
    return str(tmp_path / "ckpt"), str(tmp_path / "mem")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run that never stopped: 4 ranks on two nodes, steps 0..STEPS-1."""
    where = tmp_path_factory.mktemp("reference")
    return train(where, 4, root=str(where / "ckpt"), mem=str(where / "mem"), nodes=TWO_NODES)


def test_a_worker_crash_resumes_at_its_step_from_own_memory(tmp_path, reference):
    root, mem = dirs(tmp_path)
    # rank 2 dies during step 5: its snapshot of 5 never exists, the others' do
    train(tmp_path, 4, root=root, mem=mem, nodes=TWO_NODES, crash=(2, 5), crash_expected=True)
    resumed, log = train_logged(tmp_path, 4, round_number=1, root=root, mem=mem,
                                nodes=TWO_NODES, fresh=False)
    for rank in resumed:
        assert (rank["start"], rank["path"], rank["samples"]) == \
            (5, "memory:round-0/step-4", 40)  # lost: the step in progress, nothing more
    assert "slots from own memory 4, replicas 0, sent by peers 0" in log
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]


def replicate(mem, source, target):
    """Copy node ``source``'s own slots into ``target``'s replicas, as the agent's
    replication does (the slot protocol), then lose ``source``."""
    from elastic.checkpoint.memory import layout

    for info in layout.list_slots(os.path.join(mem, source)):
        copy = os.path.join(layout.replica_dir(os.path.join(mem, target), source),
                            os.path.basename(info.path))
        layout.begin_write(copy)
        for name in info.manifest.files:
            shutil.copyfile(os.path.join(info.path, name), os.path.join(copy, name))
        assert layout.still_same(info)
        layout.finish_write(copy, info.manifest)
    shutil.rmtree(os.path.join(mem, source))


def test_a_lost_node_resumes_from_its_buddys_replicas(tmp_path, reference):
    root, mem = dirs(tmp_path)
    train(tmp_path, 4, root=root, mem=mem, nodes=TWO_NODES, crash=(0, 6), crash_expected=True)
    replicate(mem, "node-b", "node-a")
    # node-c replaces node-b with empty memory: ranks 2-3 get their slots from node-a's ranks
    resumed, log = train_logged(tmp_path, 4, round_number=1, root=root, mem=mem, fresh=False,
                                nodes=["node-a", "node-a", "node-c", "node-c"])
    assert "slots from own memory 2, replicas 0, sent by peers 2" in log
    assert [(r["start"], r["path"], r["samples"]) for r in resumed] == \
        [(6, "memory:round-0/step-5", 48)] * 4
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4)])
def test_a_world_size_change_reshards_from_memory_like_disk(tmp_path, old, new):
    """FSDP2 shards saved by ``old`` ranks, loaded by ``new``: from memory at the
    step of a disk checkpoint, the run ends bitwise where the one from disk ends."""
    root, mem = dirs(tmp_path)
    nodes = {4: TWO_NODES, 2: ["node-a", "node-b"]}
    train(tmp_path, old, root=root, mem=mem, nodes=nodes[old], steps=5, disk_at=(4,))
    from_disk = train(tmp_path, new, round_number=1, root=root, mem=mem, nodes=nodes[new],
                      fresh=False, memory=False)
    from_memory = train(tmp_path, new, round_number=2, root=root, mem=mem, nodes=nodes[new],
                        fresh=False)
    assert [(r["start"], r["samples"]) for r in from_disk + from_memory] == [(5, 40)] * 2 * new
    assert from_disk[0]["path"].endswith("step-000000000004")
    assert [r["path"] for r in from_memory] == ["memory:round-0/step-4"] * new
    assert [r["digest"] for r in from_memory] == [r["digest"] for r in from_disk]


def make_zombie_slots(mem, node, round_number, step):
    """Slots of an older round with a higher step, as a zombie worker left them."""
    import dataclasses

    from elastic.checkpoint.memory import layout

    for info in layout.list_slots(os.path.join(mem, node)):
        key = layout.SlotKey(round_number, info.key.rank, info.key.slot)
        zombie = os.path.join(layout.own_dir(os.path.join(mem, node)), key.name)
        layout.begin_write(zombie)
        for name in info.manifest.files:
            shutil.copyfile(os.path.join(info.path, name), os.path.join(zombie, name))
        layout.finish_write(zombie, dataclasses.replace(info.manifest, round=round_number,
                                                        step=step))


def tear_newest(mem, node, rank):
    """Leave ``rank``'s newest slot as a writer that died mid-write leaves it."""
    from elastic.checkpoint.memory import layout

    slots = [s for s in layout.list_slots(os.path.join(mem, node)) if s.key.rank == rank]
    layout.begin_write(max(slots, key=lambda s: s.manifest.step).path)


def test_torn_slots_and_a_zombies_slots_are_never_used(tmp_path, reference):
    root, mem = dirs(tmp_path)
    train(tmp_path, 4, round_number=2, root=root, mem=mem, nodes=TWO_NODES, steps=6,
          disk_at=(2,))
    make_zombie_slots(mem, "node-a", round_number=1, step=7)   # round 1 < 2: a zombie's
    tear_newest(mem, "node-b", rank=3)                         # step 5 torn on rank 3
    spare = str(tmp_path / "spare")
    shutil.copytree(mem, spare)
    resumed = train(tmp_path, 4, round_number=3, root=root, mem=mem, nodes=TWO_NODES,
                    fresh=False)
    assert [(r["start"], r["path"]) for r in resumed] == [(5, "memory:round-2/step-4")] * 4
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]
    # both of rank 3's slots torn: no complete snapshot of round 2, the disk one is used
    tear_newest(spare, "node-b", rank=3)
    from_disk = train(tmp_path, 4, round_number=3, root=root, mem=spare, nodes=TWO_NODES,
                      fresh=False)
    assert [r["start"] for r in from_disk] == [3] * 4
    assert from_disk[0]["path"].endswith("step-000000000002")
    assert [r["digest"] for r in from_disk] == [r["digest"] for r in reference]


def test_ddp_resumes_from_memory_bitwise(tmp_path):
    """DDP, one rank per node (2 ranks: see task_train on DDP's order of additions)."""
    nodes = ["node-a", "node-b"]
    reference = train(tmp_path, 2, root=str(tmp_path / "ref"), mem=str(tmp_path / "refmem"),
                      nodes=nodes, kind="ddp")
    root, mem = dirs(tmp_path)
    train(tmp_path, 2, root=root, mem=mem, nodes=nodes, kind="ddp", crash=(1, 3),
          crash_expected=True)
    resumed = train(tmp_path, 2, round_number=1, root=root, mem=mem, nodes=nodes, kind="ddp",
                    fresh=False)
    assert [(r["start"], r["path"]) for r in resumed] == [(3, "memory:round-0/step-2")] * 2
    assert [r["digest"] for r in resumed] == [r["digest"] for r in reference]
