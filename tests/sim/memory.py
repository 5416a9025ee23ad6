"""The memory tier in the simulator: each node's memory, replication to its buddy,
the agent's free rule, and the restore's choice, with the tier's invariants.

The rules are the real ones, called, not copied: whom a node replicates to
(the round's placement, :meth:`elastic.rendezvous.api.Round.placement`), what it sends
(:func:`agent.memory_rules.to_send`), what it frees
(:func:`agent.memory_rules.slots_to_free`, every ``FULL_SCAN_S`` of
:mod:`agent.memory_replication`), and which snapshot a new group restores
(:func:`elastic.checkpoint.memory.choice.choose`, or the rule passed as
``choose``: the planted-bug tests pass broken ones). The rest is modelled:

* **Workers** stage ``(round, rank, step)`` into their node's memory every
  ``every`` steps, alternating between the rank's two slots of the round (a
  staging is instant: the steps of a group are atomic here, so a worker's own
  slot is never torn).
* **Replication** is one send at a time per node, each taking a seeded lag;
  the receiver's copy of the slot is torn (incomplete) from the first byte
  until the last. A send is dropped, its copy left torn, when either end is
  gone or cut off from its peers, when the receiver does not know the source
  as a member of its round, or when the worker rewrote the slot meanwhile
  (the layout's ``still_same`` check); the sender retries ``RETRY_S`` later.
* **Memory** is lost with the agent that owns it (killed or exited: it removes
  its directory, a restarted one removes what the last left); it is kept
  through a worker crash, a freeze and a partition.

Checked at each restore (violations as in :mod:`tests.sim.cluster`):

* the chosen memory set is complete (every rank of its round), of one round,
  and made of complete slots of its step that the readers' nodes hold;
* it is never of an older round than the disk's latest commit, never of an
  older step;
* lineage: the state restored is one that round's group trained (a step
  after the one it started from, at most the last it reached);
* lost work: when the previous group staged a complete snapshot and at most
  one of its nodes is missing from the restore (its memory lost since that
  group started, or not a member of the new group) with replication
  *current* for it (when it went missing, a node of the new group whose
  memory survived held a complete replica of each of its ranks' newest own
  snapshot), the restore resumes at most ``every`` steps behind the last step
  the previous group reached. Two nodes missing (a node and its buddy) are
  not bounded: their set is incomplete and disk is used, which the checks
  above then cover.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from agent import memory_receiver, memory_rules
from agent.memory_replication import FULL_SCAN_S, RETRY_S
from elastic.checkpoint.memory import choice as memory_choice
from elastic.checkpoint.memory.choice import Choice, DiskLatest, SlotSeen
from elastic.checkpoint.memory.layout import OWN, SLOTS_PER_RANK, SlotKey
from elastic.rendezvous.api import Round

Choose = Callable[[Iterable[SlotSeen], "DiskLatest | None"], Choice]
NPROC = 2  # workers per simulated node (the cluster's nproc_per_node)


@dataclass(frozen=True)
class Snapshot:
    """A complete slot: rank ``key.rank``'s state after ``step`` steps, trained by
    round ``key.round``'s group of ``world_size`` ranks."""

    key: SlotKey
    step: int
    world_size: int


@dataclass
class _Send:
    source: str
    receiver: str
    snapshot: Snapshot
    arrives_at: float


@dataclass
class _Node:
    """One node's memory directory, ``(holder, key) -> Snapshot`` (None: torn),
    and its replicator's state."""

    slots: dict[tuple[str, SlotKey], Snapshot | None] = field(default_factory=dict)
    acked: dict[int, memory_rules.Acked] = field(default_factory=dict)
    buddy: str | None = None
    sending: _Send | None = None
    retry_at: float = 0.0
    scanned_at: float = -FULL_SCAN_S
    # Bumped by every change of the slots or the acknowledgements: the rules are
    # pure, so a pass asks them again only when what they read changed.
    version: int = 0
    scanned: int | None = None  # the version the last free pass saw
    offered: int = -1  # the version of the last call of to_send

    def put(self, holder: str, key: SlotKey, snap: Snapshot | None) -> None:
        self.slots[(holder, key)] = snap
        self.version += 1


