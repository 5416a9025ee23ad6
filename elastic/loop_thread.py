"""An asyncio event loop on a daemon thread of its own, driven from other threads.

Everything grpc.aio in a process (the agent's servers, every etcd store's
streams) shares one: :func:`acquire_shared`. Everything else in the process
stays synchronous and hands it work here. Why one: grpc.aio's poller thread
wakes every loop it serves for every event of any of them (they all watch
one socket), so each further loop costs a wake-up per gRPC message in the
process.
"""

from __future__ import annotations

import asyncio
import os
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


_shared_lock = threading.Lock()
_shared: LoopThread | None = None
_shared_users = 0


def acquire_shared() -> LoopThread:
    """The process's loop for grpc.aio, started by the first caller. Pair
    each call with :func:`release_shared`; never close it yourself."""
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            _shared = LoopThread("elastic-aio")
        _shared_users += 1
        return _shared


def release_shared(loop: LoopThread, timeout_s: float = 2.0) -> None:
    """One user of ``loop`` fewer; the last one stops it (waiting at most
    ``timeout_s``). A loop that is no longer the shared one is left alone."""
    global _shared, _shared_users
    with _shared_lock:
        if loop is not _shared:
            return
        _shared_users -= 1
        if _shared_users > 0:
            return
        _shared = None
    loop.close(timeout_s)


def shared_users() -> int:
    """How many users hold the shared loop now (0: it is not running)."""
    with _shared_lock:
        return _shared_users


def _forget_in_child() -> None:
    # A forked child has the loop object but not its thread: it starts its own.
    global _shared, _shared_users
    _shared, _shared_users = None, 0


os.register_at_fork(after_in_child=_forget_in_child)
