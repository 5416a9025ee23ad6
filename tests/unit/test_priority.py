"""Thread priorities of a warm worker's preload (elastic.worker.priority), on real threads."""

from __future__ import annotations

import os
import threading

import pytest

from elastic.worker import priority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def _in_thread(fn):
    """Run ``fn`` on a fresh thread; returns (its result, its native id). The thread
    stays alive until the caller releases it, so its id stays valid."""
    out: dict = {}
    release = threading.Event()

    def run():
        out["result"], out["tid"] = fn(), threading.get_native_id()
        out["done"].set()
        release.wait(10)

    out["done"] = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    out["done"].wait(10)
    return out["result"], out["tid"], lambda: (release.set(), thread.join(10))


def test_lowering_a_thread_leaves_the_rest_of_the_process_at_normal_priority():
    lowered, tid, release = _in_thread(priority.lower_this_thread)
    try:
        assert lowered and priority.is_idle(tid)
        assert not priority.is_idle(threading.get_native_id())
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this (main) thread
        if priority.io_class(tid) is not None:  # the syscall exists on this machine
            assert priority.io_class(tid) == 3
            assert priority.io_class(threading.get_native_id()) != 3
    finally:
        release()


def test_threads_started_by_a_lowered_thread_inherit_its_priority():
    def lower_then_start_one():
        priority.lower_this_thread()
        child: dict = {}
        t = threading.Thread(target=lambda: child.update(idle=priority.is_idle(
            threading.get_native_id())))
        t.start()
        t.join()
        return child["idle"]

    child_idle, _, release = _in_thread(lower_then_start_one)
    release()
    assert child_idle  # why the preload's threads are swept by restore_process()


@pytest.mark.skipif(os.geteuid() != 0, reason="leaving SCHED_IDLE needs CAP_SYS_NICE")
def test_restore_process_gives_every_lowered_thread_normal_priority_where_allowed():
    _, tid, release = _in_thread(priority.lower_this_thread)
    try:
        assert priority.is_idle(tid)
        priority.restore_process()
        assert not priority.is_idle(tid)
        if priority.io_class(tid) is not None:
            assert priority.io_class(tid) != 3
    finally:
        release()

