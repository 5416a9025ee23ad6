"""Recovery benchmark: elasticd against torchrun, side by side, on the same training script.

What is measured (every launcher runs ``examples/ddp.py --steps 100000 --step-time S
--progress-file F``; the script appends one JSON line per completed step and rank with
the wall time ``t``, ``rank``, ``step``, ``restart`` (TORCHELASTIC_RESTART_COUNT),
``world`` and ``pid``, and the benchmark reads that file):

1. **Worker crash** (the headline). One node, two workers, rank 1 gets SIGKILL. Recovery
   time = ``t`` of the first step completed by the restarted group minus the time of the
   kill. Three cases (``--cases``), each with two scripts (``--scripts``): ``ddp``
   (examples/ddp.py, which reports its steps with ``elastic.step``) and ``plain``
   (bench/plain_ddp.py: torch only, as a user brings it from torchrun, never reports a
   step):

   - ``steady``: once both ranks have made 20 steps (and, for elasticd, once its warm
     workers for the next round are ready: two more of the agent's children blocked
     reading their assignment);
   - ``early``: at rank 1's first step of the job's first round, a second or two after
     the round started (a flapping node, a bad first batch; the very first round);
   - ``repeat``: a steady-state kill, then a second kill at the restarted rank 1's first
     step, within seconds of the restart; measured from the second kill.

   Rows per case and script:

   - torchrun ``--standalone`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its best
     configuration: without it, torch 2.13's restarted workers sometimes hang in
     ``init_process_group``);
   - torchrun with its defaults (steady ddp only), bounded (``--hang-bound``, 30 s): the
     hang rate (runs with no restarted step within the bound) and the median of the runs
     that recovered;
   - elasticd ``--standalone`` with its defaults, and the ratio elasticd / torchrun of the
     medians (target <= 0.2). Its log lines give a breakdown of the recovery (median
     seconds after the kill): detected (worker reaped), round committed, old workers
     stopped, new workers started (and how many started cold or still importing), process
     group formed (rank 0 prints ``training: ...``), first step. torchrun gets the same
     where its log says it (detected, group formed, first step).

2. **Frozen node, dead node**. Two "nodes" on this machine (two agents, one worker each,
   ``--nnodes 1:2``). Once both train in one group (world 2, 20 steps), node b's agent
   and all its processes get SIGSTOP. Recovery = first step of the survivor alone (first
   record with ``world == 1`` after the freeze) minus the freeze time. elasticd: one etcd
   started by this benchmark for both agents, ``--lease-ttl 5`` and ``--lease-ttl 2``
   (a frozen node is gone once its lease expires, so recovery is about the TTL plus a
   restart). torchrun: two agents on a c10d rendezvous (the first hosts the store), bound
   ``--frozen-bound`` (60 s); torchrun does not notice a frozen peer, its survivor hangs in
   the collective until the process-group timeout, so "no recovery within 60 s" is the
   expected result. Node death: node b's agent alone gets SIGKILL (its workers follow it,
   as when a machine's agent dies); elasticd with the default ``--lease-ttl 5``, and
   torchrun. elasticd runs once with ``--freeze-timeout`` at its default (node a's probes
   find b silent and its lease is revoked: recovery is about the freeze timeout plus a
   restart) and once with ``--freeze-timeout 0`` (the lease alone), ``--freeze-timeouts``;
   the ratio of the two is printed. Target for elasticd: at most 1.5 s.

3. **Agent footprint**. While elasticd runs a job (one node, two workers) the agent
   process itself (not its workers, not its etcd): VmRSS from /proc/PID/status, CPU
   (utime+stime from /proc/PID/stat) over a ``--window`` (60 s) of steady state as % of
   one core, and whether any libtorch is mapped (/proc/PID/maps). With ddp.py training,
   and with workers that only sleep and report a step a second; ``--footprint-runs`` (3)
   of each, in turn, judged on the median (one busy minute of the machine moves a single
   run by half: 0.20 to 0.42 % seen). Targets: <= 60 MB, <= 0.3 % of a core. torchrun's
   agent is measured the same way during training, for comparison.

How to run (about 27 minutes by default on a quiet 2-core machine;
--no-footprint-torchrun saves 3.5 minutes; do not run other heavy things meanwhile, the
numbers are wall-clock times on a small machine)::

    .venv/bin/python bench/recovery.py                 # everything, 3 runs per crash row
    .venv/bin/python bench/recovery.py --quick         # one run per row, shorter (about 7 minutes)
    .venv/bin/python bench/recovery.py --runs 9 --json /tmp/recovery.json
    .venv/bin/python bench/recovery.py --only crash    # crash, frozen or footprint (repeatable)

How to read it: each row is a median with [min .. max] over the runs; "hangs k/n" counts
runs that never recovered within the bound. The elasticd breakdown shows where its
recovery time goes: everything up to "workers started" is the agent (detection,
rendezvous, stopping, spawning); "group formed" and "first step" are the workers
(``init_process_group``, building the model, the first step). Lower is better everywhere.

Every process a run starts carries a tag in its environment; each run ends by stopping
its launchers (SIGTERM, then SIGKILL of every tagged process and process group), and the
benchmark checks at the end (environment tag scan and ``pgrep -f`` on its scratch
directory) that none is left. All traffic stays on 127.0.0.1.

On a GPU host the script's workers use NCCL, one GPU per worker, and the "nodes" of a
run share the host: each launcher gets its own GPUs through ``CUDA_VISIBLE_DEVICES``
(node a the first ``nproc`` visible, node b the next), so no GPU serves two ranks of a
group, which NCCL refuses. The two-node rows need 4 GPUs (2 for the others); with
fewer a run stops with an error that says so. ``CUDA_VISIBLE_DEVICES=""`` runs on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent.devices import colocated_node_gpus, physical_gpus, visible_gpus  # noqa: E402
from elastic.errors import ConfigError  # noqa: E402
from elastic.store.server import EtcdServer  # noqa: E402
from elastic.worker.bootstrap import PRELOAD_THREAD_NAME  # noqa: E402

# Not ELASTIC_*: elasticd reads those as its options (and warns about unknown ones).
TAG_ENV = "BENCH_RECOVERY_TAG"
SCRIPT = os.path.join(ROOT, "examples", "ddp.py")
PLAIN_SCRIPT = os.path.join(ROOT, "bench", "plain_ddp.py")
# What a crash row runs: a script that reports steps (elastic.step) and one that never does.
SCRIPTS = {"ddp": SCRIPT, "plain": PLAIN_SCRIPT}
# When rank 1 gets SIGKILL: at steady state; at its first step of the job's first round
# (the first seconds of a round, and the very first round); right after the first step of
# a group that was just restarted (a second failure within seconds of a restart).
CASES = ("steady", "early", "repeat")
CLK_TCK = os.sysconf("SC_CLK_TCK")
STEPS_BEFORE_FAULT = 20
RATIO_TARGET = 0.2  # elasticd / torchrun, worker SIGKILL to the first restarted step
FOOTPRINT_RSS_MB = 60  # the agent process, steady state
FOOTPRINT_CPU_PCT = 0.3  # % of one core, over --window

SLEEPER = '''\
"""Workers that do nothing but sleep and report a step a second (bench/recovery.py)."""
import time

import elastic

elastic.init()
step = 0
while True:
    time.sleep(1)
    elastic.step(step)
    step += 1
'''


# ---------------------------------------------------------------- processes


def _proc_parents() -> dict[int, int]:
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            parents[int(name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (not ``pid`` itself)."""
    children: dict[int, list[int]] = {}
    for child, parent in _proc_parents().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tagged(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries this benchmark's tag."""
    needle = f"{TAG_ENV}={tag}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            if process_state(int(name)) in ("Z", "X", None):
                continue
        except OSError:
            continue
        found.append(int(name))
    return found


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, T, Z...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return None


def signal_all(pids, sig: int, groups: bool = False) -> None:
    """Send ``sig`` to each of ``pids`` (with ``groups``, to its process group
    first, unless that is this bench's own); a process already gone is skipped."""
    mine = os.getpgid(0)
    for pid in pids:
        if groups:
            try:
                pgid = os.getpgid(pid)
                if pgid != mine and pgid > 1:
                    os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _die_with_bench() -> None:
    """In the child before exec: SIGKILL it when the benchmark dies, even by SIGKILL
    (elasticd's workers then die with their agent; SIGTERM and Ctrl-C are cleaned up
    properly by the benchmark itself)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Launcher:
    """One launcher process (an agent or torchrun) in its own session, its output
    read line by line with the time each line arrived."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str):
        self.name = name
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._log = open(log_path, "w", encoding="utf-8", errors="replace")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_bench)
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"bench-{name}-reader")
        self._reader.start()

    def _read(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            now = time.time()
            text = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.lines.append((now, text))
            try:
                self._log.write(f"{now:.3f} {text}\n")
                self._log.flush()
            except ValueError:
                pass

    def snapshot(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.lines)

    def find(self, pattern: str, after: float = 0.0) -> tuple[float, re.Match] | None:
        """First line arrived after ``after`` that matches; its time (the log's own
        timestamp when the line has one, else the arrival time) and the match."""
        rx = re.compile(pattern)
        for arrived, text in self.snapshot():
            m = rx.search(text)
            if not m:
                continue
            t = _log_time(text, arrived)
            if t >= after:
                return t, m
        return None

    def close(self) -> None:
        self._reader.join(timeout=5)
        try:
            self.proc.stdout.close()
        except OSError:
            pass
        self._log.close()


_ELASTICD_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) elasticd ")
_GLOG_TS = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d+) ")


