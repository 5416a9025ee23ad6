"""Async saves: ``save()`` blocks only for staging, one save is in flight at a time,
and the staged copy is a real copy; optimizer steps and forward passes during the
background copy are fine, an in-place change of a parameter by anything else fails
the save, naming why, and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import os
import threading

import pytest

from elastic.checkpoint.api import CommitEntry, CommitLog
from tests.integration.checkpointing import Worker, fingerprint, hidden_entries, run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


class GatedCommitLog(CommitLog):
    """A commit log whose commit of a step waits until the test opens that step's gate,
    so "save() returned before its commit" is an observation, not a timing."""

    GATE_TIMEOUT_S = 30.0

    def __init__(self, inner: CommitLog):
        self.inner = inner
        self._opened: set[int] = set()
        self._cond = threading.Condition()

    def open(self, step: int) -> None:
        with self._cond:
            self._opened.add(step)
            self._cond.notify_all()

    def commit(self, entry: CommitEntry) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: entry.step in self._opened,
                                       timeout=self.GATE_TIMEOUT_S):
                raise AssertionError(f"the test never opened the commit of step {entry.step}")
        self.inner.commit(entry)

    def latest(self) -> CommitEntry | None:
        return self.inner.latest()


def digest_on_disk(w: Worker, root, step):
    """Load one checkpoint directory's model and optimizer into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from elastic.checkpoint import layout, state

    model, opt, _ = w.ddp(init_seed=99, width=1024, depth=4)
    chunks = state.make_chunks(model, opt)
    tensors = state.collect(chunks)
    dcp.load(tensors.state_dict, checkpoint_id=os.path.join(root, layout.step_dir_name(step)))
    state.apply(chunks, tensors)
    return w.ddp_digest(model, opt)


def task_async(w: Worker, root):
    """Commits are held back by a gate that this task opens, so whether save()
    waited for a commit is seen in the log, never inferred from a duration."""
    import torch
    import torch.distributed as dist

    model, opt, sched = w.ddp(width=1024, depth=4)  # ~3.2 M params, ~38 MB with Adam
    w.train(model, opt, sched, steps=1)
    announced = []
    gate = GatedCommitLog(w.commit_log(root, None))
    ckpt = w.checkpointer(root, model, opt, sched, keep=2, on_saving=announced.append,
                             commit_log=gate)
    gate.open(0)
    ckpt.save(0)
    ckpt.wait()
    announced_first = list(announced)

    before = w.ddp_digest(model, opt)
    ckpt.save(1)  # its commit cannot happen until the gate of step 1 opens
    latest_after_first_call = gate.latest().step
    dist.barrier()  # only rank 0 commits: every rank has looked before its gate opens
    # an optimizer step (the only in-place change allowed while the copy to CPU may
    # still run: it waits for the copy), while step 1 is being written
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    after = w.ddp_digest(model, opt)
    # save(2) must first wait for step 1, whose gate opens a little later
    threading.Timer(0.3, gate.open, args=(1,)).start()
    ckpt.save(2)
    latest_after_second_call = gate.latest().step
    dist.barrier()
    gate.open(2)
    ckpt.wait()
    ckpt.close()
    return {"announced_first": announced_first, "announced": announced,
            "dirs": sorted(n for n in os.listdir(root) if n.startswith("step-")),
            "latest_after_first_call": latest_after_first_call,
            "latest_after_second_call": latest_after_second_call,
            "before_mutation": before, "after_mutation": after,
            "step1_on_disk": digest_on_disk(w, root, 1),
            "step2_on_disk": digest_on_disk(w, root, 2)}


