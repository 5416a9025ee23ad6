"""Leases of the etcd backend: sessions, and the one keep-alive loop that serves them.

Part of the etcd backend (:mod:`elastic.store.etcd`), on its
:class:`~elastic.store.etcd_conn.EtcdConnection`: :class:`EtcdLeases` grants,
resumes and revokes a store's leases and hands each :class:`EtcdSession` to
its :class:`KeepAliveLoop`. All sessions of a store share that loop's thread
and its one LeaseKeepAlive stream, so the number of sessions costs memory,
not threads. The stream carries no deadline; the loop recycles it when its
answers stop coming. With a user, the stream carries the auth token of when
it was opened; a stream that etcd ends for that token is reopened with a
fresh one (etcd 3.5 does not check tokens on keep-alives, later ones may).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time

import grpc

from elastic.errors import StoreAuthError, StoreError
from elastic.store.api import KEEPALIVE_TTL_FRACTION, Session
from elastic.store.etcd_conn import EtcdConnection
from elastic.store.etcd_convert import rpc_error_text
from elastic.store.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic.store.retry import reconnect_delay

logger = logging.getLogger(__name__)


class EtcdSession(Session):
    """A lease kept alive by its store's :class:`KeepAliveLoop`.

    The loop owns the keep-alive bookkeeping fields and guards them with its
    lock; ``close`` is the only method callers use.
    """

    def __init__(self, leases: EtcdLeases, lease_id: int, ttl_s: float, *, granted_at: float):
        super().__init__(lease_id, ttl_s)
        self._leases = leases
        # The server's expiry is at least TTL after our request reached it, so
        # counting from when we *sent* a request errs towards "lost" early.
        self.last_renewed_at = granted_at
        self.next_due = 0.0
        self.in_flight: collections.deque[float] = collections.deque()
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def confirmed_at(self) -> float:
        return self.last_renewed_at

    @property
    def interval_s(self) -> float:
        return self.ttl_s * KEEPALIVE_TTL_FRACTION

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort, at most
        about 2 s); sets ``lost``. Idempotent; errors are logged, not raised."""
        self.end(self._leases.revoke_deadline())

    def end(self, revoke_deadline: float) -> None:
        """:meth:`close`, revoking by ``revoke_deadline`` (monotonic): the
        store ends all its sessions within one."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._leases.release(self, revoke_deadline)
        self.lost.set()


class EtcdLeases:
    """The leases of one store: grants and resumes sessions, keeps them alive
    through one :class:`KeepAliveLoop`, revokes leases, and ends every
    session when the store closes."""

    def __init__(self, conn: EtcdConnection):
        self._conn = conn
        self._stub = rpc_pb2_grpc.LeaseStub(conn.channel)
        self._lock = threading.Lock()
        self._closing = False  # close() has begun: no new sessions
        self._sessions: set[EtcdSession] = set()
        self._keeper = KeepAliveLoop(conn)

    def grant(self, ttl_s: float) -> EtcdSession:
        """See :meth:`EtcdStore.session`; ``ttl_s`` is positive."""
        requested_at = time.monotonic()
        resp = self._conn.call("lease_grant", self._stub.LeaseGrant,
                               rpc_pb2.LeaseGrantRequest(TTL=max(1, math.ceil(ttl_s))),
                               timeout_s=None, retry=False)
        if resp.error:
            raise StoreError(f"etcd at {self._conn.where} refused a lease of {ttl_s} s: "
                             f"{resp.error}")
        session = EtcdSession(self, resp.ID, float(resp.TTL), granted_at=requested_at)
        if not self._keep(session):
            session.close()
            raise self._conn.closed_error()
        return session

    def resume(self, lease_id: int, ttl_s: float) -> EtcdSession | None:
        """See :meth:`EtcdStore.resume_session`."""
        asked_at = time.monotonic()
        # A third of the TTL, not the store's timeout: a probe sent while etcd
        # had no leader can sit on its member until its deadline even after
        # quorum is back, and a node whose lease stays unconfirmed for most of
        # a TTL stops its workers. The caller asks again on its next pass.
        left = self.time_to_live(lease_id, timeout_s=max(1.0, ttl_s / 3))
        if left <= 0:
            return None
        session = EtcdSession(self, lease_id, max(ttl_s, left), granted_at=asked_at)
        if not self._keep(session):
            raise self._conn.closed_error()
        return session

    def _keep(self, session: EtcdSession) -> bool:
        """Keep ``session`` alive; False once close() has begun."""
        with self._lock:
            if self._closing:
                return False
            self._sessions.add(session)
        self._keeper.add(session)
        return True

    def time_to_live(self, lease_id: int, *, timeout_s: float | None = None) -> float:
        """Seconds left on the lease; -1 if it is gone."""
        resp = self._conn.call("lease_ttl", self._stub.LeaseTimeToLive,
                               rpc_pb2.LeaseTimeToLiveRequest(ID=lease_id),
                               timeout_s=timeout_s, retry=True)
        return float(resp.TTL) if resp.TTL >= 0 else -1.0

    def revoke(self, lease_id: int, *, timeout_s: float | None = None,
               missing_ok: bool = True) -> None:
        """Revoke the lease; with ``missing_ok`` a lease already gone is not
        an error. Raises the store's errors."""
        try:
            self._conn.call("lease_revoke", self._stub.LeaseRevoke,
                            rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout_s=timeout_s,
                            retry=True)
        except StoreError as exc:
            if not missing_ok or "not found" not in str(exc).lower():
                raise

    def revoke_deadline(self) -> float:
        """When best-effort lease revokes on close give up: 2 s from now, or
        the request timeout if that is shorter."""
        return time.monotonic() + min(2.0, self._conn.request_timeout_s)

    def release(self, session: EtcdSession, revoke_deadline: float) -> None:
        """Stop keeping ``session``'s lease alive and revoke it by
        ``revoke_deadline`` (monotonic; best effort: a failure, an expired
        lease among them, is logged)."""
        self._keeper.remove(session)
        with self._lock:
            self._sessions.discard(session)
        left = revoke_deadline - time.monotonic()
        if left > 0:
            try:
                self.revoke(session.lease_id, timeout_s=left, missing_ok=False)
            except StoreError as exc:
                logger.debug("Revoking etcd lease %x failed: %s", session.lease_id, exc)

    def close(self) -> None:
        """End every session (revoking their leases, about 2 s in all) and
        stop the keep-alive loop. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            sessions, self._sessions = list(self._sessions), set()
        revoke_deadline = self.revoke_deadline()
        for s in sessions:
            s.end(revoke_deadline)
        self._keeper.stop()


class _KeepAliveStream:
    """One LeaseKeepAlive call (see :mod:`.etcd_stream`); a thread reads its answers."""

    def __init__(self, loop: KeepAliveLoop):
        conn = loop.conn
        self.token = conn.token
        self.call = conn.streams.lease_keep_alive(conn.metadata_for(self.token))
        self.broken = False
        self.answered = False
        self.reader = threading.Thread(
            target=loop._read, args=(self,), name="etcd-keepalive-reader", daemon=True
        )
        self.reader.start()

    def send(self, lease_id: int) -> None:
        self.call.send(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))

    def close(self) -> None:
        self.broken = True
        self.call.close()


class KeepAliveLoop:
    """Keeps every session of one store alive from one thread and one stream.

    Each lease gets a keep-alive every TTL/3. A session is lost when etcd
    answers TTL <= 0 (the lease is gone) or when no keep-alive it sent in the
    last TTL was answered; lost sessions are dropped from the loop. A stream
    that fails, or leaves a keep-alive unanswered for a keep-alive interval
    (etcd answers in milliseconds: the member it reaches lost its leader or
    died), is replaced with backoff, never longer than a quarter interval:
    a peer on another member may already be renewing, and a node whose lease
    stays unconfirmed for most of a TTL stops its workers.
    """

    def __init__(self, conn: EtcdConnection):
        self.conn = conn
        self._cond = threading.Condition()
        self._sessions: dict[int, EtcdSession] = {}
        self._stream: _KeepAliveStream | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failures = 0
        self._reopen_at = 0.0

    def add(self, session: EtcdSession) -> None:
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

    def remove(self, session: EtcdSession) -> None:
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
                    if (oldest := self._oldest_unanswered()) is not None:
                        wake = min(wake, oldest + self._patience())
                else:
                    wake = self._reopen_at
                for s in self._sessions.values():
                    wake = min(wake, s.last_renewed_at + s.ttl_s)
                # Sleep until the next deadline: everything else notifies.
                self._cond.wait(timeout=max(0.005, wake - now))
            self._close_stream()

    def _expire(self, now: float) -> None:
        for s in list(self._sessions.values()):
            if now - s.last_renewed_at > s.ttl_s:
                self._lose(s, f"no keep-alive was answered for {s.ttl_s:.0f} s")

    def _lose(self, s: EtcdSession, why: str) -> None:
        del self._sessions[s.lease_id]
        logger.warning("etcd lease %x (TTL %.0f s) is lost: %s.", s.lease_id, s.ttl_s, why)
        s.lost.set()

    def _stream_usable(self, now: float) -> bool:
        """Whether the stream can carry keep-alives; opens one when due."""
        stream = self._stream
        if stream is not None and not stream.broken:
            oldest = self._oldest_unanswered()
            if oldest is None or now - oldest <= self._patience():
                return True
            logger.log(logging.WARNING if self._failures == 0 else logging.DEBUG,
                       "etcd at %s left a lease keep-alive unanswered for %.1f s; "
                       "reopening the keep-alive stream.", self.conn.where, now - oldest)
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

    def _oldest_unanswered(self) -> float | None:
        """When the oldest keep-alive still unanswered was sent (None: none is)."""
        return min((s.in_flight[0] for s in self._sessions.values() if s.in_flight),
                   default=None)

    def _patience(self) -> float:
        """How long a keep-alive may go unanswered before the stream is replaced."""
        return min(self.conn.request_timeout_s, self._shortest_interval())

    def _shortest_interval(self) -> float:
        return min((s.interval_s for s in self._sessions.values()), default=math.inf)

    def _stream_failed(self) -> None:
        self._close_stream()
        self._failures += 1
        self._reopen_at = time.monotonic() + min(reconnect_delay(self._failures),
                                                 self._shortest_interval() / 4)

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
                self.conn.ops.add("lease_keepalive")
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
                                        self.conn.where)
                        self._failures = 0
                    self._on_answer(resp)
            error = "the stream ended"
        except grpc.RpcError as exc:
            error = rpc_error_text(exc)
            if self.conn.token_refused(exc) and not stream.broken:
                self._renew_token(stream)
        with self._cond:
            if stream is self._stream and not self._stopping:
                if self._failures == 0:
                    logger.warning("Lease keep-alive stream to etcd at %s failed (%s); "
                                   "reconnecting.", self.conn.where, error)
                self._stream_failed()
                self._cond.notify()

    def _renew_token(self, stream: _KeepAliveStream) -> None:
        """etcd ended ``stream`` for its auth token: get a fresh one (outside
        the loop's lock) for the stream that replaces it. A failure is logged;
        the reopened stream fails the same way and tries again."""
        try:
            self.conn.refresh_token(stream.token)
        except StoreAuthError as exc:
            logger.error("Lease keep-alive cannot authenticate at etcd: %s", exc)
        except StoreError as exc:
            logger.debug("Lease keep-alive: authenticating again at etcd failed: %s", exc)

    def _on_answer(self, resp: rpc_pb2.LeaseKeepAliveResponse) -> None:
        s = self._sessions.get(resp.ID)
        if s is None:
            return
        sent_at = s.in_flight.popleft() if s.in_flight else None
        if resp.TTL <= 0:
            self._lose(s, "etcd no longer knows it (expired or revoked)")
        elif sent_at is not None:
            s.last_renewed_at = max(s.last_renewed_at, sent_at)
