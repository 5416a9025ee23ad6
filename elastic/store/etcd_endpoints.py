"""etcd endpoints: parsing what the user wrote, and the gRPC target to dial.

Part of the etcd backend (:mod:`elastic.store.etcd`); :func:`parse_endpoints`
is re-exported there.
"""

from __future__ import annotations

import logging
import re
import socket
import urllib.parse
from typing import Sequence

from elastic.errors import ConfigError, StoreUnavailableError
from elastic.hostport import HostPort

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a DNS name or IPv4 address; IPv6 goes in [...]


def parse_endpoints(endpoints: str | Sequence[str]) -> list[HostPort]:
    """``"http://a:2379,b"`` or a list of such -> ``[HostPort("a", 2379), HostPort("b", 2379)]``.

    Raises:
        ConfigError: as :func:`parse_endpoint_urls`.
    """
    return parse_endpoint_urls(endpoints)[1]


def parse_endpoint_urls(
    endpoints: str | Sequence[str],
) -> tuple[str | None, list[HostPort]]:
    """The scheme the endpoints share (``"http"``, ``"https"``, or None when
    every one is a bare ``host[:port]``) and their hosts and ports. A bare
    endpoint beside ``https://`` ones is reached over TLS too.

    Raises:
        ConfigError: no endpoint, a scheme other than http:// and https://,
            http:// and https:// mixed, or something that is not ``host[:port]``.
    """
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    parts = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"no etcd endpoint given (got {endpoints!r})")
    parsed = [_parse_endpoint(p) for p in parts]
    schemes = sorted({scheme for scheme, _ in parsed if scheme is not None})
    if len(schemes) > 1:
        raise ConfigError(f"etcd endpoints {','.join(parts)!r} mix http:// and https://; "
                          "give every endpoint of the cluster the same scheme")
    return (schemes[0] if schemes else None), [hp for _, hp in parsed]


def _parse_endpoint(text: str) -> tuple[str | None, HostPort]:
    """``[scheme://]host[:port]``: the scheme (None without one) and where it
    points. A URL, so urlsplit reads it: ``host`` alone (port DEFAULT_PORT) and
    a bracketed IPv6 host without a port are endpoints too, unlike HOST:PORT."""
    rest = text
    scheme = None
    if "://" in text:
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigError(f"bad etcd endpoint {text!r}: the scheme must be http:// or "
                              "https://")
    try:
        split = urllib.parse.urlsplit("//" + rest.rstrip("/"))
        host, port = split.hostname, split.port
    except ValueError as exc:
        raise ConfigError(f"bad etcd endpoint {text!r}: {exc}") from exc
    name_ok = bool(_HOST_NAME.fullmatch(host or "")) or (":" in (host or "") and "[" in rest)
    if not name_ok or split.path or split.query or split.fragment or split.username or port == 0:
        raise ConfigError(f"bad etcd endpoint {text!r}: expected [http[s]://]host[:port]")
    return scheme, HostPort(host, port if port is not None else DEFAULT_PORT)


def unix_socket_path(endpoints: str | Sequence[str]) -> str | None:
    """The socket's absolute path when ``endpoints`` is one ``unix://PATH``
    endpoint (the standalone etcd's private socket, see
    :class:`elastic.store.server.EtcdServer`); None when no endpoint is one.

    Raises:
        ConfigError: a ``unix://`` endpoint beside others, or with a path
            that is not absolute.
    """
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    parts = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    unix = [p for p in parts if p.lower().startswith("unix://")]
    if not unix:
        return None
    if len(parts) > 1:
        raise ConfigError(f"etcd endpoints {','.join(parts)!r}: a unix:// endpoint is one "
                          "etcd on this host; give it alone")
    path = unix[0][len("unix://"):]
    if not path.startswith("/") or "\0" in path:
        raise ConfigError(f"bad etcd endpoint {unix[0]!r}: expected unix:///absolute/path")
    return path


def grpc_target(hostports: list[HostPort]) -> str:
    """One endpoint: gRPC's DNS resolver (re-resolved on reconnect). Several:
    their addresses, resolved now, for gRPC's pick_first to fail over between.

    Raises:
        StoreUnavailableError: one of several endpoints does not resolve.
    """
    if len(hostports) == 1:
        return str(hostports[0])
    v4: list[str] = []
    v6: list[str] = []
    for endpoint in hostports:
        try:
            infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise StoreUnavailableError(
                f"cannot resolve etcd endpoint {endpoint}: {exc.strerror}"
            ) from exc
        for family, _, _, _, addr in infos:
            resolved = str(HostPort(addr[0], endpoint.port))
            if family == socket.AF_INET and resolved not in v4:
                v4.append(resolved)
            elif family == socket.AF_INET6 and resolved not in v6:
                v6.append(resolved)
    # A gRPC address list is of one family; IPv4 is what etcd clusters use.
    if v4:
        if v6:
            logger.info("Using the IPv4 addresses of the etcd endpoints; ignoring %s.", v6)
        return "ipv4:" + ",".join(v4)
    return "ipv6:" + ",".join(v6)
