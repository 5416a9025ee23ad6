"""The etcd store over TLS with client certificates and etcd authentication, on a real etcd.

One etcd serves the module: TLS with client certificates required (a CA
made by trustme at test time), authentication on, simple tokens that expire
after 2 s without use (so token renewal runs all the time, not only in the
test made for it), and two users: ``trainer``, whose role grants readwrite on
the job's prefix only, and ``outsider``, whose role grants another job's.

* The store contract runs as ``trainer`` under the job's prefix.
* Each refusal is one line that says what to change, asserted word for word
  where it matters: an unknown CA, a client certificate from another CA, no
  client certificate, a wrong password, a user without the job's prefix,
  no user at all, plain text against TLS.
* Tokens: a store, a lease and a watch outlive the token's TTL and an etcd
  restart (which forgets every simple token).
* The password and the tokens never reach a log line or an error message.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest

from elastic.errors import StoreAuthError, StoreUnavailableError
from elastic.store import EtcdSecurity, open_store
from elastic.store.api import Compare, Put
from elastic.store.server import EtcdServer, ServerTLS
from tests.contract.test_store_contract import (
    WAIT_S,
    EventSink,
    RawEtcd,
    RawEtcdHooks,
    StoreContract,
)

trustme = pytest.importorskip("trustme")

pytestmark = pytest.mark.integration

JOB = "secure-job"
JOB_PREFIX = f"/elastic/v1/{JOB}/"
TRAINER_PASSWORD = "tr41ner-" + uuid.uuid4().hex  # unique: searched for in logs
OUTSIDER_PASSWORD = "0utsider-" + uuid.uuid4().hex
ROOT_PASSWORD = "r00t-" + uuid.uuid4().hex
CONNECT_S = 3.0
AUTH_ARGS = ("--auth-token", "simple", "--auth-token-ttl", "2", "--bcrypt-cost", "4")


class Pki:
    """PEM files on disk: our CA, a foreign CA, the server's and clients' certificates."""

    def __init__(self, directory):
        ca, rogue = trustme.CA(), trustme.CA()
        server = ca.issue_cert("127.0.0.1", "localhost")
        client = ca.issue_cert("elastic-agent")  # no common name: not an etcd user
        rogue_client = rogue.issue_cert("elastic-agent")

        def write(name: str, blob) -> str:
            path = directory / name
            blob.write_to_path(str(path))
            return str(path)

        self.ca = write("ca.pem", ca.cert_pem)
        self.rogue_ca = write("rogue-ca.pem", rogue.cert_pem)
        self.server_cert = write("server.pem", server.cert_chain_pems[0])
        self.server_key = write("server-key.pem", server.private_key_pem)
        self.client_cert = write("client.pem", client.cert_chain_pems[0])
        self.client_key = write("client-key.pem", client.private_key_pem)
        self.rogue_cert = write("rogue-client.pem", rogue_client.cert_chain_pems[0])
        self.rogue_key = write("rogue-client-key.pem", rogue_client.private_key_pem)

    def server_tls(self) -> ServerTLS:
        return ServerTLS(ca_file=self.ca, cert_file=self.server_cert, key_file=self.server_key,
                         client_ca_file=self.ca)

    def security(self, *, user: str | None = "trainer", password: str | None = TRAINER_PASSWORD,
                 **changes) -> EtcdSecurity:
        fields = dict(cacert=self.ca, cert=self.client_cert, key=self.client_key, user=user,
                      password=password if user else None)
        fields.update(changes)
        return EtcdSecurity(**fields)


def start_secure_etcd(pki: Pki, workdir) -> EtcdServer:
    server = EtcdServer(data_dir=str(workdir / "data"), log_path=str(workdir / "etcd.log"),
                        unsafe_no_fsync=True, tls=pki.server_tls(), extra_args=AUTH_ARGS)
    server.start(timeout_s=20.0)
    try:
        server.add_user("trainer", TRAINER_PASSWORD, prefixes=[JOB_PREFIX])
        server.add_user("outsider", OUTSIDER_PASSWORD, prefixes=["/elastic/v1/other-job/"])
        server.enable_auth(ROOT_PASSWORD)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_etcd(pki, tmp_path_factory):
    server = start_secure_etcd(pki, tmp_path_factory.mktemp("secure-etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def secrets_not_logged(caplog):
    """Every log line of the test is captured; none may hold a password or a token."""
    caplog.set_level(logging.DEBUG)
    tokens: list[str] = []
    yield tokens
    text = caplog.text
    for secret in (TRAINER_PASSWORD, OUTSIDER_PASSWORD, ROOT_PASSWORD, *tokens):
        assert secret not in text


def _open(server: EtcdServer, security: EtcdSecurity, **kwargs):
    return open_store(server.endpoint, security=security,
                      connect_timeout_s=kwargs.pop("connect_timeout_s", CONNECT_S), **kwargs)


def _refusal(server: EtcdServer, security: EtcdSecurity, endpoint: str | None = None) -> str:
    with pytest.raises(StoreAuthError) as info:
        open_store(endpoint or server.endpoint, security=security, connect_timeout_s=CONNECT_S)
    message = str(info.value)
    assert "\n" not in message
    for secret in (TRAINER_PASSWORD, OUTSIDER_PASSWORD, ROOT_PASSWORD):
        assert secret not in message
    return message


# ------------------------------------------------------------------ the contract


class TestSecureEtcdStore(RawEtcdHooks, StoreContract):
    """The whole store contract as ``trainer``, over client-certificate TLS, under
    the only prefix its role grants; tokens expire every 2 s idle meanwhile."""

    @pytest.fixture
    def prefix(self) -> str:
        return f"{JOB_PREFIX}{uuid.uuid4().hex[:12]}/"

    @pytest.fixture
    def store(self, secure_etcd, pki):
        with _open(secure_etcd, pki.security()) as store:
            yield store

    @pytest.fixture
    def raw_etcd(self, secure_etcd):
        """Root's own stubs."""
        from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc

        channel = secure_etcd.channel()
        token = rpc_pb2_grpc.AuthStub(channel).Authenticate(
            rpc_pb2.AuthenticateRequest(name="root", password=ROOT_PASSWORD), timeout=WAIT_S).token
        yield RawEtcd(channel, token)
        channel.close()


