"""The etcd v3 backend of :class:`~elastic.store.api.Store`, over raw gRPC.

It speaks etcd's gRPC API through the generated stubs of ``pyetcd.etcdrpc``
only (not pyetcd's client), so that this module alone decides deadlines,
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
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import re
import socket
import threading
import time
import urllib.parse
from typing import Callable, Iterable, Sequence

import grpc
from pyetcd.etcdrpc import kv_pb2, rpc_pb2, rpc_pb2_grpc

from elastic.errors import (
    ConfigError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    WatchCompactedError,
)
from elastic.store.api import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Compare,
    CompareTarget,
    Delete,
    ErrorCallback,
    EventsCallback,
    EventType,
    Get,
    KeyValue,
    Op,
    Put,
    Session,
    Store,
    TxnResult,
    Watch,
    WatchEvent,
)
from elastic.store.retry import call_with_retry, reconnect_delay

logger = logging.getLogger(__name__)

DEFAULT_PORT = 2379
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a DNS name or IPv4 address; IPv6 goes in [...]

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

# Watch stream failures worth reconnecting for; anything else ends the watch.
_WATCH_RETRY_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

_COMPARE_RESULT = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}
_COMPARE_TARGET = {
    CompareTarget.VERSION: (rpc_pb2.Compare.VERSION, "version"),
    CompareTarget.CREATE_REVISION: (rpc_pb2.Compare.CREATE, "create_revision"),
    CompareTarget.MOD_REVISION: (rpc_pb2.Compare.MOD, "mod_revision"),
    CompareTarget.VALUE: (rpc_pb2.Compare.VALUE, "value"),
}


# -- endpoints ----------------------------------------------------------------


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"http://a:2379,b"`` or a list of such -> ``[("a", 2379), ("b", 2379)]``.

    Raises:
        ConfigError: no endpoint, an https:// endpoint (TLS is not supported
            yet), another scheme, or something that is not ``host[:port]``.
    """
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    parts = [p.strip() for item in items for p in str(item).split(",") if p.strip()]
    if not parts:
        raise ConfigError(f"no etcd endpoint given (got {endpoints!r})")
    return [_parse_endpoint(p) for p in parts]


def _parse_endpoint(text: str) -> tuple[str, int]:
    rest = text
    if "://" in text:
        scheme, rest = text.split("://", 1)
        if scheme.lower() == "https":
            raise ConfigError(f"TLS endpoints are not supported yet: {text}")
        if scheme.lower() != "http":
            raise ConfigError(f"bad etcd endpoint {text!r}: the scheme must be http://")
    try:
        split = urllib.parse.urlsplit("//" + rest.rstrip("/"))
        host, port = split.hostname, split.port
    except ValueError as exc:
        raise ConfigError(f"bad etcd endpoint {text!r}: {exc}") from exc
    name_ok = bool(_HOST_NAME.fullmatch(host or "")) or (":" in (host or "") and "[" in rest)
    if not name_ok or split.path or split.query or split.fragment or split.username or port == 0:
        raise ConfigError(f"bad etcd endpoint {text!r}: expected [http://]host[:port]")
    return host, port if port is not None else DEFAULT_PORT


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _grpc_target(hostports: list[tuple[str, int]]) -> str:
    """One endpoint: gRPC's DNS resolver (re-resolved on reconnect). Several:
    their addresses, resolved now, for gRPC's pick_first to fail over between."""
    if len(hostports) == 1:
        return _host_port(*hostports[0])
    v4: list[str] = []
    v6: list[str] = []
    for host, port in hostports:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise StoreUnavailableError(
                f"cannot resolve etcd endpoint {_host_port(host, port)}: {exc.strerror}"
            ) from exc
        for family, _, _, _, addr in infos:
            if family == socket.AF_INET and f"{addr[0]}:{port}" not in v4:
                v4.append(f"{addr[0]}:{port}")
            elif family == socket.AF_INET6 and f"[{addr[0]}]:{port}" not in v6:
                v6.append(f"[{addr[0]}]:{port}")
    # A gRPC address list is of one family; IPv4 is what etcd clusters use.
    if v4:
        if v6:
            logger.info("Using the IPv4 addresses of the etcd endpoints; ignoring %s.", v6)
        return "ipv4:" + ",".join(v4)
    return "ipv6:" + ",".join(v6)


