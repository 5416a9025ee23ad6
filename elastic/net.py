"""Small network helpers shared by the store launcher, the rendezvous and the agent."""

from __future__ import annotations

import socket


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
