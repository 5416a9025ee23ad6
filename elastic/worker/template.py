"""A template process: preload once, then fork warm workers on the agent's request.

The agent (:mod:`agent.spawn`, for :mod:`agent.warm_pool`) starts one ``python -u -m
elastic.worker.bootstrap`` with ``ELASTIC_BOOTSTRAP_TEMPLATE_FD`` set: a Unix
``SOCK_SEQPACKET`` socket it inherited. It preloads exactly as a warm worker
does (idle-priority thread, PDEATHSIG to the agent's spawner thread) and then,
instead of waiting for one assignment, serves :func:`serve`. Each fork is a
warm worker that has paid nothing for ``import torch`` (about 0.01 CPU-second
against 2.5-4 for an import) and goes on through the bootstrap's usual path:
assignment on stdin, script, exit status.

Protocol (one JSON object per datagram; the agent's end is
:mod:`agent.template_link`):

- template -> agent: ``{"ready": true, "pid": P}`` once it may fork;
  ``{"unsafe": reason}`` instead when forking is not safe (then it exits 0);
  ``{"forked": id, "pid": P}`` for each request; ``{"refused": id,
  "reason": r}`` if forking became unsafe later; ``{"exit": P, "status": S}``
  (a raw ``waitpid`` status) when a child it forked has ended and been reaped.
- agent -> template: ``{"fork": id}`` with three fds (SCM_RIGHTS): the new
  worker's stdin, stdout and stderr. EOF (the agent closed the socket or
  died): the template exits at once, and its children with it.

Fork safety: ``fork()`` copies only the calling thread; a lock another thread
held stays locked in the child forever. So the template forks only from its
main thread, after the preload thread has ended, and only while
``/proc/self/task`` lists that one thread. Libraries that keep a thread pool
and know about fork (OpenBLAS, which numpy loads: it stops its pool in a
``pthread_atfork`` handler and starts it again on first use) are allowed for
by one probe fork before the check: a thread still running after a fork's
prepare handlers is one its library does not expect to lose, and the
template then says ``unsafe`` and the agent spawns every worker as before.
CUDA must not be touched in the template either: torch refuses CUDA in a
child forked after its parent asked the CUDA driver anything, even a bare
``torch.cuda.is_available()``, which does not set
``torch.cuda.is_initialized()`` (:mod:`elastic._compat.torch_cuda`). So the
agent starts the template with :data:`TEMPLATE_ENV`
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``: ``is_available()`` in a preloaded
module counts GPUs through NVML and leaves the driver alone), and the probe
fork asks torch, in the child, whether it would refuse CUDA there: if it
would (a preloaded module used the driver), or if CUDA is initialized, the
template says ``unsafe`` and the agent spawns every warm worker, exactly as
for a stray thread. (NVML's initialisation leaves a thread of its own, seen
on an H200 with torch 2.11, so a preload that calls ``is_available()`` still
ends in spawning, for that thread, but never in forks that cannot use CUDA.)
Forked workers initialize CUDA themselves, after the fork, exactly as a
freshly spawned worker does; their environment is the assignment's, so the
NVML setting does not follow them.

Priority: the fork runs on the main thread, which never left normal CPU and
I/O priority (only the preload thread was lowered, and it has ended), so
every child starts at normal priority.

PDEATHSIG chain: the agent's spawner thread dies -> the template gets SIGKILL
(bootstrap's ``_die_with_parent``) -> each child gets SIGKILL, because each
sets ``PR_SET_PDEATHSIG`` right after the fork and then checks that its
parent is still the template (it may have died in between).

What a fork shares that separate processes did not: Python's hash seed
(``PYTHONHASHSEED``; the same in every worker of a template, as under a
fixed seed) and the state of RNGs seeded at import: Python's ``random``
reseeds itself in a forked child, and numpy's global RNG is reseeded here
from the OS, as a fresh process would have it. torch's default generator has
a fixed seed in every process anyway.

Never touches CUDA; imports nothing heavy itself (torch only as the preload left it).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import sys
import threading
import time

from elastic import worker_env
from elastic._compat import torch_cuda
from elastic.worker import priority

TEMPLATE_FD_ENV = worker_env.BOOTSTRAP_TEMPLATE_FD
# Added to the template's environment by the agent (before the preload runs).
TEMPLATE_ENV = {torch_cuda.NVML_CHECK_ENV: "1"}
# The probe child's exit status when torch would refuse CUDA in it.
_BAD_FORK_EXIT = 17
_PR_SET_PDEATHSIG = 1
MAX_MESSAGE_BYTES = 4096  # one datagram of the protocol, either way
_THREAD_EXIT_WAIT_S = 1.0
_FDS_PER_FORK = 3  # stdin, stdout, stderr of the new worker


def _send(sock: socket.socket, message: dict) -> None:
    """Send one message; a template whose agent stopped listening has no reason to live."""
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        os._exit(0)  # the agent is gone: the children go with us (PDEATHSIG)


def unsafe_reason(torch_module=None, fork_poisoned: bool = False) -> str | None:
    """Why forking this process now would be unsafe, or None when it is safe.

    ``torch_module``: torch as imported here (default ``sys.modules.get("torch")``);
    ``fork_poisoned``: what :func:`_probe_fork` found."""
    torch = sys.modules.get("torch") if torch_module is None else torch_module
    if fork_poisoned:
        return ("a preloaded module used the CUDA driver (any CUDA call, or torch.cuda."
                "device_count()/is_available() where NVML fails): a forked worker could not "
                "use CUDA; touch CUDA only after elastic.init(), not at import")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "a preloaded module initialized CUDA"
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return "/proc/self/task cannot be read, so single-threadedness cannot be checked"
    if len(tasks) != 1:
        names = []
        for tid in tasks:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f"{tid} {f.read().strip()}")
            except OSError:
                pass
        return f"{len(tasks)} threads run after the preload ({', '.join(names)})"
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads are alive after the preload"
    if threading.current_thread() is not threading.main_thread():
        return "not on the main thread"
    if priority.is_idle(threading.get_native_id()):
        return "the main thread runs at idle priority"
    return None


def _probe_fork() -> bool:
    """Fork once and reap the child at once, so pthread_atfork handlers stop the
    thread pools of libraries that expect fork (OpenBLAS) before the check.
    Returns whether torch, asked in the child, would refuse CUDA there."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        bad = torch_cuda.in_bad_fork(sys.modules.get("torch"))
        os._exit(_BAD_FORK_EXIT if bad else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == _BAD_FORK_EXIT


def serve(fd: int, preloading: threading.Thread) -> None:
    """Be the template: wait for ``preloading`` to end, then fork workers on request.

    Returns only in a forked child, which is then a warm worker with its own
    stdin/stdout/stderr, session and process group, waiting for its
    assignment on fd 0. In the template itself it never returns: it exits
    when the agent closes the socket, when it is killed, or (status 0) when
    forking is unsafe, after saying so.
    """
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    preloading.join()
    fork_poisoned = _probe_fork()
    reason = unsafe_reason(fork_poisoned=fork_poisoned)
    deadline = time.monotonic() + _THREAD_EXIT_WAIT_S
    while reason is not None and not fork_poisoned and time.monotonic() < deadline:
        # join() returns before the kernel has removed the ended thread from
        # /proc/self/task: give it (and pools stopped by the probe) a moment.
        time.sleep(0.005)
        reason = unsafe_reason()
    if reason is not None:
        _send(sock, {"unsafe": reason})
        os._exit(0)
    me = os.getpid()
    _send(sock, {"ready": True, "pid": me})
    children: dict[int, int] = {}  # pidfd -> pid
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    while True:
        for ready_fd, _ in poller.poll():
            if ready_fd != sock.fileno():
                pid = children.pop(ready_fd)
                poller.unregister(ready_fd)
                os.close(ready_fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "status": status})
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, _FDS_PER_FORK)
            except OSError:
                os._exit(0)
            if not data:
                os._exit(0)  # the agent closed its end: we are retired
            request = json.loads(data)
            reason = unsafe_reason() if len(fds) == _FDS_PER_FORK else "the request lacks its fds"
            if reason is not None:
                for f in fds:
                    os.close(f)
                _send(sock, {"refused": request.get("fork"), "reason": reason})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_worker(me, fds, sock, list(children))
                return
            for f in fds:
                os.close(f)
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            _send(sock, {"forked": request.get("fork"), "pid": pid})


def _become_worker(template_pid: int, fds: list[int], sock: socket.socket,
                   sibling_pidfds: list[int]) -> None:
    """In a forked child: tie our life to the template, take the worker's own
    session and stdio, and drop what belongs to the template. Any failure
    here exits 1 without a word (the agent reports the exit)."""
    try:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The template may have died between fork and prctl: then nothing would kill us.
        if os.getppid() != template_pid:
            os._exit(0)
        os.setsid()  # own session and process group, so stop() reaches our children too
        for target, f in enumerate(fds):
            os.dup2(f, target)
        for f in fds:
            if f > 2:
                os.close(f)
        sock.close()
        for f in sibling_pidfds:
            os.close(f)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()  # fresh entropy, as a newly started process would have
    except BaseException:  # noqa: BLE001 - a half-made worker must not run a script
        os._exit(1)
