"""Rendezvous benchmark: how fast N nodes agree on a round, and at what etcd cost.

For each N, N simulated nodes are spread over ``--processes`` worker processes
(by default one per CPU, see :func:`default_processes`), each process with one
:class:`~elastic.store.etcd.EtcdStore` shared by its nodes, as agents on many
machines share one etcd cluster. Every node is a full
:class:`~elastic.rendezvous.node.RendezvousNode` with its own lease (kept alive)
and its own watches. Its loop runs, with ``--loops pump`` (the default), on
one of a few threads per process that pump whichever of their nodes has news
or a deadline due, as the fault simulator drives nodes; with ``--loops
thread``, on a thread of its own, as in an agent (on a small machine, 32
processes of 128 such threads spend much of the clients' CPU waking each
other up). N-1 nodes join first; the clock starts when the last one
joins and stops when all N have seen the committed round (the latest of the
processes' "all my nodes saw it" times; ``time.monotonic`` is one clock for
all processes on Linux).

Cases:

* ``--nnodes N:N`` (the round closes on the last join): the protocol's own
  latency. Target: within 2 s at 4,096 nodes.
* ``--nnodes N:2N`` with the settle window (``--settle``; 0 skips it): the
  round closes once no node has arrived for ``settle`` seconds.
* ``--reform``: then a round that replaces the formed one with the same
  members (a restart request from node 0, as after a worker failure).
* ``--replace``: then a round that replaces a node (node N-1 leaves, a new
  node joins: a failed machine swapped for a spare), timed from the new
  node's join.
* ``--idle S``: the steady load after that for S seconds (keep-alives, idle
  watches) and etcd's resident memory.

What etcd pays, from both ends, for each phase: requests counted by the
stores (client side) per node; from each etcd member's ``/metrics``: gRPC
requests handled (unary calls and stream messages), bytes sent to clients,
raft proposals, etcd's CPU seconds; and the worker processes' own CPU
seconds, which say whether a time measured here is etcd's or the simulated
clients' (on a small machine they share the cores). The simulated nodes of a
process share its store's connection and nothing else: each parses and
resolves every round itself (the library caches nothing across nodes), so
the clients' CPU per node is what an agent pays for the rendezvous. What it
pays on top (its placement) and what a user of the whole member list pays
are printed with the model (:func:`cpu_per_node`), as is the leader's
writing of the round.

``--etcd-members 3`` runs a 3-member cluster on loopback ports (the chaos
campaign's; no fsync), each process's clients listing the members in another
order. ``--tree DIR`` imports the library from another checkout (e.g. the
tree before a change), so that one bench measures both side by side: run it
once per tree, back to back, on the same quiet machine.

The model (printed after the table) takes the largest measured size and
scales each cost by how it grows (see :func:`model`).

    python bench/rendezvous.py [--sizes 1024,4096] [--repeat 3] [--settle 0]
                               [--processes P] [--loops pump|thread]
                               [--reform] [--replace] [--idle S]
                               [--etcd-members 1|3] [--tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import multiprocessing
import os
import queue
import random
import re
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

# The checkout whose library is measured: --tree, read before anything is
# imported from it; worker processes (spawned) inherit it through the environment.
_TREE_ENV = "BENCH_RENDEZVOUS_TREE"
for _i, _arg in enumerate(sys.argv[:-1]):
    if _arg == "--tree":
        os.environ[_TREE_ENV] = os.path.abspath(sys.argv[_i + 1])
sys.path.insert(0, os.environ.get(_TREE_ENV)
                or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.keyspace import JobKeys  # noqa: E402
from elastic.rendezvous.api import NodeInfo  # noqa: E402
from elastic.rendezvous.config import DEFAULT_LEASE_TTL_S, RendezvousConfig  # noqa: E402
from elastic.rendezvous.inbox import Inbox  # noqa: E402
from elastic.rendezvous.node import RendezvousNode  # noqa: E402
from elastic.store.etcd import EtcdStore  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402

NODES_PER_PROCESS = 128
# Threads that pump a process's nodes (--loops pump): each node's loop blocks
# in its reads, so one thread would make the process's reads one at a time.
PUMP_THREADS = 8
# Longer than the default: 32 processes on a small shared machine starve
# keep-alives for seconds, and a lease lost mid-run measures a re-registration,
# not a round (a round's cost does not depend on the TTL; the model uses the
# default's keep-alive rate).
LEASE_TTL_S = 30.0
TARGET_S = 2.0  # at 4,096 nodes, closes on the last join
ETCD_MAX_REQUEST_BYTES = int(1.5 * 1024 * 1024)  # etcd's default --max-request-bytes
WATCHED_TARGET_BYTES = 64 * 1024  # the watched record, at any size
# etcd CPU per GB it sends to watchers and readers (measured: 2.54 s for the
# 2.11 GB the whole-record round sent at 4,096 nodes, 1 member, 2 cores).
ETCD_CPU_S_PER_GB = 1.2
# Client-side counts that are not requests a rendezvous makes.
_NOT_REQUESTS = ("watch_event", "lease_keepalive", "retry", "watch_reconnect")


# ----------------------------------------------------------- worker process

def _node_info(i: int) -> NodeInfo:
    # Realistic lengths: a cluster host name and an agent address per node.
    return NodeInfo(node_id=f"node{i:05d}", host=f"gpu-{i:05d}.cluster.example.com", nproc=8,
                    addr=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:29400")


def _in_threads(items: list, action, threads: int = 8) -> None:
    """Call ``action(item)`` for every item, from ``threads`` threads (starting
    and stopping a node are a few etcd round trips each)."""
    chunks = [items[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=lambda c=c: [action(n) for n in c]) for c in chunks]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _cpu_s() -> float:
    """CPU seconds (user + system) this process used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wait_all(nodes, after: int, expected: int) -> tuple[float, list[int], int]:
    """When every node saw a round after ``after``, the sizes of those that
    are not ``expected`` members, and the latest number seen. Only what the
    rendezvous gives (``wait_for_round``), as in the trees before: what an
    agent does on top (its placement from its bucket, or every member built
    from a roster the record carries) is printed apart (:func:`cpu_per_node`)."""
    deadline = time.monotonic() + 120
    rounds = [n.wait_for_round(after=after, timeout_s=max(deadline - time.monotonic(), 0.1))
              for n in nodes]
    return (time.monotonic(), [len(r.members) for r in rounds if len(r.members) != expected],
            max(r.number for r in rounds))


