"""The etcd backend's two long-lived streams (Watch, LeaseKeepAlive) on a
``grpc.aio`` channel, used from ordinary threads.

Part of the etcd backend (:mod:`elastic.store.etcd`): the connection's
(:mod:`.etcd_conn`) :class:`EtcdStreams` opens a :class:`BidiStream` for its
:class:`~elastic.store.etcd_watch.WatchMux` and its
:class:`~elastic.store.etcd_lease.KeepAliveLoop`, which keep their threads and
locks; only the stream underneath changes.

Why not the synchronous API, as for every other call: an idle agent holds
both streams open for its whole life, and a synchronous stream costs
wake-ups while nothing happens. Its reader waits in grpc's wait loop, which
wakes every 0.1 s, and the channel runs a spin thread, waking every 0.2 s,
while any stream is open: 25 Python wake-ups a second for two streams, a
good part of an idle agent's CPU. On ``grpc.aio`` an idle stream costs
nothing until a message comes: the event loop sleeps in its selector,
grpc's poller in the completion queue, and a reader thread in a blocking
``SimpleQueue.get``.

One aio channel per store, on the process's shared event loop
(:func:`elastic.loop_thread.acquire_shared`), taken with the first stream
and given back by :meth:`EtcdStreams.close`. The loop runs only short
coroutines (these and the agent's servers'), never a caller's code, so a
thread that waits for it (to open a stream) waits microseconds.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable, Iterator

import grpc
import grpc.aio

from elastic import aio_fork
from elastic.loop_thread import LoopThread, acquire_shared, release_shared
from elastic.store.etcdpb import rpc_pb2_grpc

logger = logging.getLogger(__name__)

# Ends a stream's iteration (etcd closed the stream with OK).
_END = object()


def _cancelled() -> grpc.RpcError:
    """What reading a stream raises once it was cancelled here, as the
    synchronous API does (there, the call itself is that error)."""
    return grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, details="Locally cancelled")


class BidiStream:
    """One bidirectional call: ``send`` and ``close`` from any thread; one
    thread iterates the answers.

    Iteration blocks until the next answer, ends when etcd closes the stream
    with OK, and raises :class:`grpc.RpcError` (``code()``, ``details()``)
    when the call fails, with CANCELLED once it was closed here.
    """

    def __init__(self, streams: EtcdStreams, call: Any):
        self._streams = streams
        self._call = call
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._writes: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    def _start(self) -> None:
        """On the loop: start the reading and writing tasks."""
        self._tasks = [asyncio.create_task(self._read_all()),
                       asyncio.create_task(self._write_all())]

    async def _read_all(self) -> None:
        outcome: object = _END
        try:
            while (answer := await self._call.read()) is not grpc.aio.EOF:
                self._answers.put(answer)
        except grpc.RpcError as exc:
            outcome = exc
        except asyncio.CancelledError:  # the call (or this task, at close) was cancelled
            outcome = _cancelled()
        except Exception as exc:  # a bug or an answer that does not parse: end the stream
            logger.exception("Reading an etcd stream failed.")
            outcome = grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, details=repr(exc))
        finally:
            self._answers.put(outcome)
            self._writes.put_nowait(None)  # ends the writer
            self._streams.forget(self)

    async def _write_all(self) -> None:
        while (request := await self._writes.get()) is not None:
            try:
                await self._call.write(request)
            except (grpc.RpcError, asyncio.InvalidStateError):
                return  # the call is over: its reader tells why

    def send(self, request: Any) -> None:
        """Queue ``request``; a stream that has ended drops it."""
        self._streams.run_soon(self._writes.put_nowait, request)

    def close(self) -> None:
        """Cancel the call (idempotent): iteration ends with CANCELLED, unless
        it had already ended."""
        if not self._streams.run_soon(self._cancel_now):
            self.abandon()

    def _cancel_now(self) -> None:
        self._call.cancel()
        for task in self._tasks:
            task.cancel()

    def abandon(self) -> None:
        """The loop is gone: end iteration (a second end item is never read)."""
        self._answers.put(_cancelled())

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._answers.get()
            if item is _END or isinstance(item, BaseException):
                self._answers.put(item)  # a later iteration ends the same way
                if item is _END:
                    return
                raise item
            yield item


class EtcdStreams:
    """The aio channel, on the shared event loop, that carries one store's streams.

    ``open_channel`` makes the channel; it is called on the loop thread, once.
    """

    def __init__(self, open_channel: Callable[[], grpc.aio.Channel]):
        self._open_channel = open_channel
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._channel: grpc.aio.Channel | None = None
        self._open: set[BidiStream] = set()
        self._closed = False

    def watch(self, metadata) -> BidiStream:
        """A Watch stream. No wait_for_ready: while etcd is down the stream
        fails at once. Raises ValueError once closed (as a closed channel does)."""
        return self._start_call(lambda ch: rpc_pb2_grpc.WatchStub(ch).Watch(metadata=metadata))

    def lease_keep_alive(self, metadata) -> BidiStream:
        """A LeaseKeepAlive stream that waits for a ready connection (the
        channel may be failing over to another member). Raises ValueError
        once closed."""
        return self._start_call(lambda ch: rpc_pb2_grpc.LeaseStub(ch).LeaseKeepAlive(
            metadata=metadata, wait_for_ready=True))

    def _start_call(self, make_call: Callable[[grpc.aio.Channel], Any]) -> BidiStream:
        loop = self._running_loop()

        async def start() -> BidiStream:
            if self._channel is None:
                self._channel = aio_fork.track(self._open_channel())
            stream = BidiStream(self, make_call(self._channel))
            stream._start()
            with self._lock:
                self._open.add(stream)
            return stream

        return loop.run(start(), None)

    def _running_loop(self) -> LoopThread:
        with self._lock:
            if self._closed:
                raise ValueError("the store's etcd streams are closed")
            if self._loop is None:
                self._loop = acquire_shared()
            return self._loop

    def run_soon(self, fn: Callable, *args) -> bool:
        """Run ``fn(*args)`` on the loop; False if the loop has ended."""
        loop = self._loop
        return loop is not None and loop.call_soon(fn, *args)

    def forget(self, stream: BidiStream) -> None:
        with self._lock:
            self._open.discard(stream)

    def close(self, timeout_s: float = 2.0) -> None:
        """Cancel every stream, close the channel and give the loop back,
        waiting at most about ``timeout_s``. Idempotent."""
        with self._lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shut() -> None:
            with self._lock:
                streams = list(self._open)
            for stream in streams:
                stream._cancel_now()
            if self._channel is not None:
                await self._channel.close()
            # Let the cancelled tasks finish: a pending task at loop.close() is a warning.
            await asyncio.gather(*(t for s in streams for t in s._tasks), return_exceptions=True)

        try:
            loop.run(shut(), timeout_s)
        except Exception as exc:  # closing goes on whatever the channel says
            logger.debug("Closing the etcd streams' channel: %r", exc)
        release_shared(loop, timeout_s)
        with self._lock:
            left, self._open = list(self._open), set()
        for stream in left:  # never got to end on the loop: end their readers here
            stream.abandon()