def test_several_https_endpoints_are_checked_against_the_first_ones_name(secure_etcd, pki,
                                                                         secrets_not_logged):
    # Two addresses make gRPC's target an address list, with no host name of
    # its own: the certificate (valid for 127.0.0.1 only) is checked against
    # the first endpoint's host. Nothing listens on 127.0.0.2.
    port = secure_etcd.client_port
    endpoints = f"https://127.0.0.1:{port},https://127.0.0.2:{port}"
    with open_store(endpoints, security=pki.security(), connect_timeout_s=CONNECT_S) as store:
        assert store.put(f"{JOB_PREFIX}several", b"") > 0


# ------------------------------------------------------------------ refusals


def test_a_server_certificate_from_an_unknown_ca_is_refused(secure_etcd, pki, secrets_not_logged):
    message = _refusal(secure_etcd, pki.security(cacert=pki.rogue_ca))
    assert message == (f"the server's certificate at {secure_etcd.endpoint} is not signed by "
                       f"the CA in {pki.rogue_ca} (--etcd-cacert)")


def test_without_a_ca_the_system_roots_do_not_know_a_private_ca(secure_etcd, pki,
                                                                 secrets_not_logged):
    message = _refusal(secure_etcd, pki.security(cacert=None))
    assert message == (f"the server's certificate at {secure_etcd.endpoint} is not signed by a "
                       "CA among the system's roots: pass the CA that signs it with "
                       "--etcd-cacert")


def test_no_client_certificate_is_refused(secure_etcd, pki, secrets_not_logged):
    message = _refusal(secure_etcd, pki.security(cert=None, key=None))
    assert message == (f"etcd at {secure_etcd.endpoint} requires a client certificate: pass "
                       "--etcd-cert and --etcd-key")


def test_a_client_certificate_from_another_ca_is_refused(secure_etcd, pki, secrets_not_logged):
    message = _refusal(secure_etcd, pki.security(cert=pki.rogue_cert, key=pki.rogue_key))
    assert message.startswith(f"etcd at {secure_etcd.endpoint} refused the client certificate "
                              f"{pki.rogue_cert} (--etcd-cert): it is not signed by a CA etcd "
                              "trusts")


