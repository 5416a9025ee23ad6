"""Probing a peer agent: how long it has answered nothing, counting only its silence.

A :class:`PeerProbe` sends the peer one ``grpc.health.v1`` Check every
:data:`PROBE_INTERVAL_S`, each with a deadline of :data:`PROBE_DEADLINE_S`,
and feeds every outcome to the pure :func:`observe`:

* An answer (any health status) ends a silence.
* A failed probe (no answer in time, the connection refused) extends it: the
  peer has been silent since its last answer (or, with none seen since this
  agent's own last pause, since the first failed probe started) until the
  failed probe's end. It proves nothing before :data:`MIN_FAILED_PROBES`
  failed in a row.
* A probe that took much longer than its deadline, or started much later
  than due, proves nothing about the peer: this agent itself was paused
  (its node frozen, a swap storm). The silence starts over, and the answer
  before the pause no longer counts, so a node that thaws never reports its
  peers frozen for the time it was frozen itself.

While the peer stays silent, ``on_silent(proven_s)`` is called after each
failed probe; the agent's reactor decides what is long enough
(``--freeze-timeout``). Cost: one small unary call per interval to one peer,
only while a round runs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

from elastic.clock import SYSTEM_CLOCK, Clock

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.25
PROBE_DEADLINE_S = 0.25
# A probe, or the gap since the one before, this much longer than due: this
# agent was paused, not the peer.
PAUSE_SLACK_S = 0.25
MIN_FAILED_PROBES = 2


@dataclasses.dataclass(frozen=True)
class Silence:
    """A peer's silence as the probes saw it (monotonic times)."""

    since: float | None = None  # silent since (None: answering)
    failed: int = 0  # failed probes in a row
    until: float | None = None  # end of the last probe (None: none yet)
    answered_at: float | None = None  # end of the last answered probe since this agent's pause

    @property
    def proven_s(self) -> float:
        """How long the peer has answered nothing, once enough probes failed (else 0)."""
        if self.since is None or self.until is None or self.failed < MIN_FAILED_PROBES:
            return 0.0
        return self.until - self.since


def observe(silence: Silence, started: float, ended: float, answered: bool) -> Silence:
    """The silence after a probe that ran from ``started`` to ``ended``."""
    # A probe starts at most an interval after the one before ended.
    late = silence.until is not None and started - silence.until > PROBE_INTERVAL_S + PAUSE_SLACK_S
    slow = ended - started > PROBE_DEADLINE_S + PAUSE_SLACK_S
    if answered or late or slow:
        return Silence(until=ended, answered_at=ended if answered else None)
    since = silence.since
    if since is None:
        since = silence.answered_at if silence.answered_at is not None else started
    return Silence(since, silence.failed + 1, ended, silence.answered_at)


class PeerProbe:
    """Probes one peer in a daemon thread until stopped (see the module docstring).

    ``check(addr)`` returns whether the agent at ``addr`` answered within
    :data:`PROBE_DEADLINE_S` and never raises; an exception from
    ``on_silent`` is logged and does not stop the probe.
    """

    def __init__(self, addr: str, check: Callable[[str], bool],
                 on_silent: Callable[[float], None], *, clock: Clock = SYSTEM_CLOCK):
        self._addr = addr
        self._check = check
        self._on_silent = on_silent
        self._clock = clock
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # held while on_silent runs: stop() waits for it only
        self._thread = threading.Thread(target=self._run, name=f"probe-{addr}", daemon=True)

    def start(self) -> PeerProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing; no on_silent call starts after this returns. Never
        waits for the probe in flight (it ends within its deadline): a peer
        that stops answering must not delay the stop of a round."""
        with self._lock:
            self._stopped.set()

    def _report(self, silent_s: float) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            try:
                self._on_silent(silent_s)
            except Exception:  # noqa: BLE001 (a broken callback must not end the probe)
                logger.exception("The silence callback for the agent at %s failed.", self._addr)

    def _run(self) -> None:
        silence = Silence()
        while not self._stopped.is_set():
            started = self._clock.monotonic()
            answered = self._check(self._addr)
            ended = self._clock.monotonic()
            silence = observe(silence, started, ended, answered)
            if silence.proven_s > 0:
                self._report(silence.proven_s)
            self._stopped.wait(max(0.0, started + PROBE_INTERVAL_S - self._clock.monotonic()))
