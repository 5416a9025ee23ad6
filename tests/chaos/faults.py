"""The chaos campaign's faults: one function per kind, each injected at a seeded moment.

Every fault function takes the campaign (see :class:`Context`) and a seeded
``random.Random``, injects the fault, holds it as long as the kind says
(healing network faults and restarting what it stopped), and returns a
:class:`FaultRecord`. It does *not* wait for the job to recover: the campaign
does that, the same way for every kind.

``expect_restart`` says what DESIGN.md's failure table promises: a new round
(worker and node failures, cuts, drains, a crash in the middle of a
checkpoint save), or training that goes on without one (a lost etcd member, a
lost leader, lost quorum: "nothing restarts for a store blip"; a full
checkpoint disk: the save fails with ENOSPC, the script catches
``CheckpointWriteError`` and trains on). Delay and loss promise neither; they
are recorded as observed. ``event`` is what else a kind must leave in
``elasticctl events`` (a full disk: the failed saves, with ENOSPC).
"""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from elastic.checkpoint import layout
from tests.chaos.cluster import node_pids, signal_pids
from tests.proctable import alive

FILLER_NAME = "chaos-disk-filler"  # not a checkpoint name: restore and retention ignore it
SAVE_WAIT_S = 60.0  # for a save in flight: a few checkpoint intervals, and a restart
# etcd stays without quorum this many lease TTLs (plus up to 2 s): every lease would
# have expired more than twice over, so the agents keeping theirs is what is tested.
QUORUM_LOSS_TTLS = 3.0


@dataclass
class FaultRecord:
    kind: str
    target: str
    t_start: float  # wall time of the injection
    t_end: float = 0.0  # wall time the fault was over (healed, restarted, joined)
    round_before: int = 0  # the newest round training when it was injected
    expect_restart: bool | None = True  # None: no promise either way
    event: tuple[str, str] | None = None  # (kind, text) of an event it must leave
    interrupted_save: tuple[int, int] | None = None  # (step, round) of a save it cut short
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # violations seen while injecting


class Context(Protocol):
    """What the faults need of the campaign (:class:`tests.chaos.campaign.Campaign`)."""

    topo: object
    etcd: object
    tag: str
    settings: object
    ckpt_dir: str  # the checkpoint root every node shares
    ckpt_every: int  # steps between two saves

    def active_agents(self) -> list: ...
    def worker_pids(self) -> dict[int, tuple[str, int]]: ...
    def current_round(self) -> int: ...
    def max_step(self) -> int: ...
    def latest_commit(self) -> tuple[int, int] | None: ...
    def restart_agent(self, agent) -> object: ...
    def drain(self, node_id: str) -> tuple[int, str]: ...
    def join_new_node(self) -> object: ...
    def wait_for(self, predicate, timeout_s: float, what: str): ...


@dataclass(frozen=True)
class FaultKind:
    name: str
    inject: Callable[[Context, random.Random], FaultRecord]
    needs_isolation: bool = False  # network namespaces
    expect_restart: bool | None = True
    needs_disk: bool = False  # a checkpoint disk of the harness's own (a tmpfs: root)
    event: tuple[str, str] | None = None  # (kind, text) of an event it must leave


def unavailable(kind: FaultKind, *, isolated: bool, own_disk: bool) -> str:
    """Why ``kind`` cannot be injected in this topology; "" when it can."""
    if kind.needs_isolation and not isolated:
        return "needs network namespaces"
    if kind.needs_disk and not own_disk:
        return "needs a checkpoint disk of its own"
    return ""


def _record(ctx: Context, kind: str, target: str) -> FaultRecord:
    return FaultRecord(kind, target, time.time(), round_before=ctx.current_round(),
                       expect_restart=KINDS[kind].expect_restart, event=KINDS[kind].event)


