"""The process's shared event loop (elastic.loop_thread): one loop for every
grpc.aio user, alive while any of them holds it, and a forked child's own."""

from __future__ import annotations

import asyncio
import os

from elastic.loop_thread import acquire_shared, release_shared, shared_users


async def _thread_name() -> str:
    import threading

    return threading.current_thread().name


def test_users_share_one_loop_until_the_last_gives_it_back():
    held = shared_users()  # other tests' stores may hold it too
    first, second = acquire_shared(), acquire_shared()
    assert first is second
    assert shared_users() == held + 2
    assert first.run(_thread_name(), 5.0) == "elastic-aio"
    release_shared(first)
    assert first.run(_thread_name(), 5.0) == "elastic-aio", "stopped with a user left"
    release_shared(second)
    assert shared_users() == held
    if held == 0:
        assert not first.call_soon(print), "the last user gave it back, yet it runs"
        third = acquire_shared()
        try:
            assert third is not first and third.run(_thread_name(), 5.0) == "elastic-aio"
        finally:
            release_shared(third)


def test_giving_back_a_loop_that_is_no_longer_shared_changes_nothing():
    held = shared_users()
    loop = acquire_shared()
    release_shared(loop)
    if held == 0:  # it stopped; a stale handle must not count against the next loop
        fresh = acquire_shared()
        release_shared(loop)
        try:
            assert shared_users() == 1 and fresh.run(asyncio.sleep(0, "ok"), 5.0) == "ok"
        finally:
            release_shared(fresh)


def test_a_forked_child_starts_a_loop_of_its_own():
    loop = acquire_shared()
    try:
        loop.run(asyncio.sleep(0), 5.0)
        child = os.fork()
        if child == 0:  # the parent's loop thread does not exist here
            code = 1
            try:
                mine = acquire_shared()
                code = 0 if mine is not loop and mine.run(asyncio.sleep(0, 7), 5.0) == 7 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release_shared(loop)
