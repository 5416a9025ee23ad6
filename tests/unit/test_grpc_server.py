"""AgentServer, agent.peers and the worker channel client against real in-process gRPC servers."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import stat
import subprocess
import sys
import threading
import time

import grpc
import pytest

from agent import peers
from agent.assign import worker_envs
from agent.grpc_server import AgentServer, grpc_code_for
from agent.hang_attribution import RankStack
from agent.peers import HealthWatcher, PeerHealth
from elastic.errors import (
    ConfigError,
    DuplicateNodeError,
    ElasticError,
    FencedError,
    LeaseLostError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastic.hostport import HostPort
from elastic.net import free_port
from elastic.records import MAX_REASON_CHARS
from elastic.rendezvous.api import Member, Round
from elastic.v1 import agent_pb2, agent_pb2_grpc
from elastic.worker.channel import WorkerChannelClient
from tests.waiting import LOADED_SLACK_S

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.timeout(20)

_ONE_NODE_ROUND = Round(number=1, members=(Member("a", 0, "h0", 2),), master_addr="h0",
                        master_port=2345, reason="", leader="a", created_at=0)


class RecordingControl:
    """An AgentControl that answers fixed values and records what it was asked."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.error: BaseException | None = None

    def _maybe_fail(self) -> None:
        if self.error is not None:
            raise self.error

    def status(self) -> agent_pb2.AgentStatusResponse:
        self.calls.append(("status", ""))
        self._maybe_fail()
        return agent_pb2.AgentStatusResponse(
            job_id="job-1", node_id="node-a", state="RUNNING", round=3, node_rank=0,
            world_size=4, restarts=1, last_failure="worker 2 exited with 1", version="0.1.0",
            workers=[agent_pb2.WorkerStatus(local_rank=0, rank=0, pid=4242, state="running",
                                            last_step=17, step_rate=2.5, heartbeat_age_s=0.3)],
        )

    def drain(self, reason: str) -> tuple[bool, str]:
        self.calls.append(("drain", reason))
        self._maybe_fail()
        return True, "leaving at the next round boundary"

    def request_restart(self, reason: str) -> tuple[bool, int]:
        self.calls.append(("request_restart", reason))
        self._maybe_fail()
        return True, 3

    # What CollectStacks answers: this agent's workers' stacks, summarised.
    stacks = [agent_pb2.RankStack(rank=2, node_id="node-a", dumped=True,
                                  place="train.py:88 in next_batch", step=41,
                                  progress_age_s=3.5)]

    def collect_stacks(self, round_number: int) -> list[agent_pb2.RankStack]:
        self.calls.append(("collect_stacks", str(round_number)))
        return self.stacks


class RecordingSink:
    """A HeartbeatSink that keeps every heartbeat and answers ``stop_requested``, ``hold``."""

    def __init__(self):
        self.requests: list[agent_pb2.WorkerChannelHeartbeatRequest] = []
        self.stop_requested = False
        self.hold = False
        self.error: BaseException | None = None

    def heartbeat(self, request: agent_pb2.WorkerChannelHeartbeatRequest) -> tuple[bool, bool]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        return self.stop_requested, self.hold


@pytest.fixture
def control():
    return RecordingControl()


@pytest.fixture
def sink():
    return RecordingSink()


@pytest.fixture
def server(sock_dir, control, sink):
    srv = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "run", "worker.sock"), control, sink,
                      max_workers=4)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop(grace_s=0.1)
        peers.close_channels()


def _wait_for(q: queue.Queue, timeout_s: float = 3.0 + LOADED_SLACK_S):
    return q.get(timeout=timeout_s)


# --- Agent service --------------------------------------------------------------------------------

def test_status_round_trip(server, control):
    status = peers.query_status(server.address)

    assert status == control.status()
    assert (status.node_id, status.round, status.world_size) == ("node-a", 3, 4)
    assert status.workers[0].pid == 4242 and status.workers[0].last_step == 17


