"""Operating elasticd: systemd's notify protocol, SIGTERM drains, JSON logs, the
liveness probe, root causes of worker failures, and a unit started after its
job ended. Real agents, real worker processes, a real etcd."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.grpc_server import LIVENESS_SERVICE
from elastic.net import free_port
from tests.integration.procs import REPO, AgentProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A worker that trains forever (until stopped) and records what it was given.
SLEEPER = """
import json, os, sys, time
with open(sys.argv[1] + f"/env-{os.environ['RANK']}.json", "w") as f:
    json.dump({k: os.environ.get(k) for k in ("NOTIFY_SOCKET", "WATCHDOG_USEC",
               "TORCHELASTIC_ERROR_FILE")}, f)
while True:
    time.sleep(0.1)
"""

# Rank 1 raises in the first round; the second round trains until stopped.
RAISES_ONCE = """
import os, sys, time
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    raise ValueError("bad batch at step 3")
while True:
    time.sleep(0.1)
"""


# The scripts here never import torch: a warm worker would make each of them wait for
# the `import torch` it preloads (seconds of both cores) before running, and then be
# replaced by another that imports it again. Warm workers: tests/integration/test_supervisor.py.
COLD = ("--no-prestart",)


def write_script(tmp_path, source: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def messages(sock: socket.socket, until, timeout_s: float = 30.0) -> list[str]:
    """Datagrams received on ``sock`` until ``until(received)`` holds."""
    received: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not until(received):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            received.append(sock.recv(4096).decode())
        except socket.timeout:
            raise AssertionError(f"systemd saw only {received}") from None
    return received


def elasticctl(endpoint: str, job_id: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.ctl", *args, "--etcd", endpoint,
                           "--job-id", job_id], cwd=REPO, capture_output=True, text=True,
                          timeout=30)


def test_systemd_sees_ready_then_watchdog_pings_then_stopping_and_sigterm_exits_0(
        etcd_endpoint, job_id, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    port = free_port("127.0.0.1")
    agent = AgentProcess(etcd_endpoint, job_id, "a", "1", [str(tmp_path)], nproc=2,
                         script=write_script(tmp_path, SLEEPER),
                         extra=(*COLD, "--listen", f"127.0.0.1:{port}", "--log-format", "json"),
                         env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"),
                              "WATCHDOG_USEC": "1000000"})
    try:
        ready = messages(notify, lambda got: any("READY=1" in m for m in got))
        pings = messages(notify, lambda got: sum(m == "WATCHDOG=1" for m in got) >= 3)
        wait_until(lambda: all((tmp_path / f"env-{r}.json").exists() for r in (0, 1)), 30,
                   "both workers to write their environments", poll_s=0.05)
        alive = health(port, LIVENESS_SERVICE)

        agent.proc.send_signal(signal.SIGTERM)
        stopping = messages(notify, lambda got: any("STOPPING=1" in m for m in got))
        code = agent.wait_exit(30)
    finally:
        agent.stop()
        notify.close()

    assert "STATUS=" in next(m for m in ready if "READY=1" in m)
    assert sum(m == "WATCHDOG=1" for m in pings) >= 3
    assert alive == health_pb2.HealthCheckResponse.SERVING
    assert "received SIGTERM" in next(m for m in stopping if "STOPPING=1" in m)
    assert code == 0, agent.text
    # The workers never saw systemd's variables, and each had an error file of its own.
    seen = [json.loads((tmp_path / f"env-{rank}.json").read_text()) for rank in (0, 1)]
    assert all(s["NOTIFY_SOCKET"] is None and s["WATCHDOG_USEC"] is None for s in seen)
    assert len({s["TORCHELASTIC_ERROR_FILE"] for s in seen}) == 2
    # --log-format json: every line the agent logged is one object with job, node and round.
    lines = [json.loads(line) for line in agent.output if line.strip()]
    assert all(line["job"] == job_id and line["node"] == "a" for line in lines)
    drained = [line for line in lines if "DRAINING" in line["message"]]
    assert drained and drained[0]["round"] >= 1 and drained[0]["level"] == "INFO"


def test_a_worker_that_raises_is_named_with_its_exception_and_log(etcd_endpoint, job_id,
                                                                   tmp_path):
    state = tmp_path / "state"
    agent = AgentProcess(etcd_endpoint, job_id, "a", "1", [], nproc=2,
                         script=write_script(tmp_path, RAISES_ONCE),
                         extra=(*COLD, "--state-dir", str(state), "--max-restarts", "3"))
    try:
        agent.wait_output("requesting a restart")
        agent.wait_output("RUNNING", timeout_s=30)
        status = elasticctl(etcd_endpoint, job_id, "status", "--json")
        events = elasticctl(etcd_endpoint, job_id, "events", "--json")
    finally:
        agent.stop()

    log_path = str(state / job_id / "a" / "logs" / "round-1" / "rank-1.log")
    cause = "ValueError: bad batch at step 3"
    assert os.path.exists(log_path) and cause in open(log_path).read()
    node = next(n for n in json.loads(status.stdout)["nodes"] if n["node_id"] == "a")
    failure = node["agent"]["last_failure"]
    assert cause in failure and log_path in failure, status.stdout
    assert any(cause in e["message"] and log_path in e["message"]
               for e in json.loads(events.stdout)), events.stdout
    warning = next(line for line in agent.output if "requesting a restart" in line)
    assert cause in warning and log_path in warning


def test_an_agent_started_after_its_job_succeeded_exits_0_saying_so(etcd_endpoint, job_id,
                                                                     tmp_path):
    script = write_script(tmp_path, "print('trained')\n")
    first = AgentProcess(etcd_endpoint, job_id, "a", "1", [], nproc=1, script=script,
                         extra=COLD)
    assert first.wait_exit(60) == 0, first.text

    again = AgentProcess(etcd_endpoint, job_id, "a", "1", [], nproc=1, script=script,
                         extra=COLD)
    code = again.wait_exit(30)

    assert code == 0, again.text
    assert f"job {job_id} has already succeeded" in again.text
    assert "Traceback" not in again.text
