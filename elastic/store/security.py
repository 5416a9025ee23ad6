"""How the store proves who it is to etcd, and how it checks etcd: one frozen value.

:class:`EtcdSecurity` carries what etcdctl's ``--cacert``, ``--cert``,
``--key`` and ``--user`` carry, plus the user's password. It is built from the
command line by :func:`security_from_options` (elasticd and elasticctl share
it) and handed to :func:`elastic.store.open_store`. This module imports
nothing heavy: the gRPC side of it lives in :mod:`.etcd_auth`.

The password is never a flag value (a flag shows in ``ps`` and in shell
history): it comes from the environment variable ``ELASTIC_ETCD_PASSWORD`` or
from a file (``--etcd-password-file``). It is left out of ``repr`` and of
every message and log line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from elastic.errors import ConfigError
from elastic.pemfiles import read_pem, read_small_file

PASSWORD_ENV = "ELASTIC_ETCD_PASSWORD"


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS material and credentials for etcd; every field optional.

    ``cacert``: PEM bundle of the CAs that sign etcd's server certificates
    (without it, an ``https://`` endpoint is checked against the system's
    roots). ``cert`` and ``key``: PEM client certificate and its private key,
    given together. ``user`` and ``password``: an etcd user, given together;
    the store authenticates as it and sends its token on every call.

    Raises (constructor):
        ConfigError: a certificate without its key or the other way round,
            a user without a password, a password without a user, an empty
            or multi-line user name.
    """

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, missing = ("--etcd-cert", "--etcd-key") if self.key is None else (
                "--etcd-key", "--etcd-cert")
            raise ConfigError(f"{given} without {missing}: a client certificate for etcd "
                              "needs both --etcd-cert and --etcd-key")
        if self.user is not None and (not self.user or self.user != self.user.strip()
                                      or "\n" in self.user):
            raise ConfigError(f"--etcd-user {self.user!r}: expected an etcd user name")
        if self.user is not None and self.password is None:
            raise ConfigError(f"--etcd-user {self.user} needs a password: set {PASSWORD_ENV} "
                              "or pass --etcd-password-file")
        if self.password is not None and self.user is None:
            raise ConfigError(f"an etcd password is given ({PASSWORD_ENV} or "
                              "--etcd-password-file) but no --etcd-user")

    @property
    def has_tls_files(self) -> bool:
        """Whether a CA bundle or a client certificate is given (so TLS is meant)."""
        return self.cacert is not None or self.cert is not None

    def describe(self) -> str:
        """What is used, for a log line: never the password."""
        parts = [f"CA {self.cacert}" if self.cacert else "the system's CA roots"]
        if self.cert:
            parts.append(f"client certificate {self.cert}")
        if self.user:
            parts.append(f"user {self.user}")
        return ", ".join(parts)

    def read_tls_files(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(CA bundle, client key, client certificate chain) as PEM bytes, None
        where not given: the arguments of ``grpc.ssl_channel_credentials``.

        Raises:
            ConfigError: a file cannot be read or is not PEM; the message
                names the file and its flag.
        """
        return (read_pem(self.cacert, "--etcd-cacert", "etcd CA bundle"),
                read_pem(self.key, "--etcd-key", "etcd client key"),
                read_pem(self.cert, "--etcd-cert", "etcd client certificate"))


def read_password_file(path: str) -> str:
    """The password in ``path``: its text without the line break(s) that end it.

    Raises:
        ConfigError: unreadable, not UTF-8, or empty; the message names the
            file, never its content.
    """
    data = read_small_file(path, "--etcd-password-file", "etcd password file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"the etcd password file {path} (--etcd-password-file) is not "
                          "UTF-8 text") from None
    password = text.rstrip("\r\n")
    if not password:
        raise ConfigError(f"the etcd password file {path} (--etcd-password-file) is empty")
    return password


def security_from_options(
    *,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    user: str | None = None,
    password_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> EtcdSecurity:
    """The :class:`EtcdSecurity` for what the user gave: file paths as given
    (made absolute), the password from ``password_file`` or from
    ``ELASTIC_ETCD_PASSWORD`` in ``environ`` (``os.environ`` by default).

    Raises:
        ConfigError: both a password file and the variable, a file that cannot
            be read, or what :class:`EtcdSecurity` refuses.
    """
    environ = os.environ if environ is None else environ
    env_password = environ.get(PASSWORD_ENV)
    if password_file is not None and env_password is not None:
        raise ConfigError(f"the etcd password is given twice: {PASSWORD_ENV} and "
                          "--etcd-password-file; give one")
    if password_file is not None:
        password: str | None = read_password_file(password_file)
    elif env_password is not None:
        if not env_password:
            raise ConfigError(f"{PASSWORD_ENV} is set but empty")
        password = env_password
    else:
        password = None
    absolute = (lambda p: os.path.abspath(p) if p else None)
    security = EtcdSecurity(cacert=absolute(cacert), cert=absolute(cert), key=absolute(key),
                            user=user or None, password=password)
    security.read_tls_files()  # fail at start, naming the file and its flag
    return security
