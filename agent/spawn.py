"""Worker processes: how they are started, tracked and signalled.

Every worker and template runs ``python -u -m elastic.worker.bootstrap`` in its
own session and process group, so a signal to its group reaches its children
too. Processes are started only by one long-lived :class:`SpawnerThread`,
because Linux sends a child's ``PR_SET_PDEATHSIG`` when the *thread* that
forked it ends, not the process.

The stop escalation (:func:`stop_groups`): SIGTERM and SIGCONT to every group,
a grace period, then SIGKILL; a group counts as gone once it has no running
process (zombies do not count: a container's PID 1 may never reap orphans).

Never imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from agent.template_link import ForkedProcess
from elastic import worker_env
from elastic.clock import Clock
from elastic.errors import WorkerSpawnError
from elastic.joblog import JobLogger
# It imports no torch (nor anything heavy): the agent stays light.
from elastic.worker.template import TEMPLATE_ENV

BOOTSTRAP_MODULE = "elastic.worker.bootstrap"
KILL_WAIT_S = 3.0  # after SIGKILL: only a process stuck in the kernel takes longer
OUTPUT_DRAIN_S = 0.2  # how long the news of a death waits for the process's last lines
POLL_S = 0.02
WARM_TAIL_LINES = 50  # output kept from a warm worker before it has a log file


@dataclass(eq=False)
class WorkerProcess:
    """One child process, warm (no round yet) or assigned to a round; ``proc`` is a
    Popen for a spawned one, a :class:`ForkedProcess` for one forked by a template.
    ``lock`` guards the fields that change after it started."""

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
    exit: object | None = None  # the supervisor's WorkerExit once reaped, if assigned
    log_file: object | None = None
    open_streams: int = 2
    pending: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=WARM_TAIL_LINES))
    reaped: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)  # on_exit has returned
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def assigned(self) -> bool:
        return self.round is not None

    @property
    def collateral(self) -> bool:
        """It died with its template (a fork whose template's death was counted once)."""
        return bool(getattr(self.proc, "collateral", False))

    def discard(self) -> None:
        """Kill it as no longer needed: its death is not a failure."""
        with self.lock:
            self.discarded = True
        signal_worker(self.pid, signal.SIGKILL)


class SpawnerThread:
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


def signal_worker(pid: int, sig: int) -> None:
    """Signal a worker's process group, which may outlive its leader (the worker's
    children); a worker that has no group of its own yet gets the signal alone.

    A template answers a fork before its child has called setsid(), so for a
    moment a forked worker is not yet the leader of the group its pid names:
    signalling only the group would miss it.

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


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan nobody reaps stays one)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[:1] not in ([b"Z"], [b"X"])


def group_alive(pgid: int) -> bool:
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


def wait_quiet(workers: list[WorkerProcess], deadline: float, clock: Clock) -> bool:
    """Wait until every worker is reaped and its group has no running process;
    False if ``deadline`` (on ``clock``) passes first."""
    while True:
        pending = [w for w in workers if not w.reaped.is_set()]
        if not pending and not any(group_alive(w.pid) for w in workers):
            return True
        left = deadline - clock.monotonic()
        if left <= 0:
            return False
        if pending:
            pending[0].reaped.wait(min(left, POLL_S))
        else:
            time.sleep(min(left, POLL_S))


def stop_groups(workers: list[WorkerProcess], grace_s: float, clock: Clock,
                log: JobLogger) -> None:
    """SIGTERM (and SIGCONT, so a stopped process sees it) to every worker's group,
    up to ``grace_s`` for them to end, then SIGKILL and up to :data:`KILL_WAIT_S`.
    Returns once every group is gone or that wait is over (logged as an error)."""
    started = clock.monotonic()
    for w in workers:
        signal_worker(w.pid, signal.SIGTERM)
        signal_worker(w.pid, signal.SIGCONT)
    if wait_quiet(workers, started + grace_s, clock):
        return
    stubborn = [w.rank for w in workers if not w.exited or group_alive(w.pid)]
    log.warning("workers of ranks %s (or their children) outlived the %.1f s grace period; "
                "killing them.", stubborn, grace_s)
    for w in workers:
        signal_worker(w.pid, signal.SIGKILL)
    if not wait_quiet(workers, clock.monotonic() + KILL_WAIT_S, clock):
        log.error("processes of ranks %s survived SIGKILL for %.0f s (stuck in the kernel?).",
                  [w.rank for w in workers if not w.reaped.is_set()], KILL_WAIT_S)


def popen_bootstrap(python: str, cwd: str, env: dict[str, str], *, stdin: int,
                    pass_fd: int) -> subprocess.Popen:
    """Start ``python -u -m elastic.worker.bootstrap`` in a session of its own, with
    ``pass_fd`` left open in it. Raises WorkerSpawnError if it cannot start."""
    try:
        return subprocess.Popen(
            [python, "-u", "-m", BOOTSTRAP_MODULE], cwd=cwd, env=env, stdin=stdin,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            pass_fds=(pass_fd,))
    except OSError as exc:
        raise WorkerSpawnError(f"cannot start {python} -m {BOOTSTRAP_MODULE}: {exc}") from exc


def spawn_worker(python: str, cwd: str, env: dict[str, str],
                 preload: str | None) -> WorkerProcess:
    """Start a bootstrap process that waits for its assignment on stdin and reports
    on a status pipe when it has preloaded. ``preload`` None keeps the bootstrap's
    default (a warm worker); "" imports nothing ahead (a cold one). Raises
    WorkerSpawnError."""
    read_fd, write_fd = os.pipe()
    child_env = {**env, worker_env.BOOTSTRAP_STATUS_FD: str(write_fd),
                 worker_env.BOOTSTRAP_PARENT_PID: str(os.getpid())}
    startup_env = dict(env)
    if preload is not None:
        child_env[worker_env.PRELOAD] = startup_env[worker_env.PRELOAD] = preload
    try:
        proc = popen_bootstrap(python, cwd, child_env, stdin=subprocess.PIPE, pass_fd=write_fd)
    except WorkerSpawnError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return WorkerProcess(proc=proc, startup_env=startup_env, status_fd=read_fd)


def spawn_template(python: str, cwd: str,
                   env: dict[str, str]) -> tuple[WorkerProcess, socket.socket]:
    """Start a template process (:mod:`elastic.worker.template`) and return it with
    the agent's end of its socket. Raises WorkerSpawnError."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # TEMPLATE_ENV keeps torch.cuda.is_available() in the preload off the CUDA
    # driver, whose use would make every fork unable to use CUDA.
    child_env = {**env, **TEMPLATE_ENV, worker_env.BOOTSTRAP_TEMPLATE_FD: str(theirs.fileno()),
                 worker_env.BOOTSTRAP_PARENT_PID: str(os.getpid())}
    try:
        proc = popen_bootstrap(python, cwd, child_env, stdin=subprocess.DEVNULL,
                               pass_fd=theirs.fileno())
    except WorkerSpawnError:
        ours.close()
        raise
    finally:
        theirs.close()
    return WorkerProcess(proc=proc, startup_env=dict(env), status_fd=-1, label="template"), ours


class Launcher:
    """Starts workers and templates and the threads that follow each: two output
    pumps (``pump(w, stream, name)``), a waiter (``watch(w)``) that reaps it, and
    for a spawned worker a reader of its status pipe (``read_status(w)``). Keeps
    every pid it started, in order, and the processes whose threads still run.
    Call its spawn methods on the :class:`SpawnerThread` only."""

    def __init__(self, *, python: str, cwd: str, pump: Callable, watch: Callable,
                 read_status: Callable, clock: Clock):
        self.python = python
        self._cwd = cwd
        self._pump = pump
        self._watch = watch
        self._read_status = read_status
        self._clock = clock
        self._lock = threading.Lock()
        self._live: set[WorkerProcess] = set()
        self._history: list[int] = []

    def spawn(self, env: dict[str, str], preload: str | None,
              before_follow: Callable[[WorkerProcess], None] | None = None) -> WorkerProcess:
        """:func:`spawn_worker`, then ``before_follow(w)`` (so even an instant death
        finds it set up), then its threads. Raises WorkerSpawnError."""
        w = spawn_worker(self.python, self._cwd, env, preload)
        if before_follow is not None:
            before_follow(w)
        self._follow(w, [("status", lambda: self._read_status(w))])
        return w

    def adopt(self, proc: ForkedProcess, startup_env: dict[str, str]) -> WorkerProcess:
        """Follow a worker a template forked: ready at birth, no status pipe."""
        w = WorkerProcess(proc=proc, startup_env=dict(startup_env), status_fd=-1, ready=True)
        self._follow(w, [])
        return w

    def spawn_template(self, env: dict[str, str]) -> tuple[WorkerProcess, socket.socket]:
        """:func:`spawn_template`; start its threads with :meth:`follow_template`."""
        return spawn_template(self.python, self._cwd, env)

    def follow_template(self, w: WorkerProcess, serve: Callable[[], None]) -> None:
        """Start a template's output pumps and ``serve``, which follows it until it dies."""
        pid = w.pid
        self._start(w, [(f"elastic-template-{pid}-stdout", lambda: self._pump(w, w.proc.stdout,
                                                                               "stdout")),
                        (f"elastic-template-{pid}-stderr", lambda: self._pump(w, w.proc.stderr,
                                                                               "stderr")),
                        (f"elastic-template-{pid}", serve)])

    def _follow(self, w: WorkerProcess, extra: list[tuple[str, Callable[[], None]]]) -> None:
        pid = w.pid
        # The status reader apart from the waiter: a child that inherited the status
        # pipe must not delay the news of the worker's exit.
        self._start(w, [(f"elastic-worker-{pid}-stdout", lambda: self._pump(w, w.proc.stdout,
                                                                             "stdout")),
                        (f"elastic-worker-{pid}-stderr", lambda: self._pump(w, w.proc.stderr,
                                                                             "stderr")),
                        (f"elastic-worker-{pid}-waiter", lambda: self._watch(w)),
                        *((f"elastic-worker-{pid}-{name}", t) for name, t in extra)])

    def _start(self, w: WorkerProcess, targets: list[tuple[str, Callable[[], None]]]) -> None:
        w.threads = [threading.Thread(target=target, name=name, daemon=True)
                     for name, target in targets]
        for t in w.threads:
            t.start()
        with self._lock:
            self._live.add(w)
            self._history.append(w.pid)

    @staticmethod
    def drain_output(w: WorkerProcess) -> None:
        """Wait (at most :data:`OUTPUT_DRAIN_S`) for the last lines of reaped ``w``, so
        the agent's log shows them before the news of its death; bounded, because
        its children may hold the pipes open."""
        for t in w.threads[:2]:
            t.join(OUTPUT_DRAIN_S)

    def finished(self, w: WorkerProcess) -> None:
        """The news of ``w``'s death is handed over: set ``w.done``, wait for its output
        pumps (they end when its group is gone; stop and shutdown see to that), and
        count it no longer live."""
        w.done.set()
        for t in w.threads[:2]:
            t.join()
        with self._lock:
            self._live.discard(w)

    def pids(self) -> list[int]:
        """Every process started, alive or not, in order."""
        with self._lock:
            return list(self._history)

    def join_all(self, deadline: float) -> None:
        """Wait (until ``deadline``) for the threads of every live process."""
        with self._lock:
            live = list(self._live)
        me = threading.current_thread()
        for w in live:
            for t in w.threads:
                if t is not me:
                    t.join(max(0.0, deadline - self._clock.monotonic()))
