"""Watches of the etcd backend: all watches of a store on one Watch stream,
served by one thread.

Part of the etcd backend (:mod:`elastic.store.etcd`), on its
:class:`~elastic.store.etcd_conn.EtcdConnection`: :meth:`EtcdStore.watch`
creates and starts an :class:`EtcdWatch`, which its store's :class:`WatchMux`
carries. etcd multiplexes watches on one bidirectional stream: the mux sends
each watch's creation and cancellation through the stream's request queue,
and one thread, ``etcd-watch``, reads the answers and runs the callbacks. The
number of watches costs memory, not threads, and an idle store's thread
sleeps in one blocking read. The stream is opened with the first watch and
closed with the last one.

Matching answers to watches. etcd answers the creations on a stream in the
order they were sent (its receive loop handles one request at a time and
answers each on an ordered control channel, and it holds back a watch's
events until its creation is answered), so the k-th "created" answer is the
k-th creation sent. That answer names the id etcd gave the watch on this
stream, which its events, its compaction and its cancellation then carry.
Order, not a watch id of our choosing, does the matching: the generated
stubs predate client-chosen ids, and etcd 3.6 answers a refused creation
with id -1 whatever was asked for. etcd 3.5 answers it with the id asked
for, 0, and from then on holds back the events of whichever watch has id 0
on that stream: the mux creates that watch again (see ``_unstall``).

Failures. The stream carries no deadline; HTTP/2 keepalive pings detect a
dead connection under it. When it breaks it is reopened with backoff and
every live watch is created again from the revision after the last one it
delivered, so no event is lost or repeated across reconnects and etcd
restarts. What etcd says about one watch ends that watch only: a start
revision compacted away (:class:`~elastic.errors.WatchCompactedError`), a
refusal for lack of permission (:class:`~elastic.errors.StoreAuthError`).

Tokens. With a user, a stream carries the auth token of when it was opened,
and etcd checks it on every creation: a simple token expires when unused, so
a long-lived stream's token may be stale by the time a new watch is created
on it (and all of them are after an etcd restart). A creation refused for
its token gets a fresh token and the stream is reopened with it, every watch
created again; a refusal of the same watch with that fresh token is a real
lack of permission and ends that watch (etcd 3.5.1 says "permission denied"
for an expired token too, so one retry tells the two apart).

Callbacks run on the ``etcd-watch`` thread, one at a time: a slow callback
delays the other watches of its store. A callback may call the store
(``get``, ``watch``, ``cancel``, even ``close``); it must not wait for an
event of another watch of the same store, which only this thread delivers.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc

from elastic.errors import StoreAuthError, StoreError, WatchCompactedError
from elastic.store.api import ErrorCallback, EventsCallback, Watch
from elastic.store.etcd_auth import (
    auth_required_error,
    is_auth_cancel,
    key_text,
    permission_error,
)
from elastic.store.etcd_conn import EtcdConnection
from elastic.store.etcd_convert import key_range, rpc_error_text, to_event
from elastic.store.etcdpb import rpc_pb2
from elastic.store.retry import reconnect_delay

logger = logging.getLogger(__name__)

# Watch stream failures worth reconnecting for; anything else ends the watches.
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
# How long cancel() and close() wait for a callback that is running.
_CALLBACK_GRACE_S = 1.0


class EtcdWatch(Watch):
    """One watch of a store, carried by the store's :class:`WatchMux`.

    Delivers every change from its start revision on, in order and once,
    across reconnects: ``next_revision`` is the revision after the last one
    delivered, where the watch resumes. Callback errors are logged and the
    watch goes on. The mux owns the fields after ``_on_error`` and guards
    them with its lock.
    """

    def __init__(
        self,
        mux: WatchMux,
        key: str,
        prefix: bool,
        start_revision: int,
        on_events: EventsCallback,
        on_error: ErrorCallback | None,
    ):
        self._mux = mux
        self.key = key
        self.what = f"{'prefix' if prefix else 'key'} {key!r}"
        self.range = key_range(key, prefix)
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self.live = False  # started, not yet cancelled or ended
        self.ended = False  # cancelled or ended: never (again) live
        self.stream: _WatchStream | None = None  # where its creation was sent last
        self.stream_id: int | None = None  # etcd's id for it on that stream, once created
        self.token_retried = False  # refused for its token, and the stream reopened fresh

    def __repr__(self) -> str:
        return f"EtcdWatch({self.what}, next_revision={self.next_revision})"

    def start(self) -> None:
        """Create the watch on its store's stream (opened if need be).
        A second call does nothing.

        Raises:
            StoreError: the store is closed.
        """
        self._mux.add(self)

    def cancel(self) -> None:
        """Stop the watch; no callback of it starts after this returns (unless
        called from a callback, or a running callback outlasts a 1 s grace).
        Idempotent."""
        self._mux.cancel(self)


@dataclass(frozen=True)
class _StreamEnd:
    """Why the mux stopped reading a stream: after a failure it reopens with
    backoff, otherwise (a fresh auth token) at once. ``error``: the gRPC
    error that ended it, if one did."""

    why: str
    failure: bool = True
    error: grpc.RpcError | None = None


class _WatchStream:
    """One Watch call (see :mod:`.etcd_stream`); the mux's thread reads its answers."""

    def __init__(self, conn: EtcdConnection, *, renewed: bool):
        self.token = conn.token
        self.call = conn.streams.watch(conn.metadata_for(self.token))
        # Creations sent and not yet answered, in the order sent (see the module doc).
        self.pending: collections.deque[EtcdWatch] = collections.deque()
        self.by_id: dict[int, EtcdWatch] = {}  # etcd's watch ids on this stream
        self.answered = False  # etcd has created a watch on it
        self.renewed = renewed  # opened with a token fetched after the last one was refused
        self.closed = False

    def create(self, w: EtcdWatch) -> None:
        start, end = w.range
        self.pending.append(w)
        self.call.send(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(
            key=start, range_end=end, start_revision=w.next_revision)))

    def cancel_watch(self, stream_id: int) -> None:
        self.call.send(rpc_pb2.WatchRequest(
            cancel_request=rpc_pb2.WatchCancelRequest(watch_id=stream_id)))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.call.close()


