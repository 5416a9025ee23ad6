"""torchrun's rendezvous arguments for the etcd3 backend: what they mean, and the
one-line errors for what they must not be. Pure: no etcd, no torchrun."""

from __future__ import annotations

import pytest

from elastic.errors import ConfigError
from elastic.rendezvous.api import DEFAULT_LEASE_TTL_S, DEFAULT_SETTLE_S
from elastic.store.security import PASSWORD_ENV
from elastic.torchrun.settings import CONF_KEYS, settings_from_conf


def settings(conf=None, *, run_id="job-1", endpoint="10.0.0.1:2379,10.0.0.2:2379",
             nnodes=(1, 4), local_addr=None, environ=None):
    return settings_from_conf(run_id=run_id, endpoint=endpoint, min_nodes=nnodes[0],
                              max_nodes=nnodes[1], local_addr=local_addr, conf=conf or {},
                              default_host="gpu-7.cluster", environ=environ or {})


def test_timeouts_keep_torchs_c10d_names_and_become_the_rendezvous_config():
    s = settings({"join_timeout": "12", "last_call_timeout": "0.5", "close_timeout": "3",
                  "heartbeat": "2", "timeout": 900})
    assert (s.join_timeout_s, s.last_call_s, s.close_timeout_s, s.heartbeat_s) == (12, 0.5, 3, 2)
    config = s.rendezvous_config()
    assert (config.job_id, config.min_nodes, config.max_nodes) == ("job-1", 1, 4)
    assert (config.settle_s, config.lease_ttl_s, config.join_timeout_s) == (0.5, 2, 12)


def test_torchruns_own_timeout_is_the_join_timeout_unless_join_timeout_is_given():
    # torchrun always passes "timeout" (--rdzv-timeout, 900 s when not given).
    s = settings({"timeout": 900})
    assert s.join_timeout_s == 900
    assert (s.last_call_s, s.heartbeat_s) == (DEFAULT_SETTLE_S, DEFAULT_LEASE_TTL_S)


def test_the_node_host_is_local_addr_else_the_default():
    assert settings().host == "gpu-7.cluster"
    assert settings(local_addr="10.1.2.3").host == "10.1.2.3"


def test_tls_and_user_keys_are_our_etcd_flags(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    s = settings({"cacert": str(ca), "user": "trainer", "password_file": str(password)})
    assert s.security.cacert == str(ca)
    assert (s.security.user, s.security.password) == ("trainer", "s3cret")
    env = settings({"user": "trainer"}, environ={PASSWORD_ENV: "from-env"})
    assert env.security.password == "from-env"


def test_every_key_in_the_table_is_accepted():
    # The table is the one place keys are named: a key listed but refused would be a lie.
    values = {k.name: "1" for k in CONF_KEYS if k.seconds}
    assert settings(values).heartbeat_s == 1


@pytest.mark.parametrize("conf, kwargs, message", [
    ({"join_timeot": "5"}, {}, "--rdzv-conf: unknown key 'join_timeot'; the etcd3 backend "
                               "takes cacert, cert, close_timeout, heartbeat, join_timeout, key, "
                               "last_call_timeout, password_file, timeout, user"),
    ({"keep_alive_interval": "5"}, {},
     "--rdzv-conf: unknown key 'keep_alive_interval'; write heartbeat=SECONDS (the lease TTL) "
     "instead"),
    ({"ssl_cert": "c.pem"}, {}, "unknown key 'ssl_cert'; write cert= instead"),
    ({"heartbeat": "0.5"}, {}, "--rdzv-conf heartbeat=0.5: the lease TTL must be at least 1 "
                               "second (etcd's smallest)"),
    ({"last_call_timeout": "soon"}, {}, "--rdzv-conf last_call_timeout=soon: expected a number "
                                        "of seconds >= 0"),
    ({"join_timeout": "nan"}, {}, "join_timeout=nan: expected a number of seconds >= 0"),
    ({"close_timeout": "0"}, {}, "--rdzv-conf close_timeout=0: must be more than 0 seconds"),
    ({"timeout": 0}, {}, "--rdzv-conf timeout=0: must be more than 0 seconds"),
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
