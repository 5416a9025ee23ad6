"""A pipeline-parallel training job that survives failures and reshards on resume.

    elasticd --standalone --job-id pp --nnodes 1 --nproc-per-node 2 --checkpoint-dir /tmp/pp \\
        examples/pipeline.py --steps 64
    torchrun --standalone --nproc-per-node 4 examples/pipeline.py --steps 64 \\
        --checkpoint-dir /tmp/pp

One model (an input projection, ``--depth`` residual tanh layers, a head) is
split into as many pipeline stages as there are ranks: every rank builds the
whole model from the same seed and deletes what its stage does not own, so the
parameters keep their fully qualified names (``layers.3.weight``) whatever the
number of stages. ``torch.distributed.pipelining`` runs each step as a
``ScheduleGPipe`` over ``--microbatches`` micro-batches, and every stage has
its own optimizer.

Each stage runs on its rank's device (:func:`elastic.device`): the GPU of
its LOCAL_RANK where ``elastic.init()`` chose NCCL (a CUDA host), the CPU
with gloo; activations travel between stages over the same backend.

Pure pipeline parallelism has a single data-parallel replica: every stage
works on the same global batch, so the :class:`elastic.data.ElasticSampler`
is built for one rank of one (its world is the data-parallel world, not the
number of stages).

Checkpoints (every ``--ckpt-every`` steps and after the last step, with
:class:`elastic.checkpoint.Checkpointer`, asynchronous) hold each stage's
parameters and optimizer state by FQN, plus the data position; a run restores
the latest committed one at start, so after a failure it resumes where the
checkpoint left off, and a checkpoint saved with S stages loads with S'.
At a fixed number of stages a resumed run ends bitwise identical to an
uninterrupted one (no randomness is drawn after the initialization).

``--progress-file`` gets one JSON line per step and rank (``t``, ``rank``,
``step``, ``restart``, ``world``, ``pid``, ``loss`` on the last stage, else
null, and ``samples``: the global batch's sample ids). ``--result-file`` gets,
from rank 0 at the end, the SHA-256 of the full model's parameters in FQN
order and the final loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import elastic
from elastic.data import ElasticSampler, SyntheticDataset
from elastic.worker_env import WorkerEnv


class Net(nn.Module):
    """``embed`` -> ``layers.0`` .. ``layers.<depth-1>`` (residual, tanh) -> ``head``.

    A stage is a copy with the modules it does not own removed (``embed`` or
    ``head`` set to None, entries of ``layers`` deleted); ``forward`` skips
    what is missing, so a stage maps its input activations to its output ones.
    """

    def __init__(self, input_dim: int, width: int, depth: int, output_dim: int):
        super().__init__()
        self.embed: nn.Module | None = nn.Linear(input_dim, width)
        self.layers = nn.ModuleDict({str(i): nn.Linear(width, width) for i in range(depth)})
        self.head: nn.Module | None = nn.Linear(width, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = x + torch.tanh(layer(x))
        if self.head is not None:
            x = self.head(x)
        return x


def stage_layers(depth: int, stage: int, num_stages: int) -> list[int]:
    """The contiguous layer indices stage ``stage`` of ``num_stages`` owns (balanced)."""
    return [i for i in range(depth) if i * num_stages // depth == stage]


def build_stage(args: argparse.Namespace, stage: int, num_stages: int
                ) -> tuple[Net, list[str]]:
    """This stage's module and the full model's parameter FQNs, in order.

    The full model is built from ``--seed`` on every rank, so a stage's initial
    weights do not depend on the number of stages.
    """
    torch.manual_seed(args.seed)
    model = Net(args.input_dim, args.width, args.depth, 1)
    fqns = [name for name, _ in model.named_parameters()]
    owned = set(stage_layers(args.depth, stage, num_stages))
    for i in range(args.depth):
        if i not in owned:
            del model.layers[str(i)]
    if stage != 0:
        model.embed = None
    if stage != num_stages - 1:
        model.head = None
    return model, fqns


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64, help="total training steps")
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    ap.add_argument("--ckpt-every", type=int, default=10,
                    help="checkpoint every N steps and after the last (0: never)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="checkpoint root (default: $ELASTIC_CHECKPOINT_DIR; none: no "
                         "checkpoints)")
    ap.add_argument("--progress-file", default=None, help="append a JSON line per step and rank")
    ap.add_argument("--result-file", default=None,
                    help="rank 0 writes the final parameter hash and loss here (JSON)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--global-batch", type=int, default=32, help="samples per step")
    ap.add_argument("--num-samples", type=int, default=512, help="samples per epoch")
    ap.add_argument("--depth", type=int, default=8, help="residual layers (>= stages)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--input-dim", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument("--threads", type=int, default=0,
                    help="intra-op threads per worker (0: torch's default); fix it to compare "
                         "runs bit for bit across launchers and stage counts")
    args = ap.parse_args()
    if args.steps < 0 or args.ckpt_every < 0 or args.microbatches < 1:
        ap.error("--steps and --ckpt-every must be >= 0 and --microbatches >= 1")
    if args.global_batch % args.microbatches:
        ap.error(f"--global-batch {args.global_batch} must be a multiple of --microbatches "
                 f"{args.microbatches}")
    return args


class Trainer:
    """One pipeline stage: its module, schedule, optimizer and checkpointer."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world > args.depth:
            raise SystemExit(f"{self.world} stages need --depth >= {self.world}, "
                             f"got {args.depth}")
        self.device = elastic.device()
        module, self.fqns = build_stage(args, self.rank, self.world)
        self.module = module.to(self.device)
        self.stage = PipelineStage(self.module, self.rank, self.world, self.device)
        self.schedule = ScheduleGPipe(self.stage, args.microbatches,
                                      loss_fn=nn.functional.mse_loss)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=args.lr)
        self.dataset = SyntheticDataset(args.num_samples, args.input_dim, 1, seed=args.seed)
        # One data-parallel replica: every stage takes the whole global batch, as one
        # sampler micro-batch; the schedule splits it into the pipeline's micro-batches.
        self.sampler = ElasticSampler(args.num_samples, args.global_batch, seed=args.seed,
                                      rank=0, world_size=1)
        self.ckpt = None
        root = args.checkpoint_dir or WorkerEnv().checkpoint_dir
        if root and args.ckpt_every:
            from elastic.checkpoint import Checkpointer

            # data=: the sampler's position goes into every save (and every memory
            # snapshot, with the agent's --memory-tier), and restore() puts it back.
            self.ckpt = Checkpointer(root, model=[self.module], optimizer=[self.optimizer],
                                     data=self.sampler)

    def restore(self) -> int:
        """The step to start from: the latest committed checkpoint's + 1, or 0."""
        if self.ckpt is None:
            return 0
        return self.ckpt.restore()

    def train_step(self, indices: list[int]) -> float | None:
        """One optimizer step on the global batch ``indices``; the mean micro-batch
        loss on the last stage, None elsewhere."""
        x, y = (t.to(self.device) for t in self.dataset.batch(indices))
        losses: list[torch.Tensor] = []
        self.optimizer.zero_grad()
        if self.stage.is_first and self.stage.is_last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.stage.is_first:
            self.schedule.step(x)
        elif self.stage.is_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        return torch.stack(losses).mean().item() if losses else None

    def maybe_save(self, step: int) -> None:
        every = self.args.ckpt_every
        if self.ckpt is not None and ((step + 1) % every == 0 or step + 1 == self.args.steps):
            # Taken after the step: the sampler's position is the next step's.
            self.ckpt.save(step)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()

    def owned_parameters(self) -> dict[str, torch.Tensor]:
        """This stage's parameters by FQN, copied to the CPU (for the digest)."""
        return {name: p.detach().to("cpu", copy=True)
                for name, p in self.module.named_parameters()}