# -- conversions ----------------------------------------------------------------


def _key_bytes(key: str) -> bytes:
    return key.encode("utf-8", "surrogateescape")


def _key_range(key: str, prefix: bool) -> tuple[bytes, bytes]:
    """(key, range_end) for one key or, by etcd's rule, every key under a prefix."""
    raw = _key_bytes(key)
    if not prefix:
        return raw, b""
    end = bytearray(raw)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return raw, bytes(end)
        end.pop()
    # "" or all 0xff bytes: everything from the key on ("\0" means "no end").
    return raw or b"\0", b"\0"


def _to_kv(m: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(
        key=m.key.decode("utf-8", "surrogateescape"),
        value=bytes(m.value),
        create_revision=m.create_revision,
        mod_revision=m.mod_revision,
        version=m.version,
        lease=m.lease,
    )


def _to_event(m: kv_pb2.Event) -> WatchEvent:
    kind = EventType.DELETE if m.type == kv_pb2.Event.DELETE else EventType.PUT
    return WatchEvent(kind, _to_kv(m.kv))


def _range_request(key: str, prefix: bool) -> rpc_pb2.RangeRequest:
    start, end = _key_range(key, prefix)
    return rpc_pb2.RangeRequest(
        key=start,
        range_end=end,
        sort_order=rpc_pb2.RangeRequest.ASCEND if prefix else rpc_pb2.RangeRequest.NONE,
        sort_target=rpc_pb2.RangeRequest.KEY,
    )


def _compare_pb(c: Compare) -> rpc_pb2.Compare:
    target, field = _COMPARE_TARGET[c.target]
    m = rpc_pb2.Compare(key=_key_bytes(c.key), target=target, result=_COMPARE_RESULT[c.op])
    if c.target is CompareTarget.VALUE:
        if not isinstance(c.operand, (bytes, bytearray)):
            raise TypeError(f"a value compare needs bytes, got {type(c.operand).__name__}")
        m.value = bytes(c.operand)
    else:
        if isinstance(c.operand, bool) or not isinstance(c.operand, int):
            raise TypeError(f"a {c.target.value} compare needs an int, got {c.operand!r}")
        # Setting the oneof member, even to 0, is what tells etcd the operand.
        setattr(m, field, c.operand)
    return m


def _op_pb(op: Op) -> rpc_pb2.RequestOp:
    if isinstance(op, Put):
        return rpc_pb2.RequestOp(
            request_put=rpc_pb2.PutRequest(key=_key_bytes(op.key), value=bytes(op.value),
                                           lease=op.lease)
        )
    if isinstance(op, Delete):
        start, end = _key_range(op.key, op.prefix)
        return rpc_pb2.RequestOp(
            request_delete_range=rpc_pb2.DeleteRangeRequest(key=start, range_end=end)
        )
    if isinstance(op, Get):
        return rpc_pb2.RequestOp(request_range=_range_request(op.key, op.prefix))
    raise TypeError(f"not a transaction op: {op!r}")


def _op_result(r: rpc_pb2.ResponseOp):
    which = r.WhichOneof("response")
    if which == "response_range":
        return [_to_kv(kv) for kv in r.response_range.kvs]
    if which == "response_delete_range":
        return r.response_delete_range.deleted
    return None


def _is_unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


# -- the store --------------------------------------------------------------------


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
        self.endpoints = tuple(f"http://{_host_port(h, p)}" for h, p in hostports)
        self._where = ",".join(self.endpoints)
        self.request_timeout_s = float(request_timeout_s)
        self._channel = grpc.insecure_channel(_grpc_target(hostports), options=_CHANNEL_OPTIONS)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
        self._watch = rpc_pb2_grpc.WatchStub(self._channel)
        self._lock = threading.Lock()
        self._closing = False  # close() has begun: no new sessions or watches
        self._closed = False  # the channel is closed
        self._watches: set[_EtcdWatch] = set()
        self._sessions: set[_EtcdSession] = set()
        self._keeper = _KeepAliveLoop(self)
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
                f"{self._where} did not answer like etcd: {exc.code().name}: {exc.details()}"
            ) from exc

    # -- plumbing -------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> float:
        return self.request_timeout_s if timeout_s is None else float(timeout_s)

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
        name = code.name if code is not None else "UNKNOWN"
        return StoreError(f"etcd at {self._where} failed {what}: {name}: {exc.details()}")

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
            raise StoreError(f"the store for etcd at {self._where} is closed")
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
                raise StoreError(f"the store for etcd at {self._where} is closed") from exc
            raise

    # -- key-value ------------------------------------------------------------

    def get(self, key: str, *, timeout_s: float | None = None) -> KeyValue | None:
        resp = self._call("get", self._kv.Range, _range_request(key, False),
                          timeout_s=timeout_s, retry=True)
        return _to_kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(
        self, prefix: str, *, timeout_s: float | None = None
    ) -> tuple[list[KeyValue], int]:
        resp = self._call("get_prefix", self._kv.Range, _range_request(prefix, True),
                          timeout_s=timeout_s, retry=True)
        return [_to_kv(kv) for kv in resp.kvs], resp.header.revision

    def put(
        self, key: str, value: bytes, *, lease: int = 0, timeout_s: float | None = None
    ) -> int:
        request = rpc_pb2.PutRequest(key=_key_bytes(key), value=bytes(value), lease=lease)
        resp = self._call("put", self._kv.Put, request, timeout_s=timeout_s, retry=True)
        return resp.header.revision

    def delete(self, key: str, *, prefix: bool = False, timeout_s: float | None = None) -> int:
        """See :meth:`Store.delete`. A delete retried after a lost answer
        reports 0 keys deleted, since the first attempt already deleted them."""
        start, end = _key_range(key, prefix)
        resp = self._call("delete", self._kv.DeleteRange,
                          rpc_pb2.DeleteRangeRequest(key=start, range_end=end),
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
            compare=[_compare_pb(c) for c in compares],
            success=[_op_pb(op) for op in success],
            failure=[_op_pb(op) for op in failure],
        )
        resp = self._call("txn", self._kv.Txn, request, timeout_s=timeout_s, retry=False)
        return TxnResult(
            succeeded=resp.succeeded,
            revision=resp.header.revision,
            results=tuple(_op_result(r) for r in resp.responses),
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
        session = _EtcdSession(self, resp.ID, float(resp.TTL), granted_at=requested_at)
        with self._lock:
            closing = self._closing
            if not closing:
                self._sessions.add(session)
        if closing:
            session.close()
            raise StoreError(f"the store for etcd at {self._where} is closed")
        self._keeper.add(session)
        return session

    def lease_time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        resp = self._call("lease_ttl", self._lease.LeaseTimeToLive,
                          rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id),
                          timeout_s=timeout_s, retry=True)
        return float(resp.TTL) if resp.TTL >= 0 else -1.0

    def _revoke(self, lease_id: int, timeout_s: float) -> None:
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
            start, _ = _key_range(key, False)
            resp = self._call("watch_create", self._kv.Range,
                              rpc_pb2.RangeRequest(key=start, count_only=True),
                              timeout_s=None, retry=True, count=False)
            start_revision = resp.header.revision + 1
        w = _EtcdWatch(self, key, prefix, start_revision, on_events, on_error)
        with self._lock:
            if self._closing:
                raise StoreError(f"the store for etcd at {self._where} is closed")
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
        budget_end = time.monotonic() + min(2.0, self.request_timeout_s)
        for s in sessions:
            s._close(revoke_deadline=budget_end)
        self._keeper.stop()
        with self._lock:
            self._closed = True
        self._channel.close()


