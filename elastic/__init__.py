"""elastic: the library behind the elastic training daemon.

The control plane (``elastic.store``, ``elastic.rendezvous``, ``elastic.errors``)
imports without torch; only the worker-side modules import it.
"""

__version__ = "0.1.0"


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Join the process group from the environment and start heartbeats to the
    local agent (see :func:`elastic.worker.runtime.init`)."""
    from elastic.worker import runtime

    runtime.init(backend=backend, timeout_s=timeout_s)


def device():
    """The ``torch.device`` this rank trains on: its LOCAL_RANK's GPU when its
    group uses NCCL, else the CPU (see :func:`elastic.worker.runtime.device`)."""
    from elastic.worker import runtime

    return runtime.device()


def step(n: int | None = None) -> int:
    """Report a completed training step (see :func:`elastic.worker.runtime.step`)."""
    from elastic.worker import runtime

    return runtime.step(n)
