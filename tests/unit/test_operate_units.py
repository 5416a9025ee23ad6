"""The pieces operators rely on, one by one: systemd notifications, error
files, JSON log lines, the liveness health service, the internal-error exit."""

from __future__ import annotations

import json
import logging
import os
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent import daemon
from agent.grpc_server import LIVENESS_SERVICE, AgentServer
from agent.sdnotify import SystemdNotifier
from elastic import errorfile
from elastic.errors import EXIT_INTERNAL
from elastic.joblog import JobLogger, JsonFormatter
from tests.fakes.clock import FakeClock


@pytest.fixture
def systemd(tmp_path):
    """A notify socket this test owns, as systemd would pass it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    yield sock, str(tmp_path / "notify")
    sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            return out


def test_ready_is_sent_once_then_only_status_changes(systemd):
    sock, path = systemd
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})

    notifier.ready("JOINING in round 0")
    notifier.ready("JOINING in round 0")
    notifier.ready("RUNNING in round 1")
    notifier.stopping("leaving the job: received SIGTERM")

    assert received(sock) == ["READY=1\nSTATUS=JOINING in round 0", "STATUS=RUNNING in round 1",
                              "STOPPING=1\nSTATUS=leaving the job: received SIGTERM"]


def test_watchdog_pings_every_half_interval_and_takes_the_variables_from_the_environment(
        systemd):
    sock, path = systemd
    clock = FakeClock()
    environ = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "OTHER": "kept"}
    notifier = SystemdNotifier(environ, clock=clock)

    for _ in range(9):  # 4 s in steps of 0.5 s: a ping at 0, 2 and 4 s
        notifier.watchdog()
        clock.advance(0.5)

    assert received(sock) == ["WATCHDOG=1"] * 3
    assert environ == {"OTHER": "kept"}  # the workers inherit none of systemd's variables


def test_a_watchdog_meant_for_another_process_is_not_ours(systemd):
    sock, path = systemd
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000",
                                "WATCHDOG_PID": "1"})
    notifier.watchdog()
    assert notifier.watchdog_interval_s is None and received(sock) == []


def test_without_systemd_nothing_is_sent_and_nothing_fails():
    notifier = SystemdNotifier({})
    notifier.ready("x")
    notifier.watchdog()
    assert not notifier.enabled


def test_a_vanished_notify_socket_is_logged_once_and_never_raises(tmp_path, caplog):
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    with caplog.at_level(logging.WARNING):
        notifier.ready("a")
        notifier.status("b")
    assert len([r for r in caplog.records if "Could not notify systemd" in r.message]) == 1


def test_the_error_file_names_the_exception_and_keeps_the_callstack(tmp_path):
    path = str(tmp_path / "rank-3.error.json")
    try:
        raise ValueError("bad batch at step 7\nsecond line")
    except ValueError as exc:
        assert errorfile.write(path, exc)
        assert not errorfile.write(path, RuntimeError("later")), "the first cause is kept"

    cause = errorfile.read_root_cause(path)

    assert cause.message == "ValueError: bad batch at step 7 second line"
    assert "Traceback" in cause.traceback and "bad batch" in cause.traceback


def test_torch_record_files_and_odd_files_are_read_or_ignored_safely(tmp_path):
    torch_style = tmp_path / "a.json"
    torch_style.write_text(json.dumps({"message": {"message": "RuntimeError: NCCL error",
                                                   "extraInfo": {"py_callstack": "tb",
                                                                 "timestamp": "1"}}}))
    plain = tmp_path / "b.json"
    plain.write_text("Segmentation fault \x1b[31m(core dumped)" + "x" * 1000)
    empty = tmp_path / "c.json"
    empty.write_text("")

    assert errorfile.read_root_cause(str(torch_style)) == errorfile.RootCause(
        "RuntimeError: NCCL error", "tb")
    odd = errorfile.read_root_cause(str(plain)).message
    assert "\x1b" not in odd and len(odd) == errorfile.MAX_CAUSE_CHARS
    assert errorfile.read_root_cause(str(empty)) is None
    assert errorfile.read_root_cause(str(tmp_path / "missing.json")) is None


def test_json_log_lines_carry_job_node_and_round_without_the_text_prefix():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(handler.format(record))
    handler.setFormatter(JsonFormatter("job1", "node-a", lambda: 7))
    logger = logging.getLogger("test.jsonlog")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        JobLogger(logger, "job1", "node-a", lambda: 4).warning("workers %s", "stopped")
        logger.info("plain line")
        logger.info("job job1 node node-a round 3: by hand")
        try:
            raise OSError("disk")
        except OSError:
            logger.exception("save failed")
    finally:
        logger.removeHandler(handler)

    adapted, plain, by_hand, failed = (json.loads(line) for line in records)
    assert (adapted["job"], adapted["node"], adapted["round"], adapted["level"],
            adapted["message"]) == ("job1", "node-a", 4, "WARNING", "workers stopped")
    assert (plain["round"], plain["message"]) == (7, "plain line")
    assert (by_hand["round"], by_hand["message"]) == (3, "by hand")
    assert "OSError: disk" in failed["exc"] and failed["time"].endswith("Z")


def test_liveness_answers_from_the_loop_while_readiness_is_set_by_the_agent(sock_dir):
    alive = [True]
    server = AgentServer("127.0.0.1:0", os.path.join(sock_dir, "agent.sock"), control=None,
                         heartbeats=None, liveness=lambda: alive[0])
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def check(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service),
                                  timeout=5).status

            assert check(LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING
            assert check("") == health_pb2.HealthCheckResponse.NOT_SERVING  # joining: not ready
            alive[0] = False
            assert check(LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(grace_s=0)


def test_an_unexpected_exception_exits_with_the_internal_error_code(monkeypatch, caplog):
    def broken(_argv):
        raise KeyError("a bug")

    monkeypatch.setattr(daemon.agent_config, "load", broken)
    with caplog.at_level(logging.ERROR):
        code = daemon.main([])
    assert code == EXIT_INTERNAL
    assert any(r.exc_info and "internal error" in r.message for r in caplog.records)
