"""The agent's gRPC servers: health, status and control on TCP; worker heartbeats on a Unix socket.

:class:`AgentServer` serves

* on ``listen`` (``HOST:PORT``, TCP): the standard ``grpc.health.v1.Health``
  service (Kubernetes gRPC probes and peer agents use it) and ``elastic.v1.Agent``
  (status and control for elasticctl and peers). With an
  :class:`~agent.tls.AgentTLS` this endpoint speaks mutual TLS only: every
  client presents a certificate signed by ``--tls-ca``, and control (Drain,
  RequestRestart, StoreHealth's fencing signal) is taken only from a verified
  one. Without it, anyone who reaches the address may drain this node or
  restart the job: the server says so once, as a warning, at start;
* on ``probe_listen`` (optional, plain text): the same health service and a
  read-only ``elastic.v1.Agent`` (Status; StoreHealth without its fencing
  signal; Drain, RequestRestart and Replicate refused with PERMISSION_DENIED), for
  Kubernetes' gRPC probes, which cannot speak TLS (why it is not one TLS
  endpoint that asks for client certificates without requiring them: see
  :mod:`agent.tls`);
* on ``worker_socket`` (a Unix socket path): ``elastic.v1.WorkerChannel``, the
  heartbeats, checkpoint commits, failed-save and restore reports of this node's own
  workers;
* beside it (:attr:`AgentServer.heartbeat_socket`, a datagram socket): the
  same heartbeats without gRPC, which is what the workers use, at a fraction
  of a gRPC call's CPU (:mod:`agent.heartbeat_socket`).

These are separate ``grpc.aio`` servers, not one listening on every address:
a gRPC server serves every registered service on every port, which would
let any host that reaches ``--listen`` fake heartbeats of a hung worker, and
the workers' calls get a thread pool that busy peers cannot exhaust.

Why ``grpc.aio`` with the servicers left synchronous: a synchronous
``grpc.server`` polls its completion queue on a thread of its own that wakes
five times a second even when nobody calls (grpc's interrupt check), and
those wake-ups were about a quarter of an idle agent's CPU. The aio servers
run on the process's one event loop (:func:`elastic.loop_thread.acquire_shared`,
shared with the etcd store's streams), which sleeps until something arrives;
each server's unary handlers still run on its own thread pool, so they may
block as before, dispatched by :class:`_RunOnPool`, not by grpc.aio
(which frees a cancelled RPC's call while its handler still runs: SIGSEGV at
the handler's next ``context.peer()``). The health service's Watch
streams, which peers hold open for as long as they watch, are coroutines on
that loop: :meth:`AgentServer.stop` ends them (on a pool thread, nothing
would, and the agent's process could not exit).

Every request is hostile input (:mod:`agent.grpc_input`): over 1 MiB it is
RESOURCE_EXHAUSTED, bytes that are not the method's message and values no
worker sends are INVALID_ARGUMENT. The servicers only delegate to an
:class:`AgentControl` and a :class:`HeartbeatSink`, with free-text reasons
made printable and cut to MAX_REASON_CHARS; an
:class:`~elastic.errors.ElasticError` they raise reaches the caller as the
gRPC status :func:`grpc_code_for` picks, with the error's message as details.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import socket
import stat
import threading
import enum
from concurrent import futures
from typing import Any, Callable, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent.grpc_input import (
    SERVER_OPTIONS,
    ParseRequests,
    check_failure_report,
    check_heartbeat,
    check_restore_report,
)
from agent.heartbeat_socket import HeartbeatSocket, datagram_path
from agent.localfiles import prepare_socket_path
from agent.tls import AgentTLS, verified_client, verified_common_name
from elastic import aio_fork
from elastic.errors import (
    ConfigError,
    ElasticError,
    NotAuthorisedError,
    RateLimitedError,
    RendezvousError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from elastic.hostport import HostPort
from elastic.loop_thread import LoopThread, acquire_shared, release_shared
from elastic.records import cap_text
from elastic.v1 import agent_pb2, agent_pb2_grpc

logger = logging.getLogger(__name__)

AGENT_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name  # "elastic.v1.Agent"
WORKER_CHANNEL_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["WorkerChannel"].full_name
# The health entries set_serving() flips: the server as a whole and the Agent service.
# SERVING only while this node's workers run healthy: a readiness probe.
HEALTH_SERVICES = (health.OVERALL_HEALTH, AGENT_SERVICE)
# SERVING while the agent's main loop turns, whatever the job is doing (joining,
# restarting): a liveness probe (Kubernetes: grpc.service: elastic.v1.Liveness).
LIVENESS_SERVICE = "elastic.v1.Liveness"

_SERVER_OPTIONS = [
    # gRPC sets SO_REUSEPORT by default; without this a second agent on the same
    # port would bind "successfully" and steal half of the connections.
    ("grpc.so_reuseport", 0),
    # Peers' HealthWatchers send keepalive pings every few seconds on otherwise
    # silent Watch streams to notice a frozen agent; do not punish them for it.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
    ("grpc.http2.max_ping_strikes", 0),
    *SERVER_OPTIONS,  # requests over 1 MiB: RESOURCE_EXHAUSTED (agent.grpc_input)
]


class AgentControl(Protocol):
    """What the ``elastic.v1.Agent`` service asks of the agent.

    Each method may raise :class:`~elastic.errors.ElasticError`; the caller
    then receives the gRPC status :func:`grpc_code_for` maps it to.
    """

    def status(self) -> agent_pb2.AgentStatusResponse:
        """The agent's current state, round and workers."""
        ...

    def drain(self, reason: str) -> tuple[bool, str]:
        """Ask the agent to leave the job at the next round boundary: (accepted, message)."""
        ...

    def request_restart(self, reason: str) -> tuple[bool, int]:
        """Ask for a new round with the same members: (accepted, round it was requested for)."""
        ...

    def store_health(self, asker_has_store: bool, asker: str) -> tuple[bool, float, bool]:
        """Whether etcd confirmed this agent's lease recently: (reachable, seconds
        since, workers running). ``asker_has_store``: the asker reaches etcd."""
        ...

    def replicate(self, request: agent_pb2.AgentReplicateRequest) -> int:
        """Apply one part of a buddy's memory-tier snapshot; returns the bytes
        left free on the memory root. Raises InvalidRequestError for input it
        refuses, FencedError for a sender that is no member of the round."""
        ...

    def collect_stacks(self, round_number: int) -> list[agent_pb2.RankStack]:
        """The stacks of this agent's workers of ``round_number``, summarised
        (none when its workers run another round); waits about a second."""
        ...


