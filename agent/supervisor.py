"""The node agent's worker supervisor: start a round's workers, watch them, stop them.

Every worker runs ``python -u -m elastic.worker.bootstrap`` (see that module
for the protocol) in its own session and process group, so ``stop()`` reaches
the worker's children too. With ``prestart`` the supervisor keeps a pool of
*warm* workers that have already imported torch and wait for an assignment on
stdin; a round takes them (ready ones first) and the pool is filled again
(``warm_up``, ``warm_sets`` sets of ``nproc``), so a restart does not wait
for ``import torch``. A round takes a warm worker only if
it would see the same *startup* variables (``PYTHON*``, ``LD_*``, ``OMP_*``,
``TORCH_*``, ...: read when the interpreter or torch starts, too late to change
afterwards); otherwise that rank starts cold. The next warm set is started
with ``worker_env`` and the startup variables the last round set for all its
ranks (e.g. the ``OMP_NUM_THREADS=1`` of several workers per node), so from
the second round on they match even when the agent does not pass them in
``worker_env``.

Template: warm workers are *forked* from one template process per startup
environment (:mod:`elastic.worker.template`), which alone imports torch, so
replacing a used set costs milliseconds of CPU, not ``nproc`` imports.
Forked workers are the template's children: it reaps them and relays each
exit status over a socketpair (:mod:`agent.template_link`). Before the first
round, while the template imports, the warm workers are spawned and import on
their own, so the first round takes them, mid-import if need be, and is not
slower than without a template. Once a round started, the pool waits for the
template, and for a new one after it died or was replaced: replacements
spawned then would only serve a failure within the template's import, and
would import torch ``nproc`` more times beside the round's start. A template
that finds forking unsafe (a preloaded module left a thread running, or
used the CUDA driver) says so, is logged once, and every warm worker is spawned
from then on. A template with other startup variables than the next warm set
needs is retired: no more forks, killed once its last fork has ended (its
death kills its forks: PDEATHSIG). If a template dies, its forks die with it;
those of a round are reported killed, the pool is refilled from a new
template, and the death counts toward WARM_FAILURE_LIMIT.

Threads: processes are spawned only by one long-lived spawner thread, because
Linux sends a child's ``PR_SET_PDEATHSIG`` when the *thread* that forked it
ends, not the process; callers may use any thread. Each worker has two output
readers, a reader of its bootstrap's status pipe and a waiter that reaps it
the moment it exits (a fork: when its template relays the exit) and calls
``on_exit`` (from that waiter thread: ``on_exit``
should only hand the exit over, e.g. to a queue; calling stop() from it works
but holds up other exits until that stop() returns).

Never imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

import elastic
from agent import localfiles
from agent.console import ConsoleFilter
from agent.template_link import (ForkedProcess, MalformedMessage, RetiredAndIdle, TemplateEvent,
                                 TemplateLink, TemplateReady, TemplateUnsafe)
from elastic import errorfile
from elastic.errors import ConfigError, WorkerSpawnError
from elastic.joblog import JobLogger
# Neither imports torch (nor anything heavy): the agent stays light.
from elastic.worker.bootstrap import PARENT_PID_ENV, PRELOAD_ENV, STATUS_FD_ENV
from elastic.worker.template import TEMPLATE_ENV, TEMPLATE_FD_ENV

log = logging.getLogger(__name__)

BOOTSTRAP_MODULE = "elastic.worker.bootstrap"

WARM_FAILURE_LIMIT = 3  # consecutive deaths of unassigned warm workers before going cold
# Variables read when the interpreter, the dynamic loader, OpenMP/MKL or torch start.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                        "TORCH_", "PYTORCH_")
_KILL_WAIT_S = 3.0  # after SIGKILL: only a process stuck in the kernel takes longer
_OUTPUT_DRAIN_S = 0.2  # how long on_exit waits for a dead worker's last lines
_CALLBACK_WAIT_S = 2.0  # how long stop() waits for on_exit of the workers it stopped
_SPAWN_TIMEOUT_S = 30.0
_WARM_TAIL_LINES = 50  # output kept from a warm worker before it has a log file
_POLL_S = 0.02
_FORK_TIMEOUT_S = 10.0  # a fork costs ~10 ms of CPU; this is for a node loaded to a crawl


@dataclass(frozen=True)
class Entrypoint:
    """What every worker runs: a script path or a module name (exactly one), and its arguments.

    ``no_python``: ``script`` is a program the worker executes in its place
    (torchrun's ``--no-python``). Raises ValueError if neither or both of
    ``script`` and ``module`` are given, or ``no_python`` with a module.
    """

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()
    no_python: bool = False

    def __post_init__(self) -> None:
        if (self.script is None) == (self.module is None):
            raise ValueError("an entrypoint needs exactly one of script and module")
        if self.no_python and self.module is not None:
            raise ValueError("a module is run by python: no_python needs a script")
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))


@dataclass(frozen=True)
class WorkerExit:
    """How one worker of a round ended.

    ``exit_code`` is the process's exit status, or 128 + the signal number
    (as a shell reports it) when ``signal`` is set. ``at`` is
    ``time.monotonic()`` when it was reaped. ``stopped`` is true when the exit
    follows ``stop()``: not a failure of the worker.
    """

    round: int
    local_rank: int
    rank: int
    pid: int
    exit_code: int
    signal: int | None
    at: float
    stopped: bool = False
    log_path: str = ""  # the rank's log of this round
    error_file: str = ""  # its TORCHELASTIC_ERROR_FILE (elastic.errorfile), if it wrote one


def rank_files(log_dir: str, round_number: int, rank: int) -> tuple[str, str]:
    """The log and the error file (``TORCHELASTIC_ERROR_FILE``) of ``rank`` in a round."""
    round_dir = os.path.join(log_dir, f"round-{round_number}")
    return (os.path.join(round_dir, f"rank-{rank}.log"),
            os.path.join(round_dir, f"rank-{rank}.error.json"))


class WorkerStatus(NamedTuple):
    """One worker of the current (or last) round, for status reports."""

    local_rank: int
    rank: int
    pid: int
    alive: bool


class WarmStatus(NamedTuple):
    """One warm worker; ``ready`` once it has imported what it preloads."""

    pid: int
    ready: bool


@dataclass(eq=False)
class _Worker:
    """One child process, warm (no round yet) or assigned to a round; ``proc`` is a
    Popen for a spawned one, a :class:`ForkedProcess` for one forked by a template."""

    proc: subprocess.Popen | ForkedProcess
    startup_env: dict[str, str]  # what the interpreter started with, less the bootstrap's own
    status_fd: int  # -1: none (a fork is ready at birth; a template uses its socket)
    lock: threading.Lock = field(default_factory=threading.Lock)
    label: str = "warm"
    round: int | None = None
    local_rank: int = -1
    rank: int = -1
    ready: bool = False
    exited: bool = False
    discarded: bool = False  # killed by the supervisor while warm: not a failure
    stop_requested: bool = False
    exit: WorkerExit | None = None
    log_file: object | None = None
    open_streams: int = 2
    pending: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=_WARM_TAIL_LINES))
    reaped: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # on_exit has returned
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def assigned(self) -> bool:
        return self.round is not None


@dataclass(eq=False)
class _Template:
    """One template process (:mod:`elastic.worker.template`): ``worker`` carries
    its Popen and output (label ``template``), ``link`` its socket and children.
    ``ready``: it may fork (set under the supervisor's lock). ``discarded``: its
    death is not a failure. Once retired (``link.retired``) it forks no more and
    is killed when its last child has ended (killing it earlier would kill them:
    PDEATHSIG).
    """

    worker: _Worker
    link: TemplateLink
    started: float
    ready: bool = False
    discarded: bool = False

    @property
    def pid(self) -> int:
        return self.worker.pid

    @property
    def startup_env(self) -> dict[str, str]:
        return self.worker.startup_env

    @property
    def usable(self) -> bool:
        return self.ready and not self.link.dead and not self.link.retired


@dataclass(frozen=True)
class _Slot:
    """The place of one worker in a round."""

    round: int
    local_rank: int
    rank: int


@dataclass(eq=False)
class _Round:
    number: int
    workers: list[_Worker]
    stopped: bool = False


class _Spawner:
    """A long-lived thread that runs every spawn, so PDEATHSIG never fires while the agent lives."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        """Queue ``fn(*args)``; raises RuntimeError once closed."""
        if self._closed:
            raise RuntimeError("the spawner thread has been closed")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def run_queued(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what is queued now has run; the thread lives on."""
        if threading.current_thread() is self._thread:
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            self.submit(lambda: None).result(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Run what is queued, then end the thread."""
        self._closed = True
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)


def _startup_differences(a: dict[str, str], b: dict[str, str]) -> list[str]:
    keys = {k for k in (*a, *b) if k.startswith(STARTUP_ENV_PREFIXES)}
    return sorted(k for k in keys if a.get(k) != b.get(k))


def signal_worker(pid: int, sig: int) -> None:
    """Signal a worker's process group, which may outlive its leader (the worker's
    children); a worker that has no group of its own yet gets the signal alone.

    A template answers a fork before its child has called setsid(), so for a
    moment a forked worker is not yet the leader of the group its pid names:
    signalling only the group then missed it (a warm worker discarded right
    after its fork lived on until its template died, and was left a zombie).

    Once the leader is reaped and the group empty, its id could in principle name a new
    group; pids cycle through the whole pid space before that, and stop() signals only
    groups of the round it is stopping, so the window is the few seconds of one stop().
    """
    try:
        os.killpg(pid, sig)
        return
    except PermissionError:
        return  # its id was reused by someone else's group
    except ProcessLookupError:
        pass  # no such group: gone, or not made yet
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan nobody reaps stays one)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[:1] not in ([b"Z"], [b"X"])


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies do not count: a
    container's PID 1 may never reap orphans)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


class WorkerSupervisor:
    """Starts, watches and stops the ``nproc`` workers of this node, one round at a time.

    ``on_exit`` gets a :class:`WorkerExit` for every assigned worker that ends,
    from a supervisor thread, promptly (the reaping is immediate; the call waits
    at most 0.2 s for the worker's last output). Warm workers that die before
    they get a round are replaced, not reported. Output of every worker goes to
    ``sys.stdout`` line by line as ``[rank R]: line`` (``[warm]: `` before it
    has a round) and to ``log_dir/round-<N>/rank-<R>.log`` as ``stdout: line``
    or ``stderr: line``.

    ``worker_env`` holds variables every worker gets in every round, on top of
    ``os.environ`` (``OMP_NUM_THREADS`` and the like): warm workers start with
    them, so even the first round can use warm workers when it sets startup
    variables. ``start_round``'s environments are added on top of both.
    ``console`` says which lines reach ``sys.stdout`` (torchrun's
    ``--redirects`` and ``--local-ranks-filter``); the log files get every line.
    """

    def __init__(self, *, job_id: str, node_id: str, nproc: int, entrypoint: Entrypoint,
                 log_dir: str, stop_grace_s: float = 5.0, prestart: bool = True,
                 warm_sets: int = 1, on_exit: Callable[[WorkerExit], None] | None = None,
                 python: str = sys.executable, worker_env: Mapping[str, str] | None = None,
                 console: ConsoleFilter = ConsoleFilter()):
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must not be negative, got {stop_grace_s}")
        if warm_sets < 1:
            raise ValueError(f"warm_sets must be at least 1, got {warm_sets}")
        self.job_id = job_id
        self.node_id = node_id
        self.nproc = nproc
        self.entrypoint = entrypoint
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.prestart = prestart
        self.warm_sets = warm_sets
        self.python = python
        self.worker_env = dict(worker_env or {})
        self.console = console
        self._on_exit = on_exit
        # The bootstrap runs with -m from here, so it imports even if elastic is not installed.
        self._package_root = os.path.dirname(os.path.dirname(os.path.abspath(elastic.__file__)))
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()  # one stop() at a time; a second waits, then no-ops
        self._echo_lock = threading.Lock()
        self._warm: list[_Worker] = []
        self._round: _Round | None = None
        self._live: set[_Worker] = set()  # spawned, and their threads not all done
        self._pid_history: list[int] = []
        self._learned_env: dict[str, str] = {}  # startup variables the last round set everywhere
        self._warm_failures = 0
        self._warm_disabled = False
        self._template: _Template | None = None  # the one new warm workers are forked from
        self._templates: list[_Template] = []  # every live one, retired ones included
        self._fork_disabled = False  # a template found forking unsafe: spawn, for good
        self._closed = False
        self._spawner = _Spawner(f"elastic-spawner-{node_id}")
        # Lines about no round in particular (warm workers) name the latest one started.
        self.log = JobLogger(log, job_id, node_id,
                             lambda: self._round.number if self._round is not None else 0)

    # ------------------------------------------------------------ public API

    @property
    def warm_enabled(self) -> bool:
        """Whether rounds take warm workers (prestart on, and warm workers not failing)."""
        return self.prestart and not self._warm_disabled

    def warm_up(self) -> None:
        """Start warm workers until ``warm_sets * nproc`` are warm; returns at once (they
        warm in the background). Does nothing without prestart, after repeated warm
        failures, or after shutdown(). Takes no lock (the pool fill checks again), so
        a template's thread may call it while the spawner waits for its answer."""
        if not self.warm_enabled or self._closed:
            return
        try:
            self._spawner.submit(self._fill_warm_pool)
        except RuntimeError:
            return

    def start_round(self, round_number: int, envs: list[dict[str, str]]) -> None:
        """Start one worker per local rank; ``envs[i]`` is added to ``os.environ`` for local rank i.

        Returns once every worker process exists (not once the scripts run).
        The next warm set is forked from the template at once when it is ready
        (warm at birth), else as soon as it is; without a template (forking
        unsafe) it is spawned and imports at the lowest CPU and I/O priority
        (:mod:`elastic.worker.priority`), taking only what this round's start
        leaves, so a failure in the round's first seconds finds it partly warm.
        Raises ValueError if ``len(envs) != nproc``, RuntimeError if a worker of the
        previous round is still alive (call stop() first) or after shutdown(),
        WorkerSpawnError if a process or the round's log directory cannot be created
        (the workers already started then belong to the round: stop() ends them).
        Call start_round and stop from one thread (the agent's loop).
        """
        if len(envs) != self.nproc:
            raise ValueError(f"start_round needs {self.nproc} environments, got {len(envs)}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the supervisor has been shut down")
            previous = self._round
        if previous is not None and not previous.stopped:
            alive = [w.pid for w in previous.workers if not w.exited]
            if alive:
                raise RuntimeError(f"round {previous.number} still has live workers {alive}; "
                                   f"stop() it before starting round {round_number}")
            self.stop()  # its workers are gone; this only sweeps what they left behind
        future = self._spawner.submit(self._start_round_now, round_number,
                                      [dict(e) for e in envs])
        try:
            future.result(timeout=_SPAWN_TIMEOUT_S)
        except TimeoutError as exc:
            raise WorkerSpawnError(f"round {round_number}: workers were not started within "
                                   f"{_SPAWN_TIMEOUT_S:.0f} s") from exc
        self.warm_up()

    def stop(self, timeout_s: float | None = None) -> list[WorkerExit]:
        """Stop the current round's workers and everything in their process groups.

        SIGTERM (and SIGCONT, so a stopped process sees it) to every worker's
        group, up to ``timeout_s`` (default ``stop_grace_s``) to exit, then
        SIGKILL. Returns the exit of every worker of the round in local-rank
        order, once all are reaped and their ``on_exit`` calls have returned
        (bounded: grace + a few seconds). Returns [] if no round is running.
        """
        grace_s = self.stop_grace_s if timeout_s is None else timeout_s
        with self._stop_lock:
            with self._lock:
                rnd = self._round
                if rnd is None or rnd.stopped:
                    return []
                rnd.stopped = True
                workers = list(rnd.workers)
            running = 0
            for w in workers:
                with w.lock:
                    w.stop_requested = True
                    running += not w.exited
            self.log.at_round(rnd.number).info("stopping %d running workers (grace %.1f s).",
                                               running, grace_s)
            started = time.monotonic()
            for w in workers:
                signal_worker(w.pid, signal.SIGTERM)
                signal_worker(w.pid, signal.SIGCONT)
            if not self._wait_quiet(workers, started + grace_s):
                stubborn = [w.rank for w in workers if not w.exited or _group_alive(w.pid)]
                self.log.at_round(rnd.number).warning("workers of ranks %s (or their children) "
                            "outlived the %.1f s grace period; killing them.", stubborn, grace_s)
                for w in workers:
                    signal_worker(w.pid, signal.SIGKILL)
                if not self._wait_quiet(workers, time.monotonic() + _KILL_WAIT_S):
                    self.log.at_round(rnd.number).error("processes of ranks %s survived SIGKILL "
                              "for %.0f s (stuck in the kernel?).",
                              [w.rank for w in workers if not w.reaped.is_set()],
                              _KILL_WAIT_S)
            me = threading.current_thread()
            deadline = time.monotonic() + _CALLBACK_WAIT_S
            for w in workers:
                if me not in w.threads:
                    w.done.wait(max(0.0, deadline - time.monotonic()))
            self.log.at_round(rnd.number).info("workers stopped in %.2f s.",
                                               time.monotonic() - started)
            return [w.exit for w in workers if w.exit is not None]

    def shutdown(self) -> None:
        """stop(), then kill the warm pool and end the supervisor's threads. Idempotent;
        afterwards no process this supervisor started is alive (bounded wait)."""
        with self._lock:
            already = self._closed
            self._closed = True
        if not already:
            self._spawner.run_queued(_SPAWN_TIMEOUT_S)  # a start_round in progress finishes
        self.stop()
        with self._lock:
            warm, self._warm = self._warm, []
        for w in warm:
            with w.lock:
                w.discarded = True
            signal_worker(w.pid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_WAIT_S
        for w in warm:
            w.done.wait(max(0.0, deadline - time.monotonic()))
        # Last: a template's death kills whatever it forked that is still alive, and
        # they are nobody's to reap then. Only now may the spawner thread end, since
        # its end kills the templates (PDEATHSIG).
        with self._lock:
            templates, self._templates, self._template = self._templates, [], None
        for tpl in templates:
            self._kill_template(tpl)
        deadline = time.monotonic() + _KILL_WAIT_S
        for tpl in templates:
            tpl.worker.done.wait(max(0.0, deadline - time.monotonic()))
        if not already:
            self._spawner.close(_SPAWN_TIMEOUT_S)
        with self._lock:
            live = list(self._live)
        for w in live:
            for t in w.threads:
                if t is not threading.current_thread():
                    t.join(max(0.0, deadline - time.monotonic()))
        if not already:
            self.log.info("worker supervisor shut down.")

    def workers(self) -> list[WorkerStatus]:
        """The workers of the current round (or of the last one, once stopped), by local rank."""
        with self._lock:
            rnd = self._round
        if rnd is None:
            return []
        return [WorkerStatus(w.local_rank, w.rank, w.pid, not w.exited) for w in rnd.workers]

    def warm_workers(self) -> list[WarmStatus]:
        """The warm workers waiting for a round."""
        with self._lock:
            return [WarmStatus(w.pid, w.ready) for w in self._warm if not w.exited]

    def warm_template(self) -> WarmStatus | None:
        """The template new warm workers are forked from (``ready`` once it may fork),
        or None: none started yet, being replaced, or forking found unsafe."""
        with self._lock:
            tpl = self._template
            if tpl is None or tpl.link.dead or tpl.link.retired:
                return None
            return WarmStatus(tpl.pid, tpl.ready)

    def pids(self) -> list[int]:
        """Every process this supervisor has started (templates and their forks
        included), warm or not, alive or not, in order."""
        with self._lock:
            return list(self._pid_history)

    # ------------------------------------------------------------ spawner thread only

    def _fill_warm_pool(self) -> None:
        """Fork the missing warm workers from the template. While it is still
        importing, spawn them only before the first round (which takes them);
        once a round started, leave them to the template, which fills the pool
        in milliseconds once ready (this runs again then). Without a template
        (forking is off, or it cannot start) spawn them."""
        with self._lock:
            if not self.warm_enabled or self._closed:
                return
            missing = self.warm_sets * self.nproc - sum(1 for w in self._warm if not w.exited)
            env = {**self._base_env(), **self._learned_env}
            tpl = self._template_for(env)
            if tpl is not None and not tpl.ready and self._round is not None:
                # Spawned now, they would import torch beside the template and the
                # round's workers, for a failure within the template's import only.
                return
            forked: list[int] = []
            started = time.monotonic()
            for _ in range(missing):
                try:
                    if tpl is not None and tpl.usable:
                        try:
                            self._warm.append(self._fork(tpl))
                            forked.append(self._warm[-1].pid)
                            continue
                        except WorkerSpawnError as exc:
                            self.log.warning("template pid %d could not fork a warm worker "
                                             "(%s); spawning it instead.", tpl.pid, exc)
                            tpl = None
                    self._warm.append(self._spawn(env, preload=None))
                except WorkerSpawnError as exc:
                    self.log.warning("could not start a warm worker: %s", exc)
                    return
            if forked:
                self.log.debug("forked warm workers %s from template pid %d in %.3f s.",
                               forked, self._templates[-1].pid if self._templates else -1,
                               time.monotonic() - started)

    def _template_for(self, env: dict[str, str]) -> _Template | None:
        """The template to fork warm workers with ``env`` from, started if needed
        (caller holds self._lock, on the spawner thread). One with other startup
        variables is retired. None when forking is off or no template can start."""
        if self._fork_disabled:
            return None
        tpl = self._template
        if tpl is not None and (tpl.link.dead or _startup_differences(tpl.startup_env, env)):
            self._template = None
            self._retire_template(tpl)
            tpl = None
        if tpl is None:
            try:
                tpl = self._template = self._spawn_template(env)
            except WorkerSpawnError as exc:
                self.log.warning("could not start a template for warm workers: %s", exc)
                return None
        return tpl

    def _spawn_template(self, env: dict[str, str]) -> _Template:
        """Start a template process (caller holds self._lock, on the spawner thread:
        its PDEATHSIG follows that thread). Raises WorkerSpawnError."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # TEMPLATE_ENV keeps torch.cuda.is_available() in the preload off the CUDA
        # driver, whose use would make every fork unable to use CUDA.
        child_env = {**env, **TEMPLATE_ENV}
        child_env[TEMPLATE_FD_ENV] = str(theirs.fileno())
        child_env[PARENT_PID_ENV] = str(os.getpid())
        try:
            proc = subprocess.Popen(
                [self.python, "-u", "-m", BOOTSTRAP_MODULE], cwd=self._package_root,
                env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(theirs.fileno(),))
        except OSError as exc:
            ours.close()
            raise WorkerSpawnError(f"cannot start {self.python} -m {BOOTSTRAP_MODULE}: "
                                   f"{exc}") from exc
        finally:
            theirs.close()
        w = _Worker(proc=proc, startup_env=dict(env), status_fd=-1, label="template")
        tpl = _Template(worker=w, link=TemplateLink(ours), started=time.monotonic())
        w.threads = [
            threading.Thread(target=self._pump, args=(w, proc.stdout, "stdout"),
                             name=f"elastic-template-{proc.pid}-stdout", daemon=True),
            threading.Thread(target=self._pump, args=(w, proc.stderr, "stderr"),
                             name=f"elastic-template-{proc.pid}-stderr", daemon=True),
            threading.Thread(target=self._serve_template, args=(tpl,),
                             name=f"elastic-template-{proc.pid}", daemon=True),
        ]
        for t in w.threads:
            t.start()
        self._templates.append(tpl)
        self._live.add(w)
        self._pid_history.append(proc.pid)
        return tpl

    def _fork(self, tpl: _Template) -> _Worker:
        """Have ``tpl`` fork a warm worker (caller holds self._lock, on the spawner
        thread). Raises WorkerSpawnError if it refuses, dies or does not answer."""
        try:
            proc = tpl.link.fork(_FORK_TIMEOUT_S)
        except WorkerSpawnError as exc:
            raise WorkerSpawnError(f"template pid {tpl.pid} {exc}") from exc
        w = _Worker(proc=proc, startup_env=dict(tpl.startup_env), status_fd=-1, ready=True)
        self._track(w, status_pipe=False)  # a fork is ready at once: no status to read
        return w

    def _retire_template(self, tpl: _Template) -> None:
        """No more forks from ``tpl``; it is killed once its last child has ended."""
        tpl.discarded = True
        if tpl.link.retire():
            self._kill_template(tpl)

    @staticmethod
    def _kill_template(tpl: _Template) -> None:
        tpl.discarded = True
        signal_worker(tpl.pid, signal.SIGKILL)

    # ------------------------------------------------------------ template thread

    def _serve_template(self, tpl: _Template) -> None:
        """Follow ``tpl`` until it dies (:meth:`TemplateLink.serve`); then reap it
        and end its children's watch."""
        w = tpl.worker
        orphans: list[ForkedProcess] = []
        try:
            orphans = tpl.link.serve(lambda event: self._on_template_event(tpl, event))
        finally:
            self._on_template_death(tpl, orphans)
            for t in w.threads[:2]:
                t.join(_OUTPUT_DRAIN_S)
            w.done.set()
            for t in w.threads[:2]:
                t.join()
            with self._lock:
                self._live.discard(w)

    def _on_template_event(self, tpl: _Template, event: TemplateEvent) -> None:
        # Once tpl is ready the spawner may hold self._lock while it waits in
        # tpl.link.fork() for an answer only this thread delivers: after "ready",
        # this thread takes self._lock only where no fork can be waiting
        # (forking unsafe: the link failed the fork first).
        match event:
            case RetiredAndIdle():
                self._kill_template(tpl)
            case TemplateUnsafe(reason=reason):
                with self._lock:
                    first = not self._fork_disabled
                    self._fork_disabled = True
                    if self._template is tpl:
                        self._template = None
                if first:
                    self.log.warning("forking warm workers from a template is unsafe here "
                                     "(%s); every warm worker is spawned and imports on its "
                                     "own from now on.", reason)
                self._retire_template(tpl)
                self.warm_up()  # what was left to this template
            case TemplateReady():
                with self._lock:  # no fork is asked of tpl before this
                    self._warm_failures = 0
                    tpl.ready = True
                self.log.info("template pid %d is ready to fork warm workers (imported in "
                              "%.1f s).", tpl.pid, time.monotonic() - tpl.started)
                self.warm_up()
            case MalformedMessage(data=data):
                self.log.warning("template pid %d sent a malformed message: %r", tpl.pid,
                                 data[:200])

    def _on_template_death(self, tpl: _Template, orphans: list[ForkedProcess]) -> None:
        """Reap ``tpl``; the forks it leaves died with it (PDEATHSIG): report them
        killed once they are gone. An unrequested death is a warm failure."""
        returncode = tpl.worker.proc.wait()
        deadline = time.monotonic() + _KILL_WAIT_S
        for proc in orphans:
            while _process_running(proc.pid) and time.monotonic() < deadline:
                time.sleep(_POLL_S / 4)
            proc.ended(-signal.SIGKILL, collateral=True)
        with self._lock:
            if tpl in self._templates:
                self._templates.remove(tpl)
            if self._template is tpl:
                self._template = None
            if tpl.discarded or self._closed:
                return
            self._warm_failures += 1
            failures = self._warm_failures
        with tpl.worker.lock:
            tail = " | ".join(text for _, text in list(tpl.worker.pending)[-5:])
        self.log.warning("template pid %d died with status %d%s (its last output: %s); %d "
                         "workers it forked died with it.", tpl.pid, returncode,
                         "" if tpl.ready else " before it was ready", tail or "none",
                         len(orphans))
        if failures >= WARM_FAILURE_LIMIT:
            self._give_up_warm(failures)
            return
        self.warm_up()

    def _start_round_now(self, number: int, envs: list[dict[str, str]]) -> None:
        round_dir = os.path.dirname(rank_files(self.log_dir, number, 0)[0])
        try:
            # Private (0700, never through a link): see agent.localfiles.
            localfiles.ensure_dir(self.log_dir, "the log directory")
            localfiles.private_subdir(self.log_dir, os.path.basename(round_dir))
        except (OSError, ConfigError) as exc:
            raise WorkerSpawnError(f"cannot create the log directory {round_dir}: {exc}") from exc
        base = self._base_env()
        rnd = _Round(number, [])
        with self._lock:
            warm = [w for w in self._warm if not w.exited] if self.warm_enabled else []
            self._warm = [w for w in self._warm if w not in warm]
        # Ready ones first: with more than one set, a restart soon after the last one
        # takes the set that finished importing, not the one still warming.
        warm.sort(key=lambda w: not w.ready)
        differing: set[str] = set()  # startup variables that made warm workers unusable
        cold_ranks: list[int] = []
        unready = 0  # warm workers taken before they finished importing
        started = time.monotonic()
        try:
            for local_rank, extra in enumerate(envs):
                slot = _Slot(number, local_rank, int(extra.get("RANK", local_rank)))
                error_file = rank_files(self.log_dir, number, slot.rank)[1]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(error_file)  # a stale one would name another failure's cause
                env = {**base, **extra, errorfile.ENV_VAR: error_file}
                assignment = {"env": env, "argv": list(self.entrypoint.args),
                              "script": self.entrypoint.script,
                              "module": self.entrypoint.module, "cwd": os.getcwd(),
                              "no_python": self.entrypoint.no_python}
                line = (json.dumps(assignment) + "\n").encode()
                worker = None
                while warm and worker is None:
                    candidate = warm.pop(0)
                    differ = _startup_differences(candidate.startup_env, env)
                    if differ:
                        differing.update(differ)
                        self._discard(candidate)
                    elif self._assign_warm(candidate, slot, line):
                        worker = candidate
                        unready += not candidate.ready
                if worker is None:
                    with self._lock:
                        worker = self._spawn(env, preload="", slot=slot)
                    self._send(worker, line)
                    cold_ranks.append(slot.rank)
                rnd.workers.append(worker)
        finally:
            # Even after a failed spawn the round owns what it started, so stop() ends it.
            with self._lock:
                self._warm = warm + self._warm  # more warm than ranks: keep the rest
                self._round = rnd
        with self._lock:
            if self.prestart:
                common = None
                for extra in envs:
                    mine = {k: v for k, v in extra.items() if k.startswith(STARTUP_ENV_PREFIXES)}
                    common = mine if common is None else {
                        k: v for k, v in common.items() if mine.get(k) == v}
                self._learned_env = common or {}
        if cold_ranks and differing:
            self.log.at_round(number).info("ranks %s start cold: the round changes %s, which "
                     "the warm workers read when they started; the next warm workers start with "
                     "the new values.", cold_ranks,
                     ", ".join(sorted(differing)))
        elif cold_ranks and self.warm_enabled:
            self.log.at_round(number).info("ranks %s start cold: no warm worker was left.",
                                           cold_ranks)
        self.log.at_round(number).info("started %d workers (pids %s, %d cold, %d warm but "
                 "still importing) in %.3f s.", len(rnd.workers), [w.pid for w in rnd.workers],
                 len(cold_ranks), unready,
                 time.monotonic() - started)

    def _spawn(self, env: dict[str, str], preload: str | None,
               slot: _Slot | None = None) -> _Worker:
        """Start a bootstrap process (caller holds self._lock, on the spawner thread).

        ``preload`` None keeps the bootstrap's default (a warm worker); "" imports
        nothing ahead (a cold one, whose script imports what it needs itself).
        With ``slot`` the worker belongs to that round from the start, so even an
        instant death is reported as the rank's exit."""
        read_fd, write_fd = os.pipe()
        child_env = dict(env)
        child_env[STATUS_FD_ENV] = str(write_fd)
        child_env[PARENT_PID_ENV] = str(os.getpid())
        if preload is not None:
            child_env[PRELOAD_ENV] = preload
        try:
            proc = subprocess.Popen(
                [self.python, "-u", "-m", BOOTSTRAP_MODULE], cwd=self._package_root,
                env=child_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, pass_fds=(write_fd,))
        except OSError as exc:
            os.close(read_fd)
            raise WorkerSpawnError(f"cannot start {self.python} -m {BOOTSTRAP_MODULE}: "
                                   f"{exc}") from exc
        finally:
            os.close(write_fd)
        startup_env = dict(env)
        if preload is not None:
            startup_env[PRELOAD_ENV] = preload
        w = _Worker(proc=proc, startup_env=startup_env, status_fd=read_fd)
        if slot is not None:
            self._bind(w, slot)
        self._track(w, status_pipe=True)
        return w

    def _track(self, w: _Worker, *, status_pipe: bool) -> None:
        """Start ``w``'s output pumps and waiter (and the reader of its status pipe, if it
        has one), and count it as spawned (caller holds self._lock)."""
        pid = w.proc.pid
        w.threads = [
            threading.Thread(target=self._pump, args=(w, w.proc.stdout, "stdout"),
                             name=f"elastic-worker-{pid}-stdout", daemon=True),
            threading.Thread(target=self._pump, args=(w, w.proc.stderr, "stderr"),
                             name=f"elastic-worker-{pid}-stderr", daemon=True),
            threading.Thread(target=self._watch, args=(w,),
                             name=f"elastic-worker-{pid}-waiter", daemon=True),
        ]
        if status_pipe:
            # Apart from the waiter: a child that inherited the status pipe must not delay
            # the news of the worker's exit.
            w.threads.append(threading.Thread(target=self._read_status, args=(w,),
                                              name=f"elastic-worker-{pid}-status", daemon=True))
        for t in w.threads:
            t.start()
        self._live.add(w)
        self._pid_history.append(w.pid)

    def _bind(self, w: _Worker, slot: _Slot) -> None:
        """Make ``w`` the worker of ``slot`` (caller holds ``w.lock`` or owns ``w`` alone)."""
        w.round, w.local_rank, w.rank, w.label = slot.round, slot.local_rank, slot.rank, \
            f"rank {slot.rank}"
        path = rank_files(self.log_dir, slot.round, slot.rank)[0]
        try:
            w.log_file = localfiles.open_log(path)
            for stream, text in w.pending:  # what it printed while warm (torch's warnings)
                w.log_file.write(f"{stream}: {text}\n")
            w.log_file.flush()
        except OSError as exc:
            self.log.at_round(slot.round).warning("cannot write the log of rank %d to %s: %s",
                                                  slot.rank, path, exc)
            w.log_file = None
        w.pending.clear()
        self._close_log_if_done(w)

    def _assign_warm(self, w: _Worker, slot: _Slot, line: bytes) -> bool:
        """Give warm ``w`` its round; False if it died before it could take it."""
        with w.lock:
            if w.exited:
                return False
            self._bind(w, slot)
        if self._send(w, line):
            return True
        with w.lock:
            if w.exit is not None:
                return True  # already reported as the rank's exit: it stays the rank's worker
            # Its death will be handled as a warm worker's, not as a failure of the round.
            w.round, w.label = None, "warm"
            if w.log_file is not None:
                w.log_file.close()
                w.log_file = None
        return False

    @staticmethod
    def _send(w: _Worker, line: bytes) -> bool:
        """Write the assignment to ``w``'s stdin; False if it is no longer reading."""
        try:
            w.proc.stdin.write(line)
            w.proc.stdin.close()
        except OSError:  # BrokenPipeError: it died (or is dying) before reading it
            try:
                w.proc.stdin.close()
            except (OSError, ValueError):
                pass
            return False
        return True

    def _discard(self, w: _Worker) -> None:
        with w.lock:
            w.discarded = True
        signal_worker(w.pid, signal.SIGKILL)

    # ------------------------------------------------------------ per-worker threads

    def _pump(self, w: _Worker, stream, name: str) -> None:
        """Copy one output stream of ``w`` to the agent's stdout and the rank's log file."""
        try:
            for raw in iter(lambda: stream.readline(65536), b""):
                text = raw.decode("utf-8", "replace").rstrip("\n")
                with w.lock:
                    label = w.label
                    shown = self.console.shows(w.local_rank if w.assigned else None, name)
                    if w.log_file is not None:
                        try:
                            w.log_file.write(f"{name}: {text}\n")
                            w.log_file.flush()
                        except (OSError, ValueError):
                            pass
                    elif not w.assigned:
                        w.pending.append((name, text))
                if shown:
                    self._echo(f"[{label}]: {text}\n")
        finally:
            stream.close()
            with w.lock:
                w.open_streams -= 1
                self._close_log_if_done(w)

    @staticmethod
    def _close_log_if_done(w: _Worker) -> None:
        if w.open_streams == 0 and w.log_file is not None:
            try:
                w.log_file.close()
            except OSError:
                pass
            w.log_file = None

    def _echo(self, line: str) -> None:
        out = sys.stdout
        if out is None:
            return
        with self._echo_lock:
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass  # the agent's stdout is closed or full; the log file still has it

    def _watch(self, w: _Worker) -> None:
        """Reap ``w`` the moment it exits and report the exit."""
        returncode = w.proc.wait()
        at = time.monotonic()
        sig = -returncode if returncode < 0 else None
        with w.lock:
            w.exited = True
            if w.assigned:
                log_path, error_file = rank_files(self.log_dir, w.round, w.rank)
                w.exit = WorkerExit(round=w.round, local_rank=w.local_rank, rank=w.rank,
                                    pid=w.pid, exit_code=128 + sig if sig else returncode,
                                    signal=sig, at=at, stopped=w.stop_requested,
                                    log_path=log_path, error_file=error_file)
        w.reaped.set()
        try:
            # So the agent's log shows a worker's last lines before the news of its death;
            # bounded, because the worker's children may hold the pipes open.
            for t in w.threads[:2]:
                t.join(_OUTPUT_DRAIN_S)
            if w.exit is not None:
                self._report(w.exit)
            else:
                self._on_warm_exit(w, returncode)
        finally:
            w.done.set()
            for t in w.threads[:2]:
                t.join()  # ends when its group is gone; stop() and shutdown() see to that
            with self._lock:
                self._live.discard(w)

    def _read_status(self, w: _Worker) -> None:
        """Learn when ``w`` has preloaded: one JSON line on its status pipe, then EOF."""
        data = b""
        try:
            while chunk := os.read(w.status_fd, 4096):
                data += chunk
        except OSError:
            pass
        finally:
            os.close(w.status_fd)
        try:
            ready = bool(json.loads(data.split(b"\n", 1)[0]).get("ready")) if data else False
        except ValueError:
            ready = False
        if not ready:
            return
        with w.lock:
            w.ready = True
            assigned = w.assigned
        if not assigned:
            with self._lock:
                self._warm_failures = 0
                ready_now = sum(1 for x in self._warm if x.ready and not x.exited)
            # Once per set, so an operator (or a benchmark) knows a restart is fast now.
            level = logging.INFO if ready_now % self.nproc == 0 else logging.DEBUG
            self.log.log(level, "warm worker pid %d is ready (%d of %d warm).", w.pid, ready_now,
                         self.warm_sets * self.nproc)

    def _report(self, e: WorkerExit) -> None:
        how = f"was killed by signal {e.signal}" if e.signal else f"exited with code {e.exit_code}"
        level = logging.INFO if e.stopped or e.exit_code == 0 else logging.WARNING
        self.log.at_round(e.round).log(level, "worker rank %d (local rank %d, pid %d) %s%s.",
                                       e.rank, e.local_rank, e.pid, how,
                " after stop()" if e.stopped else "")
        if self._on_exit is None:
            return
        try:
            self._on_exit(e)
        except Exception:  # noqa: BLE001 - a broken callback must not kill the waiter
            self.log.at_round(e.round).exception("on_exit raised for worker rank %d.", e.rank)

    def _on_warm_exit(self, w: _Worker, returncode: int) -> None:
        with self._lock:
            if w in self._warm:
                self._warm.remove(w)
            if w.discarded or self._closed:
                self.log.debug("discarded warm worker pid %d is gone.", w.pid)
                return
            # Died with its template: that death was counted once, not once per fork.
            counted = not getattr(w.proc, "collateral", False)
            self._warm_failures += counted
            failures = self._warm_failures
        if not counted:
            self.warm_up()
            return
        with w.lock:
            tail = " | ".join(text for _, text in list(w.pending)[-5:])
        if failures >= WARM_FAILURE_LIMIT:
            self.log.warning("warm worker pid %d died with status %d before it got a round "
                             "(its last output: %s).", w.pid, returncode, tail or "none")
            self._give_up_warm(failures)
            return
        self.log.warning("warm worker pid %d died with status %d before it got a "
                    "round (its last output: %s); starting another.", w.pid, returncode,
                    tail or "none")
        self.warm_up()

    def _give_up_warm(self, failures: int) -> None:
        """Rounds start cold from now on; end the warm workers and templates that
        would never be used (replacements started before this verdict included)."""
        with self._lock:
            self._warm_disabled = True
            given_up, self._warm = self._warm, []
            tpl, self._template = self._template, None
        for other in given_up:
            self._discard(other)
        if tpl is not None:
            self._retire_template(tpl)
        self.log.warning("%d warm workers (or templates) in a row died before they got a "
                         "round; workers start cold from now on.", failures)

    # ------------------------------------------------------------ helpers

    def _base_env(self) -> dict[str, str]:
        """What every worker's environment starts from, before its round adds its own."""
        return {**os.environ, "PYTHONUNBUFFERED": "1", **self.worker_env}

    def _wait_quiet(self, workers: list[_Worker], deadline: float) -> bool:
        """Wait until every worker is reaped and its group has no running process."""
        while True:
            pending = [w for w in workers if not w.reaped.is_set()]
            if not pending and not any(_group_alive(w.pid) for w in workers):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if pending:
                pending[0].reaped.wait(min(left, _POLL_S))
            else:
                time.sleep(min(left, _POLL_S))
