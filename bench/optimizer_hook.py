"""What counting optimizer steps as progress costs a training step.

Every worker elasticd starts counts each optimizer step as progress (the
worker bootstrap registers torch's global optimizer step hook, which calls
``elastic.worker.runtime.optimizer_stepped``). This bench times
``optimizer.step()`` of a small model (SGD, the cheapest step there is, so the
hook's share is the largest it can be) with and without that hook, in
interleaved rounds, and prints the medians and the hook's cost per step. The
heartbeat behind the hook is real (its thread runs; no agent answers at the
socket path, which changes nothing for the training thread).

    .venv/bin/python bench/optimizer_hook.py [--steps 20000] [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from elastic import worker_env
from elastic.worker import runtime


def per_step_us(optimizer: torch.optim.Optimizer, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    os.environ[worker_env.AGENT_SOCKET] = os.path.join(tempfile.mkdtemp(), "no-agent.sock")
    model = torch.nn.Linear(16, 16)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    per_step_us(optimizer, 1000)  # warm up
    plain, hooked = [], []
    for _ in range(args.rounds):
        plain.append(per_step_us(optimizer, args.steps))
        handle = register_optimizer_step_post_hook(lambda o, a, k: runtime.optimizer_stepped())
        hooked.append(per_step_us(optimizer, args.steps))
        handle.remove()
    runtime.shutdown()
    result = {"plain_us": round(statistics.median(plain), 3),
              "hooked_us": round(statistics.median(hooked), 3),
              "hook_us": round(statistics.median(h - q for h, q in zip(hooked, plain)), 3),
              "steps": args.steps, "rounds": args.rounds, "torch": torch.__version__}
    print(f"optimizer.step() of Linear(16, 16), SGD: {result['plain_us']} us plain, "
          f"{result['hooked_us']} us with the progress hook: +{result['hook_us']} us per step "
          f"(median of {args.rounds} interleaved rounds of {args.steps} steps)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
