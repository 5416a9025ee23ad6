"""Worker heartbeats as datagrams on a second Unix socket: the idle agent's cheap path.

A heartbeat is the ``elastic.v1.WorkerChannel`` Heartbeat exchange without
gRPC: the worker sends one serialised ``WorkerChannelHeartbeatRequest`` as a
datagram to :class:`HeartbeatSocket`'s path and receives one serialised
``WorkerChannelHeartbeatResponse`` back (the client:
:class:`elastic.worker.channel.WorkerChannelClient`). Why not the gRPC method:
each unary call cost the agent about 2 ms of CPU (its poll thread, a pool
thread, HTTP/2 framing), and the heartbeats of two idle workers were a
fifth of an idle agent's CPU; a datagram costs it a few tens of
microseconds. The gRPC Heartbeat stays served, for workers of an older
library and nodes whose socket directory leaves no room for this path.

What stays as it was:

* the meaning: the same request goes through the same checks
  (:func:`agent.grpc_input.check_heartbeat`) to the same
  :class:`agent.grpc_server.HeartbeatSink`, and the answer carries the same
  stop_requested and hold. A worker that stops sending is judged hung by the
  agent exactly as before: the agent never waited on the transport;
* who may send: the socket lives beside the gRPC one in the node's private
  directory, mode 0600, so only this user's processes reach it;
* hostile input: a datagram over :data:`MAX_DATAGRAM_BYTES`, bytes that are
  not a request, or values no worker sends are refused, logged as a warning
  and answered with nothing (the worker counts that as an agent that did not
  answer);
* an agent restart: a worker's next datagram goes to the new agent's socket
  at the same path.

Answers are sent without blocking: a worker that does not read them cannot
stall the agent's thread, it only loses the answer.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading

from agent.grpc_input import check_heartbeat
from elastic.errors import ElasticError
from elastic.v1 import agent_pb2
from elastic.worker.channel import MAX_HEARTBEAT_DATAGRAM_BYTES

logger = logging.getLogger(__name__)

# A heartbeat request is well under 100 bytes; anything longer is not one.
MAX_DATAGRAM_BYTES = MAX_HEARTBEAT_DATAGRAM_BYTES
# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_UNIX_PATH_BYTES = 107
# As plain ints: the enum's operators cost more than the rest of the check.
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)


def datagram_path(worker_socket: str) -> str | None:
    """The heartbeat socket's path beside ``worker_socket`` (``agent.sock`` ->
    ``agent.hb.sock``); None when it would not fit in a Unix socket address
    (the workers then send their heartbeats over gRPC), and off Linux: the
    client binds its socket to an abstract address, which only Linux has."""
    if not sys.platform.startswith("linux"):
        return None
    root, ext = os.path.splitext(worker_socket)
    path = f"{root}.hb{ext or '.sock'}"
    return path if len(os.fsencode(path)) <= _MAX_UNIX_PATH_BYTES else None


class HeartbeatSocket:
    """Serves heartbeat datagrams at ``path`` to ``sink`` on one thread.

    The thread sleeps in the kernel between datagrams: no timer, no polling.
    Not restartable: after :meth:`stop`, build a new one.
    """

    def __init__(self, path: str, sink) -> None:
        """``sink`` is an :class:`agent.grpc_server.HeartbeatSink` (only its
        ``heartbeat`` is used). Nothing is bound until :meth:`bind`."""
        self.path = path
        self._sink = sink
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def bind(self) -> None:
        """Bind the socket (the caller has made ``path`` bindable: no live
        owner, no stale file) and restrict it to this user. Raises OSError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o600)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def start(self) -> None:
        """Serve on a daemon thread; after :meth:`bind`."""
        if self._sock is None:
            raise ElasticError("HeartbeatSocket.start() before bind()")
        self._thread = threading.Thread(target=self._serve, args=(self._sock,),
                                        name="agent-heartbeats", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop serving, close the socket and remove its file. Idempotent."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._stopping.set()
        # shutdown() wakes the thread blocked in recvmsg (it returns no data).
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout_s)
        sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self, sock: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                data, _, flags, sender = sock.recvmsg(MAX_DATAGRAM_BYTES + 1)
            except InterruptedError:
                continue
            except OSError as exc:
                if not self._stopping.is_set():
                    logger.error("The agent stopped serving heartbeat datagrams on %s: %s.",
                                 self.path, exc)
                return
            if self._stopping.is_set():
                return
            answer = self._answer(data, flags, sender)
            if answer is not None and sender:
                try:
                    sock.sendto(answer, _MSG_DONTWAIT, sender)
                except OSError as exc:  # the worker is gone, or does not read its answers
                    logger.debug("Could not answer a heartbeat datagram: %s.", exc)

    def _answer(self, data: bytes, flags: int, sender) -> bytes | None:
        """The serialised answer to one datagram; None (and a warning) for one refused."""
        if flags & _MSG_TRUNC or len(data) > MAX_DATAGRAM_BYTES:
            logger.warning("Refused a heartbeat datagram over %d bytes on %s.",
                           MAX_DATAGRAM_BYTES, self.path)
            return None
        if not sender:
            # Nowhere to answer; the client always binds its socket.
            logger.warning("Refused a heartbeat datagram from an unbound socket on %s.",
                           self.path)
            return None
        try:
            request = agent_pb2.WorkerChannelHeartbeatRequest.FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, or anything it raises
            logger.warning("Refused a malformed heartbeat datagram (%d bytes) on %s.",
                           len(data), self.path)
            return None
        try:
            check_heartbeat(request)
            stop, hold = self._sink.heartbeat(request)
        except ElasticError as exc:
            logger.warning("The agent refused a heartbeat datagram of pid %d: %s.",
                           request.pid, exc)
            return None
        except Exception:  # noqa: BLE001 (a bug: logged with its trace; the thread goes on)
            logger.exception("The agent failed serving a heartbeat datagram of pid %d.",
                             request.pid)
            return None
        return agent_pb2.WorkerChannelHeartbeatResponse(
            stop_requested=bool(stop), hold=bool(hold)).SerializeToString()
