"""A worker that ignores SIGTERM, as one blocked in an NCCL collective does
(Python runs a signal handler only between bytecodes, and the collective does
not return while its peer is gone), so only SIGKILL ends it.

No torch. It appends ``<node> <round> <pid>`` to ``--starts`` when it starts;
with ``--fail-node N`` the worker of node N exits 1 ``--fail-after`` seconds
into that node's first round (TORCHELASTIC_RESTART_COUNT 0); every other
worker sleeps until killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--starts", required=True)
    p.add_argument("--fail-node", default="")
    p.add_argument("--fail-after", type=float, default=2.0)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    node = os.environ["ELASTIC_NODE_ID"]
    with open(args.starts, "a") as f:
        f.write(f"{node} {os.environ['ELASTIC_ROUND']} {os.getpid()}\n")
    if node == args.fail_node and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(args.fail_after)
        return 1
    while True:
        time.sleep(1000)


if __name__ == "__main__":
    raise SystemExit(main())