class _Pumps:
    """One thread that runs the loops of some of a process's nodes (``--loops
    pump``, PUMP_THREADS of them a process): each node's inbox rings it, and it
    pumps the nodes that have news or a deadline due, as
    :meth:`RendezvousNode.pump` allows (the fault simulator drives nodes the
    same way). A real agent runs one loop thread on its own machine; 128 such
    threads per process, 32 processes on 2 cores, spend a third of the
    clients' CPU waking each other up."""

    def __init__(self):
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._nodes: dict[int, RendezvousNode] = {}
        self._due: dict[int, float] = {}
        self._lock = threading.Lock()  # a node is pumped, added or removed at a time
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pumps", daemon=True)
        self._thread.start()

    def inbox(self, i: int) -> Inbox:
        """The inbox of node ``i``: it rings this driver on every message."""
        ring = self._ready.put

        class Doorbell(Inbox):
            def post(self, message) -> None:
                super().post(message)
                ring(i)

        return Doorbell()

    def add(self, i: int, node: RendezvousNode) -> None:
        """Pump node ``i`` (started with ``thread=False``) from now on."""
        with self._lock:
            self._nodes[i] = node
        self._ready.put(i)

    def remove(self, i: int) -> None:
        """Pump node ``i`` no more (before it stops)."""
        with self._lock:
            self._nodes.pop(i, None)

    def close(self) -> None:
        self._stopping.set()
        self._ready.put(-1)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopping.is_set():
            now = time.time()
            wait = min(self._due.values(), default=now + 0.5) - now
            ready = set()
            try:
                ready.add(self._ready.get(timeout=min(max(wait, 0.0), 0.5)))
                while True:
                    ready.add(self._ready.get_nowait())
            except queue.Empty:
                pass
            now = time.time()
            ready |= {i for i, at in list(self._due.items()) if at <= now}
            for i in ready:
                with self._lock:
                    node = self._nodes.get(i)
                    if node is None:
                        self._due.pop(i, None)
                        continue
                    at = node.pump()
                    if at is None:
                        self._due.pop(i, None)
                    else:
                        self._due[i] = at