def _log_time(text: str, arrived: float) -> float:
    """The timestamp a log line carries (elasticd's or torch's glog style), else its
    arrival time. Both are local time with at most microsecond resolution."""
    m = _ELASTICD_TS.match(text)
    if m:
        return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
    m = _GLOG_TS.match(text)
    if m:
        year = time.localtime(arrived).tm_year
        base = time.mktime((year, int(m.group(1)), int(m.group(2)), int(m.group(3)),
                            int(m.group(4)), int(m.group(5)), 0, 0, -1))
        return base + float("0." + m.group(6))
    return arrived


class Progress:
    """Reads the progress file incrementally."""

    def __init__(self, path: str):
        self.path = path
        self.records: list[dict] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.records.extend(new)
        return new


class BenchError(Exception):
    pass


def wait_for(what: str, cond, timeout_s: float, interval_s: float = 0.02,
             run: "Run | None" = None):
    """Poll ``cond`` until true; BenchError after ``timeout_s``, or as soon as one of
    ``run``'s launchers has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if run is not None:
            run.check_alive(what)
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def launcher_env(name: str, env: dict[str, str], argv: list[str], node: int,
                 gpus: list[str]) -> dict[str, str]:
    """``env`` for launcher ``name``, the ``node``-th of its run on this host, with
    ``CUDA_VISIBLE_DEVICES`` set to its own share of ``gpus`` (one per worker of
    its ``--nproc-per-node``) when there are any. Raises BenchError when too few."""
    try:
        share = colocated_node_gpus(node, _nproc(argv), gpus)
    except ConfigError as exc:
        raise BenchError(f"{name}: {exc}") from exc
    return env if share is None else {**env, "CUDA_VISIBLE_DEVICES": share}


def _nproc(argv: list[str]) -> int:
    """The ``--nproc-per-node`` of a launcher's command line (1 if absent)."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--nproc-per-node", "--nproc_per_node"):
            return int(argv[i + 1])
    return 1


def new_job_id() -> str:
    """A job id of its own for one measurement."""
    return f"bench-{uuid.uuid4().hex[:12]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- one run


