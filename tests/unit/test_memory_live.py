"""The state a snapshot copies, collected once and reused (elastic.checkpoint.memory.live).

Each test writes real snapshots (SnapshotWriter into real slots) and compares the
slot, read back, with a fresh full collection of the live state: the oracle a
stale reuse would fail. ``collections`` shows when the state was collected again.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from elastic.checkpoint import state
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.items import dtype_of, plan_slot
from elastic.checkpoint.memory.live import LiveState
from elastic.checkpoint.memory.reader import load_objects
from elastic.checkpoint.memory.writer import Identity, SnapshotWriter


class Job:
    """A small model, AdamW and a warm-up schedule, snapshotted by a LiveState."""

    def __init__(self, memory_dir, model=None):
        torch.manual_seed(0)
        self.model = model if model is not None else nn.Sequential(
            nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda s: (s + 1) / 4)
        self.chunks = state.make_chunks(self.model, self.optimizer)
        self.live = LiveState(self.chunks)
        self.writer = SnapshotWriter(memory_dir, Identity("job", "a", 1, 0, 1))
        self.memory_dir = memory_dir
        self.step = 0

    def train(self):
        self.model(torch.randn(3, 4)).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    def snapshot(self):
        """Snapshot now; the slot read back as {name: tensor or value}."""
        key = self.writer.write(self.step, self.live.plan(), b"local")
        return read_slot(os.path.join(layout.own_dir(self.memory_dir), key.name))


def read_slot(path):
    info = layout.read_slot(path)
    assert info is not None, "the slot is not complete"
    with open(os.path.join(path, layout.DATA), "rb") as f:
        data = bytearray(f.read())
    out = {}
    for item in info.manifest.tensors:
        raw = torch.frombuffer(data, dtype=torch.uint8)[item.offset:item.offset + item.nbytes]
        out[item.fqn] = raw.view(dtype_of(item.dtype)).view(item.shape).clone()
    with open(os.path.join(path, layout.OBJECTS), "rb") as f:
        out.update(load_objects(f.read()))
    return out


def collected_now(chunks):
    """The oracle: what a full collection gives now, by slot name."""
    plan = plan_slot(state.collect(chunks).state_dict)
    out = {item.fqn: tensor.detach().clone() for item, tensor in zip(plan.items, plan.tensors)}
    out.update(plan.objects)
    return out


def assert_same(slot, oracle):
    assert slot.keys() == oracle.keys()
    for name, value in oracle.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(slot[name], value), name
        else:
            assert slot[name] == value, name


def test_steps_reuse_one_collection_and_each_snapshot_is_the_state_at_its_step(tmp_path):
    job = Job(str(tmp_path))
    for _ in range(4):
        job.train()
        assert_same(job.snapshot(), collected_now(job.chunks))
    assert job.live.collections == 1
    # the scheduler set a new lr at every step: read afresh, not from the first collection
    assert job.snapshot()["optim.param_groups.0.weight.lr"] == pytest.approx(0.1 * 5 / 4)


def test_a_parameter_whose_data_is_swapped_is_collected_again(tmp_path):
    job = Job(str(tmp_path))
    job.train()
    job.snapshot()
    weight = job.model[0].weight
    weight.data = torch.full_like(weight, 3.0)  # same Parameter object, new bytes
    slot = job.snapshot()
    assert job.live.collections == 2
    assert torch.equal(slot["model.0.weight"], torch.full((8, 4), 3.0))
    assert_same(slot, collected_now(job.chunks))


def test_a_parameter_replaced_in_the_model_and_optimizer_is_collected_again(tmp_path):
    job = Job(str(tmp_path))
    job.train()
    job.snapshot()
    old = job.model[2].bias
    new = nn.Parameter(torch.full_like(old, -2.0))
    job.model[2].bias = new
    group = job.optimizer.param_groups[0]
    group["params"] = [new if p is old else p for p in group["params"]]
    job.optimizer.state[new] = job.optimizer.state.pop(old)
    slot = job.snapshot()
    assert job.live.collections == 2
    assert torch.equal(slot["model.2.bias"], torch.tensor([-2.0]))
    assert_same(slot, collected_now(job.chunks))


def test_optimizer_state_that_appears_later_is_collected(tmp_path):
    job = Job(str(tmp_path))
    frozen = job.model[2].weight
    frozen.requires_grad_(False)  # no gradient: AdamW keeps no state for it yet
    job.train()
    first = job.snapshot()
    assert "optim.state.2.weight.exp_avg" not in first
    frozen.requires_grad_(True)
    job.train()
    slot = job.snapshot()
    assert job.live.collections == 2
    assert "optim.state.2.weight.exp_avg" in slot
    assert_same(slot, collected_now(job.chunks))


def test_optimizer_state_replaced_or_loaded_is_collected_again(tmp_path):
    job = Job(str(tmp_path))
    job.train()
    job.snapshot()
    job.optimizer.state[job.model[0].bias]["exp_avg"] = torch.full((8,), 7.0)
    slot = job.snapshot()
    assert torch.equal(slot["optim.state.0.bias.exp_avg"], torch.full((8,), 7.0))
    saved = copy.deepcopy(job.optimizer.state_dict())
    job.train()
    job.optimizer.load_state_dict(saved)  # new state tensors, new groups
    slot = job.snapshot()
    assert job.live.collections == 3
    assert torch.equal(slot["optim.state.0.bias.exp_avg"], torch.full((8,), 7.0))
    assert_same(slot, collected_now(job.chunks))


def test_a_parameter_group_added_is_collected_again(tmp_path):
    job = Job(str(tmp_path), model=nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    job.scheduler = None  # one lambda per group: not for a group added later
    head = job.model[1]
    group = job.optimizer.param_groups[0]
    group["params"] = [p for p in group["params"] if all(p is not q for q in head.parameters())]
    job.train()
    job.snapshot()
    job.optimizer.add_param_group({"params": list(head.parameters()), "lr": 0.5})
    job.train()
    slot = job.snapshot()
    assert job.live.collections == 2
    assert slot["optim.param_groups.1.weight.lr"] == pytest.approx(0.5)
    assert_same(slot, collected_now(job.chunks))


class WithExtraState(nn.Linear):
    def __init__(self):
        super().__init__(4, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, extra):
        self.calls = extra["calls"]


def test_state_the_live_objects_cannot_explain_is_collected_at_every_snapshot(tmp_path):
    job = Job(str(tmp_path), model=WithExtraState())  # a value only the module can give
    for _ in range(3):
        job.train()
        assert_same(job.snapshot(), collected_now(job.chunks))
    assert job.live.collections == 3

    copying = Job(str(tmp_path / "copying"))
    copying.model.register_state_dict_post_hook(  # a hook whose tensors are copies
        lambda module, sd, prefix, meta: sd.update({k: v.clone() for k, v in sd.items()}))
    for _ in range(3):
        copying.train()
        assert_same(copying.snapshot(), collected_now(copying.chunks))
    assert copying.live.collections == 3


def test_each_slot_holds_its_own_objects_when_they_change_and_change_back(tmp_path):
    writer = SnapshotWriter(str(tmp_path), Identity("job", "a", 1, 0, 1))
    tensor = {"model": {"w": torch.zeros(2)}}
    # slot 0, 1, 0, 1, 0: a value seen before must still be written into a slot
    # that last held another; -0.0 is not 0.0
    for step, lr in enumerate([0.1, 0.2, 0.2, 0.1, -0.0]):
        key = writer.write(step, plan_slot({**tensor, "optim": {"param_groups.w.lr": lr}}), b"x")
        slot = read_slot(os.path.join(layout.own_dir(str(tmp_path)), key.name))
        assert repr(slot["optim.param_groups.w.lr"]) == repr(lr), step
    key = writer.write(5, plan_slot({**tensor, "optim": {"param_groups.w.lr": 0.0}}), b"x")
    slot = read_slot(os.path.join(layout.own_dir(str(tmp_path)), key.name))
    assert repr(slot["optim.param_groups.w.lr"]) == "0.0"


def test_unchanged_objects_are_kept_and_a_value_changed_in_place_or_replaced_is_seen(tmp_path):
    job = Job(str(tmp_path))
    job.scheduler = None
    group = job.optimizer.param_groups[0]
    group["betas"] = [0.9, 0.999]  # an option that can change in place
    job.train()
    job.live.plan()  # the collection
    first, again = job.live.plan(), job.live.plan()  # reused: the objects read, and kept
    assert again.objects is first.objects and again.objects_key == first.objects_key
    assert_same(job.snapshot(), collected_now(job.chunks))
    group["betas"][0] = 0.5  # in place: the same list object
    job.train()
    slot = job.snapshot()
    assert slot["optim.param_groups.0.weight.betas"] == [0.5, 0.999]
    assert_same(slot, collected_now(job.chunks))
    for lr in (0.0, -0.0):  # equal values, other pickles: a slot holds each as it is
        group["lr"] = lr
        assert repr(job.snapshot()["optim.param_groups.2.bias.lr"]) == repr(lr)
    assert job.live.collections == 1
