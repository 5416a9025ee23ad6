"""Snapshots into slots (elastic.checkpoint.memory.items and .writer): the manifest's
items, the slot protocol, the double buffer."""

from __future__ import annotations

import os

import pytest
import torch

from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.items import ALIGN, plan_slot
from elastic.checkpoint.memory.writer import Identity, SnapshotWriter

IDENT = Identity(job_id="job", node_id="node-a", round=3, rank=1, world_size=2)


def state_dict():
    return {"model": {"w": torch.arange(6, dtype=torch.float32).view(2, 3),
                      "b": torch.ones(3, dtype=torch.bfloat16)},
            "optim": {"state.w.step": torch.tensor(4.0), "param_groups.w.lr": 0.1}}


def test_items_name_dcp_keys_and_lie_aligned():
    plan = plan_slot(state_dict())
    assert [i.fqn for i in plan.items] == ["model.w", "model.b", "optim.state.w.step"]
    assert plan.objects == {"optim.param_groups.w.lr": 0.1}
    w, b, step = plan.items
    assert (w.dtype, w.global_shape, w.offsets, w.shape, w.nbytes) == \
        ("float32", (2, 3), (0, 0), (2, 3), 24)
    assert (b.dtype, b.offset, step.shape, step.offset) == ("bfloat16", ALIGN, (), 2 * ALIGN)
    assert plan.data_bytes == 3 * ALIGN


def test_a_dtensor_item_is_its_chunk(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
        (item,) = plan_slot({"model": {"x": sharded}}).items
        assert (item.global_shape, item.offsets, item.shape) == ((4, 2), (0, 0), (4, 2))
    finally:
        dist.destroy_process_group()


def test_slots_alternate_and_round_trip(tmp_path):
    writer = SnapshotWriter(str(tmp_path), IDENT)
    sd = state_dict()
    first = writer.write(10, plan_slot(sd), b"local-10")
    sd["model"]["w"].add_(1)
    second = writer.write(11, plan_slot(sd), b"local-11")
    assert (first.slot, second.slot) == (0, 1)
    slots = {s.key.slot: s for s in layout.list_slots(str(tmp_path))}
    assert {k: s.manifest.step for k, s in slots.items()} == {0: 10, 1: 11}
    info = slots[1]
    assert (info.manifest.round, info.manifest.rank, info.manifest.node_id) == (3, 1, "node-a")
    (w,) = [i for i in info.manifest.tensors if i.fqn == "model.w"]
    with open(os.path.join(info.path, layout.DATA), "rb") as f:
        raw = f.read()[w.offset:w.offset + w.nbytes]
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).view(2, 3).equal(sd["model"]["w"])
    with open(os.path.join(info.path, layout.LOCAL), "rb") as f:
        assert f.read() == b"local-11"


def test_the_previous_snapshot_stays_complete_while_the_next_is_written(tmp_path):
    writer = SnapshotWriter(str(tmp_path), IDENT)
    writer.write(10, plan_slot(state_dict()), b"x")
    writer.write(11, plan_slot(state_dict()), b"x")
    # the writer dies in the middle of step 12 (slot 0): begin_write happened, no finish
    layout.begin_write(writer.slot_dir(0))
    assert [(s.key.slot, s.manifest.step) for s in layout.list_slots(str(tmp_path))] == [(1, 11)]


def test_a_step_rewrites_in_place_without_growing(tmp_path):
    writer = SnapshotWriter(str(tmp_path), IDENT)
    for step in range(4):
        writer.write(step, plan_slot(state_dict()), b"x")
    assert writer.held_bytes() == 2 * 3 * ALIGN
    assert sorted(os.listdir(layout.own_dir(str(tmp_path)))) == \
        [layout.SlotKey(3, 1, 0).name, layout.SlotKey(3, 1, 1).name]


def test_a_restart_in_the_same_round_writes_over_the_older_snapshot_first(tmp_path):
    first = SnapshotWriter(str(tmp_path), IDENT)
    for step in range(3):  # slot 0: step 2, slot 1: step 1
        first.write(step, plan_slot(state_dict()), b"x")
    again = SnapshotWriter(str(tmp_path), IDENT)  # no agent: the same round 0 after a restart
    assert again.write(3, plan_slot(state_dict()), b"x").slot == 1
    assert sorted(s.manifest.step for s in layout.list_slots(str(tmp_path))) == [2, 3]


def test_a_slot_removed_under_the_writer_fails_one_write_then_is_made_anew(tmp_path):
    import shutil

    writer = SnapshotWriter(str(tmp_path), IDENT)
    sd = state_dict()
    writer.write(10, plan_slot(sd), b"local-10")
    writer.write(11, plan_slot(sd), b"local-11")
    shutil.rmtree(writer.slot_dir(0))  # the next write's slot, gone
    with pytest.raises(OSError):
        writer.write(12, plan_slot(sd), b"local-12")
    sd["model"]["w"].add_(1)
    assert writer.write(12, plan_slot(sd), b"local-12").slot == 0
    slots = {s.key.slot: s for s in layout.list_slots(str(tmp_path))}
    assert {k: s.manifest.step for k, s in slots.items()} == {0: 12, 1: 11}
    (w,) = [i for i in slots[0].manifest.tensors if i.fqn == "model.w"]
    with open(os.path.join(slots[0].path, layout.DATA), "rb") as f:
        raw = f.read()[w.offset:w.offset + w.nbytes]
    assert torch.frombuffer(bytearray(raw), dtype=torch.float32).view(2, 3).equal(sd["model"]["w"])
