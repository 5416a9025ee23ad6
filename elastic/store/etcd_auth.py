"""The gRPC side of etcd security: channel credentials, the auth token, and
what etcd's refusals mean in words an operator can act on.

Part of the etcd backend (:mod:`elastic.store.etcd`); the settings themselves
are :class:`elastic.store.security.EtcdSecurity`.

Tokens. With a user, the store calls ``Auth.Authenticate`` once when it
opens and sends the token as the ``token`` metadata of every call and of
every stream it opens. etcd's tokens expire: a simple token after
``--auth-token-ttl`` (300 s by default) without use, a JWT at its expiry, and
every simple token when etcd restarts. etcd then answers ``invalid auth
token`` (or ``revision of auth store is old`` after a change of users or
roles), before the request is applied, so repeating the request is safe
even for a transaction: the store re-authenticates once and repeats the
call. Streams carry the token they were opened with; a watch whose creation
etcd refuses for that reason, or a keep-alive stream that fails with it, is
reopened with a fresh token. Concurrent callers that fail with the same
token share one re-authentication.

The password and the token are never logged nor put in an error message.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from elastic.errors import StoreAuthError, StoreError
from elastic.keyspace import ROOT as JOBS_ROOT
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.security import EtcdSecurity

logger = logging.getLogger(__name__)

# What etcd says (in the details of an error, or as a watch's cancel reason)
# when the token is missing, expired or from before a change of the auth store.
_TOKEN_TEXTS = ("invalid auth token", "revision of auth store is old", "user name is empty")
_PERMISSION_TEXT = "permission denied"
# What gRPC's details hold when the server refused our client certificate.
_CLIENT_CERT_REFUSED = (
    "CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "HANDSHAKE_FAILURE",
    "CERTIFICATE_UNKNOWN", "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED", "DECRYPT_ERROR",
    "TSI_DATA_CORRUPTED", "UNWRAP FAILED",
)


def channel_credentials(security: EtcdSecurity) -> grpc.ChannelCredentials:
    """TLS credentials for a channel to etcd: the CA bundle (None: the
    system's roots) and the client certificate and key, if given.

    Raises:
        ConfigError: a file cannot be read or is not PEM.
    """
    root, key, chain = security.read_tls_files()
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                        certificate_chain=chain)


def is_token_error(exc: grpc.RpcError) -> bool:
    """Whether a failed call was refused for its token (missing or stale): a
    fresh token may make it pass."""
    code = exc.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    details = (exc.details() or "").lower()
    return code == grpc.StatusCode.INVALID_ARGUMENT and any(t in details for t in _TOKEN_TEXTS)


def is_auth_cancel(reason: str) -> bool:
    """Whether etcd refused to create a watch for its token or a permission.
    etcd 3.5.1 answers "permission denied" for an expired token too, so one
    retry with a fresh token tells the two apart."""
    reason = reason.lower()
    return _PERMISSION_TEXT in reason or any(t in reason for t in _TOKEN_TEXTS)


def key_text(key: bytes | str) -> str:
    return key if isinstance(key, str) else key.decode("utf-8", "replace")


def request_key(request) -> str | None:
    """The key a request touches first (for messages), or None."""
    key = getattr(request, "key", None)
    if key:
        return key_text(key)
    if isinstance(request, rpc_pb2.TxnRequest):
        for cmp in request.compare:
            return key_text(cmp.key)
        for op in list(request.success) + list(request.failure):
            which = op.WhichOneof("request")
            inner = getattr(op, which) if which else None
            if inner is not None and getattr(inner, "key", None):
                return key_text(inner.key)
    return None


def _who(security: EtcdSecurity) -> str:
    if security.user:
        return f"user {security.user}"
    if security.cert:
        return (f"the etcd user named by the common name (CN) of {security.cert} "
                "(no --etcd-user given)")
    return "this client (no --etcd-user, no client certificate)"


def permission_error(where: str, what: str, key: str | None,
                     security: EtcdSecurity) -> StoreAuthError:
    """The one-line error for etcd's "permission denied" on ``what`` of ``key``."""
    on = f" of {key!r}" if key else ""
    if key and key.startswith(JOBS_ROOT):
        job = key[len(JOBS_ROOT):].split("/", 1)[0]
        scope = f"prefix {JOBS_ROOT}{job}/"
    elif key:
        scope = f"key {key!r}"
    else:
        scope = "the keys it touches"
    return StoreAuthError(f"permission denied for {what}{on} at etcd {where}: the role of "
                          f"{_who(security)} must grant readwrite on {scope}")


def auth_required_error(where: str) -> StoreAuthError:
    return StoreAuthError(
        f"etcd at {where} requires authentication: pass --etcd-user (its password in "
        "ELASTIC_ETCD_PASSWORD or --etcd-password-file), or a client certificate "
        "(--etcd-cert, --etcd-key) whose common name is an etcd user")


def explain_connect_failure(details: str, *, where: str, tls: bool,
                            security: EtcdSecurity) -> str | None:
    """What a failure to connect means, when gRPC's details say (a TLS
    handshake refused on either side, TLS against plain text); None when
    they do not (etcd down, a wrong address: waiting may still help)."""
    text = details.upper()
    if not tls:
        if "HTTP1" in text or "HTTP/1" in text:
            return (f"etcd at {where} answered like an HTTPS server: it serves TLS, use "
                    "https:// endpoints (with --etcd-cacert, and --etcd-cert and --etcd-key "
                    "if it wants client certificates)")
        return None
    if "WRONG_VERSION_NUMBER" in text or "PACKET_LENGTH_TOO_LONG" in text:
        return f"etcd at {where} does not speak TLS: use http:// endpoints"
    if ("CERTIFICATE_VERIFY_FAILED" in text or "UNABLE TO GET LOCAL ISSUER" in text
            or "SELF SIGNED" in text or "SELF-SIGNED" in text):
        if security.cacert:
            return (f"the server's certificate at {where} is not signed by the CA in "
                    f"{security.cacert} (--etcd-cacert)")
        return (f"the server's certificate at {where} is not signed by a CA among the "
                "system's roots: pass the CA that signs it with --etcd-cacert")
    if "HOSTNAME VERIFICATION" in text or "NOT IN PEER CERTIFICATE" in text:
        return (f"the server's certificate at {where} is not valid for the host name of "
                "the endpoint: use a name or address it lists (its subject alternative names)")
    # etcd refused our certificate (or its absence). Under TLS 1.3 it says so
    # after the handshake, in an alert the client cannot read any more: gRPC
    # reports only "Unwrap failed (TSI_DATA_CORRUPTED)" (the alert's name goes
    # to gRPC's own log).
    if any(a in text for a in _CLIENT_CERT_REFUSED):
        if security.cert is None:
            return (f"etcd at {where} requires a client certificate: pass --etcd-cert and "
                    "--etcd-key")
        return (f"etcd at {where} refused the client certificate {security.cert} "
                "(--etcd-cert): it is not signed by a CA etcd trusts (its --trusted-ca-file), "
                "has expired, or is not meant for client authentication")
    return None


class TokenAuth:
    """The token of one etcd user, for one store.

    ``translate(exc, what)`` turns a gRPC error other than a refusal of the
    user into a store error (the store's own translation).
    """

    def __init__(self, channel: grpc.Channel, security: EtcdSecurity, where: str,
                 translate: Callable[[grpc.RpcError, str, float], StoreError]):
        assert security.user is not None and security.password is not None
        self._stub = rpc_pb2_grpc.AuthStub(channel)
        self._user = security.user
        self._password = security.password
        self._where = where
        self._translate = translate
        self._lock = threading.Lock()
        self._token: str | None = None
        self._warned_disabled = False

    def __repr__(self) -> str:
        return f"TokenAuth(user={self._user!r}, etcd={self._where})"

    @property
    def user(self) -> str:
        return self._user

    @property
    def token(self) -> str | None:
        """The current token (None while etcd has authentication off)."""
        return self._token

    @staticmethod
    def metadata_for(token: str | None) -> tuple[tuple[str, str], ...] | None:
        return (("token", token),) if token else None

    def authenticate(self, timeout_s: float) -> None:
        """Get a fresh token.

        Raises:
            StoreAuthError: etcd refused the user and password.
            StoreUnavailableError, StoreTimeoutError, StoreError: as any call.
        """
        with self._lock:
            self._authenticate_locked(timeout_s)

    def refresh(self, failed_token: str | None, timeout_s: float) -> None:
        """Re-authenticate after ``failed_token`` was refused, unless another
        caller already replaced it. Raises as :meth:`authenticate`."""
        with self._lock:
            if self._token != failed_token:
                return
            logger.info("etcd at %s refused the token of user %s (expired, or etcd "
                        "restarted); authenticating again.", self._where, self._user)
            self._authenticate_locked(timeout_s)

    def _authenticate_locked(self, timeout_s: float) -> None:
        request = rpc_pb2.AuthenticateRequest(name=self._user, password=self._password)
        try:
            resp = self._stub.Authenticate(request, timeout=max(timeout_s, 0.001))
        except grpc.RpcError as exc:
            details = (exc.details() or "").lower()
            if "authentication is not enabled" in details:
                self._token = None
                if not self._warned_disabled:
                    self._warned_disabled = True
                    logger.warning("etcd at %s has authentication turned off; going on "
                                   "without a token for user %s.", self._where, self._user)
                return
            if "authentication failed" in details:
                # The cause would carry nothing more; leave the chain empty.
                raise StoreAuthError(f"etcd at {self._where} refused user {self._user}: "
                                     "authentication failed (wrong password, or no such "
                                     "user)") from None
            raise self._translate(exc, f"authentication of user {self._user}",
                                  timeout_s) from exc
        self._token = resp.token or None
