"""A small FSDP2 training job that survives failures and resumes at any world size.

    elasticd --standalone --job-id demo --nnodes 1 --nproc-per-node 2 \\
        --checkpoint-dir /tmp/ckpt examples/fsdp.py --steps 100
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONPATH=. \\
        torchrun --standalone --nproc-per-node 2 examples/fsdp.py --steps 100 \\
        --checkpoint-dir /tmp/ckpt

Every linear layer is sharded with ``fully_shard`` (FSDP2: parameters are
DTensors, sharded on dim 0 over a 1-D device mesh of all ranks) and so is the
root, on CPU with gloo (or on GPUs with NCCL when CUDA is available). A
checkpoint saved at one world size loads at another: DCP reshards the
DTensors. Gradient accumulation turns the reduce-scatter off for all but the
last micro-batch. Flags, reports and the training loop: ``examples/common.py``.

(torch 2.13's torchrun needs that variable, or restarted workers sometimes fail
to connect in ``init_process_group``; ``PYTHONPATH`` unless the repository is installed.)
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from common import train


def wrap(model: nn.Module, world_size: int) -> nn.Module:
    mesh = init_device_mesh(next(model.parameters()).device.type, (world_size,))
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


if __name__ == "__main__":
    train(__doc__.split("\n")[0], wrap, no_sync)