def _worker(conn, endpoint: str, config: RendezvousConfig, ids: list[int], last: int | None,
            inline_bytes: int | None, loops: str = "thread"):
    """One process's share of the nodes. Protocol on ``conn``: sends "ready"
    once all but the last node are registered; on "go" starts the last node
    (if it holds it) and sends its start time; sends "done" when all its
    nodes saw the round. Then, per command: "reform" (node 0 asks for a new
    round with the same members), "replace" (the holder of the last node
    stops it and starts node N in its place), each answered when all its
    nodes saw the next round; "stop" leaves and exits."""
    logging.basicConfig(level=logging.WARNING)
    # `kill -USR1 <pid>` prints every thread's stack: where a slow run spends its time.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if inline_bytes is not None:
        from elastic.rendezvous import round_record
        round_record.INLINE_BYTES = inline_bytes  # whichever node leads writes the rounds
    store = EtcdStore(endpoint)
    # A node's loop blocks in its reads: a few pump threads keep reads in flight.
    pumps = [_Pumps() for _ in range(PUMP_THREADS)] if loops == "pump" else []
    pump_of = lambda i: pumps[i % len(pumps)] if pumps else None  # noqa: E731
    # The hosts are made up: rank 0's next MASTER_PORT is not probed on them.
    make = lambda i: RendezvousNode(store, config, _node_info(i),  # noqa: E731
                                    port_picker=lambda _host: 29500,
                                    inbox=pump_of(i).inbox(i) if pumps else None)
    nodes = {i: make(i) for i in ids}

    def start(i: int) -> RendezvousNode:
        node = nodes[i].start(thread=not pumps)
        if pumps:
            pump_of(i).add(i, node)
        return node

    def stop(i: int) -> None:
        if pumps:
            pump_of(i).remove(i)
        nodes[i].stop()

    try:
        _in_threads([i for i in nodes if i != last], start)
        conn.send(("ready", threading.active_count()))
        assert conn.recv() == "go"
        started_at = None
        if last is not None:
            started_at = time.monotonic()
            start(last)
        conn.send(("started", started_at, _cpu_s()))
        done_at, bad, number = _wait_all(nodes.values(), 0, config.min_nodes)
        conn.send(("done", done_at, store.ops.snapshot(), bad, threading.active_count(),
                   _cpu_s()))
        while (command := conn.recv()) != "stop":
            began = None
            if command == "reform" and 0 in nodes:
                nodes[0].request_restart("bench: a new round", number, failure=False)
            elif command == "replace" and last in nodes:
                stop(last)
                del nodes[last]
                began = time.monotonic()
                nodes[config.min_nodes] = make(config.min_nodes)
                start(config.min_nodes)
            done_at, bad, number = _wait_all(nodes.values(), number, config.min_nodes)
            conn.send((command, done_at, store.ops.snapshot(), bad, began, _cpu_s()))
    finally:
        _in_threads(list(nodes), stop)
        for p in pumps:
            p.close()
        store.close()


# ------------------------------------------------------------- etcd metrics

_METRICS = {
    "unary_requests": re.compile(r'^grpc_server_handled_total\{.*grpc_type="unary".*\} (\S+)$'),
    "stream_messages": re.compile(
        r'^grpc_server_msg_received_total\{.*grpc_type="bidi_stream".*\} (\S+)$'),
    "bytes_sent": re.compile(r"^etcd_network_client_grpc_sent_bytes_total (\S+)$"),
    "proposals": re.compile(r"^etcd_server_proposals_committed_total (\S+)$"),
    "cpu_s": re.compile(r"^process_cpu_seconds_total (\S+)$"),
    "rss_bytes": re.compile(r"^process_resident_memory_bytes (\S+)$"),
}


def write_json(path: str | None, data) -> None:
    """``data`` as indented JSON in ``path`` (--json); nothing without one."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def etcd_metrics(endpoints: str) -> dict[str, float]:
    """Sums of the server-side counters in ``_METRICS`` over each etcd
    member's /metrics (comma-separated endpoints). Every member counts the
    cluster's proposals: the cluster's are the largest member's."""
    sums = dict.fromkeys(_METRICS, 0.0)
    proposals = []
    for endpoint in endpoints.split(","):
        with urllib.request.urlopen(endpoint + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        mine = dict.fromkeys(_METRICS, 0.0)
        for line in text.splitlines():
            for name, pattern in _METRICS.items():
                m = pattern.match(line)
                if m:
                    mine[name] += float(m.group(1))
        proposals.append(mine.pop("proposals"))
        for name, value in mine.items():
            sums[name] += value
    sums["proposals"] = max(proposals)
    return sums


def _diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if k != "rss_bytes"}


