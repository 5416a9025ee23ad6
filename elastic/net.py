"""Small network helpers shared by the store launcher, the rendezvous and the agent."""

from __future__ import annotations

import os
import socket

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"


def no_grpc_fork_handlers() -> None:
    """Turn gRPC's fork handlers off for this process (and its children),
    unless the environment already chose. Call it before gRPC starts.

    Our processes fork only to exec (``subprocess``), which needs none. With
    them, a fork that is not a vfork (``Popen`` with ``preexec_fn``) restarts
    gRPC's poller thread in the child, where ``close_fds`` has just closed the
    poller's epoll descriptor: the child aborts before it execs (grpc/grpc
    issue 43055; seen as an agent that "exited -6" in the chaos campaign).
    """
    os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago.

    Another process may take it before the caller binds it; callers that bind
    it themselves retry on EADDRINUSE, and callers that hand it to workers
    (MASTER_PORT) pick a fresh one each round.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
