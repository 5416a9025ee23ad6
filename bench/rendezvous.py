"""Rendezvous benchmark: how fast N nodes agree on a round, and at what etcd cost.

For each N, N simulated nodes are spread over ``--processes`` worker processes
(by default one per 128 nodes), each process with one
:class:`~elastic.store.etcd.EtcdStore` shared by its nodes, as agents on many
machines share one etcd cluster. Every node is a full
:class:`~elastic.rendezvous.node.RendezvousNode` with its own lease (kept alive)
and its own watches, against one real etcd on this machine. N-1 nodes join
first; the clock starts when the last one joins and stops when all N have seen
the committed round (the latest of the processes' "all my nodes saw it" times;
``time.monotonic`` is one clock for all processes on Linux).

Two cases:

* ``--nnodes N:N`` (the round closes on the last join): the protocol's own
  latency. Target at 1,024 nodes: within 2 s.
* ``--nnodes N:2N`` with the settle window: the round closes once no node has
  arrived for ``settle`` seconds, so the time is the window plus overhead.

What etcd pays, from both ends:

* client side: requests counted by the stores for the whole rendezvous
  (registration, election, watch creates, reads, the round commit), per node;
  keep-alives and watch events apart;
* server side, from etcd's own ``/metrics`` before the first node starts and
  after the last saw the round (so the keep-alives of that time are in):
  gRPC requests handled (unary calls, and stream messages received), bytes sent
  to clients (the watch fan-out), raft proposals committed, and etcd's CPU
  seconds. CPU per request and bytes per node are the "cost per operation"
  that the model at the end extrapolates from.

The model (printed after the table) takes the largest measured size and
scales each cost by how it grows: requests and proposals with N, the round
record with N, so the fan-out of the round to N watchers with N squared, and
the steady keep-alive load with N / (TTL/3). It also says where a record
limit is crossed (our 1 MiB record limit, etcd's default 1.5 MiB request limit).

    python bench/rendezvous.py [--sizes 64,256,1024] [--repeat 3] [--settle 1.0]
                               [--processes P] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.records import MAX_RECORD_BYTES  # noqa: E402
from elastic.rendezvous.api import NodeInfo  # noqa: E402
from elastic.rendezvous.config import RendezvousConfig  # noqa: E402
from elastic.rendezvous.node import RendezvousNode  # noqa: E402
from elastic.store.etcd import EtcdStore  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402

NODES_PER_PROCESS = 128
LEASE_TTL_S = 10.0
TARGET_S = 2.0  # at 1,024 nodes, closes on the last join
ETCD_MAX_REQUEST_BYTES = int(1.5 * 1024 * 1024)  # etcd's default --max-request-bytes
# Client-side counts that are not requests a rendezvous makes.
_NOT_REQUESTS = ("watch_event", "lease_keepalive", "retry", "watch_reconnect")


# ----------------------------------------------------------- worker process

def _node_info(i: int) -> NodeInfo:
    # Realistic lengths: a cluster host name and an agent address per node.
    return NodeInfo(node_id=f"node{i:05d}", host=f"gpu-{i:05d}.cluster.example.com", nproc=8,
                    addr=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:29400")


def _in_threads(nodes: list[RendezvousNode], action, threads: int = 8) -> None:
    """Call ``action(node)`` for every node, from ``threads`` threads (starting
    and stopping are a few etcd round trips each)."""
    chunks = [nodes[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=lambda c=c: [action(n) for n in c]) for c in chunks]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _worker(conn, endpoint: str, config: RendezvousConfig, ids: list[int], last: int | None):
    """One process's share of the nodes. Protocol on ``conn``: sends "ready"
    once all but the last node are registered; on "go" starts the last node
    (if it holds it) and sends its start time; sends "done" when all its
    nodes saw the round; on "stop" leaves and exits."""
    logging.basicConfig(level=logging.WARNING)
    store = EtcdStore(endpoint)
    # The hosts are made up: rank 0's next MASTER_PORT is not probed on them.
    nodes = {i: RendezvousNode(store, config, _node_info(i), port_picker=lambda _host: 29500)
             for i in ids}
    try:
        _in_threads([n for i, n in nodes.items() if i != last], RendezvousNode.start)
        conn.send(("ready", threading.active_count()))
        assert conn.recv() == "go"
        started_at = None
        if last is not None:
            started_at = time.monotonic()
            nodes[last].start()
        conn.send(("started", started_at))
        deadline = time.monotonic() + 60
        rounds = [n.wait_for_round(after=0, timeout_s=max(deadline - time.monotonic(), 0.1))
                  for n in nodes.values()]
        done_at = time.monotonic()
        bad = [len(r.members) for r in rounds if len(r.members) != config.min_nodes]
        conn.send(("done", done_at, store.ops.snapshot(),
                   len(rounds[0].to_json()), bad, threading.active_count()))
        assert conn.recv() == "stop"
    finally:
        _in_threads(list(nodes.values()), RendezvousNode.stop)
        store.close()


# ------------------------------------------------------------- etcd metrics

_METRICS = {
    "unary_requests": re.compile(r'^grpc_server_handled_total\{.*grpc_type="unary".*\} (\S+)$'),
    "stream_messages": re.compile(
        r'^grpc_server_msg_received_total\{.*grpc_type="bidi_stream".*\} (\S+)$'),
    "bytes_sent": re.compile(r"^etcd_network_client_grpc_sent_bytes_total (\S+)$"),
    "proposals": re.compile(r"^etcd_server_proposals_committed_total (\S+)$"),
    "cpu_s": re.compile(r"^process_cpu_seconds_total (\S+)$"),
}


def write_json(path: str | None, data) -> None:
    """``data`` as indented JSON in ``path`` (--json); nothing without one."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """Sums of the server-side counters in ``_METRICS``, from etcd's /metrics."""
    with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    sums = dict.fromkeys(_METRICS, 0.0)
    for line in text.splitlines():
        for name, pattern in _METRICS.items():
            m = pattern.match(line)
            if m:
                sums[name] += float(m.group(1))
    return sums


