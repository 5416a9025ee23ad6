"""A plain torchrun script (no ``elastic`` import): checks the worker environment, all-reduces.

Run by ``torchrun`` or ``elasticd``, every worker checks that the variables
torch's ``LocalElasticAgent`` sets are there and agree with each other and
with what the test expects, forms a gloo group from them (``env://``), checks
through an all-reduce and an all-gather that the ranks are dense and the
world is what the variables say, prints one line
``torchrun_env ok {json of the variables}`` and exits 0. Any mismatch exits 3
with the reason on stderr.

``--min-world N``: in a round with a smaller world (a node that formed a
round before its peers joined), wait to be restarted into a larger one
instead of failing; the agent stops this worker when the round grows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from gloo_exit import leave

NAMES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
         "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def fail(reason: str) -> None:
    print(f"torchrun_env FAILED: {reason}", file=sys.stderr, flush=True)
    sys.exit(3)


def check(env: dict[str, str], args: argparse.Namespace) -> None:
    missing = [n for n in NAMES if not env.get(n)]
    if missing:
        fail(f"missing {missing}")
    n = {k: int(env[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE",
                                  "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")}
    expected = {
        "dense ranks": n["RANK"] == n["GROUP_RANK"] * n["LOCAL_WORLD_SIZE"] + n["LOCAL_RANK"],
        "world": n["WORLD_SIZE"] == n["GROUP_WORLD_SIZE"] * n["LOCAL_WORLD_SIZE"],
        "role rank": (n["ROLE_RANK"], n["ROLE_WORLD_SIZE"]) == (n["RANK"], n["WORLD_SIZE"]),
        "local world": n["LOCAL_WORLD_SIZE"] == args.nproc and 0 <= n["LOCAL_RANK"] < args.nproc,
        "role": env["ROLE_NAME"] == args.role,
        "max restarts": n["TORCHELASTIC_MAX_RESTARTS"] == args.max_restarts,
        "run id": args.run_id is None or env["TORCHELASTIC_RUN_ID"] == args.run_id,
        "agent store": env["TORCHELASTIC_USE_AGENT_STORE"] == "False",
        # torchrun forces 1; elasticd leaves torch's default (3) unless its own
        # environment sets one (agent.assign), which these tests' does not.
        "nccl errors": "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env,
        "threads": args.nproc == 1 or env.get("OMP_NUM_THREADS") == "1",
        "error file": os.path.isabs(env["TORCHELASTIC_ERROR_FILE"]),
    }
    wrong = [what for what, ok in expected.items() if not ok]
    if wrong:
        fail(f"{wrong} in {json.dumps({k: env.get(k) for k in NAMES})}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument("--role", default="default")
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--run-id", default=None)
    p.add_argument("--min-world", type=int, default=1)
    args = p.parse_args()
    env = dict(os.environ)
    check(env, args)
    world = int(env["WORLD_SIZE"])
    if world < args.min_world:
        time.sleep(60)  # the agent restarts this worker into the larger round
        fail(f"still in a world of {world} after 60 s")

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    if (dist.get_rank(), dist.get_world_size()) != (int(env["RANK"]), world):
        fail(f"the group says rank {dist.get_rank()} of {dist.get_world_size()}")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    ranks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(ranks, torch.tensor([float(dist.get_rank())]))
    gathered = [int(r.item()) for r in ranks]
    if total.item() != world * (world - 1) / 2 or gathered != list(range(world)):
        fail(f"all-reduce {total.item()}, all-gather {ranks}")
    dist.destroy_process_group()
    print("torchrun_env ok " + json.dumps({k: env[k] for k in NAMES}), flush=True)
    return 0


if __name__ == "__main__":
    leave(main())  # see gloo_exit: a clean exit may abort