class WatchMux:
    """Carries every watch of one store on one Watch stream, read by one thread.

    The thread (``etcd-watch``) starts with the first watch and lives until
    the store closes; without watches it holds no stream and sleeps. It opens
    the stream, creates every live watch on it, then reads: it routes each
    answer to its watch and runs that watch's callbacks. A stream that breaks
    is replaced with backoff and every live watch created again from its
    ``next_revision``; the warning is logged once per outage.
    """

    def __init__(self, conn: EtcdConnection):
        self.conn = conn
        self._cond = threading.Condition()
        self._watches: dict[EtcdWatch, None] = {}  # live watches, in the order started
        self._stream: _WatchStream | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failures = 0  # streams in a row that broke before etcd created a watch
        self._reopen_at = 0.0
        self._fresh_token = False  # the next stream's token was fetched after a refusal
        self._running: EtcdWatch | None = None  # whose callback runs now

    @property
    def stream_open(self) -> bool:
        """Whether a Watch stream is open now (for tests and diagnostics)."""
        with self._cond:
            return self._stream is not None

    # -- the watches' side (any thread) ---------------------------------------------

    def add(self, w: EtcdWatch) -> None:
        """Start carrying ``w``. Raises StoreError once the store is closing."""
        with self._cond:
            if self._stopping:
                raise self.conn.closed_error()
            if w.live or w.ended:
                return
            w.live = True
            self._watches[w] = None
            if self._stream is not None:
                self._send_create(self._stream, w)
            if self._thread is None:
                self._start_thread()
            self._cond.notify_all()

    def cancel(self, w: EtcdWatch) -> None:
        """Stop ``w``: see :meth:`EtcdWatch.cancel`."""
        with self._cond:
            w.ended = True
            self._drop(w)
            if threading.current_thread() is not self._thread:
                self._cond.wait_for(lambda: self._running is not w, timeout=_CALLBACK_GRACE_S)

    def stop(self) -> None:
        """Cancel every watch, close the stream and end the thread (waiting at
        most about 2 s for a running callback and the thread). Idempotent."""
        me = threading.current_thread()
        with self._cond:
            self._stopping = True
            for w in self._watches:
                w.live, w.ended = False, True
            self._watches.clear()
            self._close_stream()
            self._cond.notify_all()
            thread = self._thread
            if me is not thread:
                self._cond.wait_for(lambda: self._running is None, timeout=_CALLBACK_GRACE_S)
        if thread is not None and me is not thread:
            thread.join(timeout=_CALLBACK_GRACE_S)

    def _drop(self, w: EtcdWatch) -> bool:
        """Under the lock: stop carrying ``w``; False if it was not live. The
        last watch takes the stream with it."""
        if not w.live:
            return False
        w.live = False
        del self._watches[w]
        stream = self._stream
        if stream is not None and w.stream is stream and w.stream_id is not None:
            # A creation still unanswered is cancelled when its answer comes.
            stream.by_id.pop(w.stream_id, None)
            stream.cancel_watch(w.stream_id)
        if not self._watches:
            self._close_stream()
        self._cond.notify_all()
        return True

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _send_create(self, stream: _WatchStream, w: EtcdWatch) -> None:
        w.stream, w.stream_id = stream, None
        stream.create(w)

    # -- the thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                stream = self._open_when_due()
                if stream is None:
                    return
                self._ended(stream, self._serve(stream))
        except Exception as exc:
            if self._stopping:  # e.g. a token renewal cut short by close()
                logger.debug("The watch thread for etcd at %s ended while closing: %r",
                             self.conn.where, exc)
                return
            # A bug here must not stop every watch of the store in silence:
            # end them, and let the next watch start a fresh thread.
            logger.exception("The watch thread for etcd at %s failed; ending its watches.",
                             self.conn.where)
            with self._cond:
                self._close_stream()
            why = f"the watch thread for etcd at {self.conn.where} failed: {exc!r}"
            self._end_all(lambda w: StoreError(why), exc)
            with self._cond:
                self._thread = None
                if self._watches and not self._stopping:  # started meanwhile
                    self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    def _open_when_due(self) -> _WatchStream | None:
        """Wait until a stream is wanted and the backoff has passed, then open
        one and create every live watch on it; None once the store closes."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                if not self._watches:
                    self._cond.wait()
                    continue
                left = self._reopen_at - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                try:
                    stream = _WatchStream(self.conn, renewed=self._fresh_token)
                except ValueError:  # the channel is closed: the store is closing
                    return None
                self._fresh_token = False
                for w in self._watches:
                    self._send_create(stream, w)
                self._stream = stream
                return stream

    def _serve(self, stream: _WatchStream) -> _StreamEnd:
        """Read ``stream`` until it ends or must be replaced."""
        try:
            for resp in stream.call:
                end = self._handle(stream, resp)
                if end is not None:
                    return end
            return _StreamEnd("the server ended the stream")
        except grpc.RpcError as exc:
            return _StreamEnd(rpc_error_text(exc), error=exc)

    def _ended(self, stream: _WatchStream, end: _StreamEnd) -> None:
        """After ``stream`` ended: nothing if it was closed on purpose;
        otherwise end every watch, or schedule the next stream."""
        with self._cond:
            if stream is not self._stream or self._stopping:
                stream.close()
                return  # the last watch went, or the store is closing
            self._close_stream()
        if end.error is not None and end.error.code() not in _WATCH_RETRY_CODES:
            end = self._stream_refused(stream, end.error)
            if end is None:
                return
        with self._cond:
            if self._stopping:
                return
            n = len(self._watches)
            if end.failure:
                # The break may be an etcd restart, which forgets every token:
                # a refusal on the next stream deserves a fresh token again.
                for w in self._watches:
                    w.token_retried = False
                self._failures += 1
                if self._failures == 1:
                    logger.warning("Watch stream to etcd at %s broke (%s); re-creating its %d "
                                   "watches, each from the revision after its last event.",
                                   self.conn.where, end.why, n)
                self._reopen_at = time.monotonic() + reconnect_delay(self._failures)
            else:
                logger.debug("Reopening the watch stream to etcd at %s (%s).",
                             self.conn.where, end.why)
            if n:
                self.conn.ops.add("watch_reconnect", n)

    def _stream_refused(self, stream: _WatchStream, exc: grpc.RpcError) -> _StreamEnd | None:
        """etcd ended the stream with an error a reconnect does not cure. For
        a stale token: the next stream's (None when getting one failed for
        good); for anything else every watch ends, as each would alone."""
        try:
            if self.conn.token_refused(exc) and not stream.renewed:
                end = self._renew_token(stream, "the watch stream")
                if end is None:
                    self._fresh_token = True
                    return _StreamEnd("etcd refused the stream's auth token", failure=False)
                return end
        except StoreAuthError as refused:
            message = str(refused)
            self._end_all(lambda w: StoreAuthError(message), exc)
            return None
        self._end_all(lambda w: self.conn.translate(exc, f"watch on {w.what}", 0.0,
                                                      key_text(w.key)), exc)
        return None

    def _renew_token(self, stream: _WatchStream, whose: str) -> _StreamEnd | None:
        """Re-authenticate after etcd refused ``stream``'s token. None: a
        fresh token is there; a failed try reopens with backoff (and tries
        again).

        Raises:
            StoreAuthError: etcd refused the user and password.
        """
        try:
            self.conn.refresh_token(stream.token)
        except StoreAuthError:
            raise
        except StoreError as exc:
            if self.conn.closed:
                return _StreamEnd("the store is closing")
            logger.info("Watch on %s: authenticating again at etcd %s failed (%s); retrying.",
                        whose, self.conn.where, exc)
            return _StreamEnd(f"authenticating again failed: {exc}")
        return None

    def _handle(self, stream: _WatchStream, resp: rpc_pb2.WatchResponse) -> _StreamEnd | None:
        """Route one answer; a _StreamEnd says to replace the stream."""
        if resp.created:
            return self._created(stream, resp)
        with self._cond:
            w = stream.by_id.get(resp.watch_id)
            if w is None or not w.live:
                return None  # cancelled: late events, or etcd confirming the cancel
        if resp.compact_revision > 0:
            self._fail(w, WatchCompactedError(
                f"watch on {w.what} asked for revision {w.next_revision}, but etcd "
                f"compacted history up to {resp.compact_revision}",
                resp.compact_revision,
            ))
        elif resp.canceled:
            reason = resp.cancel_reason or "no reason given"
            self._fail(w, StoreError(f"etcd cancelled the watch on {w.what}: {reason}"))
        elif resp.events:
            self._deliver(w, [to_event(e) for e in resp.events])
        return None

    def _created(self, stream: _WatchStream, resp: rpc_pb2.WatchResponse) -> _StreamEnd | None:
        with self._cond:
            if not stream.pending:
                logger.warning("etcd at %s answered a watch creation that was never sent "
                               "(watch id %d); ignoring it.", self.conn.where, resp.watch_id)
                return None
            w = stream.pending.popleft()
            refused = resp.canceled
            if refused:
                if not w.live:  # cancelled before etcd answered: nobody to tell
                    self._unstall(stream, resp.watch_id)
                    return None
            else:
                if not w.live:
                    stream.cancel_watch(resp.watch_id)  # cancelled before etcd created it
                    return None
                w.stream_id = resp.watch_id
                stream.by_id[resp.watch_id] = w
                w.token_retried = False
                stream.renewed = False
                if not stream.answered:
                    stream.answered = True
                    if self._failures:
                        logger.info("Watch stream to etcd at %s works again: %d watches resumed "
                                    "from revision %d or later, each where it left off.",
                                    self.conn.where, len(self._watches),
                                    min(x.next_revision for x in self._watches))
                    self._failures = 0
        if refused:
            return self._refused(stream, w, resp.cancel_reason or "no reason given",
                                 resp.watch_id)
        return None

    def _unstall(self, stream: _WatchStream, refused_id: int) -> None:
        """Under the lock, after etcd refused a creation on ``stream``: create
        again the watch whose id the refusal named, if one of ours has it.

        etcd 3.5 answers a creation it refuses for permission with the id the
        request asked for (0: our stubs cannot ask for another) and then holds
        back, for good, every event of the stream's watch that has that id.
        Its events so far have all been delivered (they came before the
        refusal), so it resumes from ``next_revision`` with nothing lost.
        """
        stalled = stream.by_id.pop(refused_id, None)
        if stalled is None or not stalled.live:
            return
        logger.info("etcd at %s stopped the events of the watch on %s when it refused another "
                    "watch on the same stream; creating it again from revision %d.",
                    self.conn.where, stalled.what, stalled.next_revision)
        stream.cancel_watch(refused_id)
        self._send_create(stream, stalled)

    def _refused(self, stream: _WatchStream, w: EtcdWatch, reason: str,
                 refused_id: int) -> _StreamEnd | None:
        """etcd refused to create ``w``: end it, or renew the token and replace
        the stream."""
        if not is_auth_cancel(reason):
            err = StoreError(f"etcd cancelled the watch on {w.what}: {reason}")
            return self._refused_for_good(stream, w, err, refused_id)
        conn = self.conn
        if conn.uses_auth and not w.token_retried:
            try:
                end = self._renew_token(stream, w.what)
            except StoreAuthError as exc:
                return self._refused_for_good(stream, w, exc, refused_id)
            if end is not None:
                return end
            w.token_retried = True
            return _StreamEnd(f"etcd refused its auth token ({reason})", failure=False)
        if "user name is empty" in reason and not conn.uses_auth:
            err = auth_required_error(conn.where)
        else:
            err = permission_error(conn.where, "watch", w.key, conn.security)
        return self._refused_for_good(stream, w, err, refused_id)

    def _refused_for_good(self, stream: _WatchStream, w: EtcdWatch, err: StoreError,
                          refused_id: int) -> None:
        """End ``w`` with ``err``; the stream goes on, its other watches too."""
        with self._cond:
            if stream is self._stream:
                self._unstall(stream, refused_id)
        self._fail(w, err)

    def _deliver(self, w: EtcdWatch, events: list) -> None:
        with self._cond:
            if not w.live:
                return
            # Advance before delivering: a failing callback must not cause a replay.
            w.next_revision = events[-1].kv.mod_revision + 1
            self._running = w
        try:
            self.conn.ops.add("watch_event", len(events))
            w._on_events(events)
        except Exception:
            logger.exception("The callback of the watch on %s failed on revision %d; "
                             "the watch goes on.", w.what, events[-1].revision)
        finally:
            self._callback_done()

    def _fail(self, w: EtcdWatch, err: StoreError, cause: BaseException | None = None) -> None:
        """End ``w`` (only) with ``err``, told to its error callback."""
        err.__cause__ = cause
        with self._cond:
            w.ended = True
            if not self._drop(w):
                return  # cancelled meanwhile: nobody is listening
            self._running = w
        try:
            logger.warning("Watch on %s at etcd %s ended: %s", w.what, self.conn.where, err)
            if w._on_error is not None:
                w._on_error(err)
        except Exception:
            logger.exception("The error callback of the watch on %s failed.", w.what)
        finally:
            self._callback_done()

    def _end_all(self, error_of: Callable[[EtcdWatch], StoreError],
                 cause: BaseException) -> None:
        with self._cond:
            watches = list(self._watches)
        for w in watches:
            self._fail(w, error_of(w), cause)

    def _callback_done(self) -> None:
        with self._cond:
            self._running = None
            self._cond.notify_all()