class Run:
    """The processes of one measurement; ``close()`` leaves none behind."""

    def __init__(self, bench: "Bench", label: str):
        self.bench = bench
        self.dir = tempfile.mkdtemp(prefix=f"{label}-", dir=bench.scratch)
        self.progress = Progress(os.path.join(self.dir, "progress.jsonl"))
        self.launchers: list[Launcher] = []
        self.frozen: list[int] = []
        self.killed: set[str] = set()  # launchers this run killed on purpose
        self.etcd: EtcdServer | None = None
        self.stray = 0

    def launch(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None,
               node: int = 0) -> Launcher:
        """Start launcher ``name``, the ``node``-th (from 0) of its run on this host:
        on a GPU host it gets GPUs of its own (see the module docstring)."""
        env = launcher_env(name, {**self.bench.env, **(extra_env or {})}, argv, node,
                           self.bench.visible_gpus)
        ln = Launcher(name, argv, env, os.path.join(self.dir, f"{name}.log"))
        self.launchers.append(ln)
        return ln

    def script_args(self, script: str = SCRIPT) -> list[str]:
        if script not in SCRIPTS.values():
            return [script]
        return [script, "--steps", "100000", "--step-time", str(self.bench.args.step_time),
                "--progress-file", self.progress.path]

    def elasticd(self, name: str, opts: list[str], script: str = SCRIPT, node: int = 0
                 ) -> Launcher:
        argv = [self.bench.python, "-m", "agent.daemon", *opts, "--advertise-addr", "127.0.0.1",
                "--listen", "127.0.0.1:0", "--log-dir", os.path.join(self.dir, f"{name}-logs"),
                *self.script_args(script)]
        return self.launch(name, argv, node=node)

    def torchrun(self, name: str, opts: list[str], extra_env: dict[str, str] | None = None,
                 script: str = SCRIPT, node: int = 0) -> Launcher:
        argv = [self.bench.torchrun, *opts, *self.script_args(script)]
        return self.launch(name, argv, extra_env, node=node)

    def check_alive(self, what: str) -> None:
        for ln in self.launchers:
            code = ln.proc.poll()
            if code is not None and ln.name not in self.killed:
                tail = " | ".join(text for _, text in ln.snapshot()[-3:])
                raise BenchError(f"{ln.name} exited with {code} while waiting for {what}: "
                                 f"{tail}")

    def close(self) -> None:
        """SIGCONT what was frozen, SIGTERM the launchers, then SIGKILL everything
        tagged that is still there (processes and their groups)."""
        tag = self.bench.tag
        for ln in self.launchers:
            if ln.proc.poll() is None:
                signal_all([ln.pid], signal.SIGTERM)
        signal_all(self.frozen, signal.SIGCONT)
        deadline = time.monotonic() + self.bench.args.stop_grace
        while time.monotonic() < deadline and any(ln.proc.poll() is None for ln in self.launchers):
            time.sleep(0.05)
        keep = {self.etcd.pid} if self.etcd is not None and self.etcd.pid else set()
        for _ in range(20):
            left = [p for p in tagged(tag) if p not in keep]
            for ln in self.launchers:
                if ln.proc.poll() is None:
                    left.append(ln.pid)
            if not left:
                break
            signal_all(left, signal.SIGKILL, groups=True)
            signal_all(left, signal.SIGCONT)
            time.sleep(0.1)
        for ln in self.launchers:
            try:
                ln.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            ln.close()
        if self.etcd is not None:
            self.etcd.stop()
        self.stray = len(tagged(tag))

    def close_into(self, out: dict) -> dict:
        """:meth:`close`, then note in ``out`` how many tagged processes were
        left (``stray``) and where this run's files are (``dir``); returns it."""
        self.close()
        out["stray"] = self.stray
        out["dir"] = self.dir
        return out


# ---------------------------------------------------------------- measurements


def _steady(run: Run, world: int, ranks: int, what: str, timeout_s: float,
            first_start: bool = True) -> None:
    """Wait until every rank of a group of ``world`` has made the warm-up steps (in the
    first start of the workers, unless ``first_start`` is False)."""
    def ready():
        run.progress.poll()
        best: dict[int, int] = {}
        for r in run.progress.records:
            if r["world"] == world and (r["restart"] == 0 or not first_start):
                best[r["rank"]] = max(best.get(r["rank"], -1), r["step"])
        return len(best) >= ranks and all(s >= STEPS_BEFORE_FAULT for s in best.values())
    wait_for(what, ready, timeout_s, run=run)


def _current_pids(run: Run) -> set[int]:
    return {r["pid"] for r in run.progress.records}


def warm_workers(agent_pid: int, busy: set[int]) -> list[int]:
    """The agent's children that are warm: blocked in read(0, ...) for an assignment,
    with no thread still preloading (the bootstrap names it PRELOAD_THREAD_NAME)."""
    ready = []
    for pid in descendants(agent_pid):
        if pid in busy:
            continue
        try:
            with open(f"/proc/{pid}/syscall") as f:
                fields = f.read().split()
            names = []
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names.append(f.read().strip())
        except OSError:
            continue
        if (len(fields) > 1 and fields[0] == "0" and fields[1] == "0x0"
                and PRELOAD_THREAD_NAME not in names):
            ready.append(pid)
    return ready


def _wait_warm(run: Run, agent: Launcher, want: int, timeout_s: float) -> float | None:
    """Wait until ``want`` warm workers are ready; seconds it took, None if they never were."""
    started = time.monotonic()
    try:
        wait_for("warm workers", lambda: len(warm_workers(agent.pid, _current_pids(run))) >= want,
                 timeout_s, 0.1, run=run)
    except BenchError:
        run.check_alive("warm workers")  # a dead launcher is an error, slow warm-up is not
        return None
    return time.monotonic() - started


def _first(records: list[dict], pred) -> dict | None:
    for r in records:
        if pred(r):
            return r
    return None


def _rel(found, origin: float) -> float | None:
    return round(found[0] - origin, 3) if found else None


def _rank1_pid(run: Run, restart: int, what: str, timeout_s: float) -> int:
    """The pid of rank 1 once it has completed a step with ``restart`` (TORCHELASTIC_RESTART_COUNT)."""
    found = wait_for(what, lambda: _first(run.progress.poll(), lambda r: r["rank"] == 1
                                          and r["restart"] == restart), timeout_s, run=run)
    return found["pid"]


def crash_run(bench: "Bench", launcher: str, bound_s: float, case: str = "steady",
              script: str = "ddp") -> dict:
    """One worker-crash measurement. ``launcher``: elasticd, torchrun or torchrun-default;
    ``case``: one of CASES; ``script``: a key of SCRIPTS."""
    args = bench.args
    run = Run(bench, f"crash-{case}-{script}-{launcher}")
    out: dict = {"launcher": launcher, "case": case, "script": script}
    path = SCRIPTS[script]
    try:
        started = time.time()
        if launcher == "elasticd":
            ln = run.elasticd("agent", ["--standalone", "--job-id", new_job_id(),
                                        "--nnodes", "1", "--nproc-per-node", "2"], script=path)
        else:
            env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun" else {}
            ln = run.torchrun("torchrun", ["--standalone", "--nnodes", "1", "--nproc-per-node",
                                           "2", "--max-restarts", "3"], env, script=path)
        measured = 1  # the restart count of the group whose first step ends the measurement
        if case == "early":
            victim = _rank1_pid(run, 0, "rank 1's first step", args.start_timeout)
        else:
            _steady(run, 2, 2, f"{launcher} to train", args.start_timeout)
            if launcher == "elasticd":
                out["warm_wait_s"] = _wait_warm(run, ln, 2, args.warm_timeout)
            time.sleep(args.settle)
            run.progress.poll()
            victim = max((r for r in run.progress.records if r["rank"] == 1
                          and r["restart"] == 0), key=lambda r: r["step"])["pid"]
            if case == "repeat":
                _kill_worker(ln, victim)
                restarted_at = time.time()
                victim = _rank1_pid(run, 1, "the restarted rank 1's first step", bound_s)
                out["after_restart_s"] = round(time.time() - restarted_at, 3)
                measured = 2
        if launcher == "elasticd":
            out["warm_at_kill"] = len(warm_workers(ln.pid, _current_pids(run)))
        killed_at = _kill_worker(ln, victim)
        out["killed_pid"] = victim
        out["since_launch_s"] = round(killed_at - started, 3)
        deadline = time.monotonic() + bound_s
        first = None
        while first is None and time.monotonic() < deadline:
            first = _first(run.progress.poll(), lambda r: r["restart"] >= measured)
            if first is None:
                run.check_alive("the restarted workers' first step")
                time.sleep(0.02)
        out["recovery_s"] = round(first["t"] - killed_at, 3) if first else None
        out["phases"] = _crash_phases(launcher, ln, killed_at, first, measured)
    except BenchError as exc:
        out["error"] = str(exc)
        out["recovery_s"] = None
    finally:
        run.close_into(out)
    return out