# ------------------------------------------------------------------ one run

def run_once(endpoint: str, n: int, max_nodes: int, settle_s: float, processes: int) -> dict:
    config = RendezvousConfig(job_id=f"bench-{uuid.uuid4().hex[:12]}", min_nodes=n,
                              max_nodes=max_nodes, settle_s=settle_s, lease_ttl_s=LEASE_TTL_S)
    ctx = multiprocessing.get_context("spawn")
    before = etcd_metrics(endpoint)  # the whole rendezvous: registration to the round
    last = n - 1
    conns, procs = [], []
    for k in range(processes):
        ids = list(range(k, n, processes))
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, endpoint, config, ids,
                                              last if last in ids else None), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    try:
        threads = [_expect(c, "ready", 300)[1] for c in conns]
        for c in conns:
            c.send("go")
        started_at = [_expect(c, "started", 60)[1] for c in conns]
        t0 = next(t for t in started_at if t is not None)
        dones = [_expect(c, "done", 90) for c in conns]
        elapsed = max(d[1] for d in dones) - t0
        after = etcd_metrics(endpoint)
        bad = [b for d in dones for b in d[4]]
        if bad:
            raise AssertionError(f"rounds of the wrong size: {bad[:5]} (expected {n})")
        ops: dict[str, int] = {}
        for d in dones:
            for k, v in d[2].items():
                ops[k] = ops.get(k, 0) + v
        server = {k: after[k] - before[k] for k in after}
        return {"n": n, "seconds": elapsed, "processes": processes,
                "requests": sum(v for k, v in ops.items() if k not in _NOT_REQUESTS),
                "watch_events": ops.get("watch_event", 0), "ops": ops,
                "round_bytes": dones[0][3], "server": server,
                "threads_per_process": max(d[5] for d in dones),
                "threads_before_last_join": max(threads)}
    finally:
        for c in conns:
            try:
                c.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def _expect(conn, tag: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a worker process sent no {tag!r} within {timeout_s:.0f} s")
    msg = conn.recv()
    if msg[0] != tag:
        raise AssertionError(f"expected {tag!r} from a worker process, got {msg!r}")
    return msg


# -------------------------------------------------------------------- model

def model(row: dict, sizes: tuple[int, ...] = (4096, 16384)) -> list[str]:
    """Extrapolate one measured row (closes on last join) to larger jobs."""
    n = row["n"]
    s = row["server"]
    requests = s["unary_requests"] + s["stream_messages"]
    cpu_per_request = s["cpu_s"] / requests if requests else math.nan
    # Bytes etcd sent: the round record to every node's watch dominates.
    fanout = row["round_bytes"] * n
    other_bytes = max(s["bytes_sent"] - fanout, 0.0)
    lines = [f"measured at {n} nodes: {requests / n:.1f} etcd requests/node "
             f"(unary + stream messages), {s['proposals'] / n:.1f} raft proposals/node, "
             f"etcd CPU {1e6 * cpu_per_request:.0f} us/request, round record "
             f"{row['round_bytes'] / n:.0f} B/member, {s['bytes_sent'] / 1e6:.1f} MB sent "
             f"to clients ({fanout / 1e6:.1f} MB of it the round to {n} watchers)"]
    for big in sizes:
        scale = big / n
        record = row["round_bytes"] * scale
        sent = fanout * scale * scale + other_bytes * scale
        cpu = s["cpu_s"] * scale  # per-request work; the fan-out's share is below
        keepalives = big / (LEASE_TTL_S / 3)
        limits = []
        if record > MAX_RECORD_BYTES:
            limits.append(f"exceeds our {MAX_RECORD_BYTES >> 20} MiB record limit")
        if record > ETCD_MAX_REQUEST_BYTES:
            limits.append("exceeds etcd's default 1.5 MiB --max-request-bytes")
        lines.append(
            f"model at {big:>6d} nodes: {requests * scale:>9.0f} requests, "
            f"{s['proposals'] * scale:>8.0f} proposals, ~{cpu:.1f} etcd CPU-s for the requests, "
            f"round record {record / 1024:.0f} KiB, {sent / 1e9:.2f} GB of watch fan-out, "
            f"{keepalives:.0f} keep-alives/s at TTL {LEASE_TTL_S:.0f} s"
            + (f"  -- the round record {' and '.join(limits)}" if limits else ""))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0,
                    help="settle window of the second case (0: skip that case)")
    ap.add_argument("--processes", type=int, default=0,
                    help=f"worker processes per run (default: one per {NODES_PER_PROCESS} nodes)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = [("closes on last join", 0.0)] + ([("settle window", args.settle)]
                                               if args.settle > 0 else [])
    results = []
    print(f"# {os.cpu_count()} CPUs; lease TTL {LEASE_TTL_S:.0f} s; target: all of 1,024 "
          f"nodes see the round within {TARGET_S:.0f} s of the last join", flush=True)
    with EtcdServer(unsafe_no_fsync=False) as server:
        server.start()
        for case, settle in cases:
            for n in sizes:
                max_nodes = n if settle == 0.0 else 2 * n
                procs = args.processes or max(1, math.ceil(n / NODES_PER_PROCESS))
                runs = [run_once(server.endpoint, n, max_nodes, settle, procs)
                        for _ in range(args.repeat)]
                median = statistics.median(r["seconds"] for r in runs)
                first = runs[0]
                s = first["server"]
                row = {"case": case, "nnodes": f"{n}:{max_nodes}", "settle_s": settle, "n": n,
                       "processes": procs, "median_s": median,
                       "runs_s": [r["seconds"] for r in runs],
                       "requests_per_node": first["requests"] / n,
                       "watch_events_per_node": first["watch_events"] / n,
                       "round_bytes": first["round_bytes"], "server": s, "ops": first["ops"],
                       "threads_per_process": first["threads_per_process"]}
                results.append(row)
                print(f"{case:20s} nnodes {row['nnodes']:>10s} ({procs} proc)  median "
                      f"{median:6.3f} s  (runs {', '.join(f'{x:.3f}' for x in row['runs_s'])})"
                      f"  requests/node: client {row['requests_per_node']:.1f}, etcd "
                      f"{(s['unary_requests'] + s['stream_messages']) / n:.1f}  "
                      f"proposals/node {s['proposals'] / n:.1f}  watch events/node "
                      f"{row['watch_events_per_node']:.1f}  etcd CPU {s['cpu_s']:.2f} s  "
                      f"sent {s['bytes_sent'] / 1e6:.1f} MB  threads/process "
                      f"{row['threads_per_process']}", flush=True)
    largest = max((r for r in results if r["settle_s"] == 0.0), key=lambda r: r["n"])
    print()
    for line in model(largest):
        print(line)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
