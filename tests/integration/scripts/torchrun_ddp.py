"""A small DDP job on gloo for the torchrun ``etcd3`` backend tests.

Each worker joins the process group from torchrun's environment (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), trains a tiny model for ``--steps`` steps,
checks that every rank ended with the same weights, and writes
``<--out>/<restart>-<rank>.json``::

    {"rank": ..., "world": ..., "group_rank": ..., "restart": ..., "weights_sum": ...}

``--crash-once MARKER``: global rank 1 is killed (SIGKILL) at its start, once (it
creates MARKER first; with MARKER present it trains normally). Its peers then wait in
``init_process_group`` for it: only the rendezvous can get them out.
``--until-world N``: in a world smaller than N, write
``<--out>/running-<world>-<rank>`` and wait (until the agent stops the group
to admit a waiting node; exit 3 after ``--give-up-s``) without importing
torch, which would only slow the test down; train in a world of N.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from gloo_exit import leave


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--crash-once", default=None)
    p.add_argument("--until-world", type=int, default=0)
    p.add_argument("--give-up-s", type=float, default=60.0)
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.crash_once and rank == 1 and not os.path.exists(args.crash_once):
        open(args.crash_once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if world < args.until_world:
        open(os.path.join(args.out, f"running-{world}-{rank}"), "w").close()
        time.sleep(args.give_up_s)
        return 3

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    # The store explicitly, so that rank 0, which hosts it, can leave last: a rank whose
    # store host is gone while it tears its group down dies in C++ ("terminate called
    # without an active exception"), and its launcher fails the job.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        model(torch.full((2, 4), float(rank + 1))).sum().backward()
        opt.step()

    for _ in range(args.steps):
        step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)
    if not all(torch.equal(g, weights) for g in gathered):
        print(f"rank {rank}: replicas disagree", file=sys.stderr)
        return 2
    record = {"rank": rank, "world": world, "group_rank": int(os.environ["GROUP_RANK"]),
              "restart": restart, "weights_sum": float(weights.sum())}
    with open(os.path.join(args.out, f"{restart}-{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    if rank == 0:
        store.wait([f"left-{r}" for r in range(1, world)])  # nothing to wait for alone
    else:
        store.set(f"left-{rank}", "1")
    return 0


if __name__ == "__main__":
    leave(main())  # see gloo_exit: a clean exit may abort
