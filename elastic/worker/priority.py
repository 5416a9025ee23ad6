"""CPU and I/O priority of one thread: the lowest while a warm worker prepares.

A warm worker imports torch (seconds of CPU, hundreds of files) while the
round it may later serve is starting. Done on a thread at ``SCHED_IDLE`` and
the idle I/O class, that work only takes cycles and disk time nobody else
wants, so preparing the next workers never slows the workers that train.

Linux keeps both per thread, which matters for users without privileges:
leaving ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` of 20),
so a process that lowered its own main thread could never train at normal
priority again. Only the preloading thread is lowered; the main thread, which
runs the script, never is. :func:`restore` raises a lowered thread back where
it can (root, ``CAP_SYS_NICE``) and otherwise leaves it: it ends with the
preload anyway.

Everything here is best effort: on another OS, or where a call is refused,
nothing changes and nothing raises.
"""

from __future__ import annotations

import ctypes
import os
import platform

_IOPRIO_WHO_PROCESS = 1  # with a thread id: that thread
_IOPRIO_CLASS_SHIFT = 13
_IOPRIO_CLASS_NONE = 0  # "follow the CPU nice value", every thread's default
_IOPRIO_CLASS_IDLE = 3
_SYS_IOPRIO = {  # (ioprio_set, ioprio_get) by machine
    "x86_64": (251, 252),
    "aarch64": (30, 31),
    "ppc64le": (273, 274),
}


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _ioprio_call(which: int, *args: int) -> int:
    numbers = _SYS_IOPRIO.get(platform.machine())
    libc = _libc()
    if numbers is None or libc is None:
        return -1
    return libc.syscall(numbers[which], *args)


def lower_this_thread() -> bool:
    """Put the calling thread at ``SCHED_IDLE`` and in the idle I/O class;
    True if the CPU policy took (the I/O class is a bonus: some schedulers
    ignore it). Threads it starts afterwards inherit both."""
    lowered = False
    if hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            lowered = True
        except OSError:
            pass
    _ioprio_call(0, _IOPRIO_WHO_PROCESS, 0, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)
    return lowered


def restore(thread_id: int) -> bool:
    """Give thread ``thread_id`` (a native id) the default CPU policy and I/O
    class again; True if it has the default CPU policy afterwards."""
    if not hasattr(os, "SCHED_IDLE"):
        return True
    try:
        if os.sched_getscheduler(thread_id) != os.SCHED_IDLE:
            return True
        os.sched_setscheduler(thread_id, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return False  # unprivileged, or the thread has ended
    _ioprio_call(0, _IOPRIO_WHO_PROCESS, thread_id, _IOPRIO_CLASS_NONE)
    return True


def is_idle(thread_id: int) -> bool:
    """Whether thread ``thread_id`` runs at ``SCHED_IDLE``."""
    try:
        return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(thread_id) == os.SCHED_IDLE
    except OSError:
        return False


def io_class(thread_id: int) -> int | None:
    """The thread's I/O scheduling class (3: idle), None where it cannot be read."""
    value = _ioprio_call(1, _IOPRIO_WHO_PROCESS, thread_id)
    return None if value < 0 else value >> _IOPRIO_CLASS_SHIFT


def restore_process(pid: int | None = None) -> None:
    """Restore every thread of process ``pid`` (this one by default) that runs at
    ``SCHED_IDLE``: the preload's own thread and any thread a preloaded module
    started from it. Another process's threads need root or ``CAP_SYS_NICE``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task")]
    except OSError:
        return
    for tid in tids:
        if is_idle(tid):
            restore(tid)
