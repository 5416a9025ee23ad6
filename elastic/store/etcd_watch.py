"""Watches of the etcd backend: one thread and one Watch stream each.

Part of the etcd backend (:mod:`elastic.store.etcd`): :meth:`EtcdStore.watch`
creates and starts an :class:`EtcdWatch`. The stream carries no deadline;
HTTP/2 keepalive pings detect a dead connection under it, and any transient
failure re-creates it from the revision after the last one delivered, so no
event is lost or repeated across reconnects and etcd restarts.

With a user, a stream carries the auth token of when it was opened. etcd
checks it when the watch is created, and refuses the creation (a cancelled
watch) when the token has expired meanwhile (etcd restarted, or the stream
was reopened after the token's TTL): the watch then re-authenticates and
reopens once; a refusal with a fresh token is a real lack of permission, and
ends the watch with :class:`~elastic.errors.StoreAuthError`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc
from pyetcd.etcdrpc import rpc_pb2

from elastic.errors import StoreAuthError, StoreError, WatchCompactedError
from elastic.store.api import ErrorCallback, EventsCallback, Watch
from elastic.store.etcd_auth import (
    auth_required_error,
    is_auth_cancel,
    is_token_error,
    key_text,
    permission_error,
)
from elastic.store.etcd_convert import key_range, rpc_error_text, to_event
from elastic.store.retry import reconnect_delay

if TYPE_CHECKING:
    from elastic.store.etcd import EtcdStore

logger = logging.getLogger(__name__)

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


class EtcdWatch(Watch):
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
        self._key = key
        self._range = key_range(key, prefix)
        self.next_revision = start_revision
        self._on_events = on_events
        self._on_error = on_error
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._created = False  # whether the current stream's watch was created
        self._failures = 0  # stream failures in a row
        self._token: str | None = None  # the auth token the current stream carries
        self._renewed = False  # the current stream's token is fresh after a refusal
        self._reconnect: str | None = None  # set by _handle: why to reopen the stream
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
        self._token = self._store._token()
        try:
            # One request, then the request side closes; etcd keeps the stream.
            call = self._store._watch.Watch(iter([request]),
                                            metadata=self._store._metadata(self._token))
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
                    reconnect, self._reconnect = self._reconnect, None
                    return reconnect
            return "the server ended the stream"
        except grpc.RpcError as exc:
            if self._cancelled.is_set():
                return None
            if exc.code() in _WATCH_RETRY_CODES:
                return rpc_error_text(exc)
            try:
                if is_token_error(exc) and self._renew_token():
                    return "etcd refused the auth token"
                err = self._store._translate(exc, f"watch on {self._what}", 0.0,
                                             key_text(self._key))
            except StoreAuthError as refused:
                err = refused
            self._fail(err, exc)
            return None
        finally:
            call.cancel()
            with self._lock:
                self._call = None

    def _handle(self, resp: rpc_pb2.WatchResponse) -> bool:
        """Process one response. False ends this stream, and the watch with it
        unless ``_reconnect`` says why to open another."""
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
            if is_auth_cancel(reason):
                try:
                    if self._renew_token():
                        self._reconnect = f"etcd refused the watch's auth token ({reason})"
                        return False
                    if "user name is empty" in reason and self._store._auth is None:
                        err: StoreError = auth_required_error(self._store._where)
                    else:
                        err = permission_error(self._store._where, "watch", self._key,
                                               self._store.security)
                except StoreAuthError as exc:
                    err = exc
                self._fail(err, None)
                return False
            self._fail(StoreError(f"etcd cancelled the watch on {self._what}: {reason}"), None)
            return False
        if resp.created:
            self._created = True
            self._renewed = False
            if self._failures:
                logger.info("Watch on %s at etcd %s resumed from revision %d.",
                            self._what, self._store._where, self.next_revision)
            return True
        if resp.events:
            events = [to_event(e) for e in resp.events]
            # Advance before delivering: a failing callback must not cause a replay.
            self.next_revision = events[-1].kv.mod_revision + 1
            self._store.ops.add("watch_event", len(events))
            try:
                self._on_events(events)
            except Exception:
                logger.exception("The callback of the watch on %s failed on revision %d; "
                                 "the watch goes on.", self._what, events[-1].revision)
        return True

    def _renew_token(self) -> bool:
        """After etcd refused this stream's auth token: whether to reopen the
        stream. True with a fresh token, or after a failed try to get one
        (the reconnect backoff tries again); False when the token was fresh
        already or there is no user (the refusal is real).

        Raises:
            StoreAuthError: etcd refused the user and password.
        """
        if self._store._auth is None or self._renewed:
            return False
        try:
            self._store._refresh_token(self._token, self._store.request_timeout_s)
        except StoreAuthError:
            raise
        except StoreError as exc:
            logger.info("Watch on %s: authenticating again at etcd %s failed (%s); "
                        "retrying.", self._what, self._store._where, exc)
            return True
        self._renewed = True
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