def _sum_ops(snapshots) -> dict[str, int]:
    ops: dict[str, int] = {}
    for snapshot in snapshots:
        for k, v in snapshot.items():
            ops[k] = ops.get(k, 0) + v
    return ops


def _phase(seconds: float, server: dict, clients_cpu_s: float, ops: dict) -> dict:
    return {"seconds": seconds, "server": server, "clients_cpu_s": clients_cpu_s,
            "client_requests": sum(v for k, v in ops.items() if k not in _NOT_REQUESTS),
            "watch_events": ops.get("watch_event", 0), "ops": ops,
            "loadavg": os.getloadavg()[0]}


def _round_bytes(endpoint: str, keys: JobKeys) -> dict[str, int]:
    """The watched record's size, the stored rosters' (0 in a tree without;
    a roster the record carries is stored too, for nodes that miss it) and
    their buckets' (0 in a tree without, or a roster carried)."""
    sizes = {"watched": 0, "stored_roster": 0, "buckets": 0, "bucket_count": 0}
    with EtcdStore(endpoint) as store:
        head = store.get(keys.round)
        sizes["watched"] = len(head.value) if head else 0
        for field, prefix in (("stored_roster", getattr(keys, "rosters", None)),
                              ("buckets", getattr(keys, "roster_buckets", None))):
            kvs = store.get_prefix(prefix)[0] if prefix else []
            sizes[field] = sum(len(kv.value) for kv in kvs)
            if field == "buckets":
                sizes["bucket_count"] = len(kvs)
    return sizes


# ------------------------------------------------------------------ one run

