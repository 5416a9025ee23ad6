"""A plain torchrun-style DDP script: torch only, no ``elastic`` import (bench/recovery.py).

What a user brings unchanged from torchrun: it reads the launcher's environment
through ``init_process_group("env://")``, never reports a step to the agent and
never checkpoints (every restart trains from step 0). Like examples/ddp.py it
appends one JSON line per completed step and rank to ``--progress-file`` (wall
time ``t``, ``rank``, ``step``, ``restart``, ``world``, ``pid``) and prints
``training: world size N, restart R`` once the process group is formed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--progress-file", required=True)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"training: world size {world}, restart {restart}", flush=True)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randn(8, 32)
    for step in range(args.steps):
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()
        time.sleep(args.step_time)
        with open(args.progress_file, "a") as f:
            f.write(json.dumps({"t": time.time(), "rank": rank, "step": step,
                                "restart": restart, "world": world, "pid": os.getpid()}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
