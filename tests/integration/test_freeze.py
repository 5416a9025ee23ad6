"""A frozen node costs about a second, not a lease TTL; a slow node costs nothing.

Real ``elasticd`` processes on a real etcd, one progress worker each (no
torch; see ``test_faults.py``), a lease TTL of 5 s and the default freeze
timeout (1 s). A node's agent and worker get SIGSTOP: its ring peer's probes
go unanswered, the leader (or, when the frozen node leads, the peer that
reported it) revokes its lease, and the survivors train again in a new round
long before the lease could have expired. When the node thaws, its agent
finds its lease gone, stops its old worker and joins again. A node frozen for
less than the timeout, or slowed by a CPU hog, keeps its place: no round forms.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_faults import Cluster, tagged_pids
from tests.proctable import alive

pytestmark = [pytest.mark.integration]

LEASE_TTL_S = 5.0
FREEZE_TIMEOUT_S = 1.0  # the default at this lease TTL
# Freeze to the survivors' first step of the new round: the freeze timeout,
# the leader's check, the round and the new workers' start, with slack for a
# loaded 2-core machine. A lease expiry takes at least 2/3 of a TTL (3.3 s)
# after the freeze, plus the same round and start.
RECOVERY_BOUND_S = 3.0
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture
def cluster(etcd_endpoint, job_id, tmp_path):
    c = Cluster(etcd_endpoint, job_id, tmp_path)
    try:
        yield c
    finally:
        for pid in tagged_pids(c.tag):  # a test that failed may leave a node stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        c.teardown()


def start_three(cluster: Cluster, lease_ttl_s: float = LEASE_TTL_S) -> tuple[dict, int]:
    """Three agents training in one round: the agents by node id, and the round."""
    agents = {n: cluster.start(n, "2:3", extra=("--lease-ttl", f"{lease_ttl_s:g}"))
              for n in NODES}
    together = cluster.wait_until(
        lambda: _round_with(cluster.records(), set(NODES)), 60,
        "the three nodes to train in one round", running=tuple(agents.values()))
    return agents, together


def _round_with(records: list[dict], nodes: set[str]) -> int | None:
    """The newest round in which every node of ``nodes`` made a step."""
    by_round: dict[int, set[str]] = {}
    for r in records:
        if r["step"] >= 1:
            by_round.setdefault(r["round"], set()).add(r["node"])
    return max((n for n, seen in by_round.items() if seen >= nodes), default=None)


def leader_of(store, cluster: Cluster) -> str:
    kv = store.get(cluster.keys.leader)
    return kv.value.decode()


def node_pids(cluster: Cluster, agent) -> list[int]:
    """The agent and every process of the test under it (its workers)."""
    return [agent.proc.pid] + [p for p in tagged_pids(cluster.tag) if _under(p, agent.proc.pid)]


def _under(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])
        if pid == ancestor:
            return True
    return False


def seconds_to_train_again(cluster: Cluster, agents: dict, survivors: set[str], r0: int,
                           since: float, how: str) -> float:
    """From ``since`` to the survivors' first step in a round after ``r0``."""
    first = cluster.wait_until(
        lambda: [r for r in cluster.records()
                 if r["node"] in survivors and r["round"] > r0 and r["t"] > since],
        20, f"the survivors to train {how}", running=tuple(agents[n] for n in survivors))[0]
    return first["t"] - since


def freeze(pids: list[int]) -> float:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return time.time()


def thaw(pids: list[int]) -> float:
    for pid in reversed(pids):
        os.kill(pid, signal.SIGCONT)
    return time.time()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("who", ["member", "leader"])
