"""etcd security without an etcd: the settings, their checks at start, the
options of elasticd, the token's renewal and what refusals say.
(tests/integration/test_etcd_security.py runs the same against a real etcd.)"""

from __future__ import annotations

import logging

import grpc
import pytest

from agent import config
from elastic.errors import ConfigError, StoreAuthError, StoreError, StoreUnavailableError
from elastic.hostport import HostPort
from elastic.store import EtcdSecurity, open_store, register_backend, security_from_options
from elastic.store.etcd import EtcdStore
from elastic.store.etcd_auth import (
    TokenAuth,
    explain_connect_failure,
    is_auth_cancel,
    is_token_error,
    permission_error,
    request_key,
)
from elastic.store.etcd_convert import put_request
from elastic.store.etcd_endpoints import parse_endpoint_urls
from elastic.store.etcdpb import rpc_pb2

PASSWORD = "s3cret-pa55word"
PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


@pytest.fixture
def pem(tmp_path):
    def write(name: str, data: bytes = PEM) -> str:
        path = tmp_path / name
        path.write_bytes(data)
        return str(path)

    return write


# ------------------------------------------------------------------ the settings


def test_a_certificate_needs_its_key_and_the_message_names_both_flags():
    with pytest.raises(ConfigError, match="--etcd-cert without --etcd-key.*--etcd-cert and "
                                          "--etcd-key"):
        EtcdSecurity(cert="/c.pem")
    with pytest.raises(ConfigError, match="--etcd-key without --etcd-cert"):
        EtcdSecurity(key="/k.pem")


def test_a_user_needs_a_password_and_a_password_a_user():
    with pytest.raises(ConfigError, match="ELASTIC_ETCD_PASSWORD or pass --etcd-password-file"):
        EtcdSecurity(user="trainer")
    with pytest.raises(ConfigError, match="no --etcd-user"):
        EtcdSecurity(password=PASSWORD)
    with pytest.raises(ConfigError, match="expected an etcd user name"):
        EtcdSecurity(user=" trainer", password=PASSWORD)


def test_the_password_stays_out_of_repr_and_descriptions():
    security = EtcdSecurity(cacert="/ca.pem", user="trainer", password=PASSWORD)
    assert PASSWORD not in repr(security)
    assert PASSWORD not in security.describe()
    assert "user trainer" in security.describe()
    assert EtcdSecurity().describe() == "the system's CA roots"


def test_password_from_a_file_without_its_newline(tmp_path):
    path = tmp_path / "pw"
    path.write_text(PASSWORD + "\n")
    security = security_from_options(user="trainer", password_file=str(path), environ={})
    assert security.password == PASSWORD


def test_password_from_the_environment_and_never_twice(tmp_path):
    env = {"ELASTIC_ETCD_PASSWORD": PASSWORD}
    assert security_from_options(user="trainer", environ=env).password == PASSWORD
    path = tmp_path / "pw"
    path.write_text("other")
    with pytest.raises(ConfigError, match="given twice") as info:
        security_from_options(user="trainer", password_file=str(path), environ=env)
    assert PASSWORD not in str(info.value)
    with pytest.raises(ConfigError, match="is set but empty"):
        security_from_options(user="trainer", environ={"ELASTIC_ETCD_PASSWORD": ""})


def test_an_empty_or_missing_password_file_is_named(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=f"password file {empty} .* is empty"):
        security_from_options(user="u", password_file=str(empty), environ={})
    with pytest.raises(ConfigError, match=f"cannot read the etcd password file {tmp_path}/no"):
        security_from_options(user="u", password_file=str(tmp_path / "no"), environ={})


def test_tls_files_are_read_at_start_and_a_bad_one_is_named(pem, tmp_path):
    ca, crt, key = pem("ca.pem"), pem("c.pem"), pem("k.pem")
    security = security_from_options(cacert=ca, cert=crt, key=key, environ={})
    assert security.read_tls_files() == (PEM, PEM, PEM)
    with pytest.raises(ConfigError, match=f"cannot read the etcd CA bundle {tmp_path}/x.pem "
                                          r"\(--etcd-cacert\): No such file"):
        security_from_options(cacert=str(tmp_path / "x.pem"), environ={})
    with pytest.raises(ConfigError, match=r"client key .*junk \(--etcd-key\) is not a PEM file"):
        security_from_options(cert=crt, key=pem("junk", b"hello"), environ={})


# ------------------------------------------------------------------ endpoints


def test_https_endpoints_are_accepted_and_mixing_schemes_is_not():
    assert parse_endpoint_urls("https://a:1,b") == ("https", [HostPort("a", 1),
                                                              HostPort("b", 2379)])
    assert parse_endpoint_urls("a,b:3") == (None, [HostPort("a", 2379), HostPort("b", 3)])
    with pytest.raises(ConfigError, match="mix http:// and https://"):
        parse_endpoint_urls("http://a,https://b")


def test_tls_files_with_http_endpoints_are_refused_before_connecting(pem):
    with pytest.raises(ConfigError, match="need https:// etcd endpoints"):
        EtcdStore("http://127.0.0.1:1", security=EtcdSecurity(cacert=pem("ca.pem")))


