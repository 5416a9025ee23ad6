"""Demo: a private etcd, three nodes form a round, one is killed, the others re-form.

Run with ``make demo``. Each node is a real process (``python -m agent.member``)
with its own etcd lease; the killed one gets SIGKILL, so only its lease expiry
tells the others, and the leader commits the next round without it. The job's
state is shown with ``elasticctl status`` before and after, and its history
with ``elasticctl events``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from elastic.store.server import EtcdServer  # noqa: E402
from tests.integration.procs import MemberProcess  # noqa: E402

JOB = "demo"
LEASE_TTL = 2.0


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def elasticctl(endpoint: str, *args: str) -> None:
    cmd = [sys.executable, "-m", "agent.ctl", *args, "--etcd", endpoint, "--job-id", JOB]
    print("$ elasticctl " + " ".join(args + ("--etcd", endpoint, "--job-id", JOB)), flush=True)
    subprocess.run(cmd, cwd=REPO, check=False)


def main() -> int:
    with EtcdServer() as etcd:
        etcd.start()
        say(f"started a private etcd at {etcd.endpoint}")
        nodes = [MemberProcess(etcd.endpoint, JOB, f"node{i}", "2:3", lease_ttl=LEASE_TTL,
                               settle=0.5) for i in (1, 2, 3)]
        try:
            say("three nodes join with --nnodes 2:3 (lease TTL 2 s)")
            for n in nodes:
                r = n.wait_round(["node1", "node2", "node3"])
                print(f"   {n.node_id}: round {r['number']}, node rank {r['node_rank']} "
                      f"of {len(r['members'])}", flush=True)
            elasticctl(etcd.endpoint, "status")

            say("SIGKILL node3: no goodbye, only its lease expiry will tell")
            killed = time.monotonic()
            nodes[2].proc.send_signal(signal.SIGKILL)
            for n in nodes[:2]:
                r = n.wait_round(["node1", "node2"], timeout_s=LEASE_TTL + 10)
            print(f"   node1 and node2 are in round {r['number']} "
                  f"{time.monotonic() - killed:.2f} s after the kill: {r['reason']}", flush=True)
            elasticctl(etcd.endpoint, "status")

            say("node4 joins and is taken in at the next round")
            nodes.append(MemberProcess(etcd.endpoint, JOB, "node4", "2:3", lease_ttl=LEASE_TTL,
                                       settle=0.5))
            r = nodes[-1].wait_round(["node1", "node2", "node4"])
            print(f"   round {r['number']}: {r['members']} ({r['reason']})", flush=True)
            elasticctl(etcd.endpoint, "events")
        finally:
            for n in nodes:
                n.stop()
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