def _kill_worker(ln: Launcher, pid: int) -> float:
    """SIGKILL worker ``pid`` of launcher ``ln``; returns the wall time of the kill."""
    if pid not in descendants(ln.pid):
        raise BenchError(f"rank 1's pid {pid} is not a process of the launcher")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return killed_at


def _crash_phases(launcher: str, ln: Launcher, t0: float, first: dict | None,
                  restart: int) -> dict:
    """Where the time after the kill went; the group restarted ``restart`` times is
    elasticd's round ``restart + 1`` (one node: one round per restart)."""
    phases: dict = {}
    old, new = restart, restart + 1
    if launcher == "elasticd":
        phases["detected"] = _rel(ln.find(r"was killed by signal 9\.$", t0 - 0.05), t0)
        phases["round committed"] = _rel(ln.find(rf"round {new} committed", t0 - 0.05), t0)
        phases["workers stopped"] = _rel(ln.find(rf"round {old}: workers stopped in",
                                                 t0 - 0.05), t0)
        started = ln.find(rf"round {new}: started (\d+) workers \(pids .*, (\d+) cold, "
                          rf"(\d+) warm but still importing\)", t0 - 0.05)
        phases["workers started"] = _rel(started, t0)
        phases["cold"] = int(started[1].group(2)) if started else None
        phases["importing"] = int(started[1].group(3)) if started else None
    else:
        phases["detected"] = _rel(ln.find(r"failed \(exitcode: -9\)", t0 - 0.05), t0)
    phases["group formed"] = _rel(ln.find(rf"training: world size \d+, restart {restart}",
                                          t0), t0)
    phases["first step"] = round(first["t"] - t0, 3) if first else None
    return phases


def frozen_run(bench: "Bench", launcher: str, lease_ttl: float, bound_s: float,
               fault: str = "freeze", freeze_timeout: str = "default") -> dict:
    """One node-fault measurement: nodes a and b, one worker each; b freezes (SIGSTOP of
    its agent and workers) or dies (``fault="kill"``: SIGKILL of its agent alone, whose
    workers follow it as they do when a machine's agent dies). ``freeze_timeout``:
    elasticd's --freeze-timeout ("default": the flag not given)."""
    args = bench.args
    run = Run(bench, f"{fault}-{launcher}")
    out: dict = {"launcher": launcher, "fault": fault,
                 "lease_ttl_s": lease_ttl if launcher == "elasticd" else None,
                 "freeze_timeout": freeze_timeout if launcher == "elasticd" else None}
    try:
        job = new_job_id()
        if launcher == "elasticd":
            run.etcd = EtcdServer().start()
            common = ["--etcd", run.etcd.endpoint, "--job-id", job, "--nnodes", "1:2",
                      "--nproc-per-node", "1", "--lease-ttl", f"{lease_ttl:g}"]
            if freeze_timeout != "default":
                common += ["--freeze-timeout", freeze_timeout]
            a = run.elasticd("a", [*common, "--node-id", "a"])
            # a first, so that a leads and b's worker is rank 1 (as in the brief).
            wait_for("node a to lead", lambda: a.find(r"node a round \d+: elected leader"), 30, 0.05,
                     run=run)
            b = run.elasticd("b", [*common, "--node-id", "b"], node=1)
        else:
            port = free_port()
            common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                      "--rdzv-id", job, "--nnodes", "1:2", "--nproc-per-node", "1",
                      "--max-restarts", "3", "--local-addr", "127.0.0.1"]
            env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
            a = run.torchrun("a", [*common, "--rdzv-conf", "is_host=1"], env)
            time.sleep(0.5)
            b = run.torchrun("b", [*common, "--rdzv-conf", "is_host=0"], env, node=1)
        # elasticd's node a may first train alone (world 1) until b arrives.
        _steady(run, 2, 2, f"{launcher} nodes to train together", args.start_timeout,
                first_start=False)
        if launcher == "elasticd":
            out["warm_wait_s"] = _wait_warm(run, a, 1, args.warm_timeout)
        time.sleep(args.settle)
        run.progress.poll()
        worker_b = [r["pid"] for r in run.progress.records if r["world"] == 2 and r["rank"] == 1]
        b_tree = descendants(b.pid)
        if not worker_b or worker_b[-1] not in b_tree:
            raise BenchError("rank 1 of the world-2 group is not node b's worker")
        frozen_at = time.time()
        if fault == "kill":
            run.killed.add(b.name)
            signal_all([b.pid], signal.SIGKILL)
        else:
            run.frozen = [b.pid, *b_tree]
            signal_all(run.frozen, signal.SIGSTOP)
            out["frozen_pids"] = run.frozen
        deadline = time.monotonic() + bound_s
        first = None
        while first is None and time.monotonic() < deadline:
            first = _first(run.progress.poll(),
                           lambda r: r["world"] == 1 and r["t"] > frozen_at)
            if first is None:
                run.check_alive("the survivor's first step alone")
                time.sleep(0.05)
        out["recovery_s"] = round(first["t"] - frozen_at, 3) if first else None
        if launcher == "elasticd":
            out["phases"] = {
                "revoked": _rel(a.find(r"revoked the lease of b", frozen_at), frozen_at),
                "peer gone": _rel(a.find(r"node b left", frozen_at), frozen_at),
                "round committed": _rel(a.find(r"committed round", frozen_at), frozen_at),
                "workers stopped": _rel(a.find(r"workers stopped in", frozen_at), frozen_at),
                "workers started": _rel(a.find(r"started \d+ workers", frozen_at), frozen_at),
                "group formed": _rel(a.find(r"training: world size 1", frozen_at), frozen_at),
                "first step": out["recovery_s"],
            }
    except BenchError as exc:
        out["error"] = str(exc)
        out["recovery_s"] = None
    finally:
        signal_all(run.frozen, signal.SIGKILL)
        run.close_into(out)
    return out


