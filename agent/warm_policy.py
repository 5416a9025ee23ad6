"""The warm pool's rules: ``WarmPolicy.on(event, now) -> actions``.

Pure, like :func:`agent.reactor.react`: no I/O, no clock reads, no threads.
:class:`agent.warm_pool.WarmPool` turns what happens to warm workers and
templates into typed events, calls :meth:`WarmPolicy.on` (under its lock, so
the policy's state changes in one place) and carries out the actions in order.

The rules:

* The pool holds ``warm_sets * nproc`` warm workers, started with the base
  environment plus the startup variables (:data:`STARTUP_ENV_PREFIXES`) that
  the last round set for all its ranks. A round takes a warm worker only if it
  would see the same startup variables.
* Warm workers are forked from one template per startup environment; a
  template with other startup variables than the next warm set needs is
  retired. While the template imports, no warm worker is spawned: the pool
  waits for it, and so does a round that finds too few warm workers
  (:meth:`agent.warm_pool.WarmPool.await_template`), since a spawned worker
  would import beside the template and finish no sooner. One import per node,
  not ``nproc + 1``, is what makes a cold start (a whole job's, or a node's
  that comes back) fast. Without a template (forking found unsafe, or it
  cannot start) warm workers are spawned.
* A template that finds forking unsafe turns forking off for good (logged once)
  and is retired; the pool is refilled by spawning.
* A warm worker or a template that dies unrequested counts as a warm failure;
  a warm worker that becomes ready, or a template that does, resets the count.
  Forks that died with their template are not counted again, only replaced.
  :data:`WARM_FAILURE_LIMIT` failures in a row give up the pool: every warm
  worker is discarded, the template retired, and rounds start cold from then on.
* After the supervisor closes, deaths are nobody's failure and nothing is started.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Mapping, Union

WARM_FAILURE_LIMIT = 3  # consecutive deaths of unassigned warm workers before going cold
# Variables read when the interpreter, the dynamic loader, OpenMP/MKL or torch start.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
                        "TORCH_", "PYTORCH_")


def startup_differences(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The startup variables whose values differ between two environments, sorted."""
    keys = {k for k in (*a, *b) if k.startswith(STARTUP_ENV_PREFIXES)}
    return sorted(k for k in keys if a.get(k) != b.get(k))


def common_startup_env(envs: list[Mapping[str, str]]) -> dict[str, str]:
    """The startup variables every one of ``envs`` sets to the same value."""
    common: dict[str, str] | None = None
    for extra in envs:
        mine = {k: v for k, v in extra.items() if k.startswith(STARTUP_ENV_PREFIXES)}
        common = mine if common is None else {k: v for k, v in common.items()
                                              if mine.get(k) == v}
    return common or {}


@dataclass(frozen=True)
class TemplateView:
    """What the pool knows of its current template."""

    pid: int
    startup_env: Mapping[str, str]
    ready: bool = False
    dead: bool = False
    retired: bool = False

    @property
    def usable(self) -> bool:
        return self.ready and not self.dead and not self.retired


# ------------------------------------------------------------------ events

@dataclass(frozen=True)
class FillAsked:
    """The pool should be topped up: ``warm`` live warm workers now, ``base_env``
    what every worker's environment starts from, ``template`` the current one."""

    warm: int
    base_env: Mapping[str, str]
    template: TemplateView | None


@dataclass(frozen=True)
class TemplateStarted:
    """The template a :class:`StartTemplate` asked for runs (not ready yet)."""

    pid: int


@dataclass(frozen=True)
class TemplateStartFailed:
    error: str


@dataclass(frozen=True)
class ForkFailed:
    """The template could not fork; ``missing`` warm workers are still to start."""

    pid: int
    error: str
    missing: int


@dataclass(frozen=True)
class WarmWorkerReady:
    """A warm worker without a round finished its preload; ``ready_now`` warm are ready."""

    pid: int
    ready_now: int


@dataclass(frozen=True)
class WarmWorkerDied:
    """A warm worker without a round ended. ``discarded``: the pool killed it;
    ``collateral``: it died with its template."""

    pid: int
    returncode: int
    discarded: bool = False
    collateral: bool = False
    last_output: str = ""


@dataclass(frozen=True)
class TemplateReadied:
    """The template finished its preload and may fork; it started at ``started_at``."""

    pid: int
    started_at: float


@dataclass(frozen=True)
class TemplateFoundUnsafe:
    """The template found forking unsafe in its process (``reason``): no more forks."""

    pid: int
    reason: str