def test_async_save_blocks_only_for_staging_and_one_in_flight(tmp_path):
    for r in run(tmp_path, 2, {"task": task_async, "root": str(tmp_path / "ckpt")}):
        # with the commit of step 1 held back, save(1) still returned ...
        assert r["latest_after_first_call"] == 0, r
        # ... the next save first waited for it, which was then committed (and step 2's
        # commit, held back in turn, had not happened yet) ...
        assert r["latest_after_second_call"] == 1, r
        # ... and the staged copy was a real copy: mutating the live tensors after
        # save() returned did not leak into the checkpoint being written
        assert r["step1_on_disk"] == r["before_mutation"] != r["after_mutation"]
        assert r["step2_on_disk"] == r["after_mutation"]
        # the agent hears of each save with an estimate, and of its end with 0
        assert len(r["announced_first"]) == 2 and r["announced_first"][0] > 0
        assert r["announced_first"][1] == 0 and r["announced"][-1] == 0
        # keep=2: step 0 was pruned after step 2 was committed
        assert r["dirs"] == ["step-000000000001", "step-000000000002"]


def digest_on_disk_of(root, step, model, opt):
    """Digest of a checkpoint loaded into a copy of ``model`` and ``opt``."""
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from elastic.checkpoint import layout, state

    twin = copy.deepcopy(model.module)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
    twin_opt.load_state_dict(opt.state_dict())
    chunks = state.make_chunks(twin, twin_opt)
    tensors = state.collect(chunks)
    dcp.load(tensors.state_dict, checkpoint_id=os.path.join(root, layout.step_dir_name(step)))
    state.apply(chunks, tensors)
    return replicated_digest(twin, twin_opt)


def replicated_digest(module, opt) -> str:
    """Digest without BatchNorm's running statistics: each DDP rank has its own
    (from its own batches), and DCP writes one rank's copy of replicated tensors.
    ``num_batches_tracked`` stays: equal on all ranks, and changed by forward."""
    return fingerprint([{k: v for k, v in module.state_dict().items()
                         if ".running_" not in k}, opt.state_dict()])


def task_inplace_guard(w: Worker, root):
    """Async saves whose background copy is slowed by 0.5 s: forward passes (which
    change BatchNorm buffers) and optimizer steps during the copy are fine; an
    in-place change of a parameter by anything but the optimizer fails the save."""
    import torch
    from torch import nn
    from elastic.checkpoint import CheckpointError, FileCommitLog

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = w.checkpointer(root, model, opt)
    w.train(model, opt)
    ckpt.save(0, async_=False)
    os.environ["ELASTIC_FAILPOINT"] = "ckpt.stage=sleep:0.5"
    try:
        w.train(model, opt)
        before = replicated_digest(model.module, opt)
        ckpt.save(1)
        w.train(model, opt, steps=2)  # forward changes buffers; step() waits
        ckpt.wait()
        latest_after_good = FileCommitLog(root).latest().step
        on_disk = digest_on_disk_of(root, 1, model, opt)
        # the change below must land while the copy is still held back: a window
        # far longer than any stall of this thread on a loaded machine
        os.environ["ELASTIC_FAILPOINT"] = "ckpt.stage=sleep:3.0"
        ckpt.save(2)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.999)  # e.g. weight decay by hand: not allowed before the step
        error = None
        try:
            ckpt.wait()
        except CheckpointError as exc:
            error = str(exc)
    finally:
        del os.environ["ELASTIC_FAILPOINT"]
    latest_after_bad = FileCommitLog(root).latest().step
    hidden = hidden_entries(root)
    w.train(model, opt)
    ckpt.save(3)
    ckpt.close()
    return {"latest_after_good": latest_after_good,
            "before": before, "step1_on_disk": on_disk, "error": error,
            "latest_after_bad": latest_after_bad, "hidden_after_bad": hidden,
            "latest_after_retry": FileCommitLog(root).latest().step}


def test_inplace_change_during_background_copy_fails_the_save(tmp_path):
    root = str(tmp_path / "ckpt")
    for r in run(tmp_path, 2, {"task": task_inplace_guard, "root": root}):
        # forward passes and optimizer steps during the copy: committed, and what was
        # written is the state as of save(), BatchNorm buffers included
        assert r["latest_after_good"] == 1
        assert r["step1_on_disk"] == r["before"]
        # a parameter changed in place by the script: the save fails loudly, naming why
        assert r["error"] is not None and "modified in place" in r["error"], r
        assert "optimizer.step()" in r["error"], r
        assert r["latest_after_bad"] == 1 and r["hidden_after_bad"] == []
        assert r["latest_after_retry"] == 3
