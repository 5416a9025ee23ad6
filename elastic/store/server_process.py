"""The embedded etcd's child process: spawning it with a parent-death guard,
signalling its process group, and stopping it with a grace period.

Part of :mod:`elastic.store.server`, which decides what to run and when it is
ready; this module only supervises the process.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import sys
from typing import Sequence

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
"""How long etcd has to exit after SIGTERM before it is killed."""
_LOG_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1


def parent_death_guard():
    """A preexec_fn that makes the kernel SIGKILL the child when its parent dies.

    The libc function is resolved here, in the parent, so the child only makes
    one foreign call between fork and exec. Note that Linux ties the signal to
    the *thread* that forked: start servers from a long-lived thread.
    None where there is no such guard (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent_pid = os.getpid()

    def guard() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return guard


def log_tail(path: str | None) -> str:
    """The last lines of the log at ``path``, or "(no log)"."""
    try:
        with open(path, "r", errors="replace") as f:
            return "".join(collections.deque(f, maxlen=_LOG_TAIL_LINES))
    except (OSError, TypeError):
        return "(no log)"


class ServerProcess:
    """At most one child process at a time, in its own process group (so
    signals reach only it), killed by the kernel if this process dies.
    :meth:`spawn` replaces the last one, which must have ended."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._paused = False

    @property
    def pid(self) -> int | None:
        """The child's pid (None: never spawned)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self, command: Sequence[str], log_path: str, header: str,
              cwd: str | None = None) -> None:
        """Start ``command`` with its output appended to ``log_path`` after
        the line ``header``. Raises OSError if it cannot be started."""
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"{header}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: signals reach only etcd
                preexec_fn=parent_death_guard(),
                close_fds=True,
                cwd=cwd,
            )
        self._paused = False

    def kill(self) -> None:
        """SIGKILL the child at once and reap it."""
        if self.running:
            self._signal(signal.SIGKILL)
            self._proc.wait()
        self._paused = False

    def pause(self) -> None:
        """Freeze the child (SIGSTOP)."""
        if self.running:
            self._signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Thaw the child after :meth:`pause` (SIGCONT)."""
        if self.running:
            self._signal(signal.SIGCONT)
        self._paused = False

    def terminate(self) -> None:
        """Stop the child: SIGTERM (thawing it if paused), then SIGKILL after
        :data:`STOP_GRACE_S`. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._signal(signal.SIGTERM)
            if self._paused:
                self._signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("etcd (pid %d) ignored SIGTERM for %.0f s; killing it.",
                               proc.pid, STOP_GRACE_S)
                self._signal(signal.SIGKILL)
                proc.wait()
        self._paused = False

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self._proc.pid, signum)
        except ProcessLookupError:
            pass
