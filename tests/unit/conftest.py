"""Fixtures shared by the unit tests."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

import pytest

from agent.grpc_server import AgentServer
from tests.tls_certs import make_certs


@pytest.fixture
def socket_path(node):
    """The worker channel of the module's ``node`` fixture (a real agent of
    ``tests.unit.test_agent_loop.OneNode``), served on a real Unix socket."""
    # Not tmp_path: a Unix socket path must stay under 108 bytes.
    directory = tempfile.mkdtemp(prefix="elastic-test-", dir="/tmp")
    server = AgentServer("127.0.0.1:0", os.path.join(directory, "worker.sock"),
                         control=node.agent.service, heartbeats=node.agent.channel,
                         max_workers=2)
    server.start()
    try:
        yield server.worker_socket
    finally:
        server.stop(grace_s=0.1)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def certs():
    """A CA and the certificates signed by it (``tests.tls_certs``), once per module."""
    directory = tempfile.mkdtemp(prefix="elastic-tls-")
    try:
        yield make_certs(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def preadv_meeting(monkeypatch):
    """``preadv_meeting(n)``: from now on the first ``n`` calls of ``os.preadv``
    wait for each other at a barrier (which fewer than ``n`` threads reading at
    once never pass: it times out); returns the list of the calling threads' ids,
    one per call."""
    def install(n: int) -> list[int]:
        together = threading.Barrier(n, timeout=60)
        calls: list[int] = []
        real_preadv = os.preadv

        def meeting(*args):
            calls.append(threading.get_ident())
            if len(calls) <= n:
                together.wait()
            return real_preadv(*args)

        monkeypatch.setattr(os, "preadv", meeting)
        return calls
    return install