def full_model_digest(fqns: list[str], params: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every parameter, in the full model's FQN order (names, dtypes,
    shapes and bytes)."""
    missing = [name for name in fqns if name not in params]
    if missing:
        raise RuntimeError(f"no stage reported parameters {missing[:3]}")
    h = hashlib.sha256()
    for name in fqns:
        tensor = params[name].contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def append_progress(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")  # one write: lines of ranks do not interleave


def write_result(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)  # readers never see half a result


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    elastic.init()
    trainer = Trainer(args)
    rank, world = trainer.rank, trainer.world
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    start = trainer.restore()
    if rank == 0:
        print(f"pipeline: {world} stages on {trainer.device.type}, restart {restart}, "
              f"starting at step {start}", flush=True)

    step, loss = start, None
    while step < args.steps:
        for micro_batches in trainer.sampler:
            indices = [i for batch in micro_batches for i in batch]
            loss = trainer.train_step(indices)
            elastic.step(step)
            if args.progress_file:
                append_progress(args.progress_file, {
                    "t": time.time(), "rank": rank, "step": step, "restart": restart,
                    "world": world, "pid": os.getpid(), "loss": loss, "samples": indices})
            if loss is not None and step % 10 == 0:
                print(f"step {step} loss {loss:.5f}", flush=True)
            trainer.maybe_save(step)
            step += 1
            if args.step_time:
                time.sleep(args.step_time)
            if step >= args.steps:
                break
    trainer.close()

    # Every stage's parameters (and the last stage's loss) to rank 0, for the result.
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object((trainer.owned_parameters(), loss), gathered, dst=0)
    if gathered is not None:
        params = {name: t for owned, _ in gathered for name, t in owned.items()}
        final_loss = gathered[-1][1]  # the last stage's
        digest = full_model_digest(trainer.fqns, params)
        print(f"done: {args.steps} steps, final loss {final_loss}, params sha256 {digest}",
              flush=True)
        if args.result_file:
            write_result(args.result_file, {"sha256": digest, "final_loss": final_loss,
                                            "steps": args.steps, "start": start,
                                            "world": world})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