def run_once(endpoint: str, n: int, max_nodes: int, settle_s: float, processes: int,
             follow_ups: tuple[str, ...] = (), idle_s: float = 0.0,
             inline_bytes: int | None = None, loops: str = "thread") -> dict:
    """One rendezvous of ``n`` nodes (closing at ``max_nodes`` or after
    ``settle_s``), then each of ``follow_ups`` ("reform", "replace")."""
    config = RendezvousConfig(job_id=f"bench-{uuid.uuid4().hex[:12]}", min_nodes=n,
                              max_nodes=max_nodes, settle_s=settle_s, lease_ttl_s=LEASE_TTL_S)
    keys = JobKeys(config.job_id)
    ctx = multiprocessing.get_context("spawn")
    before = etcd_metrics(endpoint)  # the whole rendezvous: registration to the round
    last = n - 1
    members = endpoint.split(",")
    conns, procs = [], []
    for k in range(processes):
        ids = list(range(k, n, processes))
        parent, child = ctx.Pipe()
        # Clients spread over the members, as agents list them in another order.
        mine = ",".join(members[k % len(members):] + members[:k % len(members)])
        p = ctx.Process(target=_worker, args=(child, mine, config, ids,
                                              last if last in ids else None, inline_bytes,
                                              loops),
                        daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    try:
        threads = [_expect(c, "ready", 600)[1] for c in conns]
        at_go = etcd_metrics(endpoint)
        for c in conns:
            c.send("go")
        started = [_expect(c, "started", 60) for c in conns]
        t0 = next(s[1] for s in started if s[1] is not None)
        dones = [_expect(c, "done", 180) for c in conns]
        after = etcd_metrics(endpoint)
        _check_sizes(dones, n)
        ops = [d[2] for d in dones]  # each process's counts so far
        cpu = [d[5] for d in dones]  # and CPU seconds
        result = {"n": n, "processes": processes, "threads_before_last_join": max(threads),
                  "threads_per_process": max(d[4] for d in dones),
                  "round_bytes": _round_bytes(endpoint, keys),
                  "rendezvous": {"server": _diff(after, before), "ops": _sum_ops(ops)},
                  "first": _phase(max(d[1] for d in dones) - t0, _diff(after, at_go),
                                  sum(cpu) - sum(s[2] for s in started), _sum_ops(ops))}
        for command in follow_ups:
            at = etcd_metrics(endpoint)
            sent_at = time.monotonic()
            for c in conns:
                c.send(command)
            replies = [_expect(c, command, 180) for c in conns]
            later = etcd_metrics(endpoint)
            _check_sizes(replies, n)
            began = next((r[4] for r in replies if r[4] is not None), sent_at)
            now_ops = [r[2] for r in replies]
            delta_ops = _sum_ops([{k: v - o.get(k, 0) for k, v in new.items()}
                                  for new, o in zip(now_ops, ops)])
            result[command] = _phase(max(r[1] for r in replies) - began, _diff(later, at),
                                     sum(r[5] - was for was, r in zip(cpu, replies)),
                                     delta_ops)
            result[command]["round_bytes"] = _round_bytes(endpoint, keys)
            cpu = [r[5] for r in replies]
            ops = now_ops
        if idle_s > 0:
            # The steady load of a formed job: keep-alives on every lease,
            # idle watches (no agent here publishes status).
            at = etcd_metrics(endpoint)
            time.sleep(idle_s)
            later = etcd_metrics(endpoint)
            result["idle_per_s"] = {k: v / idle_s for k, v in _diff(later, at).items()}
            result["idle_per_s"]["rss_bytes"] = later["rss_bytes"]
        return result
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


def _check_sizes(replies, n: int) -> None:
    bad = [b for r in replies for b in r[3]]
    if bad:
        raise AssertionError(f"rounds of the wrong size: {bad[:5]} (expected {n})")


def _expect(conn, tag: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"a worker process sent no {tag!r} within {timeout_s:.0f} s")
    msg = conn.recv()
    if msg[0] != tag:
        raise AssertionError(f"expected {tag!r} from a worker process, got {msg!r}")
    return msg


# -------------------------------------------------------------------- model

def _first_round(big: int):
    """The first round of ``big`` nodes of this bench's names, ranked in the
    order they registered: here, concurrently from many processes, so not in
    id order (which would compress better)."""
    from elastic.rendezvous.api import Member, Round
    order = list(range(big))
    random.Random(0).shuffle(order)
    members = tuple(Member(node_id=i.node_id, node_rank=k, host=i.host, nproc=i.nproc,
                           addr=i.addr)
                    for k, i in enumerate(_node_info(j) for j in order))
    return Round(number=1, members=members, master_addr=members[0].host, master_port=29500,
                 reason=f"a node joined; closing with {big} nodes (max reached)",
                 leader=members[0].node_id, created_at=time.time())


def _records(big: int) -> dict | None:
    """What the rounds of ``big`` nodes of this bench's names write and what
    a node reads of them, as this tree writes them (None in a tree without
    rosters: its round lists every member): ``phase -> (watched record,
    bytes a node that holds one bucket reads)``, and ``"whole"``: the stored
    roster, which a node that uses the list whole reads once."""
    try:
        from elastic.rendezvous import round_record
    except ImportError:
        return None
    from elastic.rendezvous.api import Member
    first = _first_round(big)
    members = first.members
    spare = _node_info(big)
    replaced = dataclasses.replace(first, number=2, members=members[:-1] + (Member(
        node_id=spare.node_id, node_rank=big - 1, host=spare.host, nproc=8, addr=spare.addr),))
    head, name, stored = round_record.head_of(first, None, "")
    again, _, _ = round_record.head_of(dataclasses.replace(first, number=2), first, name)
    swapped, _, _ = round_record.head_of(replaced, first, name)
    carried = b'"packed"' in head
    if carried or not hasattr(round_record, "roster_buckets"):
        # Carried, or (a tree without buckets) read whole by every node: nothing more.
        read = 0 if carried else len(stored)
        return {"first": (len(head), read), "reform": (len(again), 0),
                "replace": (len(swapped), 0), "whole": 0}
    _, _, sealed = round_record.roster_buckets(_raw_of(first))
    bucket = sum(len(b) for b in sealed) / len(sealed)
    # The nodes of the bench hold a bucket: a new roster (a node replaced)
    # means reading their bucket of it again; an agent that holds the roster
    # whole rebuilds it from the delta instead.
    # A tree whose buckets place each member: its agents run each round from
    # their bucket, and only an occasional user (elasticctl status, a hang
    # report) reads the stored roster whole.
    placed = hasattr(getattr(round_record, "buckets", None), "placements")
    return {"first": (len(head), bucket), "reform": (len(again), 0),
            "replace": (len(swapped), bucket), "whole": 0 if placed else len(stored),
            "stored": len(stored)}


def _raw_of(record) -> bytes:
    from elastic.rendezvous import roster
    return roster.canonical(record.members)


def cpu_per_node(big: int) -> str:
    """What the first round of ``big`` nodes costs one process, in CPU
    milliseconds: the leader writing it, a node resolving it as the
    rendezvous does (its own line, from its bucket when the record names
    buckets), and an agent building the whole member list (its ranks, peers,
    memory buddy), reading the stored roster when it was not carried. "" in
    a tree without rosters."""
    try:
        from elastic.keyspace import JobKeys as Keys
        from elastic.rendezvous import round_record
    except ImportError:
        return ""
    keys = Keys("bench")
    first = _first_round(big)
    me = first.members[big // 2].node_id
    began = time.process_time()
    earlier, ops, name = round_record.commit_ops(keys, first, None, "")
    wrote = time.process_time() - began
    writes = {op.key: op.value for txn in earlier + [ops] for op in txn
              if getattr(op, "value", None) is not None}
    head = round_record.parse_head(keys.round, writes[keys.round], 1)
    bucket_of = getattr(round_record, "bucket_reads", None)
    began = time.process_time()
    if getattr(head, "buckets", None) is not None and bucket_of is not None:
        key = bucket_of(keys, head, me)[1].key
        resolved = round_record.resolve(head, None, "", None, {name: writes[key]}, me)
        how = "from its bucket"
    else:
        stored = round_record.stored_rosters(keys, [_kv(k, v) for k, v in writes.items()])
        resolved = round_record.resolve(head, None, "", stored if head.packed is None else None)
        how = "from the record" if head.packed is not None else "from the roster"
    assert resolved.member(me) is not None
    placed = getattr(resolved, "placement", None)
    if placed is not None:
        assert placed(me) is not None  # what the agent runs the round with
    found = time.process_time() - began
    began = time.process_time()
    stored = round_record.stored_rosters(keys, [_kv(k, v) for k, v in writes.items()])
    whole = round_record.resolve(head, None, "", stored) if head.packed is None else resolved
    assert len(list(whole.members)) == big
    built = time.process_time() - began
    itself = "itself and its placement" if placed is not None else "itself"
    whole_user = "a user of the whole list" if placed is not None else "an agent"
    return (f"CPU per first round: the leader writes it in {wrote * 1e3:.0f} ms, a node "
            f"finds {itself} {how} in {found * 1e3:.2f} ms, {whole_user} builds all {big} "
            f"members in {built * 1e3:.0f} ms more")


def _kv(key: str, value: bytes):
    from elastic.store.api import KeyValue
    return KeyValue(key=key, value=value, version=1, create_revision=1, mod_revision=1)


def model(row: dict, sizes: tuple[int, ...] = (4096, 16384, 65536)) -> list[str]:
    """Extrapolate one measured row (closes on last join) to larger jobs.

    Per round, etcd sends the watched record to every node, and what nodes
    read. With rosters (this tree's records, :func:`_records`): the first
    round sends every node the roster once when the record carries it, else
    each node reads its own bucket (about 1 KB, at any size) with one more
    request; a round that keeps the members sends the head alone; one that
    replaces a node sends the head and a delta, and a node that holds one
    bucket reads its bucket of the new roster. An agent takes its ranks,
    ring peer and buddy from its bucket (a tree before placements: it read
    the stored roster once on top, printed apart). Without
    rosters (``--tree`` of an older checkout): the whole record, N members, to
    N watchers, every round. Other bytes (registrations, election, keep-alive
    answers), requests and proposals grow with N; etcd CPU with N for its
    requests and with ETCD_CPU_S_PER_GB for the bytes it sends; keep-alives
    with N / (TTL/3) at the default TTL.
    """
    n = row["n"]
    lines = []
    phases = [ph for ph in ("first", "reform", "replace") if ph in row]
    at_n = _records(n)
    for ph in phases:
        p = row[ph]
        s = p["server"]
        requests = s["unary_requests"] + s["stream_messages"]
        lines.append(
            f"measured at {n} nodes, {ph} round: {p['seconds']:.3f} s, "
            f"{requests / n:.2f} etcd requests/node, {s['proposals']:.0f} proposals, etcd CPU "
            f"{s['cpu_s']:.2f} s, clients' CPU {p['clients_cpu_s']:.2f} s, "
            f"{s['bytes_sent'] / 1e6:.1f} MB sent ({s['bytes_sent'] / n / 1e3:.1f} kB/node)")

    def round_sent(records, nodes: int, ph: str) -> tuple[float, float]:
        """(bytes sent for the round, watched record bytes)."""
        if records is None:
            watched = row["round_bytes"]["watched"] * nodes / n
            return watched * nodes, watched
        watched, read = records[ph]
        return nodes * (watched + read), watched

    for big in sizes:
        scale = big / n
        # Before _records: the leader keeps the last rosters it compressed,
        # and this is the first time, as in a job's first round.
        node_cpu = cpu_per_node(big)
        at_big = _records(big)
        parts = []
        for ph in phases:
            s = row[ph]["server"]
            measured, _ = round_sent(at_n, n, ph)
            other = max(s["bytes_sent"] - measured, 0.0)
            sent, watched = round_sent(at_big, big, ph)
            sent += other * scale
            cpu = (max(s["cpu_s"] - ETCD_CPU_S_PER_GB * s["bytes_sent"] / 1e9, 0.0) * scale
                   + ETCD_CPU_S_PER_GB * sent / 1e9)
            limit = ("" if watched <= WATCHED_TARGET_BYTES else " (over 64 KiB)") + (
                "" if watched <= ETCD_MAX_REQUEST_BYTES else " (over etcd's request limit)")
            parts.append(f"{ph}: watched {watched / 1024:.1f} KiB{limit}, {sent / 1e9:.3f} GB "
                         f"sent, etcd CPU ~{cpu:.1f} s")
        lines.append(f"model at {big:>6d} nodes: " + "; ".join(parts)
                     + f"; {big / (DEFAULT_LEASE_TTL_S / 3):.0f} keep-alives/s at the default "
                     f"TTL ({DEFAULT_LEASE_TTL_S:g} s)")
        if at_big is not None and at_big["whole"]:
            whole = big * at_big["whole"]
            lines.append(f"{'':20s}agents that use the list whole read the stored roster "
                         f"({at_big['whole'] / 1e3:.0f} KB) once more: {whole / 1e9:.3f} GB, "
                         f"etcd CPU ~{ETCD_CPU_S_PER_GB * whole / 1e9:.1f} s, over the first "
                         "round")
        elif at_big is not None and at_big.get("stored") and at_big["first"][1]:
            lines.append(f"{'':20s}agents run the round from their bucket (their ranks, ring "
                         "peer and buddy in it): nothing more; a user of the whole list "
                         f"(elasticctl status, a hang report) reads the stored roster, "
                         f"{at_big['stored'] / 1e3:.0f} KB, when it needs it")
        if node_cpu:
            lines.append(f"{'':20s}{node_cpu}")
    return lines


@contextlib.contextmanager
def _etcd(members: int):
    """The endpoints of one etcd (fsync on), or of a 3-member cluster on
    loopback ports (tests/chaos/etcd_cluster.py's, as the campaign runs it)."""
    if members == 1:
        with EtcdServer(unsafe_no_fsync=False) as server:
            server.start()
            yield server.endpoint
        return
    from tests.chaos.etcd_cluster import EtcdCluster
    from tests.chaos.topology import Host
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as workdir:
        cluster = EtcdCluster([Host(f"e{i}", "127.0.0.1") for i in range(members)], workdir,
                              f"bench{os.getpid()}")
        try:
            cluster.start()
            yield cluster.endpoints
        finally:
            cluster.stop()


def _print_phase(label: str, n: int, runs: list[dict]) -> None:
    seconds = [r["seconds"] for r in runs]
    s = runs[0]["server"]
    loads = ", ".join(f"{r['loadavg']:.1f}" for r in runs)
    print(f"{'':4s}{label:8s} median {statistics.median(seconds):7.3f} s (runs "
          f"{', '.join(f'{x:.3f}' for x in seconds)}); first run: etcd "
          f"{(s['unary_requests'] + s['stream_messages']) / n:.2f} requests/node, "
          f"{s['proposals']:.0f} proposals, etcd CPU {s['cpu_s']:.2f} s, clients' CPU "
          f"{runs[0]['clients_cpu_s']:.2f} s, sent {s['bytes_sent'] / 1e6:.1f} MB; load "
          f"average {loads}", flush=True)


def default_processes(n: int, loops: str) -> int:
    """Worker processes for ``n`` nodes: pumped nodes share few threads, so one
    process per CPU (each its own interpreter: nodes in one process share its
    GIL), at least NODES_PER_PROCESS nodes each; nodes on threads of their
    own, one process per NODES_PER_PROCESS nodes."""
    per_process = NODES_PER_PROCESS
    if loops == "pump":
        per_process = max(per_process, math.ceil(n / (os.cpu_count() or 1)))
    return max(1, math.ceil(n / per_process))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settle", type=float, default=1.0,
                    help="settle window of the second case (0: skip that case)")
    ap.add_argument("--processes", type=int, default=0,
                    help="worker processes per run (default: one per CPU with --loops pump, "
                         f"one per {NODES_PER_PROCESS} nodes with --loops thread)")
    ap.add_argument("--reform", action="store_true",
                    help="then a round that replaces the first with the same members")
    ap.add_argument("--replace", action="store_true",
                    help="then a round in which a new node replaces one that left")
    ap.add_argument("--idle", type=float, default=0.0,
                    help="after the rounds, measure etcd's steady load for this long (s)")
    ap.add_argument("--etcd-members", type=int, default=1, choices=(1, 3),
                    help="one etcd, or a 3-member cluster on loopback ports")
    ap.add_argument("--inline-bytes", type=int, default=None,
                    help="the largest roster a round record carries itself (default: the "
                         "tree's; 0: every roster stored and read)")
    ap.add_argument("--loops", default="pump", choices=("pump", "thread"),
                    help=f"run each process's nodes' loops from {PUMP_THREADS} threads (pump: "
                         "as the fault simulator does), or one thread per node (as agents do, "
                         "each on its own machine)")
    ap.add_argument("--tree", default=None,
                    help="import the library from this checkout (default: this one)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = [("closes on last join", 0.0)] + ([("settle window", args.settle)]
                                               if args.settle > 0 else [])
    follow_ups = tuple(c for c, on in (("reform", args.reform), ("replace", args.replace)) if on)
    tree = os.environ.get(_TREE_ENV) or os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))
    results = []
    inline = "" if args.inline_bytes is None else f"; rosters inline up to {args.inline_bytes} B"
    print(f"# tree {tree}{inline}; loops: {args.loops}; {os.cpu_count()} CPUs; "
          f"{args.etcd_members} etcd member(s); lease "
          f"TTL {LEASE_TTL_S:.0f} s; target: every node of 4,096 sees the round within "
          f"{TARGET_S:.0f} s of the last join; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    with _etcd(args.etcd_members) as endpoint:
        for case, settle in cases:
            for n in sizes:
                max_nodes = n if settle == 0.0 else 2 * n
                procs = args.processes or default_processes(n, args.loops)
                runs = [run_once(endpoint, n, max_nodes, settle, procs,
                                 follow_ups if settle == 0.0 else (), args.idle,
                                 args.inline_bytes, args.loops)
                        for _ in range(args.repeat)]
                first = runs[0]
                row = {"case": case, "nnodes": f"{n}:{max_nodes}", "settle_s": settle, "n": n,
                       "processes": procs, "round_bytes": first["round_bytes"],
                       "rendezvous": first["rendezvous"],
                       "threads_per_process": first["threads_per_process"],
                       "runs": runs}
                for phase in ("first", *follow_ups):
                    if phase in first:
                        row[phase] = dict(first[phase], seconds=statistics.median(
                            r[phase]["seconds"] for r in runs))
                results.append(row)
                rz = first["rendezvous"]
                print(f"{case:20s} nnodes {row['nnodes']:>10s} ({procs} proc): watched record "
                      f"{row['round_bytes']['watched']} B, stored roster "
                      f"{row['round_bytes']['stored_roster']} B, "
                      f"{row['round_bytes']['bucket_count']} buckets of "
                      f"{row['round_bytes']['buckets'] / max(row['round_bytes']['bucket_count'], 1):.0f}"
                      f" B; whole rendezvous: client "
                      f"{sum(v for k, v in rz['ops'].items() if k not in _NOT_REQUESTS) / n:.1f}"
                      f" requests/node, {rz['server']['proposals'] / n:.2f} proposals/node, "
                      f"threads/process {row['threads_per_process']}", flush=True)
                for phase in ("first", *follow_ups):
                    if phase in first:
                        _print_phase(phase, n, [r[phase] for r in runs])
                idle = first.get("idle_per_s")
                if idle:
                    print(f"{'':4s}idle: etcd {idle['unary_requests'] + idle['stream_messages']:.0f}"
                          f" requests/s, {idle['proposals']:.1f} proposals/s, CPU "
                          f"{100 * idle['cpu_s']:.1f}% of a core, RSS "
                          f"{idle['rss_bytes'] / 2**20:.0f} MiB", flush=True)
    largest = max((r for r in results if r["settle_s"] == 0.0), key=lambda r: r["n"])
    print()
    for line in model(largest):
        print(line)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
