"""The first code a worker process runs: preload torch, wait for an assignment, run the script.

    python -u -m elastic.worker.bootstrap

The node agent starts workers through this module so that a
restart does not pay for ``import torch`` (seconds) on its critical path: a
*warm* worker imports the modules in ``ELASTIC_PRELOAD`` ahead of need, on a
thread at the lowest CPU and I/O priority (:mod:`elastic.worker.priority`)
so that it never slows the round that is training or starting, while the main
thread blocks on stdin until the agent hands it a round's assignment. Taken
before its import finished, the worker raises the import back to normal
priority where it may, waits for it, and runs the script.

Protocol (the agent's side is :mod:`agent.spawn`; the variables are named in
:mod:`elastic.worker_env`):

- Environment at start (set by the agent, not seen by the script):
  ``ELASTIC_PRELOAD``: comma-separated modules to import ahead of time
  (default ``torch,torch.distributed``; empty for a cold start, where
  preloading would only delay the script); ``ELASTIC_BOOTSTRAP_STATUS_FD``:
  a file descriptor that receives one JSON line ``{"ready": true, "pid": P,
  "preload_s": S}`` once preloading is done, and is then closed;
  ``ELASTIC_BOOTSTRAP_PARENT_PID``: the agent's pid.
- stdin: exactly one JSON line, ``{"env": {...}, "argv": [...],
  "script": path | null, "module": name | null, "cwd": dir}``, with
  ``"no_python": true`` when ``script`` is a program to execute in this
  process's place (torchrun's ``--no-python``). ``env`` is the
  complete environment the script sees (it replaces ``os.environ``); ``argv``
  are the arguments after the script or module name. After reading it, stdin
  is re-pointed to ``/dev/null``. EOF before a full line (the agent is gone or
  discards this warm worker) exits 0 without a word.

Promises: the script runs as ``python -u script.py ARGS`` (or ``python -u -m
module ARGS``) would run it in ``cwd`` with ``env``: same ``sys.argv``,
``sys.path[0]``, ``__name__ == "__main__"`` and the same exit status
(``SystemExit`` codes as given, 1 with a traceback for an uncaught exception,
death by SIGINT for an uncaught ``KeyboardInterrupt``, 2 for a script file
that cannot be opened). An uncaught exception is also written to
``TORCHELASTIC_ERROR_FILE`` when that is set (:mod:`elastic.errorfile`). Environment variables read only when the interpreter
or torch starts (``PYTHONPATH``, ``OMP_NUM_THREADS``, ...) are those of the
warm process, not of the assignment; the agent starts a worker cold when
they differ (:mod:`agent.warm_policy`). The worker gets SIGKILL when the thread of the agent that spawned
it dies (``PR_SET_PDEATHSIG``), so no worker outlives a killed agent.

Template mode: with ``ELASTIC_BOOTSTRAP_TEMPLATE_FD`` (a Unix socket) the
process preloads the same way but then serves fork requests
(:mod:`elastic.worker.template`); each fork continues here as a warm worker
whose preload is already done, with the same protocol and promises, its
stdin/stdout/stderr passed by the agent (:mod:`agent.warm_pool`, through
:mod:`agent.template_link`), and PDEATHSIG to the template.
"""

from __future__ import annotations

import builtins
import gc
import ctypes
import importlib
import importlib.machinery
import importlib.util
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
import types

from elastic import errorfile, worker_env
from elastic._compat import runpy_main
from elastic.worker import priority, stacks, template
from elastic.worker.template import TEMPLATE_FD_ENV

# What a training script's start-up pays for: torch itself, and torch._dynamo,
# which DistributedDataParallel and FSDP import lazily on construction (about
# 1.6 s here, a restart's largest cost after torch). DCP for checkpoints. Then
# our own library's worker side: elastic.init()'s runtime (grpc and protobuf
# for the agent's channel) and the Checkpointer (with the memory tier), which a
# script imports after its process group formed: 0.1-0.7 s of every restart's
# critical path on two busy cores, paid once here instead. None of them starts
# a thread at import (the template forks only a single-threaded process).
DEFAULT_PRELOAD = ("torch,torch.distributed,torch._dynamo,torch.distributed.checkpoint,"
                   "torch.distributed._functional_collectives,"
                   "elastic.worker.runtime,elastic.checkpoint.checkpointer")