def _pick_worker(ctx: Context, rng: random.Random, exclude_node: str | None = None
                 ) -> tuple[int, str, int]:
    """(rank, node, pid) of a live worker of the current round."""
    workers = {r: v for r, v in sorted(ctx.worker_pids().items()) if v[0] != exclude_node}
    if not workers:
        raise RuntimeError("no live worker of the current round to hit")
    rank = rng.choice(sorted(workers))
    node, pid = workers[rank]
    return rank, node, pid


def _pick_node(ctx: Context, rng: random.Random):
    return rng.choice(sorted(ctx.active_agents(), key=lambda a: a.node_id))


def _min_nodes(ctx: Context) -> int:
    """The job's min nodes (``--nnodes N`` or ``MIN:MAX``)."""
    return int(ctx.settings.nnodes.split(":")[0])


# ----------------------------------------------------------------------------- workers


def worker_kill(ctx: Context, rng: random.Random) -> FaultRecord:
    rank, node, pid = _pick_worker(ctx, rng)
    rec = _record(ctx, "worker_kill", f"rank {rank} on {node} (pid {pid})")
    signal_pids([pid], signal.SIGKILL)
    rec.t_end = time.time()
    return rec


def worker_hang(ctx: Context, rng: random.Random) -> FaultRecord:
    """SIGSTOP one worker: its agent must judge it hung (no heartbeat) and kill it."""
    rank, node, pid = _pick_worker(ctx, rng)
    rec = _record(ctx, "worker_hang", f"rank {rank} on {node} (pid {pid})")
    signal_pids([pid], signal.SIGSTOP)
    timeout = ctx.settings.hang_timeout_s + ctx.settings.stop_grace_s + 15
    try:
        ctx.wait_for(lambda: not alive(pid), timeout, f"the agent to kill hung pid {pid}")
    except AssertionError:
        rec.problems.append(f"hung worker pid {pid} still alive {timeout:g} s after SIGSTOP")
        signal_pids([pid], signal.SIGKILL)
    rec.notes.append(f"hung worker gone after {time.time() - rec.t_start:.1f} s")
    rec.t_end = time.time()
    return rec


def double_worker_fail(ctx: Context, rng: random.Random) -> FaultRecord:
    """Two workers (on different nodes where possible) killed less than 1 s apart."""
    rank1, node1, pid1 = _pick_worker(ctx, rng)
    try:
        rank2, node2, pid2 = _pick_worker(ctx, rng, exclude_node=node1)
    except RuntimeError:
        rank2, node2, pid2 = _pick_worker(ctx, rng)
    gap = rng.uniform(0.05, 0.9)
    rec = _record(ctx, "double_worker_fail",
                  f"rank {rank1} on {node1}, then rank {rank2} on {node2} {gap:.2f} s later")
    signal_pids([pid1], signal.SIGKILL)
    time.sleep(gap)
    if not alive(pid2):
        rec.notes.append(f"second worker pid {pid2} was already gone (stopped by its agent)")
    signal_pids([pid2], signal.SIGKILL)
    rec.t_end = time.time()
    return rec


def fail_after_restart(ctx: Context, rng: random.Random) -> FaultRecord:
    """Kill a worker; once its node's workers train in the next round, kill one of
    them again, within 5 s of that restart."""
    rank, node, pid = _pick_worker(ctx, rng)
    rec = _record(ctx, "fail_after_restart", f"rank {rank} on {node} (pid {pid}), twice")
    signal_pids([pid], signal.SIGKILL)

    def restarted():
        if ctx.current_round() <= rec.round_before:
            return None
        mine = [(r, p) for r, (n, p) in ctx.worker_pids().items() if n == node]
        return mine or None

    try:
        mine = ctx.wait_for(restarted, 90, f"{node}'s workers to train in a new round")
    except AssertionError as exc:
        rec.problems.append(f"no restart to fail again: {exc}"[:300])
        rec.t_end = time.time()
        return rec
    restart_seen = time.time()
    time.sleep(rng.uniform(0.0, 1.5))
    rank2, pid2 = rng.choice(sorted(mine))
    signal_pids([pid2], signal.SIGKILL)
    rec.t_end = time.time()
    rec.notes.append(f"killed rank {rank2} (pid {pid2}) of round {ctx.current_round()} "
                     f"{rec.t_end - restart_seen:.2f} s after its first step")
    return rec