def _proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


def _torch_libs(pid: int) -> list[str]:
    libs = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split(maxsplit=5)[-1].strip() if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if name.startswith(("libtorch", "libc10")) or "/torch/lib/" in path:
                libs.add(name)
    return sorted(libs)


def footprint_run(bench: "Bench", launcher: str, workload: str) -> dict:
    """RSS and CPU of the launcher process while its job runs steadily."""
    args = bench.args
    run = Run(bench, f"footprint-{launcher}-{workload}")
    out: dict = {"launcher": launcher, "workload": workload, "window_s": args.window}
    try:
        script = SCRIPT
        if workload == "sleep":
            script = os.path.join(run.dir, "sleeper.py")
            with open(script, "w") as f:
                f.write(SLEEPER)
        if launcher == "elasticd":
            ln = run.elasticd("agent", ["--standalone", "--job-id", new_job_id(),
                                        "--nnodes", "1", "--nproc-per-node", "2"], script=script)
        else:
            ln = run.torchrun("torchrun", ["--standalone", "--nnodes", "1", "--nproc-per-node",
                                           "2", "--max-restarts", "3"],
                              {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        if workload == "train":
            _steady(run, 2, 2, f"{launcher} to train", args.start_timeout)
        if launcher == "elasticd":
            # Sleepers never print: wait until the warm set for the next round is up
            # (its preload is CPU the agent's children spend, not the agent).
            out["warm_wait_s"] = _wait_warm(run, ln, 2, args.start_timeout)
        time.sleep(max(args.settle, 2.0))
        pid = ln.pid
        t0, c0 = time.monotonic(), _cpu_ticks(pid)
        rss = []
        while time.monotonic() - t0 < args.window:
            rss.append(int(_proc_status(pid)["VmRSS"].split()[0]))
            time.sleep(0.5)
        t1, c1 = time.monotonic(), _cpu_ticks(pid)
        status = _proc_status(pid)
        out["rss_mb"] = round(max(rss) / 1024, 1)
        out["hwm_mb"] = round(int(status["VmHWM"].split()[0]) / 1024, 1)
        out["threads"] = int(status["Threads"])
        out["cpu_pct"] = round(100.0 * (c1 - c0) / CLK_TCK / (t1 - t0), 2)
        out["torch_libs"] = _torch_libs(pid)
        if ln.proc.poll() is not None:
            raise BenchError(f"{launcher} exited during the window ({ln.proc.returncode})")
    except (BenchError, OSError, KeyError) as exc:
        out["error"] = str(exc)
    finally:
        run.close_into(out)
    return out


# ---------------------------------------------------------------- the benchmark


class BenchBase:
    """What a :class:`Run` needs of its bench: the arguments (``python``,
    ``torchrun``, ``step_time``, ``stop_grace``, ``quiet``), the tag that finds
    its processes, a scratch directory named ``<scratch_prefix>...``, the
    environment every launcher gets, the GPUs launchers are given, and
    :meth:`log`."""

    def __init__(self, args: argparse.Namespace, scratch_prefix: str):
        self.args = args
        self.tag = uuid.uuid4().hex
        self.scratch = tempfile.mkdtemp(prefix=scratch_prefix)
        self.python = args.python
        self.torchrun = args.torchrun
        pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        # The same environment for every launcher: the repository importable (torchrun's
        # workers need it), gloo on loopback, and the tag that finds our processes.
        self.env = {**os.environ, TAG_ENV: self.tag, "PYTHONPATH": pythonpath,
                    "GLOO_SOCKET_IFNAME": "lo"}
        self.env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        # What each launcher's CUDA_VISIBLE_DEVICES is cut from (none: the CPU);
        # Run.launch gives each node its share.
        self.visible_gpus = visible_gpus(physical_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))

    def log(self, msg: str) -> None:
        """``msg`` on stderr with the time, unless ``--quiet``."""
        if not self.args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Bench(BenchBase):
    def __init__(self, args: argparse.Namespace):
        super().__init__(args, "bench-recovery-")
        self.results: dict = {"crash": [], "frozen": [], "footprint": []}

    def _show(self, r: dict) -> str:
        if r.get("error"):
            return f"error: {r['error']}"
        rec = r.get("recovery_s")
        extra = ""
        if r.get("phases"):
            extra = "  (" + ", ".join(f"{k} {v}" for k, v in r["phases"].items()
                                      if v is not None) + ")"
        return (f"{rec:.2f} s{extra}" if rec is not None else "no recovery within the bound") + (
            f"  STRAY {r['stray']}" if r.get("stray") else "")

    def run(self) -> dict:
        a = self.args
        only = set(a.only or ["crash", "frozen", "footprint"])
        meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                "host": platform.node(), "cpus": os.cpu_count(),
                "loadavg_start": os.getloadavg()[0], "python": self.python,
                "torch": torch_version(self.python), "args": vars(a)}
        self.results["meta"] = meta
        t_start = time.monotonic()
        if "crash" in only:
            for i in range(a.runs):
                for case in a.cases:
                    for script in a.scripts:
                        kinds = ["torchrun", "elasticd"]
                        if i < a.default_runs and (case, script) == ("steady", "ddp"):
                            kinds.append("torchrun-default")
                        for kind in kinds:
                            bound = a.hang_bound if kind == "torchrun-default" else a.crash_bound
                            r = crash_run(self, kind, bound, case, script)
                            r["run"] = i
                            self.results["crash"].append(r)
                            self.log(f"crash {case} {script} {i + 1}/{a.runs} {kind}: "
                                     f"{self._show(r)}")
        if "frozen" in only:
            plan = []
            if "freeze" in a.node_faults:
                plan += [("elasticd", ttl, a.frozen_runs, "freeze", ft) for ttl in a.lease_ttls
                         for ft in a.freeze_timeouts]
                plan.append(("torchrun", None, a.frozen_torchrun_runs, "freeze", None))
            if "kill" in a.node_faults:  # the default lease TTL (5 s), and torchrun
                plan += [("elasticd", 5.0, a.frozen_runs, "kill", ft) for ft in a.freeze_timeouts]
                plan.append(("torchrun", None, a.frozen_torchrun_runs, "kill", None))
            for i in range(max(n for _, _, n, _, _ in plan)):
                for kind, ttl, n, fault, ft in plan:
                    if i >= n:
                        continue
                    r = frozen_run(self, kind, ttl or 0, a.frozen_bound, fault, ft or "default")
                    r["run"] = i
                    self.results["frozen"].append(r)
                    name = (f"elasticd --lease-ttl {ttl:g} --freeze-timeout {ft}"
                            if kind == "elasticd" else kind)
                    self.log(f"{fault} {i + 1}/{n} {name}: {self._show(r)}")
        if "footprint" in only:
            plan = [("elasticd", "train"), ("elasticd", "sleep")]
            if a.footprint_torchrun:
                plan.append(("torchrun", "train"))
            # Round-robin, so that a disturbance of the machine lands on one run of
            # one workload, not on every run of it.
            for i in range(a.footprint_runs):
                for launcher, workload in plan:
                    r = footprint_run(self, launcher, workload)
                    r["run"] = i
                    self.results["footprint"].append(r)
                    self.log(f"footprint {launcher} {workload} {i + 1}/{a.footprint_runs}: " + (
                        f"error: {r['error']}" if r.get("error") else
                        f"RSS {r['rss_mb']} MB, CPU {r['cpu_pct']} %, "
                        f"torch libs {r['torch_libs']}"))
        meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
        meta["loadavg_end"] = os.getloadavg()[0]
        return self.results

    def finish(self) -> dict:
        """Kill anything tagged that is left (there should be nothing) and report."""
        left = tagged(self.tag)
        if left:
            signal_all(left, signal.SIGKILL, groups=True)
            time.sleep(0.5)
        pgrep = subprocess.run(["pgrep", "-f", self.scratch], capture_output=True, text=True)
        check = {"tagged_left_at_end": left, "killed": left,
                 "pgrep_scratch": [int(p) for p in pgrep.stdout.split()],
                 "tagged_after_kill": tagged(self.tag),
                 "stray_per_run": sum(r.get("stray", 0) for k in ("crash", "frozen", "footprint")
                                      for r in self.results.get(k, []))}
        self.results["cleanup"] = check
        if not self.args.keep:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return check


