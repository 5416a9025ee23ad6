"""The processes and records of one chaos run: node agents, step logs, checkpoint and events.

- :class:`NodeAgent`: one ``elasticd`` in a topology slot (``ip netns exec``),
  its output in a file; killed, frozen and started again by the faults. Its
  environment carries ``CHAOS_TAG`` (the run) and ``CHAOS_NODE`` (its node
  id), which its workers inherit: that is how the harness finds every
  process of a node and every process of the run.
- :class:`StepLog`: the workers' step lines (see ``tests/chaos/train.py``),
  read incrementally from the per-process files.
- :class:`CheckpointPoller`: a thread reading ``checkpoint/latest`` from etcd
  every 0.2 s, recording every value it saw (for "never goes back").
- :func:`read_events`: ``elasticctl events --json``, merged across calls (the
  job's history in etcd is a bounded ring per writer).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from elastic.failpoints import ENV_VAR as FAILPOINT_ENV
from elastic.keyspace import JobKeys
from tests.chaos.topology import REPO, TAG_ENV, Host
from tests.proctable import killed_with_this_process, pids_with_env

log = logging.getLogger(__name__)

NODE_ENV = "CHAOS_NODE"
TRAIN_SCRIPT = os.path.join(REPO, "tests", "chaos", "train.py")


def checkpoint_dir(workdir: str) -> str:
    """The checkpoint root of the run in ``workdir`` (every node shares it)."""
    return os.path.join(workdir, "checkpoints")


@dataclass(frozen=True)
class AgentSettings:
    """elasticd's options for the campaign (small timeouts: a 2-core machine, minutes)."""

    nnodes: str
    nproc: int = 2
    lease_ttl_s: float = 3.0
    hang_timeout_s: float = 4.0
    settle_s: float = 0.5
    stop_grace_s: float = 1.0
    start_timeout_s: float = 20.0
    join_timeout_s: float = 180.0
    exit_barrier_timeout_s: float = 60.0
    # The workers' ELASTIC_FAILPOINT: every rank sleeps after writing its shards, so each
    # save stays in flight long enough for a fault to crash a worker in its middle.
    worker_failpoints: str = "ckpt.mid_write=sleep:0.4"
    # Warm workers (elasticd's default). The fault-free reference run turns them off: it
    # restarts nothing, and on 2 cores its spare sets' torch imports only compete.
    prestart: bool = True
    # elasticd --memory-tier (on /dev/shm, its default root): the memory variant.
    memory_tier: bool = False


def node_pids(tag: str, node_id: str) -> list[int]:
    """Live processes of run ``tag`` whose environment says ``CHAOS_NODE=node_id``
    (the agent, its workers and warm workers)."""
    return pids_with_env(f"{TAG_ENV}={tag}", f"{NODE_ENV}={node_id}")


