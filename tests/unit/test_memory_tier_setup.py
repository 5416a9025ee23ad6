"""Turning the memory tier on: what it needs from the script and from the node, said
before training goes on (a single rank, no process group)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from elastic.checkpoint import Checkpointer
from elastic.checkpoint.memory import capacity, layout
from elastic.errors import ConfigError
from elastic.worker import runtime
from elastic.worker_env import MEMORY_DIR
from tests.fakes.data_position import Position


def model_and_optimizer():
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_tier_without_data_is_refused_saying_what_to_pass(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    with pytest.raises(ConfigError, match=r"the memory tier snapshots every step: pass "
                                          r"data=<your sampler or data loader>"):
        Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt,
                     memory_dir=str(tmp_path / "mem"))
    monkeypatch.setenv(MEMORY_DIR, str(tmp_path / "mem"))  # the agent's --memory-tier
    with pytest.raises(ConfigError, match="pass data="):
        Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt)


def test_a_node_too_small_fails_the_first_step_before_anything_is_written(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(capacity, "filesystem_free", lambda path: 100)
    model, opt = model_and_optimizer()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt, data=Position(),
                        memory_dir=str(tmp_path / "mem"), memory_every=1)
    try:
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        with pytest.raises(ConfigError, match=r"needs .* GiB of host memory on this node .* "
                                              r"only 0.00 GiB free on the file system"):
            runtime.step(0)
        assert layout.list_slots(str(tmp_path / "mem")) == []
    finally:
        ckpt.close()


def test_snapshots_follow_elastic_step_until_close(tmp_path):
    model, opt = model_and_optimizer()
    data = Position()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt, data=data,
                        memory_dir=str(tmp_path / "mem"), memory_every=2)
    for step in range(5):
        data.samples += 1
        runtime.step(step)
    ckpt.close()
    runtime.step(5)  # after close: no snapshot
    slots = layout.list_slots(str(tmp_path / "mem"))
    assert sorted(s.manifest.step for s in slots) == [2, 4]
    assert all({"model.weight", "model.bias"} <= {t.fqn for t in s.manifest.tensors}
               for s in slots)


def test_a_restore_from_memory_brings_back_the_snapshots_state(tmp_path):
    model, opt = model_and_optimizer()
    data = Position()
    kwargs = dict(model=model, optimizer=opt, data=data, memory_dir=str(tmp_path / "mem"),
                  memory_every=1)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), **kwargs)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    data.samples = 7
    runtime.step(3)
    ckpt.close()
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    data.samples = 0
    ckpt = Checkpointer(str(tmp_path / "ckpt"), **kwargs)
    assert ckpt.restore() == 4
    ckpt.close()
    assert ckpt.restored_path == "memory:round-0/step-3" and data.samples == 7
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))


class Planted:
    """What a hostile replica could carry: unpickling it would create a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_snapshot_that_would_run_code_is_refused_and_disk_is_used(tmp_path, caplog):
    import io
    import os

    model, opt = model_and_optimizer()
    kwargs = dict(model=model, optimizer=opt, data=Position(), memory_dir=str(tmp_path / "mem"),
                  memory_every=1)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), **kwargs)
    runtime.step(0)
    ckpt.close()
    (info,) = layout.list_slots(str(tmp_path / "mem"))
    planted = io.BytesIO()
    torch.save({name: Planted(str(tmp_path / "ran")) for name in info.manifest.objects}, planted)
    layout.begin_write(info.path)
    with open(os.path.join(info.path, layout.OBJECTS), "wb") as f:
        f.write(planted.getvalue())
    files = {**info.manifest.files, layout.OBJECTS: len(planted.getvalue())}
    layout.finish_write(info.path, layout.Manifest(**{**info.manifest.__dict__, "files": files}))
    ckpt = Checkpointer(str(tmp_path / "ckpt"), **kwargs)
    assert ckpt.restore() == 0  # no disk checkpoint: a fresh start, not the planted snapshot
    ckpt.close()
    assert not os.path.exists(tmp_path / "ran")
    assert "cannot restore memory:round-0/step-0" in caplog.text
    assert "restoring from disk instead" in caplog.text


def test_a_failed_snapshot_write_is_a_warning_and_training_goes_on(tmp_path, monkeypatch,
                                                                   caplog):
    import errno

    from elastic.checkpoint.memory.writer import SnapshotWriter

    model, opt = model_and_optimizer()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt, data=Position(),
                        memory_dir=str(tmp_path / "mem"), memory_every=1)
    runtime.step(0)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SnapshotWriter, "write", full)
    runtime.step(1)  # does not raise
    ckpt.close()
    assert "could not write its memory snapshot of step 1" in caplog.text
    assert [s.manifest.step for s in layout.list_slots(str(tmp_path / "mem"))] == [0]


@pytest.mark.parametrize("huge, said", [(False, "a tmpfs with 4 KiB pages"),
                                        (True, "a tmpfs with 2 MiB pages")])
def test_the_first_snapshot_says_which_pages_the_memory_directory_has(tmp_path, monkeypatch,
                                                                      caplog, huge, said):
    monkeypatch.setattr(capacity, "huge_pages", lambda path: huge)  # a mount needs root
    caplog.set_level(logging.INFO, logger="elastic.checkpoint.memory.tier")
    model, opt = model_and_optimizer()
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model, optimizer=opt, data=Position(),
                        memory_dir=str(tmp_path / "mem"), memory_every=1)
    runtime.step(0)
    ckpt.close()
    assert said in caplog.text