def torch_version(python: str) -> str:
    """The torch version ``python`` has installed; "?" when it cannot tell."""
    try:
        # From the package metadata: importing torch here would cost seconds.
        out = subprocess.run([python, "-c", "import importlib.metadata as m; "
                              "print(m.version('torch'))"], capture_output=True, text=True,
                             timeout=30)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


# ---------------------------------------------------------------- report


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def summarize(results: dict, args: argparse.Namespace) -> dict:
    summary: dict = {"crash": {}, "frozen": {}, "footprint": {}}
    for case in CASES:
        for script in SCRIPTS:
            runs = [r for r in results["crash"]
                    if r.get("case", "steady") == case and r.get("script", "ddp") == script]
            if runs:
                summary["crash"][f"{case} {script}"] = _crash_rows(runs)
    for r in results["frozen"]:
        key = (f"elasticd ttl {r['lease_ttl_s']:g} freeze-timeout "
               f"{r.get('freeze_timeout', 'default')}" if r["launcher"] == "elasticd"
               else "torchrun") + f" {r.get('fault', 'freeze')}"
        row = summary["frozen"].setdefault(key, {"runs": 0, "values": [], "errors": [],
                                                 "phases": {}})
        row["runs"] += 1
        if r["recovery_s"] is not None:
            row["values"].append(r["recovery_s"])
        if r.get("error"):
            row["errors"].append(r["error"])
        for k, v in (r.get("phases") or {}).items():
            if v is not None:
                row["phases"].setdefault(k, []).append(v)
    for row in summary["frozen"].values():
        row["stats"] = _stats(row.pop("values"))
        row["recovered"] = row["stats"]["n"] if row["stats"] else 0
        row["phases_median"] = {k: round(statistics.median(v), 3)
                                for k, v in row.pop("phases").items()}
    by_key: dict[str, list[dict]] = {}
    for r in results["footprint"]:
        by_key.setdefault(f"{r['launcher']} {r['workload']}", []).append(r)
    for key, runs in by_key.items():
        ok = [r for r in runs if not r.get("error")]
        errors = [r["error"] for r in runs if r.get("error")]
        if not ok:
            summary["footprint"][key] = {"error": errors[0], "runs": len(runs)}
            continue
        # Judged on the median CPU and the largest RSS; the range shows the noise.
        summary["footprint"][key] = {
            "runs": len(runs), "errors": errors, "window_s": ok[0]["window_s"],
            "cpu": _stats([r["cpu_pct"] for r in ok]),
            "rss_mb": max(r["rss_mb"] for r in ok), "hwm_mb": max(r["hwm_mb"] for r in ok),
            "threads": max(r["threads"] for r in ok),
            "torch_libs": sorted({lib for r in ok for lib in r["torch_libs"]})}
    return summary


def _crash_rows(runs: list[dict]) -> dict:
    """One case and script: a row per launcher, and elasticd's ratios to torchrun."""
    rows: dict = {}
    for kind in ("torchrun", "torchrun-default", "elasticd"):
        mine = [r for r in runs if r["launcher"] == kind]
        if not mine:
            continue
        ok = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        row = {"runs": len(mine), "recovered": len(ok), "stats": _stats(ok),
               "errors": [r["error"] for r in mine if r.get("error")]}
        phases: dict[str, list[float]] = {}
        for r in mine:
            for k, v in (r.get("phases") or {}).items():
                if v is not None and k not in ("cold", "importing"):
                    phases.setdefault(k, []).append(v)
        row["phases_median"] = {k: round(statistics.median(v), 3) for k, v in phases.items()}
        if kind == "elasticd":
            row["cold_starts"] = sum((r.get("phases") or {}).get("cold") or 0 for r in mine)
            row["importing"] = sum((r.get("phases") or {}).get("importing") or 0 for r in mine)
            row["warm_at_kill"] = [r.get("warm_at_kill") for r in mine]
        rows[kind] = row
    ours, theirs = rows.get("elasticd"), rows.get("torchrun")
    if ours and theirs and ours["stats"] and theirs["stats"]:
        rows["ratio"] = round(ours["stats"]["median"] / theirs["stats"]["median"], 3)
    dflt = rows.get("torchrun-default")
    if ours and dflt and ours["stats"] and dflt["stats"]:
        rows["ratio_vs_default"] = round(ours["stats"]["median"] / dflt["stats"]["median"], 3)
    return rows


def _range(s: dict | None) -> str:
    return f"{s['median']:5.2f} s  [{s['min']:.2f} .. {s['max']:.2f}]" if s else "    -"


