"""Waiting in tests for something that real processes and threads bring about."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, *,
               poll_s: float = 0.01, context: Callable[[], str] | None = None) -> T:
    """Call ``predicate`` every ``poll_s`` until it returns something true, and
    return that.

    Raises:
        AssertionError: not within ``timeout_s``; the message names ``what``
            and adds ``context()`` (say, the output of the processes involved).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            more = f"\n{context()}" if context is not None else ""
            raise AssertionError(f"not within {timeout_s:g} s: {what}{more}")
        time.sleep(poll_s)


# What an upper bound on a real call's duration must allow beyond the call's
# own time: on two cores shared at load 20 a thread can wait seconds for its
# turn. Such bounds catch hangs (a timeout ignored, a wait for a default
# deadline or a long backoff), not slowness; lower bounds stay exact.
LOADED_SLACK_S = 5.0
