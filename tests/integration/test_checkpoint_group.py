"""The checkpoint group's object collectives (elastic.checkpoint.group.CheckpointGroup)
between two real gloo processes: payloads that fit in one frame and payloads that
need the second round, gathered and broadcast, arrive whole and in rank order."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from elastic.checkpoint.group import FRAME_BYTES, CheckpointGroup

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = CheckpointGroup.create(None, 60.0)
    big = "x" * (3 * FRAME_BYTES) + str(rank)  # needs the second round
    results = {
        "small": group.all_gather(("problems", rank, [rank] * 3), "testing"),
        "one big": group.all_gather(big if rank == 1 else rank, "testing"),
        "all big": group.all_gather(big, "testing"),
        "broadcast small": group.broadcast(["step-1", "step-0"] if rank == 0 else None, "testing"),
        "broadcast big": group.broadcast(big if rank == 0 else "ignored", "testing"),
        "after": group.all_gather(rank, "testing"),  # still in step
    }
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def test_object_collectives_deliver_small_and_large_payloads(tmp_path):
    from elastic.checkpoint.group import FRAME_BYTES

    outs = _run_two_ranks(_rank, tmp_path)
    big = ["x" * (3 * FRAME_BYTES) + str(r) for r in range(2)]
    for rank, out in enumerate(outs):
        with open(out) as f:
            got = json.load(f)
        assert got["small"] == [["problems", 0, [0, 0, 0]], ["problems", 1, [1, 1, 1]]]
        assert got["one big"] == [0, big[1]]
        assert got["all big"] == big
        assert got["broadcast small"] == ["step-1", "step-0"]
        assert got["broadcast big"] == big[0]
        assert got["after"] == [0, 1], rank
    assert all(os.path.getsize(out) > 3 * FRAME_BYTES for out in outs)


def _rank_with_callers_group(rank: int, store: str, out: str) -> None:
    import threading

    import torch
    import torch.distributed as dist

    from elastic.checkpoint.group import CheckpointGroup

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    callers = dist.new_group([0, 1], backend="gloo")
    group = CheckpointGroup.create(callers, 60.0)
    # The training thread keeps using its group while the checkpoint's collectives run
    # in another thread: on one shared group the two pair up wrongly.
    sums = []

    def train():
        for step in range(200):
            value = torch.tensor([float(step + rank)])
            dist.all_reduce(value, group=callers)
            sums.append(value.item())

    trainer = threading.Thread(target=train)
    trainer.start()
    gathered = [group.all_gather(("rank", rank, round_), "testing") for round_ in range(50)]
    trainer.join(60)
    results = {"own group": group.pg is not callers,
               "same ranks": dist.get_process_group_ranks(group.pg)
               == dist.get_process_group_ranks(callers),
               "backend": dist.get_backend(group.pg),
               "sums right": sums == [2.0 * step + 1 for step in range(200)],
               "gathered right": gathered == [[("rank", 0, r), ("rank", 1, r)]
                                              for r in range(50)]}
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(results, f)


def test_a_callers_group_is_not_shared_with_the_background_collectives(tmp_path):
    for out in _run_two_ranks(_rank_with_callers_group, tmp_path):
        with open(out) as f:
            assert json.load(f) == {"own group": True, "same ranks": True, "backend": "gloo",
                                    "sums right": True, "gathered right": True}


def _run_two_ranks(target, tmp_path) -> list[str]:
    """Run ``target(rank, store, out)`` in two spawned processes, each rank writing
    its results to ``out``; the two paths, once both ended well."""
    context = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    procs = [context.Process(target=target, args=(r, store, outs[r])) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(90)
        assert proc.exitcode == 0
    return outs