# ----------------------------------------------------------------------------- checkpoints


def _save_in_flight(ctx: Context) -> tuple[int, int, str] | None:
    """(step, round, path) of a save of the current round that is writing its
    shards: its temporary directory exists and has no DCP metadata yet (rank 0
    writes that once every rank has written its shards)."""
    current = ctx.current_round()
    try:
        names = os.listdir(ctx.ckpt_dir)
    except FileNotFoundError:
        return None
    for name in names:
        parsed = layout.parse_tmp_dir(name)
        path = os.path.join(ctx.ckpt_dir, name)
        if parsed is not None and parsed[1] == current and _mid_write(path):
            return parsed[0], parsed[1], path
    return None


def _mid_write(tmp: str) -> bool:
    return os.path.isdir(tmp) and not os.path.exists(os.path.join(tmp, layout.METADATA_FILE))


def ckpt_crash(ctx: Context, rng: random.Random) -> FaultRecord:
    """SIGKILL a worker while a checkpoint save is writing its shards (the
    workers' ``ckpt.mid_write`` sleep keeps every save that long in flight).

    The save cannot commit: the killed rank never joins the collectives that
    follow the write. The group restarts from the previous committed
    checkpoint, and the next round's first save removes the temporary
    directory (both checked by the invariants, through ``interrupted_save``).
    """
    deadline = time.monotonic() + SAVE_WAIT_S
    while (save := _save_in_flight(ctx)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no checkpoint save in flight under {ctx.ckpt_dir} within "
                               f"{SAVE_WAIT_S:g} s")
        time.sleep(0.01)  # the write stays in flight for the workers' 0.4 s failpoint sleep
    step, round_, tmp = save
    rank, node, pid = _pick_worker(ctx, rng)
    rec = _record(ctx, "ckpt_crash", f"rank {rank} on {node} (pid {pid}) while saving step "
                                     f"{step} of round {round_} into {os.path.basename(tmp)}")
    signal_pids([pid], signal.SIGKILL)
    rec.t_end = time.time()
    if _mid_write(tmp):  # still true after the kill: the kill landed in the write
        rec.interrupted_save = (step, round_)
    else:
        rec.notes.append(f"{os.path.basename(tmp)} got its metadata (or went) before the kill "
                         f"landed: not counted as an interrupted save")
    return rec


