"""The worker side of elasticd: process group from the environment, heartbeats, progress.

Progress is what the script numbers with :func:`step`, or, for a script that
never calls it, its optimizer steps (:func:`optimizer_stepped`, called by the
hook the worker bootstrap installs in every worker; heartbeats then start at
the first one). Works under ``torchrun`` too (no agent socket: no
heartbeats, nothing else changes), so a script written for this library runs
under either launcher.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from elastic.errors import ConfigError
from elastic.worker.channel import WorkerChannelClient
from elastic.worker.step_timer import StepTimer, ThreadBusyClock
from elastic.worker_env import WorkerEnv

log = logging.getLogger(__name__)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _round_or_0(env: WorkerEnv) -> int:
    """The worker's round; 0 when it is not an integer (heartbeats go on)."""
    try:
        return env.round
    except ConfigError:
        return 0


def busy_tells(cuda) -> bool:
    """Whether the training thread's busy time measures this rank's speed:
    not once the process has initialized CUDA (``cuda``: ``torch.cuda`` or a
    facade with its ``is_initialized``). Kernels run asynchronously, so the
    thread's CPU time is the host's share of a step alone: where it waits for
    the GPU by spinning, every rank is busy for its whole step; where it
    sleeps, a rank with more host work (rank 0's logging) can be far busier
    than its peers while that work overlaps its GPU's and costs the job nothing."""
    return not cuda.is_initialized()


# The heartbeat interval's basis when the agent names no hang timeout.
_DEFAULT_HANG_TIMEOUT_S = 300.0


class Heartbeat:
    """A background thread that tells the agent, every ``interval_s`` seconds
    and at once on the first step, on each save announced and after each
    memory snapshot, that this worker is alive and where it is (rank, round and
    step from the environment and :meth:`report`; snapshots taken:
    :meth:`report_snapshot`), with the mean wall and busy times of the steps
    since the last beat (:class:`~elastic.worker.step_timer.StepTimer`; busy
    time only while this process has not initialized CUDA: :func:`busy_tells`).

    ``client`` is the channel to the agent (a
    :class:`~elastic.worker.channel.WorkerChannelClient`, or anything with its
    ``heartbeat``, ``confirmed_at`` and ``close``); the heartbeat owns it from
    then on and closes it in :meth:`close`. The thread starts at construction.
    """

    def __init__(self, client: WorkerChannelClient, interval_s: float):
        self.client = client
        self.interval_s = interval_s
        self.rank = _env_int("RANK", 0)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        self.round = _round_or_0(WorkerEnv())
        self.step = -1
        self.snapshots = 0
        # Monotonic time the announced save should be over: each heartbeat
        # sends what is left of it (the proto's "for this many seconds from
        # now"), so a save that overruns is judged like any hang.
        self.saving_until = 0.0
        self.timer = StepTimer(ThreadBusyClock())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastic-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            # Cleared before the beat reads what it sends: a wake set after the clear
            # sends again at once (cleared after the wait, one set in between was lost
            # and a snapshot waited a whole interval to be told).
            self._wake.clear()
            timed = self.timer.take()
            self.client.heartbeat(self.rank, self.local_rank, os.getpid(), self.round, self.step,
                                  max(0.0, self.saving_until - time.monotonic()),
                                  snapshots=self.snapshots, step_time_s=timed.wall_s,
                                  step_busy_s=timed.busy_s if busy_tells(torch.cuda) else 0.0)
            self._wake.wait(self.interval_s)

    def wait_until_confirmed(self, hold_after_s: float) -> None:
        """Block while the agent has not vouched for this round for
        ``hold_after_s`` (0: never block). The agent then either confirms,
        or stops this worker: its node was cut off, or frozen past its lease."""
        if hold_after_s <= 0:
            return
        logged = False
        while time.monotonic() - self.client.confirmed_at > hold_after_s \
                and not self._stop.is_set():
            if not logged:
                self.timer.untimed()  # the wait is the agent's, not this rank's speed
                log.warning("Rank %d: the agent has not confirmed round %d for %.0f s; "
                               "waiting for it before the next step.", self.rank, self.round,
                               hold_after_s)
                logged = True
            self._wake.set()
            self._stop.wait(0.05)

    def report(self, step: int, saving_for_s: float | None = None,
               at_once: bool = False) -> None:
        """Record ``step`` as this worker's latest; with ``saving_for_s``, a save
        that lasts up to that long from now (0: the save is over). The first
        step, each save and a step reported ``at_once`` are sent at once, the
        rest with the next beat."""
        first = self.step < 0 or at_once
        self.step = step
        if saving_for_s is None:
            self.timer.step_ended(time.monotonic())
        else:
            self.timer.untimed()  # a save is no measure of this rank's speed
            self.saving_until = time.monotonic() + saving_for_s if saving_for_s > 0 else 0.0
        if first or saving_for_s is not None:
            self._wake.set()  # the agent hears at once about the first step and saves

    def report_snapshot(self) -> None:
        """A memory snapshot was completed: sent at once, so the agent
        replicates it now rather than when it next looks."""
        self.snapshots += 1
        self._wake.set()

    def close(self) -> None:
        """Stop the thread (waiting up to 2 s for it), tell the agent this
        worker is exiting, and close the client."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2)
        # Interpreter shutdown can take seconds (torch, gloo): tell the agent
        # this silence is an exit, not a hang.
        self.client.heartbeat(self.rank, self.local_rank, os.getpid(), self.round, self.step,
                              exiting=True)
        self.client.close()


_heartbeat: Heartbeat | None = None
_device: torch.device | None = None  # the GPU init() bound this process to
_step = -1
_script_steps = False  # the script called step(): its numbers are its progress
_optimizer_steps = 0
_step_listeners: list[Callable[[int], None]] = []
# The agent's lease TTL (set by elasticd): a worker whose agent has not vouched
# for its round that long waits before its next step.
_hold_after_s = 0.0


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Join the process group described by the environment and start heartbeats.

    ``backend`` defaults to nccl when CUDA is available, gloo otherwise. With
    any backend that uses NCCL (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) each
    process is bound to the GPU of its LOCAL_RANK (:func:`join_process_group`).
    Safe to call twice. Raises ConfigError when LOCAL_RANK has no GPU, and
    whatever ``init_process_group`` raises when the group cannot form within
    ``timeout_s``.
    """
    global _device
    if not dist.is_initialized():
        _device = join_process_group(backend, timeout_s, _env_int("LOCAL_RANK", 0), torch.cuda,
                                      dist.init_process_group)
    _start_heartbeat()


