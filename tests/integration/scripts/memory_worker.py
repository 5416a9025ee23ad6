"""A worker that stages memory-tier snapshots the way the Checkpointer will: no torch.

Each step it writes its rank's next slot (alternating slot 0 and 1) under
``$ELASTIC_MEMORY_DIR/own/`` with the layout's protocol (``begin_write``,
the files, ``finish_write``): ``data.bin`` of ``--bytes`` bytes, each byte
a function of (rank, step), so a copy can be checked byte for byte.
After ``--steps`` steps it sleeps until it is stopped.
"""

from __future__ import annotations

import argparse
import os
import time

from elastic.checkpoint.memory import layout


def payload(rank: int, step: int, size: int) -> bytes:
    """The bytes rank ``rank`` stages at ``step``."""
    pattern = bytes((rank * 31 + step * 7 + i) % 251 for i in range(251))
    return (pattern * (size // len(pattern) + 1))[:size]


def stage(memory_dir: str, rank: int, step: int, size: int) -> None:
    env = os.environ
    key = layout.SlotKey(int(env["ELASTIC_ROUND"]), rank, step % layout.SLOTS_PER_RANK)
    slot_dir = os.path.join(layout.own_dir(memory_dir), key.name)
    layout.begin_write(slot_dir)
    data = payload(rank, step, size)
    with open(os.path.join(slot_dir, layout.DATA), "wb") as f:
        f.write(data)
    with open(os.path.join(slot_dir, layout.LOCAL), "wb") as f:
        f.write(b"rank %d step %d" % (rank, step))
    manifest = layout.Manifest(
        job_id=env["ELASTIC_JOB_ID"], node_id=env["ELASTIC_NODE_ID"], round=key.round,
        step=step, rank=rank, world_size=int(env["WORLD_SIZE"]),
        files={layout.DATA: len(data), layout.LOCAL: len(b"rank %d step %d" % (rank, step))},
        written_at=time.time())
    layout.finish_write(slot_dir, manifest)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--step-s", type=float, default=0.05)
    args = p.parse_args()
    memory_dir = os.environ["ELASTIC_MEMORY_DIR"]
    rank = int(os.environ["RANK"])
    for step in range(args.steps):
        stage(memory_dir, rank, step, args.bytes)
        time.sleep(args.step_s)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
