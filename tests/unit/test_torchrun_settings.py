"""torchrun's rendezvous arguments for the etcd3 backend: what they mean, and the
one-line errors for what they must not be. Pure: no etcd, no torchrun."""

from __future__ import annotations

import pytest

from elastic.errors import ConfigError
from elastic.rendezvous.config import DEFAULT_LEASE_TTL_S, DEFAULT_SETTLE_S
from elastic.store.api import DEFAULT_CONNECT_TIMEOUT_S
from elastic.store.security import PASSWORD_ENV
from elastic.torchrun.conf import CONF_KEYS
from elastic.torchrun.settings import settings_from_conf


def settings(conf=None, *, run_id="job-1", endpoint="10.0.0.1:2379,10.0.0.2:2379",
             nnodes=(1, 4), local_addr=None, environ=None):
    return settings_from_conf(run_id=run_id, endpoint=endpoint, min_nodes=nnodes[0],
                              max_nodes=nnodes[1], local_addr=local_addr, conf=conf or {},
                              default_host="gpu-7.cluster", environ=environ or {})


def test_timeouts_keep_torchs_names_and_become_the_rendezvous_config():
    s = settings({"join_timeout": "12", "last_call_timeout": "0.5", "close_timeout": "3",
                  "keep_alive_interval": "1", "keep_alive_max_attempt": "2", "timeout": 900,
                  "read_timeout": "7", "heartbeat_timeout": "5"})
    assert (s.join_timeout_s, s.last_call_s, s.close_timeout_s, s.lease_ttl_s,
            s.connect_timeout_s) == (12, 0.5, 3, 2, 7)
    config = s.rendezvous_config()
    assert (config.job_id, config.min_nodes, config.max_nodes) == ("job-1", 1, 4)
    assert (config.settle_s, config.lease_ttl_s, config.join_timeout_s) == (0.5, 2, 12)


def test_torchruns_own_timeout_is_the_join_timeout_unless_join_timeout_is_given():
    # torchrun always passes "timeout" (LaunchConfig's rdzv_timeout, 900 s).
    s = settings({"timeout": 900})
    assert s.join_timeout_s == 900
    assert (s.last_call_s, s.lease_ttl_s) == (DEFAULT_SETTLE_S, DEFAULT_LEASE_TTL_S)
    assert s.connect_timeout_s == DEFAULT_CONNECT_TIMEOUT_S  # the store's default


def test_one_keep_alive_key_takes_torchs_default_for_the_other():
    assert settings({"keep_alive_interval": "2"}).lease_ttl_s == 6  # x 3 attempts
    assert settings({"keep_alive_max_attempt": "2"}).lease_ttl_s == 10  # 5 s x


def test_protocol_gives_bare_endpoints_their_scheme():
    assert (settings({"protocol": "https"}).endpoints
            == "https://10.0.0.1:2379,https://10.0.0.2:2379")
    assert settings().endpoints == "10.0.0.1:2379,10.0.0.2:2379"


def test_the_node_host_is_local_addr_else_the_default():
    assert settings().host == "gpu-7.cluster"
    assert settings(local_addr="10.1.2.3").host == "10.1.2.3"


@pytest.mark.parametrize("cacert_key", ["cacert", "ca_cert"])
def test_tls_and_user_keys_are_our_etcd_flags(tmp_path, cacert_key):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    s = settings({cacert_key: str(ca), "user": "trainer", "password_file": str(password)})
    assert s.security.cacert == str(ca)
    assert (s.security.user, s.security.password) == ("trainer", "s3cret")
    env = settings({"user": "trainer"}, environ={PASSWORD_ENV: "from-env"})
    assert env.security.password == "from-env"


def _takes_a_number(key) -> bool:
    try:
        return key.parse(key.name, "1") == 1
    except ConfigError:
        return False


def test_every_number_key_in_the_table_is_accepted():
    # The table is the one place keys are named: a key listed but refused would be a lie.
    numbers = {k.name: "1" for k in CONF_KEYS if _takes_a_number(k)}
    assert set(numbers) >= {"join_timeout", "keep_alive_interval", "keep_alive_max_attempt"}
    assert settings(numbers).lease_ttl_s == 1


@pytest.mark.parametrize("conf, kwargs, message", [
    ({"join_timeot": "5"}, {}, "--rdzv-conf: unknown key(s) 'join_timeot'; known: ca_cert, "
                               "cacert, cert, close_timeout, heartbeat_timeout, is_host, "
                               "join_timeout, keep_alive_interval, keep_alive_max_attempt, key, "
                               "last_call_timeout, password_file, protocol, read_timeout, "
                               "ssl_cert, ssl_cert_key, store_type, timeout, use_libuv, user"),
    ({"heartbeat": "6"}, {}, "unknown key(s) 'heartbeat' (not read by torch: the lease TTL is "
                             "keep_alive_interval x keep_alive_max_attempt)"),
    ({"keep_alive_interval": "0.25", "keep_alive_max_attempt": "2"}, {},
     "--rdzv-conf keep_alive_interval*keep_alive_max_attempt 0.25*2: the lease TTL must be at "
     "least 1 s (etcd's smallest)"),
    ({"last_call_timeout": "soon"}, {}, "--rdzv-conf last_call_timeout 'soon': expected a float"),
    ({"join_timeout": "nan"}, {}, "--rdzv-conf join_timeout 'nan': expected a finite number"),
    ({"join_timeout": True}, {}, "--rdzv-conf join_timeout True: expected a float"),
    ({"close_timeout": "0"}, {}, "--rdzv-conf close_timeout '0': must be greater than 0"),
    ({"timeout": 0}, {}, "--rdzv-conf timeout 0: must be greater than 0"),
    ({"key": "k.pem", "ssl_cert_key": "k.pem"}, {},
     "--rdzv-conf key and ssl_cert_key both set the etcd client key: give one"),
    ({"is_host": "1"}, {}, "--rdzv-conf is_host: settings of torch's c10d rendezvous"),
    ({"protocol": "https"}, {"endpoint": "http://a:1"},
     "--rdzv-conf protocol=https but the endpoint 'http://a:1' says otherwise"),
    ({"cert": "/c.pem"}, {}, "--rdzv-conf: --etcd-cert without --etcd-key"),
    ({"user": "trainer"}, {}, f"needs a password: set {PASSWORD_ENV}"),
    ({"cacert": "/nonexistent/ca.pem"}, {}, "/nonexistent/ca.pem"),
    ({}, {"run_id": "my job"}, "invalid --rdzv-id 'my job'"),
    ({}, {"endpoint": ""}, "the etcd3 rendezvous needs --rdzv-endpoint"),
    ({}, {"endpoint": "etcd://a:1"}, "--rdzv-endpoint: bad etcd endpoint 'etcd://a:1'"),
    ({}, {"local_addr": "a b"}, "--local-addr 'a b': expected a host name"),
    ({}, {"nnodes": (3, 2)}, "--nnodes 3:2: need 1 <= MIN <= MAX"),
])
def test_bad_input_is_one_line_that_names_the_option(conf, kwargs, message):
    with pytest.raises(ConfigError) as err:
        settings(conf, **kwargs)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