PRELOAD_ENV = worker_env.PRELOAD
STATUS_FD_ENV = worker_env.BOOTSTRAP_STATUS_FD
PARENT_PID_ENV = worker_env.BOOTSTRAP_PARENT_PID

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# The preloading thread's name, as /proc/PID/task/TID/comm shows it while it imports.
PRELOAD_THREAD_NAME = "elastic-preload"
# Cap on the assignment line: an environment is a few KiB; anything near this is not ours.
_MAX_ASSIGNMENT_BYTES = 16 * 1024 * 1024


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the spawning agent thread dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # without prctl the agent's stop() still reaps us; nothing better to do
    parent = os.environ.get(PARENT_PID_ENV)
    # The agent may have died between fork and prctl; then nobody would ever kill us.
    if parent and parent.isdigit() and os.getppid() != int(parent):
        os._exit(0)


def _preload(modules: str) -> float:
    started = time.monotonic()
    for name in (m.strip() for m in modules.split(",")):
        if name:
            importlib.import_module(name)
    return time.monotonic() - started


def _name_this_thread(name: str) -> None:
    """Name the calling thread for the OS (``top -H``, ``/proc/PID/task/TID/comm``)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _rename_threads(old: str, new: str, *, but: int) -> None:
    """Rename this process's threads called ``old`` (except thread ``but``)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        if tid == but:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm", "r+") as f:
                if f.read().strip() == old:
                    f.seek(0)
                    f.write(new)
        except OSError:
            pass  # ended meanwhile


def _start_preload(modules: str) -> threading.Thread:
    """Import ``modules`` on a thread at the lowest CPU and I/O priority, then
    report ready. The main thread meanwhile waits for an assignment at normal
    priority. A failed import ends the process with its traceback and status
    1, as it would have on the main thread: the agent counts a warm failure."""
    def run() -> None:
        _name_this_thread(PRELOAD_THREAD_NAME)
        if modules.strip():
            priority.lower_this_thread()
        try:
            preload_s = _preload(modules)
        except BaseException:  # noqa: BLE001 - any failure ends this warm worker
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        # Threads a preloaded module started here inherited the name: they
        # are the library's, not the preload's (which ends now).
        _rename_threads(PRELOAD_THREAD_NAME, "python", but=threading.get_native_id())
        _report_ready(preload_s)

    thread = threading.Thread(target=run, name=PRELOAD_THREAD_NAME, daemon=True)
    thread.start()
    return thread


def _report_ready(preload_s: float) -> None:
    fd_text = os.environ.get(STATUS_FD_ENV, "")
    if not fd_text.isdigit():
        return
    fd = int(fd_text)
    line = json.dumps({"ready": True, "pid": os.getpid(), "preload_s": round(preload_s, 3)})
    try:
        os.write(fd, line.encode() + b"\n")
    except OSError:
        pass  # the agent stopped listening; the assignment (or EOF) still decides
    finally:
        try:
            os.close(fd)  # the script and its children must not inherit it
        except OSError:
            pass


