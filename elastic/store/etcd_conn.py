"""One store's connection to etcd: the channels, the auth token, error
translation and the unary call with its deadline and retries.

Part of the etcd backend (:mod:`elastic.store.etcd`). The store's KV calls,
its keep-alive loop (:mod:`.etcd_lease`) and its watch mux
(:mod:`.etcd_watch`) each depend on one :class:`EtcdConnection` and on nothing
else of the backend, so the modules form a line: connection, then leases and
watches, then the store.

The token rules, written once here:

* A call refused for its token (:meth:`EtcdConnection.token_refused`) may
  pass with a fresh one: etcd checks the token before it applies anything, so
  repeating the call is safe even for a transaction.
* :meth:`EtcdConnection.call` renews the token once and repeats a unary call
  that etcd refused for its token, retry or not (:func:`call_with_token`).
* Streams carry the token they were opened with; their owners renew it with
  :meth:`EtcdConnection.refresh_token` and open the next stream with the
  fresh one. Concurrent callers that fail with the same token share one
  re-authentication.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence, TypeVar

import grpc
import grpc.aio

from elastic.errors import (
    ConfigError,
    StoreAuthError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastic.hostport import HostPort
from elastic.store.api import OpCounter
from elastic.store.etcd_auth import (
    TokenAuth,
    auth_required_error,
    channel_credentials,
    explain_connect_failure,
    is_token_error,
    permission_error,
    request_key,
)
from elastic.store.etcd_convert import rpc_error_text
from elastic.store.etcd_endpoints import grpc_target, parse_endpoint_urls, unix_socket_path
from elastic.store.etcd_stream import EtcdStreams
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.retry import call_with_retry
from elastic.store.security import EtcdSecurity

logger = logging.getLogger(__name__)

T = TypeVar("T")

_CHANNEL_OPTIONS = (
    # Pings find a dead peer under an idle watch stream. etcd refuses pings
    # more often than every 5 s (--grpc-keepalive-min-time) and pings on a
    # connection without calls, so stay above the one and never do the other.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default reconnect backoff grows to 120 s; after an etcd restart
    # we want the channel back within a second.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.max_receive_message_length", -1),
    # Each store gets its own connection, as separate agents would.
    ("grpc.use_local_subchannel_pool", 1),
    # A stray http_proxy in a training environment must not reroute etcd traffic.
    ("grpc.enable_http_proxy", 0),
)
# The streams' channel: with gRPC's flow-control probing (BDP pings) each
# keep-alive (one every TTL/3) is followed by a ping and its answer, and each
# exchange restarts the backoff of gRPC's idle worker threads (15 ms, growing
# 1.3x), the largest part of an idle agent's CPU: without the probes they
# wake a third less. The probes are what grows a stream's window, so it is
# set large instead: a round record fanned out to a process's many watchers
# (bench/watch_fanout.py) is as fast as with them, not half as fast again.
# Unary calls, on the other channel, keep the probes.
_STREAM_CHANNEL_OPTIONS = (("grpc.http2.bdp_probe", 0),
                           ("grpc.http2.lookahead_bytes", 8 << 20))


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


def call_with_token(
    attempt: Callable[[str | None], T],
    *,
    current_token: Callable[[], str | None],
    token_refused: Callable[[grpc.RpcError], bool],
    refresh: Callable[[str | None], None],
) -> T:
    """``attempt(token)`` with the current token; when etcd refuses that token
    (``token_refused``), ``refresh(token)`` and one more attempt with the
    fresh one. etcd checks the token before it applies anything, so the
    second attempt is safe for any call.

    Raises:
        grpc.RpcError: what the last attempt raised (a second refusal too).
        What ``refresh`` raises.
    """
    token = current_token()
    try:
        return attempt(token)
    except grpc.RpcError as exc:
        if not token_refused(exc):
            raise
    refresh(token)
    return attempt(current_token())


class EtcdConnection:
    """The channels to one etcd cluster, as one user, for one store.

    ``endpoints`` and ``security`` as for :class:`~elastic.store.etcd.EtcdStore`;
    ``ops`` counts the calls made. ``where`` names the cluster in messages;
    ``streams`` opens the Watch and LeaseKeepAlive streams (on a channel of
    their own, see :mod:`.etcd_stream`).

    Raises (constructor): ConfigError for malformed endpoints, mixed schemes,
    TLS files with http:// endpoints, an unreadable TLS file or non-positive
    timeouts; :meth:`connect` raises the rest.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        request_timeout_s: float,
        connect_timeout_s: float,
        security: EtcdSecurity | None,
        ops: OpCounter,
    ):
        if not connect_timeout_s > 0 or not request_timeout_s > 0:
            raise ConfigError(
                f"etcd timeouts must be positive (connect {connect_timeout_s} s, "
                f"request {request_timeout_s} s)"
            )
        self.security = security if security is not None else EtcdSecurity()
        self.ops = ops
        # A unix:// endpoint: an etcd on this host behind its socket's
        # directory (the standalone one), plain text.
        socket_path = unix_socket_path(endpoints)
        self._unix_target = None if socket_path is None else f"unix:{socket_path}"
        scheme, hostports = (("unix", []) if socket_path is not None
                             else parse_endpoint_urls(endpoints))
        if scheme in ("http", "unix") and self.security.has_tls_files:
            raise ConfigError("--etcd-cacert and --etcd-cert need https:// etcd endpoints; "
                              f"got {endpoints!r}")
        self.tls = scheme == "https" or (scheme is None and self.security.has_tls_files)
        url_scheme = "https" if self.tls else "http"
        self.endpoints = ((f"unix://{socket_path}",) if socket_path is not None else
                          tuple(f"{url_scheme}://{endpoint}" for endpoint in hostports))
        self.where = ",".join(self.endpoints)  # how messages name this etcd
        self.request_timeout_s = float(request_timeout_s)
        self.closed = False  # close() has run: calls raise closed_error()
        self.channel = self._open_channel(hostports)
        self.streams = EtcdStreams(lambda: self._open_channel(hostports, grpc.aio,
                                                              _STREAM_CHANNEL_OPTIONS))
        self._auth: TokenAuth | None = None
        if self.security.user is not None:
            self._auth = TokenAuth(self.channel, self.security, self.where, self.translate)

    def _open_channel(self, hostports: list[HostPort], api=grpc, extra_options=()):
        """A channel to the members: ``api`` is ``grpc`` or ``grpc.aio``;
        ``extra_options`` are added to the common ones."""
        target = self._unix_target or grpc_target(hostports)
        options = _CHANNEL_OPTIONS + tuple(extra_options)
        if not self.tls:
            return api.insecure_channel(target, options=options)
        if len(hostports) > 1:
            # The target is a list of addresses; check certificates against a name.
            options += (("grpc.ssl_target_name_override", hostports[0].host),)
        if self.security.cacert is None and api is grpc:
            logger.info("Checking the certificate of etcd at %s against the system's CA "
                        "roots (no --etcd-cacert given).", self.where)
        return api.secure_channel(target, channel_credentials(self.security), options=options)

    # -- opening and closing ---------------------------------------------------------

    def connect(self, timeout_s: float) -> None:
        """Wait until etcd answers, then authenticate; closes the channel and
        raises if either fails.

        Raises:
            StoreAuthError: etcd and we do not accept each other's
                certificates, or etcd refused the user and password.
            StoreUnavailableError: etcd did not answer within ``timeout_s``.
            StoreError: something answered, but not as etcd does.
        """
        try:
            self._check_reachable(timeout_s)
            if self._auth is not None:
                self._auth.authenticate(self.request_timeout_s)
        except BaseException:
            self.channel.close()
            raise
        logger.debug("Connected to etcd at %s (%s).", self.where,
                     self.security.describe() if self.tls or self._auth else "plain text")

    def _check_reachable(self, timeout_s: float) -> None:
        """Ask etcd's status until it answers or ``timeout_s`` passes. A call
        that fails while the connection cannot be made fails at once with
        gRPC's reason: a TLS refusal ends the wait there (waiting will not
        help), anything else (etcd starting, restarting) is asked again."""
        maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        deadline = time.monotonic() + timeout_s
        hung_up = False  # any attempt, not only the last (which may just run out of time)
        while True:
            left = deadline - time.monotonic()
            try:
                maintenance.Status(rpc_pb2.StatusRequest(), timeout=max(min(left, 1.0), 0.001))
                return
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.PERMISSION_DENIED or is_token_error(exc):
                    return  # etcd answered; it wants a user for this (some versions do)
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise StoreError(
                        f"{self.where} did not answer like etcd: {rpc_error_text(exc)}"
                    ) from exc
                why = explain_connect_failure(details, where=self.where, tls=self.tls,
                                              security=self.security)
                if why is not None:
                    raise StoreAuthError(why) from exc
                hung_up = hung_up or "socket closed" in details.lower()
                if deadline - time.monotonic() <= 0:
                    raise self._unreachable(timeout_s, details, hung_up) from exc
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _unreachable(self, timeout_s: float, details: str, hung_up: bool) -> StoreError:
        last = f" (last error: {details})" if details else ""
        if not self.tls and hung_up:
            # What a TLS-only etcd does to plain text: it hangs up.
            last += "; etcd hangs up on plain text: if it serves TLS, use https:// endpoints"
        return StoreUnavailableError(
            f"cannot reach etcd at {self.where} within {timeout_s:.1f} s; "
            f"is the server running and the address right?{last}"
        )

    def close(self) -> None:
        """Close the streams' channel, then this one; later calls raise
        :meth:`closed_error`. Idempotent."""
        self.streams.close()
        self.closed = True
        self.channel.close()

    def closed_error(self) -> StoreError:
        """What a call on this connection's store raises once it is closed."""
        return StoreError(f"the store for etcd at {self.where} is closed")

    # -- the auth token -----------------------------------------------------------

    @property
    def uses_auth(self) -> bool:
        """Whether calls carry a user's token (``--etcd-user``)."""
        return self._auth is not None

    @property
    def token(self) -> str | None:
        """The auth token that calls and new streams carry now (None: none)."""
        return self._auth.token if self._auth is not None else None

    @staticmethod
    def metadata_for(token: str | None):
        """The call metadata that carries ``token`` (None: none)."""
        return TokenAuth.metadata_for(token)

    def token_refused(self, exc: grpc.RpcError) -> bool:
        """Whether etcd refused a call of this user for its token, so that a
        fresh token may make it pass (without a user there is none to renew)."""
        return self._auth is not None and is_token_error(exc)

    def refresh_token(self, refused_token: str | None, timeout_s: float | None = None) -> None:
        """Re-authenticate after etcd refused ``refused_token`` (shared by
        concurrent callers; ``timeout_s`` None: the request timeout).

        Raises:
            StoreAuthError: no user, or etcd refused the user and password.
            StoreError: another failure, or the connection is closed.
        """
        if self._auth is None:
            raise auth_required_error(self.where)
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        try:
            self._auth.refresh(refused_token, timeout)
        except ValueError as exc:  # gRPC's answer once the channel is closed
            if self.closed:
                raise self.closed_error() from exc
            raise

    # -- unary calls --------------------------------------------------------------

    def translate(self, exc: grpc.RpcError, what: str, timeout_s: float,
                  key: str | None = None) -> StoreError:
        """The store error that a failed call (``what``, on ``key``) raises."""
        code = exc.code()
        details = exc.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            why = explain_connect_failure(details, where=self.where, tls=self.tls,
                                          security=self.security)
            return StoreUnavailableError(
                f"etcd at {self.where} is unavailable ({what}): {why or details}"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return StoreTimeoutError(
                f"etcd at {self.where} did not complete {what} within {timeout_s:.1f} s"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return permission_error(self.where, what, key, self.security)
        if is_token_error(exc):
            if self._auth is None:
                return auth_required_error(self.where)
            return StoreAuthError(f"etcd at {self.where} refused the token of user "
                                  f"{self._auth.user} for {what} even after authenticating "
                                  f"again: {details}")
        return StoreError(f"etcd at {self.where} failed {what}: {rpc_error_text(exc)}")

    def call(
        self,
        kind: str,
        method: Callable,
        request,
        *,
        timeout_s: float | None,
        retry: bool,
        count: bool = True,
    ):
        """One unary RPC with a deadline (``timeout_s`` None: the request
        timeout), retried while etcd is unavailable if ``retry``, counted as
        ``kind`` if ``count``, errors translated.

        A call refused for its auth token is repeated once with a fresh token,
        retry or not: etcd checks the token before it applies anything.

        Raises:
            StoreUnavailableError, StoreTimeoutError, StoreAuthError, StoreError:
                as :meth:`translate` says; StoreError once closed.
        """
        if self.closed:
            raise self.closed_error()
        if count:
            self.ops.add(kind)
        timeout = self.request_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        try:
            return call_with_token(
                lambda token: self._attempt(method, request, self.metadata_for(token),
                                            deadline, retry),
                current_token=lambda: self.token,
                token_refused=self.token_refused,
                refresh=lambda token: self.refresh_token(
                    token, max(deadline - time.monotonic(), 0.001)),
            )
        except grpc.RpcError as exc:
            raise self.translate(exc, kind, timeout, request_key(request)) from exc
        except ValueError as exc:  # gRPC's answer once the channel is closed
            if self.closed:
                raise self.closed_error() from exc
            raise

    def _attempt(self, method: Callable, request, metadata, deadline: float, retry: bool):
        """One call with ``metadata`` by ``deadline``, repeated while etcd is
        unavailable if ``retry``; raises gRPC's error."""
        if not retry:
            return method(request, timeout=max(deadline - time.monotonic(), 0.0),
                          metadata=metadata)
        return call_with_retry(
            lambda left: method(request, timeout=left, metadata=metadata),
            deadline=deadline,
            is_retryable=_is_unavailable,
            on_retry=lambda: self.ops.add("retry"),
        )