def test_a_wrong_password_is_refused(secure_etcd, pki, secrets_not_logged):
    message = _refusal(secure_etcd, pki.security(password=OUTSIDER_PASSWORD))
    assert message == (f"etcd at {secure_etcd.endpoint} refused user trainer: authentication "
                       "failed (wrong password, or no such user)")


def test_plain_text_against_tls_says_to_use_https(secure_etcd, pki, secrets_not_logged):
    plain = secure_etcd.endpoint.replace("https://", "http://")
    with pytest.raises(StoreUnavailableError) as info:
        open_store(plain, connect_timeout_s=1.0)
    assert str(info.value).endswith("etcd hangs up on plain text: if it serves TLS, use "
                                    "https:// endpoints")


def test_a_user_without_the_jobs_prefix_is_refused_naming_the_prefix(secure_etcd, pki,
                                                                      secrets_not_logged):
    key = f"{JOB_PREFIX}round"
    hint = (f"at etcd {secure_etcd.endpoint}: the role of user outsider must grant readwrite "
            f"on prefix {JOB_PREFIX}")
    with _open(secure_etcd, pki.security(user="outsider", password=OUTSIDER_PASSWORD)) as store:
        with pytest.raises(StoreAuthError) as info:
            store.put(key, b"1")
        assert str(info.value) == f"permission denied for put of {key!r} {hint}"
        with pytest.raises(StoreAuthError) as info:
            store.txn([Compare.version(key, "==", 0)], [Put(key, b"1")])
        assert str(info.value) == f"permission denied for txn of {key!r} {hint}"
        with pytest.raises(StoreAuthError, match="permission denied for get_prefix"):
            store.get_prefix(JOB_PREFIX)
        sink = EventSink()
        store.watch(JOB_PREFIX, sink.on_events, prefix=True, start_revision=1,
                    on_error=sink.on_error)
        error = sink.wait_error()
        assert isinstance(error, StoreAuthError)
        assert str(error) == f"permission denied for watch of {JOB_PREFIX!r} {hint}"
        assert store.get("/elastic/v1/other-job/round") is None  # its own prefix works


def test_a_watch_refused_for_permission_ends_alone(secure_etcd, pki, secrets_not_logged):
    # The refused watch shares its store's stream with the others: its
    # refusal (and the retry with a fresh token that tells it from a stale
    # token) must neither end them nor make them miss or repeat an event.
    own = f"/elastic/v1/other-job/{uuid.uuid4().hex[:12]}/"
    hint = (f"at etcd {secure_etcd.endpoint}: the role of user outsider must grant readwrite "
            f"on prefix {JOB_PREFIX}")
    with _open(secure_etcd, pki.security(user="outsider", password=OUTSIDER_PASSWORD)) as store:
        first = store.put(own + "first", b"")
        older = EventSink()
        store.watch(own, older.on_events, prefix=True, start_revision=first,
                    on_error=older.on_error)
        older.wait_count(1)
        refused = EventSink()
        store.watch(JOB_PREFIX, refused.on_events, prefix=True, start_revision=1,
                    on_error=refused.on_error)
        assert str(refused.wait_error()) == f"permission denied for watch of {JOB_PREFIX!r} {hint}"
        newer = EventSink()
        store.watch(own, newer.on_events, prefix=True, on_error=newer.on_error)
        second = store.put(own + "second", b"")
        assert [e.revision for e in older.wait_count(2)] == [first, second], older.describe()
        assert [e.revision for e in newer.wait_count(1)] == [second], newer.describe()
        assert older.errors == [] and newer.errors == []
        assert refused.snapshot() == [] and len(refused.errors) == 1


def test_without_a_user_the_certificates_name_is_the_user(secure_etcd, pki, secrets_not_logged):
    # etcd takes the user from the client certificate's common name; ours has none.
    key = JOB_PREFIX + "round"
    with _open(secure_etcd, pki.security(user=None)) as store:
        with pytest.raises(StoreAuthError) as info:
            store.get(key)
    assert str(info.value) == (
        f"permission denied for get of {key!r} at etcd {secure_etcd.endpoint}: the role of the "
        f"etcd user named by the common name (CN) of {pki.client_cert} (no --etcd-user given) "
        f"must grant readwrite on prefix {JOB_PREFIX}")


# ------------------------------------------------------------------ tokens


