"""The node agent's worker supervisor: start a round's workers, watch them, stop them.

Every worker runs ``python -u -m elastic.worker.bootstrap`` (see that module
for the protocol) in its own session and process group, so ``stop()`` reaches
the worker's children too. With ``prestart`` the supervisor keeps a pool of
*warm* workers that have already imported torch and wait for an assignment on
stdin; a round takes them (ready ones first) and the pool is filled again
(``warm_up``, ``warm_sets`` sets of ``nproc``), so a restart does not wait
for ``import torch``. A round takes a warm worker only if it would see the
same *startup* variables (``PYTHON*``, ``LD_*``, ``OMP_*``, ``TORCH_*``, ...:
read when the interpreter or torch starts, too late to change afterwards);
otherwise that rank starts cold. The next warm set is started with
``worker_env`` and the startup variables the last round set for all its
ranks (e.g. the ``OMP_NUM_THREADS=1`` of several workers per node), so from
the second round on they match even when the agent does not pass them in
``worker_env``.

The parts, as torch's elastic agent splits its own:

* :mod:`agent.spawn`: starting processes (on one long-lived spawner thread:
  Linux sends a child's ``PR_SET_PDEATHSIG`` when the *thread* that forked it
  ends), signalling their groups, the stop escalation SIGTERM -> grace -> SIGKILL;
* :mod:`agent.worker_output`: output pumps, rank log files, the console filter;
* :mod:`agent.warm_policy`: the warm pool's rules, pure (events in, actions out),
  and :mod:`agent.warm_pool`, which carries them out, the templates included;
* this module: starting and stopping a round with the above.

Threads: each worker has two output readers, a reader of its bootstrap's
status pipe and a waiter that reaps it the moment it exits (a fork: when its
template relays the exit) and calls ``on_exit`` (from that waiter thread:
``on_exit`` should only hand the exit over, e.g. to a queue; calling stop()
from it works but holds up other exits until that stop() returns).

Never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

import elastic
from agent import localfiles
from agent.console import ConsoleFilter
from agent.spawn import Launcher, SpawnerThread, WorkerProcess, stop_groups
from agent.warm_policy import WarmPolicy, startup_differences
from agent.warm_pool import WarmPool, WarmStatus
from agent.worker_output import WorkerOutput, close_log, rank_files, stacks_file
from elastic import errorfile, worker_env
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import ConfigError, WorkerSpawnError
from elastic.joblog import JobLogger

__all__ = ["Entrypoint", "WorkerExit", "WorkerStatus", "WorkerSupervisor"]

log = logging.getLogger(__name__)

_CALLBACK_WAIT_S = 2.0  # how long stop() waits for on_exit of the workers it stopped
_SPAWN_TIMEOUT_S = 30.0
# How long a round waits for an importing template before it spawns its workers cold:
# under the spawn timeout, so the forks that follow still fit in it.
TEMPLATE_WAIT_S = 20.0


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
    (as a shell reports it) when ``signal`` is set. ``at`` is the supervisor
    clock's monotonic time when it was reaped. ``stopped`` is true when the
    exit follows ``stop()``: not a failure of the worker.
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


class WorkerStatus(NamedTuple):
    """One worker of the current (or last) round, for status reports."""

    local_rank: int
    rank: int
    pid: int
    alive: bool


@dataclass(frozen=True)
class _Slot:
    """The place of one worker in a round."""

    round: int
    local_rank: int
    rank: int


@dataclass(eq=False)
class _Round:
    number: int
    workers: list[WorkerProcess]
    stopped: bool = False


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
                 console: ConsoleFilter = ConsoleFilter(), clock: Clock = SYSTEM_CLOCK):
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {nproc}")
        if stop_grace_s < 0:
            raise ValueError(f"stop_grace_s must not be negative, got {stop_grace_s}")
        if warm_sets < 1:
            raise ValueError(f"warm_sets must be at least 1, got {warm_sets}")
        self.job_id, self.node_id, self.nproc = job_id, node_id, nproc
        self.entrypoint = entrypoint
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.prestart = prestart
        self.warm_sets = warm_sets
        self.python = python
        self.worker_env = dict(worker_env or {})
        self.console = console
        self.clock = clock
        self._on_exit = on_exit
        self._lock = threading.Lock()  # guards _round and _closed
        self._stop_lock = threading.Lock()  # one stop() at a time; a second waits, then no-ops
        self._round: _Round | None = None
        self._closed = False
        # Lines about no round in particular (warm workers) name the latest one started.
        self.log = JobLogger(log, job_id, node_id,
                             lambda: self._round.number if self._round is not None else 0)
        self._output = WorkerOutput(console, self.log)
        self._spawner = SpawnerThread(f"elastic-spawner-{node_id}")
        # The bootstrap runs with -m from here, so it imports even if elastic is not installed.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(elastic.__file__)))
        self._launcher = Launcher(python=python, cwd=package_root, pump=self._output.pump,
                                  watch=self._watch, read_status=self._read_status, clock=clock)
        self._pool = WarmPool(
            policy=WarmPolicy(nproc=nproc, warm_sets=warm_sets, prestart=prestart),
            launcher=self._launcher, spawner=self._spawner,
            spawn=lambda env: self._launcher.spawn(env, preload=None),
            base_env=self._base_env, clock=clock, log=self.log)

    # ------------------------------------------------------------ public API

    @property
    def warm_enabled(self) -> bool:
        """Whether rounds take warm workers (prestart on, and warm workers not failing)."""
        return self._pool.warm_enabled

    def warm_up(self) -> None:
        """Start warm workers until ``warm_sets * nproc`` are warm; returns at once (they
        warm in the background). Does nothing without prestart, after repeated warm
        failures, or after shutdown(). Takes no lock (the pool fill checks again), so
        a template's thread may call it while the spawner waits for its answer."""
        if not self._closed:
            self._pool.warm_up()

    def start_round(self, round_number: int, envs: list[dict[str, str]]) -> None:
        """Start one worker per local rank; ``envs[i]`` is added to ``os.environ`` for local rank i.

        Returns once every worker process exists (not once the scripts run).
        Short of warm workers while the template imports (a cold start), it
        waits for the template, up to TEMPLATE_WAIT_S, and takes forks of it:
        a cold worker would import beside it and finish no sooner. The next
        warm set is forked from the template at once when it is ready (warm at
        birth), else as soon as it is; without a template (forking unsafe) it
        is spawned and imports at the lowest CPU and I/O priority
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
            round_log = self.log.at_round(rnd.number)
            round_log.info("stopping %d running workers (grace %.1f s).", running, grace_s)
            started = self.clock.monotonic()
            stop_groups(workers, grace_s, self.clock, round_log)
            me = threading.current_thread()
            deadline = self.clock.monotonic() + _CALLBACK_WAIT_S
            for w in workers:
                if me not in w.threads:
                    w.done.wait(max(0.0, deadline - self.clock.monotonic()))
            round_log.info("workers stopped in %.2f s.", self.clock.monotonic() - started)
            return [w.exit for w in workers if w.exit is not None]

    def shutdown(self) -> None:
        """stop(), then kill the warm pool and end the supervisor's threads. Idempotent;
        afterwards no process this supervisor started is alive (bounded wait)."""
        with self._lock:
            already = self._closed
            self._closed = True
        self._pool.close()
        if not already:
            self._spawner.run_queued(_SPAWN_TIMEOUT_S)  # a start_round in progress finishes
        self.stop()
        # The templates go last, in the pool's shutdown: a template's death kills
        # whatever it forked. Only then may the spawner thread end, since its end
        # kills the templates (PDEATHSIG).
        deadline = self._pool.shutdown()
        if not already:
            self._spawner.close(_SPAWN_TIMEOUT_S)
        self._launcher.join_all(deadline)
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
        return self._pool.warm_workers()

    def ready_for_a_round(self) -> bool:
        """Whether a round would start this node's workers at once: warm ones
        ready for every local rank, or none to wait for (warm workers off, or
        given up after repeated failures)."""
        if not self.warm_enabled:
            return True
        return sum(1 for w in self.warm_workers() if w.ready) >= self.nproc

    def warm_template(self) -> WarmStatus | None:
        """The template new warm workers are forked from (``ready`` once it may fork),
        or None: none started yet, being replaced, or forking found unsafe."""
        return self._pool.template()

    def pids(self) -> list[int]:
        """Every process this supervisor has started (templates and their forks
        included), warm or not, alive or not, in order."""
        return self._launcher.pids()

    # ------------------------------------------------------------ spawner thread only

    def _start_round_now(self, number: int, envs: list[dict[str, str]]) -> None:
        self._make_round_dir(number)
        base = self._base_env()
        rnd = _Round(number, [])
        self._pool.await_template({**base, **envs[0]}, self.nproc, TEMPLATE_WAIT_S)
        warm = self._pool.take()
        differing: set[str] = set()  # startup variables that made warm workers unusable
        cold_ranks: list[int] = []
        unready = 0  # warm workers taken before they finished importing
        started = self.clock.monotonic()
        learned: list[dict[str, str]] | None = None
        try:
            for local_rank, extra in enumerate(envs):
                slot = _Slot(number, local_rank, int(extra.get("RANK", local_rank)))
                env, line = self._assignment(slot, base, extra)
                worker = self._take_warm(warm, slot, env, line, differing)
                if worker is None:
                    worker = self._launcher.spawn(env, preload="",
                                                  before_follow=lambda w: self._bind(w, slot))
                    self._send(worker, line)
                    cold_ranks.append(slot.rank)
                else:
                    unready += not worker.ready
                rnd.workers.append(worker)
            learned = envs
        finally:
            # Even after a failed spawn the round owns what it started, so stop() ends it.
            self._pool.give_back(warm)  # more warm than ranks: keep the rest
            with self._lock:
                self._round = rnd
            self._pool.round_started(learned)
        round_log = self.log.at_round(number)
        if cold_ranks and differing:
            round_log.info("ranks %s start cold: the round changes %s, which the warm workers "
                           "read when they started; the next warm workers start with the new "
                           "values.", cold_ranks, ", ".join(sorted(differing)))
        elif cold_ranks and self.warm_enabled:
            round_log.info("ranks %s start cold: no warm worker was left.", cold_ranks)
        round_log.info("started %d workers (pids %s, %d cold, %d warm but still importing) in "
                       "%.3f s.", len(rnd.workers), [w.pid for w in rnd.workers],
                       len(cold_ranks), unready, self.clock.monotonic() - started)

    def _make_round_dir(self, number: int) -> None:
        """Create the round's log directory: private (0700, never through a link: see
        agent.localfiles). Raises WorkerSpawnError."""
        round_dir = os.path.dirname(rank_files(self.log_dir, number, 0)[0])
        try:
            localfiles.ensure_dir(self.log_dir, "the log directory")
            localfiles.private_subdir(self.log_dir, os.path.basename(round_dir))
        except (OSError, ConfigError) as exc:
            raise WorkerSpawnError(f"cannot create the log directory {round_dir}: {exc}") from exc

    def _assignment(self, slot: _Slot, base: dict[str, str],
                    extra: dict[str, str]) -> tuple[dict[str, str], bytes]:
        """The environment of ``slot``'s worker and the assignment line sent to its stdin."""
        error_file = rank_files(self.log_dir, slot.round, slot.rank)[1]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(error_file)  # a stale one would name another failure's cause
        env = {**base, **extra, errorfile.ENV_VAR: error_file,
               worker_env.STACKS_FILE: stacks_file(self.log_dir, slot.round, slot.rank)}
        assignment = {"env": env, "argv": list(self.entrypoint.args),
                      "script": self.entrypoint.script, "module": self.entrypoint.module,
                      "cwd": os.getcwd(), "no_python": self.entrypoint.no_python}
        return env, (json.dumps(assignment) + "\n").encode()

    def _take_warm(self, warm: list[WorkerProcess], slot: _Slot, env: dict[str, str],
                   line: bytes, differing: set[str]) -> WorkerProcess | None:
        """The first of ``warm`` that started with ``env``'s startup variables and takes
        ``slot``; those that started with others are discarded (their variables added
        to ``differing``). None if none is left."""
        while warm:
            candidate = warm.pop(0)
            differ = startup_differences(candidate.startup_env, env)
            if differ:
                differing.update(differ)
                candidate.discard()
            elif self._assign_warm(candidate, slot, line):
                return candidate
        return None

    def _bind(self, w: WorkerProcess, slot: _Slot) -> None:
        """Make ``w`` the worker of ``slot`` (caller holds ``w.lock`` or owns ``w`` alone)."""
        w.round, w.local_rank, w.rank, w.label = slot.round, slot.local_rank, slot.rank, \
            f"rank {slot.rank}"
        self._output.open_rank_log(w, self.log_dir)

    def _assign_warm(self, w: WorkerProcess, slot: _Slot, line: bytes) -> bool:
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
            close_log(w)
        return False

    @staticmethod
    def _send(w: WorkerProcess, line: bytes) -> bool:
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

    # ------------------------------------------------------------ per-worker threads

    def _watch(self, w: WorkerProcess) -> None:
        """Reap ``w`` the moment it exits and report the exit."""
        returncode = w.proc.wait()
        at = self.clock.monotonic()
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
            self._launcher.drain_output(w)
            if w.exit is not None:
                self._report(w.exit)
            else:
                self._pool.died(w, returncode)
        finally:
            self._launcher.finished(w)

    def _read_status(self, w: WorkerProcess) -> None:
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
            self._pool.ready(w)

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

    def _base_env(self) -> dict[str, str]:
        """What every worker's environment starts from, before its round adds its own."""
        return {**os.environ, "PYTHONUNBUFFERED": "1", **self.worker_env}
