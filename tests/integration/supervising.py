"""Helpers for the tests that drive a WorkerSupervisor with real processes
(tests/integration/test_supervisor.py, tests/integration/test_warm_template.py)."""

from __future__ import annotations

import os
import threading

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
