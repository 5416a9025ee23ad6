"""The etcd v3 backend of :class:`~elastic.store.api.Store`, over raw gRPC.

It speaks etcd's gRPC API through our generated stubs (``elastic.store.etcdpb``)
and no etcd client library, so that this backend alone decides deadlines,
retries and reconnection:

* Every unary call has a deadline. Calls that are safe to repeat are retried
  while etcd is unavailable, within that deadline (see :mod:`.retry`);
  transactions and lease grants are never repeated, since a lost answer does
  not mean the request was not applied.
* gRPC errors become store errors here: UNAVAILABLE ->
  StoreUnavailableError, DEADLINE_EXCEEDED -> StoreTimeoutError, anything
  else -> StoreError, with the gRPC error chained.
* All sessions of a store share one keep-alive thread and one LeaseKeepAlive
  stream; the number of sessions costs memory, not threads.
* All watches of a store share one Watch stream, read by one thread that
  runs their callbacks; after any transient failure the stream is reopened
  and each watch created again from the revision after the last one it
  delivered, so no event is lost or repeated across reconnects and etcd
  restarts.

Long-lived streams (watches, keep-alive) carry no deadline; HTTP/2 keepalive
pings detect a dead connection under them, and the keep-alive loop recycles a
stream whose answers stop coming.

Security (:class:`~elastic.store.security.EtcdSecurity`): ``https://``
endpoints are reached over TLS, checked against the given CA bundle or the
system's roots, with a client certificate if given; with a user, every call
carries its auth token, renewed when etcd refuses it (:mod:`.etcd_auth`).
Refusals (an unknown CA, a missing or refused client certificate, a wrong
password, a missing permission) are :class:`~elastic.errors.StoreAuthError`
with one line that says what to change.

This module holds :class:`EtcdStore`: the connection, unary calls and their
error translation, and the public entry points. Beside it:
:mod:`.etcd_endpoints` (endpoint parsing and the gRPC target),
:mod:`.etcd_auth` (TLS credentials, the auth token, refusals explained),
:mod:`.etcd_convert` (store types <-> etcd messages), :mod:`.etcd_lease`
(sessions and the keep-alive loop) and :mod:`.etcd_watch` (watches and the
one stream that carries them).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Sequence

import grpc
import grpc.aio

from elastic.errors import (
    ConfigError,
    StoreAuthError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastic.store.api import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    Compare,
    ErrorCallback,
    EventsCallback,
    KeyValue,
    Op,
    Session,
    Store,
    TxnResult,
    Watch,
)
from elastic.store.etcd_auth import (
    TokenAuth,
    auth_required_error,
    channel_credentials,
    explain_connect_failure,
    is_token_error,
    permission_error,
    request_key,
)
from elastic.store.etcd_convert import (
    compare_pb,
    delete_request,
    key_bytes,
    op_pb,
    op_result,
    put_request,
    range_request,
    rpc_error_text,
    to_kv,
)
from elastic.store.etcd_endpoints import (
    DEFAULT_PORT,
    grpc_target,
    host_port,
    parse_endpoint_urls,
    parse_endpoints,
    unix_socket_path,
)
from elastic.store.etcd_lease import EtcdSession, KeepAliveLoop
from elastic.store.etcd_stream import EtcdStreams
from elastic.store.etcd_watch import EtcdWatch, WatchMux
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.retry import call_with_retry
from elastic.store.security import EtcdSecurity

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PORT", "EtcdSecurity", "EtcdStore", "parse_endpoints"]

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


class EtcdStore(Store):
    """A :class:`Store` on an etcd v3 cluster.

    ``endpoints``: ``"http://host:port"``, ``"https://host:port"`` or
    ``"host:port"`` (port 2379 by default), comma-separated or as a list;
    with several, gRPC fails over between them. All share one scheme; bare
    ones are https when the others are, or when ``security`` names a CA or a
    client certificate. ``security``: TLS material and the user (see
    :class:`~elastic.store.security.EtcdSecurity`); https without a CA bundle
    checks etcd's certificate against the system's roots.

    With several https endpoints every member's certificate is checked
    against the first endpoint's host name (gRPC Python takes one name per
    channel): give the members certificates that list it (a shared name of
    the cluster), or name one endpoint that balances over them.

    Raises (constructor):
        ConfigError: malformed endpoints, http:// and https:// mixed, TLS
            files with http:// endpoints, an unreadable TLS file,
            non-positive timeouts.
        StoreAuthError: etcd and we do not accept each other's certificates,
            or etcd refused the user and password.
        StoreUnavailableError: etcd did not answer within ``connect_timeout_s``.
        StoreError: something answered, but not as etcd does.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        security: EtcdSecurity | None = None,
    ):
        super().__init__()
        if not connect_timeout_s > 0 or not request_timeout_s > 0:
            raise ConfigError(
                f"etcd timeouts must be positive (connect {connect_timeout_s} s, "
                f"request {request_timeout_s} s)"
            )
        self.security = security if security is not None else EtcdSecurity()
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
                          tuple(f"{url_scheme}://{host_port(h, p)}" for h, p in hostports))
        self.where = ",".join(self.endpoints)  # how messages name this etcd
        self.request_timeout_s = float(request_timeout_s)
        self._channel = self._open_channel(hostports)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
        # The Watch and LeaseKeepAlive streams, on a channel of their own (see etcd_stream).
        self.streams = EtcdStreams(lambda: self._open_channel(hostports, grpc.aio,
                                                              _STREAM_CHANNEL_OPTIONS))
        self._auth: TokenAuth | None = None
        if self.security.user is not None:
            self._auth = TokenAuth(self._channel, self.security, self.where, self.translate)
        self._lock = threading.Lock()
        self._closing = False  # close() has begun: no new sessions or watches
        self._closed = False  # the channel is closed
        self._sessions: set[EtcdSession] = set()
        self._keeper = KeepAliveLoop(self)
        self._watcher = WatchMux(self)
        self._connect(connect_timeout_s)

    def __repr__(self) -> str:
        return f"EtcdStore({self.where})"

    def _open_channel(self, hostports: list[tuple[str, int]], api=grpc, extra_options=()):
        """A channel to the members: ``api`` is ``grpc`` or ``grpc.aio``;
        ``extra_options`` are added to the common ones."""
        target = self._unix_target or grpc_target(hostports)
        options = _CHANNEL_OPTIONS + tuple(extra_options)
        if not self.tls:
            return api.insecure_channel(target, options=options)
        if len(hostports) > 1:
            # The target is a list of addresses; check certificates against a name.
            options += (("grpc.ssl_target_name_override", hostports[0][0]),)
        if self.security.cacert is None and api is grpc:
            logger.info("Checking the certificate of etcd at %s against the system's CA "
                        "roots (no --etcd-cacert given).", self.where)
        return api.secure_channel(target, channel_credentials(self.security), options=options)

    def _connect(self, timeout_s: float) -> None:
        """Wait until etcd answers, then authenticate; closes the channel and
        raises if either fails (see the constructor)."""
        try:
            self._check_reachable(timeout_s)
            if self._auth is not None:
                self._auth.authenticate(self.request_timeout_s)
        except BaseException:
            self._channel.close()
            raise
        logger.debug("Connected to etcd at %s (%s).", self.where,
                     self.security.describe() if self.tls or self._auth else "plain text")

    def _check_reachable(self, timeout_s: float) -> None:
        """Ask etcd's status until it answers or ``timeout_s`` passes. A call
        that fails while the connection cannot be made fails at once with
        gRPC's reason: a TLS refusal ends the wait there (waiting will not
        help), anything else (etcd starting, restarting) is asked again."""
        maintenance = rpc_pb2_grpc.MaintenanceStub(self._channel)
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
                    last = f" (last error: {details})" if details else ""
                    if not self.tls and hung_up:
                        # What a TLS-only etcd does to plain text: it hangs up.
                        last += "; etcd hangs up on plain text: if it serves TLS, use https:// "
                        last += "endpoints"
                    raise StoreUnavailableError(
                        f"cannot reach etcd at {self.where} within {timeout_s:.1f} s; "
                        f"is the server running and the address right?{last}"
                    ) from exc
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    # -- plumbing -------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> float:
        return self.request_timeout_s if timeout_s is None else float(timeout_s)

    def closed_error(self) -> StoreError:
        """What a call on this store raises once it is closed."""
        return StoreError(f"the store for etcd at {self.where} is closed")

    def revoke_deadline(self) -> float:
        """When best-effort lease revokes on close give up: 2 s from now, or
        the request timeout if that is shorter."""
        return time.monotonic() + min(2.0, self.request_timeout_s)

    def current_token(self) -> str | None:
        """The auth token that calls and new streams carry now (None: none)."""
        return self._auth.token if self._auth is not None else None

    @property
    def uses_auth(self) -> bool:
        """Whether calls carry a user's token (``--etcd-user``)."""
        return self._auth is not None

    def metadata_for(self, token: str | None):
        """The call metadata that carries ``token`` (None: none)."""
        return TokenAuth.metadata_for(token)

    def refresh_token(self, failed_token: str | None, timeout_s: float) -> None:
        """Re-authenticate after etcd refused ``failed_token`` (shared by
        concurrent callers). Raises StoreAuthError or another store error."""
        if self._auth is None:
            raise auth_required_error(self.where)
        self._auth.refresh(failed_token, timeout_s)

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

    def _call(
        self,
        kind: str,
        method: Callable,
        request,
        *,
        timeout_s: float | None,
        retry: bool,
        count: bool = True,
    ):
        """One unary RPC with a deadline, retried if ``retry``, errors translated.

        A call refused for its auth token is repeated once with a fresh token,
        retry or not: etcd checks the token before it applies anything."""
        if self._closed:
            raise self.closed_error()
        if count:
            self.ops.add(kind)
        timeout = self._timeout(timeout_s)
        deadline = time.monotonic() + timeout
        renewed = False
        while True:
            token = self.current_token()
            metadata = self.metadata_for(token)
            try:
                if not retry:
                    return method(request, timeout=max(deadline - time.monotonic(), 0.0),
                                  metadata=metadata)
                return call_with_retry(
                    lambda left, md=metadata: method(request, timeout=left, metadata=md),
                    deadline=deadline,
                    is_retryable=_is_unavailable,
                    on_retry=lambda: self.ops.add("retry"),
                )
            except grpc.RpcError as exc:
                if not renewed and self._auth is not None and is_token_error(exc):
                    renewed = True
                    self.refresh_token(token, max(deadline - time.monotonic(), 0.001))
                    continue
                raise self.translate(exc, kind, timeout, request_key(request)) from exc
            except ValueError as exc:  # gRPC's answer once the channel is closed
                if self._closed:
                    raise self.closed_error() from exc
                raise

    # -- key-value ------------------------------------------------------------

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        resp = self._call("get", self._kv.Range, range_request(key, False),
                          timeout_s=timeout_s, retry=True)
        return to_kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(
        self, prefix: str, *, timeout_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        resp = self._call("get_prefix", self._kv.Range, range_request(prefix, True),
                          timeout_s=timeout_s, retry=True)
        return [to_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None
    ) -> int:
        resp = self._call("put", self._kv.Put, put_request(key, value, lease),
                          timeout_s=timeout_s, retry=True)
        return resp.header.revision

    def delete(self, key: str, *, prefix: bool = False, timeout_s: float | None = None) -> int:
        """See :meth:`Store.delete`. A delete retried after a lost answer
        reports 0 keys deleted, since the first attempt already deleted them."""
        resp = self._call("delete", self._kv.DeleteRange, delete_request(key, prefix),
                          timeout_s=timeout_s, retry=True)
        return resp.deleted

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout_s: float | None = None,
    ) -> TxnResult:
        """See :meth:`Store.txn`. Never retried. etcd refuses (StoreError) a
        transaction that writes one key twice in a branch.

        Raises:
            TypeError: an op or a compare operand of the wrong type.
        """
        request = rpc_pb2.TxnRequest(
            compare=[compare_pb(c) for c in compares],
            success=[op_pb(op) for op in success],
            failure=[op_pb(op) for op in failure],
        )
        resp = self._call("txn", self._kv.Txn, request, timeout_s=timeout_s, retry=False)
        return TxnResult(
            succeeded=resp.succeeded,
            revision=resp.header.revision,
            results=tuple(op_result(r) for r in resp.responses),
        )

    # -- leases ---------------------------------------------------------------

    def session(self, ttl_s: float) -> Session:
        """See :meth:`Store.session`. The TTL is rounded up to whole seconds,
        and etcd may raise it to its minimum; ``session.ttl_s`` is what it granted.

        Raises:
            ValueError: ``ttl_s`` is not positive.
        """
        if not ttl_s > 0:
            raise ValueError(f"a session needs a positive TTL, got {ttl_s}")
        requested_at = time.monotonic()
        resp = self._call("lease_grant", self._lease.LeaseGrant,
                          rpc_pb2.LeaseGrantRequest(TTL=max(1, math.ceil(ttl_s))),
                          timeout_s=None, retry=False)
        if resp.error:
            raise StoreError(f"etcd at {self.where} refused a lease of {ttl_s} s: {resp.error}")
        session = EtcdSession(self, resp.ID, float(resp.TTL), granted_at=requested_at)
        with self._lock:
            closing = self._closing
            if not closing:
                self._sessions.add(session)
        if closing:
            session.close()
            raise self.closed_error()
        self._keeper.add(session)
        return session

    def lease_time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        resp = self._call("lease_ttl", self._lease.LeaseTimeToLive,
                          rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id),
                          timeout_s=timeout_s, retry=True)
        return float(resp.TTL) if resp.TTL >= 0 else -1.0

    def resume_session(self, lease_id: int, ttl_s: float) -> Session | None:
        """See :meth:`Store.resume_session`."""
        asked_at = time.monotonic()
        # A third of the TTL, not the store's timeout: a probe sent while etcd
        # had no leader can sit on its member until its deadline even after
        # quorum is back (seen in the chaos campaign: 5 s, while the peers,
        # back already, told this node it was the one cut off, and it stopped
        # its workers). The caller asks again on its next pass, soon enough.
        left = self.lease_time_to_live(lease_id, timeout_s=max(1.0, ttl_s / 3))
        if left <= 0:
            return None
        session = EtcdSession(self, lease_id, max(ttl_s, left), granted_at=asked_at)
        with self._lock:
            closing = self._closing
            if not closing:
                self._sessions.add(session)
        if closing:
            raise self.closed_error()
        self._keeper.add(session)
        return session

    def revoke_lease(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        """See :meth:`Store.revoke_lease`."""
        try:
            self._revoke(lease_id, timeout_s)
        except StoreError as exc:
            if "not found" not in str(exc).lower():
                raise

    def _revoke(self, lease_id: int, timeout_s: float | None) -> None:
        self._call("lease_revoke", self._lease.LeaseRevoke,
                   rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout_s=timeout_s, retry=True)

    # -- watches ----------------------------------------------------------------

    def watch(
        self,
        key: str,
        on_events: EventsCallback,
        *,
        prefix: bool = False,
        start_revision: int | None = None,
        on_error: ErrorCallback | None = None,
    ) -> Watch:
        """See :meth:`Store.watch`.

        With ``start_revision`` None this reads the current revision first, so
        every change made after ``watch`` returns is delivered, even if the
        stream is only established later. The watch rides the store's one
        Watch stream; its callbacks run on the store's ``etcd-watch`` thread,
        one at a time with those of the store's other watches (see
        :mod:`.etcd_watch`). Callable from a callback.

        Raises:
            ValueError: ``start_revision`` is not positive.
            StoreUnavailableError, StoreTimeoutError: reading the current
                revision failed.
            StoreError: the store is closed.
        """
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        self.ops.add("watch_create")
        if start_revision is None:
            resp = self._call("watch_create", self._kv.Range,
                              rpc_pb2.RangeRequest(key=key_bytes(key), count_only=True),
                              timeout_s=None, retry=True, count=False)
            start_revision = resp.header.revision + 1
        w = EtcdWatch(self._watcher, key, prefix, start_revision, on_events, on_error)
        w.start()  # raises once close() has begun
        return w

    def release_session(self, session: EtcdSession, revoke_deadline: float) -> None:
        """Stop keeping ``session``'s lease alive and revoke it by
        ``revoke_deadline`` (monotonic; best effort: a failure, an expired
        lease among them, is logged). For :meth:`EtcdSession.end`."""
        self._keeper.remove(session)
        with self._lock:
            self._sessions.discard(session)
        left = revoke_deadline - time.monotonic()
        if left > 0:
            try:
                self._revoke(session.lease_id, left)
            except StoreError as exc:
                logger.debug("Revoking etcd lease %x failed: %s", session.lease_id, exc)

    # -- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        """Cancel watches (waiting about 2 s at most for a running callback),
        revoke sessions' leases (best effort, about 2 s in all) and close the
        connection. Idempotent; may be called from a watch callback."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            sessions, self._sessions = list(self._sessions), set()
        self._watcher.stop()
        revoke_deadline = self.revoke_deadline()
        for s in sessions:
            s.end(revoke_deadline)
        self._keeper.stop()
        self.streams.close()
        with self._lock:
            self._closed = True
        self._channel.close()
