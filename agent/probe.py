"""Probing a peer agent: how long it has answered nothing, counting only its silence.

A :class:`PeerProbe` sends the peer one ``grpc.health.v1`` Check every
:data:`PROBE_INTERVAL_S` without waiting for the one before: each may be
answered up to :data:`ANSWER_WAIT_S` later, and any answer (any health
status) proves the peer alive, however late it comes, so a slow network or a
busy peer is never taken for a frozen one. The pure :class:`Silence` keeps
the account:

* The peer is silent since its last answer arrived (or since probing began).
* It proves nothing before :data:`MIN_UNANSWERED_PROBES` probes went out
  since then.
* A probe sent much later than due means this agent itself was paused (its
  node frozen, a swap storm): answers could not arrive meanwhile, so the
  silence starts over. A node that thaws never reports its peers frozen for
  the time it was frozen itself.

While the peer stays silent, ``on_silent(silent_s)`` is called at every
probe; the agent's reactor decides what is long enough (``--freeze-timeout``).
Only while a round runs, and one peer per agent.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

from elastic.clock import SYSTEM_CLOCK, Clock

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.25
# How long an answer may take and still count.
ANSWER_WAIT_S = 2.0
# The deadline of the decider's own check of a node reported frozen
# (elastic.rendezvous.revoke): long enough for a slow network's answer, short
# beside the freeze timeout it adds to when the reporter does not decide.
LEADER_CHECK_S = 0.5
# A probe this much later than due: this agent was paused, not the peer.
PAUSE_SLACK_S = 0.25
MIN_UNANSWERED_PROBES = 2


@dataclasses.dataclass(frozen=True)
class Silence:
    """A peer's silence as the probes saw it (monotonic times)."""

    since: float  # the peer's last answer, or when probing (re)started
    unanswered: int = 0  # probes sent since
    last_sent: float | None = None

    def silent_s(self, now: float) -> float:
        """How long the peer has answered nothing, once enough probes went out (else 0)."""
        return now - self.since if self.unanswered >= MIN_UNANSWERED_PROBES else 0.0

    def sent(self, now: float) -> Silence:
        """A probe went out at ``now``."""
        if self.last_sent is not None and now - self.last_sent > PROBE_INTERVAL_S + PAUSE_SLACK_S:
            return Silence(now, 1, now)
        return Silence(self.since, self.unanswered + 1, now)

    def answered(self, now: float) -> Silence:
        """An answer arrived at ``now``."""
        return Silence(max(self.since, now), 0, self.last_sent)


class PeerProbe:
    """Probes one peer from a daemon thread until stopped (see the module docstring).

    ``send(on_answer)`` sends one probe and returns at once; it calls
    ``on_answer()`` (from any thread) if and when the peer answers it, and
    never raises. An exception from ``on_silent`` is logged and does not stop
    the probe.
    """

    def __init__(self, addr: str, send: Callable[[Callable[[], None]], None],
                 on_silent: Callable[[float], None], *, clock: Clock = SYSTEM_CLOCK):
        self._addr = addr
        self._send = send
        self._on_silent = on_silent
        self._clock = clock
        self._stopped = threading.Event()
        # Guards the silence (answers arrive on gRPC's threads) and on_silent
        # calls: stop() waits for a call in progress only.
        self._lock = threading.Lock()
        self._silence = Silence(clock.monotonic())
        self._thread = threading.Thread(target=self._run, name=f"probe-{addr}", daemon=True)

    def start(self) -> PeerProbe:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop probing; no on_silent call starts after this returns. Never
        waits for an answer: a peer that stops answering must not delay the
        stop of a round."""
        with self._lock:
            self._stopped.set()

    def _answered(self) -> None:
        with self._lock:
            self._silence = self._silence.answered(self._clock.monotonic())

    def _run(self) -> None:
        while not self._stopped.is_set():
            now = self._clock.monotonic()
            with self._lock:
                self._silence = self._silence.sent(now)
                silent_s = self._silence.silent_s(now)
            self._send(self._answered)
            if silent_s > 0:
                self._report(silent_s)
            self._stopped.wait(max(0.0, now + PROBE_INTERVAL_S - self._clock.monotonic()))

    def _report(self, silent_s: float) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            try:
                self._on_silent(silent_s)
            except Exception:  # noqa: BLE001 (a broken callback must not end the probe)
                logger.exception("The silence callback for the agent at %s failed.", self._addr)
