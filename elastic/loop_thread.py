"""An asyncio event loop on a daemon thread of its own, driven from other threads.

The agent's grpc.aio servers and each etcd store's streams run on one each;
everything else in the process stays synchronous and hands them work here.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class LoopThread:
    """A loop running on thread ``name`` from construction until :meth:`close`."""

    def __init__(self, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Awaitable[T], timeout_s: float | None) -> T:
        """Run ``coro`` on the loop and return its result (or raise what it
        raised); TimeoutError after ``timeout_s`` (None: no limit)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def call_soon(self, fn: Callable, *args) -> bool:
        """Run ``fn(*args)`` on the loop soon; False once the loop is closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the loop and its thread (waiting at most ``timeout_s``); then close the loop."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
