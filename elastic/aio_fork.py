"""grpc.aio and fork(): keep a forked child from hanging in grpc's aio shutdown.

grpc.aio holds a process-wide state (a completion queue and its poller
thread) while any aio channel or server exists, and shuts it down, joining
that thread, when the last one is deallocated. A child made by ``fork()``
(``os.fork``, or multiprocessing's default start method on Linux) inherits
the parent's aio objects but none of its threads. If the child's garbage
collector frees the last of them (one the parent had dropped but not yet
collected), the shutdown waits forever for a thread that does not exist
there: any process that closed a store and then forks (a process pool, a
warm worker) can hang in its child.

Every aio channel and server this project makes goes through :func:`track`.
A child that inherits any of them takes one more reference on grpc's aio
state, so that the child never shuts it down.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TypeVar

import grpc.aio

T = TypeVar("T")

_tracked: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def track(aio_object: T) -> T:
    """Note an aio channel or server made in this process; returns it."""
    global _hooked
    with _lock:
        _tracked.add(aio_object)
        if not _hooked:
            os.register_at_fork(after_in_child=_hold_in_child)
            _hooked = True
    return aio_object


def _hold_in_child() -> None:
    # Only where aio objects came along: elsewhere this would start grpc's aio
    # machinery in a child that never asked for it.
    if len(_tracked):
        grpc.aio.init_grpc_aio()
