"""What one memory-tier snapshot costs on the goodput bench's model, and the k that "auto" picks.

The model, optimizer and LR schedule are ``examples/common.py``'s (the MLP of
``examples/ddp.py`` wrapped in DDP, AdamW, a 5-step warm-up), in one process
(a gloo group of one rank). Each round trains ``--steps`` real steps (forward, backward, optimizer
step, scheduler step) and takes a snapshot after each, as the tier does at
``elastic.step(n)``: :meth:`SnapshotTier.snapshot` into a fresh directory under
``--memory-root`` (a tmpfs). The first ``--warmup`` snapshots of a round are
left out (the first collects the state and maps the slots). It prints the
median snapshot cost over the rounds, in wall time (what the tier's cadence
measures) and in this thread's CPU time (steadier on a shared machine), and the
k that :func:`choose_every` (the 1% rule of ``memory_every="auto"``) gives for
a step of ``--step-s`` (the goodput bench's median step: 0.064 s).

Only public names are used, so the same file measures an older tree
(before/after, interleaved)::

    .venv/bin/python bench/memory_snapshot.py [--rounds 7] [--steps 200] [--json FILE]
    git archive <rev> | tar -x -C /tmp/base && cp bench/memory_snapshot.py /tmp/base/bench/
    python3 tools/compare_trees.py --base /tmp/base --keys 'snapshot_us|every' \\
        -- bench/memory_snapshot.py

Run it on a quiet machine: it times sub-millisecond work.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from common import _Warmup, build_model, INPUT_DIM  # noqa: E402

from elastic.checkpoint import state  # noqa: E402
from elastic.checkpoint.memory.cadence import BUDGET, Cadence, choose_every  # noqa: E402
from elastic.checkpoint.memory.tier import SnapshotTier  # noqa: E402
from elastic.checkpoint.memory.writer import Identity  # noqa: E402


class _Position:
    """A data position as small as the example's sampler's."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"epoch": 0, "step": self.step, "seed": 0}


def one_round(root: str, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this thread) of each snapshot of one fresh job."""
    torch.manual_seed(0)
    model = DistributedDataParallel(build_model(0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(5))
    data = _Position()
    directory = tempfile.mkdtemp(prefix="bench-snapshot-", dir=root)
    tier = SnapshotTier(directory, Identity("bench", "a", 1, 0, 1),
                        chunks=state.make_chunks(model, optimizer), schedulers=[scheduler],
                        data=data, cadence=Cadence(1, max), local_ranks=1,
                        extras=lambda: None, news_level=0)
    x, y = torch.randn(24, INPUT_DIM), torch.randn(24, 1)
    walls, cpus = [], []
    try:
        for step in range(steps):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            data.step = step + 1
            cpu = time.thread_time()
            wall = tier.snapshot(step)
            cpu = time.thread_time() - cpu
            if step >= warmup:
                walls.append(wall)
                cpus.append(cpu)
    finally:
        tier.close()
        shutil.rmtree(directory, ignore_errors=True)
    return walls, cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200, help="steps (and snapshots) per round")
    ap.add_argument("--warmup", type=int, default=5, help="snapshots left out per round")
    ap.add_argument("--step-s", type=float, default=0.064,
                    help="the step the 1%% rule is applied to (goodput bench's median)")
    ap.add_argument("--memory-root", default="/dev/shm")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = tempfile.mkdtemp(prefix="bench-snapshot-store-")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
    walls, cpus = [], []
    try:
        for _ in range(args.rounds):
            wall, cpu = one_round(args.memory_root, args.steps, args.warmup)
            walls.append(statistics.median(wall))
            cpus.append(statistics.median(cpu))
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    result = {
        "snapshot_us": round(wall * 1e6, 1),
        "snapshot_us_rounds": [round(m * 1e6, 1) for m in walls],
        "snapshot_cpu_us": round(cpu * 1e6, 1),
        "budget_us": round(args.step_s * BUDGET * 1e6, 1),
        "every": choose_every(wall, args.step_s),
        "every_by_cpu": choose_every(cpu, args.step_s),
        "step_s": args.step_s, "rounds": args.rounds, "steps": args.steps,
        "torch": torch.__version__,
    }
    print(f"snapshot {result['snapshot_us']} us wall (rounds {result['snapshot_us_rounds']}), "
          f"{result['snapshot_cpu_us']} us CPU; 1% of a {args.step_s * 1000:.0f} ms step is "
          f"{result['budget_us']} us: auto picks k = {result['every']} "
          f"(k = {result['every_by_cpu']} by CPU time)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