def _wait_for_log(caplog, text: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in caplog.text:
        assert time.monotonic() < deadline, f"no log line with {text!r}:\n{caplog.text}"
        time.sleep(0.05)


def test_calls_a_lease_and_a_watch_outlive_token_expiry_and_an_etcd_restart(
        pki, tmp_path, caplog, secrets_not_logged):
    server = start_secure_etcd(pki, tmp_path)
    try:
        with _open(server, pki.security()) as store:
            secrets_not_logged.append(store.connection.token)
            prefix = f"{JOB_PREFIX}refresh/"
            session = store.session(4)
            store.put(prefix + "node", b"", lease=session.lease_id)
            sink = EventSink()
            watch = store.watch(prefix, sink.on_events, prefix=True, on_error=sink.on_error)

            time.sleep(3.5)  # past the 2 s token TTL: the store's token is gone
            first = store.connection.token
            store.put(prefix + "a", b"1")  # renews the token and goes through
            assert store.connection.token != first
            secrets_not_logged.append(store.connection.token)
            sink.wait_key(prefix + "a")

            before_restart = store.connection.token
            assert caplog.text.count("authenticating again") == 1  # for the put
            server.restart()  # a simple token lives in etcd's memory only
            # The watch's stream broke. Reopened, etcd refuses its token at
            # creation: the watch renews it itself (no call of ours did yet)
            # and resumes where it was.
            _wait_for_log(caplog, "resumed from revision")
            assert caplog.text.count("authenticating again") == 2
            assert store.connection.token != before_restart
            secrets_not_logged.append(store.connection.token)
            store.put(prefix + "b", b"2")
            sink.wait_key(prefix + "b")
            assert not sink.errors
            assert [e.kv.key for e in sink.snapshot()] == [prefix + "a", prefix + "b"]
            # The lease was kept alive all along, across the restart.
            time.sleep(2.5)
            assert not session.lost.is_set()
            assert store.get(prefix + "node").lease == session.lease_id
            result = store.txn([Compare.version(prefix + "a", ">", 0)], [Put(prefix + "c", b"")])
            assert result.succeeded
            watch.cancel()
            session.close()
        assert "authenticating again" in caplog.text
    finally:
        server.stop()


def test_concurrent_callers_share_one_renewal(secure_etcd, pki, caplog, secrets_not_logged):
    with _open(secure_etcd, pki.security()) as store:
        time.sleep(3.5)  # the token expires
        caplog.clear()
        errors: list[BaseException] = []

        def call(i: int) -> None:
            try:
                store.put(f"{JOB_PREFIX}concurrent/{i}", b"")
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 2)
        assert not errors
        assert caplog.text.count("authenticating again") == 1
        secrets_not_logged.append(store.connection.token)
        kvs, _ = store.get_prefix(f"{JOB_PREFIX}concurrent/")
        assert len(kvs) == 8
        assert all(kv.key.startswith(JOB_PREFIX) for kv in kvs)


def test_a_watch_created_on_a_stream_whose_token_expired_joins_the_others(
        secure_etcd, pki, secrets_not_logged):
    # All watches of a store share one stream, which carries the token of
    # when it was opened. Once that token has expired, etcd refuses the next
    # watch's creation on it: the stream is reopened with a fresh token and
    # every watch created again, none missing or repeating an event.
    prefix = f"{JOB_PREFIX}{uuid.uuid4().hex[:12]}/"
    with _open(secure_etcd, pki.security()) as store:
        first = store.put(prefix + "a", b"1")
        older = [EventSink() for _ in range(3)]
        for sink in older:
            store.watch(prefix, sink.on_events, prefix=True, start_revision=first,
                        on_error=sink.on_error)
            sink.wait_count(1)
        time.sleep(3.5)  # past the 2 s token TTL: the stream's token is gone
        second = store.put(prefix + "b", b"2")  # renews the store's token
        for sink in older:
            sink.wait_count(2)

        newer = EventSink()
        store.watch(prefix, newer.on_events, prefix=True, start_revision=first,
                    on_error=newer.on_error)
        third = store.put(prefix + "c", b"3")
        fence = store.put(prefix + "fence", b"")

        for sink in [*older, newer]:
            events = sink.wait_count(4)
            assert [e.revision for e in events] == [first, second, third, fence], sink.describe()
            assert sink.errors == []
        secrets_not_logged.append(store.connection.token)