@dataclass(frozen=True)
class TemplateDied:
    """A template ended; ``forks``: how many of its children died with it."""

    pid: int
    returncode: int
    was_ready: bool
    discarded: bool = False
    forks: int = 0
    last_output: str = ""


@dataclass(frozen=True)
class RoundStarted:
    """A round started with these per-rank environments (what it set on top of the
    base), or None: its start failed part way, and teaches nothing."""

    envs: tuple[Mapping[str, str], ...] | None


@dataclass(frozen=True)
class Closed:
    """The supervisor shuts down."""


WarmEvent = Union[FillAsked, TemplateStarted, TemplateStartFailed, ForkFailed, WarmWorkerReady,
                  WarmWorkerDied, TemplateReadied, TemplateFoundUnsafe, TemplateDied,
                  RoundStarted, Closed]


# ------------------------------------------------------------------ actions

@dataclass(frozen=True)
class Log:
    """Log ``message % args`` at ``level`` on the supervisor's job logger."""

    level: int
    message: str
    args: tuple = ()


@dataclass(frozen=True)
class RetireTemplate:
    """No more forks from template ``pid`` (None: the current one, if any); it is no
    longer the current one, and is killed once its last child has ended."""

    pid: int | None = None


@dataclass(frozen=True)
class StartTemplate:
    """Start a template with ``env``; answer with TemplateStarted or TemplateStartFailed."""

    env: Mapping[str, str]


@dataclass(frozen=True)
class ForkWarm:
    """Fork ``count`` warm workers from template ``pid``; answer a failure with ForkFailed."""

    pid: int
    count: int


@dataclass(frozen=True)
class SpawnWarm:
    """Spawn ``count`` warm workers with ``env``; stop at the first that cannot start."""

    count: int
    env: Mapping[str, str]


@dataclass(frozen=True)
class Refill:
    """Ask for a fill from the spawner thread (FillAsked comes from there)."""


@dataclass(frozen=True)
class DiscardWarm:
    """Kill every warm worker: none will be used."""


WarmAction = Union[Log, RetireTemplate, StartTemplate, ForkWarm, SpawnWarm, Refill, DiscardWarm]


# ------------------------------------------------------------------ the policy

@dataclass(frozen=True)
class WarmState:
    """The pool's policy state; replaced, never changed in place."""

    failures: int = 0  # warm failures in a row
    warm_disabled: bool = False  # gave up: rounds start cold
    fork_disabled: bool = False  # a template found forking unsafe: spawn, for good
    learned_env: Mapping[str, str] = field(default_factory=dict)
    closed: bool = False
    filling: tuple[int, Mapping[str, str]] | None = None  # a fill waiting for its template


