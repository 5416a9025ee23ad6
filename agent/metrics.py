"""The agent's Prometheus metrics: every metric name is defined here, once.

:class:`AgentMetrics` is fed by the agent's loop (:mod:`agent.daemon`) with
what it already has in hand: each typed event with the view
:func:`agent.reactor.react` returned and its commands, at the loop's
monotonic ``now``; each lifecycle transition; the workers' heartbeats; the
checkpoint commits and restores its workers report; and the etcd errors its
loop retries. It never reads a clock, so tests drive it with explicit times
(``tests/unit/test_metrics.py``). Each agent has a registry of its own, never
the process-wide default: the fault simulator runs many agents in one
process. :class:`NoMetrics` is the same interface doing nothing (agents built
without ``--metrics-port``).

Every metric carries the labels ``job_id`` and ``node_id``. Not ``job``:
Prometheus sets ``job`` on every scraped series to the scrape job's name and
would rename ours to ``exported_job``.

Restarts are counted where this node's workers are stopped for a new round
(once per reaction), with a bounded ``reason``: the value of the stop's typed
cause (:class:`agent.reactor.StopCause`), never read from free text:

=================  ===========================================================
``worker_exit``    a worker of this node exited non-zero or was killed
``worker_hang``    a worker of this node made no progress (or went silent)
``peer_unhealthy`` the ring peer reported its workers NOT_SERVING for a TTL
``store_cut_off``  this node was cut off from etcd (the partition rule)
``node_left``      a new round without some members (lease lost, drained)
``peer_failure``   a new round, same members, a failure counted elsewhere
``node_joined``    a new round with more members (scale up)
``requested``      a new round, same members, no failure (``elasticctl
                   restart``, a node back from a cut-off, an agent registered
                   again)
``other``          kept at 0 for dashboards that query it: every stop has
                   one of the causes above
=================  ===========================================================

Time to detect (``elasticd_detect_seconds``) is the stop's ``detect_s``, known
where this node judged the fault: 0 for a worker's exit (the supervisor reaps
it at once), the silence before a hang verdict, the time the peer was
NOT_SERVING, the time the lease went unconfirmed. Time to recover
(``elasticd_recover_seconds``) runs from the first stop of the workers to the
first step of every worker of a later round (``Tick.workers_stepped``);
restarts in between (a crash loop) do not reset it, and a node left out of
the next round (standby) observes nothing.

The GPU check before a round (``--gpu-check``, :mod:`agent.gpu_health`) is
counted by its verdict (``elasticd_gpu_checks{result}``: ``pass``, ``warn``,
``leave``; a wait is not a verdict) and by each problem it found
(``elasticd_gpu_check_problems{problem}``, the labels of
:data:`agent.gpu_health.PROBLEMS`); ``elasticd_gpu_check_seconds`` is how long
the verdict took from the start of the round here (mostly: waiting for the
driver to free the memory of the last round's workers).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

from agent import goodput, reactor
from agent.gpu_health import PROBLEMS as GPU_PROBLEMS
from agent.gpu_health import GpuAction
from agent.hang_attribution import HangKind
from agent.lifecycle import AgentState
from agent.status_record import MemoryTierRow
from elastic.errors import ConfigError
from elastic.hostport import HostPort
from elastic.joblog import JobLogger

log = logging.getLogger(__name__)

RESTART_REASONS = tuple(c.value for c in reactor.StopCause if c.restart) + ("other",)
# What the status record reports per worker (agent.publishing.status_of).
WORKER_STATES = ("starting", "running", "succeeded")
# Where the loop met an etcd error it retries (Agent.step and Agent.flush) or
# passed on to a worker (a checkpoint commit).
STORE_OPS = ("round_read", "react", "flush", "checkpoint_commit")
_LABELS = ("job_id", "node_id")
# What the leader did about a straggler (agent.straggler_watch): "drained" only
# with --straggler-action replace and a standby waiting.
STRAGGLER_OUTCOMES = ("reported", "drained")

_DETECT_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
_RECOVER_BUCKETS_S = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_RENDEZVOUS_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
_GPU_CHECK_BUCKETS_S = (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0)
GPU_CHECK_RESULTS = tuple(a.value for a in GpuAction if a is not GpuAction.WAIT)
_CHECKPOINT_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                         1800.0)


class NoMetrics:
    """The metrics interface, doing nothing: what an agent without
    ``--metrics-port`` (and one the tests or the simulator build) is fed
    through. Stateless, so one instance serves every agent. ``observe`` and
    ``observe_transition`` are called from the agent's loop only; the others
    from any thread (gRPC handlers, the HTTP server's)."""

    def observe(self, event: reactor.Event, after: reactor.AgentView,
                commands: Sequence[reactor.Command], now: float) -> None:
        """The loop reacted to ``event`` at monotonic ``now``: ``after`` is the
        view :func:`agent.reactor.react` returned, ``commands`` its commands."""

    def observe_transition(self, state: AgentState, now: float) -> None:
        """The lifecycle entered ``state`` at monotonic ``now``."""

    def observe_heartbeat(self, step: int, step_rate: float) -> None:
        """A heartbeat of the current round arrived; ``step`` is the newest
        step of this node's workers (-1: none yet), ``step_rate`` their
        slowest rate in steps/s."""

    def observe_save(self, step: int, seconds: float, size_bytes: int) -> None:
        """A checkpoint of ``step`` was committed through this agent; its save
        took ``seconds`` and wrote ``size_bytes`` (0: not measured)."""

    def observe_restore(self, seconds: float, size_bytes: int) -> None:
        """A worker restored a checkpoint of ``size_bytes`` in ``seconds``."""

    def store_error(self, op: str) -> None:
        """The loop met an etcd error during ``op`` (one of STORE_OPS)."""

    def straggler_named(self, outcome: str) -> None:
        """The leader named a straggler and did ``outcome`` (one of STRAGGLER_OUTCOMES)."""

    def stragglers_now(self, named: Iterable[tuple[int, str, float]]) -> None:
        """The ranks the leader names stragglers now: (rank, node, step time
        over its peers' median); the ones left out are no longer named."""

    def count_workers_with(self, states: Callable[[], Iterable[str]]) -> None:
        """``states()`` lists the state of each worker of this node (any
        thread), read at every scrape."""

    def watch_memory_tier(self, status: Callable[[], MemoryTierRow]) -> None:
        """``status()`` is the memory tier's state (any thread), read at every scrape."""

    def watch_goodput(self, snapshot: Callable[[], goodput.Snapshot]) -> None:
        """``snapshot()`` is the goodput accounting now (any thread), read at every scrape."""

    def serve(self, host: str, port: int) -> str:
        """Serve the metrics over HTTP; returns the URL. Nothing to serve here."""
        return ""

    def close(self) -> None:
        """Stop serving. Idempotent."""


NO_METRICS = NoMetrics()


class AgentMetrics(NoMetrics):
    """One agent's metrics in a registry of its own (``registry``)."""

    def __init__(self, job_id: str, node_id: str, registry: CollectorRegistry | None = None):
        self.job_id = job_id
        self.node_id = node_id
        self.registry = registry if registry is not None else CollectorRegistry()
        self._log = JobLogger(log, job_id, node_id)
        ids = self._ids = (job_id, node_id)
        r = self.registry
        self._rounds_started = _series(r, ids, Counter, "elasticd_rounds_started",
                                       "Rounds this node started workers in.")
        self._round = _series(r, ids, Gauge, "elasticd_round",
                              "The round this node's workers belong to (0: none yet).")
        self._world_size = _series(r, ids, Gauge, "elasticd_world_size",
                                   "World size of that round.")
        self._state = Gauge("elasticd_agent_state",
                            "The agent's lifecycle state: 1 for the current one.",
                            _LABELS + ("state",), registry=r)
        self._restarts = Counter("elasticd_restarts",
                                 "Stops of this node's workers for a new round, by reason.",
                                 _LABELS + ("reason",), registry=r)
        self._detect = Histogram(
            "elasticd_detect_seconds",
            "From the evidence of a fault to this agent's reaction, by reason.",
            _LABELS + ("reason",), buckets=_DETECT_BUCKETS_S, registry=r)
        self._recover = Histogram(
            "elasticd_recover_seconds",
            "From the stop of the workers to the first step of every worker of a later "
            "round, by the stop's reason.",
            _LABELS + ("reason",), buckets=_RECOVER_BUCKETS_S, registry=r)
        self._rendezvous = _series(r, ids, Histogram, "elasticd_rendezvous_seconds",
                                   "From entering JOINING to STARTING a round.",
                                   buckets=_RENDEZVOUS_BUCKETS_S)
        self._store_errors = Counter("elasticd_etcd_errors",
                                     "etcd errors met by the agent's loop, by operation.",
                                     _LABELS + ("op",), registry=r)
        self._define_worker_series(r, ids)
        self._define_gpu_series(r, ids)
        self._hang_attributions = Counter(
            "elasticd_hang_attributions",
            "Hang verdicts of this node, by the rule that named the culprit from the ranks' "
            "stacks (agent.hang_attribution.HangKind).", _LABELS + ("kind",), registry=r)
        for kind in HangKind:
            self._hang_attributions.labels(*ids, kind.value)
        self._define_straggler_series(r, ids)
        self._states_source: Callable[[], Iterable[str]] = tuple
        self._goodput_source: Callable[[], goodput.Snapshot | None] = lambda: None
        r.register(_GoodputCollector(ids, lambda: self._goodput_source()))
        r.register(_WorkersCollector("elasticd_workers",
                                     "This node's workers of the running round, by state.",
                                     ids, lambda: self._states_source()))
        # Every series exists from the start, so rate() and "== 1" queries work.
        for reason in RESTART_REASONS:
            self._restarts.labels(*ids, reason)
        for op in STORE_OPS:
            self._store_errors.labels(*ids, op)
        for state in AgentState:
            self._state.labels(*ids, state.value).set(0)
        self._joining_since: float | None = None
        # (reason, monotonic time) of the first stop not yet recovered from.
        self._unrecovered: tuple[str, float] | None = None
        self._server = None
        self._thread = None

    def _define_worker_series(self, r: CollectorRegistry, ids: tuple[str, str]) -> None:
        """The series fed by the workers: steps, heartbeats, checkpoints."""
        self._step = _series(r, ids, Gauge, "elasticd_step",
                             "The newest step this node's workers reported.")
        self._step_rate = _series(r, ids, Gauge, "elasticd_step_rate",
                                  "Steps per second of this node's slowest worker.")
        self._heartbeats = _series(r, ids, Counter, "elasticd_worker_heartbeats",
                                   "Heartbeats received from this node's workers.")
        self._save_seconds = _series(
            r, ids, Histogram, "elasticd_checkpoint_save_seconds",
            "Checkpoint saves committed through this agent: from save() to the commit.",
            buckets=_CHECKPOINT_BUCKETS_S)
        self._save_bytes = _series(
            r, ids, Counter, "elasticd_checkpoint_save_bytes",
            "Bytes of the checkpoints committed through this agent (all ranks' files).")
        self._checkpoint_step = _series(r, ids, Gauge, "elasticd_checkpoint_step",
                                        "The step of the last checkpoint committed here.")
        self._restore_seconds = _series(r, ids, Histogram, "elasticd_checkpoint_restore_seconds",
                                        "Checkpoint restores reported by this node's rank 0.",
                                        buckets=_CHECKPOINT_BUCKETS_S)
        self._restore_bytes = _series(
            r, ids, Counter, "elasticd_checkpoint_restore_bytes",
            "Bytes of the checkpoints restored by this node's rank 0 (all ranks' files).")

    def _define_straggler_series(self, r: CollectorRegistry, ids: tuple[str, str]) -> None:
        """The leader's straggler detection (agent.stragglers): rank and node
        are labels of the slowdown gauge only while the rank is named, so the
        series stay as few as the stragglers."""
        self._stragglers = Counter(
            "elasticd_stragglers", "Ranks this node, as leader, named stragglers, by what "
            "it did about them (reported; drained: their node left for a standby).",
            _LABELS + ("action",), registry=r)
        for outcome in STRAGGLER_OUTCOMES:
            self._stragglers.labels(*ids, outcome)
        self._straggler_slowdown = Gauge(
            "elasticd_straggler_slowdown", "Time per step over the peers' median, by the "
            "measure it is named by (wall or busy), of each rank the leader names a "
            "straggler now.", _LABELS + ("rank", "straggler_node"),
            registry=r)

    def _define_gpu_series(self, r: CollectorRegistry, ids: tuple[str, str]) -> None:
        """The series of the GPU checks before a round (``--gpu-check``)."""
        self._gpu_checks = Counter(
            "elasticd_gpu_checks", "GPU checks before a round, by verdict (pass, warn, leave).",
            _LABELS + ("result",), registry=r)
        self._gpu_problems = Counter(
            "elasticd_gpu_check_problems", "Problems found by the GPU checks, by kind.",
            _LABELS + ("problem",), registry=r)
        self._gpu_check_seconds = _series(
            r, ids, Histogram, "elasticd_gpu_check_seconds",
            "From the start of a round on this node to the GPU check's verdict (mostly the "
            "wait for the last round's processes to release GPU memory).",
            buckets=_GPU_CHECK_BUCKETS_S)
        for result in GPU_CHECK_RESULTS:
            self._gpu_checks.labels(*ids, result)
        for problem in GPU_PROBLEMS:
            self._gpu_problems.labels(*ids, problem)

    # ------------------------------------------------------------ the loop

    def observe(self, event: reactor.Event, after: reactor.AgentView,
                commands: Sequence[reactor.Command], now: float) -> None:
        ids = (self.job_id, self.node_id)
        for command in commands:
            if isinstance(command, reactor.StartWorkers):
                self._rounds_started.inc()
        if isinstance(event, reactor.HangAttributed) and any(
                isinstance(c, reactor.StopWorkers) for c in commands):
            self._hang_attributions.labels(*ids, event.kind.value).inc()
        if isinstance(event, reactor.GpuChecked) and event.decision.action is not GpuAction.WAIT:
            self._gpu_checks.labels(*ids, event.decision.action.value).inc()
            for problem in event.decision.problems:
                self._gpu_problems.labels(*ids, problem).inc()
            self._gpu_check_seconds.observe(event.decision.waited_s)
        self._round.set(after.round_number)
        self._world_size.set(after.round.world_size if after.round is not None else 0)
        restart = next((c for c in commands
                        if isinstance(c, reactor.StopWorkers) and c.cause.restart), None)
        if restart is not None:
            reason = restart.cause.value
            self._restarts.labels(*ids, reason).inc()
            if restart.detect_s is not None:
                self._detect.labels(*ids, reason).observe(max(0.0, restart.detect_s))
            if self._unrecovered is None:
                self._unrecovered = (reason, now)
        unrecovered = self._unrecovered
        if unrecovered is None:
            return
        reason, stopped_at = unrecovered
        if after.state is AgentState.STANDBY or after.state.final:
            self._unrecovered = None  # the job goes on (or ends) without this node
        elif (isinstance(event, reactor.Tick) and event.workers_stepped
              and after.state is AgentState.RUNNING):
            # The loop gives the workers of a new round fresh records (no step
            # yet) as it starts them: "stepped" in RUNNING is the new round's.
            self._recover.labels(*ids, reason).observe(now - stopped_at)
            self._unrecovered = None

    def observe_transition(self, state: AgentState, now: float) -> None:
        ids = (self.job_id, self.node_id)
        for s in AgentState:
            self._state.labels(*ids, s.value).set(1 if s is state else 0)
        if state is AgentState.JOINING:
            self._joining_since = now
        elif state is AgentState.STARTING and self._joining_since is not None:
            self._rendezvous.observe(max(0.0, now - self._joining_since))
            self._joining_since = None
        else:
            # A standby waits for room, not for a rendezvous.
            self._joining_since = None

    def store_error(self, op: str) -> None:
        self._store_errors.labels(self.job_id, self.node_id,
                                  op if op in STORE_OPS else "other").inc()

    def straggler_named(self, outcome: str) -> None:
        self._stragglers.labels(self.job_id, self.node_id,
                                outcome if outcome in STRAGGLER_OUTCOMES else "reported").inc()

    def stragglers_now(self, named: Iterable[tuple[int, str, float]]) -> None:
        self._straggler_slowdown.clear()
        for rank, node_id, ratio in named:
            self._straggler_slowdown.labels(self.job_id, self.node_id, str(rank),
                                            node_id).set(ratio)

    # ------------------------------------------------------------ the workers

    def observe_heartbeat(self, step: int, step_rate: float) -> None:
        self._heartbeats.inc()
        if step >= 0:
            self._step.set(step)
        self._step_rate.set(step_rate if math.isfinite(step_rate) and step_rate > 0 else 0.0)

    def observe_save(self, step: int, seconds: float, size_bytes: int) -> None:
        self._checkpoint_step.set(step)
        if math.isfinite(seconds) and seconds > 0:
            self._save_seconds.observe(seconds)
        if size_bytes > 0:
            self._save_bytes.inc(size_bytes)

    def observe_restore(self, seconds: float, size_bytes: int) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._restore_seconds.observe(seconds)
        if size_bytes > 0:
            self._restore_bytes.inc(size_bytes)

    def count_workers_with(self, states: Callable[[], Iterable[str]]) -> None:
        self._states_source = states

    def watch_memory_tier(self, status: Callable[[], MemoryTierRow]) -> None:
        self.registry.register(_MemoryTierCollector(self._ids, status))

    def watch_goodput(self, snapshot: Callable[[], goodput.Snapshot]) -> None:
        self._goodput_source = snapshot

    # ------------------------------------------------------------ serving

    def serve(self, host: str, port: int) -> str:
        """Serve ``/metrics`` on ``host:port`` from a thread of its own; returns
        its URL. Raises ConfigError when the port cannot be bound."""
        addr = host.strip("[]")
        try:
            self._server, self._thread = start_http_server(port, addr=addr,
                                                           registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot serve metrics on {host}: "
                              f"{exc}") from exc
        url = f"http://{HostPort(addr, port)}/metrics"
        self._log.info("serves Prometheus metrics at %s.", url)
        return url

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _series(registry: CollectorRegistry, ids: tuple[str, str], kind, name: str,
            documentation: str, **options):
    """The one series of metric ``name`` (a Counter, Gauge or Histogram) for
    this node: labelled ``job_id`` and ``node_id`` only."""
    return kind(name, documentation, _LABELS, registry=registry, **options).labels(*ids)


class _WorkersCollector:
    """``elasticd_workers{state}``, read from the agent at each scrape: the
    known states always, at 0 when no worker is in them."""

    def __init__(self, name: str, documentation: str, ids: tuple[str, str],
                 states: Callable[[], Iterable[str]]):
        self._name = name
        self._documentation = documentation
        self._ids = ids
        self._states = states

    def collect(self):
        counts = dict.fromkeys(WORKER_STATES, 0)
        for state in self._states():
            counts[state] = counts.get(state, 0) + 1
        family = GaugeMetricFamily(self._name, self._documentation,
                                   labels=_LABELS + ("state",))
        for state, n in counts.items():
            family.add_metric([*self._ids, state], n)
        yield family

    def describe(self):
        # Without this, registering would call collect() (and the agent) at once.
        yield GaugeMetricFamily(self._name, self._documentation, labels=_LABELS + ("state",))


class _MemoryTierCollector:
    """The memory tier's series, read from the agent at each scrape:
    ``elasticd_memory_tier_bytes{kind=own|replica}``, the need, the
    replication rate and how many steps the buddy's copy trails."""

    def __init__(self, ids: tuple[str, str], status: Callable[[], MemoryTierRow]):
        self._ids = ids
        self._status = status

    def _families(self, row: MemoryTierRow | None):
        held = GaugeMetricFamily("elasticd_memory_tier_bytes",
                                 "Bytes of memory-tier snapshots held on this node, by kind.",
                                 labels=_LABELS + ("kind",))
        need = GaugeMetricFamily("elasticd_memory_tier_need_bytes",
                                 "The most the memory tier may hold on this node: twice the "
                                 "own snapshot plus twice the replica.", labels=_LABELS)
        rate = GaugeMetricFamily("elasticd_memory_replication_bytes_per_second",
                                 "Bytes per second of the recent replications to the buddy.",
                                 labels=_LABELS)
        lag = GaugeMetricFamily("elasticd_memory_replication_lag_steps",
                                "Steps the buddy's copy trails this node's newest snapshot.",
                                labels=_LABELS)
        if row is not None:
            held.add_metric([*self._ids, "own"], row.own_bytes)
            held.add_metric([*self._ids, "replica"], row.replica_bytes)
            need.add_metric(list(self._ids), row.need_bytes)
            rate.add_metric(list(self._ids), row.replication_bytes_per_s)
            lag.add_metric(list(self._ids), row.lag_steps)
        return [held, need, rate, lag]

    def collect(self):
        yield from self._families(self._status())

    def describe(self):
        yield from self._families(None)


class _GoodputCollector:
    """``elasticd_goodput_seconds{kind, cause}`` and ``elasticd_ettr``, read
    from the agent's goodput tracker at each scrape: every (kind, cause) pair
    always, at 0 until time is charged to it."""

    def __init__(self, ids: tuple[str, str], snapshot: Callable[[], goodput.Snapshot | None]):
        self._ids = ids
        self._snapshot = snapshot

    def _families(self, snap: goodput.Snapshot | None):
        seconds = CounterMetricFamily(
            "elasticd_goodput_seconds",
            "Where the job's wall time went as this node sees it, by kind (productive, "
            "repeated, recovery, other) and cause (agent.goodput).",
            labels=_LABELS + ("kind", "cause"))
        ettr = GaugeMetricFamily(
            "elasticd_ettr", "Effective training time ratio: productive over accounted time "
            "in the last --goodput-window (-1: nothing accounted yet).", labels=_LABELS)
        totals = snap.totals if snap is not None else {}
        for kind, cause in goodput.series():
            seconds.add_metric([*self._ids, kind.value, cause], totals.get((kind, cause), 0.0))
        if snap is not None:
            ettr.add_metric(list(self._ids), -1.0 if snap.ettr is None else snap.ettr)
        return [seconds, ettr]

    def collect(self):
        yield from self._families(self._snapshot())

    def describe(self):
        yield from self._families(None)
