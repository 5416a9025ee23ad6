"""Mutual TLS on the agents' gRPC endpoint: one frozen value, shared by elasticd and elasticctl.

:class:`AgentTLS` carries ``--tls-cert``, ``--tls-key``, ``--tls-ca`` and
``--tls-server-name``. elasticd serves with it (a client must present a
certificate signed by ``--tls-ca``) and calls its peers with it (presenting its
own certificate, checking theirs against ``--tls-ca``); elasticctl calls the
agents with it. Build it with :func:`agent_tls_from_options`, which reads the
files once so that a missing or unreadable one fails at start, naming it.

Why the TLS endpoint requires a client certificate on every connection, and
the probes get an endpoint of their own: gRPC's Python API offers a TLS server
either *requiring* a verified client certificate or *not asking for one at
all* (``require_client_auth=False`` never requests it, so the server could not
tell an authorised client from anyone). Control (Drain, RequestRestart, the
fencing signal of StoreHealth) must see a verified certificate, so the TLS
endpoint requires one; and Kubernetes' gRPC probes speak no TLS at all. The
read-only endpoint ``--probe-listen`` (plain text: health, Status, StoreHealth
without its fencing signal; control refused with PERMISSION_DENIED) serves
them. See :mod:`agent.grpc_server`.

Peers are called at the address they advertise (an IP, usually). The
certificate an agent serves must then name that address (an IP subject
alternative name), or every agent's certificate carries one shared name and
all of them, and elasticctl, pass it as ``--tls-server-name`` (checked instead
of the address: practical where pod IPs are not known when certificates are
issued).

Authorised for control = holds a certificate signed by ``--tls-ca``: use a CA
that signs only this job's agents and its operators. The files are read once
(at start); a renewed certificate takes effect when the agent restarts. This
module imports grpc only when credentials are built.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic.errors import ConfigError
from elastic.pemfiles import read_pem

if TYPE_CHECKING:  # grpc is imported where credentials are built, not with the config
    import grpc

ENV = {"cert": "ELASTIC_TLS_CERT", "key": "ELASTIC_TLS_KEY", "ca": "ELASTIC_TLS_CA",
       "server_name": "ELASTIC_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class AgentTLS:
    """TLS files for the agents' gRPC endpoint (absolute paths), and the name to check.

    ``cert`` and ``key``: this side's PEM certificate (chain) and private key,
    given together. ``ca``: PEM bundle of the CAs that sign the agents' and the
    operators' certificates (without it a client checks agents against the
    system's roots). ``server_name``: the name checked in an agent's
    certificate instead of the host part of its address. ``allowed_cns``
    (elasticd's ``--tls-allowed-cn``): the common names (CN) of the client
    certificates that may drain or restart; empty: any certificate ``ca``
    signed.

    Raises (constructor):
        ConfigError: a certificate without its key or the other way round, no
            file at all, or a malformed server name.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None
    allowed_cns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, missing = ("--tls-cert", "--tls-key") if self.key is None else (
                "--tls-key", "--tls-cert")
            raise ConfigError(f"{given} without {missing}: a certificate needs both --tls-cert "
                              "and --tls-key")
        if self.cert is None and self.ca is None:
            raise ConfigError("--tls-server-name needs --tls-ca (or --tls-cert and --tls-key)"
                              if self.server_name is not None else
                              "AgentTLS without a file: give --tls-ca, --tls-cert, --tls-key")
        if self.server_name is not None and (not self.server_name or any(
                c.isspace() for c in self.server_name) or len(self.server_name) > 253):
            raise ConfigError(f"--tls-server-name {self.server_name!r}: expected a host name")
        for cn in self.allowed_cns:
            if not cn or cn != cn.strip() or not cn.isprintable() or len(cn) > 64:
                raise ConfigError(f"--tls-allowed-cn {cn!r}: expected a certificate's common "
                                  "name (printable, at most 64 characters)")

    @property
    def can_serve(self) -> bool:
        """Whether this is enough for elasticd: certificate, key and CA."""
        return None not in (self.cert, self.key, self.ca)

    def describe(self) -> str:
        """What is used, for a log line."""
        parts = [f"CA {self.ca}" if self.ca else "the system's CA roots"]
        if self.cert:
            parts.append(f"certificate {self.cert}")
        if self.server_name:
            parts.append(f"server name {self.server_name}")
        if self.allowed_cns:
            parts.append(f"control for CN {', '.join(self.allowed_cns)} only")
        return ", ".join(parts)

    def read_files(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(CA bundle, private key, certificate chain) as PEM bytes, None where
        not given. Raises ConfigError naming the option and the file."""
        return (read_pem(self.ca, "--tls-ca", "TLS CA bundle"),
                read_pem(self.key, "--tls-key", "TLS private key"),
                read_pem(self.cert, "--tls-cert", "TLS certificate"))

    def server_credentials(self) -> "grpc.ServerCredentials":
        """Credentials of a server that takes only clients whose certificate
        ``ca`` signed. Raises ConfigError (files, or not :attr:`can_serve`)."""
        import grpc

        if not self.can_serve:
            raise ConfigError("serving mutual TLS needs --tls-cert, --tls-key and --tls-ca")
        ca, key, cert = self.read_files()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> "grpc.ChannelCredentials":
        """Credentials of a client that checks agents against ``ca`` and
        presents ``cert`` when given. Read once per value. Raises ConfigError."""
        return _channel_credentials(self)

    def channel_options(self) -> list[tuple[str, Any]]:
        """gRPC channel options: the name to check, when ``server_name`` is set."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


@functools.lru_cache(maxsize=8)
def _channel_credentials(tls: AgentTLS) -> "grpc.ChannelCredentials":
    import grpc

    ca, key, cert = tls.read_files()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def agent_tls_from_options(*, cert: str | None = None, key: str | None = None,
                           ca: str | None = None, server_name: str | None = None,
                           serving: bool = False, allowed_cns: tuple[str, ...] = ()
                           ) -> AgentTLS | None:
    """The :class:`AgentTLS` for what the user gave (paths made absolute, files
    read once to fail now), or None when nothing was given (plain text).

    ``serving`` (elasticd): certificate, key and CA are needed together.

    Raises:
        ConfigError: what :class:`AgentTLS` refuses, a file that cannot be
            read or is not PEM, (``serving``) a missing file of the three, or
            ``allowed_cns`` without them.
    """
    if cert is None and key is None and ca is None and server_name is None:
        if allowed_cns:
            raise ConfigError("--tls-allowed-cn needs mutual TLS: give --tls-cert, --tls-key "
                              "and --tls-ca too")
        return None
    absolute = (lambda p: os.path.abspath(p) if p else None)
    tls = AgentTLS(cert=absolute(cert), key=absolute(key), ca=absolute(ca),
                   server_name=server_name or None, allowed_cns=tuple(allowed_cns))
    if serving and not tls.can_serve:
        missing = [flag for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key),
                                           ("--tls-ca", tls.ca)) if path is None]
        raise ConfigError(f"elasticd's mutual TLS needs --tls-cert, --tls-key and --tls-ca "
                          f"together; missing {', '.join(missing)}")
    tls.read_files()  # fail at start, naming the file and its flag
    return tls


