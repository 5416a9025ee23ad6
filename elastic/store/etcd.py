"""The etcd v3 backend of :class:`~elastic.store.api.Store`, over raw gRPC.

It speaks etcd's gRPC API through our generated stubs (``elastic.store.etcdpb``)
and no etcd client library, so that this backend alone decides deadlines,
retries and reconnection:

* Every unary call has a deadline. Calls that are safe to repeat are retried
  while etcd is unavailable, within that deadline (see :mod:`.retry`);
  transactions and lease grants are never repeated, since a lost answer does
  not mean the request was not applied.
* gRPC errors become store errors at the connection (:mod:`.etcd_conn`):
  UNAVAILABLE -> StoreUnavailableError, DEADLINE_EXCEEDED ->
  StoreTimeoutError, anything else -> StoreError, with the gRPC error chained.
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

This module holds :class:`EtcdStore`, the public entry points. Beneath it,
each used by the ones above it only: :mod:`.etcd_endpoints` (endpoint
parsing and the gRPC target), :mod:`.etcd_auth` (TLS credentials, the auth
token, refusals explained), :mod:`.etcd_convert` (store types <-> etcd
messages), :mod:`.etcd_stream` (the long-lived streams), :mod:`.etcd_conn`
(the connection: channels, token, error translation, the unary call),
:mod:`.etcd_lease` (sessions and the keep-alive loop) and :mod:`.etcd_watch`
(watches and the one stream that carries them).
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

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
from elastic.store.etcd_conn import EtcdConnection
from elastic.store.etcd_convert import (
    compare_pb,
    delete_request,
    key_bytes,
    op_pb,
    op_result,
    put_request,
    range_request,
    to_kv,
)
from elastic.store.etcd_endpoints import DEFAULT_PORT, parse_endpoints
from elastic.store.etcd_lease import EtcdLeases
from elastic.store.etcd_watch import EtcdWatch, WatchMux
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.security import EtcdSecurity

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PORT", "EtcdSecurity", "EtcdStore", "parse_endpoints"]


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
        # The connection that every call, the keep-alive loop and the watches share.
        self.connection = EtcdConnection(endpoints, request_timeout_s=request_timeout_s,
                                         connect_timeout_s=connect_timeout_s,
                                         security=security, ops=self.ops)
        self.security = self.connection.security
        self.tls = self.connection.tls
        self.endpoints = self.connection.endpoints
        self.where = self.connection.where  # how messages name this etcd
        self.request_timeout_s = self.connection.request_timeout_s
        self._kv = rpc_pb2_grpc.KVStub(self.connection.channel)
        self._leases = EtcdLeases(self.connection)
        self.watches = WatchMux(self.connection)  # carries every watch of this store
        self._close_lock = threading.Lock()
        self._closing = False
        self.connection.connect(connect_timeout_s)

    def __repr__(self) -> str:
        return f"EtcdStore({self.where})"

    # -- key-value ------------------------------------------------------------

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        resp = self.connection.call("get", self._kv.Range, range_request(key, False),
                                    timeout_s=timeout_s, retry=True)
        return to_kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(
        self, prefix: str, *, timeout_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        resp = self.connection.call("get_prefix", self._kv.Range,
                                    range_request(prefix, True),
                                    timeout_s=timeout_s, retry=True)
        return [to_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None
    ) -> int:
        resp = self.connection.call("put", self._kv.Put, put_request(key, value, lease),
                                    timeout_s=timeout_s, retry=True)
        return resp.header.revision

    def delete(self, key: str, *, prefix: bool = False, timeout_s: float | None = None) -> int:
        """See :meth:`Store.delete`. A delete retried after a lost answer
        reports 0 keys deleted, since the first attempt already deleted them."""
        resp = self.connection.call("delete", self._kv.DeleteRange,
                                    delete_request(key, prefix),
                                    timeout_s=timeout_s, retry=True)
        return resp.deleted

    def _run_txn(self, compares: Sequence[Compare], success: Sequence[Op],
                 failure: Sequence[Op], timeout_s: float | None) -> TxnResult:
        """See :meth:`Store.txn`. Never retried. etcd refuses (StoreError) a
        transaction that writes one key twice in a branch.

        Raises:
            TypeError: an op that is not a Put, Delete or Get.
        """
        request = rpc_pb2.TxnRequest(
            compare=[compare_pb(c) for c in compares],
            success=[op_pb(op) for op in success],
            failure=[op_pb(op) for op in failure],
        )
        resp = self.connection.call("txn", self._kv.Txn, request, timeout_s=timeout_s,
                                    retry=False)
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
        return self._leases.grant(ttl_s)

    def lease_time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        return self._leases.time_to_live(lease_id, timeout_s=timeout_s)

    def resume_session(self, lease_id: int, ttl_s: float) -> Session | None:
        """See :meth:`Store.resume_session`."""
        return self._leases.resume(lease_id, ttl_s)

    def revoke_lease(self, lease_id: int, *, timeout_s: float | None = None) -> None:
        """See :meth:`Store.revoke_lease`."""
        self._leases.revoke(lease_id, timeout_s=timeout_s)

    # -- watches ----------------------------------------------------------------

    def _start_watch(self, key: str, prefix: bool, start_revision: int | None,
                     on_events: EventsCallback, on_error: ErrorCallback | None) -> Watch:
        """See :meth:`Store.watch`.

        With ``start_revision`` None this reads the current revision first, so
        every change made after ``watch`` returns is delivered, even if the
        stream is only established later. The watch rides the store's one
        Watch stream; its callbacks run on the store's ``etcd-watch`` thread,
        one at a time with those of the store's other watches (see
        :mod:`.etcd_watch`). Callable from a callback.

        Raises:
            StoreUnavailableError, StoreTimeoutError: reading the current
                revision failed.
            StoreError: the store is closed.
        """
        self.ops.add("watch_create")
        if start_revision is None:
            resp = self.connection.call(
                "watch_create", self._kv.Range,
                rpc_pb2.RangeRequest(key=key_bytes(key), count_only=True),
                timeout_s=None, retry=True, count=False)
            start_revision = resp.header.revision + 1
        w = EtcdWatch(self.watches, key, prefix, start_revision, on_events, on_error)
        w.start()  # raises once close() has begun
        return w

    # -- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        """Cancel watches (waiting about 2 s at most for a running callback),
        revoke sessions' leases (best effort, about 2 s in all) and close the
        connection. Idempotent; may be called from a watch callback."""
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self.watches.stop()
        self._leases.close()
        self.connection.close()