def test_a_frozen_node_is_dropped_within_the_freeze_timeout_and_fail_stops_when_it_thaws(
        cluster, etcd_store, who):
    agents, r0 = start_three(cluster)
    leader = leader_of(etcd_store, cluster)
    frozen_id = leader if who == "leader" else next(n for n in NODES if n != leader)
    frozen = agents[frozen_id]
    survivors = {n for n in NODES if n != frozen_id}
    pids = node_pids(cluster, frozen)
    old_workers = [p for p in pids if p != frozen.proc.pid]
    assert old_workers, f"{frozen_id} runs no worker to freeze"

    frozen_at = freeze(pids)
    recovery_s = seconds_to_train_again(cluster, agents, survivors, r0, frozen_at,
                                        f"without the frozen {frozen_id}")
    survivor_text = "".join(agents[n].text for n in survivors)
    assert f"revoked the lease of {frozen_id}" in survivor_text, (
        f"the lease of {frozen_id} must have been revoked\n{cluster.tails()}")
    assert recovery_s <= RECOVERY_BOUND_S, (
        f"the survivors trained again {recovery_s:.2f} s after {frozen_id} froze: more than "
        f"{RECOVERY_BOUND_S:g} s (freeze timeout {FREEZE_TIMEOUT_S:g} s, lease TTL "
        f"{LEASE_TTL_S:g} s)\n{cluster.tails()}")

    thawed_at = thaw(pids)
    cluster.wait_until(lambda: not any(alive(p) for p in old_workers), 5,
                       f"the thawed {frozen_id} to stop its old workers {old_workers}",
                       running=(frozen,))
    # Its watch may show it the new round before its keep-alive finds the lease gone:
    # either stops the old workers, and the lease loss must follow.
    cluster.wait_until(lambda: "lease lost" in frozen.text, 5,
                       f"the thawed {frozen_id} to find its lease revoked", running=(frozen,))
    late = [r for r in cluster.records() if r["node"] == frozen_id and r["round"] <= r0
            and r["t"] > thawed_at + 2.0]
    assert not late, f"{frozen_id}'s old workers went on stepping after it thawed: {late[:3]}"
    cluster.wait_until(lambda: _round_with(cluster.records(), set(NODES)) not in (None, r0),
                       30, f"{frozen_id} to train again with the others in a new round",
                       running=tuple(agents.values()))


@pytest.mark.timeout(120)
def test_a_dead_leader_whose_death_broke_the_survivors_workers_is_replaced_within_the_freeze_timeout(
        cluster, etcd_store):
    # A lease TTL whose expiry (at least 2/3 of it) lies far beyond the bound.
    agents, r0 = start_three(cluster, lease_ttl_s=10.0)
    leader = leader_of(etcd_store, cluster)
    survivors = {n for n in NODES if n != leader}
    doomed = node_pids(cluster, agents[leader])
    # A dead node's peers see their collectives fail at once and stop their
    # workers: the survivors are no longer running when the leader's silence counts.
    broken = [p for n in survivors for p in node_pids(cluster, agents[n])[1:]]
    assert broken, "the survivors run no worker whose collective could break"

    died_at = time.time()
    for pid in doomed + broken:
        os.kill(pid, signal.SIGKILL)
    recovery_s = seconds_to_train_again(cluster, agents, survivors, r0, died_at,
                                        f"without the dead leader {leader}")
    assert f"revoked the lease of {leader}" in "".join(agents[n].text for n in survivors), (
        f"a survivor must have revoked the lease of {leader}\n{cluster.tails()}")
    assert recovery_s <= RECOVERY_BOUND_S, (
        f"the survivors trained again {recovery_s:.2f} s after the leader {leader} died: more "
        f"than {RECOVERY_BOUND_S:g} s (freeze timeout {FREEZE_TIMEOUT_S:g} s)\n"
        f"{cluster.tails()}")


def _rounds_since(cluster: Cluster, r0: int, since: float) -> list[dict]:
    return [r for r in cluster.records() if r["round"] > r0 and r["t"] > since]


@pytest.mark.timeout(120)
def test_a_node_frozen_for_less_than_the_timeout_keeps_its_place(cluster, etcd_store):
    agents, r0 = start_three(cluster)
    leader = leader_of(etcd_store, cluster)
    pids = node_pids(cluster, agents[next(n for n in NODES if n != leader)])

    frozen_at = freeze(pids)
    time.sleep(0.4)
    thaw(pids)
    time.sleep(3 * FREEZE_TIMEOUT_S)

    assert not _rounds_since(cluster, r0, frozen_at), (
        f"a 0.4 s freeze (freeze timeout {FREEZE_TIMEOUT_S:g} s) started a new round\n"
        f"{cluster.tails()}")
    assert "revoked the lease" not in "".join(a.text for a in agents.values())


HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


@pytest.mark.timeout(120)
def test_a_node_slowed_by_a_cpu_hog_keeps_its_place(cluster, etcd_store):
    agents, r0 = start_three(cluster)
    slowed = agents[next(n for n in NODES if n != leader_of(etcd_store, cluster))]
    cpus = sorted(os.sched_getaffinity(slowed.proc.pid))
    hog_s = 4 * FREEZE_TIMEOUT_S
    # Two busy processes per CPU the agent may run on, pinned there beside it.
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(s=hog_s)],
                             preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))
            for cpu in cpus for _ in range(2)]
    started_at = time.time()
    try:
        for hog in hogs:
            hog.wait(timeout=hog_s + 10)
    finally:
        for hog in hogs:
            hog.kill()
    time.sleep(FREEZE_TIMEOUT_S)

    assert not _rounds_since(cluster, r0, started_at), (
        f"{slowed.node_id} under a CPU hog was taken for frozen\n{cluster.tails()}")
    assert "revoked the lease" not in "".join(a.text for a in agents.values())
