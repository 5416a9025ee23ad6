"""The warm pool: warm workers waiting for a round, and the template they are forked from.

:class:`agent.warm_policy.WarmPolicy` decides; :class:`WarmPool` feeds it
typed events (under its lock: the policy's state changes in one place) from
the threads where things happen, and carries out its actions:

* the spawner thread fills the pool (:meth:`WarmPool.fill`), forking from the
  template or spawning;
* each template's thread follows its messages and its death;
* the supervisor's threads report a warm worker ready or dead, and a round
  taking warm workers.

Template: warm workers are *forked* from one template process per startup
environment (:mod:`elastic.worker.template`), which alone imports torch, so
replacing a used set costs milliseconds of CPU, not ``nproc`` imports.
Forked workers are the template's children: it reaps them and relays each
exit status over a socketpair (:mod:`agent.template_link`). A template that
is retired forks no more and is killed once its last fork has ended (its
death kills its forks: PDEATHSIG).

Lock order: the pool's lock, then a worker's. The spawner holds the pool's lock
while it waits in ``TemplateLink.fork`` for an answer only the template's
thread delivers, so that thread takes the pool's lock only where no fork can
be waiting (before "ready", or after the link failed every pending fork).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

from agent.spawn import KILL_WAIT_S, POLL_S, Launcher, SpawnerThread, WorkerProcess, \
    process_running, signal_worker
from agent.template_link import (ForkedProcess, MalformedMessage, RetiredAndIdle, TemplateEvent,
                                 TemplateLink, TemplateReady, TemplateUnsafe)
from agent.warm_policy import (Closed, DiscardWarm, FillAsked, ForkFailed, ForkWarm, Log, Refill,
                               RetireTemplate, RoundStarted, SpawnWarm, StartTemplate,
                               TemplateDied, TemplateFoundUnsafe, TemplateReadied,
                               TemplateStarted, TemplateStartFailed, TemplateView, WarmAction,
                               WarmEvent, WarmPolicy, WarmWorkerDied, WarmWorkerReady,
                               startup_differences)
from agent.worker_output import last_lines
from elastic.clock import Clock
from elastic.errors import WorkerSpawnError
from elastic.joblog import JobLogger
from elastic.worker import priority

FORK_TIMEOUT_S = 10.0  # a fork costs ~10 ms of CPU; this is for a node loaded to a crawl


class WarmStatus(NamedTuple):
    """One warm worker; ``ready`` once it has imported what it preloads."""

    pid: int
    ready: bool


@dataclass(eq=False)
class _Template:
    """One template process: ``worker`` carries its Popen and output (label
    ``template``), ``link`` its socket and children. ``ready``: it may fork (set
    under the pool's lock). ``discarded``: its death is not a failure."""

    worker: WorkerProcess
    link: TemplateLink
    started: float
    ready: bool = False
    discarded: bool = False

    @property
    def pid(self) -> int:
        return self.worker.pid

    def view(self) -> TemplateView:
        return TemplateView(self.pid, self.worker.startup_env, self.ready, self.link.dead,
                            self.link.retired)

    def kill(self) -> None:
        self.discarded = True
        signal_worker(self.pid, signal.SIGKILL)

    def retire(self) -> None:
        """No more forks; killed now if it has no live child, else once the last ends."""
        self.discarded = True
        if self.link.retire():
            self.kill()


class WarmPool:
    """Warm workers for the next round, and their template.

    ``spawn(env)`` starts (and follows) one warm worker; ``base_env()`` is what
    every worker's environment starts from. Raises nothing from its threads:
    failures are logged and counted by the policy.
    """

    def __init__(self, *, policy: WarmPolicy, launcher: Launcher, spawner: SpawnerThread,
                 spawn: Callable[[dict], WorkerProcess], base_env: Callable[[], dict],
                 clock: Clock, log: JobLogger):
        self._policy = policy
        self._launcher = launcher
        self._spawner = spawner
        self._spawn = spawn
        self._base_env = base_env
        self._clock = clock
        self.log = log
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # after each event the policy saw
        self._warm: list[WorkerProcess] = []
        self._template: _Template | None = None  # the one new warm workers are forked from
        self._templates: list[_Template] = []  # every live one, retired ones included

    # ------------------------------------------------------------ what the supervisor asks

    @property
    def warm_enabled(self) -> bool:
        """Whether rounds take warm workers (prestart on, and warm workers not failing)."""
        return self._policy.warm_enabled

    def warm_up(self) -> None:
        """Ask the spawner thread to fill the pool; returns at once. Takes no lock (the
        fill checks again), so a template's thread may call it while the spawner waits
        for its answer."""
        state = self._policy.state
        if not self.warm_enabled or state.closed:
            return
        try:
            self._spawner.submit(self.fill)
        except RuntimeError:
            return

    def take(self) -> list[WorkerProcess]:
        """Remove and return the live warm workers, ready ones first ([] when rounds
        start cold). Give back with :meth:`give_back` what the round did not use."""
        with self._lock:
            warm = [w for w in self._warm if not w.exited] if self.warm_enabled else []
            self._warm = [w for w in self._warm if w not in warm]
        # Ready ones first: with more than one set, a restart soon after the last one
        # takes the set that finished importing, not the one still warming.
        warm.sort(key=lambda w: not w.ready)
        return warm

    def await_template(self, env: Mapping[str, str], wanted: int, timeout_s: float) -> None:
        """Before a round takes its workers (on the spawner thread): with fewer than
        ``wanted`` live warm workers and a template still importing that started with
        ``env``'s startup variables, wait up to ``timeout_s`` for it, then fork what is
        missing. A template that dies, is retired or finds forking unsafe ends the
        wait, and so does :meth:`close`. The template's import, lowered to idle
        priority so it takes only spare time, is raised back while a round waits for
        it (where this process may: root or ``CAP_SYS_NICE``)."""
        with self._lock:
            tpl = self._template
            live = sum(1 for w in self._warm if not w.exited)
            if (live >= wanted or tpl is None or tpl.ready or tpl.link.dead
                    or startup_differences(tpl.worker.startup_env, env)):
                return
        started = self._clock.monotonic()
        priority.restore_process(tpl.pid)
        with self._changed:
            self._changed.wait_for(lambda: self._template is not tpl or tpl.ready
                                   or tpl.link.dead or self._policy.state.closed, timeout_s)
            ready = self._template is tpl and tpl.ready
            closed = self._policy.state.closed
        waited = self._clock.monotonic() - started
        if closed:
            return
        if not ready:
            self.log.warning("the round waited %.1f s for template pid %d, which is not ready "
                             "to fork; its workers start cold.", waited, tpl.pid)
            return
        self.log.info("the round waited %.1f s for template pid %d to finish importing.",
                      waited, tpl.pid)
        self.fill()

    def give_back(self, workers: list[WorkerProcess]) -> None:
        with self._lock:
            self._warm = workers + self._warm

    def round_started(self, envs: list[dict[str, str]] | None) -> None:
        """A round started with these per-rank environments (learn its startup
        variables), or None: its start failed."""
        self._notice(RoundStarted(None if envs is None else tuple(envs)))

    def ready(self, w: WorkerProcess) -> None:
        """Warm ``w`` (no round) finished its preload."""
        with self._lock:
            ready_now = sum(1 for x in self._warm if x.ready and not x.exited)
        self._notice(WarmWorkerReady(w.pid, ready_now))

    def died(self, w: WorkerProcess, returncode: int) -> None:
        """Warm ``w`` (no round) ended with ``returncode``."""
        tail = last_lines(w)
        with self._lock:
            if w in self._warm:
                self._warm.remove(w)
        self._notice(WarmWorkerDied(w.pid, returncode, discarded=w.discarded,
                                    collateral=w.collateral, last_output=tail))

    def warm_workers(self) -> list[WarmStatus]:
        with self._lock:
            return [WarmStatus(w.pid, w.ready) for w in self._warm if not w.exited]

    def template(self) -> WarmStatus | None:
        """The current template (``ready`` once it may fork), or None."""
        with self._lock:
            tpl = self._template
            if tpl is None or tpl.link.dead or tpl.link.retired:
                return None
            return WarmStatus(tpl.pid, tpl.ready)

    def close(self) -> None:
        """From now on nothing is started and no death is a failure."""
        self._notice(Closed())

    def shutdown(self) -> float:
        """Kill the warm workers, then the templates (their death kills what they
        forked), and wait for each to be reaped; returns the deadline of that wait."""
        with self._lock:
            warm, self._warm = self._warm, []
        for w in warm:
            w.discard()
        deadline = self._clock.monotonic() + KILL_WAIT_S
        for w in warm:
            w.done.wait(max(0.0, deadline - self._clock.monotonic()))
        with self._lock:
            templates, self._templates, self._template = self._templates, [], None
        for tpl in templates:
            tpl.kill()
        deadline = self._clock.monotonic() + KILL_WAIT_S
        for tpl in templates:
            tpl.worker.done.wait(max(0.0, deadline - self._clock.monotonic()))
        return deadline

    # ------------------------------------------------------------ spawner thread only

    def fill(self) -> None:
        """Top the pool up as the policy says (on the spawner thread)."""
        with self._lock:
            template = self._template.view() if self._template is not None else None
            live = sum(1 for w in self._warm if not w.exited)
            self._carry_out(self._decide(FillAsked(live, self._base_env(), template)))

    def _start_template(self, env: dict) -> None:
        try:
            w, sock = self._launcher.spawn_template(dict(env))
        except WorkerSpawnError as exc:
            self._carry_out(self._decide(TemplateStartFailed(str(exc))))
            return
        tpl = self._template = _Template(worker=w, link=TemplateLink(sock),
                                         started=self._clock.monotonic())
        self._launcher.follow_template(w, lambda: self._serve_template(tpl))
        self._templates.append(tpl)
        self._carry_out(self._decide(TemplateStarted(tpl.pid)))

    def _fork_warm(self, pid: int, count: int) -> None:
        tpl = self._template
        forked: list[int] = []
        started = self._clock.monotonic()
        for i in range(count):
            try:
                if tpl is None or tpl.pid != pid:
                    raise WorkerSpawnError("is no longer the template")
                try:
                    proc = tpl.link.fork(FORK_TIMEOUT_S)
                except WorkerSpawnError as exc:
                    raise WorkerSpawnError(f"template pid {pid} {exc}") from exc
            except WorkerSpawnError as exc:
                self._carry_out(self._decide(ForkFailed(pid, str(exc), count - i)))
                break
            w = self._launcher.adopt(proc, tpl.worker.startup_env)
            self._warm.append(w)
            forked.append(w.pid)
        if forked:
            self.log.debug("forked warm workers %s from template pid %d in %.3f s.", forked,
                           pid, self._clock.monotonic() - started)

    def _spawn_warm(self, count: int, env: dict) -> None:
        for _ in range(count):
            try:
                self._warm.append(self._spawn(dict(env)))
            except WorkerSpawnError as exc:
                self.log.warning("could not start a warm worker: %s", exc)
                return

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
            self._launcher.drain_output(w)
            self._launcher.finished(w)

    def _on_template_event(self, tpl: _Template, event: TemplateEvent) -> None:
        match event:
            case RetiredAndIdle():
                tpl.kill()
            case TemplateUnsafe(reason=reason):
                self._notice(TemplateFoundUnsafe(tpl.pid, reason))
            case TemplateReady():
                with self._lock:  # no fork is asked of tpl before this
                    tpl.ready = True
                self._notice(TemplateReadied(tpl.pid, tpl.started))
            case MalformedMessage(data=data):
                self.log.warning("template pid %d sent a malformed message: %r", tpl.pid,
                                 data[:200])

    def _on_template_death(self, tpl: _Template, orphans: list[ForkedProcess]) -> None:
        """Reap ``tpl``; the forks it leaves died with it (PDEATHSIG): report them
        killed once they are gone."""
        returncode = tpl.worker.proc.wait()
        deadline = self._clock.monotonic() + KILL_WAIT_S
        for proc in orphans:
            while process_running(proc.pid) and self._clock.monotonic() < deadline:
                time.sleep(POLL_S / 4)
            proc.ended(-signal.SIGKILL, collateral=True)
        with self._lock:
            if tpl in self._templates:
                self._templates.remove(tpl)
            if self._template is tpl:
                self._template = None
        self._notice(TemplateDied(tpl.pid, returncode, tpl.ready, discarded=tpl.discarded,
                                  forks=len(orphans), last_output=last_lines(tpl.worker)))

    # ------------------------------------------------------------ the policy's actions

    def _decide(self, event: WarmEvent) -> list[WarmAction]:
        with self._lock:
            return self._policy.on(event, self._clock.monotonic())

    def _notice(self, event: WarmEvent) -> None:
        """Decide and carry out under the lock, so no thread sees the policy's new
        state before its actions (a pool given up still holding warm workers)."""
        with self._lock:
            self._carry_out(self._decide(event))
            self._changed.notify_all()

    def _carry_out(self, actions: list[WarmAction]) -> None:
        for action in actions:
            match action:
                case Log(level=level, message=message, args=args):
                    self.log.log(level, message, *args)
                case Refill():
                    self.warm_up()
                case StartTemplate(env=env):
                    self._start_template(dict(env))
                case ForkWarm(pid=pid, count=count):
                    self._fork_warm(pid, count)
                case SpawnWarm(count=count, env=env):
                    self._spawn_warm(count, dict(env))
                case RetireTemplate(pid=pid):
                    self._retire(pid)
                case DiscardWarm():
                    with self._lock:
                        given_up, self._warm = self._warm, []
                    for w in given_up:
                        w.discard()

    def _retire(self, pid: int | None) -> None:
        with self._lock:
            tpl = next((t for t in self._templates if t.pid == pid), None) \
                if pid is not None else self._template
            if tpl is not None and self._template is tpl:
                self._template = None
        if tpl is not None:
            tpl.retire()

