"""Demo: an elastic DDP job on this machine survives a killed worker.

Run with ``make demo``. It starts an embedded etcd, then two ``elasticd``
agents ("nodes" a and b) with two DDP workers each (world size 4) training
``examples/ddp.py`` with a checkpoint every 10 steps; on a GPU host each
agent gets two GPUs of its own (four in all, or a clear error first). Midway it SIGKILLs one
worker; the output shows the agent detecting it, the leader forming a new
round, both agents restarting their (warm) workers, and training resuming from
the last committed checkpoint and going on to the end. ``elasticctl status`` and
``elasticctl events`` show the job before the end and its history after.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from agent import status as status_view  # noqa: E402
from agent.devices import colocated_node_gpus, physical_gpus, visible_gpus  # noqa: E402
from elastic.errors import ConfigError  # noqa: E402
from elastic.store import open_store  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402
from tests.integration.procs import wait_progress  # noqa: E402

JOB = "demo"
STEPS = 200
NODES = ("a", "b")
NPROC = 2  # workers per agent


def say(text: str) -> None:
    print(f"\n==> {text}\n", flush=True)


def node_of_worker(status: dict, rank: int, pid: int | None = None) -> str | None:
    """The node that runs the worker of global ``rank`` (with ``pid``), from
    ``elasticctl status`` data (:func:`agent.status.collect`).

    The agent that reports a worker with that pid (and rank) answers first:
    it started that process. Else the round does: ranks are dense and follow
    node ranks (a node's first rank is the number of workers on the nodes
    before it, as :mod:`agent.assign` hands them out). Node ids say nothing
    about node ranks: whoever joins first may get either. None when no node
    has the rank.
    """
    for node in status["nodes"]:
        workers = (node["agent"] or {}).get("workers") or []
        if pid is not None and any(w.get("pid") == pid and w.get("rank") == rank
                                   for w in workers):
            return node["node_id"]
    members = sorted((n for n in status["nodes"] if n["node_rank"] is not None),
                     key=lambda n: n["node_rank"])
    first = 0
    for node in members:
        if first <= rank < first + node["nproc"]:
            return node["node_id"]
        first += node["nproc"]
    return None


_WARM_READY = re.compile(r"warm worker pid \d+ is ready \((\d+) of \d+ warm\)")


def warm_nodes(output: list[str], nproc: int) -> set[str]:
    """The nodes whose agent said (in ``output``: "<node>: <line>", as
    :func:`relay` keeps it) that a whole set of ``nproc`` warm workers is
    ready, so that a restart there starts warm."""
    ready = set()
    for line in output:
        node, _, text = line.partition(": ")
        m = _WARM_READY.search(text)
        if m and int(m.group(1)) >= nproc:
            ready.add(node)
    return ready


def relay(name: str, proc: subprocess.Popen, seen: list[str]) -> threading.Thread:
    """Print an agent's output with its node name in front, and keep it in ``seen``."""
    def pump() -> None:
        for line in proc.stdout:
            seen.append(f"{name}: {line}")
            print(f"[node {name}] {line}", end="", flush=True)
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return t


def elasticctl(endpoint: str, *args: str) -> None:
    print(f"$ elasticctl {' '.join(args)} --etcd {endpoint} --job-id {JOB}", flush=True)
    subprocess.run([sys.executable, "-m", "agent.ctl", *args, "--etcd", endpoint,
                    "--job-id", JOB], cwd=REPO, check=False)


def agent_launches(endpoint: str, workdir: str, progress: str, environ: dict[str, str],
                   physical_gpus: int) -> list[tuple[str, list[str], dict[str, str]]]:
    """(node, argv, environment) of each agent of the demo.

    On a GPU host each agent gets its own ``NPROC`` GPUs (``CUDA_VISIBLE_DEVICES``
    from those ``environ`` shows, ``physical_gpus`` of them without it): its
    workers then pick NCCL, one GPU per LOCAL_RANK, and no GPU is in the group
    twice, which NCCL refuses. Without GPUs (or with ``CUDA_VISIBLE_DEVICES=""``)
    the environment is left alone and the workers use gloo on the CPU. Raises
    ConfigError when there are GPUs but fewer than ``len(NODES) * NPROC``.
    """
    visible = visible_gpus(physical_gpus, environ.get("CUDA_VISIBLE_DEVICES"))
    launches = []
    for index, node in enumerate(NODES):
        env = dict(environ)
        gpus = colocated_node_gpus(index, NPROC, visible)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        argv = [sys.executable, "-m", "agent.daemon", "--etcd", endpoint,
                "--job-id", JOB, "--node-id", node, "--nnodes", "2",
                "--nproc-per-node", str(NPROC), "--advertise-addr", "127.0.0.1",
                "--listen", "127.0.0.1:0", "--lease-ttl", "3", "--hang-timeout", "30",
                "--log-dir", os.path.join(workdir, "logs", node),
                "--checkpoint-dir", os.path.join(workdir, "checkpoints"),
                "examples/ddp.py", "--steps", str(STEPS), "--step-time", "0.05",
                "--ckpt-every", "10", "--progress-file", progress]
        launches.append((node, argv, env))
    return launches


def main() -> int:
    workdir = tempfile.mkdtemp(prefix="elastic-demo-")
    progress = os.path.join(workdir, "progress.jsonl")
    agents: dict[str, subprocess.Popen] = {}
    output: list[str] = []
    with EtcdServer() as etcd:
        etcd.start()
        say(f"embedded etcd at {etcd.endpoint}; starting two agents, 2 workers each")
        try:
            try:
                launches = agent_launches(etcd.endpoint, workdir, progress, dict(os.environ),
                                          physical_gpus())
            except ConfigError as exc:
                print(f"demo: {exc}", file=sys.stderr)
                return 2
            for node, argv, env in launches:
                agents[node] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True)
                relay(node, agents[node], output)

            say("waiting until training runs and both agents have warm workers ready")
            deadline = time.time() + 120
            while warm_nodes(output, 2) != set(agents) and time.time() < deadline:
                time.sleep(0.1)
            records = wait_progress(progress, lambda rs: any(r["step"] >= 40 for r in rs), 120)
            victim = next(r for r in reversed(records) if r["rank"] == 3)
            with open_store(etcd.endpoint) as store:
                node = node_of_worker(status_view.collect(store, JOB), 3, victim["pid"])
            say(f"training is at step {max(r['step'] for r in records)}: SIGKILL worker rank 3 "
                f"(pid {victim['pid']}) on node {node or '?'}")
            killed_at = time.time()
            os.kill(victim["pid"], signal.SIGKILL)

            records = wait_progress(progress, lambda rs: any(r["restart"] >= 1 for r in rs), 120)
            first = min((r for r in records if r["restart"] >= 1), key=lambda r: r["t"])
            say(f"the restarted group completed step {first['step']} (resumed from the last "
                f"checkpoint) {first['t'] - killed_at:.2f} s after the kill; the job's state now:")
            time.sleep(2.5)  # let the agents publish their progress
            elasticctl(etcd.endpoint, "status")

            codes = {node: p.wait(timeout=300) for node, p in agents.items()}
            say(f"agents exited with {codes}; the job's history:")
            elasticctl(etcd.endpoint, "events", "--limit", "30")
            say(f"done; worker logs per round are under {workdir}/logs")
            return 0 if set(codes.values()) == {0} else 1
        finally:
            for p in agents.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()


if __name__ == "__main__":
    sys.exit(main())
