"""The etcd v3 backend of :class:`~elastic.store.api.Store`, over raw gRPC.

It speaks etcd's gRPC API through the generated stubs of ``pyetcd.etcdrpc``
only (not pyetcd's client), so that this backend alone decides deadlines,
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
* Each watch has one thread and one Watch stream, re-created after any
  transient failure from the revision after the last one delivered, so no
  event is lost or repeated across reconnects and etcd restarts.

Long-lived streams (watches, keep-alive) carry no deadline; HTTP/2 keepalive
pings detect a dead connection under them, and the keep-alive loop recycles a
stream whose answers stop coming.

This module holds :class:`EtcdStore`: the connection, unary calls and their
error translation, and the public entry points. Beside it:
:mod:`.etcd_endpoints` (endpoint parsing and the gRPC target),
:mod:`.etcd_convert` (store types <-> etcd messages), :mod:`.etcd_lease`
(sessions and the keep-alive loop) and :mod:`.etcd_watch` (watch threads).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable, Sequence

import grpc
from pyetcd.etcdrpc import rpc_pb2, rpc_pb2_grpc

from elastic.errors import ConfigError, StoreError, StoreTimeoutError, StoreUnavailableError
from elastic.store.api import (
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
from elastic.store.etcd_endpoints import DEFAULT_PORT, grpc_target, host_port, parse_endpoints
from elastic.store.etcd_lease import EtcdSession, KeepAliveLoop
from elastic.store.etcd_watch import EtcdWatch
from elastic.store.retry import call_with_retry

__all__ = ["DEFAULT_PORT", "EtcdStore", "parse_endpoints"]

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


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class EtcdStore(Store):
    """A :class:`Store` on an etcd v3 cluster (plain-text gRPC).

    ``endpoints``: ``"http://host:port"`` or ``"host:port"`` (port 2379 by
    default), comma-separated or as a list; with several, gRPC fails over
    between them.

    Raises (constructor):
        ConfigError: malformed or https:// endpoints, non-positive timeouts.
        StoreUnavailableError: etcd did not answer within ``connect_timeout_s``.
        StoreError: something answered, but not as etcd does.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        connect_timeout_s: float = 5.0,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    ):
        super().__init__()
        if not connect_timeout_s > 0 or not request_timeout_s > 0:
            raise ConfigError(
                f"etcd timeouts must be positive (connect {connect_timeout_s} s, "
                f"request {request_timeout_s} s)"
            )
        hostports = parse_endpoints(endpoints)
        self.endpoints = tuple(f"http://{host_port(h, p)}" for h, p in hostports)
        self._where = ",".join(self.endpoints)
        self.request_timeout_s = float(request_timeout_s)
        self._channel = grpc.insecure_channel(grpc_target(hostports), options=_CHANNEL_OPTIONS)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
        self._watch = rpc_pb2_grpc.WatchStub(self._channel)
        self._lock = threading.Lock()
        self._closing = False  # close() has begun: no new sessions or watches
        self._closed = False  # the channel is closed
        self._watches: set[EtcdWatch] = set()
        self._sessions: set[EtcdSession] = set()
        self._keeper = KeepAliveLoop(self)
        self._check_reachable(connect_timeout_s)

    def __repr__(self) -> str:
        return f"EtcdStore({self._where})"

    def _check_reachable(self, timeout_s: float) -> None:
        maintenance = rpc_pb2_grpc.MaintenanceStub(self._channel)
        try:
            # wait_for_ready: keep trying to connect until the deadline rather
            # than failing at the first refused connection (etcd may be starting).
            maintenance.Status(rpc_pb2.StatusRequest(), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            self._channel.close()
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise StoreUnavailableError(
                    f"cannot reach etcd at {self._where} within {timeout_s:.1f} s; "
                    "is the server running and the address right?"
                ) from exc
            raise StoreError(
                f"{self._where} did not answer like etcd: {rpc_error_text(exc)}"
            ) from exc

    # -- plumbing -------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> float:
        return self.request_timeout_s if timeout_s is None else float(timeout_s)

    def _closed_error(self) -> StoreError:
        return StoreError(f"the store for etcd at {self._where} is closed")

    def _revoke_deadline(self) -> float:
        """When best-effort lease revokes on close give up: 2 s from now, or
        the request timeout if that is shorter."""
        return time.monotonic() + min(2.0, self.request_timeout_s)

    def _translate(self, exc: grpc.RpcError, what: str, timeout_s: float) -> StoreError:
        code = exc.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            return StoreUnavailableError(
                f"etcd at {self._where} is unavailable ({what}): {exc.details()}"
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return StoreTimeoutError(
                f"etcd at {self._where} did not complete {what} within {timeout_s:.1f} s"
            )
        return StoreError(f"etcd at {self._where} failed {what}: {rpc_error_text(exc)}")

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
        """One unary RPC with a deadline, retried if ``retry``, errors translated."""
        if self._closed:
            raise self._closed_error()
        if count:
            self.ops.add(kind)
        timeout = self._timeout(timeout_s)
        try:
            if not retry:
                return method(request, timeout=timeout)
            return call_with_retry(
                lambda left: method(request, timeout=left),
                deadline=time.monotonic() + timeout,
                is_retryable=_is_unavailable,
                on_retry=lambda: self.ops.add("retry"),
            )
        except grpc.RpcError as exc:
            raise self._translate(exc, kind, timeout) from exc
        except ValueError as exc:  # gRPC's answer once the channel is closed
            if self._closed:
                raise self._closed_error() from exc
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
            raise StoreError(f"etcd at {self._where} refused a lease of {ttl_s} s: {resp.error}")
        session = EtcdSession(self, resp.ID, float(resp.TTL), granted_at=requested_at)
        with self._lock:
            closing = self._closing
            if not closing:
                self._sessions.add(session)
        if closing:
            session.close()
            raise self._closed_error()
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
        left = self.lease_time_to_live(lease_id)
        if left <= 0:
            return None
        session = EtcdSession(self, lease_id, max(ttl_s, left), granted_at=asked_at)
        with self._lock:
            closing = self._closing
            if not closing:
                self._sessions.add(session)
        if closing:
            raise self._closed_error()
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
        stream is only established later.

        Raises:
            ValueError: ``start_revision`` is not positive.
            StoreUnavailableError, StoreTimeoutError: reading the current
                revision failed.
        """
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        self.ops.add("watch_create")
        if start_revision is None:
            resp = self._call("watch_create", self._kv.Range,
                              rpc_pb2.RangeRequest(key=key_bytes(key), count_only=True),
                              timeout_s=None, retry=True, count=False)
            start_revision = resp.header.revision + 1
        w = EtcdWatch(self, key, prefix, start_revision, on_events, on_error)
        with self._lock:
            if self._closing:
                raise self._closed_error()
            self._watches.add(w)
        w.start()
        return w

    def _forget(self, item) -> None:
        with self._lock:
            self._watches.discard(item)
            self._sessions.discard(item)

    # -- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        """Cancel watches, revoke sessions' leases (best effort, about 2 s in
        all) and close the connection. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            watches, self._watches = list(self._watches), set()
            sessions, self._sessions = list(self._sessions), set()
        for w in watches:
            w.cancel()
        revoke_deadline = self._revoke_deadline()
        for s in sessions:
            s._close(revoke_deadline=revoke_deadline)
        self._keeper.stop()
        with self._lock:
            self._closed = True
        self._channel.close()
