"""What the example training scripts share: flags, data, model, the training loop.

``examples/ddp.py`` and ``examples/fsdp.py`` differ only in how they wrap the
model and how they skip the gradient sync of a micro-batch; everything else is
here, so both recover the same way:

- **Data.** A deterministic :class:`~elastic.data.SyntheticDataset` (sample
  ``i`` is the same tensor pair everywhere) read through an
  :class:`~elastic.data.ElasticSampler`: a constant global batch split over
  the ranks in micro-batches, gradients accumulated over them, so a step
  trains on the same global batch at any world size.
- **Checkpoints** (with ``--checkpoint-dir`` or ``$ELASTIC_CHECKPOINT_DIR``): an
  :class:`~elastic.checkpoint.Checkpointer` restores the latest committed
  checkpoint at start (model, optimizer, LR schedule, RNG, data position) and
  saves every ``--ckpt-every`` steps (asynchronously unless ``--sync-ckpt``)
  and after the last step. Without a directory the job trains from step 0 on
  every start. The sampler is the Checkpointer's ``data=``: its position is
  saved with every checkpoint and loaded back by ``restore()``.
- **Memory tier** (with ``--memory-dir`` or ``$ELASTIC_MEMORY_DIR``, which
  ``elasticd --memory-tier`` sets): the same Checkpointer also snapshots the
  state into node-local host memory at ``elastic.step(n)``, every step or
  every ``--memory-every`` steps (default ``auto``: within 1% of the step
  time), and ``restore()`` resumes from memory when it holds a newer step
  than the disk: a crash then loses at most the step in progress.
- **Reports.** ``elastic.step(n)`` after each step (progress for the agent's
  hang detection); with ``--progress-file`` one JSON line per step and rank::

      {"t": 1700000000.0, "rank": 0, "step": 7, "restart": 1, "world": 2, "pid": 4242,
       "epoch": 0, "loss": 0.52, "samples": [17, 3, ...]}

  ``loss`` is the mean loss over the whole global batch (the same on every
  rank), ``samples`` the dataset indices this rank trained on in that step.
  With ``--result-file`` rank 0 writes one JSON line at the end: ``sha256`` of
  every parameter gathered in full (names, dtypes, shapes and bytes), the
  final ``loss``, the ``step`` count and the ``world`` size.

At a fixed world size a run resumed from a checkpoint ends with bitwise the
same parameters as a run that never stopped (tests/integration/test_oracle.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import time
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import elastic
from elastic.data import ElasticSampler, SyntheticDataset
from elastic.worker_env import WorkerEnv

INPUT_DIM = 16
HIDDEN_DIM = 64

# wrap(model, world_size) -> the distributed model; no_sync(model) -> a context in
# which backward accumulates gradients locally, without communication.
Wrap = Callable[[nn.Module, int], nn.Module]
NoSync = Callable[[nn.Module], ContextManager[Any]]


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=100, help="train until this many steps are done")
    ap.add_argument("--step-time", type=float, default=0.05, help="extra seconds per step")
    ap.add_argument("--progress-file", default=None, help="append a JSON line per step and rank")
    ap.add_argument("--result-file", default=None,
                    help="rank 0 writes the final parameter hash and loss here (JSON)")
    ap.add_argument("--checkpoint-dir", default=WorkerEnv().checkpoint_dir,
                    help="save and resume here (default: $ELASTIC_CHECKPOINT_DIR; none: "
                         "no checkpoints)")
    ap.add_argument("--ckpt-every", type=int, default=10,
                    help="save every this many steps (0: only after the last step)")
    ap.add_argument("--sync-ckpt", action="store_true",
                    help="save synchronously (default: stage to memory, write in background)")
    ap.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep")
    ap.add_argument("--memory-dir", default=WorkerEnv().memory_dir,
                    help="the memory tier's node-local directory (default: "
                         "$ELASTIC_MEMORY_DIR; none: no memory tier)")
    ap.add_argument("--memory-every", type=_every, default="auto",
                    help="memory snapshot every this many steps, or auto")
    ap.add_argument("--num-samples", type=int, default=24 * 10 + 5,
                    help="samples per epoch (the tail short of a global batch is dropped)")
    ap.add_argument("--global-batch", type=int, default=24,
                    help="samples per step over all ranks, at any world size")
    ap.add_argument("--micro-batch", type=int, default=2,
                    help="samples per forward/backward; must divide global-batch / world size")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--crash", default=None, metavar="RANK:STEP",
                    help="fault injection: this rank exits with 13 at this step, first run only")
    ap.add_argument("--crash-always", action="store_true", help="crash on every run")
    return ap.parse_args()


def _every(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_model(dropout: float) -> nn.Sequential:
    """A small MLP; dropout makes the result depend on the RNG state, so restoring
    the RNG is part of what a bitwise resume proves."""
    return nn.Sequential(
        nn.Linear(INPUT_DIM, HIDDEN_DIM), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(HIDDEN_DIM, HIDDEN_DIM), nn.ReLU(), nn.Dropout(dropout),
        nn.Linear(HIDDEN_DIM, 1))


def train(description: str, wrap: Wrap, no_sync: NoSync) -> None:
    """The whole job: init, restore, train ``--steps`` steps, report, save, hash."""
    args = parse_args(description)
    elastic.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    # One GPU per worker when there are GPUs (elastic.init picked it), else the CPU.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = wrap(build_model(args.dropout).to(device), world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Warmup(5))
    torch.manual_seed(args.seed + 1 + rank)  # dropout: a stream of its own per rank
    dataset = SyntheticDataset(args.num_samples, INPUT_DIM, 1, seed=args.seed)
    sampler = ElasticSampler(len(dataset), args.global_batch, micro_batch_size=args.micro_batch,
                             seed=args.seed, rank=rank, world_size=world)

    ckpt = None
    step = 0
    if args.checkpoint_dir:
        from elastic.checkpoint import Checkpointer

        ckpt = Checkpointer(args.checkpoint_dir, model=model, optimizer=optimizer,
                            scheduler=scheduler, keep=args.keep, data=sampler,
                            memory_dir=args.memory_dir, memory_every=args.memory_every)
        step = ckpt.restore()  # also puts the sampler back where the state was taken
    saved = step - 1  # the last step saved or being saved (-1: none)
    if rank == 0:
        print(f"training: world size {world}, restart {restart}, from step {step}"
              + (f" ({ckpt.restored_path})" if ckpt and ckpt.restored_path else ""), flush=True)

    crash_rank, crash_step = map(int, args.crash.split(":")) if args.crash else (-1, -1)
    loss = None
    while step < args.steps:
        for micro_batches in sampler:  # the rest of the epoch
            if rank == crash_rank and step == crash_step and (restart == 0 or args.crash_always):
                print(f"rank {rank}: injected crash at step {step}", flush=True)
                os._exit(13)
            loss = _train_step(model, optimizer, dataset, micro_batches, no_sync, device)
            scheduler.step()
            elastic.step(step)
            if ckpt is not None and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0:
                if _save(ckpt, step, sampler, async_=not args.sync_ckpt):
                    saved = step
            if args.progress_file:
                _append_line(args.progress_file, {
                    "t": time.time(), "rank": rank, "step": step, "restart": restart,
                    "world": world, "pid": os.getpid(), "epoch": sampler.epoch, "loss": loss,
                    "samples": [i for batch in micro_batches for i in batch]})
            if rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)
            if args.step_time:
                time.sleep(args.step_time)
            step += 1
            if step >= args.steps:
                break

    if ckpt is not None:
        if saved < step - 1:  # leave the final state committed, to resume or extend the run
            ckpt.save(step - 1, data_state=sampler.state_dict(), async_=False)
        ckpt.close()  # waits for a save in flight; raises its failure
    digest = params_sha256(model)  # a collective: every rank takes part
    if rank == 0:
        print(f"done: {step} steps, final loss "
              f"{'n/a' if loss is None else f'{loss:.4f}'}, params sha256 {digest}", flush=True)
        if args.result_file:
            _write_atomically(args.result_file, {"sha256": digest, "loss": loss, "step": step,
                                                  "world": world, "restart": restart})
    dist.barrier()
    dist.destroy_process_group()
    # Interpreter shutdown garbage-collects torch's whole module graph (seconds when several
    # workers exit at once on a small machine); nothing left needs collecting, so skip it.
    gc.freeze()


def _save(ckpt: Any, step: int, sampler: ElasticSampler, *, async_: bool) -> bool:
    """Checkpoint after ``step``'s optimizer update (the sampler's position then resumes at
    ``step + 1``). A failed write (this one, or the previous asynchronous one, which
    surfaces here and cancels this one) is reported and training goes on: the last
    committed checkpoint stays intact. Every rank gets the same outcome. Returns whether
    this save was started. A fenced commit (a zombie of an old round) still raises."""
    from elastic.checkpoint import CheckpointWriteError

    try:
        ckpt.save(step, data_state=sampler.state_dict(), async_=async_)
    except CheckpointWriteError as exc:
        if dist.get_rank() == 0:
            print(f"checkpoint failed, training goes on: {exc}", flush=True)
        return False
    return True


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, dataset: SyntheticDataset,
                micro_batches: list[list[int]], no_sync: NoSync, device: torch.device) -> float:
    """One optimizer step over this rank's micro-batches; returns the global batch's mean loss.

    Gradients are synchronized once, in the last micro-batch's backward. Each
    micro-batch's loss is divided by the number of micro-batches, so the
    accumulated gradient is the mean over this rank's share; the data-parallel
    reduction averages over ranks, which makes it the global batch's mean at
    any world size (all micro-batches have the same size).
    """
    total = torch.zeros((), device=device)
    for index, indices in enumerate(micro_batches):
        x, y = (t.to(device) for t in dataset.batch(indices))
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync(model):
            loss = nn.functional.mse_loss(model(x), y) / len(micro_batches)
            loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def params_sha256(model: nn.Module) -> str | None:
    """sha256 over every parameter and buffer in full (gathered from the shards
    under FSDP), by name; a collective, the digest on rank 0 (None elsewhere)."""
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


class _Warmup:
    """Linear LR warm-up (a class, not a lambda: the scheduler state then pickles)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)


def _append_line(path: str, record: dict) -> None:
    """One ``write`` on an O_APPEND descriptor: lines of several ranks never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _write_atomically(path: str, record: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
