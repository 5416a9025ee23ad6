"""What the simulated agents run against: one shared in-memory etcd, each node's
connection to it, the network between agents, and fake workers.

Everything here is single-threaded and driven by the simulator's clock: the
store delivers watch events only in ``deliver_pending()``, the network
re-evaluates health only in ``Network.update()``, workers move only in
``Workers.advance()``. Faults are switches on these objects (cut a node from
the store or from its peers, fail store calls, kill a process, hang a worker).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

from agent.reactor import WorkerExited
from agent.supervisor import WorkerStatus
from elastic.errors import LeaseLostError, StoreError, StoreTimeoutError, StoreUnavailableError
from elastic.store.api import Compare, Op, Session, Store, TxnResult, Watch
from elastic.v1 import agent_pb2
from tests.fakes.memory_store import MemoryStore


# ------------------------------------------------------------------- store

class _HeldWatch(Watch):
    """A watch whose events wait while its node is cut off, as a real etcd
    client's watch resumes from its last revision after a reconnect."""

    def __init__(self, conn: "NodeStore", on_events, on_error):
        self._conn = conn
        self._on_events = on_events
        self._on_error = on_error
        self.held: list = []
        self.inner: Watch | None = None
        self.cancelled = False

    def events(self, evs) -> None:
        if self.cancelled:
            return
        if self._conn.partitioned:
            self.held.append(list(evs))
        else:
            self._on_events(evs)

    def error(self, exc) -> None:
        if not self.cancelled and self._on_error is not None:
            self._on_error(exc)

    def release(self) -> None:
        held, self.held = self.held, []
        for evs in held:
            self._on_events(evs)

    def cancel(self) -> None:
        self.cancelled = True
        if self.inner is not None:
            self.inner.cancel()


class NodeStore(Store):
    """One node's connection to the shared store.

    ``partitioned``: every call fails with StoreUnavailableError and the node's
    leases are not kept alive (they expire at the store after their TTL).
    ``error_rate``: a call fails before it reaches the store; ``ambiguous_rate``:
    a write is applied and the caller still gets a timeout (it cannot know).
    ``kill()``: the process died: its watches end, its leases are no longer
    kept alive, and nothing more goes through.
    """

    def __init__(self, store: MemoryStore, rng: random.Random):
        super().__init__()
        self.store = store
        self.rng = rng
        self.partitioned = False
        self.dead = False
        self.error_rate = 0.0
        self.ambiguous_rate = 0.0
        self._leases: list[int] = []
        self._watches: list[_HeldWatch] = []

    def _check(self) -> None:
        if self.dead:
            raise StoreError("the process is dead")
        if self.partitioned:
            raise StoreUnavailableError("cut off from etcd (simulated partition)")
        if self.error_rate and self.rng.random() < self.error_rate:
            raise StoreUnavailableError("etcd did not answer (simulated error)")

    def _ambiguous(self) -> None:
        if self.ambiguous_rate and self.rng.random() < self.ambiguous_rate:
            raise StoreTimeoutError("the write may or may not have happened (simulated)")

    def get(self, key, *, timeout_s=None):
        self._check()
        return self.store.get(key)

    def get_prefix(self, prefix, *, timeout_s=None):
        self._check()
        return self.store.get_prefix(prefix)

    def put(self, key, value, *, lease=0, timeout_s=None):
        self._check()
        revision = self.store.put(key, value, lease=lease)
        self._ambiguous()
        return revision

    def delete(self, key, *, prefix=False, timeout_s=None):
        self._check()
        return self.store.delete(key, prefix=prefix)

    def _run_txn(self, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op], timeout_s: float | None) -> TxnResult:
        self._check()
        result = self.store.txn(compares, success, failure)
        self._ambiguous()
        return result

    def session(self, ttl_s: float) -> Session:
        self._check()
        session = self.store.session(ttl_s)
        self._leases.append(session.lease_id)
        return session

    def lease_time_to_live(self, lease_id, *, timeout_s=None):
        self._check()
        return self.store.lease_time_to_live(lease_id)

    def resume_session(self, lease_id, ttl_s):
        self._check()
        session = self.store.resume_session(lease_id, ttl_s)
        if session is not None:
            self._leases.append(lease_id)
        return session

    def revoke_lease(self, lease_id, *, timeout_s=None):
        self._check()
        self.store.revoke_lease(lease_id)

    def _start_watch(self, key: str, prefix: bool, start_revision: int | None,
                     on_events, on_error) -> Watch:
        self._check()
        held = _HeldWatch(self, on_events, on_error)
        held.inner = self.store.watch(key, held.events, prefix=prefix,
                                      start_revision=start_revision, on_error=held.error)
        self._watches.append(held)
        return held

    def close(self) -> None:
        pass

    def _keepalive(self, on: bool) -> None:
        for lease_id in self._leases:
            try:
                (self.store.resume_keepalive if on else self.store.suspend_keepalive)(lease_id)
            except LeaseLostError:
                pass

    def cut(self) -> None:
        self.partitioned = True
        self._keepalive(False)

    def heal(self) -> None:
        self.partitioned = False
        if not self.dead:
            self._keepalive(True)
            for w in self._watches:
                w.release()

    def freeze(self) -> None:
        """SIGSTOP: no keep-alive leaves the frozen process (its calls just wait)."""
        self._keepalive(False)

    def thaw(self) -> None:
        if not self.dead and not self.partitioned:
            self._keepalive(True)

    def kill(self) -> None:
        self.dead = True
        self._keepalive(False)
        for w in self._watches:
            w.cancel()


