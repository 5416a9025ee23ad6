"""A training stand-in for agent fault tests: no torch, no process group.

It "trains" by sleeping ``--step-s`` per step for ``--work-s`` seconds of
wall time and appends one JSON line per step to its own file under
``--progress-dir``::

    {"t": <time.time()>, "node": ..., "round": ..., "rank": ..., "pid": ...,
     "step": ...}

Each worker process writes its own file (``<node>-<pid>.jsonl``), so files are
never shared. With ``--final FILE`` it writes ``FILE`` (its contents: JSON with
``t`` and ``pid``) after the work and before exiting; with ``--exit-code N``
it then exits N. With ``--hold-file FILE`` it keeps working past
``--work-s`` for as long as FILE exists (a test removes it once the scenario
has played out, so no worker can finish early by accident). What matters in
these tests is the agent's behaviour, so the worker only needs to be
observable from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--progress-dir", required=True)
    p.add_argument("--work-s", type=float, default=60.0)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--final", default=None)
    p.add_argument("--exit-code", type=int, default=0)
    p.add_argument("--hold-file", default=None)
    args = p.parse_args()

    node = os.environ.get("ELASTIC_NODE_ID", "?")
    record = {"node": node, "round": int(os.environ.get("ELASTIC_ROUND", "0")),
              "rank": int(os.environ.get("RANK", "-1")), "pid": os.getpid()}
    path = os.path.join(args.progress_dir, f"{node}-{os.getpid()}.jsonl")
    start = time.monotonic()
    step = 0
    with open(path, "a", buffering=1) as out:
        while True:
            out.write(json.dumps({"t": time.time(), "step": step, **record}) + "\n")
            out.flush()
            held = args.hold_file is not None and os.path.exists(args.hold_file)
            if time.monotonic() - start >= args.work_s and not held:
                break
            step += 1
            time.sleep(args.step_s)
    if args.final:
        tmp = args.final + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"t": time.time(), "pid": os.getpid(), "node": node}, f)
        os.replace(tmp, args.final)
    print(f"progress_worker {node} pid {os.getpid()}: done after {step} steps, "
          f"exiting {args.exit_code}", flush=True)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
