"""The agents' gRPC security end to end: real elasticd processes with mutual TLS
(certificates made by trustme for this run), a real etcd, real worker kills.

Workers are ``scripts/progress_worker.py`` (no torch): they append a line per
step to a file per process and keep working while the hold file exists.
"""

from __future__ import annotations

import glob
import json
import os
import signal
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent import ctl, peers
from agent.tls import AgentTLS
from elastic.errors import AgentAuthError, RateLimitedError
from elastic.hostport import HostPort
from elastic.keyspace import JobKeys
from elastic.net import free_port
from elastic.rendezvous.api import NodeInfo, Outcome, Round
from elastic.rendezvous.round_record import read_round
from elastic.v1 import agent_pb2, agent_pb2_grpc
from tests.integration.procs import REPO, AgentProcess
from tests.tls_certs import make_certs
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "progress_worker.py")


@pytest.fixture
def agents():
    started: list[AgentProcess] = []

    def start(*args, **kw) -> AgentProcess:
        agent = AgentProcess(*args, **kw)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.stop()
    peers.close_channels()


def progress(directory) -> list[dict]:
    records = []
    for path in glob.glob(os.path.join(directory, "*.jsonl")):
        with open(path) as f:
            records.extend(json.loads(line) for line in f if line.strip().endswith("}"))
    return records


def current_round(store, job_id) -> Round | None:
    return read_round(store, JobKeys(job_id))


def agent_addr(store, job_id, node_id) -> str:
    kv = store.get(JobKeys(job_id).node(node_id))
    return NodeInfo.from_json(kv.key, kv.value).addr


def output_of(*procs: AgentProcess) -> Callable[[], str]:
    """What the agents said last, for a wait that timed out."""
    return lambda: "\n".join(f"--- {p.node_id}:\n{''.join(p.output[-25:])}" for p in procs)


def round_with(store, job_id, members, after: int = 0):
    r = current_round(store, job_id)
    return r if r and r.number > after and sorted(r.node_ids) == sorted(members) else None


def steps_in(directory, node: str, round_: int) -> int:
    return max((r["step"] for r in progress(directory)
                if r["node"] == node and r["round"] == round_), default=-1)