def verified_client(context: "grpc.ServicerContext") -> str | None:
    """Who the client of this call is, when the TLS handshake verified its
    certificate (the name in it, else its subject); None on a connection
    without a verified client certificate (plain text, or TLS without one)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"] or not auth.get("x509_pem_cert"):
        return None
    names = context.peer_identities() or auth.get("x509_subject") or [b"a certificate"]
    return b",".join(names).decode("utf-8", errors="replace")


def verified_common_name(context: "grpc.ServicerContext") -> str | None:
    """The common name (CN) in the client certificate the TLS handshake
    verified; None without one (no verified certificate, or no CN in it)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"] or not auth.get("x509_pem_cert"):
        return None
    names = auth.get("x509_common_name") or []
    return names[0].decode("utf-8", errors="replace") if names else None


def handshake_problem(details: str, tls: AgentTLS | None) -> str | None:
    """What a failed connection's gRPC details say about TLS, in an operator's
    words with what to change; None when they say nothing about TLS (the
    agent is down, or slow)."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return ("the TLS handshake failed: the agent's certificate is not signed by a CA in "
                "--tls-ca (unknown CA)")
    if "Hostname Verification" in details or "Peer name" in details:
        name = f"--tls-server-name {tls.server_name}" if tls and tls.server_name else (
            "the address it was called at")
        return (f"the TLS handshake failed: the agent's certificate does not name {name}; "
                "give it that address as a subject alternative name, or pass the name all "
                "agents' certificates carry as --tls-server-name")
    if "WRONG_VERSION_NUMBER" in details:
        return ("the TLS handshake failed: the agent does not serve TLS (started without "
                "--tls-cert)")
    # A connection the agent closed before any call: a refused handshake (not
    # an established connection that broke, which says no "failed to connect").
    refused = "Socket closed" in details and "failed to connect" in details
    if refused and tls is not None:
        return ("the agent closed the connection in the TLS handshake: it takes only clients "
                "with a certificate signed by its --tls-ca, and this one presented "
                + ("another CA's (unknown CA)" if tls.cert else
                   "none (pass --tls-cert and --tls-key)"))
    if refused:
        return ("the agent closed the connection at once: if the agents run with TLS, pass "
                "--tls-ca, --tls-cert and --tls-key")
    return None


def etcd_bypass_warning(tls: AgentTLS | None, etcd: str | None, *, etcd_tls_client: bool,
                        etcd_user: bool) -> str | None:
    """The warning for an agent whose control is behind mutual TLS while its
    etcd is open: plain ``http://`` without a user or a client certificate.
    Control also travels through etcd (``requests/drain/<node>``, restart
    requests, the round), so whoever reaches such an etcd drains nodes and
    restarts the job without any certificate. None when there is nothing to
    say: no TLS on ``--listen`` (already warned about), an etcd over https
    with a client certificate or a user, or an ``unix://`` one (the
    standalone etcd's private socket). One line."""
    if tls is None or not etcd or etcd_user or etcd_tls_client:
        return None
    endpoints = [e.strip() for e in etcd.split(",") if e.strip()]
    open_ones = [e for e in endpoints if not e.startswith(("unix://", "unixs://"))]
    if not open_ones:
        return None
    plain = all(e.startswith("http://") or "://" not in e for e in open_ones)
    how = "plain text without authentication" if plain else "without authentication"
    return (f"Control on --listen takes mutual TLS, but etcd at {', '.join(open_ones)} is "
            f"{how}: anyone who reaches it can drain this node or restart the job by writing "
            "its requests/ keys, with no certificate. Give etcd a user whose role holds only "
            "/elastic/v1/<job>/ (--etcd-user with --etcd-password-file), or client "
            "certificates (https:// with --etcd-cert and --etcd-key, etcd's "
            "--client-cert-auth).")
