"""Rendezvous benchmark: how fast N nodes agree on a round, and at what etcd cost.

For each N, N simulated nodes live in this process, each a full
:class:`~elastic.rendezvous.node.RendezvousNode` with its own lease (and
keep-alive) and its own watches, against one real etcd on this machine. N-1
nodes join first; the clock starts when the last one joins and stops when all
N have seen the committed round.

Two cases:

* ``--nnodes N:N`` (the round closes on the last join): the protocol's own
  latency.
* ``--nnodes N:2N`` with the settle window: the round closes once no node has
  arrived for ``settle`` seconds, so the time is the window plus overhead.

etcd operations are counted by the store client for the whole rendezvous
(registration, election, watches, the round commit) and reported per node.

    python bench/rendezvous.py [--sizes 8,64,256] [--repeat 3] [--settle 1.0] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.rendezvous.api import NodeInfo, RendezvousConfig  # noqa: E402
from elastic.rendezvous.node import RendezvousNode  # noqa: E402
from elastic.store.etcd import EtcdStore  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402


def _start_all(nodes: list[RendezvousNode], threads: int = 16) -> None:
    """Start nodes concurrently (registration is a few round trips each)."""
    chunks = [nodes[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=lambda c=c: [n.start() for n in c]) for c in chunks]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def run_once(endpoint: str, n: int, max_nodes: int, settle_s: float, tag: str) -> dict:
    job = f"bench-{tag}-{n}-{time.monotonic_ns()}"
    config = RendezvousConfig(job_id=job, min_nodes=n, max_nodes=max_nodes, settle_s=settle_s,
                              lease_ttl_s=10.0)
    store = EtcdStore(endpoint)
    nodes = [RendezvousNode(store, config, NodeInfo(node_id=f"node{i:04d}", host="127.0.0.1"))
             for i in range(n)]
    try:
        ops_before = store.ops.snapshot()
        _start_all(nodes[:-1])
        t0 = time.perf_counter()
        nodes[-1].start()
        deadline = time.monotonic() + 60
        for node in nodes:
            left = deadline - time.monotonic()
            r = node.wait_for_round(after=0, timeout_s=max(left, 0.1))
            assert len(r.members) == n, f"round has {len(r.members)} members, expected {n}"
        elapsed = time.perf_counter() - t0
        ops_after = store.ops.snapshot()
        ops = {k: ops_after.get(k, 0) - ops_before.get(k, 0) for k in ops_after}
        requests = sum(v for k, v in ops.items() if k not in ("watch_event", "lease_keepalive"))
        return {"n": n, "seconds": elapsed, "requests": requests,
                "requests_per_node": requests / n, "watch_events": ops.get("watch_event", 0),
                "ops": ops}
    finally:
        for node in nodes:
            node.stop()
        store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,64,256")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    with EtcdServer() as server:
        server.start()
        for case, settle in (("closes on last join", 0.0), ("settle window", args.settle)):
            for n in sizes:
                max_nodes = n if settle == 0.0 else 2 * n
                runs = [run_once(server.endpoint, n, max_nodes, settle, "x" if settle else "s")
                        for _ in range(args.repeat)]
                median = statistics.median(r["seconds"] for r in runs)
                row = {"case": case, "nnodes": f"{n}:{max_nodes}", "settle_s": settle, "n": n,
                       "median_s": median, "runs_s": [r["seconds"] for r in runs],
                       "requests_per_node": runs[0]["requests_per_node"],
                       "watch_events_per_node": runs[0]["watch_events"] / n,
                       "ops": runs[0]["ops"]}
                results.append(row)
                print(f"{case:20s} nnodes {row['nnodes']:>8s}  median {median:6.3f} s  "
                      f"(runs {', '.join(f'{s:.3f}' for s in row['runs_s'])})  "
                      f"etcd requests/node {row['requests_per_node']:.1f}  "
                      f"watch events/node {row['watch_events_per_node']:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
