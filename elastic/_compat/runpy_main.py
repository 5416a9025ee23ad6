"""Run a module as ``python -m NAME`` does: runpy's private ``_run_module_as_main``.

That function is what the interpreter itself calls for ``-m``: the module's
code runs in the real ``__main__`` module (which stays in ``sys.modules``
after it returns, for atexit handlers and multiprocessing's spawn),
``sys.argv[0]`` becomes the module's file, and a module that cannot be found
ends the process with ``python: No module named NAME``, exit status 1.

Tested on CPython 3.11.7. Fallback, where runpy no longer has it: the public
``runpy.run_module(name, run_name="__main__", alter_sys=True)``, which runs
the code in a fresh ``__main__`` module with the same ``sys.argv[0]``, but
puts the previous ``__main__`` back when the module returns; a module that
cannot be found exits with the same message and status.
"""

from __future__ import annotations

import importlib.util
import logging
import runpy
import sys

logger = logging.getLogger(__name__)

_INTERNAL = "_run_module_as_main"


def has_internal() -> bool:
    """Whether this Python's runpy still has ``_run_module_as_main``."""
    return callable(getattr(runpy, _INTERNAL, None))


def run_module_as_main(name: str) -> None:
    """Run module (or package, through its ``__main__``) ``name`` as
    ``python -m name`` does, with the arguments already in ``sys.argv[1:]``.

    Raises whatever the module raises (``SystemExit`` included); exits with
    status 1 when ``name`` cannot be found.
    """
    internal = getattr(runpy, _INTERNAL, None)
    if callable(internal):
        internal(name, alter_argv=True)
        return
    logger.debug("runpy has no %s; running %s through runpy.run_module", _INTERNAL, name)
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a bad name
        found = False
    if not found:
        sys.exit(f"{sys.executable}: No module named {name}")
    runpy.run_module(name, run_name="__main__", alter_sys=True)