# -- sessions -----------------------------------------------------------------------


class _EtcdSession(Session):
    """A lease kept alive by its store's :class:`_KeepAliveLoop`.

    The loop owns the keep-alive bookkeeping fields and guards them with its
    lock; ``close`` is the only method callers use.
    """

    def __init__(self, store: EtcdStore, lease_id: int, ttl_s: float, *, granted_at: float):
        super().__init__(lease_id, ttl_s)
        self._store = store
        # The server's expiry is at least TTL after our request reached it, so
        # counting from when we *sent* a request errs towards "lost" early.
        self.last_renewed_at = granted_at
        self.next_due = 0.0
        self.in_flight: collections.deque[float] = collections.deque()
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def interval_s(self) -> float:
        return self.ttl_s / 3.0

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort, at most
        about 2 s); sets ``lost``. Idempotent; errors are logged, not raised."""
        self._close(revoke_deadline=time.monotonic() + min(2.0, self._store.request_timeout_s))

    def _close(self, *, revoke_deadline: float) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._store._keeper.remove(self)
        self._store._forget(self)
        left = revoke_deadline - time.monotonic()
        if left > 0:
            try:
                self._store._revoke(self.lease_id, left)
            except StoreError as exc:
                # NOT_FOUND (already expired) lands here too: nothing to do.
                logger.debug("Revoking etcd lease %x failed: %s", self.lease_id, exc)
        self.lost.set()


class _KeepAliveStream:
    """One LeaseKeepAlive call: requests go through a queue, a thread reads answers."""

    def __init__(self, loop: "_KeepAliveLoop"):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = loop.store._lease.LeaseKeepAlive(self._request_iter())
        self.broken = False
        self.answered = False
        self.reader = threading.Thread(
            target=loop._read, args=(self,), name="etcd-keepalive-reader", daemon=True
        )
        self.reader.start()

    def _request_iter(self) -> Iterable[rpc_pb2.LeaseKeepAliveRequest]:
        while True:
            lease_id = self._requests.get()
            if lease_id is None:
                return
            yield rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)

    def send(self, lease_id: int) -> None:
        self._requests.put(lease_id)

    def close(self) -> None:
        self.broken = True
        self._requests.put(None)
        self.call.cancel()


class _KeepAliveLoop:
    """Keeps every session of one store alive from one thread and one stream.

    Each lease gets a keep-alive every TTL/3. A session is lost when etcd
    answers TTL <= 0 (the lease is gone) or when no keep-alive it sent in the
    last TTL was answered; lost sessions are dropped from the loop. A stream
    that fails, or leaves a request unanswered past the request timeout, is
    replaced with backoff.
    """

    def __init__(self, store: EtcdStore):
        self.store = store
        self._cond = threading.Condition()
        self._sessions: dict[int, _EtcdSession] = {}
        self._stream: _KeepAliveStream | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failures = 0
        self._reopen_at = 0.0

    def add(self, session: _EtcdSession) -> None:
        with self._cond:
            if self._stopping:
                return
            session.next_due = time.monotonic()
            self._sessions[session.lease_id] = session
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-keepalive",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, session: _EtcdSession) -> None:
        with self._cond:
            self._sessions.pop(session.lease_id, None)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            stream, self._stream = self._stream, None
            thread = self._thread
            self._cond.notify()
        if stream is not None:
            stream.close()
        if thread is not None:
            thread.join(timeout=2.0)

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                now = time.monotonic()
                self._expire(now)
                if not self._sessions:
                    self._close_stream()  # idle: hold no stream without leases
                    self._cond.wait()
                    continue
                if self._stream_usable(now):
                    wake = self._send_due(now)
                else:
                    wake = self._reopen_at
                for s in self._sessions.values():
                    wake = min(wake, s.last_renewed_at + s.ttl_s)
                self._cond.wait(timeout=min(1.0, max(0.005, wake - now)))
            self._close_stream()

    def _expire(self, now: float) -> None:
        for s in list(self._sessions.values()):
            if now - s.last_renewed_at > s.ttl_s:
                self._lose(s, f"no keep-alive was answered for {s.ttl_s:.0f} s")

    def _lose(self, s: _EtcdSession, why: str) -> None:
        del self._sessions[s.lease_id]
        logger.warning("etcd lease %x (TTL %.0f s) is lost: %s.", s.lease_id, s.ttl_s, why)
        s.lost.set()

    def _stream_usable(self, now: float) -> bool:
        """Whether the stream can carry keep-alives; opens one when due."""
        stream = self._stream
        if stream is not None and not stream.broken:
            oldest = min((s.in_flight[0] for s in self._sessions.values() if s.in_flight),
                         default=None)
            if oldest is None or now - oldest <= self.store.request_timeout_s:
                return True
            logger.log(logging.WARNING if self._failures == 0 else logging.DEBUG,
                       "etcd at %s left a lease keep-alive unanswered for %.1f s; "
                       "reopening the keep-alive stream.", self.store._where, now - oldest)
            self._stream_failed()
        if now < self._reopen_at:
            return False
        try:
            self._stream = _KeepAliveStream(self)
        except ValueError:  # the channel is closed: the store is closing
            return False
        for s in self._sessions.values():
            s.in_flight.clear()
            s.next_due = now
        return True

    def _stream_failed(self) -> None:
        self._close_stream()
        self._failures += 1
        self._reopen_at = time.monotonic() + reconnect_delay(self._failures)

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _send_due(self, now: float) -> float:
        """Send the keep-alives that are due; returns when the next one is."""
        next_wake = math.inf
        for s in self._sessions.values():
            if s.next_due <= now:
                self._stream.send(s.lease_id)
                s.in_flight.append(now)
                s.next_due = now + s.interval_s
                self.store.ops.add("lease_keepalive")
            next_wake = min(next_wake, s.next_due)
        return next_wake

    def _read(self, stream: _KeepAliveStream) -> None:
        """The reader thread of one stream."""
        try:
            for resp in stream.call:
                with self._cond:
                    if stream is not self._stream:
                        return  # a late answer on a replaced stream proves little
                    if not stream.answered:
                        stream.answered = True
                        if self._failures:
                            logger.info("Lease keep-alive to etcd at %s works again.",
                                        self.store._where)
                        self._failures = 0
                    self._on_answer(resp)
            error = "the stream ended"
        except grpc.RpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        with self._cond:
            if stream is self._stream and not self._stopping:
                if self._failures == 0:
                    logger.warning("Lease keep-alive stream to etcd at %s failed (%s); "
                                   "reconnecting.", self.store._where, error)
                self._stream_failed()
                self._cond.notify()

    def _on_answer(self, resp: rpc_pb2.LeaseKeepAliveResponse) -> None:
        s = self._sessions.get(resp.ID)
        if s is None:
            return
        sent_at = s.in_flight.popleft() if s.in_flight else None
        if resp.TTL <= 0:
            self._lose(s, "etcd no longer knows it (expired or revoked)")
        elif sent_at is not None:
            s.last_renewed_at = max(s.last_renewed_at, sent_at)


# -- watches --------------------------------------------------------------------------


class _EtcdWatch(Watch):
    """One Watch stream in one daemon thread, re-created after transient errors.

    Resumes from the revision after the last delivered event (or the start
    revision), so events are delivered once and in order across reconnects.
    Callback errors are logged and the watch goes on.
    """

    def __init__(
        self,
        store: EtcdStore,
        key: str,
        prefix: bool,
        start_revision: int,
        on_events: EventsCallback,
        on_error: ErrorCallback | None,
    ):
        self._store = store
        self._what = f"{'prefix' if prefix else 'key'} {key!r}"
        self._range = _key_range(key, prefix)
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._created = False  # whether the current stream's watch was created
        self._failures = 0  # stream failures in a row
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Stop the watch; no callback starts after this returns (unless called
        from a callback, or a callback outlasts a 1 s grace). Idempotent."""
        self._cancelled.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=1.0)
        self._store._forget(self)

    def _run(self) -> None:
        while not self._cancelled.is_set():
            error = self._stream_once()
            if error is None or self._cancelled.is_set():
                return
            if self._created:
                self._failures = 0  # the stream that broke had been working
            self._failures += 1
            if self._failures == 1:
                logger.warning("Watch on %s at etcd %s broke (%s); reconnecting from "
                               "revision %d.", self._what, self._store._where, error,
                               self.next_revision)
            self._store.ops.add("watch_reconnect")
            self._cancelled.wait(reconnect_delay(self._failures))

    def _stream_once(self) -> str | None:
        """Run one stream. None: the watch is over; otherwise why to reconnect."""
        self._created = False
        start, end = self._range
        request = rpc_pb2.WatchRequest(
            create_request=rpc_pb2.WatchCreateRequest(
                key=start, range_end=end, start_revision=self.next_revision
            )
        )
        try:
            # One request, then the request side closes; etcd keeps the stream.
            call = self._store._watch.Watch(iter([request]))
        except ValueError:  # the channel is closed
            return None
        with self._lock:
            if self._cancelled.is_set():
                call.cancel()
                return None
            self._call = call
        try:
            for resp in call:
                if self._cancelled.is_set():
                    return None
                if not self._handle(resp):
                    return None
            return "the server ended the stream"
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return None
            if exc.code() in _WATCH_RETRY_CODES:
                return f"{exc.code().name}: {exc.details()}"
            self._fail(self._store._translate(exc, f"watch on {self._what}", 0.0), exc)
            return None
        finally:
            call.cancel()
            with self._lock:
                self._call = None

    def _handle(self, resp: rpc_pb2.WatchResponse) -> bool:
        """Process one response; False ends the watch."""
        if resp.compact_revision > 0:
            err = WatchCompactedError(
                f"watch on {self._what} asked for revision {self.next_revision}, but etcd "
                f"compacted history up to {resp.compact_revision}",
                resp.compact_revision,
            )
            self._fail(err, None)
            return False
        if resp.canceled:
            reason = resp.cancel_reason or "no reason given"
            self._fail(StoreError(f"etcd cancelled the watch on {self._what}: {reason}"), None)
            return False
        if resp.created:
            self._created = True
            if self._failures:
                logger.info("Watch on %s at etcd %s resumed from revision %d.",
                            self._what, self._store._where, self.next_revision)
            return True
        if resp.events:
            events = [_to_event(e) for e in resp.events]
            # Advance before delivering: a failing callback must not cause a replay.
            self.next_revision = events[-1].kv.mod_revision + 1
            self._store.ops.add("watch_event", len(events))
            try:
                self._on_events(events)
            except Exception:
                logger.exception("The callback of the watch on %s failed on revision %d; "
                                 "the watch goes on.", self._what, events[-1].revision)
        return True

    def _fail(self, err: Exception, cause: BaseException | None) -> None:
        err.__cause__ = cause
        logger.warning("Watch on %s at etcd %s ended: %s", self._what, self._store._where, err)
        if self._on_error is None or self._cancelled.is_set():
            return
        try:
            self._on_error(err)
        except Exception:
            logger.exception("The error callback of the watch on %s failed.", self._what)