def _read_assignment() -> dict | None:
    """The assignment from fd 0, or None at EOF. Reads byte-wise from the fd so
    no Python-level buffer of ``sys.stdin`` holds data the script could see."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk or size > _MAX_ASSIGNMENT_BYTES:
            break
    line = b"".join(chunks).split(b"\n", 1)[0]
    assignment = json.loads(line)
    if not isinstance(assignment, dict):
        raise ValueError("the assignment is not a JSON object")
    if (assignment.get("script") is None) == (assignment.get("module") is None):
        raise ValueError("the assignment names neither or both of script and module")
    return assignment


def _detach_stdin() -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(devnull, 0)
    finally:
        os.close(devnull)


def _apply(assignment: dict) -> None:
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in assignment.get("env", {}).items()})
    cwd = assignment.get("cwd")
    if cwd:
        os.chdir(cwd)
    args = [str(a) for a in assignment.get("argv", [])]
    script = assignment.get("script")
    if script is not None:
        sys.argv = [script, *args]
        first = os.path.dirname(os.path.realpath(script))
    else:
        # runpy replaces argv[0] with the module's file, as -m does.
        sys.argv = [assignment["module"], *args]
        first = os.getcwd()
    # With -P / PYTHONSAFEPATH, Python prepends nothing, so there is nothing to replace.
    if not sys.flags.safe_path:
        if sys.path:
            sys.path[0] = first
        else:
            sys.path.insert(0, first)


def _report_uncaught(exc: BaseException) -> None:
    """Print ``exc`` as the interpreter prints an uncaught exception of ``python script.py``:
    without the frames of this module and of runpy above the script's own."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    # The default hook prints the exception's own __traceback__, not the tb argument.
    exc = exc.with_traceback(tb)
    sys.excepthook(type(exc), exc, tb)


def _run_file(path: str) -> None:
    """Run a script file as ``python path`` does.

    Not ``runpy.run_path``: that leaves ``__file__`` as given (Python makes it
    absolute), sets ``sys.argv[0]`` to its argument and puts the old
    ``__main__`` back when the script returns, while atexit handlers and
    multiprocessing's spawn still expect the script's ``__main__``.
    """
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main_module = types.ModuleType("__main__")
    main_module.__file__ = path
    main_module.__cached__ = None
    main_module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