def _failed(row: dict, what: str, bound: float) -> str:
    missed = row["runs"] - row["recovered"]
    return f"  {what} within {bound:g} s in {missed}/{row['runs']}" if missed else ""


def render(results: dict, summary: dict, args: argparse.Namespace) -> str:
    meta = results["meta"]
    out = [f"elasticd vs torchrun: recovery benchmark ({meta['host']}, {meta['cpus']} cpus, "
           f"torch {meta['torch']}, load avg {meta['loadavg_start']:.1f} at start, "
           f"{meta.get('loadavg_end', 0):.1f} at end, {meta.get('elapsed_s', 0):.0f} s)"]
    for key, crash in summary["crash"].items():
        case, script = key.split()
        n = max((row["runs"] for row in crash.values() if isinstance(row, dict)), default=0)
        what = {"steady": "at steady state", "early": "at rank 1's first step of the job",
                "repeat": "at the first step after a restart"}[case]
        out += ["", f"worker SIGKILL {what} -> first restarted step ({script}: "
                    f"{os.path.relpath(SCRIPTS[script], ROOT)}, 1 node, 2 workers, "
                    f"--step-time {args.step_time:g}; median [min .. max] of {n})"]
        w = 50
        if "torchrun" in crash:
            row = crash["torchrun"]
            fail = _failed(row, "no step", args.crash_bound)
            out.append(f"  {'torchrun (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)':<{w}}"
                       f"{_range(row['stats'])}{fail}")
        if "torchrun-default" in crash:
            row = crash["torchrun-default"]
            out.append(f"  {'torchrun (default)':<{w}}{_range(row['stats'])}  hangs "
                       f"{row['runs'] - row['recovered']}/{row['runs']} (no step within "
                       f"{args.hang_bound:g} s)")
        if "elasticd" in crash:
            row = crash["elasticd"]
            ratio = crash.get("ratio")
            fail = _failed(row, "no step", args.crash_bound)
            out.append(f"  {'elasticd':<{w}}{_range(row['stats'])}"
                       + (f"  ratio {ratio:.2f} (target <= {RATIO_TARGET}: "
                          f"{'met' if ratio <= RATIO_TARGET else 'NOT met'})"
                          if ratio is not None else "") + fail)
            if crash.get("ratio_vs_default") is not None:
                out.append(f"  {'':<{w}}vs torchrun (default, recovered runs): "
                           f"ratio {crash['ratio_vs_default']:.2f}")
        for kind in ("elasticd", "torchrun", "torchrun-default"):
            if kind in crash and crash[kind]["phases_median"]:
                ph = crash[kind]["phases_median"]
                line = ", ".join(f"{k} {v:.2f}" for k, v in ph.items())
                out.append(f"  {kind} breakdown (median s after the kill): {line}")
        if "elasticd" in crash:
            row = crash["elasticd"]
            out.append(f"  elasticd: {row['cold_starts']} cold-started and {row['importing']} "
                       f"still-importing workers in {row['runs']} restarts; warm workers ready "
                       f"at each kill: {row['warm_at_kill']}")
    frozen = summary["frozen"]
    for fault, title in (("freeze", "frozen node (SIGSTOP of one of 2 nodes: its agent and "
                                    "workers, 1 worker each)"),
                         ("kill", "node death (SIGKILL of the agent of one of 2 nodes, 1 "
                                  "worker each)")):
        rows = {k.rsplit(" ", 1)[0]: row for k, row in frozen.items() if k.endswith(f" {fault}")}
        if not rows:
            continue
        out += ["", f"{title} -> first step of the survivor alone"]
        for key, row in rows.items():
            if key == "torchrun":
                name = "torchrun (c10d rendezvous, --nnodes 1:2)"
                if row["recovered"] == 0:
                    out.append(f"  {name:<42}no recovery within {args.frozen_bound:g} s in "
                               f"{row['runs']}/{row['runs']} runs")
                    continue
            else:
                _, _, ttl, _, timeout = key.split()
                name = f"elasticd --lease-ttl {ttl} --freeze-timeout {timeout}"
            tail = _failed(row, "no recovery", args.frozen_bound)
            out.append(f"  {name:<42}{_range(row['stats'])}  (n={row['runs']}){tail}")
        ours = {k: row["stats"]["median"] for k, row in rows.items()
                if k != "torchrun" and row["stats"]}
        for key, median in ours.items():
            off = key.rsplit(" ", 1)[0] + " 0"
            if key != off and ours.get(off):
                out.append(f"  ratio {key} / {off}: {median / ours[off]:.2f}")
        for key, row in rows.items():
            if row["phases_median"]:
                line = ", ".join(f"{k} {v:.2f}" for k, v in row["phases_median"].items())
                out.append(f"  {key} breakdown (median s after the fault): {line}")
    fp = summary["footprint"]
    if fp:
        out += ["", f"agent footprint (the launcher process only, not workers or etcd; CPU over "
                    f"{args.window:g} s of steady state, % of one core)"]
        out.append(f"  {'':<20}{'RSS':>9}{'peak':>9}{'CPU median [min .. max]':>26}"
                   f"{'runs':>6}{'threads':>9}  libtorch mapped")
        for key, row in fp.items():
            if "cpu" not in row:
                out.append(f"  {key:<20}error in all {row['runs']} runs: {row['error']}")
                continue
            libs = ", ".join(row["torch_libs"][:3]) + (" ..." if len(row["torch_libs"]) > 3
                                                       else "") if row["torch_libs"] else "no"
            cpu = row["cpu"]
            spread = f"{cpu['median']:.2f}% [{cpu['min']:.2f} .. {cpu['max']:.2f}]"
            failed = f" ({len(row['errors'])} failed: {row['errors'][0]})" if row["errors"] else ""
            out.append(f"  {key:<20}{row['rss_mb']:>6.1f} MB{row['hwm_mb']:>6.1f} MB"
                       f"{spread:>26}{cpu['n']:>6}{row['threads']:>9}  {libs}{failed}")
        verdicts = []
        for key, row in fp.items():
            if key.startswith("elasticd") and "cpu" in row:
                ok = (row["rss_mb"] <= FOOTPRINT_RSS_MB
                      and row["cpu"]["median"] <= FOOTPRINT_CPU_PCT and not row["torch_libs"])
                verdicts.append(f"{key.split()[1]}: {'met' if ok else 'NOT met'}")
        out.append(f"  targets for elasticd: <= {FOOTPRINT_RSS_MB} MB, <= {FOOTPRINT_CPU_PCT} % "
                   f"of a core, no libtorch "
                   f"({'; '.join(verdicts)})")
    c = results.get("cleanup")
    if c is not None:
        clean = not c["tagged_left_at_end"] and not c["pgrep_scratch"] and not c["stray_per_run"]
        out += ["", "stray processes: " + ("none (environment tag scan and pgrep -f on the "
                                           "scratch directory)" if clean else
                                           f"FOUND {c}")]
    return "\n".join(out)


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a bench whose module docstring is ``doc``: described by
    its first line, the help text shown as written."""
    return argparse.ArgumentParser(description=doc.split("\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_launcher_args(ap: argparse.ArgumentParser, quiet_help: str) -> None:
    """The arguments of a bench that starts launchers: --python (this
    repository's .venv, else this interpreter), --torchrun (None: next to
    --python, see :func:`parse_launcher_args`), --keep and --quiet."""
    default_python = os.path.join(ROOT, ".venv", "bin", "python")
    if not os.path.exists(default_python):
        default_python = sys.executable
    ap.add_argument("--python", default=default_python, help="interpreter for elasticd")
    ap.add_argument("--torchrun", default=None, help="torchrun (next to --python)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    ap.add_argument("--quiet", action="store_true", help=quiet_help)


def parse_launcher_args(ap: argparse.ArgumentParser, argv: list[str] | None
                        ) -> argparse.Namespace:
    """``ap.parse_args(argv)`` with --torchrun defaulted next to --python."""
    args = ap.parse_args(argv)
    if args.torchrun is None:
        args.torchrun = os.path.join(os.path.dirname(args.python), "torchrun")
    return args


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--runs", type=int, default=3,
                    help="worker-crash runs per launcher, case and script (3)")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"worker-crash cases, comma-separated ({','.join(CASES)})")
    ap.add_argument("--scripts", default=",".join(SCRIPTS),
                    help=f"worker-crash scripts, comma-separated ({','.join(SCRIPTS)})")
    ap.add_argument("--quick", action="store_true",
                    help="one run per row and shorter runs (about 7 minutes): a smoke test, not numbers")
    ap.add_argument("--json", metavar="FILE", help="write every run and the summary here")
    ap.add_argument("--only", action="append", choices=["crash", "frozen", "footprint"],
                    help="run only these parts (repeatable)")
    ap.add_argument("--default-runs", type=int, default=None,
                    help="runs of torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE (--runs)")
    ap.add_argument("--step-time", type=float, default=0.05, help="ddp.py --step-time (0.05)")
    ap.add_argument("--crash-bound", type=float, default=60.0,
                    help="give up on a crash recovery after this long (60 s)")
    ap.add_argument("--hang-bound", type=float, default=30.0,
                    help="torchrun (default): a run with no restarted step within this long "
                         "counts as a hang (30 s)")
    ap.add_argument("--frozen-runs", type=int, default=3, help="elasticd runs per lease TTL (3)")
    ap.add_argument("--node-faults", default="freeze,kill",
                    help="node faults of the frozen part, comma-separated (freeze,kill)")
    ap.add_argument("--frozen-torchrun-runs", type=int, default=1, help="torchrun runs (1)")
    ap.add_argument("--lease-ttls", default="5,2", help="elasticd --lease-ttl values (5,2)")
    ap.add_argument("--freeze-timeouts", default="default,0",
                    help="elasticd --freeze-timeout values of the frozen part, 'default' for "
                         "the flag not given, 0 for the lease alone (default,0)")
    ap.add_argument("--frozen-bound", type=float, default=60.0,
                    help="give up on a frozen-node recovery after this long (60 s)")
    ap.add_argument("--window", type=float, default=60.0, help="footprint CPU window (60 s)")
    ap.add_argument("--footprint-runs", type=int, default=3,
                    help="footprint runs per launcher and workload (3), judged on the median")
    ap.add_argument("--no-footprint-torchrun", dest="footprint_torchrun", action="store_false",
                    help="skip measuring torchrun's agent for comparison")
    ap.add_argument("--start-timeout", type=float, default=120.0,
                    help="bound on a job's start until it has trained 20 steps (120 s)")
    ap.add_argument("--warm-timeout", type=float, default=30.0,
                    help="bound on waiting for elasticd's warm workers before the fault (30 s)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="pause between 'ready' and the fault (1 s)")
    ap.add_argument("--stop-grace", type=float, default=10.0,
                    help="after SIGTERM to the launchers, SIGKILL what is left after this (10 s)")
    add_launcher_args(ap, "no per-run progress on stderr")
    args = parse_launcher_args(ap, argv)
    if args.quick:
        args.runs = min(args.runs, 1)
        args.frozen_runs = 1
        args.hang_bound = min(args.hang_bound, 20.0)
        args.frozen_bound = min(args.frozen_bound, 30.0)
        args.window = min(args.window, 8.0)
        args.footprint_runs = 1
        args.footprint_torchrun = False
        if args.default_runs is None:
            args.default_runs = 1
    if args.default_runs is None:
        args.default_runs = args.runs
    args.lease_ttls = [float(x) for x in str(args.lease_ttls).split(",") if x]
    args.freeze_timeouts = [x.strip() for x in str(args.freeze_timeouts).split(",") if x.strip()]
    args.cases = [c for c in args.cases.split(",") if c]
    args.node_faults = [c for c in args.node_faults.split(",") if c]
    args.scripts = [c for c in args.scripts.split(",") if c]
    unknown = (sorted(set(args.cases) - set(CASES)) + sorted(set(args.scripts) - set(SCRIPTS))
               + sorted(set(args.node_faults) - {"freeze", "kill"}))
    if unknown:
        print(f"recovery.py: unknown case or script {', '.join(unknown)} (cases: "
              f"{', '.join(CASES)}; scripts: {', '.join(SCRIPTS)})", file=sys.stderr)
        return 2
    for exe in (args.python, args.torchrun):
        if not os.access(exe, os.X_OK):
            print(f"recovery.py: {exe} is not executable (see --python, --torchrun)",
                  file=sys.stderr)
            return 2

    bench = Bench(args)
    interrupted = False

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _terminate)
    try:
        bench.log(f"scratch {bench.scratch}, tag {TAG_ENV}={bench.tag}")
        results = bench.run()
    except KeyboardInterrupt:
        interrupted = True
        results = bench.results
        results.setdefault("meta", {})
    finally:
        check = bench.finish()
    if interrupted:
        print(f"recovery.py: interrupted; cleanup: {check}", file=sys.stderr)
        return 130
    summary = summarize(results, args)
    print(render(results, summary, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=2, default=str)
    clean = not check["tagged_left_at_end"] and not check["pgrep_scratch"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
