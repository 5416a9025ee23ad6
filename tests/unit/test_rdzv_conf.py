"""torchrun's ``--rdzv-conf`` means the same through both of our entry points.

The same ``--rdzv-conf`` line is given to elasticd (a torchrun command line,
:func:`agent.config.load`) and to the ``etcd3`` handler torchrun loads
(:func:`elastic.torchrun.settings.settings_from_conf`, with the keys torch
would hand it): both must set the same join timeout, last call, lease TTL and
connect timeout, and refuse the same mistakes with the same line.
"""

from __future__ import annotations

import os
import re

import pytest

from agent import config
from agent.devices import HostDevices
from agent.netaddr import HostNetwork
from agent.torchrun_cli import parse_rdzv_conf
from elastic.errors import ConfigError
from elastic.torchrun.conf import C10D_KEYS, CONF_KEYS
from elastic.torchrun.settings import settings_from_conf

NET = HostNetwork(fqdn=lambda: "node1", resolve=lambda h: ["10.0.0.5"] if h == "node1" else [],
                  route_source=lambda addr, port: "10.0.0.5", interface_of=lambda a: "eth0")
NO_GPU = HostDevices(physical_gpus=lambda: 0, cpu_count=lambda: 6)
ENDPOINT = "etcd1:2379"
GUIDE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "migrating-from-torchrun.md")


def takes_a_number(key) -> bool:
    try:
        return key.parse(key.name, "1") == 1
    except ConfigError:
        return False


@pytest.fixture
def both(tmp_path):
    """``both(line)``: (elasticd's AgentConfig, the handler's HandlerSettings) for
    ``--rdzv-conf line``, or the two ConfigError messages they raised instead."""
    script = tmp_path / "train.py"
    script.write_text("")

    def read(line: str):
        outcomes = []
        try:
            outcomes.append(config.load(
                ["--rdzv-backend", "etcd", "--rdzv-endpoint", ENDPOINT, "--rdzv-id", "j",
                 "--nnodes", "1:4", "--rdzv-conf", line, str(script)], {},
                net=NET, devices=NO_GPU))
        except ConfigError as exc:
            outcomes.append(str(exc))
        try:
            outcomes.append(settings_from_conf(
                run_id="j", endpoint=ENDPOINT, min_nodes=1, max_nodes=4, local_addr=None,
                conf=parse_rdzv_conf(line), default_host="node1", environ={}))
        except ConfigError as exc:
            outcomes.append(str(exc))
        return tuple(outcomes)
    return read


@pytest.mark.parametrize("line", [
    "",
    "join_timeout=30",
    "timeout=90",
    "timeout=900,join_timeout=30",
    "last_call_timeout=0",
    "last_call_timeout=2.5",
    "keep_alive_interval=2,keep_alive_max_attempt=4",
    "keep_alive_interval=0.5",
    "keep_alive_max_attempt=2",
    "read_timeout=7",
    "protocol=HTTPS,close_timeout=3,heartbeat_timeout=2",
])
def test_the_same_line_sets_the_same_rendezvous(both, line):
    ours, handler = both(line)

    assert not isinstance(ours, str) and not isinstance(handler, str), (ours, handler)
    assert ours.rendezvous().join_timeout_s == handler.rendezvous_config().join_timeout_s
    assert ours.rendezvous().settle_s == handler.rendezvous_config().settle_s
    assert ours.rendezvous().lease_ttl_s == handler.rendezvous_config().lease_ttl_s
    assert ours.etcd == handler.endpoints
    if "read_timeout" in line:
        assert ours.connect_timeout_s == handler.connect_timeout_s == 7


@pytest.mark.parametrize("line, needle", [
    ("join_timout=5", "unknown key(s) 'join_timout'; known: "),
    ("heartbeat=6", "unknown key(s) 'heartbeat' (not read by torch: the lease TTL is "
                    "keep_alive_interval x keep_alive_max_attempt)"),
    ("etcd_prefix=/x,zz=1", "unknown key(s) 'etcd_prefix' (the rendezvous keeps its keys "
                            "under /elastic/v1/<job id>/: separate jobs by --rdzv-id), 'zz'"),
    ("keep_alive_interval=0.2", "the lease TTL must be at least 1 s"),
    ("join_timeout=soon", "--rdzv-conf join_timeout 'soon': expected a float"),
    ("last_call_timeout=-1", "--rdzv-conf last_call_timeout '-1': must not be negative"),
    ("read_timeout=inf", "--rdzv-conf read_timeout 'inf': expected a finite number"),
    ("cert=a.pem,ssl_cert=b.pem", "--rdzv-conf cert and ssl_cert both set the etcd client "
                                  "certificate: give one"),
    ("protocol=ftp", "--rdzv-conf protocol 'ftp': expected http or https"),
    ("store_type=tcp", "--rdzv-conf store_type: settings of torch's c10d rendezvous, not of an "
                       "etcd one: drop them"),
])
def test_the_same_mistake_is_refused_with_the_same_line(both, line, needle):
    ours, handler = both(line)

    assert ours == handler
    assert needle in ours


@pytest.mark.parametrize("key", [k.name for k in CONF_KEYS if takes_a_number(k)])
def test_every_number_key_refuses_a_bad_value_the_same_way(both, key):
    for bad in ("-1", "0x", "nan"):
        ours, handler = both(f"{key}={bad}")

        assert ours == handler
        assert ours.startswith(f"--rdzv-conf {key} '{bad}': ")


def test_every_key_is_in_the_migration_guide():
    with open(GUIDE) as f:
        guide = f.read()
    documented = set(re.findall(r"`([a-z_]+)`", guide))

    assert {k.name for k in CONF_KEYS} | set(C10D_KEYS) <= documented