def _exec_program(path: str, args: list[str]) -> None:
    """Replace this process by the program at ``path`` (torchrun's --no-python);
    returns only by exiting 126 (not executable) or 127 (missing), as a shell does."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(path, [path, *args])
    except OSError as exc:
        print(f"elastic.worker.bootstrap: cannot execute {path}: {exc}", file=sys.stderr)
        sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


# How long a warm worker of another rank waits for rank 0's early store before
# its script runs anyway (rank 0 hosts it within milliseconds of its assignment).
RENDEZVOUS_STORE_WAIT_S = 0.2
# Rank 0's early store: referenced for the life of the process, which it serves.
_hosted_store: object | None = None


def _meet_at_the_rendezvous_store() -> object | None:
    """Make the process group's TCPStore server on ``MASTER_PORT`` be up before
    any rank's script connects to it; returns the server where this worker
    hosts it (it must stay referenced), else None.

    The scripts connect in ``init_process_group``. A connection that comes
    before rank 0's script has listened is refused, and torch tries again only
    after a backoff of 0.4 to 0.7 s: half of a warm restart, whenever another
    rank wins the race. So a warm worker (torch preloaded) of global rank 0
    hosts the server a few milliseconds after its assignment, before its
    script imports anything; the script's own ``env://`` rendezvous asks for a
    multi-tenant store on that port and shares it, nothing in its environment
    changes. A warm worker of another rank waits for that port to answer, for
    at most RENDEZVOUS_STORE_WAIT_S, before its script runs.

    A script that binds ``MASTER_PORT`` itself without multi-tenancy finds it
    taken, as under torchrun, whose agent hosts that port. Cold workers host
    and wait for nothing: importing torch, or waiting for a rank 0 that may
    not use torch, would only delay a script that may not need it.

    The store hosted here listens on ``MASTER_ADDR`` (the advertised address)
    only, not on every interface as torch's own would
    (:func:`_listen_on_master_addr`). So that a cold rank 0's script does not
    bind every interface through torch either, its store is hosted the same
    way as soon as the script has imported torch
    (:func:`_host_once_torch_is_imported`), before it can call
    ``init_process_group``.
    """
    env = os.environ
    if "torch.distributed" not in sys.modules or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    try:
        host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", ""))
    except ValueError:
        return None  # the script's own rendezvous says what is wrong, if it needs one
    if env.get("RANK") != "0":
        deadline = time.monotonic() + RENDEZVOUS_STORE_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                socket.create_connection((host, port), timeout=left).close()
                break
            except OSError:
                time.sleep(0.002)
        return None
    try:
        listener = _listen_on_master_addr(host, port)
    except OSError as exc:  # the script's own rendezvous will fail the same way, and say so
        print(f"elastic.worker.bootstrap: not hosting the rendezvous store early: cannot "
              f"listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None
    try:
        from torch.distributed import TCPStore

        # The store serves on this very descriptor (it does not duplicate it):
        # it is the store's from here on, kept open as long as the store is.
        options = dict(wait_for_workers=False, multi_tenant=True,
                       master_listen_fd=listener.fileno())
        try:
            store = TCPStore(host, port, None, True, **options)
        except RuntimeError as exc:
            # torch 2.6's default (libuv) server takes no listening socket; its
            # legacy server does, and serves the same protocol.
            if "listen fd" not in str(exc):
                raise
            store = TCPStore(host, port, None, True, use_libuv=False, **options)
        listener.detach()
        return store
    except Exception as exc:  # the script's own rendezvous will fail the same way, and say so
        listener.close()
        print(f"elastic.worker.bootstrap: not hosting the rendezvous store early: {exc}",
              file=sys.stderr)
        return None


def _host_once_torch_is_imported() -> None:
    """For a cold worker of global rank 0: host the rendezvous store (on
    MASTER_ADDR only) right after the script's ``import torch`` completes
    (which imports torch.distributed), before any of its code can ask torch
    for a store of its own on every interface. A script that never imports
    torch hosts nothing."""
    if ("torch" in sys.modules or os.environ.get("RANK") != "0"
            or not os.environ.get("MASTER_PORT")
            or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        return
    _once_torch_is_imported(_host_store)


def _host_store() -> None:
    global _hosted_store
    _hosted_store = _meet_at_the_rendezvous_store()


# What runs right after the script's ``import torch`` (in this order).
_after_torch_import: list = []


def _once_torch_is_imported(callback) -> None:
    """Call ``callback()`` once torch is imported: now if it is, else right
    after the script's ``import torch`` completes (a script that never
    imports torch calls nothing)."""
    if "torch" in sys.modules:
        callback()
        return
    if not _after_torch_import:
        sys.meta_path.insert(0, _AfterTorchImport())
    _after_torch_import.append(callback)


class _AfterTorchImport:
    """A meta path finder that finds nothing itself: it wraps torch's own
    loader so that the callbacks of :func:`_once_torch_is_imported` run once
    torch is imported, then leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.loader is not None:
            spec.loader = _HostingLoader(spec.loader)
        return spec