@dataclass
class _Trained:
    """What a round's group did: the step it restored, the last it reached, its nodes
    in rank order, and when it formed."""

    start: int
    reached: int
    nodes: tuple[str, ...]
    started_at: float
    staged: bool = False  # some step of it was staged by every rank


def draw_memory_tier(seed: int, on: bool | None, share: float,
                     choose: Choose | None = None) -> "MemoryTier | None":
    """The seed's memory tier: on when ``on`` says so, else (None) in ``share``
    of the seeds; its snapshot interval and replication lag drawn from the
    seed, apart from the schedule's draws."""
    rng = random.Random(f"memory-{seed}")
    if not (on if on is not None else rng.random() < share):
        return None
    every = rng.choice((1, 1, 2, 4))
    lag = rng.choice(((0.01, 0.1), (0.1, 0.6), (0.5, 3.0)))
    return MemoryTier(every, lag, rng, **({"choose": choose} if choose else {}))


class MemoryTier:
    """The simulated memory tier of every node (see the module docstring)."""

    def __init__(self, every: int, lag_s: tuple[float, float], rng: random.Random, *,
                 choose: Choose = memory_choice.choose):
        self.every = every
        self.lag_s = lag_s
        self.rng = rng
        self.choose = choose
        self.nodes: dict[str, _Node] = {}
        self.trained: dict[int, _Trained] = {}
        # node -> (when its memory was lost, the nodes that held its newest snapshots then)
        self.lost: dict[str, list[tuple[float, frozenset[str]]]] = {}
        self.violations: list[str] = []
        self.restores = {memory_choice.MEMORY: 0, memory_choice.DISK: 0}
        self._writes: dict[tuple[int, int], int] = {}  # (round, rank) -> snapshots written

    def report(self, result) -> None:
        """Move the violations found so far into ``result`` (a
        :class:`tests.sim.cluster.Result`), with the restores from memory."""
        result.violations.extend(self.violations)
        self.violations.clear()
        result.restored_from_memory = self.restores[memory_choice.MEMORY]

    def _node(self, node_id: str) -> _Node:
        return self.nodes.setdefault(node_id, _Node())

    # ------------------------------------------------------------- workers

    def stepped(self, round_: int, step: int, ranks: Sequence[tuple[str, int, int]]) -> None:
        """Round ``round_``'s group completed ``step``; ``ranks``: (node, rank, world
        size) of its workers. Each stages a snapshot when the step is due."""
        self.trained[round_].reached = step
        if step % self.every:
            return
        for node_id, rank, world in ranks:
            written = self._writes.get((round_, rank), 0)
            self._writes[(round_, rank)] = written + 1
            key = SlotKey(round_, rank, written % SLOTS_PER_RANK)
            self._node(node_id).put(OWN, key, Snapshot(key, step, world))
        self.trained[round_].staged = True

    # --------------------------------------------------------------- agents

    def lose(self, node_id: str, now: float) -> None:
        """The node's agent died or exited: its memory directory is gone. Records
        which nodes held its ranks' newest snapshots then (for the lost-work check)."""
        mem = self.nodes.pop(node_id, None)
        if mem is None:
            return
        self.lost.setdefault(node_id, []).append((now, self._replica_holders(node_id, mem)))
        for other in self.nodes.values():
            if other.sending is not None and other.sending.receiver == node_id:
                other.sending, other.retry_at = None, now + RETRY_S

    def _replica_holders(self, node_id: str, mem: _Node) -> frozenset[str]:
        """The other nodes that hold a complete replica of each of ``node_id``'s
        ranks' newest own snapshot: replication is *current* on them."""
        newest = [mem.slots[(OWN, s.key)]
                  for s in memory_rules.newest_per_rank(self._seen(mem, OWN)).values()]
        return frozenset(other for other, held in self.nodes.items() if other != node_id
                         and all(held.slots.get((node_id, snap.key)) == snap for snap in newest))

    def _held(self, node_id: str, key: SlotKey) -> Snapshot | None:
        """The complete snapshot of slot ``key`` on ``node_id`` (own or a replica)."""
        mem = self.nodes.get(node_id)
        return next((snap for (_, k), snap in sorted(mem.slots.items()) if k == key and snap),
                    None) if mem else None

    @staticmethod
    def _seen(mem: _Node, holder: str | None = None) -> list[memory_rules.SlotSeen]:
        return [memory_rules.SlotSeen(h, key, snap.step if snap else None, 1 if snap else 0)
                for (h, key), snap in mem.slots.items() if holder in (None, h)]

    @property
    def settings(self) -> str:
        lag = f"{self.lag_s[0]:g}-{self.lag_s[1]:g} s"
        return f"snapshots every {self.every} step(s), replication {lag}"

    def replicate_all(self, running: dict[str, Round | None], now: float,
                      connected: Callable[[str, str], bool]) -> None:
        """A pass of each running node's replicator (``running``: the node ids of
        the live, unfrozen agents, each with the round it knows)."""
        for node_id, current in sorted(running.items()):
            self.replicate(node_id, current, now, connected, running.get)

    def replicate(self, node_id: str, current: Round | None, now: float,
                  connected: Callable[[str, str], bool],
                  known_round: Callable[[str], Round | None]) -> None:
        """One pass of the node's replicator (its agent is alive and not frozen):
        finish the send in flight, free what the rule says, start the next send.
        ``current`` is the round its agent knows; ``known_round(node)`` another
        live agent's (None when that node's agent is gone or frozen)."""
        mem = self._node(node_id)
        if mem.sending is not None:
            if now < mem.sending.arrives_at:
                return  # the pass is busy in the send
            self._arrive(mem, mem.sending, connected, known_round, now)
            mem.sending = None
        placed = current.placement(node_id) if current else None
        buddy = placed.buddy.node_id if placed and placed.buddy else None
        if buddy != mem.buddy:
            mem.buddy, mem.acked = buddy, {}
            mem.version += 1
        if now - mem.scanned_at >= FULL_SCAN_S:
            mem.scanned_at = now
            if mem.scanned != mem.version:
                self._free(mem)
                mem.scanned = mem.version
        if buddy is None or now < mem.retry_at or mem.offered == mem.version:
            return
        mem.offered = mem.version
        pending = memory_rules.to_send([s for s in self._seen(mem, OWN) if s.complete],
                                       mem.acked)
        if not pending:
            return
        if not self._accepts(node_id, buddy, connected, known_round):
            mem.retry_at, mem.offered = now + RETRY_S, -1
            return
        snap = mem.slots[(OWN, pending[0].key)]
        # begin_write on the receiver: its copy is torn until the last byte lands.
        self._node(buddy).put(node_id, snap.key, None)
        mem.sending = _Send(node_id, buddy, snap, now + self.rng.uniform(*self.lag_s))

    def _free(self, mem: _Node) -> None:
        for s in memory_rules.slots_to_free(self._seen(mem), NPROC):
            del mem.slots[(s.holder, s.key)]
            mem.version += 1

    def _accepts(self, source: str, receiver: str, connected, known_round) -> bool:
        """Whether ``receiver``'s agent answers ``source`` and takes its replicas: it
        runs, they reach each other, and the receiver's rule takes ``source`` in its round."""
        known = known_round(receiver)
        return known is not None and connected(source, receiver) \
            and memory_receiver.may_send(known, receiver, source)

    def _arrive(self, mem: _Node, send: _Send, connected, known_round, now: float) -> None:
        receiver = self.nodes.get(send.receiver)
        if receiver is None or not self._accepts(send.source, send.receiver, connected,
                                                 known_round):
            mem.retry_at, mem.offered = now + RETRY_S, -1
            return
        if mem.slots.get((OWN, send.snapshot.key)) != send.snapshot:
            return  # rewritten or freed meanwhile: the copy is abandoned, torn
        if (send.source, send.snapshot.key) in receiver.slots:  # not freed meanwhile
            receiver.put(send.source, send.snapshot.key, send.snapshot)
            mem.acked[send.snapshot.key.rank] = memory_rules.Acked(
                send.snapshot.key.round, send.snapshot.step)
            mem.version += 1

    # -------------------------------------------------------------- restore

    def restore(self, round_: int, readers: Sequence[tuple[str, int]],
                disk: tuple[int, int], now: float) -> int:
        """The step round ``round_``'s group resumes from: what ``choose`` says over
        the complete slots its workers' nodes hold (``readers``: node, new rank)
        and the disk's latest commit (``disk``: step, round; (0, 0): none).
        Checks the invariants of the module docstring."""
        latest = DiskLatest(*disk) if disk != (0, 0) else None
        seen = [SlotSeen(rank, key, snap.step, snap.world_size)
                for node_id, rank in readers
                for (_, key), snap in sorted(self._node(node_id).slots.items()) if snap]
        choice = self.choose(seen, latest)
        self.restores[choice.source] += 1
        if choice.source == memory_choice.MEMORY:
            self._check_set(round_, choice, {rank: node for node, rank in readers}, latest)
            step = choice.step
        else:
            step = latest.step if latest else 0
        nodes = tuple(dict.fromkeys(node for node, _ in sorted(readers, key=lambda r: r[1])))
        self._check_lost_work(round_, step, set(nodes), latest)
        self.trained[round_] = _Trained(step, step, nodes, now)
        return step

    def _check_set(self, round_: int, choice: Choice, node_of: dict[int, str],
                   disk: DiskLatest | None) -> None:
        v = self.violations
        what = f"round {round_} restored memory {choice.label}"
        missing = sorted(set(range(choice.world_size)) - set(choice.holders))
        if missing:
            v.append(f"{what}, incomplete: no slot of rank(s) {missing}")
        for rank, readers in choice.holders.items():
            for reader, key in readers.items():
                snap = self._held(node_of[reader], key) if reader in node_of else None
                if key.round != choice.round or key.rank != rank:
                    v.append(f"{what}, mixing in slot {key.name} (not round {choice.round}'s "
                             f"rank {rank})")
                elif snap is None or (snap.step, snap.world_size) != (choice.step,
                                                                      choice.world_size):
                    v.append(f"{what}, using slot {key.name} on {node_of.get(reader)}, which "
                             f"holds {'no complete snapshot' if snap is None else snap}")
        if disk is not None and (choice.round < disk.round or choice.step < disk.step):
            v.append(f"{what} over the newer disk commit of step {disk.step} in round "
                     f"{disk.round}")
        trained = self.trained.get(choice.round)
        if trained is None or not trained.start < choice.step <= trained.reached:
            v.append(f"{what}: a state round {choice.round} never trained ("
                     + (f"it trained steps {trained.start + 1}..{trained.reached})"
                        if trained else "it never trained)"))

    def _check_lost_work(self, round_: int, step: int, readers: set[str],
                         disk: DiskLatest | None) -> None:
        before = [r for r in self.trained if r < round_]
        if not before or not self.trained[max(before)].staged:
            return  # nothing trained before, or no complete snapshot staged
        prev = self.trained[max(before)]
        # Each node of the previous group whose memory the restore cannot read, with the
        # nodes that held replicas of its newest snapshots when it went missing (its
        # first loss since: a later incarnation held nothing of that group's).
        missing: dict[str, frozenset[str]] = {}
        for n in prev.nodes:
            losses = [holders for when, holders in self.lost.get(n, [])
                      if when >= prev.started_at]
            if losses:
                missing[n] = losses[0]
        for n in prev.nodes:
            if n not in readers and n not in missing and n in self.nodes:
                missing[n] = self._replica_holders(n, self.nodes[n])
        if len(missing) > 1:
            return  # two nodes lost together: disk may be all there is
        intact = readers - set(missing)
        if any(not holders & intact for holders in missing.values()):
            return  # replication was not current for the missing node
        if prev.reached - step > self.every:
            lost = f"only {next(iter(missing))}" if missing else "none"
            self.violations.append(
                f"round {round_} resumed at step {step}, {prev.reached - step} steps behind "
                f"step {prev.reached} of round {max(before)} (snapshots every {self.every}), "
                f"though {lost} of its nodes {list(prev.nodes)} was missing and replication "
                f"was current")
