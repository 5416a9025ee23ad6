"""Which address this node advertises, and which network interface carries it.

Two decisions the agent takes once, at start-up:

* :func:`choose_advertise_addr`: the address the other nodes (and this node's
  workers, as MASTER_ADDR) reach this node at. A host name that resolves to
  loopback here (common in containers and network namespaces, where
  ``getfqdn()`` is ``localhost``) would make every peer wait on itself, so
  the source address of the route to etcd is used instead: etcd is the one
  address every node of the job must reach.
* :func:`socket_ifname_env`: ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
  for the workers. Without them gloo picks the interface its host name
  resolves to, which in such a container is ``lo``, and then tries to reach
  the peers at 127.0.0.1. NCCL gets exactly the interface that carries the
  advertised address (``=eth0``), also on a host with several: NCCL takes
  the first interface of its list *in the kernel's order* for its bootstrap
  (and InfiniBand's out-of-band exchange), so a list could move them to an
  interface the peers do not reach, and whether the others reach the peers
  (one subnet, or rails of matching interfaces) only the operator knows. The
  bandwidth of several NICs comes through NCCL_IB_HCA (InfiniBand, RoCE) or
  a network plugin, which this variable does not limit; for sockets the
  operator sets ``NCCL_SOCKET_IFNAME`` as a list (``=eth0,eth1``), which is
  passed on unchanged, and the agent's log says so where there are others.

What the host says about its network (its name, resolution, routes,
interfaces) comes in through :class:`HostNetwork`, so both decisions are
tested with fakes and no network.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import sys
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Mapping, NoReturn

from elastic.errors import ConfigError
from elastic.hostport import HostPort

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"  # Linux's name; the agent runs workers on Linux
ETCD_DEFAULT_PORT = 2379
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"

_SIOCGIFADDR = 0x8915  # Linux: the (primary) IPv4 address of an interface
_IFREQ_ADDR = slice(20, 24)  # ifr_name[16], then sockaddr_in: family, port, address


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to here, in the resolver's order, without
    repeats; an address resolves to itself. ``[]`` when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # gaierror is an OSError
        return []
    addrs: list[str] = []
    for *_, sockaddr in infos:
        if sockaddr[0] not in addrs:
            addrs.append(sockaddr[0])
    return addrs


def route_source(addr: str, port: int) -> str | None:
    """This host's source address on the route to ``addr`` (an IP address), or
    None when there is no route. Connecting a UDP socket only asks the kernel
    to pick the route: no packet is sent."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, port))
            return sock.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for each address of this host's interfaces.

    IPv4 comes from an ``SIOCGIFADDR`` ioctl per interface, so only each
    interface's primary address is seen (not secondary ones added with
    ``ip addr add``); IPv6 from ``/proc/net/if_inet6``. Linux only: elsewhere
    the list is empty. Never raises.
    """
    if not sys.platform.startswith("linux"):
        return []
    pairs: list[tuple[str, str]] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for name in names:
                try:
                    ifreq = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                        struct.pack("256s", name.encode()[:15]))
                except OSError:  # no IPv4 address (EADDRNOTAVAIL), or gone meanwhile
                    continue
                pairs.append((name, socket.inet_ntoa(ifreq[_IFREQ_ADDR])))
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:  # "<32 hex digits> <index> <prefix> <scope> <flags> <name>"
                fields = line.split()
                if len(fields) == 6:
                    addr = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))
                    pairs.append((fields[5], addr))
    except (OSError, ValueError):  # no IPv6 in this kernel or namespace
        pass
    return pairs


def interface_of(addr: str,
                 addresses: Callable[[], list[tuple[str, str]]] = interface_addresses
                 ) -> str | None:
    """The name of the interface of this host that carries ``addr`` (an IP
    address), or None when none does (e.g. the address is NAT'd to this host)."""
    wanted = _ip(addr)
    if wanted is None:
        return None
    for name, have in addresses():
        if _ip(have) == wanted:
            return name
    return None


@dataclass(frozen=True)
class HostNetwork:
    """What the host says about its network, as the decisions here need it.

    The defaults ask the real host; tests pass fakes.
    """

    fqdn: Callable[[], str] = socket.getfqdn
    resolve: Callable[[str], list[str]] = resolve
    route_source: Callable[[str, int], "str | None"] = route_source
    interface_of: Callable[[str], "str | None"] = interface_of
    interfaces: Callable[[], list[tuple[str, str]]] = interface_addresses


SYSTEM_NETWORK = HostNetwork()


@dataclass(frozen=True)
class AdvertiseChoice:
    """The address to advertise, and why it was chosen (a phrase for the log)."""

    addr: str
    reason: str


def choose_advertise_addr(explicit: str | None, *, standalone: bool, etcd: str | None,
                          net: HostNetwork = SYSTEM_NETWORK) -> AdvertiseChoice:
    """The address the other nodes and the workers reach this node at.

    In order: ``explicit`` (``--advertise-addr``) as given; 127.0.0.1 with
    ``standalone``; the host's FQDN when it resolves, and only to addresses
    that are not loopback; 127.0.0.1 when the first etcd endpoint is itself
    on loopback (a single-machine job); else this host's source address on
    the route to the first etcd endpoint.

    Raises ConfigError, telling the user to pass --advertise-addr, when none
    of these gives an address the other nodes could reach.
    """
    if explicit:
        return AdvertiseChoice(explicit, "given with --advertise-addr")
    if standalone:
        return AdvertiseChoice(LOOPBACK, "--standalone keeps the job on this machine")
    name = net.fqdn()
    name_addrs = net.resolve(name) if name else []
    if name_addrs and not any(_unusable(a) for a in name_addrs):
        return AdvertiseChoice(name, f"the host name {name} resolves to {', '.join(name_addrs)}")
    if name_addrs:
        name_problem = (f"the host name {name!r} resolves to a loopback address "
                        f"({', '.join(name_addrs)})")
    else:
        name_problem = f"the host name {name!r} does not resolve"

    endpoint = _first_endpoint(etcd or "")
    if endpoint is None:
        _refuse(f"{name_problem}, and the etcd endpoint {etcd!r} names no host to route to")
    where = f"etcd at {endpoint.host}:{endpoint.port}"
    etcd_addrs = net.resolve(endpoint.host)
    if not etcd_addrs:
        _refuse(f"{name_problem}, and {where} does not resolve")
    if _is_loopback(etcd_addrs[0]):
        return AdvertiseChoice(LOOPBACK, f"{name_problem}, and {where} is on loopback too: "
                                         "a single-machine job")
    source = net.route_source(etcd_addrs[0], endpoint.port)
    if source is None:
        _refuse(f"{name_problem}, and there is no route to {where} ({etcd_addrs[0]})")
    if _unusable(source):
        _refuse(f"{name_problem}, and the route to {where} leaves from {source}")
    return AdvertiseChoice(source, f"{name_problem}; {source} is this host's source address "
                                   f"on the route to {where}")


def socket_ifname_env(advertise_addr: str, environ: Mapping[str, str], *,
                      net: HostNetwork = SYSTEM_NETWORK) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` naming the interface that
    carries ``advertise_addr`` (``lo`` for loopback), less those already in
    ``environ``: the user's setting wins.

    When no interface carries the address, returns none of them and logs a
    warning naming the variables to set. Never raises.
    """
    wanted = [var for var in (GLOO_IFNAME, NCCL_IFNAME) if var not in environ]
    if not wanted:
        return {}
    addrs = net.resolve(advertise_addr)
    ifname = next((name for name in (_interface_carrying(a, net) for a in addrs) if name), None)
    if ifname is None:
        log.warning(
            "No network interface of this host carries the advertised address %s%s; the "
            "workers' gloo and NCCL will pick an interface from the host name, which may not "
            "reach the other nodes: set %s in elasticd's environment to the interface that does.",
            advertise_addr, f" ({', '.join(addrs)})" if addrs and addrs != [advertise_addr] else "",
            " and ".join(wanted))
        return {}
    log.info("Workers' gloo and NCCL will use network interface %s, which carries the "
             "advertised address %s.", ifname, advertise_addr)
    others = _other_interfaces(ifname, net)
    if NCCL_IFNAME in wanted and others:
        log.info("NCCL's sockets are kept to %s although this host also has %s: NCCL "
                 "bootstraps on the first interface of its list in the kernel's order, which "
                 "the peers may not reach; with InfiniBand/RoCE the data goes through "
                 "NCCL_IB_HCA's devices anyway. To spread NCCL's socket traffic over several "
                 "interfaces that all reach the peers, set %s in elasticd's environment, e.g. "
                 "%s=%s.", ifname, ", ".join(others), NCCL_IFNAME, NCCL_IFNAME,
                 "=" + ",".join([ifname, *others]))
    # NCCL matches its variable as a prefix ("eth0" would take "eth0.100" too);
    # a leading "=" asks for exactly the interfaces listed. Gloo matches exactly.
    values = {GLOO_IFNAME: ifname, NCCL_IFNAME: "=" + ifname}
    return {var: values[var] for var in wanted}


# Interfaces no peer reaches this host through: loopback, container bridges and
# their veth ends, tunnels of the host's own.
_NOT_FOR_PEERS = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali",
                  "tunl", "kube-ipvs")


def _other_interfaces(ifname: str, net: HostNetwork) -> list[str]:
    """This host's interfaces with an address, other than ``ifname``, that
    could carry traffic to the peers, in the kernel's order."""
    try:
        pairs = net.interfaces()
    except OSError:
        return []
    names: list[str] = []
    for name, addr in pairs:
        ip = _ip(addr)
        if name == ifname or name in names or name.startswith(_NOT_FOR_PEERS) \
                or ip is None or ip.is_loopback or ip.is_link_local:
            continue
        names.append(name)
    return names


def _interface_carrying(addr: str, net: HostNetwork) -> str | None:
    # 127.0.0.0/8 is all on lo, though lo's listed address is only 127.0.0.1.
    return LOOPBACK_INTERFACE if _is_loopback(addr) else net.interface_of(addr)


def _first_endpoint(etcd: str) -> HostPort | None:
    """The host and port of the first of the comma-separated endpoints, any
    scheme or none (port 2379 unless given); None when it names no host."""
    first = etcd.split(",", 1)[0].strip()
    if not first:
        return None
    rest = first.split("://", 1)[1] if "://" in first else first
    try:
        split = urllib.parse.urlsplit("//" + rest)
        host, port = split.hostname, split.port
    except ValueError:
        return None
    return HostPort(host, port or ETCD_DEFAULT_PORT) if host else None


def _refuse(problem: str) -> NoReturn:
    raise ConfigError(
        f"cannot tell which address the other nodes reach this node at: {problem}. Pass "
        "--advertise-addr (or ELASTIC_ADVERTISE_ADDR) with this node's address on the network "
        "the nodes share")


def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0])  # drop an IPv6 zone ("%eth0")
    except ValueError:
        return None


def _is_loopback(addr: str) -> bool:
    ip = _ip(addr)
    return ip is not None and ip.is_loopback


def _unusable(addr: str) -> bool:
    """Loopback or unspecified: no other host can reach this node there."""
    ip = _ip(addr)
    return ip is not None and (ip.is_loopback or ip.is_unspecified)
