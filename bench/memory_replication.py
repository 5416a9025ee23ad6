"""Memory-tier replication benchmark: how fast a slot reaches the buddy, against loopback.

Usage::

    python bench/memory_replication.py [--mib 256] [--repeat 3]

Three numbers, each on this machine's loopback:

1. **Replication**: a receiving agent's gRPC server (:class:`agent.grpc_server.AgentServer`
   with the memory tier's :class:`~agent.memory_receiver.ReplicaReceiver`, in a process
   of its own) and :class:`~agent.memory_client.ReplicaClient` sending one slot of
   ``--mib`` MiB from ``/dev/shm``: bytes per second, best of ``--repeat``.
2. **Loopback TCP**: the same bytes through one plain TCP connection between two
   processes, 1 MiB writes (what the network could carry at most here).
3. **Idle cost**: the CPU the replicator's thread spends per second of polling
   ``own/`` every 20 ms with 16 complete slots and nothing new to send.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent import memory_tier  # noqa: E402
from agent.memory_client import ReplicaClient  # noqa: E402
from agent.memory_receiver import ReplicaReceiver  # noqa: E402
from agent.memory_replication import POLL_RUNNING_S, Replicator  # noqa: E402
from elastic.checkpoint.memory import layout  # noqa: E402
from elastic.joblog import JobLogger  # noqa: E402
from elastic.rendezvous.api import Member, Round  # noqa: E402

JOB = "bench"


def a_round(port: int = 0) -> Round:
    return Round(number=1, members=(Member("a", 0, "127.0.0.1", 1),
                                    Member("b", 1, "127.0.0.1", 1, addr=f"127.0.0.1:{port}")),
                 master_addr="127.0.0.1", master_port=1, reason="bench", leader="a",
                 created_at=0.0)


def write_slot(memory_dir: str, rank: int, step: int, size: int) -> layout.SlotInfo:
    slot_dir = os.path.join(layout.own_dir(memory_dir), layout.SlotKey(1, rank, step % 2).name)
    layout.begin_write(slot_dir)
    block = os.urandom(1 << 20)
    with open(os.path.join(slot_dir, layout.DATA), "wb") as f:
        for _ in range(size >> 20):
            f.write(block)
    layout.finish_write(slot_dir, layout.Manifest(
        job_id=JOB, node_id="a", round=1, step=step, rank=rank, world_size=16,
        files={layout.DATA: size}))
    info = layout.read_slot(slot_dir)
    assert info is not None
    return info


class _Control:
    def __init__(self, receiver: ReplicaReceiver):
        self.replicate = receiver.receive


def serve(memory_dir: str) -> None:
    """The receiving agent (the ``--serve`` process): serves Replicate until stdin
    closes; prints its port."""
    from agent.grpc_server import AgentServer

    receiver = ReplicaReceiver(memory_dir, JOB, "b", a_round, lambda: 1 << 40,
                               threading.Lock())
    server = AgentServer("127.0.0.1:0", os.path.join(memory_dir, "agent.sock"),
                         control=_Control(receiver), heartbeats=None)
    server.start()
    print(server.address.rsplit(":", 1)[1], flush=True)
    sys.stdin.read()
    server.stop()


class Receiver:
    """The receiving agent, in a process of its own."""

    def __init__(self, scratch: str):
        receiving = os.path.join(scratch, "b")
        os.makedirs(receiving)
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", receiving],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def replication_rate(receiver: Receiver, size: int, repeat: int, scratch: str) -> float:
    info = write_slot(os.path.join(scratch, "a"), 0, 1, size)
    client = ReplicaClient(JOB, "a", None)
    best = 0.0
    for _ in range(repeat):
        started = time.perf_counter()
        sent = client.send_slot(f"127.0.0.1:{receiver.port}", 1, info)
        best = max(best, sent / (time.perf_counter() - started))
    client.close()
    return best


def loopback_rate(size: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sink = subprocess.Popen([sys.executable, "-c", (
        "import socket,sys\n"
        f"s=socket.create_connection(('127.0.0.1',{port}))\n"
        "while s.recv(1<<20): pass\n")])
    conn, _ = listener.accept()
    block = b"\0" * (1 << 20)
    started = time.perf_counter()
    for _ in range(size >> 20):
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)
    sink.wait()
    elapsed = time.perf_counter() - started
    conn.close()
    listener.close()
    return size / elapsed


def idle_cpu_per_s(receiver: Receiver, scratch: str, seconds: float = 3.0) -> float:
    """CPU of the replicator's passes per second once the buddy has every slot."""
    memory = memory_tier.MemoryDir(scratch, scratch, os.path.join(scratch, "idle"), "")
    for rank in range(8):
        for step in (0, 1):
            write_slot(memory.path, rank, step, 1 << 20)
    replicator = Replicator(memory, "a", 8, lambda: a_round(receiver.port), lambda: True,
                            ReplicaClient(JOB, "a", None), threading.Lock(),
                            JobLogger(logging.getLogger("bench"), JOB, "a"))
    logging.basicConfig(level=logging.WARNING)
    replicator.run_once()  # sends each rank's newest slot: nothing is new after this
    assert replicator.status().lag_steps == 0, replicator.status()
    started_cpu, started = time.thread_time(), time.monotonic()
    while time.monotonic() - started < seconds:
        replicator.run_once()
        time.sleep(POLL_RUNNING_S)
    return (time.thread_time() - started_cpu) / (time.monotonic() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    size = args.mib << 20
    scratch = tempfile.mkdtemp(prefix="elastic-bench-", dir="/dev/shm")
    receiver = Receiver(scratch)
    try:
        replication = replication_rate(receiver, size, args.repeat, scratch)
        loopback = loopback_rate(size)
        idle = idle_cpu_per_s(receiver, scratch)
    finally:
        receiver.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"replication: {replication / 1e6:.0f} MB/s ({args.mib} MiB slot, best of "
          f"{args.repeat})")
    print(f"loopback TCP: {loopback / 1e6:.0f} MB/s (replication at "
          f"{100 * replication / loopback:.0f}% of it)")
    print(f"idle cost: {100 * idle:.2f}% of one core (polling own/ every "
          f"{POLL_RUNNING_S * 1000:.0f} ms, 16 slots, nothing to send)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
