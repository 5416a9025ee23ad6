"""torchrun's rendezvous: our ``etcd3`` backend against torch's ``c10d``, side by side.

For each N (``--sizes``) and each backend, N real torchrun agents (one
process each, ``--nnodes N --nproc-per-node 1``, all on this machine) run a
trivial worker script that only records when it started. Each agent runs
through this file's ``--agent`` mode: it imports torchrun
(``torch.distributed.run``, which loads the rendezvous backends, ours through
its entry point) and then waits for a "go" on its standard input, so that
importing torch (seconds of CPU per process, the same for both backends) is
not measured.

* **rendezvous**: from "go" to the start of the last worker. It covers
  creating the handler (connecting to etcd, or binding/dialling the c10d
  TCPStore), the rendezvous itself, the agents' rank assignment through the
  store the rendezvous returned, and torchrun spawning one worker (the same
  for both). The round closes when the N-th agent joins (MIN = MAX = N), so
  neither backend waits out a last-call window.
* **to exit**: from "go" until every agent exited 0: the above, the workers,
  the exit barrier through the store, and shutting the rendezvous down.

etcd3 runs against one etcd started here (fsync on, as deployed), with the
defaults of ``--rdzv-conf`` (lease TTL 5 s). c10d runs with its defaults:
``--rdzv-endpoint 127.0.0.1:PORT``; the agent that binds the port hosts the
TCPStore, the others dial it (torch's own way for agents on one host). The
backends alternate run by run, ``--repeat`` runs each; rows give the median
with [min .. max] and the ratio etcd3 / c10d of the medians (below 1: ours is
faster). For etcd3 also the etcd requests per agent (unary calls and stream
messages, from etcd's /metrics, over the whole run to exit).

On 2 cores, 8 agents is about the most that fits: beyond, the agents' own
threads (and, for c10d, its random 0-0.3 s first-round delay and 1 s sync
polling) and the scheduler decide the numbers, not the protocols.

    .venv/bin/python bench/torchrun_rendezvous.py [--sizes 2,4,8] [--repeat 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.rendezvous import etcd_metrics, write_json  # noqa: E402
from elastic.net import free_port  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402

BACKENDS = ("etcd3", "c10d")
READY_S = 600.0  # a bound: N agents import torch at once, on 2 cores shared with others
RUN_S = 120.0
WORKER = """import os, sys, time
t = time.time()
with open(os.path.join(sys.argv[1], str(os.getpid())), "w") as f:
    f.write(repr(t))
"""


def agent_main(argv: list[str]) -> int:
    """``--agent TORCHRUN_ARGS...``: import torchrun, say "ready", wait for "go", run it."""
    import torch.distributed.run as torchrun

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 2
    torchrun.main(argv)
    return 0


def run_once(backend: str, n: int, endpoint: str, scratch: str) -> dict:
    """One rendezvous of ``n`` agents on ``backend``; seconds to the last worker and to exit."""
    starts = tempfile.mkdtemp(dir=scratch)
    script = os.path.join(scratch, "worker.py")
    if backend == "etcd3":
        rdzv = ["--rdzv-endpoint", endpoint]
        before = etcd_metrics(endpoint)
    else:
        rdzv = ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        before = None
    args = ["--rdzv-backend", backend, *rdzv, "--rdzv-id", f"bench-{uuid.uuid4().hex[:10]}",
            "--nnodes", str(n), "--nproc-per-node", "1", "--local-addr", "127.0.0.1",
            script, starts]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [os.path.join(starts, f"agent-{i}.log") for i in range(n)]
    agents = []
    for log in logs:
        with open(log, "w") as err:  # a file, not a pipe: a chatty agent never blocks
            agents.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--agent", *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env))
    try:
        for agent, log in zip(agents, logs):
            line = _readline(agent, READY_S)
            if line != "ready":
                raise RuntimeError(f"{backend} agent said {line!r} instead of 'ready': "
                                   f"{_tail(log)}")
        go = time.time()
        for agent in agents:
            agent.stdin.write("go\n")
            agent.stdin.flush()
        deadline = time.monotonic() + RUN_S
        codes = [agent.wait(timeout=max(deadline - time.monotonic(), 1)) for agent in agents]
        exited = time.time()
        if codes != [0] * n:
            failed = next(log for code, log in zip(codes, logs) if code)
            raise RuntimeError(f"{backend} agents exited {codes}: {_tail(failed)}")
        started = [float(open(os.path.join(starts, f)).read()) for f in os.listdir(starts)
                   if not f.startswith("agent-")]
        if len(started) != n:
            raise RuntimeError(f"{backend}: {len(started)} workers started, expected {n}")
        row = {"backend": backend, "n": n, "rendezvous_s": max(started) - go,
               "exit_s": exited - go}
        if before is not None:
            after = etcd_metrics(endpoint)
            requests = sum(after[k] - before[k] for k in ("unary_requests", "stream_messages"))
            row["etcd_requests_per_agent"] = requests / n
        return row
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    """The first line ``proc`` prints, or "" when it prints none within ``timeout_s``."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline().strip()


def _tail(path: str) -> str:
    with open(path) as f:
        return f.read()[-3000:]


def _spread(values: list[float]) -> str:
    return (f"{statistics.median(values):6.3f} s [{min(values):.3f} .. {max(values):.3f}]")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--agent":
        return agent_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write every run to this file")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    scratch = tempfile.mkdtemp(prefix="torchrun-rdzv-bench-")
    with open(os.path.join(scratch, "worker.py"), "w") as f:
        f.write(WORKER)
    runs: list[dict] = []
    print(f"# {os.cpu_count()} CPUs; N torchrun agents, --nnodes N, one trivial worker each; "
          f"{args.repeat} runs per row; times from 'go' (torch already imported)", flush=True)
    try:
        with EtcdServer() as server:
            server.start()
            for n in sizes:
                rows = {b: [] for b in BACKENDS}
                for _ in range(args.repeat):
                    for backend in BACKENDS:
                        rows[backend].append(run_once(backend, n, server.endpoint, scratch))
                runs.extend(r for b in BACKENDS for r in rows[b])
                medians = {b: statistics.median(r["rendezvous_s"] for r in rows[b])
                           for b in BACKENDS}
                for backend in BACKENDS:
                    rdzv = [r["rendezvous_s"] for r in rows[backend]]
                    exit_s = [r["exit_s"] for r in rows[backend]]
                    extra = ""
                    if backend == "etcd3":
                        per_agent = [r["etcd_requests_per_agent"] for r in rows[backend]]
                        extra = f"  etcd requests/agent {statistics.median(per_agent):.0f}"
                    print(f"N={n:<3d} {backend:6s} rendezvous {_spread(rdzv)}   to exit "
                          f"{_spread(exit_s)}{extra}", flush=True)
                print(f"N={n:<3d} ratio etcd3/c10d of the rendezvous medians: "
                      f"{medians['etcd3'] / medians['c10d']:.2f}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
