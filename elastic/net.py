"""Small network helpers shared by the store launcher, the rendezvous and the agent."""

from __future__ import annotations

import os
import socket

from elastic._compat import grpc_waits

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_VERBOSITY_ENV = "GRPC_VERBOSITY"
# How long one slice of a blocking gRPC wait may last in a long-running daemon.
GRPC_WAIT_SLICE_S = 1.0
# How long one connection attempt (TCP, TLS handshake, the server's HTTP/2
# SETTINGS) may take before gRPC gives it up.
GRPC_CONNECT_TIMEOUT_S = 5.0
# How soon a channel tries a lost connection again, and the longest it waits between
# tries: a peer or an agent that restarts is reached again within a second.
GRPC_INITIAL_RECONNECT_BACKOFF_S = 0.1
GRPC_MAX_RECONNECT_BACKOFF_S = 1.0


def no_grpc_fork_handlers() -> None:
    """Turn gRPC's fork handlers off for this process (and its children),
    unless the environment already chose. Call it before gRPC starts.

    Our processes fork only to exec (``subprocess``), which needs none. With
    them, a fork that is not a vfork (``Popen`` with ``preexec_fn``) restarts
    gRPC's poller thread in the child, where ``close_fds`` has just closed the
    poller's epoll descriptor: the child aborts (SIGABRT) before it execs
    (grpc/grpc issue 43055).
    """
    os.environ.setdefault(GRPC_FORK_SUPPORT_ENV, "false")


def quiet_grpc_logs() -> None:
    """Keep gRPC's own informational lines off stderr for this process (and
    its children), unless the environment already chose (``GRPC_VERBOSITY``).
    Call it before gRPC starts.

    gRPC logs a refused TLS handshake itself ("Handshake failed with error
    SSL_ERROR_SSL: ... CERTIFICATE_VERIFY_FAILED"), at INFO, in its own format,
    before our error says the same in an operator's words (which certificate,
    what to change); its errors still show.
    """
    os.environ.setdefault(GRPC_VERBOSITY_ENV, "ERROR")


def relax_grpc_blocking_waits(slice_s: float = GRPC_WAIT_SLICE_S) -> bool:
    """Let threads blocked in gRPC (a stream waiting for its next message, a
    call waiting for its answer) sleep ``slice_s`` at a time instead of 0.1 s.

    grpc-python cuts every blocking wait into slices of 0.1 s, so that a main
    thread blocked in a call still runs Python's signal handlers promptly.
    Each of a daemon's idle streams then wakes ten times a second for nothing:
    most of an idle agent's CPU. A longer slice delays a signal handler only
    while the main thread is inside a blocking gRPC call (ours are short and
    carry deadlines) and by at most ``slice_s``. Process-wide; call it once,
    early, in a daemon (not in a library). Returns False, and changes nothing,
    when the installed grpc no longer lets us (see
    :mod:`elastic._compat.grpc_waits`; tests/unit/test_net.py fails then, so an
    upgrade does not silently bring the wakeups back).
    """
    return grpc_waits.set_blocking_wait_slice_s(slice_s)


def fast_reconnect_options() -> list[tuple[str, int]]:
    """gRPC channel options that retry a lost connection
    ``GRPC_INITIAL_RECONNECT_BACKOFF_S`` after it fails, backing off to at most
    ``GRPC_MAX_RECONNECT_BACKOFF_S`` (gRPC's default grows to 120 s), and give
    each attempt ``GRPC_CONNECT_TIMEOUT_S`` to finish.

    gRPC's C core reads ``grpc.min_reconnect_backoff_ms`` as the *connect
    timeout* (the spec's MIN_CONNECT_TIMEOUT), not as a backoff, so it must
    leave time for a TLS handshake and HTTP/2 SETTINGS on a loaded machine
    (too short: "connection attempt timed out before receiving SETTINGS
    frame"). A refused connection still fails at once, and callers' deadlines
    still bound every call, so a long connect timeout delays nothing.
    """
    return [
        ("grpc.initial_reconnect_backoff_ms", int(GRPC_INITIAL_RECONNECT_BACKOFF_S * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(GRPC_MAX_RECONNECT_BACKOFF_S * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(GRPC_CONNECT_TIMEOUT_S * 1000)),
    ]


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
