"""Mutual TLS on the agent's gRPC endpoint, the read-only probe endpoint and the
control checks, against real in-process gRPC servers and certificates made by
trustme at test time."""

from __future__ import annotations

import logging
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent import config as agent_config
from agent import peers
from agent.grpc_server import Access, AgentServer, control_refusal, grpc_code_for
from agent.tls import (
    AgentTLS,
    agent_tls_from_options,
    etcd_bypass_warning,
    handshake_problem,
)
from elastic.errors import (
    AgentAuthError,
    ConfigError,
    NotAuthorisedError,
    RateLimitedError,
)
from elastic.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.timeout(30)


class Control:
    """An AgentControl that records what it was asked."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def status(self):
        return agent_pb2.AgentStatusResponse(job_id="job-1", node_id="node-a", state="RUNNING",
                                             round=3)

    def drain(self, reason):
        self.calls.append(("drain", reason))
        return True, "node node-a will leave the job"

    def request_restart(self, reason):
        self.calls.append(("request_restart", reason))
        return True, 3

    def store_health(self, asker_has_store, asker):
        self.calls.append(("store_health", asker_has_store))
        return True, 0.5, True


class Sink:
    def heartbeat(self, request):
        return False, False


def server_tls(certs) -> AgentTLS:
    return AgentTLS(cert=certs.agent.cert, key=certs.agent.key, ca=certs.ca)


def client_tls(certs, pair=None, ca=None, server_name=None) -> AgentTLS:
    pair = pair if pair is not None else certs.operator
    return AgentTLS(cert=pair.cert if pair else None, key=pair.key if pair else None,
                    ca=ca or certs.ca, server_name=server_name)


@pytest.fixture
def start_server(sock_dir):
    started: list[AgentServer] = []

    def start(tls=None, probe=True, control=None):
        server = AgentServer("127.0.0.1:0", os.path.join(sock_dir, f"w{len(started)}.sock"),
                             control or Control(), Sink(), max_workers=4, tls=tls,
                             probe_listen="127.0.0.1:0" if probe else None)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace_s=0.1)
    peers.close_channels()


# --- options ---------------------------------------------------------------------------------

def test_a_certificate_without_its_key_names_both_options(certs):
    with pytest.raises(ConfigError,
                       match="--tls-cert without --tls-key.*--tls-cert and --tls-key"):
        AgentTLS(cert=certs.agent.cert, ca=certs.ca)
    with pytest.raises(ConfigError, match="--tls-key without --tls-cert"):
        agent_tls_from_options(key=certs.agent.key, ca=certs.ca)


def test_an_unreadable_file_is_named_with_its_option(certs, tmp_path):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError,
                       match=f"cannot read the TLS CA bundle {missing} \\(--tls-ca\\)"):
        agent_tls_from_options(ca=missing)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match=f"certificate {garbage} \\(--tls-cert\\) is not a PEM"):
        agent_tls_from_options(cert=str(garbage), key=certs.agent.key, ca=certs.ca)


def test_elasticd_needs_certificate_key_and_ca_together(certs):
    with pytest.raises(ConfigError, match="missing --tls-ca"):
        agent_tls_from_options(cert=certs.agent.cert, key=certs.agent.key, serving=True)
    assert agent_tls_from_options(serving=True) is None
    with pytest.raises(ConfigError, match="--tls-server-name needs --tls-ca"):
        agent_tls_from_options(server_name="elasticd.test")


def test_config_reads_the_tls_options_from_flags_and_environment(certs, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--standalone", "--job-id", "j", "--nnodes", "1", str(script)]
    env = {"ELASTIC_TLS_CERT": certs.agent.cert, "ELASTIC_TLS_KEY": certs.agent.key}
    config = agent_config.load(["--tls-ca", certs.ca, "--probe-listen", "127.0.0.1:0", *base],
                               environ=env)
    assert config.tls == AgentTLS(cert=certs.agent.cert, key=certs.agent.key, ca=certs.ca)
    assert config.probe_listen == "127.0.0.1:0"
    with pytest.raises(ConfigError, match="--tls-cert without --tls-key"):
        agent_config.load(["--tls-cert", certs.agent.cert, "--tls-ca", certs.ca, *base],
                          environ={})
    with pytest.raises(ConfigError, match=r"--tls-key /nonexistent/key.pem: no such file"):
        agent_config.load(["--tls-key", "/nonexistent/key.pem", *base], environ={})


def test_without_listen_the_server_binds_the_advertised_address(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--etcd", "http://10.1.2.3:2379", "--job-id", "j", "--nnodes", "1",
            "--advertise-addr", "10.1.2.3", str(script)]
    assert agent_config.load(base, environ={}).listen == "10.1.2.3:0"
    assert agent_config.load(["--listen", "0.0.0.0:29401", *base],
                             environ={}).listen == "0.0.0.0:29401"
    assert agent_config.load(base[:-2] + ["fe80::1", str(script)],
                             environ={}).listen == "[fe80::1]:0"
    # :PORT: the advertised address with a fixed port (what deploy/ ships).
    fixed = agent_config.load(["--listen", ":29401", "--probe-listen", ":29403", *base],
                              environ={})
    assert (fixed.listen, fixed.probe_listen) == ("10.1.2.3:29401", "10.1.2.3:29403")


# --- pure decisions --------------------------------------------------------------------------

def test_control_refusal_by_endpoint_and_caller():
    assert control_refusal(Access.OPEN, None, "Drain") is None
    assert control_refusal(Access.MUTUAL_TLS, "operator", "Drain") is None
    refused = control_refusal(Access.MUTUAL_TLS, None, "Drain")
    assert "Drain needs a client certificate signed by the agent's --tls-ca" in refused
    probe = control_refusal(Access.READ_ONLY, "operator", "RequestRestart")
    assert "read-only probe endpoint" in probe and "\n" not in probe


def test_control_refusal_with_an_allow_list_of_common_names():
    allowed = ("ops-alice", "ops-bob")
    assert control_refusal(Access.MUTUAL_TLS, "alice", "Drain", common_name="ops-alice",
                           allowed_cns=allowed) is None
    refused = control_refusal(Access.MUTUAL_TLS, "mallory", "RequestRestart",
                              common_name="ops-mallory", allowed_cns=allowed)
    assert refused == ("RequestRestart is refused to the certificate CN 'ops-mallory': only "
                       "--tls-allowed-cn ops-alice,ops-bob may drain or restart")
    nameless = control_refusal(Access.MUTUAL_TLS, "x@example.test", "Drain",
                               allowed_cns=allowed)
    assert "a certificate without a common name (x@example.test)" in nameless
    # Without a list, any certificate of the CA.
    assert control_refusal(Access.MUTUAL_TLS, "m", "Drain", common_name="ops-mallory") is None


def test_allowed_common_names_are_an_option_that_needs_mutual_tls(certs, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--etcd", "http://127.0.0.1:2379", "--job-id", "j", "--nnodes", "1", str(script)]
    tls = ["--tls-cert", certs.agent.cert, "--tls-key", certs.agent.key, "--tls-ca", certs.ca]
    config = agent_config.load(["--tls-allowed-cn", "ops-alice, ops-bob", *tls, *base],
                               environ={})
    assert config.tls.allowed_cns == ("ops-alice", "ops-bob")
    from_env = agent_config.load([*tls, *base], environ={"ELASTIC_TLS_ALLOWED_CN": "ops-carol"})
    assert from_env.tls.allowed_cns == ("ops-carol",)
    with pytest.raises(ConfigError, match="--tls-allowed-cn needs mutual TLS"):
        agent_config.load(["--tls-allowed-cn", "ops-alice", *base], environ={})


def test_mutual_tls_over_an_open_etcd_is_warned_about():
    tls = AgentTLS(cert="/a.pem", key="/a-key.pem", ca="/ca.pem")
    warning = etcd_bypass_warning(tls, "http://10.0.0.1:2379,http://10.0.0.2:2379",
                                  etcd_tls_client=False, etcd_user=False)
    assert warning.startswith("Control on --listen takes mutual TLS, but etcd at "
                              "http://10.0.0.1:2379, http://10.0.0.2:2379 is plain text "
                              "without authentication: anyone who reaches it can drain")
    assert "--etcd-user" in warning and "--etcd-cert" in warning
    assert "without authentication" in etcd_bypass_warning(
        tls, "https://e:2379", etcd_tls_client=False, etcd_user=False)
    for quiet in (dict(tls=None, etcd="http://e:2379", etcd_tls_client=False, etcd_user=False),
                  dict(tls=tls, etcd="http://e:2379", etcd_tls_client=False, etcd_user=True),
                  dict(tls=tls, etcd="https://e:2379", etcd_tls_client=True, etcd_user=False),
                  dict(tls=tls, etcd="unix:///run/x/etcd.sock", etcd_tls_client=False,
                       etcd_user=False),
                  dict(tls=tls, etcd=None, etcd_tls_client=False, etcd_user=False)):
        tls_, etcd = quiet.pop("tls"), quiet.pop("etcd")
        assert etcd_bypass_warning(tls_, etcd, **quiet) is None


def test_handshake_problems_in_an_operators_words():
    tls = AgentTLS(ca="/ca.pem")
    verify = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls "
              "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
              "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED")
    assert "unknown CA" in handshake_problem(verify, tls)
    closed = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:1.2.3.4:5: "
              "Socket closed")
    assert "presented none" in handshake_problem(closed, tls)
    assert "TLS" in handshake_problem(closed, None)
    refused = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
               "Failed to connect to remote host: Connection refused")
    assert handshake_problem(refused, tls) is None
    assert handshake_problem("Socket closed", tls) is None  # a broken stream, not a handshake


def test_refusals_map_to_their_grpc_codes():
    assert grpc_code_for(NotAuthorisedError("x")) == grpc.StatusCode.PERMISSION_DENIED
    assert grpc_code_for(RateLimitedError("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- mutual TLS, end to end in one process --------------------------------------------------

def test_a_client_with_a_certificate_of_the_ca_may_use_control(certs, start_server):
    control = Control()
    server = start_server(server_tls(certs), control=control)
    tls = client_tls(certs)

    assert peers.query_status(server.address, timeout_s=5, tls=tls).node_id == "node-a"
    assert peers.request_drain(server.address, "maintenance", tls=tls) == (
        True, "node node-a will leave the job")
    assert peers.request_restart(server.address, "operator asked", tls=tls) == (True, 3)
    assert peers.store_health(server.address, asker_has_store=True, tls=tls).reachable
    assert control.calls == [("drain", "maintenance"), ("request_restart", "operator asked"),
                             ("store_health", True)]


def test_only_allowed_common_names_may_drain_or_restart(certs, start_server, caplog):
    control = Control()
    server = start_server(AgentTLS(cert=certs.agent.cert, key=certs.agent.key, ca=certs.ca,
                                   allowed_cns=("ops-alice",)), control=control)
    mallory = client_tls(certs, pair=certs.mallory)
    for ask in (peers.request_drain, peers.request_restart):
        with pytest.raises(NotAuthorisedError, match="refused to the certificate CN "
                                                     "'ops-mallory': only --tls-allowed-cn "
                                                     "ops-alice may drain or restart"):
            ask(server.address, "x", tls=mallory)
    # Reading is not control: any certificate of the CA.
    assert peers.query_status(server.address, timeout_s=5, tls=mallory).node_id == "node-a"
    alice = client_tls(certs, pair=certs.alice)
    assert peers.request_drain(server.address, "maintenance", tls=alice)[0]
    assert control.calls == [("drain", "maintenance")]


def test_a_client_without_a_certificate_is_refused_at_the_handshake(certs, start_server):
    control = Control()
    server = start_server(server_tls(certs), control=control)
    with pytest.raises(AgentAuthError, match="takes only clients with a certificate signed by "
                                             "its --tls-ca.*presented none"):
        peers.request_drain(server.address, "x", tls=client_tls(certs, pair=False))
    # Plain text to the TLS port: refused too, with a hint.
    with pytest.raises(AgentAuthError, match="if the agents run with TLS"):
        peers.request_drain(server.address, "x")
    assert control.calls == []


def test_a_certificate_of_another_ca_is_refused_both_ways(certs, start_server):
    server = start_server(server_tls(certs))
    with pytest.raises(AgentAuthError, match=r"another CA's \(unknown CA\)"):
        peers.query_status(server.address, timeout_s=5,
                           tls=client_tls(certs, pair=certs.stranger))
    with pytest.raises(AgentAuthError, match=r"not signed by a CA in --tls-ca \(unknown CA\)"):
        peers.query_status(server.address, timeout_s=5,
                           tls=client_tls(certs, pair=certs.stranger, ca=certs.other_ca))


def test_a_certificate_without_the_address_needs_the_server_name(certs, start_server):
    server = start_server(AgentTLS(cert=certs.named.cert, key=certs.named.key, ca=certs.ca))
    with pytest.raises(AgentAuthError, match="does not name the address"):
        peers.query_status(server.address, timeout_s=5, tls=client_tls(certs))
    named = client_tls(certs, server_name="elasticd.test")
    assert peers.query_status(server.address, timeout_s=5, tls=named).node_id == "node-a"


def test_the_probe_endpoint_reads_without_a_certificate_and_refuses_control(certs, start_server):
    control = Control()
    server = start_server(server_tls(certs), control=control)
    probe = server.probe_address
    assert probe is not None and probe != server.address

    channel = grpc.insecure_channel(probe)
    try:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        server.set_serving(True)
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert check(health_pb2.HealthCheckRequest(service="elastic.v1.Liveness"),
                     timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        stub = agent_pb2_grpc.AgentStub(channel)
        assert stub.Status(agent_pb2.AgentStatusRequest(), timeout=5).round == 3
        with pytest.raises(grpc.RpcError) as refused:
            stub.Drain(agent_pb2.AgentDrainRequest(reason="x"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Drain is refused on the agent's read-only probe endpoint" in \
            refused.value.details()
        assert "\n" not in refused.value.details()
        # "I reach etcd" from a plain-text caller must not fence this agent.
        stub.StoreHealth(agent_pb2.AgentStoreHealthRequest(asker_has_store=True), timeout=5)
    finally:
        channel.close()
    with pytest.raises(NotAuthorisedError, match="refused RequestRestart: RequestRestart is "
                                                 "refused on the agent's read-only probe"):
        peers.request_restart(probe, "x")
    assert control.calls == [("store_health", False)]


def test_plain_text_warns_once_that_control_is_unauthenticated(start_server, caplog):
    with caplog.at_level(logging.WARNING, logger="agent.grpc_server"):
        server = start_server(None, probe=False)
    warnings = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warnings) == 1
    assert server.address in warnings[0] and "--tls-cert" in warnings[0]


def test_mutual_tls_does_not_warn(certs, start_server, caplog):
    with caplog.at_level(logging.WARNING, logger="agent.grpc_server"):
        start_server(server_tls(certs))
    assert not [r for r in caplog.records if "unauthenticated" in r.getMessage()]


def test_peers_watch_each_other_over_mutual_tls(certs, start_server):
    import queue

    server = start_server(server_tls(certs))
    seen: queue.Queue = queue.Queue()
    mesh = peers.GrpcPeerMesh(AgentTLS(cert=certs.agent.cert, key=certs.agent.key, ca=certs.ca))
    watcher = mesh.watch(server.address, seen.put)
    try:
        assert seen.get(timeout=5) == "NOT_SERVING"
        server.set_serving(True)
        assert seen.get(timeout=5) == "SERVING"
        assert mesh.answers(server.address)
        assert mesh.fence((server.address,), "node-b") is False  # its workers run
    finally:
        watcher.stop()
    stranger = peers.GrpcPeerMesh(client_tls(certs, pair=certs.stranger))
    assert not stranger.answers(server.address)


def test_elasticctl_names_a_certificate_without_its_key(certs, capsys):
    from agent import ctl

    code = ctl.main(["status", "--etcd", "http://127.0.0.1:1", "--job-id", "j",
                     "--tls-ca", certs.ca, "--tls-cert", certs.operator.cert])
    assert code == 2
    assert "--tls-cert without --tls-key" in capsys.readouterr().err
