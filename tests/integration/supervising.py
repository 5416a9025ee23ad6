"""Helpers for the tests that drive a WorkerSupervisor with real processes
(tests/integration/test_supervisor.py, tests/integration/test_warm_template.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from agent.supervisor import WorkerExit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def round_envs(n: int, **extra: str) -> list[dict[str, str]]:
    return [{"RANK": str(10 + i), "LOCAL_RANK": str(i), "WORLD_SIZE": str(n),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **extra} for i in range(n)]


class Exits:
    """on_exit collector."""

    def __init__(self):
        self.seen: list[WorkerExit] = []
        self._cond = threading.Condition()

    def __call__(self, e: WorkerExit) -> None:
        with self._cond:
            self.seen.append(e)
            self._cond.notify_all()

    def wait(self, n: int, timeout_s: float = 10.0) -> list[WorkerExit]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.seen) >= n, timeout_s):
                raise AssertionError(f"expected {n} exits within {timeout_s} s, got {self.seen}")
            return sorted(self.seen, key=lambda e: e.local_rank)


def check_exits_reported(got: list[WorkerExit], marks: Path, modes: list[str], hang_pid: int,
                         killed_at: float) -> None:
    """Four ranks' exits, by local rank: status 0, 3, 1 (an uncaught exception) and a
    SIGKILL of ``hang_pid`` at ``killed_at``, each reported within half a second of
    the end: ``marks/<mode>`` holds the monotonic time at which the first three
    (``modes``) were about to exit."""
    assert [(e.local_rank, e.exit_code, e.signal, e.stopped) for e in got] == [
        (0, 0, None, False), (1, 3, None, False), (2, 1, None, False),
        (3, 128 + signal.SIGKILL, signal.SIGKILL, False)]
    for e, mode in zip(got[:3], modes):
        exited_at = float((marks / mode).read_text())
        assert e.at - exited_at < 0.5, f"{mode}: reported {e.at - exited_at:.3f} s after exit"
    assert got[3].at - killed_at < 0.5
    assert got[3].pid == hang_pid


def kill(pid: int) -> float:
    """SIGKILL ``pid``; the monotonic time just before."""
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return killed_at