# ----------------------------------------------------------------- network

class FakeServer:
    """The agent's gRPC server as peers see it: alive or not, serving or not."""

    def __init__(self, addr: str):
        self.addr = addr
        self.serving = False
        self.alive = True
        self.agent = None  # answers StoreHealth

    def set_serving(self, serving: bool) -> None:
        self.serving = serving

    def stop(self) -> None:
        self.alive = False


@dataclass
class _HealthWatch:
    owner: str
    addr: str
    on_change: Callable[[str], None]
    last: str | None = None
    stopped: bool = False

    def stop(self) -> None:
        self.stopped = True


class Network:
    """The links between nodes. ``cut_off`` nodes reach no peer (and no peer
    reaches them); everything else is connected."""

    def __init__(self):
        self.servers: dict[str, tuple[str, FakeServer]] = {}  # addr -> (node, server)
        self.cut_off: set[str] = set()
        self.watches: list[_HealthWatch] = []

    def connected(self, a: str, b: str) -> bool:
        return a == b or (a not in self.cut_off and b not in self.cut_off)

    def health(self, owner: str, addr: str) -> str:
        node, server = self.servers.get(addr, ("", None))
        if server is None or not server.alive or not self.connected(owner, node):
            return "UNREACHABLE"
        return "SERVING" if server.serving else "NOT_SERVING"

    def update(self) -> None:
        """Deliver health changes to the watchers (what HealthWatcher threads do)."""
        self.watches = [w for w in self.watches if not w.stopped]
        for w in list(self.watches):
            status = self.health(w.owner, w.addr)
            if status != w.last:
                w.last = status
                w.on_change(status)


class FakeMesh:
    """:class:`agent.daemon.PeerMesh` for one node over a :class:`Network`."""

    def __init__(self, network: Network, node_id: str):
        self.network = network
        self.node_id = node_id

    def watch(self, addr: str, on_change):
        w = _HealthWatch(self.node_id, addr, on_change)
        self.network.watches.append(w)
        return w

    def answers(self, addr: str) -> bool:
        return self.network.health(self.node_id, addr) != "UNREACHABLE"

    def _ask(self, addr: str, *, asker_has_store: bool):
        if self.network.health(self.node_id, addr) == "UNREACHABLE":
            return None
        agent = self.network.servers[addr][1].agent
        return (agent.service.store_health(asker_has_store, self.node_id) if agent is not None
                else None)

    def check_store(self, addrs, on_answer) -> None:
        answers = [self._ask(a, asker_has_store=False) for a in addrs]
        ages = tuple((a, r[1]) for a, r in zip(addrs, answers) if r is not None)
        on_answer(ages, len(ages))

    def fence(self, addrs, asker: str) -> bool:
        answers = [self._ask(a, asker_has_store=True) for a in addrs]
        return not any(r is not None and r[2] for r in answers)


# ----------------------------------------------------------------- workers

@dataclass
class FakeWorker:
    node_id: str
    round: int
    local_rank: int
    rank: int
    pid: int
    world_size: int
    alive: bool = True
    hung: bool = False
    frozen: bool = False  # SIGSTOP with its agent: silent and stuck until resumed
    exit_code: int | None = None
    stopped: bool = False
    crash_at: float | None = None  # a crash is coming (its group broke)
    finish_at: float | None = None
    # What the agent last heard (step, exiting) and when the next periodic heartbeat is due.
    reported: tuple[int, bool] | None = None
    heartbeat_at: float = 0.0


@dataclass
class Group:
    """A round's process group: forms when all its workers run and can reach
    each other; trains in lockstep; breaks when one is lost."""

    round: int
    world_size: int
    workers: list[FakeWorker] = field(default_factory=list)
    created_at: float = 0.0
    formed: bool = False
    broken: bool = False
    finishing: bool = False
    complete_at: float | None = None
    step: int = 0
    next_step_at: float = 0.0