def test_security_for_a_store_that_is_not_etcd_is_refused():
    register_backend("securitytest", lambda endpoints, **kw: pytest.fail("opened"))
    with pytest.raises(ConfigError, match="do not apply"):
        open_store("securitytest://x", security=EtcdSecurity(user="u", password=PASSWORD))


# ------------------------------------------------------------------ elasticd's options


def _load(tmp_path, argv, environ=None):
    script = tmp_path / "train.py"
    script.write_text("")
    return config.load(["--job-id", "j", "--nnodes", "1", *argv, str(script)], environ or {})


def test_elasticd_options_build_the_security(tmp_path, pem, caplog):
    ca, crt, key = pem("ca.pem"), pem("c.pem"), pem("k.pem")
    caplog.set_level(logging.WARNING)
    cfg = _load(tmp_path, ["--etcd", "https://etcd:2379", "--etcd-cacert", ca,
                           "--etcd-cert", crt, "--etcd-key", key, "--etcd-user", "trainer"],
                {"ELASTIC_ETCD_PASSWORD": PASSWORD, "ELASTIC_ADVERTISE_ADDR": "10.0.0.5"})
    assert cfg.etcd_security == EtcdSecurity(cacert=ca, cert=crt, key=key, user="trainer",
                                             password=PASSWORD)
    assert "ELASTIC_ETCD_PASSWORD" not in caplog.text  # known, not warned about
    assert PASSWORD not in repr(cfg)


def test_elasticd_options_from_the_environment_and_no_security_by_default(tmp_path, pem):
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD)
    cfg = _load(tmp_path, ["--etcd", "http://127.0.0.1:2379"],
                {"ELASTIC_ETCD_USER": "trainer", "ELASTIC_ETCD_PASSWORD_FILE": str(pw)})
    assert (cfg.etcd_security.user, cfg.etcd_security.password) == ("trainer", PASSWORD)
    assert _load(tmp_path, ["--etcd", "http://127.0.0.1:2379"]).etcd_security == EtcdSecurity()


def test_elasticd_names_the_option_of_a_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=f"--etcd-cacert {tmp_path}/none.pem: no such file"):
        _load(tmp_path, ["--etcd", "https://127.0.0.1:2379",
                         "--etcd-cacert", str(tmp_path / "none.pem")])
    with pytest.raises(ConfigError, match="--etcd-cert without --etcd-key"):
        _load(tmp_path, ["--etcd", "https://127.0.0.1:2379",
                         "--etcd-cert", str(tmp_path / "train.py")])


def test_elasticd_refuses_security_options_with_standalone(tmp_path, pem):
    with pytest.raises(ConfigError, match="--standalone starts a private plain-text etcd"):
        _load(tmp_path, ["--standalone", "--etcd-cacert", pem("ca.pem")])


# ------------------------------------------------------------------ tokens


