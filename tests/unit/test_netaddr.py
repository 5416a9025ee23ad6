"""The advertised address and the workers' network interface (agent.netaddr,
agent.assign.startup_env): decided from a fake host network, except the last
tests, which ask this machine's real interfaces."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from agent import netaddr
from agent.assign import startup_env
from agent.netaddr import HostNetwork, choose_advertise_addr
from elastic.errors import ConfigError

ETCD = "http://etcd1.example:2379"


class FakeHost:
    """A host named ``fqdn``. ``hosts`` maps names to addresses (an address
    resolves to itself), ``routes`` a destination to the source address of the
    route there (none: no route), ``interfaces`` an address to the interface
    carrying it. Routes asked for are kept in ``asked``."""

    def __init__(self, fqdn: str = "node1.example", hosts: dict[str, list[str]] | None = None,
                 routes: dict[str, str] | None = None,
                 interfaces: dict[str, str] | None = None,
                 others: list[tuple[str, str]] | None = None):
        self.hosts = {"etcd1.example": ["10.0.0.9"], **(hosts or {})}
        self.routes = routes or {}
        self.interfaces = interfaces or {}
        self.asked: list[tuple[str, int]] = []
        listed = [(name, addr) for addr, name in self.interfaces.items()] + (others or [])
        self.net = HostNetwork(fqdn=lambda: fqdn, resolve=self.resolve,
                               route_source=self.route_source,
                               interface_of=self.interfaces.get, interfaces=lambda: listed)

    def resolve(self, host: str) -> list[str]:
        try:
            return [str(ipaddress.ip_address(host))]
        except ValueError:
            return self.hosts.get(host, [])

    def route_source(self, addr: str, port: int) -> str | None:
        self.asked.append((addr, port))
        return self.routes.get(addr)


def unreachable_net() -> HostNetwork:
    """A host that fails the test if it is asked anything."""
    def ask(*_args):
        raise AssertionError("the host network was asked")
    return HostNetwork(fqdn=ask, resolve=ask, route_source=ask, interface_of=ask,
                       interfaces=ask)


# ------------------------------------------------------------ the advertised address

def test_a_host_name_that_resolves_off_loopback_is_advertised_as_is():
    host = FakeHost(hosts={"node1.example": ["10.0.0.5"]}, routes={"10.0.0.9": "10.0.0.7"})

    choice = choose_advertise_addr(None, standalone=False, etcd=ETCD, net=host.net)

    assert choice.addr == "node1.example"
    assert "resolves to 10.0.0.5" in choice.reason
    assert host.asked == []  # no route looked up when the name is good


@pytest.mark.parametrize("fqdn, hosts, problem", [
    ("localhost", {"localhost": ["::1", "127.0.0.1"]}, "resolves to a loopback address"),
    # /etc/hosts on Debian maps the host name to 127.0.1.1
    ("node1", {"node1": ["127.0.1.1"]}, "resolves to a loopback address"),
    ("node1", {}, "does not resolve"),
])
def test_a_loopback_or_unresolvable_host_name_gives_way_to_the_route_to_etcd(fqdn, hosts,
                                                                             problem):
    host = FakeHost(fqdn=fqdn, hosts=hosts, routes={"10.0.0.9": "10.0.0.5"})

    choice = choose_advertise_addr(None, standalone=False, etcd=ETCD + ",http://etcd2:2379",
                                   net=host.net)

    assert choice.addr == "10.0.0.5"
    assert host.asked == [("10.0.0.9", 2379)]  # the first endpoint, its port
    assert problem in choice.reason and "route to etcd at etcd1.example:2379" in choice.reason


@pytest.mark.parametrize("etcd", ["http://localhost:2379", "127.0.0.1:23790", "http://[::1]:2379"])
def test_an_etcd_on_loopback_means_a_single_machine_job_on_loopback(etcd):
    host = FakeHost(fqdn="localhost", hosts={"localhost": ["::1", "127.0.0.1"]})

    choice = choose_advertise_addr(None, standalone=False, etcd=etcd, net=host.net)

    assert choice.addr == "127.0.0.1"
    assert "single-machine job" in choice.reason
    assert host.asked == []


@pytest.mark.parametrize("etcd, routes, problem", [
    (ETCD, {}, "no route to etcd at etcd1.example:2379"),
    ("http://nowhere.example:2379", {}, "etcd at nowhere.example:2379 does not resolve"),
    (ETCD, {"10.0.0.9": "0.0.0.0"}, "leaves from 0.0.0.0"),
    ("memory://", {}, "names no host"),
])
def test_no_usable_address_is_refused_naming_the_flag(etcd, routes, problem):
    host = FakeHost(fqdn="localhost", hosts={"localhost": ["127.0.0.1"]}, routes=routes)

    with pytest.raises(ConfigError) as info:
        choose_advertise_addr(None, standalone=False, etcd=etcd, net=host.net)

    message = str(info.value)
    assert "pass --advertise-addr" in message.lower()
    assert "'localhost' resolves to a loopback address (127.0.0.1)" in message
    assert problem in message


@pytest.mark.parametrize("standalone", [False, True])
def test_an_explicit_address_wins_and_nothing_is_asked(standalone):
    choice = choose_advertise_addr("203.0.113.4", standalone=standalone, etcd=ETCD,
                                   net=unreachable_net())

    assert choice.addr == "203.0.113.4"
    assert "--advertise-addr" in choice.reason


def test_standalone_advertises_loopback_and_nothing_is_asked():
    choice = choose_advertise_addr(None, standalone=True, etcd=None, net=unreachable_net())

    assert choice.addr == "127.0.0.1"


# ------------------------------------------------------------ the workers' interface

def test_the_interface_carrying_the_address_is_named_for_gloo_and_nccl():
    host = FakeHost(hosts={"node1.example": ["10.0.0.5"]}, interfaces={"10.0.0.5": "ens5"})

    env = startup_env(2, {}, "node1.example", net=host.net)

    # NCCL matches by prefix unless told "=": "ens5" alone would take "ens50" too.
    assert env == {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "ens5",
                   "NCCL_SOCKET_IFNAME": "=ens5"}


SEVERAL_NICS = [("lo", "127.0.0.1"), ("ens6", "10.1.0.5"), ("docker0", "172.17.0.1"),
                ("veth1a2b", "169.254.3.1"), ("ens6", "fe80::1"), ("ib0", "192.168.7.5")]


def test_nccl_keeps_to_the_advertised_interface_on_a_host_with_several(caplog):
    # NCCL bootstraps on the first of its list in the kernel's order, not the list's:
    # a list could move it to an interface the peers cannot reach.
    host = FakeHost(interfaces={"10.0.0.5": "ens5"}, others=SEVERAL_NICS)
    caplog.set_level("INFO", logger="agent.netaddr")

    env = startup_env(1, {}, "10.0.0.5", net=host.net)

    assert env == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "=ens5"}
    told = [r.getMessage() for r in caplog.records if "NCCL's sockets" in r.getMessage()]
    assert len(told) == 1
    assert "also has ens6, ib0:" in told[0]  # not lo, docker0, a veth, a link-local address
    assert "NCCL_SOCKET_IFNAME==ens5,ens6,ib0" in told[0]


def test_the_operator_s_list_of_interfaces_is_passed_on_unchanged(caplog):
    host = FakeHost(interfaces={"10.0.0.5": "ens5"}, others=SEVERAL_NICS)
    caplog.set_level("INFO", logger="agent.netaddr")

    env = startup_env(1, {"NCCL_SOCKET_IFNAME": "=ens5,ens6"}, "10.0.0.5", net=host.net)

    assert env == {"GLOO_SOCKET_IFNAME": "ens5"}  # the workers inherit the operator's list
    assert "NCCL's sockets" not in caplog.text


def test_one_interface_says_nothing_more(caplog):
    host = FakeHost(interfaces={"10.0.0.5": "ens5"}, others=[("lo", "127.0.0.1")])
    caplog.set_level("INFO", logger="agent.netaddr")
    assert startup_env(1, {}, "10.0.0.5", net=host.net)["NCCL_SOCKET_IFNAME"] == "=ens5"
    assert "NCCL's sockets" not in caplog.text


def test_variables_the_user_set_are_kept():
    host = FakeHost(interfaces={"10.0.0.5": "ens5"})

    only_nccl = startup_env(1, {"GLOO_SOCKET_IFNAME": "bond0"}, "10.0.0.5", net=host.net)
    neither = startup_env(1, {"GLOO_SOCKET_IFNAME": "bond0", "NCCL_SOCKET_IFNAME": "ib0"},
                          "10.0.0.5", net=unreachable_net())

    assert only_nccl == {"NCCL_SOCKET_IFNAME": "=ens5"}
    assert neither == {}


def test_no_interface_carrying_the_address_sets_nothing_and_says_what_to_set(caplog):
    host = FakeHost(interfaces={"10.0.0.5": "ens5"})  # 198.51.100.7 is NAT'd to this host

    env = startup_env(1, {"NCCL_SOCKET_IFNAME": "ib0"}, "198.51.100.7", net=host.net)

    assert env == {}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "198.51.100.7" in warnings[0] and "set GLOO_SOCKET_IFNAME in" in warnings[0]
    assert "NCCL_SOCKET_IFNAME" not in warnings[0]  # the user set that one


@pytest.mark.parametrize("advertise", ["127.0.0.1", "localhost", "127.0.1.1"])
def test_a_loopback_address_uses_lo(advertise):
    host = FakeHost(hosts={"localhost": ["::1", "127.0.0.1"]})  # no interface table at all

    env = startup_env(1, {}, advertise, net=host.net)

    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}


def test_without_an_advertised_address_only_threads_are_set():
    assert startup_env(2, {}, net=unreachable_net()) == {"OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------ this machine, for real

def test_this_machine_loopback_is_on_lo():
    assert netaddr.interface_of("127.0.0.1") == "lo"
    assert netaddr.route_source("127.0.0.1", 9) == "127.0.0.1"


def test_this_machine_own_address_is_on_one_of_its_interfaces():
    # The route to a documentation address (nothing is sent) leaves from this
    # machine's main address off loopback, if it has one.
    own = netaddr.route_source("203.0.113.1", 9)
    if own is None or ipaddress.ip_address(own).is_loopback:
        pytest.skip("this machine has no route off loopback")

    assert netaddr.interface_of(own) in {name for _, name in socket.if_nameindex()}
