"""Sessions of the etcd backend and the one keep-alive loop that serves them.

Part of the etcd backend (:mod:`elastic.store.etcd`): :meth:`EtcdStore.session`
grants the lease and hands the :class:`EtcdSession` to its store's
:class:`KeepAliveLoop`. All sessions of a store share that loop's thread and
its one LeaseKeepAlive stream, so the number of sessions costs memory, not
threads. The stream carries no deadline; the loop recycles it when its
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
from typing import TYPE_CHECKING

import grpc

from elastic.errors import StoreAuthError, StoreError
from elastic.store.api import KEEPALIVE_TTL_FRACTION, Session
from elastic.store.etcd_auth import is_token_error
from elastic.store.etcd_convert import rpc_error_text
from elastic.store.etcdpb import rpc_pb2
from elastic.store.retry import reconnect_delay

if TYPE_CHECKING:
    from elastic.store.etcd import EtcdStore

logger = logging.getLogger(__name__)


class EtcdSession(Session):
    """A lease kept alive by its store's :class:`KeepAliveLoop`.

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
    def confirmed_at(self) -> float:
        return self.last_renewed_at

    @property
    def interval_s(self) -> float:
        return self.ttl_s * KEEPALIVE_TTL_FRACTION

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (best effort, at most
        about 2 s); sets ``lost``. Idempotent; errors are logged, not raised."""
        self.end(self._store.revoke_deadline())

    def end(self, revoke_deadline: float) -> None:
        """:meth:`close`, revoking by ``revoke_deadline`` (monotonic): the
        store ends all its sessions within one."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._store.release_session(self, revoke_deadline)
        self.lost.set()


class _KeepAliveStream:
    """One LeaseKeepAlive call (see :mod:`.etcd_stream`); a thread reads its answers."""

    def __init__(self, loop: KeepAliveLoop):
        self.token = loop.store.current_token()
        self.call = loop.store.streams.lease_keep_alive(loop.store.metadata_for(self.token))
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

    def __init__(self, store: EtcdStore):
        self.store = store
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
                       "reopening the keep-alive stream.", self.store.where, now - oldest)
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
        return min(self.store.request_timeout_s, self._shortest_interval())

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
                                        self.store.where)
                        self._failures = 0
                    self._on_answer(resp)
            error = "the stream ended"
        except grpc.RpcError as exc:
            error = rpc_error_text(exc)
            if is_token_error(exc) and self.store.uses_auth and not stream.broken:
                self._renew_token(stream)
        with self._cond:
            if stream is self._stream and not self._stopping:
                if self._failures == 0:
                    logger.warning("Lease keep-alive stream to etcd at %s failed (%s); "
                                   "reconnecting.", self.store.where, error)
                self._stream_failed()
                self._cond.notify()

    def _renew_token(self, stream: _KeepAliveStream) -> None:
        """etcd ended ``stream`` for its auth token: get a fresh one (outside
        the loop's lock) for the stream that replaces it. A failure is logged;
        the reopened stream fails the same way and tries again."""
        try:
            self.store.refresh_token(stream.token, self.store.request_timeout_s)
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
