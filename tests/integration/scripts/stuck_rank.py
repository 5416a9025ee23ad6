"""A plain torch training script (no ``elastic`` import) whose ranks get stuck on cue.

Every rank trains a small model with SGD, averaging gradients with
``all_reduce`` (gloo), and appends ``{"rank", "step", "restart", "pid"}`` to
``--progress-file`` after each step. In the first ``--stuck-runs`` runs (1:
restart count 0 only), at step ``--stuck-step``, ``--scenario`` decides who gets stuck and where:

- ``data``: rank ``--stuck-rank`` waits forever for its next batch
  (``next_batch``: a data loader that never yields); the others wait for it
  in ``all_reduce``.
- ``native``: rank ``--stuck-rank`` sleeps in native code (libc's ``sleep``
  through ctypes, in ``native_wait``); the others wait in ``all_reduce``.
- ``collective``: rank ``--stuck-rank`` enters ``barrier``, which its peers
  never enter; they wait in ``all_reduce``.
- ``all``: every rank enters ``all_reduce`` on one of two groups of all the
  ranks (even ranks on the first, odd on the second): all wait together;
  rank ``--stuck-rank`` enters a second after the others.
- ``none``: nobody (a test stops a rank itself).

After those runs it trains ``--steps`` steps and exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import torch
import torch.distributed as dist


def batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def next_batch(loader, stuck: bool):
    if stuck:
        while True:  # a data loader whose worker died: no batch ever comes
            time.sleep(3600)
    return next(loader)


def native_wait() -> None:
    libc = ctypes.CDLL(None)
    while True:  # a signal (the agent's stack dump among them) ends a sleep early
        libc.sleep(3600)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True, choices=["data", "native", "collective", "all",
                                                         "none"])
    p.add_argument("--stuck-rank", type=int, default=1)
    p.add_argument("--stuck-step", type=int, default=5)
    p.add_argument("--stuck-runs", type=int, default=1, help="stuck in this many first runs")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--progress-file", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = batches(rank)
    for step in range(args.steps):
        cue = restart < args.stuck_runs and step == args.stuck_step
        me = cue and rank == args.stuck_rank
        x, y = next_batch(loader, me and args.scenario == "data")
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if me and args.scenario == "native":
            native_wait()
        if me and args.scenario == "collective":
            dist.barrier()
        if cue and args.scenario == "all":
            if me:
                time.sleep(1.0)  # the last to enter
            dist.all_reduce(torch.ones(1), group=groups[rank % 2])
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        with open(args.progress_file, "a") as f:
            f.write(json.dumps({"rank": rank, "step": step, "restart": restart,
                                "pid": os.getpid()}) + "\n")
        time.sleep(args.step_s)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
