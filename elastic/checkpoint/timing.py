"""Phases of a save and a restore, for a recorder to time (the checkpoint bench).

The checkpoint code runs each of its phases in :func:`phase` (or as a
function decorated :func:`timed`); nothing is recorded unless a recorder is
installed (:func:`install`), and then it hears every phase of every thread,
nested as they run. Off, a phase costs a global read and an empty ``with``.
The phases:

* ``collect`` (:func:`elastic.checkpoint.state.collect`: DCP's state-dict
  helpers) and ``apply`` (:func:`elastic.checkpoint.state.apply`);
* ``stage``: a copy to CPU (:meth:`elastic.checkpoint.staging.Stager.stage`);
* ``persist``: a save's write, verification and commit, of which ``prepare``
  (rank 0 makes the temporary directory), ``write`` (this rank's files, of
  which ``dcp_save``), ``verify`` (:func:`elastic.checkpoint.layout.verify_structure`,
  also in a restore's ``load``) and ``commit`` (rank 0: rename, commit log,
  marker, retention);
* ``choose`` (a restore's candidates) and ``load`` (one candidate verified and
  loaded, of which ``dcp_load``);
* ``crc``: one CRC-32 (:func:`elastic.checkpoint.layout.crc32`);
* a restore from the memory tier (:mod:`elastic.checkpoint.memory.recovery`):
  ``memory_choose``, ``memory_bring`` (slots opened, fetched, and the
  resharded load planned), ``memory_load`` (of which ``read``: slot files read
  into place, :func:`elastic.checkpoint.memory.slotfile.read_files`) and
  ``memory_agree``.

No torch here.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Recorder(Protocol):
    """What :func:`install` takes: called in the thread that runs the phase."""

    def phase(self, name: str) -> ContextManager[object]:
        """A context manager entered when the phase ``name`` starts, left when it ends."""


_OFF: ContextManager[object] = contextlib.nullcontext()
_recorder: Recorder | None = None


def install(recorder: Recorder | None) -> Recorder | None:
    """Make ``recorder`` hear every phase from now on, in every thread (None: no
    one); returns the one it replaces."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def phase(name: str) -> ContextManager[object]:
    """The context in which the phase ``name`` runs: the recorder's, or nothing."""
    recorder = _recorder
    return _OFF if recorder is None else recorder.phase(name)


def timed(name: str) -> Callable[[F], F]:
    """A decorator: each call of the function runs as the phase ``name``."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return decorate
