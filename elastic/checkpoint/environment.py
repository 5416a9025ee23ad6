"""What a Checkpointer finds out from its environment: the checkpoint root and
mode, the agent's round, the agent's "saving" and "step" hooks, the training
device, and for the memory tier its directory, the job, node and local ranks.

Each is read only where the caller did not pass the value.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import Callable, Sequence

import torch

from elastic import worker_env
from elastic.checkpoint import layout, state
from elastic.checkpoint.staging import local_tensor
from elastic.errors import ConfigError

log = logging.getLogger(__name__)


def root_from_env(root: str | None) -> str:
    """``root``, else ``$ELASTIC_CHECKPOINT_DIR``, made absolute. Raises
    ConfigError when neither is set."""
    root = root or worker_env.WorkerEnv().checkpoint_dir
    if not root:
        raise ConfigError(f"no checkpoint directory: pass root= or set "
                          f"{worker_env.CHECKPOINT_DIR}")
    return os.path.abspath(root)


def mode_from_env() -> int:
    """``$ELASTIC_CHECKPOINT_MODE`` (octal, e.g. 750) or the private default.
    Raises ConfigError for a value that is not octal digits."""
    name = worker_env.CHECKPOINT_MODE
    raw = os.environ.get(name, "").strip()
    if not raw:
        return layout.DIR_MODE
    try:
        return int(raw.removeprefix("0o"), 8)
    except ValueError:
        raise ConfigError(f"{name}={raw[:20]!r}: expected an octal mode such as 700 or "
                          f"750") from None


def round_from_env() -> int:
    """The agent's round (``$ELASTIC_ROUND``, 0 without an agent): it names
    temporaries and is the fencing token of commits. Raises ConfigError for a
    value that is not an integer."""
    return worker_env.WorkerEnv().round


def default_on_saving() -> Callable[[float], None]:
    """The worker runtime's ``saving`` hook (it suspends the agent's hang
    detection), or a no-op where the worker runtime cannot be imported."""
    try:
        from elastic.worker import runtime
    except ImportError:
        return lambda seconds: None
    return runtime.saving


class SavingNotice:
    """Tells the ``on_saving`` hook a save's estimated duration when it starts and 0
    when it ends. Never raises: a failing hook is a warning, the save goes on."""

    # A save's duration announced: a fixed allowance for collectives, fsync and
    # commit plus the shard at a pessimistic per-rank write rate.
    FIXED_S = 60.0
    BYTES_PER_S = 100 * 2**20

    def __init__(self, on_saving: Callable[[float], None], rank: int):
        self._on_saving = on_saving
        self._rank = rank

    def started(self, nbytes: int) -> None:
        """A save of ``nbytes`` (this rank's shard) started."""
        self._announce(self.FIXED_S + nbytes / self.BYTES_PER_S)

    def ended(self) -> None:
        self._announce(0.0)

    def _announce(self, seconds: float) -> None:
        try:
            self._on_saving(seconds)
        except Exception as exc:  # noqa: BLE001 - a telemetry hook must not break a save
            log.warning("Rank %d: the on_saving hook failed (%s); the save goes on.",
                        self._rank, exc)


def cuda_index(device: torch.device | int) -> int | None:
    """A CUDA device's index (the current one for a bare ``cuda``); None for another type."""
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def training_device(chunks: Sequence[state.Chunk]) -> int | None:
    """The CUDA device the model's parameters are on (the first one found), so the
    checkpoint thread works on it rather than on device 0; None when none is on CUDA."""
    for chunk in chunks:
        for parameter in chunk.model.parameters():
            if local_tensor(parameter).is_cuda:
                return local_tensor(parameter).device.index
    return None


def memory_dir_from_env(memory_dir: str | None) -> str | None:
    """``memory_dir``, else ``$ELASTIC_MEMORY_DIR`` (set by an agent run with
    ``--memory-tier``), made absolute; None: the memory tier is off."""
    memory_dir = memory_dir or worker_env.WorkerEnv().memory_dir
    return os.path.abspath(memory_dir) if memory_dir else None


def job_and_node() -> tuple[str, str]:
    """The job and node ids a memory snapshot's manifest names: the agent's
    (``$ELASTIC_JOB_ID``, ``$ELASTIC_NODE_ID``), else ``local`` and this host's
    name made a valid id."""
    env = worker_env.WorkerEnv()
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:128].lstrip("._-")
    return env.job_id or "local", env.node_id or host or "localhost"


def local_world_size() -> int:
    """This node's number of ranks (``$LOCAL_WORLD_SIZE``, set by the agent and by
    torchrun; 1 when unset or not a number)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_snapshot_notice() -> Callable[[], None]:
    """The worker runtime's ``snapshot_written`` (the agent replicates a snapshot
    when told), or a no-op where the worker runtime cannot be imported."""
    try:
        from elastic.worker import runtime
    except ImportError:
        return lambda: None
    return runtime.snapshot_written


def default_step_hook() -> Callable[[Callable[[int], None]], Callable[[], None]] | None:
    """The worker runtime's ``on_step`` (the memory tier snapshots at each
    ``elastic.step(n)``), or None where the worker runtime cannot be imported."""
    try:
        from elastic.worker import runtime
    except ImportError:
        return None
    return runtime.on_step
