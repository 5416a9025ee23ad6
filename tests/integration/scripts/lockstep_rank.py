"""A plain torch DDP job on gloo (it never imports ``elastic``) with one rank slowed on purpose.

Every rank trains the same tiny model in lockstep: DDP allreduces the
gradients in every backward pass, so a rank's peers wait there for it and
every rank's steps take the slowest's wall time. Each step first sleeps
``--step-s`` (a batch that takes time to arrive: wall time for every rank,
busy time for none); rank ``--slow-rank``, once the file ``--slow-when``
exists, then spins ``--spin-s`` more before its backward pass: a slower
device, CPU work its peers wait for. Its optimizer steps are its progress,
counted by the hook the worker bootstrap installs, and their wall and busy
times reach the agent with its heartbeats. Rank 0 says when training is over
(the file ``--over-when`` exists, or ``--run-s`` passed), so that every rank
stops after the same step.

It prints ``lockstep_rank: rank R (node N) stepped S times, slowed: yes|no`` at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gloo_exit import leave


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-s", type=float, default=60.0)
    p.add_argument("--over-when", default="")
    p.add_argument("--step-s", type=float, default=0.03)
    p.add_argument("--spin-s", type=float, default=0.04)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-when", default="")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    node = os.environ.get("ELASTIC_NODE_ID", "?")
    dist.init_process_group("gloo")
    # The store rank 0's process serves: so that it leaves last (see the end).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    slowed = False
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    over = torch.zeros(1)
    steps, start = 0, time.monotonic()
    while True:
        time.sleep(args.step_s)
        optimizer.zero_grad()
        loss = model(data).square().mean()
        slowed = slowed or (rank == args.slow_rank and os.path.exists(args.slow_when))
        if slowed:
            spin(args.spin_s)
        loss.backward()  # the allreduce: the others wait here for the slowed rank
        optimizer.step()
        steps += 1
        over[0] = float(rank == 0 and (time.monotonic() - start >= args.run_s
                                       or os.path.exists(args.over_when)))
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item():
            break
    print(f"lockstep_rank: rank {rank} (node {node}) stepped {steps} times, "
          f"slowed: {'yes' if slowed else 'no'}", flush=True)
    dist.destroy_process_group()
    # A rank whose store host is gone while it tears its group down can die in
    # C++: rank 0, whose process hosts it, leaves last.
    if rank == 0:
        store.wait([f"left-{r}" for r in range(1, world)])
    else:
        store.set(f"left-{rank}", "1")
    return 0


if __name__ == "__main__":
    leave(main())  # see gloo_exit: a clean exit may abort
