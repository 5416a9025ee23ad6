"""A plain torch script (it never imports ``elastic``) with ranks slowed on purpose.

Each rank trains a tiny model on its own for ``--run-s`` seconds of wall
time (or until the file ``--over-when`` exists), sleeping ``--step-s`` per step, and ``--slow-s`` more where it is slowed
on purpose: rank ``--slow-rank``, or every rank of node ``--slow-node``
(``ELASTIC_NODE_ID``). Its optimizer steps are its progress, counted by the
hook the worker bootstrap installs, and their times reach the agent with its
heartbeats. No collective per step: where ranks run in lockstep each takes its
slowest peer's time, and step times cannot tell the straggler apart.

It prints ``slow_rank: rank R (node N) stepped S times, slowed: yes|no`` at the end.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-s", type=float, default=20.0)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--slow-s", type=float, default=0.05)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-node", default="")
    p.add_argument("--over-when", default="", help="end once this file exists")
    args = p.parse_args()

    rank, node = int(os.environ["RANK"]), os.environ.get("ELASTIC_NODE_ID", "?")
    slowed = rank == args.slow_rank or node == args.slow_node
    pause_s = args.step_s + (args.slow_s if slowed else 0.0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 4)
    steps, start = 0, time.monotonic()
    over = (lambda: os.path.exists(args.over_when)) if args.over_when else (lambda: False)
    while time.monotonic() - start < args.run_s and not over():
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
        steps += 1
        time.sleep(pause_s)
    print(f"slow_rank: rank {rank} (node {node}) stepped {steps} times, "
          f"slowed: {'yes' if slowed else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
