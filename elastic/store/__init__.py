"""The store: the slice of etcd v3 the project uses, and how to open one.

``open_store("http://10.0.0.1:2379,10.0.0.2:2379")`` gives the etcd backend;
``open_store("https://...", security=EtcdSecurity(cacert=..., cert=..., key=...,
user=..., password=...))`` reaches it over TLS and as an etcd user. Other
schemes name backends registered with :func:`register_backend` (tests
register an in-memory one as ``memory://``). Importing this package is cheap:
the gRPC backend is imported only when a store is opened.
"""

from __future__ import annotations

import threading
from typing import Protocol

from elastic.errors import ConfigError
from elastic.store import api
from elastic.store.api import *  # noqa: F403 (the interface, named in api.__all__)
from elastic.store.api import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, Store
from elastic.store.security import PASSWORD_ENV, EtcdSecurity, security_from_options

__all__ = [
    *api.__all__,
    "EtcdSecurity",
    "PASSWORD_ENV",
    "StoreFactory",
    "open_store",
    "register_backend",
    "security_from_options",
]

_ETCD_SCHEMES = ("http", "https", "unix")


class StoreFactory(Protocol):
    """Opens a store for ``endpoints`` (the whole string, scheme included)."""

    def __call__(
        self, endpoints: str, *, connect_timeout_s: float, request_timeout_s: float
    ) -> Store: ...


_backends: dict[str, StoreFactory] = {}
_backends_lock = threading.Lock()


def register_backend(scheme: str, factory: StoreFactory) -> None:
    """Make ``open_store("<scheme>://...")`` call ``factory``; replaces an
    earlier registration of the same scheme.

    Raises:
        ValueError: the scheme is empty or is one of etcd's (http, https, unix).
    """
    scheme = scheme.lower()
    if not scheme or scheme in _ETCD_SCHEMES:
        raise ValueError(f"cannot register a store backend for scheme {scheme!r}")
    with _backends_lock:
        _backends[scheme] = factory


def open_store(
    endpoints: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    security: EtcdSecurity | None = None,
) -> Store:
    """Open the store at ``endpoints``.

    ``http://`` and ``https://`` URLs, bare ``host:port`` lists (comma
    separated) and one ``unix:///path`` (an etcd's Unix socket) open etcd, with
    ``security`` (TLS files, user and password; see :class:`EtcdSecurity`);
    another ``scheme://`` opens the backend registered for it.

    Raises:
        ConfigError: an unknown scheme, endpoints the backend rejects, bad
            TLS files, or ``security`` given for a backend that is not etcd.
        StoreAuthError: etcd refused our certificate or user, or we refused its
            certificate.
        StoreUnavailableError: the store cannot be reached in time.
    """
    first = endpoints.split(",", 1)[0].strip()
    scheme = first.split("://", 1)[0].lower() if "://" in first else ""
    if scheme in ("",) + _ETCD_SCHEMES:
        from elastic.store.etcd import EtcdStore

        return EtcdStore(
            endpoints, connect_timeout_s=connect_timeout_s, request_timeout_s=request_timeout_s,
            security=security,
        )
    with _backends_lock:
        factory = _backends.get(scheme)
    if factory is None:
        known = ", ".join(sorted(set(_ETCD_SCHEMES) | set(_backends)))
        raise ConfigError(
            f"unknown store scheme {scheme!r} in {endpoints!r} (known: {known})"
        )
    if security is not None and security != EtcdSecurity():
        raise ConfigError(f"etcd TLS and user options do not apply to {endpoints!r}")
    return factory(
        endpoints, connect_timeout_s=connect_timeout_s, request_timeout_s=request_timeout_s
    )
