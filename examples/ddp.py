"""A small DDP training job that survives failures and runs unchanged under elasticd and torchrun.

    elasticd --standalone --job-id demo --nnodes 1 --nproc-per-node 2 \\
        --checkpoint-dir /tmp/ckpt examples/ddp.py --steps 100
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONPATH=. \\
        torchrun --standalone --nproc-per-node 2 examples/ddp.py --steps 100 \\
        --checkpoint-dir /tmp/ckpt

It trains a small MLP on synthetic data with gradient accumulation over
micro-batches (``no_sync`` for all but the last), checkpoints every
``--ckpt-every`` steps and resumes from the latest committed checkpoint, at
the same or another world size. Flags, reports and the training loop:
``examples/common.py``.

(torch 2.13's torchrun needs that variable, or restarted workers sometimes fail
to connect in ``init_process_group``; ``PYTHONPATH`` unless the repository is installed.)
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common import train


def wrap(model: nn.Module, world_size: int) -> nn.Module:
    return DistributedDataParallel(model)


def no_sync(model: nn.Module):
    return model.no_sync()


if __name__ == "__main__":
    train(__doc__.split("\n")[0], wrap, no_sync)
