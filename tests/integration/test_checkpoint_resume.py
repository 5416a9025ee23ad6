"""A DDP run saved (async) mid-training and resumed in a fresh group, from another
init and other RNG seeds, ends bitwise identical to the run that never stopped:
weights, optimizer, scheduler, and every rank's own RNGs, data position and extras.
"""

from __future__ import annotations

import random

import pytest

from tests.integration.checkpointing import Worker, run, seed_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def task_ddp(w: Worker, root, save_at):
    """Train steps 0..5. The reference run saves (async) after step ``save_at`` and
    trains on while it is written; the resumed run (``save_at`` None) starts from
    another init and other RNG seeds, restores, and must end bitwise identical."""
    import torch

    fresh = save_at is not None
    model, opt, sched = w.ddp(init_seed=0 if fresh else 12345)
    seed_all((100 if fresh else 900) + w.rank)
    ckpt = w.checkpointer(root, model, opt, sched)
    start = ckpt.restore()
    for step in range(start, 6):
        w.train(model, opt, sched)
        if step == save_at:
            ckpt.save(step, data_state={"rank": w.rank, "samples": 8 * (step + 1)},
                      extras={"note": "hello", "rank": w.rank})
    ckpt.close()
    return {"start": start, "digest": w.ddp_digest(model, opt, sched),
            "torch_rand": torch.rand(3).tolist(), "py_rand": random.random(),
            "restored_data_state": ckpt.data_state, "restored_extras": ckpt.extras}


def test_ddp_resume_is_bitwise_identical(tmp_path):
    root = str(tmp_path / "ckpt")
    reference = run(tmp_path, 2, {"task": task_ddp, "root": root, "save_at": 2})
    resumed = run(tmp_path, 2, {"task": task_ddp, "root": root, "save_at": None})
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        assert ref["start"] == 0 and res["start"] == 3
        assert res["digest"] == ref["digest"], "weights/optimizer/scheduler differ after resume"
        assert res["torch_rand"] == ref["torch_rand"] and res["py_rand"] == ref["py_rand"]
        assert res["restored_data_state"] == {"rank": rank, "samples": 24}
        assert res["restored_extras"] == {"note": "hello", "rank": rank}
    # each rank got its own RNG back, not rank 0's
    assert reference[0]["torch_rand"] != reference[1]["torch_rand"]