class FakeChannel:
    """Answers Authenticate from a list: a token, or an RpcError to raise."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests: list[rpc_pb2.AuthenticateRequest] = []

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, **_):
        def call(request, timeout=None, metadata=None):
            self.requests.append(request)
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return rpc_pb2.AuthenticateResponse(token=answer)

        return call


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def _token_auth(answers):
    channel = FakeChannel(answers)
    auth = TokenAuth(channel, EtcdSecurity(user="trainer", password=PASSWORD),
                     "https://etcd:2379", lambda exc, what, t: StoreUnavailableError(what))
    return auth, channel


def test_a_token_is_renewed_once_for_all_who_saw_it_fail():
    auth, channel = _token_auth(["t1", "t2"])
    auth.authenticate(1.0)
    assert auth.token == "t1" and TokenAuth.metadata_for(auth.token) == (("token", "t1"),)
    auth.refresh("t1", 1.0)
    auth.refresh("t1", 1.0)  # another caller that failed with t1: t2 is already there
    assert auth.token == "t2"
    assert len(channel.requests) == 2
    assert channel.requests[0].name == "trainer" and channel.requests[0].password == PASSWORD
    assert PASSWORD not in repr(auth) and "t2" not in repr(auth)


def test_a_refused_password_is_one_line_without_the_password():
    auth, _ = _token_auth([FakeRpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        "etcdserver: authentication failed, invalid user ID or password")])
    with pytest.raises(StoreAuthError) as info:
        auth.authenticate(1.0)
    assert str(info.value) == ("etcd at https://etcd:2379 refused user trainer: authentication "
                               "failed (wrong password, or no such user)")


def test_etcd_without_authentication_is_used_without_a_token(caplog):
    auth, _ = _token_auth([FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION,
                                        "etcdserver: authentication is not enabled")])
    auth.authenticate(1.0)
    assert auth.token is None and TokenAuth.metadata_for(None) is None
    assert "authentication turned off" in caplog.text


def test_other_failures_are_translated_by_the_store():
    auth, _ = _token_auth([FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")])
    with pytest.raises(StoreUnavailableError, match="authentication of user trainer"):
        auth.authenticate(1.0)


@pytest.mark.parametrize("code, details, expected", [
    (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token", True),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: revision of auth store is old", True),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty", True),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", False),
    (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied", False),
])
def test_which_refusals_a_fresh_token_may_cure(code, details, expected):
    assert is_token_error(FakeRpcError(code, details)) is expected


def test_watch_cancel_reasons_that_call_for_a_fresh_token():
    assert is_auth_cancel("etcdserver: permission denied")
    assert is_auth_cancel("etcdserver: invalid auth token")
    assert not is_auth_cancel("mvcc: required revision has been compacted")


# ------------------------------------------------------------------ messages


def test_permission_denied_names_the_jobs_prefix_and_the_user():
    err = permission_error("https://etcd:2379", "put", "/elastic/v1/job-7/round",
                           EtcdSecurity(user="trainer", password=PASSWORD))
    assert isinstance(err, StoreError)
    assert str(err) == ("permission denied for put of '/elastic/v1/job-7/round' at etcd "
                        "https://etcd:2379: the role of user trainer must grant readwrite on "
                        "prefix /elastic/v1/job-7/")
    by_cert = permission_error("https://etcd:2379", "lease_revoke", None,
                               EtcdSecurity(cert="/c.pem", key="/k.pem"))
    assert "common name (CN) of /c.pem" in str(by_cert)
    assert "the keys it touches" in str(by_cert)


def test_the_key_of_a_request_for_messages():
    assert request_key(put_request("/elastic/v1/j/x", b"", 0)) == "/elastic/v1/j/x"
    txn = rpc_pb2.TxnRequest(success=[rpc_pb2.RequestOp(
        request_put=rpc_pb2.PutRequest(key=b"/elastic/v1/j/y"))])
    assert request_key(txn) == "/elastic/v1/j/y"
    assert request_key(rpc_pb2.LeaseRevokeRequest(ID=1)) is None


@pytest.mark.parametrize("details, security, expected", [
    ("Ssl handshake failed: SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
     "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
     EtcdSecurity(cacert="/ca.pem"),
     "the server's certificate at E is not signed by the CA in /ca.pem (--etcd-cacert)"),
    ("Ssl handshake failed: SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED", EtcdSecurity(),
     "the server's certificate at E is not signed by a CA among the system's roots: pass the "
     "CA that signs it with --etcd-cacert"),
    ("SSL_ERROR_SSL: error:10000410:SSL routines:OPENSSL_internal:SSLV3_ALERT_HANDSHAKE_FAILURE",
     EtcdSecurity(cacert="/ca.pem"),
     "etcd at E requires a client certificate: pass --etcd-cert and --etcd-key"),
    ("SSL_ERROR_SSL: error:10000412:SSL routines:OPENSSL_internal:SSLV3_ALERT_BAD_CERTIFICATE",
     EtcdSecurity(cacert="/ca.pem", cert="/c.pem", key="/k.pem"),
     "etcd at E refused the client certificate /c.pem (--etcd-cert): it is not signed by a CA "
     "etcd trusts (its --trusted-ca-file), has expired, or is not meant for client "
     "authentication"),
    # What gRPC 1.85 says (TLS 1.3: the server's refusal arrives after the handshake).
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:56701: "
     "Unwrap failed (TSI_DATA_CORRUPTED)", EtcdSecurity(cacert="/ca.pem"),
     "etcd at E requires a client certificate: pass --etcd-cert and --etcd-key"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:56701: "
     "Unwrap failed (TSI_DATA_CORRUPTED)", EtcdSecurity(cert="/c.pem", key="/k.pem"),
     "etcd at E refused the client certificate /c.pem (--etcd-cert): it is not signed by a CA "
     "etcd trusts (its --trusted-ca-file), has expired, or is not meant for client "
     "authentication"),
    ("last error: UNKNOWN: ipv4:127.0.0.1:39173: Custom verification check failed with "
     "error: UNAUTHENTICATED: Hostname Verification Check failed.", EtcdSecurity(),
     "the server's certificate at E is not valid for the host name of the endpoint: use a "
     "name or address it lists (its subject alternative names)"),
    ("Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
     "routines:OPENSSL_internal:WRONG_VERSION_NUMBER", EtcdSecurity(),
     "etcd at E does not speak TLS: use http:// endpoints"),
    ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:2379: "
     "Connection refused", EtcdSecurity(cacert="/ca.pem"), None),
])
def test_what_a_failed_tls_connection_means(details, security, expected):
    assert explain_connect_failure(details, where="E", tls=True, security=security) == expected


def test_a_unix_endpoint_is_one_etcd_behind_its_socket():
    from elastic.store.etcd_endpoints import unix_socket_path

    assert unix_socket_path("unix:///tmp/elastic-etcd-x/client:2379") == \
        "/tmp/elastic-etcd-x/client:2379"
    assert unix_socket_path("http://127.0.0.1:2379") is None
    with pytest.raises(ConfigError, match="give it alone"):
        unix_socket_path("unix:///a/b,http://127.0.0.1:2379")
    with pytest.raises(ConfigError, match="unix:///absolute/path"):
        unix_socket_path("unix://relative:2379")
