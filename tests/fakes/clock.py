"""A clock that moves only when a test says so."""

from __future__ import annotations

import threading

DEFAULT_MONOTONIC_S = 1_000.0
DEFAULT_WALL_S = 1_700_000_000.0


class FakeClock:
    """Implements :class:`elastic.clock.Clock`; time stands still until :meth:`advance`.

    Both clocks start at fixed values (so logs and records in tests are
    reproducible) and move together. Safe to read and advance from any thread.
    """

    def __init__(self, monotonic_s: float = DEFAULT_MONOTONIC_S, wall_s: float = DEFAULT_WALL_S):
        self._lock = threading.Lock()
        self._monotonic_s = float(monotonic_s)
        self._wall_s = float(wall_s)

    # Reading one attribute is atomic; the lock only keeps advance()'s two
    # writes together (the simulator reads the clock about 2,000 times a schedule).
    def monotonic(self) -> float:
        return self._monotonic_s

    def wall(self) -> float:
        return self._wall_s

    def advance(self, seconds: float) -> float:
        """Move both clocks forward by ``seconds``; returns the new monotonic time.

        Raises ValueError for a negative step: a monotonic clock never goes back.
        """
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        with self._lock:
            self._monotonic_s += seconds
            self._wall_s += seconds
            return self._monotonic_s
