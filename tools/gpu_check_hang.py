"""The GPU check's stuck worker (tools/gpu_check.py, check ``hang``).

    gpu_check_hang.py PROGRESS_FILE MARKER_FILE

Holds 4 GiB on its GPU, reports five steps to the agent, then, the first time
(no MARKER_FILE yet), queues a kernel that spins for about a minute and waits
for it: a worker stuck in CUDA, which no Python signal handler interrupts. The
restarted worker (MARKER_FILE exists) reports its five steps and exits 0.
Each event is appended to PROGRESS_FILE as one JSON line with the wall time.
"""

import json
import os
import sys
import time

import torch

import elastic


def note(path: str, **record) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), "pid": os.getpid(), **record}) + "\n")


def main() -> None:
    progress, marker = sys.argv[1], sys.argv[2]
    elastic.init()
    held = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    held.fill_(1)
    for step in range(5):
        torch.cuda.synchronize()
        elastic.step(step)
        note(progress, event="step", step=step)
        time.sleep(0.1)
    if not os.path.exists(marker):
        open(marker, "w").close()
        note(progress, event="stuck", held_gib=held.numel() / 2**30)
        torch.cuda._sleep(60 * 2_000_000_000)  # cycles: about a minute at ~2 GHz
        torch.cuda.synchronize()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