def _start_heartbeat() -> None:
    """Start heartbeats to the agent named in the environment (none without one)."""
    global _heartbeat, _hold_after_s
    env = WorkerEnv()
    socket_path = env.agent_socket
    if socket_path and _heartbeat is None:
        hang_timeout = env.hang_timeout_s
        hang_timeout = _DEFAULT_HANG_TIMEOUT_S if hang_timeout is None else hang_timeout
        interval = min(2.0, max(0.2, hang_timeout / 5)) if hang_timeout > 0 else 2.0
        _heartbeat = Heartbeat(WorkerChannelClient(socket_path,
                                                   heartbeat_socket=env.heartbeat_socket),
                               interval)
        _hold_after_s = env.lease_ttl_s or 0.0
        atexit.register(shutdown)


def uses_nccl(backend: str) -> bool:
    """Whether ``backend``, in torch's syntax (``"nccl"``, ``"cuda:nccl"``,
    ``"cpu:gloo,cuda:nccl"``; any case), runs NCCL for some device."""
    return any(part.rpartition(":")[2].strip().lower() == "nccl" for part in backend.split(","))


def join_process_group(backend: str | None, timeout_s: float, local_rank: int, cuda,
                        init_process_group) -> torch.device | None:
    """``init_process_group`` for ``backend`` (None: nccl when ``cuda`` has a
    GPU, else gloo), bound to GPU ``local_rank`` when the backend uses NCCL and
    CUDA is available: ``set_device`` first (so NCCL, the caching allocator
    and every later ``.cuda()`` use it, not GPU 0), and ``device_id`` (torch
    then forms the NCCL communicator at once, so a bad GPU or network fails
    here, and splits subgroups from it). ``cuda`` is ``torch.cuda`` or a
    facade with its ``is_available``, ``device_count`` and ``set_device``.

    Raises ConfigError when ``local_rank`` names no visible GPU (more workers
    than GPUs, or a ``CUDA_VISIBLE_DEVICES`` per worker), and whatever
    ``init_process_group`` raises. NCCL without CUDA is left to torch to refuse.
    Returns the GPU bound, or None.
    """
    if backend is None:
        backend = "nccl" if cuda.is_available() else "gloo"
    device = None
    if uses_nccl(backend) and cuda.is_available():
        visible = cuda.device_count()
        if local_rank >= visible:
            raise ConfigError(
                f"LOCAL_RANK {local_rank} has no GPU of its own: this process sees {visible} "
                f"GPUs (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) "
                f"and NCCL needs one per worker; run at most {visible} workers on this node "
                "(--nproc-per-node gpu) or give each node its own GPUs")
        cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    init_process_group(backend=backend, init_method="env://",
                       timeout=datetime.timedelta(seconds=timeout_s), device_id=device)
    return device


