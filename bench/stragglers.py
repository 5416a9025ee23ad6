"""What straggler detection costs the leader of a large job, and what it costs a node.

The leader, once per period (``--straggler-window`` / 6, at most 5 s), reads
every node's step-time record under ``step-times/`` from etcd, parses them and
judges every rank (:mod:`agent.straggler_watch`). This bench writes the records
of ``--nodes`` nodes of ``--ranks-per-node`` ranks into a real etcd (one rank
slow), then times ``--passes`` leader passes: wall and CPU time of the leader's
process per pass (the first parses every record; the others, like a steady job's,
only the records written again: none), and that CPU as a share of one core at the default 5 s
period (the reference: the period itself). Every pass must name the slow rank
(its window is set to 0, and the leader forgets between passes, so that each
pass names it afresh).

Every record carries both measures, wall and busy time per step (the slow rank
is slow by its wall time).

A node's side: one heartbeat's worth of ``StepTimes.observe`` and its
``record()`` per period, timed over ``--ranks-per-node`` ranks. A worker's
side: what :meth:`StepTimer.step_ended` costs the training thread at every
step, with its busy time read from schedstat and without (wall time alone).

    .venv/bin/python bench/stragglers.py [--nodes 16384] [--ranks-per-node 8]
                                         [--passes 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent.metrics import NO_METRICS  # noqa: E402
from agent.step_times import StepTimeRecord, StepTimes  # noqa: E402
from agent.straggler_watch import StragglerWatch  # noqa: E402
from agent.stragglers import StragglerPolicy  # noqa: E402
from elastic.clock import SYSTEM_CLOCK  # noqa: E402
from elastic.joblog import JobLogger  # noqa: E402
from elastic.keyspace import JobKeys  # noqa: E402
from elastic.rendezvous.api import Member, Round  # noqa: E402
from elastic.store.api import Put  # noqa: E402
from elastic.store.etcd import EtcdStore  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402
from elastic.worker.step_timer import StepTimer, ThreadBusyClock  # noqa: E402

PERIOD_S = StragglerPolicy().period_s()
SLOW_RANK = 77


def write_records(store: EtcdStore, keys: JobKeys, nodes: int, per_node: int) -> int:
    """Every node's record, 100 to a transaction; returns the bytes written."""
    rng = random.Random(1)
    ops, size = [], 0
    for n in range(nodes):
        times = {n * per_node + i: 0.2 * rng.uniform(0.95, 1.05) for i in range(per_node)}
        if SLOW_RANK in times:
            times[SLOW_RANK] *= 2
        busy = {r: 0.5 * s * rng.uniform(0.9, 1.1) for r, s in times.items()}
        value = StepTimeRecord(1, times, busy).to_json()
        size += len(value)
        ops.append(Put(keys.step_times_of(f"node-{n:05d}"), value))
        if len(ops) == 100:
            store.txn([], ops)
            ops = []
    if ops:
        store.txn([], ops)
    return size


def leader_passes(store: EtcdStore, keys: JobKeys, job: Round, passes: int) -> list[tuple]:
    """(wall s, CPU s) of each pass; each must name SLOW_RANK."""
    named: list[str] = []
    watch = StragglerWatch(StragglerPolicy(window_s=0.0), store, keys, "leader", SYSTEM_CLOCK,
                           event=lambda r, kind, message: named.append(message),
                           drain=lambda member, reason: None, metrics=NO_METRICS,
                           log=JobLogger(logging.getLogger("bench"), keys.job_id, "leader"),
                           timeout_s=30.0)
    costs = []
    for i in range(passes):
        # Not leading for a moment: the watch forgets, and names again.
        watch.run(time.monotonic(), lease=None, running=None, leading=None, standbys=())
        wall, cpu = time.perf_counter(), time.process_time()
        watch.run(time.monotonic(), lease=None, running=None, leading=job, standbys=())
        costs.append((time.perf_counter() - wall, time.process_time() - cpu))
        if not named or f"rank {SLOW_RANK} " not in named[-1] or len(named) != i + 1:
            raise SystemExit(f"pass {i}: the slow rank was not named: {named[-1:]}")
    return costs


def node_cost_us(per_node: int, beats: int = 2000) -> float:
    """CPU microseconds per period of one node: a heartbeat per rank, then its record."""
    times = StepTimes()
    started = time.process_time()
    for b in range(beats):
        for rank in range(per_node):
            times.observe(1, rank, 0.2 + rank * 1e-3, 0.1 + rank * 1e-3)
        times.record()
    return (time.process_time() - started) / beats * 1e6


def worker_step_us(busy: bool, steps: int = 20000, repeats: int = 5) -> float:
    """Microseconds of ``StepTimer.step_ended`` per step (the best of
    ``repeats`` runs: the cost, not the machine's load)."""
    timer = StepTimer(ThreadBusyClock() if busy else None)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            timer.step_ended(time.monotonic())
        best = min(best, time.perf_counter() - started)
    return best / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16384)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    logging.getLogger("bench").setLevel(logging.ERROR)  # each pass's naming
    keys = JobKeys("bench-stragglers")
    job = Round(number=1, members=tuple(
        Member(f"node-{n:05d}", n, "h", args.ranks_per_node, addr=f"h:{n + 1}")
        for n in range(args.nodes)), master_addr="h", master_port=1, reason="", leader="",
        created_at=0.0)
    with tempfile.TemporaryDirectory() as data, \
            EtcdServer(data_dir=data, unsafe_no_fsync=True) as server:
        server.start()
        with EtcdStore(server.endpoint) as store:
            size = write_records(store, keys, args.nodes, args.ranks_per_node)
            costs = leader_passes(store, keys, job, args.passes)
    # The first pass parses every record; later ones only those written again
    # (none here: a steady job).
    first_cpu = costs[0][1]
    wall = statistics.median(c[0] for c in costs[1:])
    cpu = statistics.median(c[1] for c in costs[1:])
    result = {"nodes": args.nodes, "ranks": args.nodes * args.ranks_per_node,
              "bytes_read_per_pass": size, "leader_pass_wall_s": round(wall, 4),
              "leader_pass_cpu_s": round(cpu, 4), "leader_first_pass_cpu_s": round(first_cpu, 4),
              "period_s": PERIOD_S,
              "leader_core_share": round(cpu / PERIOD_S, 4),
              "node_cpu_us_per_period": round(node_cost_us(args.ranks_per_node), 2),
              "worker_step_us": round(worker_step_us(busy=True), 2),
              "worker_step_us_wall_only": round(worker_step_us(busy=False), 2)}
    print(f"{result['ranks']} ranks on {args.nodes} nodes: a leader pass reads "
          f"{size / 1e6:.1f} MB and takes {wall:.3f} s wall, {cpu:.3f} s CPU: "
          f"{100 * cpu / PERIOD_S:.1f}% of a core at one pass per {PERIOD_S:g} s "
          f"(median of {args.passes - 1} after the first, which parsed every record in "
          f"{first_cpu:.3f} s CPU); a node's own part: "
          f"{result['node_cpu_us_per_period']} us CPU per period; a worker's, at every step: "
          f"{result['worker_step_us']} us ({result['worker_step_us_wall_only']} us for wall "
          f"time alone)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
