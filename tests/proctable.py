"""Reading this machine's process table (``/proc``) for tests: which processes
live, who their parent is, which carry a test's tag in their environment.

A zombie counts as dead everywhere here: this sandbox's PID 1 never reaps
orphans, so a killed grandchild may linger as one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from typing import Callable, Iterator


def _stat_fields(pid: int, tid: int | None = None) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` (of thread ``tid``: ``/proc/PID/task/TID/stat``)
    after the command name (which may itself hold spaces and parentheses), or None
    when the process or thread is gone."""
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat",
                  "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T, Z, ...), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0].decode() if fields else None


def stopped(pid: int) -> bool:
    """Whether every thread of the process is stopped (SIGSTOP takes effect
    thread by thread, a moment after kill() returns)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    return bool(tids) and all((f := _stat_fields(pid, tid)) and f[0] == b"T" for tid in tids)


def alive(pid: int) -> bool:
    """Running, sleeping or stopped; gone or a zombie is dead."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int:
    """The parent's pid; raises ProcessLookupError when the process is gone."""
    fields = _stat_fields(pid)
    if not fields:
        raise ProcessLookupError(pid)
    return int(fields[1])


def live_environments() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, ``NAME=value`` entries) of every live process but this one that we may read."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if alive(int(name)):
            yield int(name), env


def pids_with_env(*entries: str) -> list[int]:
    """Live processes whose environment holds every ``NAME=value`` of ``entries``."""
    want = [e.encode() for e in entries]
    return [pid for pid, env in live_environments() if all(w in env for w in want)]


def killed_with_this_process() -> Callable[[], None]:
    """A ``preexec_fn`` for a child that must not outlive this process (a test
    harness killed mid-run): SIGKILL when our thread that started it ends
    (``PR_SET_PDEATHSIG``), or at once if that already happened."""
    prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    parent_pid = os.getpid()

    def guard() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)
    return guard
