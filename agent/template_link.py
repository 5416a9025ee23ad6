"""The agent's end of a template process (:mod:`elastic.worker.template`, which
documents the protocol): fork requests out, the template's news back.

A worker forked by a template is the template's child, not the agent's: the
agent cannot ``waitpid`` it. The template reaps it and relays the exit status;
:class:`ForkedProcess` turns that into the part of ``subprocess.Popen`` the
supervisor uses, so the supervisor does not care how a worker was born.

What to do with the news (when to retire a template, what counts as a
failure) is the warm pool's (:mod:`agent.warm_policy`); this module only keeps
the books of one template: the forks it was asked for, the children it has,
whether it died.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Union

from elastic.errors import WorkerSpawnError
from elastic.worker.template import MAX_MESSAGE_BYTES


class ForkedProcess:
    """A worker forked by a template, seen through the part of ``subprocess.Popen``
    the supervisor uses: ``pid``, ``stdin`` (writable), ``stdout``/``stderr``
    (readable, binary), ``wait``/``poll``/``returncode`` (negative: killed by that
    signal). ``collateral`` is set when it died with its template.
    """

    def __init__(self, stdin_fd: int, stdout_fd: int, stderr_fd: int):
        self.pid = -1  # known once the template has forked it
        self.stdin = os.fdopen(stdin_fd, "wb")
        self.stdout = os.fdopen(stdout_fd, "rb")
        self.stderr = os.fdopen(stderr_fd, "rb")
        self.returncode: int | None = None
        self.collateral = False
        self._ended = threading.Event()

    def ended(self, returncode: int, collateral: bool = False) -> None:
        """Record the exit (first call wins)."""
        if not self._ended.is_set():
            self.collateral = collateral
            self.returncode = returncode
            self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises subprocess.TimeoutExpired after ``timeout`` seconds."""
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
        return self.returncode

    def close_streams(self) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            with contextlib.suppress(OSError):
                stream.close()


@dataclass(frozen=True)
class TemplateReady:
    """The template has preloaded and may fork."""


@dataclass(frozen=True)
class TemplateUnsafe:
    """Forking is not safe in the template (a thread its preload left running,
    CUDA initialized): it forks nothing more."""

    reason: str


@dataclass(frozen=True)
class RetiredAndIdle:
    """The last child of a retired template has ended: it may be killed now."""


@dataclass(frozen=True)
class MalformedMessage:
    """The template sent something that is not a message of the protocol."""

    data: bytes


TemplateEvent = Union[TemplateReady, TemplateUnsafe, RetiredAndIdle, MalformedMessage]


class TemplateLink:
    """One template's socket and books: forks asked for, children alive.

    ``fork`` may be called from any thread, ``serve`` runs on a thread of its own
    for the template's whole life. ``serve``'s handler must not wait on a thread
    that may be waiting in ``fork``: the answer it waits for comes from ``serve``.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: dict[int, tuple[Future, ForkedProcess]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._retired = False
        self._dead = False

    @property
    def dead(self) -> bool:
        """The template's end of the socket has closed (it died or exited)."""
        return self._dead

    @property
    def retired(self) -> bool:
        return self._retired

    def fork(self, timeout_s: float) -> ForkedProcess:
        """Ask for one warm worker and wait for it. Raises WorkerSpawnError (its
        message reads after "template pid P ") if the template refuses, dies or
        does not answer within ``timeout_s``."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        proc = ForkedProcess(stdin_w, stdout_r, stderr_r)
        future: Future = Future()
        with self._lock:
            request = self._next_id
            self._next_id += 1
            self._pending[request] = (future, proc)
        try:
            socket.send_fds(self._sock, [json.dumps({"fork": request}).encode()],
                            [stdin_r, stdout_w, stderr_w])
        except OSError as exc:
            future.set_exception(WorkerSpawnError(f"is gone ({exc})"))
        finally:
            for fd in (stdin_r, stdout_w, stderr_w):
                os.close(fd)
        try:
            future.result(timeout=timeout_s)
        except (TimeoutError, WorkerSpawnError) as exc:
            with self._lock:
                self._pending.pop(request, None)
            proc.close_streams()
            if isinstance(exc, TimeoutError):
                raise WorkerSpawnError(f"did not fork within {timeout_s:g} s") from exc
            raise
        return proc

    def retire(self) -> bool:
        """No more forks from this template; True if it has no live child (so it
        may be killed now), else :class:`RetiredAndIdle` comes when the last ends."""
        with self._lock:
            self._retired = True
            return not self._children

    def serve(self, handle: Callable[[TemplateEvent], None]) -> list[ForkedProcess]:
        """Read the template's messages until its end of the socket closes: settle
        forks, record its children's exits, hand the rest to ``handle``. Then fail
        the forks still asked for and return the children it left behind (they
        die with it: PDEATHSIG)."""
        try:
            while True:
                try:
                    data = self._sock.recv(MAX_MESSAGE_BYTES)
                except OSError:
                    data = b""
                if not data:
                    break
                try:
                    message = json.loads(data)
                    event = self._on_message(message)
                except (ValueError, TypeError, KeyError, AttributeError):
                    event = MalformedMessage(data)
                if event is not None:
                    handle(event)
        finally:
            with self._lock:
                self._dead = True
                pending, self._pending = list(self._pending.values()), {}
                orphans, self._children = list(self._children.values()), {}
            for future, _ in pending:
                future.set_exception(WorkerSpawnError("died before it forked"))
            with contextlib.suppress(OSError):
                self._sock.close()
        return orphans

    def _on_message(self, message: dict) -> TemplateEvent | None:
        if "exit" in message:
            with self._lock:
                proc = self._children.pop(message["exit"], None)
                idle = self._retired and not self._children
            if proc is not None:
                proc.ended(os.waitstatus_to_exitcode(int(message["status"])))
            return RetiredAndIdle() if idle else None
        if "forked" in message:
            with self._lock:
                future, proc = self._pending.pop(message["forked"], (None, None))
                if proc is not None:
                    proc.pid = int(message["pid"])
                    self._children[proc.pid] = proc
            if future is not None:
                future.set_result(proc.pid)
            return None
        if "refused" in message or "unsafe" in message:
            reason = str(message.get("reason") or message.get("unsafe"))
            # First: a fork() may be waiting for this answer.
            with self._lock:
                future, _ = self._pending.pop(message.get("refused"), (None, None))
            if future is not None:
                future.set_exception(WorkerSpawnError(f"refused to fork: {reason}"))
            return TemplateUnsafe(reason)
        if message.get("ready"):
            return TemplateReady()
        raise ValueError(f"unknown message {message!r}")
