"""The chaos campaign's training script: small DDP, one log line per step, a final hash.

Run by every worker of every node (``elasticd ... tests/chaos/train.py``). It

- joins the group with :func:`elastic.init` and reports each step with
  :func:`elastic.step` (the agent's hang detection),
- trains a tiny MLP on a global batch that depends only on the step number
  (``GLOBAL_BATCH`` samples, split evenly over the ranks), so at a fixed
  world size a run resumed from a checkpoint ends bitwise where a run that
  never failed ends, and at another world size it trains on the same data,
- restores the latest committed checkpoint at start and saves (async) every
  ``--ckpt-every`` steps and after the last one; with the memory tier on
  (``$ELASTIC_MEMORY_DIR``, set by ``elasticd --memory-tier``) it also
  snapshots into node memory every ``--memory-every`` steps at
  ``elastic.step(n)`` and restores from memory when that is not older than
  disk (its data position is the step itself: :class:`StepPosition`),
- appends one line per step to a file of its own under ``--log-dir``
  (``r<round>-<node id>-rank<rank>-<pid>.log``)::

      <unix time> <round> <rank> <world size> <step> <this rank's loss, float.hex>

  (the loss lets a fixed-size campaign find the first step where it left the
  fault-free run's path), written with one ``write``, so a killed worker
  leaves whole lines only (a torn last line is skipped by the reader),
- trains ``--steps`` steps, or the number in ``--target-file`` once that exists
  (the harness writes it when its faults are done; every rank reads it each step),
- sleeps ``--step-time`` seconds per step, or what the ``--pace-file``
  says when it exists (the harness slows training while faults remain and
  lets it finish at full speed afterwards; the sleep never changes the
  numbers), and
- on rank 0 writes ``{"sha256", "step", "world", "round"}`` of the final
  parameters to ``--result-file``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import elastic
from elastic.worker_env import WorkerEnv

INPUT_DIM = 8
HIDDEN_DIM = 32
GLOBAL_BATCH = 24  # divisible by 2, 4 and 6 ranks


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True,
                    help="train until this many steps (unless --target-file says otherwise)")
    ap.add_argument("--target-file", default=None,
                    help="once this file exists, the number in it replaces --steps (the harness "
                         "ends the run when its faults are done)")
    ap.add_argument("--log-dir", required=True, help="one step log per process here")
    ap.add_argument("--result-file", default=None, help="rank 0 writes the final hash here")
    ap.add_argument("--checkpoint-dir", default=WorkerEnv().checkpoint_dir)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--memory-every", type=_every, default="auto",
                    help="memory snapshot every this many steps, or auto (with the memory tier)")
    ap.add_argument("--step-time", type=float, default=0.0, help="sleep per step (s)")
    ap.add_argument("--pace-file", default=None,
                    help="a file holding the sleep per step; overrides --step-time")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def _every(text: str) -> int | str:
    return text if text == "auto" else int(text)


class StepPosition:
    """The data position the Checkpointer's ``data=`` saves and restores: the
    batch depends only on the step, so the position is the next step. The
    restored value must agree with what ``restore()`` returns."""

    def __init__(self) -> None:
        self.next_step = 0

    def state_dict(self) -> dict:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict) -> None:
        self.next_step = int(state["next_step"])


def batch(step: int, seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch (the same tensors on every run)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, INPUT_DIM, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    share = GLOBAL_BATCH // world
    return x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]


def params_sha256(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()


def target(args: argparse.Namespace) -> int:
    if args.target_file:
        try:
            with open(args.target_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            pass
    return args.steps


def pace(args: argparse.Namespace) -> float:
    if args.pace_file:
        try:
            with open(args.pace_file) as f:
                return max(0.0, min(5.0, float(f.read().strip() or 0)))
        except (OSError, ValueError):
            pass
    return args.step_time


def _save(ckpt, step: int) -> bool:
    """Start an async save; a failed write (this one or the last) is reported and
    training goes on from the last committed checkpoint. A fence still raises."""
    from elastic.checkpoint import CheckpointWriteError

    try:
        ckpt.save(step, async_=True)
    except CheckpointWriteError as exc:
        print(f"rank {dist.get_rank()}: checkpoint failed, training goes on: {exc}", flush=True)
        return False
    return True


def open_checkpointer(args: argparse.Namespace, model: nn.Module, optimizer,
                      position: StepPosition):
    """The Checkpointer (None without a checkpoint directory) and the step to start
    from, restored; SystemExit when the data position restored disagrees with it."""
    if not args.checkpoint_dir:
        return None, 0
    from elastic.checkpoint import Checkpointer

    ckpt = Checkpointer(args.checkpoint_dir, model=model, optimizer=optimizer, keep=3,
                        data=position, memory_every=args.memory_every)
    step = ckpt.restore()
    if ckpt.restored_path and position.next_step != step:
        raise SystemExit(f"restored {ckpt.restored_path}: data position "
                         f"{position.next_step}, but the state resumes at step {step}")
    return ckpt, step


def write_result(path: str, result: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="find_unused_parameters=True was specified")
    elastic.init(timeout_s=120.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    round_ = WorkerEnv().round
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")

    torch.manual_seed(args.seed)
    # find_unused_parameters=True keeps DDP from rebuilding its gradient buckets after
    # the first iteration. The rebuild reorders the flattened bucket, which moves the
    # chunk boundaries of gloo's ring allreduce and so the order in which each element's
    # gradients are summed: at world size >= 3 the first step of a resumed run would then
    # round differently from the same step of a run that never stopped, and the weights
    # oracle would fail for a reason that has nothing to do with recovery.
    model = DistributedDataParallel(nn.Sequential(
        nn.Linear(INPUT_DIM, HIDDEN_DIM), nn.Tanh(), nn.Linear(HIDDEN_DIM, 1)),
        find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    position = StepPosition()
    ckpt, step = open_checkpointer(args, model, optimizer, position)
    os.makedirs(args.log_dir, exist_ok=True)
    node = WorkerEnv().node_id or "node"
    fd = os.open(os.path.join(args.log_dir, f"r{round_}-{node}-rank{rank}-{os.getpid()}.log"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    source = f" ({ckpt.restored_path})" if ckpt is not None and ckpt.restored_path else ""
    print(f"rank {rank} round {round_}: world {world}, from step {step}{source}, torch threads "
          f"{torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})",
          flush=True)
    saved = step - 1
    while step < target(args):
        x, y = batch(step, args.seed, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        position.next_step = step + 1
        elastic.step(step)
        if ckpt is not None and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0:
            if _save(ckpt, step):
                saved = step
        os.write(fd, f"{time.time():.6f} {round_} {rank} {world} {step} {loss.item().hex()}\n"
                 .encode())
        sleep = pace(args)
        if sleep:
            time.sleep(sleep)
        step += 1
    os.close(fd)
    if ckpt is not None:
        if saved < step - 1:
            ckpt.save(step - 1, async_=False)
        ckpt.close()
    if rank == 0 and args.result_file:
        write_result(args.result_file, {"sha256": params_sha256(model.module), "step": step,
                                        "world": world, "round": round_})
    dist.barrier()
    dist.destroy_process_group()
    gc.freeze()  # skip collecting torch's module graph at exit (slow on small machines)


if __name__ == "__main__":
    main()
