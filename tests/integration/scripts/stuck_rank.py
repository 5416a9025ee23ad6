"""A plain torch training script (no ``elastic`` import) whose ranks get stuck on cue.

Every rank trains a small model with SGD, averaging gradients with
``all_reduce`` (gloo), and appends ``{"rank", "step", "restart", "pid"}`` to
``--progress-file`` after each step. ``--plan`` says how each run (restart
count 0, 1, ...) gets stuck, one ``SCENARIO:RANK`` a run: at step
``--stuck-step``, the scenario decides who gets stuck and where:

- ``data``: rank RANK waits forever for its next batch (``next_batch``: a
  data loader that never yields); the others wait for it in ``all_reduce``.
- ``native``: rank RANK sleeps in native code (libc's ``sleep`` through
  ctypes, in ``native_wait``); the others wait in ``all_reduce``.
- ``collective``: rank RANK enters ``barrier``, which its peers never enter;
  they wait in ``all_reduce``.
- ``all``: every rank enters ``all_reduce`` on one of two groups of all the
  ranks (even ranks on the first, odd on the second): all wait together;
  rank RANK enters a second after the others.
- ``none``: nobody (a test stops rank RANK itself): its steps take at least
  ``NONE_STEP_S``, time enough for that.

The runs after the plan's train ``--steps`` steps and exit 0.
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


SCENARIOS = ("data", "native", "collective", "all", "none")
NONE_STEP_S = 0.5


def run_plan(text: str) -> list[tuple[str, int]]:
    """``SCENARIO:RANK,...`` as [(scenario, rank)], one a run."""
    plan = [(scenario, int(rank)) for scenario, rank in
            (item.split(":") for item in text.split(","))]
    unknown = [scenario for scenario, _ in plan if scenario not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    return plan


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", type=run_plan, required=True,
                   help="SCENARIO:RANK for each run, in order, comma-separated")
    p.add_argument("--stuck-step", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--progress-file", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    scenario, stuck_rank = args.plan[restart] if restart < len(args.plan) else ("", -1)
    step_s = max(args.step_s, NONE_STEP_S) if scenario == "none" else args.step_s
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = batches(rank)
    for step in range(args.steps):
        cue = step == args.stuck_step
        me = cue and rank == stuck_rank
        x, y = next_batch(loader, me and scenario == "data")
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if me and scenario == "native":
            native_wait()
        if me and scenario == "collective":
            dist.barrier()
        if cue and scenario == "all":
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
        time.sleep(step_s)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
