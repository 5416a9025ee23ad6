"""Fault schedules for the simulator, drawn from a seeded random generator."""

from __future__ import annotations

import random
from dataclasses import dataclass

# What can go wrong, and how often it is drawn (weights).
KINDS = {
    "crash_worker": 3,  # a worker exits 1
    "hang_worker": 2,  # a worker stops (SIGSTOP): no heartbeat, no progress
    "kill_agent": 3,  # SIGKILL of the agent (and so its workers); restarted with the same id
    "cut_store": 3,  # the node loses etcd but not its peers
    "cut_peers": 2,  # the node loses its peers but not etcd
    "cut_both": 2,  # the node loses everything (a dead switch port)
    "cut_round": 2,  # every member of the round loses etcd, not each other (standbys keep it)
    "store_errors": 2,  # 30 % of the node's etcd calls fail
    "slow_store": 2,  # the node's loops are stuck in slow etcd calls (keep-alives go on)
    "freeze": 2,  # the whole node is frozen (SIGSTOP of agent and workers), then resumed
    "ambiguous": 2,  # 30 % of the node's writes land but report a timeout
    "expire_lease": 2,  # etcd drops the node's lease
    "leader_loss": 2,  # etcd drops the leader's lease
    "outage": 2,  # etcd is down for everyone
    "join": 1,  # a new node arrives
    "drain": 1,  # an operator drains a node
    "garbage_round": 1,  # someone writes garbage over the round key
}


@dataclass(frozen=True)
class Fault:
    at: float  # seconds into the run
    kind: str
    node: str
    duration: float = 0.0  # how long it lasts (for kill_agent: until systemd restarts it)

    def __str__(self) -> str:
        lasting = f" for {self.duration:.2f} s" if self.duration else ""
        return f"{self.kind} {self.node} at {self.at:.2f} s{lasting}"


def make_schedule(rng: random.Random, nodes: list[str], min_nodes: int) -> list[Fault]:
    """1 to 4 faults within the first 25 s; at most one drain, and only while
    more than ``min_nodes`` nodes would remain."""
    kinds, weights = zip(*KINDS.items())
    faults = []
    joined = 0
    drained = False
    for _ in range(rng.randint(1, 4)):
        kind = rng.choices(kinds, weights)[0]
        at = round(rng.uniform(0.0, 25.0), 2)
        if kind == "join":
            joined += 1
            faults.append(Fault(at, kind, f"x{joined}"))
            continue
        if kind == "drain" and (drained or len(nodes) - 1 < min_nodes):
            kind = "crash_worker"
        drained = drained or kind == "drain"
        node = rng.choice(nodes)
        duration = 0.0
        if kind in ("cut_round", "garbage_round"):
            node = "*"  # whoever the members are when it strikes
        if kind in ("cut_store", "cut_peers", "cut_both", "cut_round", "store_errors",
                    "ambiguous", "outage", "slow_store", "freeze"):
            duration = round(rng.uniform(0.5, 12.0), 2)
        elif kind == "kill_agent":
            duration = round(rng.choice((0.5, 1.0, 2.0, 6.0)), 2)
        faults.append(Fault(at, kind, node, duration))
    return faults


def make_budget_schedule(rng: random.Random, nodes: list[str], max_restarts: int
                         ) -> list[Fault]:
    """More failures than the restart budget allows, a few seconds apart (so
    most strike a running round, each then counted once): a crash or a hang
    of a worker, on any node. Spending the budget must fail the job, with
    every agent exiting and none restarted by systemd for it."""
    faults = []
    at = round(rng.uniform(2.0, 5.0), 2)
    for _ in range(max_restarts + rng.randint(1, 3)):
        kind = rng.choices(("crash_worker", "hang_worker"), (3, 1))[0]
        faults.append(Fault(at, kind, rng.choice(nodes)))
        at = round(at + rng.uniform(3.0, 7.0), 2)
    return faults


def make_partition_schedule(rng: random.Random, nodes: list[str]) -> list[Fault]:
    """One partition that leaves a node, or the whole round, without etcd but
    not without the others, often long enough for their leases to expire.
    The profile runs without the leader's fence, so only the cut-off nodes'
    own stop rule keeps a zombie group from training beside the round that
    forms without them. One at a time: when every node loses etcd (a round
    and its standbys cut off together), the nodes take etcd for down and
    train on, and only the fence stops them once a node is back."""
    kind = rng.choices(("cut_round", "cut_store"), (3, 1))[0]
    node = "*" if kind == "cut_round" else rng.choice(nodes)
    return [Fault(round(rng.uniform(2.0, 20.0), 2), kind, node,
                  round(rng.uniform(1.0, 10.0), 2))]


# The memory profile's faults: the ones that lose a node's memory (an agent's
# death), keep it but stop the workers (a crash, a hang, a freeze, a cut), a
# node and another lost together, and a node cut off while the job goes on
# without it, then another one lost (the cut-off node comes back with the
# older round's snapshots, the newer round's are incomplete).
MEMORY_KINDS = {"kill_agent": 4, "crash_worker": 3, "cut_both": 2, "cut_peers": 1,
                "freeze": 1, "hang_worker": 1, "kill_pair": 1, "stale_return": 2}


def make_memory_schedule(rng: random.Random, nodes: list[str]) -> list[Fault]:
    """1 to 3 faults within the first 25 s, drawn from :data:`MEMORY_KINDS`; an
    agent stays dead from 0.5 s (back before its lease expires) to 12 s (a
    round forms without it); a ``kill_pair`` is two agents killed at once."""
    kinds, weights = zip(*MEMORY_KINDS.items())
    faults = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choices(kinds, weights)[0]
        at = round(rng.uniform(2.0, 25.0), 2)
        if kind in ("kill_agent", "kill_pair"):
            down = round(rng.choice((0.5, 2.0, 6.0, 12.0)), 2)
            pair = rng.sample(nodes, 2 if kind == "kill_pair" and len(nodes) > 1 else 1)
            faults.extend(Fault(at, "kill_agent", node, down) for node in pair)
        elif kind == "stale_return" and len(nodes) > 1:
            cut, killed = rng.sample(nodes, 2)
            faults.append(Fault(at, "cut_both", cut, round(rng.uniform(8.0, 16.0), 2)))
            faults.append(Fault(round(at + rng.uniform(2.0, 8.0), 2), "kill_agent", killed,
                                12.0))
        else:
            kind = "crash_worker" if kind == "stale_return" else kind
            duration = 0.0 if kind in ("crash_worker", "hang_worker") \
                else round(rng.uniform(0.5, 12.0), 2)
            faults.append(Fault(at, kind, rng.choice(nodes), duration))
    return faults
