"""The worker's end of the local channel to its agent: heartbeats over a Unix socket.

Heartbeats go as datagrams to the agent's heartbeat socket when it has one
(:data:`elastic.worker_env.HEARTBEAT_SOCKET`; the protocol and why:
:mod:`agent.heartbeat_socket`), else as the gRPC Heartbeat call; everything
else (checkpoint commits, reports) is gRPC. Does not import torch, so it can
be used (and tested) without it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import grpc

from elastic.errors import AgentUnreachableError
from elastic.net import fast_reconnect_options
from elastic.v1 import agent_pb2, agent_pb2_grpc

logger = logging.getLogger(__name__)

# The agent may restart while its workers live on; reconnect within about a second.
_CHANNEL_OPTIONS = fast_reconnect_options()
# The agent is restarting or busy: normal, and the next heartbeat will tell.
_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# The largest heartbeat datagram the agent reads (agent.heartbeat_socket); a
# request is well under 100 bytes.
MAX_HEARTBEAT_DATAGRAM_BYTES = 4096


class WorkerChannelClient:
    """Sends this worker's heartbeats to the agent's ``elastic.v1.WorkerChannel`` at a Unix socket.

    Thread-safe. Every call waits at most ``timeout_s`` seconds. With
    ``heartbeat_socket`` (the agent's datagram socket), heartbeats go there
    instead of the gRPC call.
    """

    def __init__(self, socket_path: str, timeout_s: float = 1.0,
                 heartbeat_socket: str | None = None):
        self._target = f"unix:{socket_path}"
        self._timeout_s = timeout_s
        self._datagrams = _HeartbeatDatagrams(heartbeat_socket, timeout_s) \
            if heartbeat_socket else None
        self._channel = grpc.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
        self._stub = agent_pb2_grpc.WorkerChannelStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        self._last_failure: grpc.StatusCode | None = None
        # Monotonic time of the agent's last answer that did not ask to hold
        # (the agent that started this worker vouched for it just now).
        self.confirmed_at = time.monotonic()

    def heartbeat(
        self,
        rank: int,
        local_rank: int,
        pid: int,
        round: int,  # noqa: A002 (the proto field's name)
        step: int,
        saving_for_s: float = 0.0,
        exiting: bool = False,
        snapshots: int = 0,
        step_time_s: float = 0.0,
        step_busy_s: float = 0.0,
    ) -> bool:
        """Tell the agent this worker is alive at ``step`` (-1 before the first) of ``round``.

        ``saving_for_s`` > 0 says a checkpoint save runs for up to that many
        seconds, during which the agent does not judge progress. Returns
        stop_requested: True when the agent is stopping this round and the
        worker should exit. ``exiting`` says the script ended: from then on
        the agent does not judge this worker's silence. ``snapshots``: the
        memory-tier snapshots this process completed so far (the agent
        replicates when the count moves). ``step_time_s``: the mean seconds
        per step since the last heartbeat (0: none timed); ``step_busy_s``: the
        mean seconds the training thread was busy per step (0: not measured).

        Never raises for a failed call: when the agent cannot be reached
        (it may be restarting), answers with an error, or this client is
        closed, returns False; the failure is logged once per kind (debug for
        unreachable, warning otherwise).
        """
        request = agent_pb2.WorkerChannelHeartbeatRequest(
            rank=rank, local_rank=local_rank, pid=pid, round=round, step=step,
            saving_for_s=saving_for_s, exiting=exiting, snapshots=snapshots,
            step_time_s=step_time_s, step_busy_s=step_busy_s,
        )
        with self._lock:
            if self._closed:
                logger.debug("Heartbeat of rank %d dropped: the channel to the agent is closed.",
                             rank)
                return False
            stub = self._stub
        if self._datagrams is not None:
            response, failure = self._datagrams.exchange(request)
            if response is None:
                self._note_datagram_failure(failure, rank, pid, round)
                return False
        else:
            try:
                response = stub.Heartbeat(request, timeout=self._timeout_s)
            except grpc.RpcError as exc:
                self._note_failure(exc, rank, pid, round)
                return False
            except ValueError:  # close() ran while this call was starting
                return False
        if self._last_failure is not None:
            logger.debug("Rank %d (pid %d, round %d) reaches the agent at %s again.",
                         rank, pid, round, self._target)
            self._last_failure = None
        if not response.hold:
            self.confirmed_at = time.monotonic()
        return response.stop_requested

    def _note_failure(self, exc: grpc.RpcError, rank: int, pid: int, round_: int) -> None:
        code = exc.code()
        if code == self._last_failure:
            return
        self._last_failure = code
        if code in _TRANSIENT_CODES:
            logger.debug("Heartbeat of rank %d (pid %d, round %d) to the agent at %s failed: %s; "
                         "the agent may be restarting.", rank, pid, round_, self._target, code.name)
        else:
            logger.warning("Heartbeat of rank %d (pid %d, round %d) to the agent at %s failed: "
                           "%s: %s.", rank, pid, round_, self._target, code.name, exc.details())

    def _note_datagram_failure(self, failure: str, rank: int, pid: int, round_: int) -> None:
        # No answer is what an agent restarting, busy or refusing the request
        # (it logs why) looks like: debug, once until the agent answers again.
        if self._last_failure is not None:
            return
        self._last_failure = grpc.StatusCode.UNAVAILABLE
        logger.debug("Heartbeat of rank %d (pid %d, round %d) to the agent at %s got no answer: "
                     "%s; the agent may be restarting.", rank, pid, round_,
                     self._datagrams.path if self._datagrams else self._target, failure)

    def commit_checkpoint(self, *, step: int, round: int, world_size: int,  # noqa: A002
                          path: str, time: float, save_s: float = 0.0,
                          size_bytes: int = 0) -> tuple[bool, str]:
        """Ask the agent to record a checkpoint as the job's latest, fenced by
        ``round``: (True, "") or (False, why it was refused). ``save_s`` and
        ``size_bytes`` say how the save went (0: not measured).

        Raises AgentUnreachableError when the agent cannot be asked (the save
        then fails: nothing may count as committed without the fence).
        """
        entry = agent_pb2.CheckpointEntry(step=step, round=round, world_size=world_size,
                                          path=path, time=time, save_s=save_s,
                                          size_bytes=size_bytes)
        resp = self._ask(self._stub.CommitCheckpoint,
                         agent_pb2.WorkerChannelCommitCheckpointRequest(entry=entry),
                         max(self._timeout_s, 10.0), f"commit checkpoint of step {step} through")
        return resp.committed, resp.message

    def latest_checkpoint(self) -> dict | None:
        """The job's latest committed checkpoint as a dict (step, round,
        world_size, path, time), None when there is none. Raises
        AgentUnreachableError when the agent cannot be asked."""
        resp = self._ask(self._stub.LatestCheckpoint,
                         agent_pb2.WorkerChannelLatestCheckpointRequest(),
                         max(self._timeout_s, 10.0), "read the latest checkpoint from")
        if not resp.found:
            return None
        e = resp.entry
        return {"step": e.step, "round": e.round, "world_size": e.world_size, "path": e.path,
                "time": e.time, "save_s": e.save_s, "size_bytes": e.size_bytes}

    def report_checkpoint_failure(self, *, step: int, round: int,  # noqa: A002
                                  rank: int, message: str, timeout_s: float = 2.0) -> None:
        """Tell the agent that the save of ``step`` failed, so that it records
        an event. Waits at most ``timeout_s``.

        Raises AgentUnreachableError when the agent cannot be asked or answers
        with an error (the caller decides that the report is best effort).
        """
        request = agent_pb2.WorkerChannelReportCheckpointFailureRequest(
            step=step, round=round, rank=rank, message=message)
        self._ask(self._stub.ReportCheckpointFailure, request, timeout_s,
                  f"report the failed save of checkpoint step {step} to")

    def report_restore(self, *, step: int, round: int, rank: int,  # noqa: A002
                       restore_s: float, size_bytes: int, timeout_s: float = 2.0) -> None:
        """Tell the agent that this worker restored the checkpoint of ``step``
        (``size_bytes``, all ranks' files) in ``restore_s``. Waits at most
        ``timeout_s``.

        Raises AgentUnreachableError when the agent cannot be asked or answers
        with an error (the caller decides that the report is best effort).
        """
        request = agent_pb2.WorkerChannelReportRestoreRequest(
            step=step, round=round, rank=rank, restore_s=restore_s, size_bytes=size_bytes)
        self._ask(self._stub.ReportRestore, request, timeout_s,
                  f"report the restore of checkpoint step {step} to")

    def _ask(self, rpc: Any, request: Any, timeout_s: float, what: str) -> Any:
        """``rpc(request)`` within ``timeout_s``; raises AgentUnreachableError
        ("cannot <what> the agent at ...") when the agent cannot be asked or
        answers with an error."""
        try:
            return rpc(request, timeout=timeout_s)
        except (grpc.RpcError, ValueError) as exc:  # ValueError: the channel is closed
            raise AgentUnreachableError(
                f"cannot {what} the agent at {self._target}: {_describe(exc)}") from exc

    def close(self) -> None:
        """Close the channel; later heartbeats return False. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._datagrams is not None:
            self._datagrams.close()
        self._channel.close()

    def __enter__(self) -> WorkerChannelClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _HeartbeatDatagrams:
    """One heartbeat request out, its answer back, over the agent's datagram socket.

    The socket is bound (an abstract address, so the agent can answer) and
    connected to the agent's path: the kernel then delivers only what that
    socket sends, so no other process can forge an answer. When the agent
    restarts, its new socket at the same path is another peer; the first
    send to the old one fails and the next exchange connects afresh.
    """

    def __init__(self, path: str, timeout_s: float):
        self.path = path
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def exchange(self, request: agent_pb2.WorkerChannelHeartbeatRequest
                 ) -> tuple[agent_pb2.WorkerChannelHeartbeatResponse | None, str]:
        """(the agent's answer, "") or (None, why there is none); never raises."""
        with self._lock:
            if self._closed:
                return None, "the channel is closed"
            try:
                sock = self._connected()
                self._drop_late_answers(sock)
                sock.send(request.SerializeToString())
                data = sock.recv(MAX_HEARTBEAT_DATAGRAM_BYTES)
            except TimeoutError:
                return None, f"no answer within {self._timeout_s:g} s"
            except OSError as exc:
                self._reset()  # the agent's socket is gone or new: connect afresh next time
                return None, exc.strerror or str(exc)
        try:
            return agent_pb2.WorkerChannelHeartbeatResponse.FromString(data), ""
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            return None, f"a malformed answer ({len(data)} bytes)"

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                sock.bind("")  # Linux: an abstract address of the kernel's choosing
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            sock.settimeout(self._timeout_s)
            self._sock = sock
        return self._sock

    def _drop_late_answers(self, sock: socket.socket) -> None:
        # An answer that came after its exchange timed out would otherwise be
        # taken for the answer to this request.
        sock.setblocking(False)
        try:
            while True:
                sock.recv(MAX_HEARTBEAT_DATAGRAM_BYTES)
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            sock.settimeout(self._timeout_s)

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._reset()


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return "the channel is closed"
