"""One chaos campaign: topology, etcd, three nodes training, seeded faults, invariants.

:func:`run_campaign` builds the topology (:mod:`tests.chaos.topology`), starts a
3-member etcd and three ``elasticd`` nodes (two workers each of
``tests/chaos/train.py``), waits until they train at full size, then injects
the planned faults one by one (:mod:`tests.chaos.faults`), each after a seeded
random pause, waiting after each until the job trains at full size again.
The checkpoints live on a small tmpfs of the run's (as root), which the
``disk_full`` fault fills.
Then it lets the job finish (the target step goes to the workers through a
file), checks the invariants (:mod:`tests.chaos.invariants`) and, in the
fixed-size variants, runs the same job without faults (and without the
memory tier) for the weights oracle (started as soon as the target is set,
so its start-up overlaps the end).

Variants (:data:`VARIANTS`): ``fixed`` (``--nnodes 3``), ``elastic``
(``--nnodes 2:3``) and ``memory`` (``--nnodes 3`` with ``--memory-tier``,
the workers snapshotting every :data:`MEMORY_EVERY` steps; each restart must
then resume at most that many steps behind the last step every rank of the
previous round completed).
Everything it started is removed on the way out, whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field

from elastic.checkpoint import layout
from tests.chaos import faults as fault_kinds
from tests.chaos import invariants
from tests.chaos.cluster import (
    AgentSettings,
    CheckpointPoller,
    NodeAgent,
    StepLog,
    checkpoint_dir,
    dump_python_stacks,
    signal_pids,
    elasticctl,
    read_events,
)
from tests.chaos.etcd_cluster import EtcdCluster
from tests.chaos.faults import FaultRecord
from tests.chaos.topology import Topology, tagged_pids
from tests.proctable import alive
from tests.waiting import wait_until

log = logging.getLogger(__name__)

N_NODES = 3
PACE_S = 0.25  # sleep per training step while faults remain
CKPT_EVERY = 10
DISK_MIB = 64  # the checkpoint tmpfs: the chaos model's checkpoints are a few hundred KiB
FINISH_MARGIN = 20  # steps between "finish" and the end: every rank reads the target first
RECOVERY_TIMEOUT_S = 90.0
VARIANTS = ("fixed", "elastic", "memory")
FIXED_SIZE = ("fixed", "memory")  # the variants with the weights oracle
MEMORY_EVERY = 1  # the memory variant's snapshot interval (steps)
MAX_STEPS = 1_000_000  # the target file ends the run; this only bounds a lost harness


@dataclass
class Report:
    seed: int
    variant: str
    n_faults: int
    kinds: list[str] | None
    topology: str = ""
    planned: list[str] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    checks: list[invariants.Check] = field(default_factory=list)
    recovery: dict[str, list[float]] = field(default_factory=dict)
    skipped_kinds: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    workdir: str = ""
    duration_s: float = 0.0
    tails: str = ""
    options: str = ""  # non-default agent timings, for the replay command

    @property
    def ok(self) -> bool:
        return (not self.errors and all(c.ok for c in self.checks)
                and not any(f.problems for f in self.faults))

    def replay(self) -> str:
        cmd = (f"python -m tests.chaos --seed {self.seed} --faults {self.n_faults} "
               f"--variant {self.variant}")
        if self.kinds:
            cmd += f" --kinds {','.join(self.kinds)}"
        return cmd + self.options


class Campaign:
    """The run's state; also the :class:`tests.chaos.faults.Context` the faults use."""

    def __init__(self, topo: Topology, etcd: EtcdCluster, workdir: str, *, variant: str,
                 job_id: str, say, lease_ttl_s: float = 3.0, hang_timeout_s: float = 4.0,
                 tag: str | None = None):
        self.topo = topo
        self.etcd = etcd
        self.tag = tag or topo.tag  # what its processes carry; starts with the topology's
        self.workdir = workdir
        self.job_id = job_id
        self.say = say
        nnodes = f"2:{N_NODES}" if variant == "elastic" else str(N_NODES)
        self.settings = AgentSettings(nnodes=nnodes, lease_ttl_s=lease_ttl_s,
                                      hang_timeout_s=hang_timeout_s,
                                      memory_tier=variant == "memory")
        self.full_world = N_NODES * self.settings.nproc
        self.pace_file = os.path.join(workdir, "pace")
        self.target_file = os.path.join(workdir, "target")
        self.steps = StepLog(os.path.join(workdir, "steps"))
        self.ckpt_dir = checkpoint_dir(workdir)
        self.ckpt_every = CKPT_EVERY
        self.poller = CheckpointPoller(etcd.endpoints, job_id)  # started by run_campaign
        self.agents: list[NodeAgent] = []  # every incarnation ever started
        self.active: dict[str, NodeAgent] = {}  # node id -> its current incarnation
        self.next_node = N_NODES + 1
        self.events: dict = {}
        self.ctl_failures = 0
        self._set_pace(PACE_S)

    # -- the Context protocol ---------------------------------------------------------------

    def script_args(self) -> list[str]:
        return ["--steps", str(MAX_STEPS), "--log-dir", self.steps.dir,
                "--result-file", os.path.join(self.workdir, "result.json"),
                "--ckpt-every", str(CKPT_EVERY), "--pace-file", self.pace_file,
                "--target-file", self.target_file, "--memory-every", str(MEMORY_EVERY)]

    def start_node(self, node_id: str, slot) -> NodeAgent:
        agent = NodeAgent(node_id, slot, etcd=self.etcd.endpoints, job_id=self.job_id,
                          tag=self.tag, settings=self.settings, workdir=self.workdir,
                          script_args=self.script_args())
        self.agents.append(agent)
        self.active[node_id] = agent
        return agent

    def active_agents(self) -> list[NodeAgent]:
        return list(self.active.values())

    def current_round(self) -> int:
        span = self.steps.latest_round()
        return span.number if span else 0

    def max_step(self) -> int:
        return self.steps.max_step()

    def latest_commit(self) -> tuple[int, int] | None:
        return self.poller.latest()

    def worker_pids(self) -> dict[int, tuple[str, int]]:
        """rank -> (node id, pid) of the live workers of the newest training round."""
        span = self.steps.latest_round()
        if span is None:
            return {}
        return {rank: (node, pid) for rank, (node, pid, _) in span.ranks.items() if alive(pid)}

    def restart_agent(self, agent: NodeAgent) -> NodeAgent:
        new = agent.again()
        self.agents.append(new)
        self.active[agent.node_id] = new
        return new

    def drain(self, node_id: str) -> tuple[int, str]:
        proc = elasticctl(self.etcd.endpoints, self.job_id, "drain", node_id)
        self.active.pop(node_id)  # leaving: its exit is checked by the fault, not awaited here
        return proc.returncode, proc.stdout + proc.stderr

    def join_new_node(self) -> NodeAgent:
        busy = {a.slot.name for a in self.active.values()}
        busy |= {a.slot.name for a in self.agents if a.poll() is None}
        slot = next(s for s in self.topo.slots if s.name not in busy)
        node_id = f"n{self.next_node}"
        self.next_node += 1
        return self.start_node(node_id, slot)

    def wait_for(self, predicate, timeout_s: float, what: str):
        return wait_until(predicate, timeout_s, what, poll_s=0.2)

    # -- phases -----------------------------------------------------------------------------

    def _set_pace(self, seconds: float) -> None:
        _write_atomically(self.pace_file, f"{seconds:g}")

    def exited_agents(self) -> list[NodeAgent]:
        return [a for a in self.active.values() if a.poll() is not None]

    def training_at_full_size(self, since: float, steps_per_rank: int = 2):
        """The newest round if it has every rank of a full-size job, each with
        ``steps_per_rank`` steps logged after ``since``."""
        span = self.steps.latest_round()
        if span is None or span.world != self.full_world:
            return None
        counts: dict[int, int] = {}
        for ln in self.steps.lines[-8 * self.full_world * steps_per_rank:]:
            if ln.round == span.number and ln.t > since:
                counts[ln.rank] = counts.get(ln.rank, 0) + 1
        if len(counts) == self.full_world and min(counts.values()) >= steps_per_rank:
            return span
        return None

    def wait_full_size(self, since: float, timeout_s: float, what: str):
        def ready():
            gone = self.exited_agents()
            if gone:
                raise AssertionError(f"{what}: agent {gone[0].node_id} exited with code "
                                     f"{gone[0].poll()}")
            return self.training_at_full_size(since)
        return self.wait_for(ready, timeout_s, what)

    def refresh_events(self, *, with_elasticctl: bool = False) -> None:
        """Merge the job's event history into ``self.events``: what ``elasticctl events
        --json`` prints (it runs elasticctl itself when asked; in between, the same
        read in-process, which costs no interpreter start on a 2-core machine)."""
        if with_elasticctl:
            code = read_events(self.etcd.endpoints, self.job_id, self.events)
            if code != 0:
                self.ctl_failures += 1
            return
        from elastic import events as job_events
        from elastic.errors import ElasticError
        from elastic.keyspace import JobKeys
        from elastic.store import open_store

        try:
            with open_store(self.etcd.endpoints, connect_timeout_s=3.0) as store:
                for e in job_events.read_events(store, JobKeys(self.job_id)):
                    self.events[(e.time, e.node_id, e.kind, e.message)] = dict(e.__dict__)
        except ElasticError as exc:  # a failed read only loses history; the next one retries
            log.warning("reading the job's events failed: %s", exc)

    def set_target(self) -> int:
        """Let the job end: a target a few steps ahead, then full speed; returns the target."""
        target = self.steps.max_step() + FINISH_MARGIN
        _write_atomically(self.target_file, str(target))
        time.sleep(PACE_S * 3)
        self._set_pace(0)
        self.say(f"finishing: target step {target}")
        return target

    def wait_finished(self, timeout_s: float = 120.0) -> None:
        """Until every active agent exited; AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while any(a.poll() is None for a in self.active.values()):
            if time.monotonic() > deadline:
                raise AssertionError(f"the job did not finish within {timeout_s:g} s")
            time.sleep(0.2)

    def temporaries(self) -> list[str] | None:
        """The temporary directories (saves in flight or cut short) under the
        checkpoint root; None when it cannot be listed."""
        try:
            return sorted(n for n in os.listdir(self.ckpt_dir) if n.startswith(layout.TMP_PREFIX))
        except OSError:
            return None

    def leftover_processes(self, exclude: set[int], wait_s: float = 5.0) -> dict[int, str]:
        deadline = time.monotonic() + wait_s
        while True:
            left = {p: _cmdline(p) for p in tagged_pids(self.tag) if p not in exclude}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def dump_stacks(self, report: "Report") -> None:
        """Python stacks of the live agents (through gdb, where there is one) into the
        working directory, for an agent that stopped acting."""
        os.makedirs(os.path.join(self.workdir, "stacks"), exist_ok=True)
        for a in self.active.values():
            if a.poll() is None:
                path = os.path.join(self.workdir, "stacks", f"{a.node_id}.{a.incarnation}.txt")
                if dump_python_stacks(a.pid, path):
                    report.errors.append(f"Python stacks of {a.node_id}: {path}")

    def stop_agents(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                signal_pids([a.pid], signal.SIGCONT)
                a.proc.kill()  # not a.kill(): the job did not finish, its exit code says so
                a.proc.wait()

    def tails(self, n: int = 15) -> str:
        return "\n".join(a.tail(n) for a in self.agents[-6:])


def run_campaign(seed: int, n_faults: int, variant: str = "fixed", *,
                 kinds: list[str] | None = None, loopback: bool = False,
                 workdir: str | None = None, keep: bool = False, lease_ttl_s: float = 3.0,
                 hang_timeout_s: float = 4.0, say=print) -> Report:
    """Run one campaign; returns its :class:`Report` (never raises for a failed invariant)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    report = Report(seed, variant, n_faults, kinds)
    if lease_ttl_s != 3.0:
        report.options += f" --lease-ttl {lease_ttl_s:g}"
    if hang_timeout_s != 4.0:
        report.options += f" --hang-timeout {hang_timeout_s:g}"
    started = time.monotonic()
    plain_say = say

    def say(message: str) -> None:
        plain_say(f"[{time.monotonic() - started:6.1f}s] {message}")
    workdir = workdir or tempfile.mkdtemp(prefix="elastic-chaos-")
    os.makedirs(workdir, exist_ok=True)
    report.workdir = workdir
    rng = random.Random(seed)
    with Topology(N_NODES, N_NODES + 1, force_loopback=loopback) as topo:
        disk_problem = topo.mount_disk(checkpoint_dir(workdir), DISK_MIB)
        report.topology = topo.describe() + (
            f"; checkpoints on a {DISK_MIB} MiB tmpfs" if not disk_problem
            else f"; checkpoints on the working directory's disk ({disk_problem})")
        say(f"chaos: seed {seed}, {n_faults} faults, variant {variant}; {report.topology}")
        why_not = {k: fault_kinds.unavailable(v, isolated=topo.isolated, own_disk=not disk_problem)
                   for k, v in fault_kinds.KINDS.items() if not kinds or k in kinds}
        report.skipped_kinds = [k for k, why in why_not.items() if why]
        if report.skipped_kinds:
            say("chaos: NOTE: skipping " + ", ".join(f"{k} ({why_not[k]})"
                                                    for k in report.skipped_kinds))
        report.planned = fault_kinds.plan(seed, n_faults, isolated=topo.isolated,
                                          own_disk=not disk_problem, kinds=kinds)
        etcd = EtcdCluster(topo.etcd_hosts, workdir, topo.tag)
        etcd.start()
        job_id = f"chaos-{seed}-{topo.prefix}"
        camp = Campaign(topo, etcd, workdir, variant=variant, job_id=job_id, say=say,
                        lease_ttl_s=lease_ttl_s, hang_timeout_s=hang_timeout_s)
        poller = camp.poller.start()
        recovered_at: dict[int, float] = {}
        temporaries: list[str] | None = None
        ref: Campaign | None = None
        try:
            for i in range(N_NODES):
                camp.start_node(f"n{i + 1}", topo.slots[i])
            span = camp.wait_full_size(0, 180, "the job to train at full size")
            say(f"chaos: training in round {span.number} at world size {span.world}")
            _inject_all(camp, report, rng, recovered_at, say)
            target = camp.set_target()
            if variant in FIXED_SIZE:  # its start-up overlaps the campaign's last steps
                ref = _start_reference(topo, etcd, workdir, camp, target, say)
            camp.wait_finished()
            temporaries = camp.temporaries()  # before the disk goes, with the topology
        except (AssertionError, RuntimeError) as exc:
            report.errors.append(str(exc)[:2000])
            report.tails = camp.tails()
            camp.dump_stacks(report)
            camp.stop_agents()  # the orphan check below then asks: did their workers follow?
        finally:
            poller.stop()
        camp.refresh_events(with_elasticctl=True)
        if camp.ctl_failures:
            report.errors.append("elasticctl events --json failed at the end of the run")
        etcd_pids = {m.proc.pid for m in etcd.members if m.running}
        leftover = camp.leftover_processes(exclude=etcd_pids)
        events = sorted(camp.events.values(), key=lambda e: e["time"])
        camp.steps.refresh()
        reference = ref_steps = None
        if ref is not None and not report.errors:
            reference, ref_steps = _finish_reference(ref, report)
        elif ref is not None:
            ref.stop_agents()
        etcd.stop()
        for m in etcd.members:  # ~120 MB of WAL each; their logs stay
            shutil.rmtree(m.data_dir, ignore_errors=True)

    result = _read_json(os.path.join(workdir, "result.json"))
    rounds = camp.steps.rounds
    labels = [(f"{a.node_id}.{a.incarnation}", a.poll(), a.killed) for a in camp.agents]
    ref_lines = ref_steps.lines if ref_steps is not None else []
    report.checks = [
        invariants.job_finished(labels),
        invariants.rounds_disjoint(rounds),
        invariants.steps_continuous(camp.steps.lines, rounds),
        invariants.checkpoint_monotonic(poller.seen, poller.errors),
        invariants.no_orphans(leftover),
        invariants.faults_visible(report.faults, events, rounds),
        invariants.no_restart_where_promised(report.faults, events, recovered_at),
        invariants.interrupted_saves_discarded(report.faults, poller.seen, temporaries),
    ]
    if variant in FIXED_SIZE:
        report.checks.insert(1, invariants.weights_equal(result, reference, camp.steps.lines,
                                                         ref_lines))
    if variant == "memory":
        report.checks.append(invariants.memory_resume_bounded(rounds, report.faults,
                                                              MEMORY_EVERY))
    report.recovery = invariants.recovery_times(report.faults, rounds)
    report.duration_s = time.monotonic() - started
    if report.ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return report