def test_drain_and_restart_round_trip(server, control):
    assert peers.request_drain(server.address, "hardware maintenance", timeout_s=2.0) == (
        True, "leaving at the next round boundary")
    assert peers.request_restart(server.address, "operator asked", timeout_s=2.0) == (True, 3)
    assert control.calls == [("drain", "hardware maintenance"),
                             ("request_restart", "operator asked")]


def test_huge_reasons_reach_the_agent_capped(server, control):
    huge = "r" * 800_000  # alone over half of etcd's request limit once in a record

    peers.request_drain(server.address, huge, timeout_s=5.0)
    peers.request_restart(server.address, huge, timeout_s=5.0)

    assert [call for call, _ in control.calls] == ["drain", "request_restart"]
    for _, reason in control.calls:
        assert len(reason) <= MAX_REASON_CHARS
        assert reason.startswith("rrrr") and reason.endswith("more characters]")


def test_address_reports_the_bound_port(server):
    where = HostPort.parse(server.address)
    assert where.host == "127.0.0.1" and where.port > 0


@pytest.mark.parametrize("error, code", [
    (ConfigError("bad reason"), grpc.StatusCode.INVALID_ARGUMENT),
    (FencedError("round 3 is not current"), grpc.StatusCode.FAILED_PRECONDITION),
    (StoreUnavailableError("etcd down"), grpc.StatusCode.UNAVAILABLE),
    (StoreTimeoutError("etcd slow"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (ElasticError("plain"), grpc.StatusCode.INTERNAL),
    (ValueError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_control_errors_arrive_as_mapped_grpc_codes(server, control, error, code):
    control.error = error
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            agent_pb2_grpc.AgentStub(channel).Drain(agent_pb2.AgentDrainRequest(reason="r"),
                                                    timeout=2)
    assert info.value.code() == code
    assert str(error) in info.value.details()


class _BlockingControl(RecordingControl):
    """Status blocks until ``release`` is set, then fails as etcd being cut off does."""

    def __init__(self):
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def status(self) -> agent_pb2.AgentStatusResponse:
        self.started.set()
        self.release.wait(10)
        try:
            raise StoreUnavailableError("etcd is cut off")
        finally:
            self.finished.set()


def test_a_handler_that_outlives_its_callers_deadline_does_not_crash_the_agent(sock_dir, sink):
    # The chaos campaign's SIGSEGV: a handler slowed by an unreachable etcd
    # outlives its caller's deadline; grpc.aio released the call while the
    # handler still ran, and the handler's context.peer() (in the log line of
    # its error) dereferenced NULL. The process must survive and keep serving.
    control = _BlockingControl()
    srv = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "worker.sock"), control, sink,
                      max_workers=4)
    srv.start()
    try:
        with grpc.insecure_channel(srv.address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                agent_pb2_grpc.AgentStub(channel).Status(agent_pb2.AgentStatusRequest(),
                                                         timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            time.sleep(0.3)  # the server has seen the cancellation by now
            control.release.set()  # the handler logs the error with context.peer(), aborts
            assert control.finished.wait(5)
            with pytest.raises(grpc.RpcError) as info:
                agent_pb2_grpc.AgentStub(channel).Status(agent_pb2.AgentStatusRequest(),
                                                         timeout=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(grace_s=0.1)


def test_stopping_with_a_handler_in_flight_waits_for_it_without_crashing(sock_dir, sink):
    # Stopping cancels the RPCs in flight; the handler still running must not
    # find its call freed (as above), and stop() waits for it (within grace + 1 s;
    # on a loaded machine the timer that releases it may fire after that).
    control = _BlockingControl()
    srv = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "worker.sock"), control, sink,
                      max_workers=4)
    srv.start()
    with grpc.insecure_channel(srv.address) as channel:
        call = agent_pb2_grpc.AgentStub(channel).Status.future(agent_pb2.AgentStatusRequest(),
                                                               timeout=5)
        assert control.started.wait(5)
        threading.Timer(0.5, control.release.set).start()
        began = time.monotonic()
        srv.stop(grace_s=0.1)
        took = time.monotonic() - began
        assert control.finished.wait(LOADED_SLACK_S)  # its error log and abort ran, and returned
        assert 0.3 < took < 0.1 + 1.0 + LOADED_SLACK_S  # waited past the grace, within its cap
        with pytest.raises(grpc.RpcError):
            call.result(timeout=5)


def test_peer_helpers_translate_agent_errors(server, control):
    control.error = ConfigError("reason must not be empty")
    with pytest.raises(ConfigError, match="reason must not be empty"):
        peers.request_drain(server.address, "", timeout_s=2.0)

    control.error = FencedError("round 3 is not current")
    with pytest.raises(ElasticError, match="FAILED_PRECONDITION: round 3 is not current"):
        peers.request_restart(server.address, "r", timeout_s=2.0)


def test_grpc_code_for_covers_the_error_tree():
    assert grpc_code_for(LeaseLostError("gone")) == grpc.StatusCode.UNAVAILABLE
    assert grpc_code_for(DuplicateNodeError("node-a")) == grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_code_for(KeyError("x")) == grpc.StatusCode.INTERNAL


# --- Health ---------------------------------------------------------------------------------------

def test_health_follows_set_serving(server):
    assert peers.check_health(server.address) == "NOT_SERVING"

    server.set_serving(True)
    assert peers.check_health(server.address) == "SERVING"
    assert peers.check_health(server.address, service="elastic.v1.Agent") == PeerHealth.SERVING

    server.set_serving(False)
    assert peers.check_health(server.address) == "NOT_SERVING"
    assert peers.check_health(server.address, service="no.such.Service") == "UNKNOWN"


def test_health_watcher_reports_changes_and_reconnects(sock_dir, control, sink):
    first = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "a.sock"), control, sink)
    first.start()
    seen: queue.Queue[str] = queue.Queue()
    watcher = HealthWatcher(first.address, seen.put,
                            initial_backoff_s=0.05, max_backoff_s=0.2).start()
    second = None
    try:
        assert _wait_for(seen) == "NOT_SERVING"
        first.set_serving(True)
        assert _wait_for(seen) == "SERVING"
        first.set_serving(False)
        assert _wait_for(seen) == "NOT_SERVING"
        first.set_serving(True)
        assert _wait_for(seen) == "SERVING"

        first.stop(grace_s=0.1)  # graceful: NOT_SERVING first, then the stream breaks
        assert _wait_for(seen) == "NOT_SERVING"
        assert _wait_for(seen) == "UNREACHABLE"

        second = AgentServer(first.address, os.path.join(sock_dir, "b.sock"), control, sink)
        second.start()
        assert _wait_for(seen) == "NOT_SERVING"
        second.set_serving(True)
        assert _wait_for(seen) == "SERVING"
        assert watcher.status == PeerHealth.SERVING
    finally:
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 0.5 + LOADED_SLACK_S
        assert not [t for t in threading.enumerate()
                    if t.name == f"health-watch-{first.address}"], "the watch thread lives on"
        first.stop(grace_s=0)
        if second is not None:
            second.stop(grace_s=0)
        peers.close_channels()
    assert seen.empty()


# An agent process: serves, says its address, stops serving when stdin has a line, exits.
_SERVE_UNTIL_TOLD = """
import sys
from agent.grpc_server import AgentServer
server = AgentServer("127.0.0.1:0", sys.argv[1], control=None, heartbeats=None)
server.start()
server.set_serving(True)
print(server.address, flush=True)
sys.stdin.readline()
server.stop(grace_s=0.5)
"""


def test_an_agent_watched_by_peers_stops_serving_and_its_process_exits(sock_dir):
    # Peers hold Watch streams on every agent; a stopping server must end
    # them, or the process cannot exit (what a SIGTERM-ed agent does after
    # stop()). Two watchers on one service, one on another.
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_UNTIL_TOLD,
                             os.path.join(sock_dir, "w.sock")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    watchers = []
    try:
        addr = proc.stdout.readline().strip()
        assert addr, "the agent process did not start serving"
        seen = [queue.Queue() for _ in range(3)]
        watchers = [HealthWatcher(addr, q.put, service=service, max_backoff_s=0.2).start()
                    for q, service in zip(seen, ("", "", "elastic.v1.Agent"))]
        assert [_wait_for(q) for q in seen] == ["SERVING"] * 3

        proc.stdin.write("stop\n")
        proc.stdin.flush()
        started = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - started < 3.0 + LOADED_SLACK_S
        assert [_wait_for(q) for q in seen] == ["NOT_SERVING"] * 3  # a graceful stop
        assert [_wait_for(q) for q in seen] == ["UNREACHABLE"] * 3
    finally:
        for watcher in watchers:
            watcher.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        peers.close_channels()


def test_unreachable_peer_is_reported_within_the_timeout():
    addr = f"127.0.0.1:{free_port()}"  # nobody listens there

    started = time.monotonic()
    assert peers.check_health(addr, timeout_s=0.5) == "UNREACHABLE"
    assert peers.query_status(addr, timeout_s=0.5) is None
    assert time.monotonic() - started < 2 * 0.5 + LOADED_SLACK_S
    with pytest.raises(ElasticError, match="UNAVAILABLE"):
        peers.request_drain(addr, "r", timeout_s=0.5)
    peers.close_channels()


def test_health_watcher_of_unreachable_peer_says_so_and_stops_quickly():
    seen: queue.Queue[str] = queue.Queue()
    watcher = HealthWatcher(f"127.0.0.1:{free_port()}", seen.put, max_backoff_s=0.1).start()
    try:
        assert _wait_for(seen) == "UNREACHABLE"
    finally:
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 0.5 + LOADED_SLACK_S
        peers.close_channels()
    assert seen.empty()  # UNREACHABLE once, not once per retry


# --- Worker channel -------------------------------------------------------------------------------

def test_heartbeats_reach_the_sink_over_the_unix_socket(server, sink):
    with WorkerChannelClient(server.worker_socket, timeout_s=2.0) as client:
        stop = client.heartbeat(rank=5, local_rank=1, pid=777, round=3, step=41, saving_for_s=12.5)
        assert stop is False
        sink.stop_requested = True
        assert client.heartbeat(5, 1, 777, 3, 42) is True

    first, second = sink.requests
    assert (first.rank, first.local_rank, first.pid, first.round, first.step,
            first.saving_for_s) == (5, 1, 777, 3, 41, 12.5)
    assert (second.step, second.saving_for_s) == (42, 0.0)


@pytest.mark.parametrize("transport", ["grpc", "datagram"])
def test_an_answer_asking_to_hold_does_not_vouch_for_the_round(server, sink, transport):
    with (WorkerChannelClient(server.worker_socket, timeout_s=2.0) if transport == "grpc"
          else _datagram_client(server)) as client:
        client.heartbeat(0, 0, 1, 1, 1)
        vouched = client.confirmed_at
        sink.hold = True
        client.heartbeat(0, 0, 1, 1, 2)
        assert client.confirmed_at == vouched
        sink.hold = False
        client.heartbeat(0, 0, 1, 1, 3)
        assert client.confirmed_at > vouched


def test_worker_socket_is_private_and_services_are_separated(server):
    assert stat.S_IMODE(os.stat(server.worker_socket).st_mode) == 0o600
    # Heartbeats are not accepted from the network, and control is not on the workers' socket.
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            agent_pb2_grpc.WorkerChannelStub(channel).Heartbeat(
                agent_pb2.WorkerChannelHeartbeatRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(f"unix:{server.worker_socket}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            agent_pb2_grpc.AgentStub(channel).Status(agent_pb2.AgentStatusRequest(), timeout=2)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_heartbeat_sink_error_does_not_raise_in_the_worker(server, sink):
    sink.error = ValueError("agent bug")
    with WorkerChannelClient(server.worker_socket) as client:
        assert client.heartbeat(0, 0, 1, 1, 1) is False


def test_heartbeat_to_a_missing_socket_returns_false_quickly(sock_dir):
    client = WorkerChannelClient(os.path.join(sock_dir, "nobody.sock"), timeout_s=0.5)
    try:
        started = time.monotonic()
        assert client.heartbeat(0, 0, os.getpid(), 1, -1) is False
        assert client.heartbeat(0, 0, os.getpid(), 1, -1) is False
        assert time.monotonic() - started < 2 * 0.5 + LOADED_SLACK_S
    finally:
        client.close()
    assert client.heartbeat(0, 0, os.getpid(), 1, -1) is False  # closed: still no exception


# --- Binding --------------------------------------------------------------------------------------

def test_stale_socket_is_replaced_and_foreign_files_are_refused(sock_dir, control, sink):
    stale = os.path.join(sock_dir, "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
        leftover.bind(stale)  # closed without unlink: what a killed agent leaves behind
    srv = AgentServer("127.0.0.1:0", stale, control, sink)
    srv.start()
    try:
        with WorkerChannelClient(stale) as client:
            assert client.heartbeat(0, 0, 1, 1, 1) is False
        assert len(sink.requests) == 1

        # A live agent's socket is not stolen, and its port is not shared.
        with pytest.raises(ConfigError, match="in use"):
            AgentServer("127.0.0.1:0", stale, control, sink).start()
        with pytest.raises(ConfigError, match="cannot listen"):
            AgentServer(srv.address, os.path.join(sock_dir, "other.sock"), control, sink).start()
    finally:
        srv.stop(grace_s=0)
    assert not os.path.exists(stale)

    regular = os.path.join(sock_dir, "notes.txt")
    with open(regular, "w") as f:
        f.write("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        AgentServer("127.0.0.1:0", regular, control, sink).start()
    assert os.path.exists(regular)


@pytest.mark.parametrize("listen", ["127.0.0.1", ":80", "host:http", "host:70000"])
def test_malformed_listen_address_is_a_config_error(listen, control, sink):
    with pytest.raises(ConfigError, match="HOST:PORT"):
        AgentServer(listen, "/tmp/unused.sock", control, sink)


def test_grpc_modules_do_not_import_torch():
    code = ("import sys, agent.grpc_server, agent.peers, elastic.worker.channel; "
            "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


@pytest.mark.parametrize("service", ["Agent", "WorkerChannel"])
def test_the_server_implements_every_rpc_of_the_proto(server, service):
    # protoc's generated base classes answer UNIMPLEMENTED; an RPC added to
    # the proto but not to the agent would silently fall back to them. An
    # empty request is every method's message with its defaults: whatever
    # the agent answers to it (a refusal included), it is not UNIMPLEMENTED.
    descriptor = agent_pb2.DESCRIPTOR.services_by_name[service]
    assert descriptor.methods, "the proto lists no RPCs"
    target = server.address if service == "Agent" else f"unix:{server.worker_socket}"
    unimplemented = []
    with grpc.insecure_channel(target) as channel:
        for method in descriptor.methods:
            call = channel.unary_unary(f"/{descriptor.full_name}/{method.name}")
            try:
                call(b"", timeout=5)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    unimplemented.append(method.name)
    assert unimplemented == []


# --- Worker heartbeats as datagrams (agent.heartbeat_socket) --------------------------------------

def _datagram_client(server, timeout_s: float = 2.0) -> WorkerChannelClient:
    # The gRPC socket is a dead path: whatever reaches the sink came as a datagram.
    return WorkerChannelClient("/nonexistent/agent.sock", timeout_s=timeout_s,
                               heartbeat_socket=server.heartbeat_socket)


def test_heartbeat_datagrams_reach_the_sink_and_carry_its_answers_back(server, sink):
    assert server.heartbeat_socket == os.path.join(os.path.dirname(server.worker_socket),
                                                   "worker.hb.sock")
    with _datagram_client(server) as client:
        assert client.heartbeat(rank=5, local_rank=1, pid=777, round=3, step=41,
                                saving_for_s=12.5, step_time_s=0.11, step_busy_s=0.105) is False
        sink.stop_requested = True
        assert client.heartbeat(5, 1, 777, 3, 42, exiting=True) is True
    first, second = sink.requests[:2]
    assert (first.rank, first.local_rank, first.pid, first.round, first.step,
            first.saving_for_s, first.exiting) == (5, 1, 777, 3, 41, 12.5, False)
    assert (first.step_time_s, first.step_busy_s) == (0.11, 0.105)
    assert (second.step, second.saving_for_s, second.exiting) == (42, 0.0, True)


def test_heartbeat_socket_is_private_to_the_agents_user(server):
    info = os.stat(server.heartbeat_socket)
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600


def test_a_silent_or_refusing_agent_is_no_answer_and_the_socket_keeps_serving(server, sink,
                                                                            caplog):
    with _datagram_client(server, timeout_s=0.5) as client:
        sink.error = ValueError("agent bug")
        assert client.heartbeat(0, 0, 1, 1, 1) is False
        sink.error = None
        # Values no worker sends: refused by the same checks as the gRPC call.
        assert client.heartbeat(0, 0, 1, 1, step=-5) is False
        assert client.heartbeat(0, 0, 1, 1, step=9, step_busy_s=float("nan")) is False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.bind("")
            raw.settimeout(0.5)
            for junk in (b"\xff" * 10, b"x" * 70_000):
                raw.sendto(junk, server.heartbeat_socket)
                with pytest.raises(TimeoutError):
                    raw.recv(100)
        # ... and the next good heartbeat is answered
        assert client.heartbeat(0, 0, 1, 1, 2) is False
        sink.stop_requested = True
        assert client.heartbeat(0, 0, 1, 1, 3) is True
    assert [r.step for r in sink.requests] == [1, 2, 3]
    refusals = [r.getMessage() for r in caplog.records if "heartbeat datagram" in r.getMessage()]
    assert any("malformed" in m for m in refusals) and any("over" in m for m in refusals)
    assert any("step" in m for m in refusals) and any("step_busy_s" in m for m in refusals)


def test_only_the_agent_can_answer_a_workers_heartbeat(sock_dir):
    # The client's socket is connected to the agent's: a forged "stop" from
    # another process never reaches it. This test plays the agent's end.
    agent_path = os.path.join(sock_dir, "agent.hb.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent, \
            WorkerChannelClient("/nonexistent/agent.sock", timeout_s=5.0,
                                heartbeat_socket=agent_path) as client:
        agent.bind(agent_path)
        agent.settimeout(5.0)
        answers: queue.Queue[bool] = queue.Queue()
        beat = threading.Thread(target=lambda: answers.put(client.heartbeat(0, 0, 1, 1, 1)))
        beat.start()
        _, address = agent.recvfrom(4096)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
            forged = agent_pb2.WorkerChannelHeartbeatResponse(stop_requested=True)
            with pytest.raises(PermissionError):
                stranger.sendto(forged.SerializeToString(), address)
        agent.sendto(agent_pb2.WorkerChannelHeartbeatResponse().SerializeToString(), address)
        beat.join(timeout=5)
        assert answers.get(timeout=5) is False


def test_heartbeat_datagrams_reach_a_restarted_agent_at_the_same_path(sock_dir, control, sink):
    path = os.path.join(sock_dir, "agent.sock")
    first = AgentServer("127.0.0.1:0", path, control, sink)
    first.start()
    client = WorkerChannelClient("/nonexistent/agent.sock", timeout_s=0.5,
                                 heartbeat_socket=first.heartbeat_socket)
    try:
        assert client.heartbeat(0, 0, 1, 1, 1) is False
        started = time.monotonic()
        first.stop(grace_s=0)
        assert time.monotonic() - started < 2.0 + LOADED_SLACK_S
        assert not os.path.exists(first.heartbeat_socket)
        assert client.heartbeat(0, 0, 1, 1, 2) is False  # no agent: no answer, no exception
        second = AgentServer("127.0.0.1:0", path, control, sink)
        second.start()
        try:
            sink.stop_requested = True
            assert client.heartbeat(0, 0, 1, 1, 3) is True
        finally:
            second.stop(grace_s=0)
    finally:
        client.close()
    assert [r.step for r in sink.requests] == [1, 3]
    assert client.heartbeat(0, 0, 1, 1, 4) is False  # closed: still no exception


def test_a_stale_heartbeat_socket_is_replaced_and_a_live_one_is_not_stolen(sock_dir, control,
                                                                         sink):
    path = os.path.join(sock_dir, "agent.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as leftover:
        leftover.bind(os.path.join(sock_dir, "agent.hb.sock"))  # a killed agent's
    srv = AgentServer("127.0.0.1:0", path, control, sink)
    srv.start()
    try:
        with WorkerChannelClient(path, heartbeat_socket=srv.heartbeat_socket) as client:
            assert client.heartbeat(0, 0, 1, 1, 1) is False
        assert len(sink.requests) == 1
        os.unlink(path)  # only the datagram socket is still live
        with pytest.raises(ConfigError, match="in use"):
            AgentServer("127.0.0.1:0", path, control, sink).start()
    finally:
        srv.stop(grace_s=0)


def test_no_heartbeat_socket_when_its_path_would_not_fit(sock_dir, control, sink):
    # 107 bytes fit the gRPC socket; its ".hb" sibling would not: heartbeats take gRPC.
    path = os.path.join(sock_dir, "x" * (107 - len(os.fsencode(sock_dir)) - 1 - 5) + ".sock")
    assert len(os.fsencode(path)) == 107
    srv = AgentServer("127.0.0.1:0", path, control, sink)
    assert srv.heartbeat_socket is None
    assert worker_envs(_ONE_NODE_ROUND, "a", job_id="j", restart_count=0, max_restarts=0,
                       agent_socket=path, checkpoint_dir=None, hang_timeout_s=60,
                       heartbeat_socket="")[0].get("ELASTIC_AGENT_HEARTBEAT_SOCKET") is None


def test_the_workers_are_told_the_heartbeat_socket(server):
    env = worker_envs(_ONE_NODE_ROUND, "a", job_id="j", restart_count=0, max_restarts=0,
                      agent_socket=server.worker_socket, checkpoint_dir=None, hang_timeout_s=60,
                      heartbeat_socket=server.heartbeat_socket)[0]
    assert env["ELASTIC_AGENT_HEARTBEAT_SOCKET"] == server.heartbeat_socket


@contextlib.contextmanager
def worker_heartbeat(server, interval_s: float):
    """elastic.worker.runtime's heartbeat thread, as elastic.init() starts it from the
    environment (its gRPC socket a dead path), beating every ``interval_s``; closed
    (its last datagram says it exits) when the block ends."""
    pytest.importorskip("torch")
    from elastic.worker import runtime

    beat = runtime.Heartbeat(WorkerChannelClient("/nonexistent/agent.sock",
                                                 heartbeat_socket=server.heartbeat_socket),
                             interval_s)
    try:
        yield beat
    finally:
        beat.close()


def wait_for_sent(sink, predicate, timeout_s: float = 10.0) -> None:
    """Until ``predicate(sink.requests)`` holds, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate(sink.requests) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_the_workers_heartbeat_thread_sends_datagrams(server, sink):
    with worker_heartbeat(server, 0.05):
        wait_for_sent(sink, lambda sent: len(sent) >= 3)
    assert len(sink.requests) >= 3 and sink.requests[-1].exiting


def test_a_memory_snapshot_is_told_to_the_agent_at_once_with_its_count(server, sink):
    # The agent's replicator wakes on the count (agent.memory_replication), so it must
    # not wait for the next beat: 60 s away here.
    with worker_heartbeat(server, 60) as beat:
        wait_for_sent(sink, bool)  # the beat sent when the thread starts
        assert [r.snapshots for r in sink.requests] == [0]
        beat.report_snapshot()
        beat.report_snapshot()
        wait_for_sent(sink, lambda sent: sent[-1].snapshots >= 2)
    assert sink.requests[-2].snapshots == 2 and not sink.requests[-2].exiting


def test_a_step_reported_at_once_does_not_wait_for_the_next_beat(server, sink):
    # elastic.step's first number after optimizer steps were counted: the agent must
    # hear the script's numbering at once, not a beat (60 s here) later.
    with worker_heartbeat(server, 60) as beat:
        beat.report(0)  # the optimizer hook's first count: sent at once, as a first step
        wait_for_sent(sink, lambda sent: any(r.step == 0 for r in sent))
        beat.report(160, at_once=True)
        wait_for_sent(sink, lambda sent: any(r.step == 160 for r in sent))
        assert any(r.step == 160 for r in sink.requests), [r.step for r in sink.requests]


def test_a_peer_s_stacks_come_back_summarised(server, control):
    [stack] = peers.collect_stacks(server.address, 7, timeout_s=5.0)
    assert control.calls == [("collect_stacks", "7")]
    assert stack == RankStack(2, "node-a", True, place="train.py:88 in next_batch", step=41,
                              progress_age_s=3.5)


def test_a_peer_s_stacks_are_bounded_and_one_that_does_not_answer_gives_none(server, control):
    control.stacks = [agent_pb2.RankStack(rank=-5, node_id="n" * 10_000, place="\x1b[2J" * 500,
                                          collective="c" * 1000, step=-9, progress_age_s=-7.0)]
    [stack] = peers.collect_stacks(server.address, 7, timeout_s=5.0)
    assert stack.rank == 0 and stack.step == -1 and stack.progress_age_s == -1.0
    assert len(stack.node_id) <= 128 and len(stack.place) <= 300 and "\x1b" not in stack.place
    assert len(stack.collective) <= 64
    assert peers.collect_stacks(f"127.0.0.1:{free_port('127.0.0.1')}", 7, timeout_s=0.3) == []


def test_optimizer_steps_are_progress_until_the_script_numbers_its_steps(server, sink, tmp_path):
    # A script that never calls elastic.step: its optimizer steps are numbered from 0
    # (the hook the worker bootstrap installs); once it calls elastic.step(10), its
    # own numbers are its progress and optimizer steps add nothing.
    pytest.importorskip("torch")
    script = tmp_path / "steps.py"
    script.write_text(
        "import time\n"
        "import torch\n"
        "from torch.optim.optimizer import register_optimizer_step_post_hook\n"
        "from elastic.worker import runtime\n"
        "register_optimizer_step_post_hook(lambda o, a, k: runtime.optimizer_stepped())\n"
        "model = torch.nn.Linear(2, 1)\n"
        "for p in model.parameters():\n"
        "    p.grad = torch.ones_like(p)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "opt.step()\n"
        "time.sleep(0.5)  # the first step goes at once, later ones with the next beat\n"
        "opt.step()\n"
        "runtime.step(10)\n"
        "for _ in range(30):\n"
        "    opt.step()\n"
        "runtime.shutdown()\n")
    env = {**os.environ, "ELASTIC_AGENT_SOCKET": "/nonexistent/agent.sock",
           "ELASTIC_AGENT_HEARTBEAT_SOCKET": server.heartbeat_socket, "ELASTIC_ROUND": "1",
           "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    steps = [r.step for r in sink.requests if r.step >= 0]  # -1: the first beat, before
    assert steps[0] == 0, "the first optimizer step is sent at once"
    assert set(steps) <= {0, 1, 10} and steps[-1] == 10 and sink.requests[-1].exiting
