"""A small DDP training job that runs unchanged under elasticd and torchrun.

    elasticd --standalone --job-id demo --nnodes 1 --nproc-per-node 2 examples/ddp.py --steps 100
    torchrun --standalone --nproc-per-node 2 examples/ddp.py --steps 100

It trains a tiny regression model on synthetic data, reports each step to the
agent with ``elastic.step`` (heartbeats and progress for hang detection), and
with ``--progress-file`` appends one JSON line per step and rank, which the
tests and benchmarks read to see when training resumed after a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import elastic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    ap.add_argument("--progress-file", default=None, help="append a JSON line per step")
    ap.add_argument("--crash", default=None, metavar="RANK:STEP",
                    help="fault injection: this rank exits with 13 at this step, first run only")
    ap.add_argument("--crash-always", action="store_true", help="crash on every run")
    args = ap.parse_args()

    elastic.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1234)
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(100 + rank)
    if rank == 0:
        print(f"training: world size {world}, restart {restart}", flush=True)

    crash_rank, crash_step = map(int, args.crash.split(":")) if args.crash else (-1, -1)
    for step in range(args.steps):
        if rank == crash_rank and step == crash_step and (restart == 0 or args.crash_always):
            print(f"rank {rank}: injected crash at step {step}", flush=True)
            os._exit(13)
        x = torch.randn(64, 32, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        elastic.step(step)
        if args.progress_file:
            with open(args.progress_file, "a") as f:
                f.write(json.dumps({"t": time.time(), "rank": rank, "step": step,
                                    "restart": restart, "world": world,
                                    "pid": os.getpid()}) + "\n")
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
    dist.barrier()
    if rank == 0:
        print(f"done: {args.steps} steps, final loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