def signal_pids(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class NodeAgent:
    """One elasticd process (one incarnation): started in ``slot`` as ``node_id``."""

    def __init__(self, node_id: str, slot: Host, *, etcd: str, job_id: str, tag: str,
                 settings: AgentSettings, workdir: str, script_args: list[str],
                 incarnation: int = 0):
        self.node_id = node_id
        self.slot = slot
        self.tag = tag
        self.incarnation = incarnation
        self.log_path = os.path.join(workdir, "agents", f"{node_id}.{incarnation}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        s = settings
        self.args = dict(etcd=etcd, job_id=job_id, tag=tag, settings=settings, workdir=workdir,
                         script_args=script_args)
        cmd = [sys.executable, "-m", "agent.daemon", "--etcd", etcd, "--job-id", job_id,
               "--node-id", node_id, "--nnodes", s.nnodes, "--nproc-per-node", str(s.nproc),
               # In a namespace the agent finds its address itself (the route to etcd:
               # the host name resolves to loopback here) and its workers' interface.
               *(["--advertise-addr", slot.addr] if slot.netns is None else []),
               "--listen", f"{slot.addr}:0",
               "--lease-ttl", f"{s.lease_ttl_s:g}", "--hang-timeout", f"{s.hang_timeout_s:g}",
               "--settle", f"{s.settle_s:g}", "--stop-grace", f"{s.stop_grace_s:g}",
               "--start-timeout", f"{s.start_timeout_s:g}",
               "--join-timeout", f"{s.join_timeout_s:g}",
               "--exit-barrier-timeout", f"{s.exit_barrier_timeout_s:g}",
               "--max-restarts", "1000", "--connect-timeout", "10",
               *([] if s.prestart else ["--no-prestart"]),
               *(["--memory-tier"] if s.memory_tier else []),
               "--checkpoint-dir", checkpoint_dir(workdir),
               "--log-dir", os.path.join(workdir, "worker-logs", f"{node_id}.{incarnation}"),
               TRAIN_SCRIPT, *script_args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        env.update({TAG_ENV: tag, NODE_ENV: node_id, "PYTHONUNBUFFERED": "1"})
        if s.worker_failpoints:  # the agent passes its environment on to its workers
            env[FAILPOINT_ENV] = s.worker_failpoints
        with open(self.log_path, "ab") as out:
            # Spawned from the harness's main thread: PDEATHSIG follows the thread.
            self.proc = subprocess.Popen(slot.wrap(cmd), cwd=REPO, env=env,
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, preexec_fn=killed_with_this_process())
        self.started_at = time.time()
        self.killed = False  # by a fault: its exit code is not the job's outcome

    def again(self) -> "NodeAgent":
        """A new incarnation: the same node id, slot and options."""
        return NodeAgent(self.node_id, self.slot, incarnation=self.incarnation + 1, **self.args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.killed = True
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def tail(self, n: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = collections.deque(f, maxlen=n)
        except OSError:
            return ""
        return f"--- {self.node_id}.{self.incarnation} (pid {self.pid}):\n" + "".join(lines)


# ----------------------------------------------------------------------------- step logs

_STEP_FILE = re.compile(r"^r(\d+)-(.+)-rank(\d+)-(\d+)\.log$")


@dataclass(frozen=True)
class StepLine:
    t: float
    round: int
    rank: int
    world: int
    step: int
    node: str
    pid: int
    loss: str = ""  # float.hex of this rank's loss at this step


@dataclass
class RoundSpan:
    number: int
    world: int = 0
    first_t: float = float("inf")
    last_t: float = 0.0
    first_step: int = 1 << 62
    last_step: int = -1
    lines: int = 0
    ranks: dict = field(default_factory=dict)  # rank -> (node, pid, last step)


class StepLog:
    """Every step line of every worker so far; call :meth:`refresh` to read new lines."""

    def __init__(self, directory: str):
        self.dir = directory
        self.lines: list[StepLine] = []
        self.rounds: dict[int, RoundSpan] = {}
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()

    def refresh(self) -> None:
        with self._lock:
            try:
                names = os.listdir(self.dir)
            except FileNotFoundError:
                return
            for name in names:
                m = _STEP_FILE.match(name)
                if not m:
                    continue
                path = os.path.join(self.dir, name)
                offset = self._offsets.get(name, 0)
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except OSError:
                    continue
                end = data.rfind(b"\n") + 1  # a line being written is read next time
                self._offsets[name] = offset + end
                node, pid = m.group(2), int(m.group(4))
                for raw in data[:end].splitlines():
                    parts = raw.split()
                    if len(parts) != 6:
                        continue
                    t, loss = float(parts[0]), parts[5].decode()
                    rnd, rank, world, step = map(int, parts[1:5])
                    self._add(StepLine(t, rnd, rank, world, step, node, pid, loss))

    def _add(self, line: StepLine) -> None:
        self.lines.append(line)
        span = self.rounds.setdefault(line.round, RoundSpan(line.round))
        span.world = line.world
        span.first_t = min(span.first_t, line.t)
        span.last_t = max(span.last_t, line.t)
        span.first_step = min(span.first_step, line.step)
        span.last_step = max(span.last_step, line.step)
        span.lines += 1
        prev = span.ranks.get(line.rank)
        if prev is None or prev[2] < line.step:
            span.ranks[line.rank] = (line.node, line.pid, line.step)

    def latest_round(self) -> RoundSpan | None:
        self.refresh()
        return self.rounds[max(self.rounds)] if self.rounds else None

    def max_step(self) -> int:
        self.refresh()
        return max((s.last_step for s in self.rounds.values()), default=-1)

    def steps_since(self, t: float) -> list[StepLine]:
        self.refresh()
        return [ln for ln in self.lines if ln.t >= t]


# ----------------------------------------------------------------------------- etcd records


class CheckpointPoller:
    """Reads ``checkpoint/latest`` every ``interval_s`` in a thread; ``seen`` holds
    ``(time, step, round)`` each time the value changed, ``errors`` counts failed reads."""

    def __init__(self, endpoints: str, job_id: str, interval_s: float = 0.2):
        self.endpoints = endpoints
        self.key = JobKeys(job_id).checkpoint_latest
        self.interval_s = interval_s
        self.seen: list[tuple[float, int, int]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-poller", daemon=True)

    def start(self) -> "CheckpointPoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def latest(self) -> tuple[int, int] | None:
        """(step, round) of the newest value seen, None before the first commit."""
        seen = self.seen
        return seen[-1][1:] if seen else None

    def _run(self) -> None:
        from elastic.errors import ElasticError
        from elastic.store import open_store

        store = None
        last = None
        while not self._stop.wait(self.interval_s):
            try:
                if store is None:
                    store = open_store(self.endpoints, connect_timeout_s=2.0,
                                       request_timeout_s=1.0)
                kv = store.get(self.key, timeout_s=1.0)
            except ElasticError:
                self.errors += 1
                continue
            if kv is None:
                continue
            try:
                obj = json.loads(kv.value)
                value = (int(obj["step"]), int(obj["round"]))
            except (ValueError, KeyError, TypeError):
                self.errors += 1
                continue
            if value != last:
                self.seen.append((time.time(), *value))
                last = value
        if store is not None:
            store.close()


def read_events(endpoints: str, job_id: str, merged: dict) -> int:
    """Add ``elasticctl events --json`` (the newest 1000) to ``merged`` (keyed by
    content); returns elasticctl's exit code."""
    proc = subprocess.run(
        [sys.executable, "-m", "agent.ctl", "events", "--etcd", endpoints, "--job-id", job_id,
         "--json", "--limit", "1000", "--connect-timeout", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")})
    if proc.returncode == 0:
        for e in json.loads(proc.stdout):
            merged[(e["time"], e["node_id"], e["kind"], e["message"])] = e
    return proc.returncode


def elasticctl(endpoints: str, job_id: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent.ctl", *args, "--etcd", endpoints, "--job-id", job_id],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")})


def dump_python_stacks(pid: int, path: str, timeout_s: float = 30.0) -> bool:
    """Write every thread's Python stack of process ``pid`` to ``path``, through gdb
    (``faulthandler.dump_traceback`` called in the process); for an agent that
    stopped acting. Returns whether the file was written; False without gdb."""
    import shutil

    gdb = shutil.which("gdb")
    if gdb is None:
        return False
    code = ("import faulthandler\n"
            f"with open({path!r}, 'w') as f:\n"
            "    faulthandler.dump_traceback(file=f, all_threads=True)\n")
    script = code.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    try:
        subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set confirm off",
                        "-ex", "call (int)PyGILState_Ensure()",
                        "-ex", f'call (int)PyRun_SimpleString("{script}")',
                        "-ex", "call (void)PyGILState_Release($1)", "-ex", "detach"],
                       capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return False
    return os.path.exists(path)
