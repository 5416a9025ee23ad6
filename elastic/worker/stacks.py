"""A worker's Python stacks, dumped on the agent's signal into a file the agent reads.

The worker bootstrap calls :func:`dump_on_signal` in the process that runs
the script (after a warm or template worker took its assignment). From then
on :data:`DUMP_SIGNAL` makes the interpreter write every thread's Python
frames to the worker's stacks file (``faulthandler``: it writes from a C
signal handler, so it answers while the main thread sits in native code, a
blocked collective or ``time.sleep``). A process stopped (SIGSTOP) or stuck in
the kernel does not answer. Like any signal, the dump ends early a system
call that native code does not restart (libc's ``sleep``); Python's own
calls are retried (PEP 475), and the dump comes at a hang verdict, just
before the workers are stopped.

The file starts with :data:`HEADER` and the process's pid, written after the
handler is in place: the agent signals a worker only when the file names its
pid, because the signal's default action would end a process without the
handler. Each dump is appended; the agent reads what a signal added. Does
not import torch.

Where torch's flight recorder runs (:mod:`elastic._compat.torch_flight_recorder`),
:func:`serve_flight_recorder` also answers the agent with the collectives in
flight: a thread blocks (no CPU) opening a FIFO beside the stacks file
(:func:`flight_request_path`); each time the agent opens it and writes, the
thread writes torch's JSON to :func:`flight_record_path` (replaced whole). A
Python thread answers because a blocked collective releases the GIL; the
signal handler above cannot run Python.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

from elastic._compat import torch_flight_recorder

# A real-time signal: no library we know of uses it, and its default action
# (ending the process) is why the agent checks the header first.
DUMP_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
HEADER = "# elastic stack dumps of pid "

_file = None  # the open stacks file: faulthandler writes to its descriptor


def dump_on_signal(path: str) -> bool:
    """Dump this process's stacks to ``path`` (created 0600, appended) on
    :data:`DUMP_SIGNAL`. Returns False (and changes nothing) where the
    platform has no such signal or the file cannot be opened."""
    global _file
    if DUMP_SIGNAL is None or _file is not None:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
                     | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    _file = os.fdopen(fd, "w", buffering=1)
    faulthandler.register(DUMP_SIGNAL, file=_file, all_threads=True, chain=False)
    _file.write(f"{HEADER}{os.getpid()}\n")
    return True



def flight_request_path(stacks_path: str) -> str:
    """The FIFO the agent writes to, to ask for the flight record."""
    return stacks_path + ".fr-request"


def flight_record_path(stacks_path: str) -> str:
    """Where the flight record is written (JSON, replaced whole)."""
    return stacks_path + ".fr.json"


def serve_flight_recorder(stacks_path: str) -> bool:
    """Answer the agent's requests for the flight record (see the module) when
    torch records collectives here; False (nothing started) when it does not
    or the FIFO cannot be made."""
    if not torch_flight_recorder.enabled():
        return False
    request = flight_request_path(stacks_path)
    try:
        if os.path.lexists(request):
            os.unlink(request)
        os.mkfifo(request, 0o600)
    except OSError:
        return False
    threading.Thread(target=_answer_requests, args=(request, flight_record_path(stacks_path)),
                     name="elastic-flight-recorder", daemon=True).start()
    return True


def _answer_requests(request: str, out: str) -> None:
    while True:
        try:
            with open(request, "rb") as fifo:  # blocks until the agent opens it
                fifo.read(64)
        except OSError:
            return
        data = torch_flight_recorder.dump_json()
        if data is None:
            continue
        tmp = f"{out}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, out)
        except OSError:
            continue