class HeartbeatSink(Protocol):
    """What the ``elastic.v1.WorkerChannel`` service delivers to the agent."""

    def heartbeat(self, request: agent_pb2.WorkerChannelHeartbeatRequest) -> tuple[bool, bool]:
        """Record one heartbeat; returns (stop_requested, hold): whether the
        worker should stop, and whether it should not start another step yet."""
        ...

    def commit_checkpoint(self, entry: agent_pb2.CheckpointEntry) -> tuple[bool, str]:
        """Record ``entry`` as the latest checkpoint if its round is current:
        (True, "") or (False, why it was fenced off)."""
        ...

    def latest_checkpoint(self) -> agent_pb2.CheckpointEntry | None:
        """The job's latest committed checkpoint, None when there is none."""
        ...

    def report_checkpoint_failure(self, step: int, round_: int, rank: int,
                                  message: str) -> None:
        """Record that a worker's save of ``step`` in ``round_`` failed (an event)."""
        ...

    def report_restore(self, request: agent_pb2.WorkerChannelReportRestoreRequest) -> None:
        """Count a worker's checkpoint restore (time and bytes) in the metrics."""
        ...


def grpc_code_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code a caller receives for ``exc`` raised while serving its call.

    The one place that maps the error tree to gRPC codes: bad input is
    INVALID_ARGUMENT; the store being down is UNAVAILABLE (and a store
    deadline DEADLINE_EXCEEDED), which tells callers the call is safe to retry
    with backoff; a rendezvous refusal (fenced, duplicate node, no round) is
    FAILED_PRECONDITION: not retryable until the job's state changes. A
    caller without a verified client certificate is PERMISSION_DENIED; an
    operator restart too soon after the last, RESOURCE_EXHAUSTED. Any other
    error, ``ElasticError`` itself included, is a bug: INTERNAL.
    """
    for kind, code in _STATUS_CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


# First match wins: a subclass before its base.
_STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotAuthorisedError, grpc.StatusCode.PERMISSION_DENIED),
    (RateLimitedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),
    # Lease lost, compacted watch: the agent recovers from these by itself.
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (RendezvousError, grpc.StatusCode.FAILED_PRECONDITION),  # FencedError among them
)


_T = TypeVar("_T")


def _serve_call(
    context: grpc.ServicerContext, method: str, fn: Callable[..., _T], *args: Any
) -> _T:
    """Run the delegate ``fn``; abort the call with the mapped status if it raises."""
    try:
        return fn(*args)
    except ElasticError as exc:
        code = grpc_code_for(exc)
        log = logger.error if code == grpc.StatusCode.INTERNAL else logger.warning
        log("The agent could not serve %s from %s: %s (%s).",
            method, context.peer(), exc, code.name)
        context.abort(code, str(exc))
    except Exception as exc:  # noqa: BLE001 (a bug: the caller gets INTERNAL, the log the trace)
        logger.exception("The agent failed serving %s from %s with an unexpected error.",
                         method, context.peer())
        context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable: context.abort raises")


class Access(enum.Enum):
    """Who may use control (Drain, RequestRestart, StoreHealth's fencing signal) on an endpoint."""

    OPEN = "open"
    """Plain text: whoever reaches the address (warned about at start)."""
    MUTUAL_TLS = "mutual TLS"
    """Only a caller whose client certificate the TLS handshake verified."""
    READ_ONLY = "read-only"
    """Nobody: the plain-text probe endpoint of an agent that uses TLS."""


def control_refusal(access: Access, client: str | None, method: str, *,
                    common_name: str | None = None, allowed_cns: tuple[str, ...] = ()
                    ) -> str | None:
    """Why ``method`` (a control verb) is refused on an endpoint of ``access``
    to a caller whose verified certificate names ``client`` (None: no verified
    certificate) and carries ``common_name``; None when it is allowed. With
    ``allowed_cns`` (--tls-allowed-cn), only those CNs may. One line, for the
    caller."""
    if access is Access.OPEN:
        return None
    if access is Access.READ_ONLY:
        return (f"{method} is refused on the agent's read-only probe endpoint: control takes "
                "mutual TLS on its --listen address, with a client certificate signed by its "
                "--tls-ca")
    if client is None:
        return (f"{method} needs a client certificate signed by the agent's --tls-ca (mutual "
                "TLS); none was verified on this connection")
    if allowed_cns and common_name not in allowed_cns:
        who = (f"the certificate CN {cap_text(repr(common_name), 80)}" if common_name
               is not None else f"a certificate without a common name ({client})")
        return (f"{method} is refused to {who}: only --tls-allowed-cn "
                f"{','.join(allowed_cns)} may drain or restart")
    return None


class _AgentServicer(agent_pb2_grpc.AgentServicer):
    def __init__(self, control: AgentControl, access: Access = Access.OPEN,
                 allowed_cns: tuple[str, ...] = ()):
        self._control = control
        self._access = access
        self._allowed_cns = allowed_cns  # for Drain and RequestRestart

    def _caller(self, context: grpc.ServicerContext) -> tuple[str, str | None]:
        """(the caller for a log line, the name its verified certificate carries)."""
        client = verified_client(context)
        return (f"{context.peer()} (certificate {client})" if client else context.peer()), client

    def _authorise(self, context: grpc.ServicerContext, method: str) -> str:
        """The caller for a log line; aborts with PERMISSION_DENIED when
        ``method`` is refused to it."""
        caller, client = self._caller(context)
        refusal = control_refusal(self._access, client, method,
                                  common_name=verified_common_name(context),
                                  allowed_cns=self._allowed_cns)
        if refusal is not None:
            logger.warning("The agent refused %s from %s: %s.", method, caller, refusal)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        return caller

    def Status(self, request, context):  # noqa: N802 (gRPC method name)
        return _serve_call(context, "Status", self._control.status)

    # Reasons from the network are capped before anything logs or stores them:
    # they end up in etcd records, which must stay far below etcd's request limit.
    def Drain(self, request, context):  # noqa: N802
        caller = self._authorise(context, "Drain")
        reason = cap_text(request.reason)
        logger.info("The agent received a drain request from %s: %s.", caller, reason)
        accepted, message = _serve_call(context, "Drain", self._control.drain, reason)
        return agent_pb2.AgentDrainResponse(accepted=accepted, message=message)

    def RequestRestart(self, request, context):  # noqa: N802
        caller = self._authorise(context, "RequestRestart")
        reason = cap_text(request.reason)
        logger.info("The agent received a restart request from %s: %s.", caller, reason)
        accepted, round_ = _serve_call(
            context, "RequestRestart", self._control.request_restart, reason
        )
        return agent_pb2.AgentRequestRestartResponse(accepted=accepted, round=round_)

    def StoreHealth(self, request, context):  # noqa: N802
        # "I reach etcd" makes an agent cut off from it stop its workers: a
        # control signal, taken only from whoever may use control here.
        has_store = request.asker_has_store and control_refusal(
            self._access, verified_client(context), "StoreHealth") is None
        reachable, age, running = _serve_call(context, "StoreHealth", self._control.store_health,
                                              has_store, cap_text(request.asker, 128))
        return agent_pb2.AgentStoreHealthResponse(reachable=reachable, confirmed_age_s=age,
                                                  workers_running=running)

    def Replicate(self, request, context):  # noqa: N802
        # It writes into this node's memory: taken only from whoever may use
        # control here (a peer's verified certificate under mutual TLS).
        refusal = control_refusal(self._access, verified_client(context), "Replicate")
        if refusal is not None:
            logger.warning("The agent refused Replicate from %s: %s.", context.peer(), refusal)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        free = _serve_call(context, "Replicate", self._control.replicate, request)
        return agent_pb2.AgentReplicateResponse(free_bytes=free)

    def CollectStacks(self, request, context):  # noqa: N802
        # It signals this node's workers: taken only from whoever may use control here.
        refusal = control_refusal(self._access, verified_client(context), "CollectStacks")
        if refusal is not None:
            logger.warning("The agent refused CollectStacks from %s: %s.", context.peer(),
                           refusal)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        ranks = _serve_call(context, "CollectStacks", self._control.collect_stacks,
                            request.round)
        return agent_pb2.AgentCollectStacksResponse(ranks=ranks)


class _WorkerChannelServicer(agent_pb2_grpc.WorkerChannelServicer):
    def __init__(self, sink: HeartbeatSink):
        self._sink = sink

    def Heartbeat(self, request, context):  # noqa: N802
        _serve_call(context, "Heartbeat", check_heartbeat, request)
        stop, hold = _serve_call(context, "Heartbeat", self._sink.heartbeat, request)
        return agent_pb2.WorkerChannelHeartbeatResponse(stop_requested=bool(stop),
                                                        hold=bool(hold))

    def CommitCheckpoint(self, request, context):  # noqa: N802
        committed, message = _serve_call(context, "CommitCheckpoint",
                                         self._sink.commit_checkpoint, request.entry)
        return agent_pb2.WorkerChannelCommitCheckpointResponse(committed=committed,
                                                               message=message)

    def LatestCheckpoint(self, request, context):  # noqa: N802
        entry = _serve_call(context, "LatestCheckpoint", self._sink.latest_checkpoint)
        if entry is None:
            return agent_pb2.WorkerChannelLatestCheckpointResponse(found=False)
        return agent_pb2.WorkerChannelLatestCheckpointResponse(found=True, entry=entry)

    def ReportCheckpointFailure(self, request, context):  # noqa: N802
        # The message ends up in an etcd event: capped like every reason from outside.
        _serve_call(context, "ReportCheckpointFailure", check_failure_report, request)
        _serve_call(context, "ReportCheckpointFailure", self._sink.report_checkpoint_failure,
                    request.step, request.round, request.rank, cap_text(request.message))
        return agent_pb2.WorkerChannelReportCheckpointFailureResponse()

    def ReportRestore(self, request, context):  # noqa: N802
        _serve_call(context, "ReportRestore", check_restore_report, request)
        _serve_call(context, "ReportRestore", self._sink.report_restore, request)
        return agent_pb2.WorkerChannelReportRestoreResponse()


class _PoolContext:
    """What a synchronous handler, on a pool thread, may do with its call's
    ``grpc.aio`` context: the subset of ``grpc.ServicerContext`` the agent's
    handlers use. Valid only while :class:`_RunOnPool` holds the call."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop):
        self._context = context
        self._loop = loop

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with ``code``; always raises (grpc's AbortError once
        sent, ExecuteBatchError when the call was already cancelled)."""
        asyncio.run_coroutine_threadsafe(self._context.abort(code, details), self._loop).result()
        raise AssertionError("unreachable: context.abort raises")

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self._context.set_details(details)

    def peer(self) -> str:
        return self._context.peer()

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._context.auth_context()

    def peer_identities(self) -> list[bytes] | None:
        return self._context.peer_identities()

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()


class _RunOnPool(grpc.aio.ServerInterceptor):
    """Runs each synchronous unary handler on ``pool`` from a coroutine that
    ends only once the handler has returned, so that the call it uses stays
    alive (the first of a server's interceptors).

    Why not grpc.aio's own dispatch of a synchronous handler: when the client
    cancels (its deadline passes, it goes away) or the server stops, grpc
    cancels the RPC's task at once and then releases the core call (sets it
    to NULL), while the handler goes on running on the pool; its next
    ``context.peer()``, ``auth_context()`` or ``abort()`` then dereferences
    NULL in cygrpc and the agent dies of SIGSEGV (grpcio 1.85.1: a handler
    that etcd being cut off slows past its caller's deadline, or whose caller
    is killed, then logs its error with ``context.peer()``). Here a
    cancellation waits for a handler that has started; one still queued never
    runs. The RPC then ends cancelled as before.

    It also knows its server's calls in progress (:meth:`calls_ended`): the
    loop is shared, so a stopping server waits for its own, not for every task.
    """

    def __init__(self, pool: futures.Executor):
        self._pool = pool
        self._calls: set[asyncio.Task] = set()  # on the loop thread only

    async def calls_ended(self) -> None:
        """Return once every call of this server has ended (on the loop)."""
        pending = self._calls - {asyncio.current_task()}
        if pending:
            await asyncio.wait(pending)

    def _counted(self, behavior: Callable) -> Callable:
        async def counted(request, context: grpc.aio.ServicerContext):
            task = asyncio.current_task()
            self._calls.add(task)
            try:
                return await behavior(request, context)
            finally:
                self._calls.discard(task)
        return counted

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_stream is not None and inspect.iscoroutinefunction(
                handler.unary_stream):
            return handler._replace(unary_stream=self._counted(handler.unary_stream))
        if handler.unary_unary is None:
            return handler  # no other kind is served here
        if inspect.iscoroutinefunction(handler.unary_unary):
            return handler._replace(unary_unary=self._counted(handler.unary_unary))
        behavior, pool = handler.unary_unary, self._pool

        async def held(request, context: grpc.aio.ServicerContext):
            loop = asyncio.get_running_loop()
            job = pool.submit(behavior, request, _PoolContext(context, loop))
            done = asyncio.wrap_future(job, loop=loop)
            try:
                return await asyncio.shield(done)
            except asyncio.CancelledError:
                if job.cancel():
                    raise  # still queued: it never runs
                while not done.done():
                    try:
                        await asyncio.wait((done,))
                    except asyncio.CancelledError:
                        pass  # cancelled again (the server stopping): still wait
                if not done.cancelled():
                    done.exception()  # the RPC is over: what the handler raised is moot
                raise
        return handler._replace(unary_unary=self._counted(held))


def _interceptors(dispatch: _RunOnPool) -> list[grpc.aio.ServerInterceptor]:
    # Every server parses its requests itself, on its pool: bytes that are not
    # the method's message are INVALID_ARGUMENT, not gRPC's INTERNAL
    # (agent.grpc_input). _RunOnPool comes first: it wraps what ParseRequests made.
    return [dispatch, ParseRequests()]


async def _stop_servers(servers: list[grpc.aio.Server], dispatches: list[_RunOnPool],
                        grace_s: float | None) -> None:
    await asyncio.gather(*(server.stop(grace_s) for server in servers))
    # A synchronous handler still running on a pool keeps its RPC's task (and
    # call) until it returns (_RunOnPool): wait for those here, so that no
    # call outlives its server on the loop. The caller bounds the wait.
    await asyncio.gather(*(dispatch.calls_ended() for dispatch in dispatches))


def _split_listen(listen: str) -> HostPort:
    """``listen`` read as HOST:PORT; raises ConfigError when it is not one."""
    try:
        return HostPort.parse(listen)
    except ValueError:
        raise ConfigError(f"--listen must be HOST:PORT (port 0 picks a free one), "
                          f"got {listen!r}") from None


def _bind_tcp(server: grpc.aio.Server, listen: str, flag: str,
              credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``server`` to ``listen`` (TLS with ``credentials``); returns the
    port. Raises ConfigError naming ``flag``."""
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as exc:  # grpc reports a failed bind this way
        raise ConfigError(f"cannot listen on {listen!r} ({flag}): {exc}") from exc
    if port == 0:  # older grpc returns 0 instead of raising
        raise ConfigError(f"cannot listen on {listen!r} ({flag}): the address could not be bound")
    return port


class _Health(health_pb2_grpc.HealthServicer):
    """The standard health service for the aio servers, set from any thread,
    with :data:`LIVENESS_SERVICE` answered from ``liveness()`` at each Check
    (a stalled loop cannot flip a status).

    Not grpc_health's servicers: the synchronous one's Watch blocks a pool
    thread per stream until the call's close callback, which an aio server
    that is stopping never runs (the agent then never exits), and the aio
    one is set by coroutines on the loop. Here Watch is a coroutine on the
    server's loop, which ``server.stop()`` cancels, and :meth:`set` wakes it
    from whatever thread calls it, without waiting for the loop.
    """

    def __init__(self, liveness: Callable[[], bool]):
        self._liveness = liveness
        self._lock = threading.Lock()
        self._statuses = {health.OVERALL_HEALTH: health_pb2.HealthCheckResponse.SERVING,
                          LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING}
        self._watchers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        """Report ``status`` for ``service``; Watch streams see it at once.
        Ignored after :meth:`enter_graceful_shutdown`."""
        with self._lock:
            if self._shutting_down:
                return
            self._statuses[service] = status
        self._wake_watchers()

    def enter_graceful_shutdown(self) -> None:
        """Report NOT_SERVING for every service, for good."""
        with self._lock:
            self._shutting_down = True
            for service in self._statuses:
                self._statuses[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._wake_watchers()

    def _status(self, service: str) -> int | None:
        with self._lock:
            return self._statuses.get(service)

    def _wake_watchers(self) -> None:
        with self._lock:
            watchers = list(self._watchers)
        for loop, changed in watchers:
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the loop closed: its streams are gone
                pass

    def Check(self, request, context):  # noqa: N802 - gRPC's name
        # Synchronous, on the server's pool like the other unary handlers.
        if request.service == LIVENESS_SERVICE:
            alive = self._liveness()
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING if alive
                else health_pb2.HealthCheckResponse.NOT_SERVING)
        status = self._status(request.service)
        if status is None:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):  # noqa: N802
        # Sends the current status, then each change (intermediate ones may be
        # skipped: watchers want the latest), until the caller or the server
        # ends the stream.
        changed = asyncio.Event()
        watcher = (asyncio.get_running_loop(), changed)
        with self._lock:
            self._watchers.add(watcher)
        try:
            last = None
            while True:
                changed.clear()
                status = self._status(request.service)
                if status is None:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                await changed.wait()
        finally:
            with self._lock:
                self._watchers.discard(watcher)


class AgentServer:
    """The agent's gRPC endpoints (see the module docstring), started and stopped together.

    Health starts NOT_SERVING; :meth:`set_serving` flips it. Not restartable:
    after :meth:`stop`, build a new one.
    """

    def __init__(
        self,
        listen: str,
        worker_socket: str,
        control: AgentControl,
        heartbeats: HeartbeatSink,
        max_workers: int = 8,
        liveness: Callable[[], bool] = lambda: True,
        *,
        tls: AgentTLS | None = None,
        probe_listen: str | None = None,
    ):
        """Validate the addresses; nothing is bound until :meth:`start`.

        ``listen`` is ``HOST:PORT`` (port 0 picks a free port); ``max_workers``
        is the size of each server's thread pool. ``liveness`` answers the
        :data:`LIVENESS_SERVICE` health checks (any thread). ``tls``: serve
        mutual TLS on ``listen`` (None: plain text, control open to anyone).
        ``probe_listen``: ``HOST:PORT`` of the plain-text read-only endpoint
        (None: none). Raises ConfigError on a malformed address, a
        non-positive ``max_workers`` or ``tls`` without what a server needs.
        """
        self._host = _split_listen(listen).host
        if max_workers < 1:
            raise ConfigError(f"max_workers must be at least 1, got {max_workers}")
        if tls is not None and not tls.can_serve:
            raise ConfigError("serving mutual TLS needs --tls-cert, --tls-key and --tls-ca")
        self._probe_host = _split_listen(probe_listen).host if probe_listen else None
        self._tls = tls
        self._probe_listen = probe_listen
        self._listen = listen
        self._socket_path = os.path.abspath(worker_socket)
        self._control = control
        self._heartbeats = heartbeats
        self._max_workers = max_workers
        self._health = _Health(liveness)
        self.set_serving(False)
        self._tcp: grpc.aio.Server | None = None
        self._unix: grpc.aio.Server | None = None
        self._probe: grpc.aio.Server | None = None
        self._loop: LoopThread | None = None
        hb_path = datagram_path(self._socket_path)
        self._datagrams = HeartbeatSocket(hb_path, heartbeats) if hb_path else None
        self._executors: list[futures.ThreadPoolExecutor] = []
        self._dispatches: list[_RunOnPool] = []  # one per executor: its server's calls
        self._bound_port: int | None = None
        self._probe_port: int | None = None
        self._started = False
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        """``HOST:PORT`` of the TCP endpoint with the port actually bound; after :meth:`start`."""
        if self._bound_port is None:
            raise ElasticError("AgentServer.address is known only after start()")
        return str(HostPort(self._host, self._bound_port))

    @property
    def probe_address(self) -> str | None:
        """``HOST:PORT`` of the read-only probe endpoint after :meth:`start`; None without one."""
        return (None if self._probe_port is None or self._probe_host is None
                else str(HostPort(self._probe_host, self._probe_port)))

    @property
    def worker_socket(self) -> str:
        """The absolute path of the workers' Unix socket."""
        return self._socket_path

    @property
    def heartbeat_socket(self) -> str | None:
        """The absolute path of the workers' heartbeat datagram socket; None
        without one (its path would not fit a Unix socket address, or not on
        Linux: :func:`agent.heartbeat_socket.datagram_path`), when heartbeats
        take the gRPC call on :attr:`worker_socket`."""
        return self._datagrams.path if self._datagrams is not None else None

    def start(self) -> None:
        """Bind both endpoints and start serving.

        Raises ConfigError when an address cannot be bound (port in use,
        socket path unusable); nothing is left running then.
        """
        with self._lock:
            if self._started:
                raise ElasticError("AgentServer.start() called twice; build a new one instead")
            self._started = True
            # The probe endpoint has a pool of its own: plain-text callers
            # holding Watch streams there cannot starve the peers' calls.
            names = ["agent-grpc", "agent-workers"] + (["agent-probe"] if self._probe_listen
                                                       else [])
            self._executors = [
                futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix=name)
                for name in names
            ]
            self._dispatches = [_RunOnPool(executor) for executor in self._executors]
            loop = acquire_shared()
            try:
                tcp, unix, probe, port, probe_port = loop.run(self._build_and_start(), None)
            except BaseException:
                release_shared(loop)
                self._shutdown_executors()
                raise
            self._restrict_socket()
            self._loop = loop
            self._tcp, self._unix, self._probe = tcp, unix, probe
            self._bound_port, self._probe_port = port, probe_port
        logger.info("The agent serves health and elastic.v1.Agent on %s (%s) and its workers "
                    "on unix:%s%s%s.", self.address,
                    f"mutual TLS: {self._tls.describe()}" if self._tls else "plain text",
                    self._socket_path, f" (heartbeats as datagrams on {self.heartbeat_socket})"
                    if self.heartbeat_socket else "",
                    f"; read-only probes on {self.probe_address} (plain text)"
                    if probe is not None else "")
        if self._tls is None:
            logger.warning("The agent's control (drain, restart) on %s is unauthenticated: "
                           "anyone who reaches that address can drain this node or restart the "
                           "job. Give --tls-cert, --tls-key and --tls-ca for mutual TLS.",
                           self.address)

    async def _build_and_start(self) -> tuple[grpc.aio.Server, grpc.aio.Server,
                                              grpc.aio.Server | None, int, int | None]:
        """On the loop thread (aio servers belong to the loop they are made
        on): build, bind and start the servers and the heartbeat socket;
        returns them with the TCP ports. Raises ConfigError, leaving nothing
        running."""
        tcp = aio_fork.track(grpc.aio.server(migration_thread_pool=self._executors[0],
                                             options=_SERVER_OPTIONS,
                                             interceptors=_interceptors(self._dispatches[0])))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, tcp)
        access = Access.MUTUAL_TLS if self._tls is not None else Access.OPEN
        agent_pb2_grpc.add_AgentServicer_to_server(
            _AgentServicer(self._control, access,
                           self._tls.allowed_cns if self._tls is not None else ()), tcp)
        unix = aio_fork.track(grpc.aio.server(migration_thread_pool=self._executors[1],
                                              options=SERVER_OPTIONS,
                                              interceptors=_interceptors(self._dispatches[1])))
        agent_pb2_grpc.add_WorkerChannelServicer_to_server(
            _WorkerChannelServicer(self._heartbeats), unix
        )
        probe = None
        if self._probe_listen:
            probe = aio_fork.track(grpc.aio.server(
                migration_thread_pool=self._executors[2], options=_SERVER_OPTIONS,
                interceptors=_interceptors(self._dispatches[2])))
            health_pb2_grpc.add_HealthServicer_to_server(self._health, probe)
            agent_pb2_grpc.add_AgentServicer_to_server(
                _AgentServicer(self._control, Access.READ_ONLY), probe)
        servers = [s for s in (tcp, unix, probe) if s is not None]
        try:
            port, probe_port = self._bind(tcp, unix, probe)
            for server in servers:
                await server.start()
            if self._datagrams is not None:
                self._datagrams.start()
        except BaseException:
            await _stop_servers(servers, self._dispatches, None)
            if self._datagrams is not None:
                self._datagrams.stop()
            raise
        return tcp, unix, probe, port, probe_port

    def _bind(self, tcp: grpc.aio.Server, unix: grpc.aio.Server,
              probe: grpc.aio.Server | None) -> tuple[int, int | None]:
        """Bind the endpoints; returns the TCP ports (main, probe). Raises ConfigError."""
        credentials = self._tls.server_credentials() if self._tls is not None else None
        port = _bind_tcp(tcp, self._listen, "--listen", credentials)
        probe_port = (_bind_tcp(probe, self._probe_listen, "--probe-listen", None)
                      if probe is not None and self._probe_listen else None)
        prepare_socket_path(self._socket_path)
        try:
            bound = unix.add_insecure_port(f"unix:{self._socket_path}")
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot listen on worker socket {self._socket_path!r}: {exc}"
            ) from exc
        if bound == 0:
            raise ConfigError(f"cannot listen on worker socket {self._socket_path!r}")
        if self._datagrams is not None:
            prepare_socket_path(self._datagrams.path, socket.SOCK_DGRAM)
            try:
                self._datagrams.bind()
            except OSError as exc:
                raise ConfigError(f"cannot listen on heartbeat socket {self._datagrams.path!r}: "
                                  f"{exc.strerror or exc}") from exc
        return port, probe_port

    def _shutdown_executors(self) -> None:
        # grpc does not own the executors it is given; their idle threads would outlive it.
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
        self._executors = []

    def _restrict_socket(self) -> None:
        # Only this user (the agent and the workers it spawns) may talk to the workers' channel.
        try:
            os.chmod(self._socket_path, 0o600)
        except OSError as exc:
            logger.warning("Could not restrict worker socket %s to its owner: %s.",
                           self._socket_path, exc)

    def set_serving(self, healthy: bool) -> None:
        """Report SERVING (True) or NOT_SERVING (False) for "" and "elastic.v1.Agent".

        Watchers are notified at once. Ignored after :meth:`stop` began.
        """
        status = (health_pb2.HealthCheckResponse.SERVING if healthy
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in HEALTH_SERVICES:
            self._health.set(service, status)

    def stop(self, grace_s: float = 1.0) -> None:
        """Report NOT_SERVING, then stop both servers; calls in flight get ``grace_s`` to finish.

        Returns when both servers have stopped; removes the worker socket.
        Idempotent; a no-op before :meth:`start`.
        """
        with self._lock:
            tcp, unix, probe, loop = self._tcp, self._unix, self._probe, self._loop
            self._tcp = self._unix = self._probe = self._loop = None
        if tcp is None or unix is None or loop is None:
            return
        # Watchers see NOT_SERVING before their streams break, so peers can tell
        # a graceful stop from a crash.
        self._health.enter_graceful_shutdown()
        if self._datagrams is not None:
            self._datagrams.stop()
        servers = [s for s in (tcp, unix, probe) if s is not None]
        try:
            loop.run(_stop_servers(servers, self._dispatches, grace_s), grace_s + 1.0)
        except TimeoutError:
            logger.warning("The agent's gRPC servers did not stop within %.1f s.", grace_s + 1.0)
        release_shared(loop)
        self._shutdown_executors()
        try:
            if stat.S_ISSOCK(os.lstat(self._socket_path).st_mode):
                os.unlink(self._socket_path)
        except FileNotFoundError:
            pass
        logger.info("The agent stopped serving on %s and unix:%s.", self.address, self._socket_path)