class Workers:
    """Every fake worker of the simulated cluster, and the rules they follow.

    ``step_s`` per training step; an async checkpoint every ``ckpt_every``
    steps, committed through rank 0's agent ``save_s`` (a range) later; ``total_steps`` then each node's workers
    finish after that node's ``finish_delay`` (rank 0 writing the final model).
    A group forms ``form_s`` after its last rank started (process start and
    rendezvous of the process group); one that never forms within
    ``init_timeout_s`` crashes (torch's store timeout); a broken group's survivors crash after ``crash_delay_s`` (gloo's
    connection reset).

    ``memory`` (a :class:`tests.sim.memory.MemoryTier`, None: off): the memory
    tier the groups stage into at each step and restore from when they form
    (else every rank restores the disk's latest checkpoint).
    """

    def __init__(self, network: Network, *, step_s: float, total_steps: int, ckpt_every: int,
                 init_timeout_s: float, crash_delay_s: float, form_s: float,
                 rng: random.Random, save_s: tuple[float, float] = (0.25, 3.0),
                 grace_s: float = 1.0, heartbeat_s: float = 0.75,
                 latest_step: Callable[[], tuple[int, int]]):
        self.network = network
        self.step_s = step_s
        self.total_steps = total_steps
        self.ckpt_every = ckpt_every
        self.init_timeout_s = init_timeout_s
        self.crash_delay_s = crash_delay_s
        self.form_s = form_s
        self.rng = rng
        self.save_s = save_s
        self.grace_s = grace_s
        self.heartbeat_s = heartbeat_s
        self.saves: list[_Save] = []
        self.latest_step = latest_step
        self.groups: dict[int, Group] = {}
        self.finish_delay: dict[str, float] = {}
        self.agents: dict[str, object] = {}  # node -> its live agent (for heartbeats, commits)
        self.exits: list[tuple[FakeWorker, float]] = []
        self.on_exit: dict[str, Callable[[WorkerExited], None]] = {}
        self._pids = iter(range(1000, 10**9))
        self.memory = None

    def spawn(self, node_id: str, round_number: int, envs: list[dict[str, str]], now: float
              ) -> list[FakeWorker]:
        made = []
        for local_rank, env in enumerate(envs):
            w = FakeWorker(node_id, round_number, local_rank, int(env["RANK"]), next(self._pids),
                           int(env["WORLD_SIZE"]))
            group = self.groups.setdefault(round_number, Group(round_number, w.world_size,
                                                               created_at=now))
            group.workers.append(w)
            made.append(w)
        return made

    def end(self, w: FakeWorker, code: int, now: float, *, stopped: bool = False) -> None:
        if not w.alive:
            return
        w.alive, w.exit_code, w.stopped = False, code, stopped
        self.exits.append((w, now))
        notify = self.on_exit.get(w.node_id)
        if notify is not None:
            notify(WorkerExited(round=w.round, local_rank=w.local_rank, rank=w.rank, pid=w.pid,
                                exit_code=code, signal=9 if code < 0 else None, stopped=stopped))

    def training(self) -> list[Group]:
        """Groups training now: formed, not broken, not yet finishing, and not
        held by a frozen or hung rank (such a group makes no step).

        A frozen node is resumed at the start of a simulator step, so its agent
        acts on what happened meanwhile before its workers step again. On a
        real machine the workers may get a few steps in first, until the agent
        stops them; the round fence keeps those steps from being committed."""
        return [g for g in self.groups.values()
                if g.formed and not g.broken and not g.finishing
                and not any(w.alive and (w.frozen or w.hung) for w in g.workers)]

    def advance(self, now: float) -> None:
        self._commit_due(now)
        for group in list(self.groups.values()):
            self._advance_group(group, now)
        for group in list(self.groups.values()):
            if all(not w.alive for w in group.workers):
                del self.groups[group.round]

    def _connected(self, group: Group) -> bool:
        nodes = {w.node_id for w in group.workers}
        return all(self.network.connected(a, b) for a in nodes for b in nodes)

    def _advance_group(self, g: Group, now: float) -> None:
        live = [w for w in g.workers if w.alive]
        for w in live:
            if w.frozen:
                continue  # a stopped process neither crashes nor finishes until resumed
            if w.crash_at is not None and now >= w.crash_at:
                self.end(w, 1, now)
            elif w.finish_at is not None and now >= w.finish_at:
                self.end(w, 0, now)
        live = [w for w in g.workers if w.alive]
        if not live:
            return
        lost = any(not w.alive and w.exit_code != 0 for w in g.workers)
        if not g.formed:
            if len(g.workers) < g.world_size or lost or not self._connected(g):
                g.complete_at = None
            elif g.complete_at is None:
                g.complete_at = now  # every rank started: init_process_group runs
            if g.complete_at is not None and now - g.complete_at >= self.form_s:
                g.formed = True
                g.step = self._restore(g, now)
                g.next_step_at = now + self.step_s
            elif now - g.created_at > self.init_timeout_s:
                for w in live:
                    self.end(w, 1, now)
                return
        elif not g.broken and (lost or not self._connected(g)) and not g.finishing:
            g.broken = True
            for w in live:
                w.crash_at = now + self.crash_delay_s
        if g.formed and not g.broken and not g.finishing:
            if any(w.hung or w.frozen for w in live):
                g.next_step_at = now + self.step_s  # collectives wait on the hung rank
            elif now >= g.next_step_at:
                g.step += 1
                g.next_step_at = now + self.step_s
                if self.memory is not None:
                    self.memory.stepped(g.round, g.step,
                                        [(w.node_id, w.rank, w.world_size) for w in live])
                if g.step % self.ckpt_every == 0:
                    self._save(g, now)
                if g.step >= self.total_steps:
                    g.finishing = True
                    for w in live:
                        w.finish_at = now + self.finish_delay.get(w.node_id, 0.0)
        for w in live:
            if not (w.hung or w.frozen) and (g.formed or g.finishing):
                self._heartbeat(w, g, now)

    def _restore(self, g: Group, now: float) -> int:
        """The step every rank of the group resumes from: the latest checkpoint's,
        or what the memory tier's choice says."""
        if self.memory is None:
            return self.latest_step()[0]
        return self.memory.restore(g.round, [(w.node_id, w.rank) for w in g.workers],
                                   self.latest_step(), now)

    def _heartbeat(self, w: FakeWorker, g: Group, now: float) -> None:
        """As the worker library sends them (elastic.worker.runtime): every
        ``heartbeat_s``, and at once for the first step and when the script
        ends; the agent learns of the steps between with the next one."""
        news = w.reported is None or (w.reported[0] < 0 <= g.step) or (
            g.finishing and not w.reported[1])
        if not news and now < w.heartbeat_at:
            return
        agent = self.agents.get(w.node_id)
        if agent is None:
            return
        w.reported, w.heartbeat_at = (g.step, g.finishing), now + self.heartbeat_s
        agent.channel.heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(
            rank=w.rank, local_rank=w.local_rank, round=w.round, step=g.step,
            exiting=g.finishing))

    def _save(self, g: Group, now: float) -> None:
        """Rank 0 starts an async save of this step; it commits ``save_s`` later.
        One save at a time, as the checkpointer does: while one is in flight
        this step is not saved."""
        if any(save.entry.round == g.round for save in self.saves):
            return
        rank0 = next((w for w in g.workers if w.rank == 0 and w.alive), None)
        agent = self.agents.get(rank0.node_id) if rank0 else None
        if agent is not None:
            self.saves.append(_Save(now + self.rng.uniform(*self.save_s), rank0, agent,
                                    agent_pb2.CheckpointEntry(
                                        step=g.step, round=g.round, world_size=g.world_size,
                                        path=f"step-{g.step:012d}", time=now)))

    def _commit_due(self, now: float) -> None:
        """A save commits through rank 0's agent when it is done, if that worker
        still runs or was stopped less than a grace period ago (SIGTERM lets
        a checkpointer finish): a worker of an older round may commit late."""
        due = [s for s in self.saves if s.at <= now]
        self.saves = [s for s in self.saves if s.at > now]
        for save in due:
            w = save.worker
            stopped_at = next((t for x, t in self.exits if x is w), None)
            if stopped_at is not None and (now - stopped_at > self.grace_s or not w.stopped):
                continue
            try:
                save.agent.channel.commit_checkpoint(save.entry)
            except StoreError:
                pass  # the save fails; training goes on and the next one tries again


