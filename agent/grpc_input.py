"""What arrives at the agent's gRPC servers is hostile input: size limits and checks.

Anything that reaches ``--listen`` (any host on the network, unless mutual TLS
keeps it out) or the workers' socket (any process of the agent's user) may
send anything. The servers (:mod:`agent.grpc_server`) therefore

* refuse a message over :data:`MAX_MESSAGE_BYTES` before reading it: gRPC
  answers RESOURCE_EXHAUSTED (no request the agent serves comes near it; a
  free-text reason is cut to 1,024 characters anyway);
* parse each request themselves (:class:`ParseRequests`), so that bytes that
  are not the method's message are answered INVALID_ARGUMENT naming the
  method, where gRPC's own failed deserialisation answers INTERNAL (which
  reads as a bug of the agent) and logs a traceback per call;
* check every number of a worker's request (:func:`check_heartbeat`,
  :func:`commit_entry`, :func:`check_restore_report`,
  :func:`check_failure_report`): a value no worker sends (a negative rank, a
  NaN, a step beyond 2**53, a checkpoint path outside the root) is
  :class:`~elastic.errors.InvalidRequestError`, INVALID_ARGUMENT for the
  caller, naming the method and the field.

Unknown methods are answered UNIMPLEMENTED by gRPC itself.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable, NoReturn

import grpc

from agent.step_times import MAX_STEP_S
from elastic.checkpoint.api import CommitEntry
from elastic.errors import CheckpointError, InvalidRequestError
from elastic.records import MAX_NPROC, cap_text
from elastic.v1 import agent_pb2

logger = logging.getLogger(__name__)

# The largest request either server reads (gRPC's default is 4 MiB).
MAX_MESSAGE_BYTES = 1 << 20
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# A step count above this cannot be told apart from its neighbours once it
# passes through JSON (a double), which the status record and elasticctl use.
MAX_STEP = 2**53
# Longer than any save announces (the worker allows 60 s plus 100 MiB/s of its
# shard: this is 100 TB): a larger value would switch hang detection off.
MAX_SAVING_S = 1e6
_MAX_INT32 = 2**31 - 1
_MAX_INT64 = 2**63 - 1


class ParseRequests(grpc.aio.ServerInterceptor):
    """Hands each unary method its request as raw bytes and parses them here:
    a payload that is not the method's message (or not valid UTF-8 in a
    string field) is aborted with INVALID_ARGUMENT instead of gRPC's INTERNAL.

    For ``grpc.aio`` servers. A synchronous handler runs on the server's
    ``migration_thread_pool`` and so does its parsing; a coroutine handler
    (the health service's Watch) is parsed on the loop."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=None,
                                    unary_unary=_parsing(handler.unary_unary, parse, method))
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=None,
                                    unary_stream=_parsing(handler.unary_stream, parse, method))
        return handler  # no streaming requests among the agent's methods


def _refusal(raw: bytes, method: str) -> str:
    return (f"malformed request to {method}: {len(raw)} bytes that are not the method's "
            "request message")


def _parsing(behavior: Callable, parse: Callable[[bytes], Any], method: str) -> Callable:
    # The wrapper must be a coroutine function exactly when the handler is
    # one: that is how an aio server tells where to run it.
    if inspect.iscoroutinefunction(behavior):
        async def parsed_async(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                request = parse(raw)
            except Exception:  # noqa: BLE001 - as below
                logger.warning("Refused a malformed request to %s from %s (%d bytes).", method,
                               context.peer(), len(raw))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(raw, method))
                raise AssertionError("unreachable: context.abort raises") from None
            return await behavior(request, context)
        return parsed_async

    def parsed(raw: bytes, context: grpc.ServicerContext):
        try:
            request = parse(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError, or anything a parser raises
            logger.warning("Refused a malformed request to %s from %s (%d bytes).", method,
                           context.peer(), len(raw))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(raw, method))
            raise AssertionError("unreachable: context.abort raises") from None
        return behavior(request, context)
    return parsed


def _refuse(method: str, name: str, value: Any, expected: str) -> NoReturn:
    raise InvalidRequestError(f"{method}: field {name!r} is {cap_text(repr(value), 64)}, "
                              f"expected {expected}")


# The checks run for every heartbeat: the refusal's text is made only for a refusal.
def _int(method: str, name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        _refuse(method, name, value, f"an integer {low}..{high}")


def _seconds(method: str, name: str, value: float, high: float) -> None:
    if not (math.isfinite(value) and 0 <= value <= high):
        _refuse(method, name, value, f"a number of seconds 0..{high:g}")


def check_heartbeat(request: agent_pb2.WorkerChannelHeartbeatRequest) -> None:
    """Raises InvalidRequestError for a heartbeat no worker sends."""
    method = "Heartbeat"
    _int(method, "rank", request.rank, 0, _MAX_INT32)
    _int(method, "local_rank", request.local_rank, 0, MAX_NPROC - 1)
    _int(method, "pid", request.pid, 0, _MAX_INT64)
    _int(method, "round", request.round, 0, _MAX_INT64)
    _int(method, "step", request.step, -1, MAX_STEP)
    _seconds(method, "saving_for_s", request.saving_for_s, MAX_SAVING_S)
    _int(method, "snapshots", request.snapshots, 0, _MAX_INT64)
    # Bounded as the step-times record bounds them, so that what passes here is never
    # refused when the record is written.
    _seconds(method, "step_time_s", request.step_time_s, MAX_STEP_S)
    _seconds(method, "step_busy_s", request.step_busy_s, MAX_STEP_S)


def commit_entry(entry: agent_pb2.CheckpointEntry) -> CommitEntry:
    """The commit entry a worker asks to commit, validated exactly as a
    ``checkpoint/latest`` record read back from etcd is (its ``path`` a plain
    directory name in the checkpoint root); ``save_s`` and ``size_bytes``,
    which only say how the save went, are 0 when they are not plausible.
    Raises InvalidRequestError naming the field."""
    record = {"step": entry.step, "round": entry.round, "world_size": entry.world_size,
              "path": entry.path, "time": entry.time,
              "save_s": entry.save_s if math.isfinite(entry.save_s) and entry.save_s > 0
              else 0.0,
              "size_bytes": max(0, entry.size_bytes)}
    try:
        return CommitEntry.from_dict(record)
    except CheckpointError as exc:
        raise InvalidRequestError(f"CommitCheckpoint: {exc}") from None


def check_failure_report(request: agent_pb2.WorkerChannelReportCheckpointFailureRequest
                         ) -> None:
    method = "ReportCheckpointFailure"
    _int(method, "step", request.step, 0, _MAX_INT64)
    _int(method, "round", request.round, 0, _MAX_INT64)
    _int(method, "rank", request.rank, 0, _MAX_INT32)


def check_restore_report(request: agent_pb2.WorkerChannelReportRestoreRequest) -> None:
    method = "ReportRestore"
    _int(method, "step", request.step, 0, _MAX_INT64)
    _int(method, "round", request.round, 0, _MAX_INT64)
    _int(method, "rank", request.rank, 0, _MAX_INT32)
    _seconds(method, "restore_s", request.restore_s, MAX_SAVING_S)
    _int(method, "size_bytes", request.size_bytes, 0, _MAX_INT64)