def device_for(backend: str, cuda) -> torch.device:
    """The device of a process whose group runs ``backend``: the current CUDA
    device when the backend uses NCCL and CUDA is available, else the CPU."""
    if uses_nccl(backend) and cuda.is_available():
        return torch.device("cuda", cuda.current_device())
    return torch.device("cpu")


def device() -> torch.device:
    """Where this rank's model and batches belong: the GPU :func:`init` bound
    it to (its LOCAL_RANK's) when its group uses NCCL, else the CPU. After a
    process group formed elsewhere, the current CUDA device under NCCL. Raises
    RuntimeError before any process group exists."""
    if _device is not None:
        return _device
    if not dist.is_initialized():
        raise RuntimeError("elastic.device() needs a process group: call elastic.init() first")
    return device_for(str(dist.get_backend()), torch.cuda)


def step(n: int | None = None) -> int:
    """Report that a training step completed; ``n`` is its number (default:
    one more than the last). Cheap: the heartbeat thread carries it to the
    agent. Returns the step number."""
    global _step, _script_steps
    # The first number the script gives is sent at once: the optimizer hook may
    # have reported its own count (0 after a restart) just before, and the agent
    # (its goodput accounting) must not take a beat's worth of steps as a jump.
    renumbered = not _script_steps
    _script_steps = True
    _step = _step + 1 if n is None else int(n)
    if _heartbeat is not None:
        _heartbeat.report(_step, at_once=renumbered)
        _heartbeat.wait_until_confirmed(_hold_after_s)
    for listener in tuple(_step_listeners):
        listener(_step)
    return _step


def optimizer_stepped() -> None:
    """An optimizer step completed (the worker bootstrap installs a hook that
    calls this for every optimizer of every script): progress, for a script
    that does not call :func:`step`. Starts heartbeats to the agent at the
    first one, numbers the steps from 0, and holds like :func:`step` while the
    agent has not vouched for the round. Once the script called :func:`step`,
    its numbers alone are its progress and this does nothing."""
    global _optimizer_steps
    if _script_steps:
        return
    if _heartbeat is None:
        if _optimizer_steps < 0:
            return
        _start_heartbeat()
        if _heartbeat is None:  # no agent (plain torchrun): nothing to tell, ever
            _optimizer_steps = -1
            return
    _heartbeat.report(_optimizer_steps)
    _optimizer_steps += 1
    _heartbeat.wait_until_confirmed(_hold_after_s)


def on_step(listener: Callable[[int], None]) -> Callable[[], None]:
    """Call ``listener(n)`` at every :func:`step`, in the training thread, after
    the agent heard of it (the memory tier snapshots there). What it raises
    propagates from :func:`step`. Returns a function that removes it."""
    _step_listeners.append(listener)

    def remove() -> None:
        if listener in _step_listeners:
            _step_listeners.remove(listener)

    return remove


def snapshot_written() -> None:
    """A memory-tier snapshot of this worker's state is complete in its slot:
    the agent hears it at once (it replicates the slot to its buddy node)."""
    if _heartbeat is not None:
        _heartbeat.report_snapshot()


def saving(seconds: float) -> None:
    """Announce a checkpoint write of up to ``seconds`` (0 when done), so the
    agent's hang detection does not fire while no step completes."""
    if _heartbeat is not None:
        # The step the agent last heard of: the script's, or its optimizer's.
        _heartbeat.report(_heartbeat.step, saving_for_s=max(0.0, seconds))


def shutdown() -> None:
    """Stop heartbeats (the process group is left to the script)."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.close()
        _heartbeat = None
