"""``--gpu-check`` in the agent: this node's GPUs read and judged before it
joins (``enforce``) and before each round's workers start (``warn`` and
``enforce``), by the rules of :mod:`agent.gpu_health`."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable, Protocol

from agent import gpu_health, reactor
from agent.config import AgentConfig
from agent.gpu_health import GpuAction, GpuObservation, GpuReader, NvmlReading
from elastic.clock import Clock
from elastic.errors import GpuError, NodeUnfitError


class Workers(Protocol):
    """What the gate needs of the worker supervisor (:class:`agent.daemon.Supervisor`):
    each worker's ``pid`` and ``alive``."""

    def workers(self) -> list: ...
    def warm_workers(self) -> list: ...


class GpuGate:
    """Reads this node's GPUs (NVML) and what is left of its last round's
    workers, and judges them."""

    def __init__(self, config: AgentConfig, reader: GpuReader, supervisor: Workers,
                 clock: Clock, sleep: Callable[[float], None], log: logging.LoggerAdapter):
        self._config = config
        self._reader = reader
        self._supervisor = supervisor
        self._clock = clock
        self._sleep = sleep  # only between reads before joining
        self._log = log

    def before_joining(self) -> None:
        """With ``--gpu-check enforce``, a node whose GPUs are unfit does not
        join at all: joining only to leave before the first round would
        restart the others' workers twice (each time systemd or Kubernetes
        starts the agent again). Waits, as before a round, for processes to
        let go of the GPUs (those of this node's previous agent, killed with
        it). Raises NodeUnfitError."""
        expected = self._config.gpu_expectation
        if self._config.gpu_check != "enforce" or not expected.selectors:
            return
        decision = gpu_health.decide_when_settled(
            lambda: GpuObservation(self._read()), expected, "enforce", self._sleep)
        if decision.action is GpuAction.LEAVE:
            raise NodeUnfitError(f"job {self._config.job_id}: node {self._config.node_id} does "
                                 f"not join: GPU check failed (--gpu-check enforce): "
                                 f"{decision.reason}")
        self._log.info("GPU check passed before joining: %s", decision.reason)

    def check(self, command: reactor.CheckGpus,
              record: Callable[[int, str, str], None]) -> reactor.GpuChecked:
        """The answer to ``command``: the GPUs read (NVML is not read when none
        is expected), with what is left of the last round's workers, judged by
        :func:`agent.gpu_health.decide`. A verdict is ``record``-ed as an
        event (round, kind, message) unless it says to wait, or passes a node
        that expects no GPU."""
        expected = self._config.gpu_expectation
        reading = (self._read() if expected.selectors
                   else NvmlReading(unavailable="not read: no GPUs expected"))
        last = self._supervisor.workers()
        ours = frozenset(w.pid for w in last)
        warm = frozenset(w.pid for w in self._supervisor.warm_workers())
        observed = GpuObservation(
            reading, leftovers=tuple(w.pid for w in last if w.alive), last_round_pids=ours,
            warm_pids=warm, foreign_pids=live_pids_among(
                (p.pid for g in reading.gpus for p in g.processes), exclude=ours | warm))
        decision = gpu_health.decide(observed, expected, self._config.gpu_check, command.since,
                                     self._clock.monotonic())
        if decision.action is not GpuAction.WAIT and (
                decision.action is not GpuAction.PASS or expected.selectors):
            if decision.action is GpuAction.PASS:
                self._log.info("GPU check passed: %s", decision.reason)
            record(command.round, gpu_health.EVENT_KINDS[decision.action], decision.reason)
        return reactor.GpuChecked(command.round, decision)

    def close(self) -> None:
        self._reader.close()

    def _read(self) -> NvmlReading:
        try:
            return self._reader.read()
        except GpuError as exc:
            return NvmlReading(unavailable=str(exc))


def live_pids_among(pids: Iterable[int], exclude: frozenset[int]) -> frozenset[int]:
    """Those of ``pids`` (NVML's, for GPU memory holders) that are live processes
    here and not in ``exclude``. In a container without the host's pid
    namespace NVML gives host pids, which are not found here: those count as
    possibly ours, and the check waits for them as for the last round's."""
    return frozenset(pid for pid in pids
                     if pid not in exclude and os.path.exists(f"/proc/{pid}"))
