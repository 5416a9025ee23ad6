"""Failpoints: named places in the code where a test can inject a crash, an error or a delay.

A failpoint is armed through the environment, so it reaches worker processes
that a test starts::

    ELASTIC_FAILPOINT="NAME[@RANK][=ACTION][,NAME[@RANK][=ACTION]...]"

``@RANK`` limits it to the process whose ``RANK`` environment variable has
that value. ACTION is one of:

==================  ======================================================
``exit`` (default)  ``os._exit(1)``: a crash, no cleanup, no ``finally``
``exit:N``          ``os._exit(N)``
``oserror:ERRNO``   raise ``OSError(errno.ERRNO)``, e.g. ``oserror:ENOSPC``
``sleep:SECONDS``   sleep, e.g. to make a write slow in a test
==================  ======================================================

Before it acts, a failpoint writes one line to stderr naming itself, so a
test can tell the injected crash from an accidental one.

Cost when nothing is armed: one environment lookup per call; failpoints sit
on paths that run a few times per checkpoint, never per tensor or per step.
The environment is read at every call (not once at import) so that a test can
arm a failpoint between two operations of one process.

Names in use (see ``elastic.checkpoint``): ``ckpt.before_shards``,
``ckpt.write`` (before this rank writes its shard files), ``ckpt.mid_write``
(after this rank's shard files, before its other files and the metadata),
``ckpt.after_shards_before_commit``, ``ckpt.after_rename_before_commit_log``.
"""

from __future__ import annotations

import errno as errno_module
import functools
import os
import time

ENV_VAR = "ELASTIC_FAILPOINT"


def failpoint(name: str) -> None:
    """Act as armed for ``name`` in ``ELASTIC_FAILPOINT``; do nothing otherwise.

    Raises ``OSError`` for an ``oserror:`` action and ``ValueError`` for a
    malformed specification (a broken test setup must not pass silently).
    """
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    action = _parse(spec).get(name)
    if action is None:
        return
    rank, kind, arg = action
    if rank is not None and os.environ.get("RANK", "0") != rank:
        return
    os.write(2, f"elastic failpoint {name}: {kind}{':' + arg if arg else ''} "
                f"(pid {os.getpid()}, RANK {os.environ.get('RANK', '0')})\n".encode())
    if kind == "exit":
        os._exit(int(arg) if arg else 1)
    if kind == "oserror":
        code = getattr(errno_module, arg)
        raise OSError(code, f"{os.strerror(code)} (injected by failpoint {name})")
    if kind == "sleep":
        time.sleep(float(arg))


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, tuple[str | None, str, str]]:
    """``{name: (rank or None, kind, argument)}`` for a specification string."""
    armed: dict[str, tuple[str | None, str, str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, action = item.partition("=")
        name, _, rank = target.partition("@")
        kind, _, arg = (action or "exit").partition(":")
        valid = (kind == "exit" and (not arg or arg.isdigit())) \
            or (kind == "oserror" and isinstance(getattr(errno_module, arg, None), int)) \
            or (kind == "sleep" and _is_float(arg))
        if not name or not valid or (rank and not rank.isdigit()):
            raise ValueError(f"bad {ENV_VAR} entry {item!r}: expected NAME[@RANK][=exit[:N]|"
                             f"oserror:ERRNO|sleep:SECONDS]")
        armed[name] = (rank or None, kind, arg)
    return armed


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
