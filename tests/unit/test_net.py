"""elastic.net: how the daemon's idle gRPC streams wait, and how its channels connect."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
from grpc import _common as grpc_common
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elastic.net import (
    GRPC_MAX_RECONNECT_BACKOFF_S,
    fast_reconnect_options,
    relax_grpc_blocking_waits,
)


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def _wakeups_of_an_idle_stream_reader(seconds: float) -> int:
    """Context switches, over ``seconds``, of a thread that waits on a gRPC
    server stream with nothing to say (a health Watch whose status stays)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
    first = threading.Event()
    tid: list[int] = []

    def read() -> None:
        tid.append(threading.get_native_id())
        try:
            for _ in stream:
                first.set()  # the current status; then nothing until cancelled
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first.wait(5)
        time.sleep(0.3)
        before = _voluntary_switches(tid[0])
        time.sleep(seconds)
        return _voluntary_switches(tid[0]) - before
    finally:
        stream.cancel()
        reader.join(5)
        channel.close()
        server.stop(None)


def test_relaxed_waits_let_an_idle_stream_reader_sleep_instead_of_waking_ten_times_a_second():
    saved = grpc_common.MAXIMUM_WAIT_TIMEOUT
    try:
        default = _wakeups_of_an_idle_stream_reader(1.0)
        assert relax_grpc_blocking_waits(1.0)  # False: grpc changed; see the docstring
        relaxed = _wakeups_of_an_idle_stream_reader(1.0)
    finally:
        grpc_common.MAXIMUM_WAIT_TIMEOUT = saved
    assert default >= 7, default  # grpc's 0.1 s slices: about 10 a second
    assert relaxed <= 3, relaxed  # 1 s slices: about 1


class _SlowToAnswer:
    """A TCP forwarder on loopback that holds each new connection ``delay_s``
    before it forwards anything: a server whose handshake (TLS, HTTP/2
    SETTINGS) is slow because it is busy."""

    def __init__(self, target_port: int, delay_s: float):
        self._target_port, self._delay_s = target_port, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        time.sleep(self._delay_s)
        try:
            server = socket.create_connection(("127.0.0.1", self._target_port))
        except OSError:  # the test is over and its server gone
            client.close()
            return
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()


def _health_check_through_a_slow_server(options, delay_s: float) -> grpc.StatusCode | None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    slow = _SlowToAnswer(port, delay_s)
    channel = grpc.insecure_channel(f"127.0.0.1:{slow.port}", options=options)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return None
    except grpc.RpcError as exc:
        return exc.code()
    finally:
        channel.close()
        slow.close()
        server.stop(None)


def test_a_call_waits_for_a_server_slow_to_answer_its_connection_within_its_deadline():
    # The options our peer and worker channels had: gRPC reads the "min backoff"
    # as the connect timeout, so a handshake slower than 0.1 s failed the call.
    old = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
           ("grpc.max_reconnect_backoff_ms", 1_000)]
    assert _health_check_through_a_slow_server(old, 0.5) == grpc.StatusCode.UNAVAILABLE
    assert _health_check_through_a_slow_server(fast_reconnect_options(), 0.5) is None


def _seconds_to_reach_a_server_that_came_back(options, down_s: float) -> float:
    """How long a call (waiting for a connection) takes to reach a server that
    was down for ``down_s`` while the channel kept trying."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    try:
        channel.subscribe(lambda _state: None, try_to_connect=True)  # keep dialling
        time.sleep(down_s)  # refused all along: the backoff grows
        assert server.add_insecure_port(f"127.0.0.1:{port}") == port
        server.start()
        started = time.monotonic()
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                  wait_for_ready=True)
        return time.monotonic() - started
    finally:
        channel.close()
        server.stop(None)


def test_a_channel_reaches_a_server_that_came_back_within_the_longest_backoff():
    # With gRPC's own backoff (from 1 s, 1.6 times longer each try, up to 120 s)
    # the next try after 6 s down comes 2 to 4 s after the server is back.
    took = _seconds_to_reach_a_server_that_came_back(fast_reconnect_options(), 6.0)
    assert took < GRPC_MAX_RECONNECT_BACKOFF_S + 0.5, took


# A client with a certificate of another CA, refused at the handshake, in a
# process of its own (gRPC reads GRPC_VERBOSITY once, when it starts).
_REFUSED_HANDSHAKE = """
import sys, tempfile
import agent  # what elasticctl and elasticd import first
import grpc
from concurrent import futures
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tests.tls_certs import make_certs

c = make_certs(tempfile.mkdtemp())
read = lambda path: open(path, "rb").read()
server = grpc.server(futures.ThreadPoolExecutor(2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
    [(read(c.agent.key), read(c.agent.cert))], read(c.ca), True))
server.start()
creds = grpc.ssl_channel_credentials(read(c.other_ca), read(c.stranger.key), read(c.stranger.cert))
with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as exc:
        print("our error:", exc.code().name, file=sys.stderr)
server.stop(None)
"""


def _stderr_of_a_refused_handshake(**env: str) -> str:
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    out = subprocess.run([sys.executable, "-c", _REFUSED_HANDSHAKE], capture_output=True,
                         text=True, timeout=60, env={**environ, **env},
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert "our error: UNAVAILABLE" in out.stderr, out.stderr
    return out.stderr


def test_grpc_s_own_handshake_line_stays_off_the_agent_s_stderr():
    assert "Handshake failed" not in _stderr_of_a_refused_handshake()
    # An operator who asks for gRPC's lines gets them (and the test sees them).
    assert "Handshake failed" in _stderr_of_a_refused_handshake(GRPC_VERBOSITY="INFO")
