"""elastic.net: how the daemon's idle gRPC streams wait."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from grpc import _common as grpc_common
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elastic.net import relax_grpc_blocking_waits


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