class _HostingLoader:
    """torch's loader, with the callbacks run after its module has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        for callback in _after_torch_import:
            callback()
        _after_torch_import.clear()

    def __getattr__(self, name):  # resources, get_filename...: torch's loader's own
        return getattr(self._loader, name)


def _prepare_to_be_judged() -> None:
    """What lets the agent judge and explain a hang of any script: its stacks
    dumped on the agent's signal and, where torch records collectives, the
    flight record on request (:mod:`elastic.worker.stacks`), and every
    optimizer step counted as progress (torch's global optimizer step hook;
    :func:`elastic.worker.runtime.optimizer_stepped`)."""
    env = worker_env.WorkerEnv()
    if env.stacks_file:
        stacks.dump_on_signal(env.stacks_file)
        stacks.serve_flight_recorder(env.stacks_file)
    if env.agent_socket:
        _once_torch_is_imported(_count_optimizer_steps)


def _count_optimizer_steps() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_optimizer_stepped)


_runtime = None  # elastic.worker.runtime, imported at the first optimizer step


def _optimizer_stepped(optimizer, args, kwargs) -> None:
    global _runtime
    if _runtime is None:
        from elastic.worker import runtime

        _runtime = runtime
    _runtime.optimizer_stepped()


def _listen_on_master_addr(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (MASTER_ADDR, the advertised
    address) and ``port`` only.

    The store has no authentication: anyone who reaches its port can read and
    write the group's keys. torch's TCPStore server binds every interface
    (``*:port``) and takes no address to bind; its ``master_listen_fd`` takes
    a socket already listening, which is how the store is kept to the one
    address the other ranks are told to use. Raises OSError when ``host``
    does not resolve to an address of this machine.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(2048)
    except BaseException:
        listener.close()
        raise
    return listener


def _run(assignment: dict) -> None:
    script = assignment.get("script")
    if assignment.get("no_python"):
        _exec_program(script, sys.argv[1:])
    if script is None:
        # As ``python -m`` does: __main__ stays the module, argv[0] its file.
        runpy_main.run_module_as_main(assignment["module"])
        return
    if not os.path.exists(script):
        print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: "
              f"[Errno 2] No such file or directory", file=sys.stderr)
        sys.exit(2)
    if os.path.isfile(script):
        _run_file(script)
        return
    # A directory or zip with __main__.py: run_path puts it on sys.path itself.
    if sys.path and not sys.flags.safe_path:
        del sys.path[0]
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    """Run one worker; returns normally only when the script did (exit status 0)."""
    _die_with_parent()
    fd_text = os.environ.get(STATUS_FD_ENV, "")
    if fd_text.isdigit():
        try:  # nothing a preloaded module starts may keep the agent's status pipe open
            os.set_inheritable(int(fd_text), False)
        except OSError:
            pass
    preloading = _start_preload(os.environ.get(PRELOAD_ENV, DEFAULT_PRELOAD))
    template_fd = os.environ.get(TEMPLATE_FD_ENV, "")
    if template_fd.isdigit():
        # A template: returns only in a forked child, a warm worker from here on.
        template.serve(int(template_fd), preloading)
    try:
        assignment = _read_assignment()
    except (ValueError, OSError) as exc:
        print(f"elastic.worker.bootstrap: bad assignment from the agent: {exc}", file=sys.stderr)
        sys.exit(2)
    if assignment is None:
        # Discarded: leave at once, not through an interpreter shutdown that
        # would race the preload thread, which may still be importing.
        os._exit(0)
    # Taken before it finished importing: the rest is on this round's critical
    # path now, so give it normal priority where allowed, and wait for it.
    priority.restore_process()
    preloading.join()
    priority.restore_process()  # threads the preload started after the first pass
    _detach_stdin()
    _apply(assignment)
    global _hosted_store
    if not assignment.get("no_python"):
        _hosted_store = _meet_at_the_rendezvous_store()
        if _hosted_store is None:
            _host_once_torch_is_imported()
        _prepare_to_be_judged()
    try:
        _run(assignment)
    except SystemExit:
        raise  # the interpreter turns it into the exit status, exactly as for a plain script
    except KeyboardInterrupt as exc:
        _report_uncaught(exc)
        # As CPython does for an uncaught KeyboardInterrupt: die by SIGINT, so the
        # parent sees a signal death (-2), not exit status 1.
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        sys.exit(130)  # only if SIGINT could not be delivered
    except BaseException as exc:  # noqa: BLE001 - the script's error, reported as Python would
        if os.environ.get(errorfile.ENV_VAR):
            # The agent names this as the failure's root cause (torch's @record
            # may have written it already: that one is kept).
            errorfile.write(os.environ[errorfile.ENV_VAR], exc)
        _report_uncaught(exc)
        sys.exit(1)
    finally:
        # The script is done: nothing it allocated needs collecting any more,
        # yet interpreter shutdown would walk torch's millions of objects for
        # seconds per worker, and every round's end waits for the slowest.
        gc.freeze()


if __name__ == "__main__":
    main()
