"""A damaged latest checkpoint (rank 1's shard truncated, or one bit of rank 0's
flipped) is refused with a warning that names the file and why, restore falls back
to the previous one, and the next save replaces the damaged directory.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.checkpointing import Worker, launch, run, seed_all, task_check_restore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def task_two_saves(w: Worker, root):
    model, opt, sched = w.ddp()
    seed_all(w.rank)
    ckpt = w.checkpointer(root, model, opt, sched)
    w.train(model, opt, sched, steps=2)
    ckpt.save(1, data_state={"step": 1}, async_=False)
    digest = w.ddp_digest(model, opt, sched)
    w.train(model, opt, sched)
    ckpt.save(2, data_state={"step": 2}, async_=False)
    ckpt.close()
    return {"digest": digest}


def damage(directory: str, kind: str) -> str:
    """Truncate rank 1's shard or flip one bit in rank 0's; the damaged file's path."""
    path = os.path.join(directory, "__1_0.distcp" if kind == "truncate" else "__0_0.distcp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if kind == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0x04]))
    return path


@pytest.mark.parametrize("kind", ["truncate", "bitflip"])
def test_damaged_latest_falls_back_to_previous(tmp_path, kind):
    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": task_two_saves, "root": root})
    path = damage(os.path.join(root, "step-000000000002"), kind)
    ranks = launch(tmp_path, 2, [{"id": "check", "task": task_check_restore, "root": root}])
    for before, after in zip(saved, (r.results["check"] for r in ranks)):
        assert after["start"] == 2, after
        assert after["digest"] == before["digest"]
        assert after["latest_after_save"] == 2  # the damaged latest was replaced
        assert after["verify_after_save"] == {"step-000000000001": True,
                                              "step-000000000002": True}
    word = "truncated" if kind == "truncate" else "corrupt: CRC-32"
    warnings = [line for line in ranks[0].stderr.splitlines()
                if line.startswith("WARNING") and path in line]
    assert warnings and word in warnings[0], "the warning must name the damaged file and why"