def fill_disk(path: str) -> int:
    """Append to ``path`` until its file system is full (ENOSPC); returns its size.
    Called again, it takes back what was freed meanwhile."""
    chunk = b"\0" * (1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while True:
            try:
                os.write(fd, chunk)  # a short write near the end, then ENOSPC
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    return os.path.getsize(path)


def disk_full(ctx: Context, rng: random.Random) -> FaultRecord:
    """Fill the checkpoint disk (the harness's tmpfs) for a few checkpoint
    intervals of training, then free it.

    Promised: the saves meanwhile fail with ENOSPC (an event says so) and
    training goes on in the same round; the latest committed checkpoint stays
    and still verifies; once the disk is free, a newer checkpoint commits.
    The disk is kept full: a commit's retention removes an old checkpoint,
    and a save could use that space (a save already past its writes when the
    disk filled may still commit, which is fine).
    """
    intervals = rng.randint(2, 3)  # two at least: the save in flight at the fill may commit
    filler = os.path.join(ctx.ckpt_dir, FILLER_NAME)
    # A committed checkpoint first: the fault must show that the full disk leaves it intact.
    ctx.wait_for(ctx.latest_commit, SAVE_WAIT_S, "a first committed checkpoint")
    rec = _record(ctx, "disk_full", f"{ctx.ckpt_dir} full for {intervals} checkpoint "
                                    f"intervals")
    size = fill_disk(filler)
    full_at = ctx.max_step()
    rec.notes.append(f"{size >> 20} MiB filler written at step {full_at}, step "
                     f"{ctx.latest_commit()[0]} committed")
    try:
        ctx.wait_for(lambda: fill_disk(filler) and
                     ctx.max_step() >= full_at + intervals * ctx.ckpt_every, 90,
                     f"training to go on for {intervals} checkpoint intervals on a full disk")
        _check_latest_intact(ctx, full_at, rec)
    except AssertionError as exc:
        rec.problems.append(str(exc))
    finally:
        os.unlink(filler)
    freed_at = ctx.max_step()
    rec.t_end = time.time()
    try:
        committed = ctx.wait_for(lambda: _committed_after(ctx, freed_at), 90,
                                 f"a checkpoint after step {freed_at} (the disk freed) to commit")
        rec.notes.append(f"disk freed at step {freed_at}; step {committed[0]} committed "
                         f"{time.time() - rec.t_end:.1f} s later")
    except AssertionError as exc:
        rec.problems.append(str(exc))
    return rec


def _committed_after(ctx: Context, step: int) -> tuple[int, int] | None:
    latest = ctx.latest_commit()
    return latest if latest is not None and latest[0] > step else None


def _check_latest_intact(ctx: Context, full_at: int, rec: FaultRecord) -> None:
    """On the full disk: no save started after it filled committed (one save
    may have been past its writes then), and the latest committed checkpoint
    still verifies (sizes and CRC-32s)."""
    step = ctx.latest_commit()[0]
    if step > full_at + ctx.ckpt_every:
        rec.problems.append(f"checkpoint step {step} committed on the full disk (filled at "
                            f"step {full_at})")
    problems = layout.verify(os.path.join(ctx.ckpt_dir, layout.step_dir_name(step)))
    if problems:
        rec.problems.append(f"the latest committed checkpoint (step {step}) does not verify on "
                            f"the full disk: {'; '.join(map(str, problems[:3]))}")


# ----------------------------------------------------------------------------- agents, nodes


def agent_restart(ctx: Context, rng: random.Random) -> FaultRecord:
    """SIGKILL an agent, start it again 1 s later with the same node id."""
    agent = _pick_node(ctx, rng)
    children = [p for p in node_pids(ctx.tag, agent.node_id) if p != agent.pid]
    rec = _record(ctx, "agent_restart", f"{agent.node_id} (agent pid {agent.pid})")
    agent.kill()
    time.sleep(1.0)
    left = [p for p in children if alive(p)]
    if left:
        rec.notes.append(f"{len(left)} of its {len(children)} children still alive 1 s after "
                         f"the agent's SIGKILL: {left}")
    ctx.restart_agent(agent)
    rec.t_end = time.time()
    return rec


def node_freeze(ctx: Context, rng: random.Random) -> FaultRecord:
    """SIGSTOP a node's agent and workers for longer than the lease TTL, then SIGCONT."""
    agent = _pick_node(ctx, rng)
    hold = ctx.settings.lease_ttl_s + rng.uniform(1.0, 2.5)
    rec = _record(ctx, "node_freeze", f"{agent.node_id} for {hold:.1f} s")
    signal_pids([agent.pid], signal.SIGSTOP)  # first, so it does not see its workers stop
    pids = [agent.pid] + [p for p in node_pids(ctx.tag, agent.node_id) if p != agent.pid]
    signal_pids(pids[1:], signal.SIGSTOP)
    time.sleep(hold)
    pids += [p for p in node_pids(ctx.tag, agent.node_id) if p not in pids]
    signal_pids(pids[1:], signal.SIGCONT)
    signal_pids([agent.pid], signal.SIGCONT)
    rec.t_end = time.time()
    return rec


def drain_join(ctx: Context, rng: random.Random) -> FaultRecord:
    """``elasticctl drain`` a node, then a new node joins.

    The drained agent may leave at once (above min nodes) or only once a
    replacement is there (a fixed-size job keeps training meanwhile): above
    min nodes the new node joins after the drained one left, or after 10 s if
    it has not; at min nodes (the fixed-size job) it joins without that wait,
    since the drained one cannot leave before it.
    """
    agent = _pick_node(ctx, rng)
    rec = _record(ctx, "drain_join", f"drain {agent.node_id}")
    code, out = ctx.drain(agent.node_id)
    if code != 0:
        rec.problems.append(f"elasticctl drain {agent.node_id} exited {code}: {out.strip()}")
    if len(ctx.active_agents()) >= _min_nodes(ctx):
        try:
            ctx.wait_for(lambda: agent.poll() is not None, 10, f"drained {agent.node_id} to exit")
            rec.notes.append(f"{agent.node_id} left {time.time() - rec.t_start:.1f} s after the "
                             f"drain")
        except AssertionError:
            rec.notes.append(f"{agent.node_id} still there 10 s after the drain")
    else:
        rec.notes.append(f"{agent.node_id} waits for its replacement (the job is at min nodes)")
    time.sleep(rng.uniform(0.5, 2.0))
    new = ctx.join_new_node()
    rec.target += f", join {new.node_id}"
    try:
        ctx.wait_for(lambda: agent.poll() is not None, 60, f"drained {agent.node_id} to exit")
        if agent.poll() != 0:
            rec.problems.append(f"drained agent {agent.node_id} exited {agent.poll()}")
    except AssertionError:
        rec.problems.append(f"drained agent {agent.node_id} still running 60 s after the "
                            f"drain, with {new.node_id} there to replace it")
        agent.kill()
    rec.t_end = time.time()
    return rec


# ----------------------------------------------------------------------------- network


def _hold_cut(ctx: Context, rng: random.Random, kind: str, what: str, others_of) -> FaultRecord:
    agent = _pick_node(ctx, rng)
    others = others_of(agent)
    hold = {"cut_etcd": 2 * ctx.settings.lease_ttl_s + rng.uniform(0.5, 2.0),
            "cut_peers": ctx.settings.hang_timeout_s + rng.uniform(1.0, 3.0)}[kind]
    rec = _record(ctx, kind, f"{agent.node_id} from {what} for {hold:.1f} s")
    ctx.topo.cut(agent.slot, others)
    try:
        time.sleep(hold)
    finally:
        ctx.topo.heal(agent.slot, others)
    rec.t_end = time.time()
    return rec


def cut_etcd(ctx: Context, rng: random.Random) -> FaultRecord:
    return _hold_cut(ctx, rng, "cut_etcd", "etcd",
                     lambda agent: list(ctx.topo.etcd_hosts))


def cut_peers(ctx: Context, rng: random.Random) -> FaultRecord:
    return _hold_cut(ctx, rng, "cut_peers", "its peers",
                     lambda agent: [s for s in ctx.topo.slots if s is not agent.slot])


def cut_all(ctx: Context, rng: random.Random) -> FaultRecord:
    agent = _pick_node(ctx, rng)
    hold = ctx.settings.lease_ttl_s + rng.uniform(1.0, 3.0)
    rec = _record(ctx, "cut_all", f"{agent.node_id}'s link down for {hold:.1f} s")
    ctx.topo.link_down(agent.slot)
    try:
        time.sleep(hold)
    finally:
        ctx.topo.link_up(agent.slot)
    rec.t_end = time.time()
    return rec


def delay_loss(ctx: Context, rng: random.Random) -> FaultRecord:
    agent = _pick_node(ctx, rng)
    hold = rng.uniform(5.0, 8.0)
    rec = _record(ctx, "delay_loss", f"{agent.node_id}: 200 ms, 5% loss for {hold:.1f} s")
    how = ctx.topo.impair(agent.slot, 200, 5.0, seed=rng.randrange(1 << 30))
    rec.notes.append(f"by {how}")
    try:
        time.sleep(hold)
    finally:
        ctx.topo.unimpair(agent.slot)
    rec.t_end = time.time()
    return rec


# ----------------------------------------------------------------------------- etcd


def _restart_members(ctx: Context, members, down_s: float, rec: FaultRecord) -> None:
    for m in members:
        m.kill()
    time.sleep(down_s)
    for m in members:
        m.start()
    try:
        ctx.etcd.wait_ready(30)
    except RuntimeError as exc:
        rec.problems.append(f"etcd did not come back: {exc}"[:400])
    rec.t_end = time.time()


def etcd_member(ctx: Context, rng: random.Random) -> FaultRecord:
    leader = ctx.etcd.leader()
    member = rng.choice([m for m in ctx.etcd.members if m is not leader])
    down = rng.uniform(2.0, 4.0)
    rec = _record(ctx, "etcd_member", f"follower {member.name} down {down:.1f} s")
    _restart_members(ctx, [member], down, rec)
    return rec


def etcd_leader(ctx: Context, rng: random.Random) -> FaultRecord:
    leader = ctx.etcd.leader()
    if leader is None:
        raise RuntimeError("no etcd leader to kill")
    down = rng.uniform(2.0, 4.0)
    rec = _record(ctx, "etcd_leader", f"leader {leader.name} down {down:.1f} s")
    _restart_members(ctx, [leader], down, rec)
    return rec


def quorum_loss(ctx: Context, rng: random.Random) -> FaultRecord:
    members = rng.sample(ctx.etcd.members, 2)
    down = QUORUM_LOSS_TTLS * ctx.settings.lease_ttl_s + rng.uniform(0.0, 2.0)
    rec = _record(ctx, "quorum_loss", f"{members[0].name} and {members[1].name} down "
                                      f"{down:.1f} s")
    _restart_members(ctx, members, down, rec)
    return rec


KINDS: dict[str, FaultKind] = {k.name: k for k in [
    FaultKind("worker_kill", worker_kill),
    FaultKind("worker_hang", worker_hang),
    FaultKind("double_worker_fail", double_worker_fail),
    FaultKind("fail_after_restart", fail_after_restart),
    FaultKind("agent_restart", agent_restart),
    FaultKind("node_freeze", node_freeze),
    FaultKind("cut_etcd", cut_etcd, needs_isolation=True),
    FaultKind("cut_peers", cut_peers, needs_isolation=True),
    FaultKind("cut_all", cut_all, needs_isolation=True),
    FaultKind("delay_loss", delay_loss, needs_isolation=True, expect_restart=None),
    FaultKind("etcd_member", etcd_member, expect_restart=False),
    FaultKind("etcd_leader", etcd_leader, expect_restart=False),
    FaultKind("quorum_loss", quorum_loss, expect_restart=False),
    FaultKind("ckpt_crash", ckpt_crash),
    FaultKind("disk_full", disk_full, expect_restart=False, needs_disk=True,
              event=("checkpoint", "ENOSPC")),
    FaultKind("drain_join", drain_join),
]}


def plan(seed: int, count: int, *, isolated: bool, own_disk: bool,
         kinds: list[str] | None = None) -> list[str]:
    """``count`` fault kinds in a seeded order: every available kind once (as far
    as ``count`` goes), then seeded random picks."""
    rng = random.Random(f"plan-{seed}")
    available = [k for k in (kinds or list(KINDS))
                 if not unavailable(KINDS[k], isolated=isolated, own_disk=own_disk)]
    if not available:
        return []
    first = available[:]
    rng.shuffle(first)
    picks = first[:count]
    while len(picks) < count:
        picks.append(rng.choice(available))
    return picks