class WarmPolicy:
    """The warm pool's rules for ``nproc`` workers per set, ``warm_sets`` sets."""

    def __init__(self, *, nproc: int, warm_sets: int, prestart: bool):
        self.nproc = nproc
        self.warm_sets = warm_sets
        self.prestart = prestart
        self.state = WarmState()

    @property
    def warm_enabled(self) -> bool:
        """Whether rounds take warm workers (prestart on, and warm workers not failing)."""
        return self.prestart and not self.state.warm_disabled

    @property
    def learned_env(self) -> Mapping[str, str]:
        return self.state.learned_env

    def on(self, event: WarmEvent, now: float) -> list[WarmAction]:
        """The actions that follow ``event`` at monotonic time ``now``, in order."""
        s = self.state
        match event:
            case FillAsked():
                return self._fill(event)
            case TemplateStarted() | TemplateStartFailed():
                return self._after_template_start(event)
            case ForkFailed(pid=pid, error=error, missing=missing):
                env = s.filling[1] if s.filling else {}
                self.state = replace(s, filling=None)
                return [Log(logging.WARNING, "template pid %d could not fork a warm worker "
                            "(%s); spawning it instead.", (pid, error)),
                        *self._fill_from(None, missing, env)]
            case WarmWorkerReady(pid=pid, ready_now=ready_now):
                self.state = replace(s, failures=0)
                # Once per set, so an operator (or a benchmark) knows a restart is fast now.
                level = logging.INFO if ready_now % self.nproc == 0 else logging.DEBUG
                return [Log(level, "warm worker pid %d is ready (%d of %d warm).",
                            (pid, ready_now, self.warm_sets * self.nproc))]
            case WarmWorkerDied():
                return self._warm_died(event)
            case TemplateReadied(pid=pid, started_at=started_at):
                self.state = replace(s, failures=0)
                return [Log(logging.INFO, "template pid %d is ready to fork warm workers "
                            "(imported in %.1f s).", (pid, now - started_at)), Refill()]
            case TemplateFoundUnsafe(pid=pid, reason=reason):
                self.state = replace(s, fork_disabled=True)
                first = [] if s.fork_disabled else [Log(
                    logging.WARNING, "forking warm workers from a template is unsafe here "
                    "(%s); every warm worker is spawned and imports on its own from now on.",
                    (reason,))]
                return [*first, RetireTemplate(pid), Refill()]  # Refill: what it was left
            case TemplateDied():
                return self._template_died(event)
            case RoundStarted(envs=envs):
                learned = common_startup_env(list(envs)) if self.prestart and envs is not None \
                    else s.learned_env
                self.state = replace(s, learned_env=learned)
                return []
            case Closed():
                self.state = replace(s, closed=True)
                return []
        raise TypeError(f"not a warm pool event: {event!r}")

    def _fill(self, event: FillAsked) -> list[WarmAction]:
        s = self.state
        if not self.warm_enabled or s.closed:
            return []
        missing = self.warm_sets * self.nproc - event.warm
        env = {**event.base_env, **s.learned_env}
        tpl = event.template
        actions: list[WarmAction] = []
        if s.fork_disabled:
            tpl = None
        elif tpl is not None and (tpl.dead or startup_differences(tpl.startup_env, env)):
            actions.append(RetireTemplate(tpl.pid))
            tpl = None
        if tpl is None and not s.fork_disabled:
            self.state = replace(s, filling=(missing, env))
            return [*actions, StartTemplate(env)]
        return actions + self._fill_from(tpl, missing, env)

    def _fill_from(self, tpl: TemplateView | None, missing: int,
                   env: Mapping[str, str]) -> list[WarmAction]:
        self.state = replace(self.state, filling=(missing, env))
        if missing <= 0 or not self.warm_enabled or self.state.closed:
            return []
        if tpl is not None and tpl.usable:
            return [ForkWarm(tpl.pid, missing)]
        if tpl is not None and not tpl.ready:
            return []  # the template fills the pool the moment it is ready
        return [SpawnWarm(missing, env)]

    def _after_template_start(self, event: TemplateStarted | TemplateStartFailed
                              ) -> list[WarmAction]:
        missing, env = self.state.filling or (0, {})
        if isinstance(event, TemplateStartFailed):
            return [Log(logging.WARNING, "could not start a template for warm workers: %s",
                        (event.error,)), *self._fill_from(None, missing, env)]
        return self._fill_from(TemplateView(event.pid, env), missing, env)

    def _warm_died(self, event: WarmWorkerDied) -> list[WarmAction]:
        s = self.state
        if event.discarded or s.closed:
            return [Log(logging.DEBUG, "discarded warm worker pid %d is gone.", (event.pid,))]
        if event.collateral:  # its template's death was counted once, not once per fork
            return [Refill()]
        failures = s.failures + 1
        self.state = replace(s, failures=failures)
        tail = event.last_output or "none"
        if failures >= WARM_FAILURE_LIMIT:
            return [Log(logging.WARNING, "warm worker pid %d died with status %d before it got "
                        "a round (its last output: %s).", (event.pid, event.returncode, tail)),
                    *self._give_up(failures)]
        return [Log(logging.WARNING, "warm worker pid %d died with status %d before it got a "
                    "round (its last output: %s); starting another.",
                    (event.pid, event.returncode, tail)), Refill()]

    def _template_died(self, event: TemplateDied) -> list[WarmAction]:
        s = self.state
        if event.discarded or s.closed:
            return []
        failures = s.failures + 1
        self.state = replace(s, failures=failures)
        died = Log(logging.WARNING, "template pid %d died with status %d%s (its last output: "
                   "%s); %d workers it forked died with it.",
                   (event.pid, event.returncode, "" if event.was_ready else
                    " before it was ready", event.last_output or "none", event.forks))
        if failures >= WARM_FAILURE_LIMIT:
            return [died, *self._give_up(failures)]
        return [died, Refill()]

    def _give_up(self, failures: int) -> list[WarmAction]:
        """Rounds start cold from now on; end the warm workers and the template that
        would never be used (replacements started before this verdict included)."""
        self.state = replace(self.state, warm_disabled=True)
        return [DiscardWarm(), RetireTemplate(),
                Log(logging.WARNING, "%d warm workers (or templates) in a row died before they "
                    "got a round; workers start cold from now on.", (failures,))]
