"""The store's retry policy, in one place.

Retry only what is safe to repeat, only while the store is unavailable, with
exponential backoff and jitter, and never past the caller's deadline: every
attempt gets the time that is left, the last sleep is cut short so that the
last attempt still gets a useful slice, and no retry starts with less than
that slice left. Everything else fails fast.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

import tenacity

T = TypeVar("T")

INITIAL_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
JITTER_S = 0.05
MIN_ATTEMPT_S = 0.05  # no retry starts with less time than this left


def call_with_retry(
    attempt: Callable[[float], T],
    *,
    deadline: float,
    is_retryable: Callable[[BaseException], bool],
    on_retry: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``attempt(seconds_left)`` until it returns or fails for good.

    ``deadline`` is a ``clock()`` time. ``on_retry`` is called before each
    repeat (to count them). The last error is re-raised unchanged when it is
    not retryable or when no time is left for another attempt.
    """

    backoff = tenacity.wait_exponential(multiplier=INITIAL_BACKOFF_S, max=MAX_BACKOFF_S)

    def wait(state: tenacity.RetryCallState) -> float:
        # Never sleep into the last MIN_ATTEMPT_S: the final try gets that much.
        left = deadline - clock() - MIN_ATTEMPT_S
        return max(0.0, min(backoff(state) + random.uniform(0.0, JITTER_S), left))

    def stop(state: tenacity.RetryCallState) -> bool:
        return deadline - clock() <= MIN_ATTEMPT_S

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_retryable),
        wait=wait,
        stop=stop,
        before_sleep=(lambda _state: on_retry()) if on_retry is not None else None,
        sleep=sleep,
        reraise=True,
    )
    return retrying(lambda: attempt(max(deadline - clock(), 0.0)))


def reconnect_delay(failures: int) -> float:
    """The same backoff for loops that reconnect until cancelled (watches, the
    keep-alive stream): the pause after ``failures`` failures in a row."""
    base = min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** min(max(failures - 1, 0), 30))
    return base + random.uniform(0.0, JITTER_S)