def _inject_all(camp: Campaign, report: Report, rng: random.Random,
                recovered_at: dict[int, float], say) -> None:
    for i, kind in enumerate(report.planned):
        pause = rng.uniform(0.2, 1.0)  # the seeded moment: this long into healthy training
        time.sleep(pause)
        rec = fault_kinds.KINDS[kind].inject(camp, rng)
        report.faults.append(rec)
        try:
            camp.wait_full_size(rec.t_end, RECOVERY_TIMEOUT_S,
                                f"recovery from {kind} ({rec.target})")
        except AssertionError as exc:
            rec.problems.append(str(exc))
            report.tails = camp.tails()
            say(f"chaos: fault {i + 1}/{len(report.planned)} {kind}: NOT RECOVERED: {exc}")
            raise
        recovered_at[i] = time.time()
        if rec.expect_restart is False and camp.current_round() != rec.round_before:
            rec.notes.append(f"round changed {rec.round_before} -> {camp.current_round()}")
        camp.refresh_events()
        say(f"chaos: fault {i + 1}/{len(report.planned)} {kind}: {rec.target}; back at full "
            f"size in round {camp.current_round()} {recovered_at[i] - rec.t_start:.1f} s "
            f"after the fault" + (f" [{'; '.join(rec.notes)}]" if rec.notes else "")
            + (f" PROBLEMS: {'; '.join(rec.problems)}" if rec.problems else ""))