def test_mutual_tls_agents_train_recover_and_take_control_only_from_the_ca(
        agents, tmp_path, etcd_endpoint, etcd_store, job_id, capsys):
    certs = make_certs(str(tmp_path))
    hold = tmp_path / "hold"
    hold.write_text("")
    work = tmp_path / "progress"
    work.mkdir()
    probes = {node: free_port() for node in "ab"}
    procs = {node: agents(
        etcd_endpoint, job_id, node, "1:2",
        ["--progress-dir", str(work), "--work-s", "1", "--step-s", "0.05",
         "--hold-file", str(hold)],
        nproc=1, hang_timeout=0, script=SCRIPT,
        extra=("--no-prestart", "--tls-ca", certs.ca, "--probe-listen",
               f"127.0.0.1:{probes[node]}", "--operator-restart-interval", "60"),
        # The certificate and key from the environment, as a unit's EnvironmentFile would.
        env={"ELASTIC_TLS_CERT": certs.agent.cert, "ELASTIC_TLS_KEY": certs.agent.key})
        for node in "ab"}
    a, b = procs["a"], procs["b"]
    first = wait_until(lambda: (
        (r := round_with(etcd_store, job_id, ["a", "b"])) and steps_in(work, "a", r.number) >= 0
        and steps_in(work, "b", r.number) >= 0 and r), 40, "a round of a and b, both training",
        poll_s=0.1, context=output_of(a, b))
    addr = {node: agent_addr(etcd_store, job_id, node) for node in "ab"}
    operator = AgentTLS(cert=certs.operator.cert, key=certs.operator.key, ca=certs.ca)

    # Probes and status need no certificate, on the plain-text read-only endpoint.
    channel = grpc.insecure_channel(f"127.0.0.1:{probes['b']}")
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="elastic.v1.Liveness"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = agent_pb2_grpc.AgentStub(channel)
        assert stub.Status(agent_pb2.AgentStatusRequest(), timeout=5).node_id == "b"
        # Control without a certificate: refused, one line.
        with pytest.raises(grpc.RpcError) as refused:
            stub.Drain(agent_pb2.AgentDrainRequest(reason="not mine"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "refused" in refused.value.details() and "\n" not in refused.value.details()
    finally:
        channel.close()
    # The TLS endpoint takes no client without a certificate of the job's CA.
    with pytest.raises(AgentAuthError, match="presented none"):
        peers.request_drain(addr["b"], "not mine",
                            tls=AgentTLS(ca=certs.ca))
    with pytest.raises(AgentAuthError, match="unknown CA"):
        peers.request_drain(addr["b"], "not mine", tls=AgentTLS(
            cert=certs.stranger.cert, key=certs.stranger.key, ca=certs.ca))

    # elasticctl: another CA's certificate is named as the problem; the job's works.
    common = ["--etcd", etcd_endpoint, "--job-id", job_id, "--tls-ca", certs.ca]
    assert ctl.main(["status", *common, "--tls-cert", certs.stranger.cert,
                     "--tls-key", certs.stranger.key, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert any("node b: agent at" in p and "(unknown CA)" in p for p in shown["problems"]), \
        shown["problems"]
    assert ctl.main(["status", *common, "--tls-cert", certs.operator.cert,
                     "--tls-key", certs.operator.key, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert not shown["problems"]
    assert {n["node_id"]: n["agent"]["source"] for n in shown["nodes"]} == {
        "a": "agent", "b": "agent"}

    # The refused requests changed nothing: b trains on in the same round.
    before = steps_in(work, "b", first.number)
    wait_until(lambda: steps_in(work, "b", first.number) >= before + 5, 10, "b stepping on",
               poll_s=0.1, context=output_of(a, b))
    assert current_round(etcd_store, job_id).number == first.number
    assert b.proc.poll() is None

    # A worker killed: the agents (talking over mutual TLS) recover in a new round.
    victim = next(r["pid"] for r in progress(work) if r["node"] == "b"
                  and r["round"] == first.number)
    os.kill(victim, signal.SIGKILL)
    second = wait_until(lambda: (
        (r := round_with(etcd_store, job_id, ["a", "b"], first.number))
        and steps_in(work, "b", r.number) >= 0 and r), 30, "a new round training after the kill",
        poll_s=0.1, context=output_of(a, b))

    # An operator restart with the job's certificate is taken, a second one
    # within the interval is refused, whichever agent it goes to.
    assert peers.request_restart(addr["a"], "operator asked", tls=operator) == (
        True, second.number)
    with pytest.raises(RateLimitedError, match="next is allowed from"):
        peers.request_restart(addr["b"], "again", tls=operator)
    third = wait_until(lambda: round_with(etcd_store, job_id, ["a", "b"], second.number), 30,
                       "the operator's restart", poll_s=0.1, context=output_of(a, b))
    assert "restart requested by a: operator asked" in third.reason

    # Drain with the job's certificate works: b leaves with exit 0, a goes on.
    accepted, _ = peers.request_drain(addr["b"], "maintenance", tls=operator)
    assert accepted
    assert b.wait_exit(30) == 0, b.text
    wait_until(lambda: round_with(etcd_store, job_id, ["a"], third.number), 30, "a alone",
               poll_s=0.1, context=output_of(a))
    hold.unlink()
    assert a.wait_exit(40) == 0, a.text
    assert current_round(etcd_store, job_id).outcome is Outcome.SUCCEEDED
    assert "killed by signal 9" in a.text + b.text
    assert "unauthenticated" not in a.text + b.text


def test_without_tls_the_agent_binds_the_advertised_address_and_warns_once(
        agents, tmp_path, etcd_endpoint, etcd_store, job_id):
    work = tmp_path / "progress"
    work.mkdir()
    # No --listen: AgentProcess's default is dropped for this one.
    agent = agents(etcd_endpoint, job_id, "a", "1",
                   ["--progress-dir", str(work), "--work-s", "30"], nproc=1, hang_timeout=0,
                   script=SCRIPT, extra=("--no-prestart", "--advertise-addr", "127.0.0.2"),
                   listen=None)
    agent.wait_output("is unauthenticated", 30)
    agent.wait_output(": registered (", 30)  # the warning comes first: its address in etcd next
    addr = agent_addr(etcd_store, job_id, "a")
    where = HostPort.parse(addr)
    assert where.host == "127.0.0.2"
    assert peers.query_status(addr, timeout_s=5).node_id == "a"
    # Not bound on every interface: another loopback address finds nothing there.
    with pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(grpc.insecure_channel(str(HostPort("127.0.0.1", where.port)))).Check(
            health_pb2.HealthCheckRequest(), timeout=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait_exit(30) == 0, agent.text
    warnings = [line for line in agent.output if "is unauthenticated" in line]
    assert len(warnings) == 1 and f"on {addr} is unauthenticated" in warnings[0], warnings