@dataclass
class _Save:
    at: float
    worker: FakeWorker
    agent: object
    entry: agent_pb2.CheckpointEntry


class FakeSupervisor:
    """:class:`agent.daemon.Supervisor` over :class:`Workers` for one node."""

    def __init__(self, workers: Workers, node_id: str, now: Callable[[], float]):
        self.all = workers
        self.node_id = node_id
        self.now = now
        self.current: list[FakeWorker] = []

    def warm_up(self) -> None:
        pass

    def start_round(self, round_number, envs) -> None:
        if any(w.alive for w in self.current):
            raise RuntimeError("start_round with live workers (stop() first)")
        self.current = self.all.spawn(self.node_id, round_number, envs, self.now())

    def stop(self, timeout_s=None):
        for w in self.current:
            self.all.end(w, -15, self.now(), stopped=True)
        return []

    def shutdown(self) -> None:
        self.stop()

    def kill(self) -> None:
        """The agent died: PDEATHSIG takes its workers with it (not a stop it asked for)."""
        for w in self.current:
            self.all.end(w, -9, self.now())

    def workers(self) -> list[WorkerStatus]:
        return [WorkerStatus(w.local_rank, w.rank, w.pid, w.alive) for w in self.current]

    def warm_workers(self) -> list:
        return []