def _start_reference(topo, etcd, workdir, camp: Campaign, target: int, say) -> Campaign:
    """Start the same job without faults, to ``target`` (the campaign's last step), for
    the weights oracle. Its processes carry a tag of their own, so the campaign's
    orphan check does not count them while the reference still runs."""
    refdir = os.path.join(workdir, "reference")
    os.makedirs(refdir, exist_ok=True)
    ref = Campaign(topo, etcd, refdir, variant="fixed", job_id=camp.job_id + "-ref", say=say,
                   lease_ttl_s=camp.settings.lease_ttl_s,
                   hang_timeout_s=camp.settings.hang_timeout_s, tag=f"{topo.tag}-ref")
    # Nothing restarts here and nothing crashes a save: no warm workers (their spare
    # sets would only compete for the CPU) and no slowed saves. Neither changes a number.
    ref.settings = dataclasses.replace(ref.settings, prestart=False, worker_failpoints="")
    _write_atomically(ref.target_file, str(target))
    ref._set_pace(0)
    say(f"chaos: reference run without faults to step {target}")
    for i in range(N_NODES):
        ref.start_node(f"n{i + 1}", topo.slots[i])
    return ref


def _finish_reference(ref: Campaign, report: Report):
    """Wait for the reference run; returns its result and its step log."""
    try:
        ref.wait_for(lambda: all(a.poll() is not None for a in ref.agents), 240,
                     "the reference run to finish")
        bad = [f"{a.node_id} exited {a.poll()}" for a in ref.agents if a.poll() != 0]
        if bad:
            report.errors.append(f"reference run: {', '.join(bad)}")
            report.tails = ref.tails()
    except AssertionError as exc:
        report.errors.append(f"reference run: {exc}")
        report.tails = ref.tails()
    for a in ref.agents:
        a.kill()
    ref.steps.refresh()
    return _read_json(os.path.join(ref.workdir, "result.json")), ref.steps


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
