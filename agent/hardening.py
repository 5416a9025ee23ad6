"""Keep the agent's secrets from the processes of its own user.

The workers run user code as the agent's user. While the agent holds the etcd
password (read from ``ELASTIC_ETCD_PASSWORD`` or ``--etcd-password-file``),
such a process must not read it out of the agent:

* ``/proc/<agent>/environ`` is the environment the agent was started with:
  ``os.environ.pop`` changes Python's copy, never that page;
* ``/proc/<agent>/mem`` holds the password and the etcd token (readable by
  the same user where Yama's ptrace_scope is 0 or absent).

:func:`make_non_dumpable` marks the agent non-dumpable
(``prctl(PR_SET_DUMPABLE, 0)``): its ``/proc/<pid>/`` entries then belong to
root and ``environ``, ``mem``, ``fd/`` and ptrace are refused to every
process without ``CAP_SYS_PTRACE``, the same user's included; no core dump is
written. Re-executing without the variable would clean ``environ`` only, not
the memory, so this is the one that is used. The flag is not inherited across
``execve``: the workers (executed, then forked from a template that was
executed) stay ordinary processes. The cost: an operator of the same user
cannot attach a debugger or py-spy to the agent (root can).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


def _prctl():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl


def make_non_dumpable() -> bool:
    """Mark this process non-dumpable (Linux); returns whether it is now.
    Never raises: where it cannot be done, a warning says so."""
    if not sys.platform.startswith("linux"):
        log.warning("Cannot hide the etcd password from this user's other processes on %s "
                    "(no PR_SET_DUMPABLE): they can read it from this process.", sys.platform)
        return False
    try:
        prctl = _prctl()
        if prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    except (OSError, AttributeError) as exc:
        log.warning("Cannot mark the agent non-dumpable (%s): processes of this user, the "
                    "workers included, can read the etcd password from /proc/%s.", exc,
                    "<pid>/environ")
        return False
    return True


def is_dumpable() -> bool:
    """Whether this process is dumpable (its /proc entries readable by its user)."""
    return bool(_prctl()(_PR_GET_DUMPABLE, 0, 0, 0, 0))
