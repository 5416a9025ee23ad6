"""systemd's notify protocol (``Type=notify``, ``WatchdogSec=``), without libsystemd.

systemd passes ``NOTIFY_SOCKET`` (a Unix datagram socket; a leading ``@``
means the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``
(and ``WATCHDOG_PID``). The agent sends:

- ``READY=1`` once it is registered with the rendezvous (``systemctl start``
  returns then, and units ordered after it start);
- ``STATUS=...`` when its state changes (``systemctl status`` shows it);
- ``WATCHDOG=1`` from its main loop, every half watchdog interval: a loop that
  stops turning stops the pings, and systemd restarts the unit;
- ``STOPPING=1`` when a signal makes it leave.

The variables are removed from the environment when the notifier is built,
so that workers (which inherit it) never talk to systemd in the agent's name.
Without ``NOTIFY_SOCKET`` every call does nothing. Sending never raises: a
notification lost is logged once, and never stops the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import MutableMapping

from elastic.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class SystemdNotifier:
    """Notifications to systemd for this process (see the module docstring)."""

    def __init__(self, environ: MutableMapping[str, str] | None = None,
                 clock: Clock = SYSTEM_CLOCK):
        environ = os.environ if environ is None else environ
        values = {name: environ.pop(name, "") for name in _ENV}
        self._clock = clock
        self._address = _address(values["NOTIFY_SOCKET"])
        self.watchdog_interval_s = _watchdog_interval(values["WATCHDOG_USEC"],
                                                      values["WATCHDOG_PID"])
        self._last_ping: float | None = None
        self._ready = False
        self._status = ""
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self, status: str) -> None:
        """``READY=1`` with a status line; only the first call sends READY."""
        if not self._ready:
            self._ready = True
            self._status = status
            self._send(f"READY=1\nSTATUS={status}")
        else:
            self.status(status)

    def status(self, status: str) -> None:
        """``STATUS=...``, when it differs from the last one sent."""
        if status != self._status:
            self._status = status
            self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        """``WATCHDOG=1`` if half the watchdog interval has passed since the last ping."""
        if self.watchdog_interval_s is None:
            return
        now = self._clock.monotonic()
        if self._last_ping is None or now - self._last_ping >= self.watchdog_interval_s / 2:
            self._last_ping = now
            self._send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self._status = status
        self._send(f"STOPPING=1\nSTATUS={status}")

    def _send(self, message: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(message.encode(), self._address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("Could not notify systemd at %r (%s); carrying on without it.",
                            self._address, exc)


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):  # the abstract namespace
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    log.warning("Ignoring NOTIFY_SOCKET=%r: not a Unix socket path.", value)
    return None


def _watchdog_interval(usec: str, pid: str) -> float | None:
    """The watchdog interval in seconds, or None when there is none for this process."""
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (the variables leaked to a child)
    try:
        value = int(usec)
    except ValueError:
        log.warning("Ignoring WATCHDOG_USEC=%r: not a number of microseconds.", usec)
        return None
    return value / 1e6 if value > 0 else None
