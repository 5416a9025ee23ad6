"""HOST:PORT: the one way a TCP address is read and written here.

A host is a DNS name, an IPv4 address or an IPv6 address (with a ``%zone``
where it has one). Written with its port, an IPv6 address is in brackets
(``[fe80::1]:29401``); it is read with or without them, since the port is
what follows the last colon. A port is a whole number 0-65535 of at most five
digits; 0 asks for a free one where an address is bound.

This module checks only the shape; whether a host is acceptable in a record
(:func:`elastic.records.valid_host`) or reachable is for the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PORT = 65535


def is_port(text: str) -> bool:
    """Whether ``text`` is a port as written: 1 to 5 ASCII digits, at most MAX_PORT."""
    return text.isascii() and text.isdigit() and len(text) <= 5 and int(text) <= MAX_PORT


@dataclass(frozen=True)
class HostPort:
    """A host and a port. ``host`` is kept without brackets ("" where only the
    port was given, see :meth:`parse`); ``str()`` writes ``HOST:PORT`` with an
    IPv6 host in brackets. Raises ValueError for a port outside 0-MAX_PORT."""

    host: str
    port: int

    def __post_init__(self) -> None:
        if self.host.startswith("[") and self.host.endswith("]"):
            object.__setattr__(self, "host", self.host[1:-1])
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port {self.port} is not in 0-{MAX_PORT}")

    @classmethod
    def parse(cls, text: str, *, host_optional: bool = False) -> "HostPort":
        """``HOST:PORT`` (or ``[IPV6]:PORT``) as a HostPort; with
        ``host_optional``, also ``:PORT`` (host ""), which callers fill in.

        Raises ValueError, saying what is missing, when ``text`` has no colon,
        its port is not a number 0-MAX_PORT, or (unless ``host_optional``) its
        host is empty.
        """
        host, sep, port = str(text).rpartition(":")
        if not sep or not is_port(port):
            raise ValueError(f"{text!r} is not HOST:PORT: expected a port 0-{MAX_PORT} "
                             "after the last colon")
        if not host and not host_optional:
            raise ValueError(f"{text!r} is not HOST:PORT: no host before the port")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
