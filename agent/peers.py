"""Client side of an agent's TCP endpoint, for elasticctl and peer agents.

One-shot calls (:func:`query_status`, :func:`check_health`,
:func:`request_drain`, :func:`request_restart`) and a :class:`HealthWatcher`
that follows one peer's ``grpc.health.v1`` status as it changes.

Every call takes ``tls``: an :class:`~agent.tls.AgentTLS` to call with
mutual TLS (None: plain text). Channels are cached per address and ``tls``
(:func:`close_channels` closes them), with
short reconnect backoff so a restarted peer is reachable again within about a
second, and keepalive pings so a frozen peer (SIGSTOP, lost network) breaks
its watch streams within seconds instead of never.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.hang_attribution import RankStack
from agent.health import PeerHealth
from agent.probe import ANSWER_WAIT_S, PeerProbe
from agent.tls import AgentTLS, handshake_problem
from elastic.errors import (
    AgentAuthError,
    AgentUnreachableError,
    ConfigError,
    ElasticError,
    NotAuthorisedError,
    RateLimitedError,
    RequestRefusedError,
)
from elastic.net import fast_reconnect_options
from elastic.records import MAX_NPROC, cap_text
from elastic.v1 import agent_pb2, agent_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1.0
# Control verbs may make the agent write a request to etcd before it answers.
DEFAULT_CONTROL_TIMEOUT_S = 5.0

_CHANNEL_OPTIONS = [
    *fast_reconnect_options(),
    # A frozen peer still ACKs TCP (its kernel runs); only an unanswered HTTP/2
    # ping shows it is gone: detected within about keepalive_time + ping_timeout
    # (5 s). gRPC 1.85 times keepalive pings out by ping_timeout_ms (default 60 s),
    # not by keepalive_timeout_ms alone, so both are set. The agent's server
    # allows pings this often (agent/grpc_server.py).
    ("grpc.keepalive_time_ms", 2_000),
    ("grpc.keepalive_timeout_ms", 3_000),
    ("grpc.http2.ping_timeout_ms", 3_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Agents talk to each other directly, never through an HTTP proxy from the environment.
    ("grpc.enable_http_proxy", 0),
]
# Codes that mean "cannot reach the agent now", not "the agent said no".
_UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


_channels: dict[tuple[str, AgentTLS | None], grpc.Channel] = {}
_channels_lock = threading.Lock()


def _channel(addr: str, tls: AgentTLS | None = None) -> grpc.Channel:
    """The cached channel to ``addr``; raises ConfigError when ``tls``'s files
    cannot be read (they were read once at start: deleted since)."""
    with _channels_lock:
        channel = _channels.get((addr, tls))
        if channel is None:
            if tls is None:
                channel = grpc.insecure_channel(addr, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.secure_channel(addr, tls.channel_credentials(),
                                              options=_CHANNEL_OPTIONS + tls.channel_options())
            _channels[(addr, tls)] = channel
        return channel


def close_channels() -> None:
    """Close every cached channel; later calls open new ones. Breaks running watchers' streams."""
    with _channels_lock:
        channels = list(_channels.values())
        _channels.clear()
    for channel in channels:
        channel.close()


def _health_from_status(status: int) -> PeerHealth:
    if status == health_pb2.HealthCheckResponse.SERVING:
        return PeerHealth.SERVING
    if status == health_pb2.HealthCheckResponse.NOT_SERVING:
        return PeerHealth.NOT_SERVING
    return PeerHealth.UNKNOWN


def _tls_error(addr: str, method: str, exc: grpc.RpcError,
               tls: AgentTLS | None) -> AgentAuthError | None:
    """The AgentAuthError for a call that failed in the TLS handshake; None otherwise."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    problem = handshake_problem(exc.details() or "", tls)
    return AgentAuthError(f"agent at {addr} refused {method}: {problem}") if problem else None


def _rpc_error(addr: str, method: str, exc: grpc.RpcError,
               tls: AgentTLS | None = None) -> ElasticError:
    """Translate a failed call into the error tree, keeping the agent's message."""
    code = exc.code()
    message = f"agent at {addr} failed {method}: {code.name}: {exc.details()}"
    tls_error = _tls_error(addr, method, exc, tls)
    if tls_error is not None:
        return tls_error
    if code in _UNREACHABLE_CODES:
        return AgentUnreachableError(f"agent at {addr} did not answer {method} ({code.name})")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ConfigError(message)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return NotAuthorisedError(f"agent at {addr} refused {method}: {exc.details()}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # The operator restart limit; for other calls, a request over the size limit.
        refused = RateLimitedError if method == "RequestRestart" else RequestRefusedError
        return refused(f"agent at {addr} refused {method}: {exc.details()}")
    return ElasticError(message)


def query_status(
    addr: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, tls: AgentTLS | None = None
) -> agent_pb2.AgentStatusResponse | None:
    """The status of the agent at ``addr`` (``HOST:PORT``); None when unreachable in time.

    Raises AgentAuthError when the TLS handshake failed (the message says
    why), ElasticError (ConfigError for INVALID_ARGUMENT) when the agent
    answers with an error, e.g. UNIMPLEMENTED when no agent serves there.
    """
    stub = agent_pb2_grpc.AgentStub(_channel(addr, tls))
    try:
        return stub.Status(agent_pb2.AgentStatusRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        tls_error = _tls_error(addr, "Status", exc, tls)
        if tls_error is not None:
            raise tls_error from exc
        if exc.code() in _UNREACHABLE_CODES:
            logger.debug("The agent at %s did not answer Status: %s.", addr, exc.code().name)
            return None
        raise _rpc_error(addr, "Status", exc, tls) from exc


def check_health(addr: str, timeout_s: float = DEFAULT_TIMEOUT_S, service: str = "", *,
                 tls: AgentTLS | None = None) -> PeerHealth:
    """One ``grpc.health.v1`` Check of ``service`` ("" = the whole agent) at ``addr``. Never raises.

    Returns UNREACHABLE when no answer came within ``timeout_s`` (or the TLS
    handshake failed), UNKNOWN when the service is not registered there or the
    call failed otherwise.
    """
    stub = health_pb2_grpc.HealthStub(_channel(addr, tls))
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() in _UNREACHABLE_CODES:
            return PeerHealth.UNREACHABLE
        logger.debug("Health check of %r at %s failed: %s: %s.",
                     service, addr, exc.code().name, exc.details())
        return PeerHealth.UNKNOWN
    return _health_from_status(response.status)


def check_health_async(addr: str, on_answer: Callable[[], None], *,
                       timeout_s: float = ANSWER_WAIT_S, tls: AgentTLS | None = None) -> None:
    """Send one ``grpc.health.v1`` Check to ``addr`` and return at once;
    ``on_answer()`` is called (on a gRPC thread) if the agent answers within
    ``timeout_s``, whatever its status. Never raises."""
    try:
        future = health_pb2_grpc.HealthStub(_channel(addr, tls)).Check.future(
            health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except (ValueError, ConfigError):  # the channel closed under us; TLS files gone
        return

    def done(f: grpc.Future) -> None:
        if f.cancelled():
            return
        exc = f.exception()
        if exc is None or (isinstance(exc, grpc.RpcError) and exc.code() not in _UNREACHABLE_CODES
                           and _tls_error(addr, "Check", exc, tls) is None):
            on_answer()

    future.add_done_callback(done)


def store_health(addr: str, *, asker_has_store: bool = False, asker: str = "",
                 timeout_s: float = DEFAULT_TIMEOUT_S, tls: AgentTLS | None = None
                 ) -> agent_pb2.AgentStoreHealthResponse | None:
    """Ask the agent at ``addr`` whether it reaches etcd (telling it whether
    the asker does); None when it does not answer in time. Never raises."""
    stub = agent_pb2_grpc.AgentStub(_channel(addr, tls))
    request = agent_pb2.AgentStoreHealthRequest(asker_has_store=asker_has_store, asker=asker)
    try:
        return stub.StoreHealth(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        logger.debug("The agent at %s did not answer StoreHealth: %s.", addr, exc.code().name)
        return None


def collect_stacks(addr: str, round_number: int, *, timeout_s: float,
                   tls: AgentTLS | None = None) -> list[RankStack]:
    """The summarised stacks of the workers of ``round_number`` at the agent
    at ``addr`` (:func:`rank_stacks_from_pb`: validated and bounded); empty
    when it does not answer in time or answers with an error. Never raises."""
    stub = agent_pb2_grpc.AgentStub(_channel(addr, tls))
    try:
        response = stub.CollectStacks(agent_pb2.AgentCollectStacksRequest(round=round_number),
                                      timeout=timeout_s)
    except grpc.RpcError as exc:
        logger.info("The agent at %s did not answer CollectStacks: %s.", addr, exc.code().name)
        return []
    return rank_stacks_from_pb(response.ranks)


def rank_stacks_from_pb(ranks) -> list[RankStack]:
    """Another agent's stack summaries, at most :data:`MAX_NPROC` of them,
    with text capped and numbers kept within what can be true."""
    return [RankStack(rank=max(0, r.rank), node_id=cap_text(r.node_id, 128), dumped=r.dumped,
                      place=cap_text(r.place, 300), collective=cap_text(r.collective, 64),
                      step=max(-1, r.step), progress_age_s=max(-1.0, r.progress_age_s),
                      entered_ns=max(0, r.entered_ns))
            for r in list(ranks)[:MAX_NPROC]]


def rank_stacks_to_pb(ranks: list[RankStack]) -> list[agent_pb2.RankStack]:
    return [agent_pb2.RankStack(rank=r.rank, node_id=r.node_id, dumped=r.dumped, place=r.place,
                                collective=r.collective, step=r.step,
                                progress_age_s=r.progress_age_s, entered_ns=r.entered_ns)
            for r in ranks]


def request_drain(
    addr: str, reason: str, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, *,
    tls: AgentTLS | None = None
) -> tuple[bool, str]:
    """Ask the agent at ``addr`` to leave the job at the next round boundary: (accepted, message).

    Not retried (the caller decides whether repeating is safe). Raises
    ElasticError when the agent is unreachable or answers with an error:
    AgentAuthError when the TLS handshake failed, NotAuthorisedError
    (PERMISSION_DENIED) without a client certificate it accepts, ConfigError
    for INVALID_ARGUMENT.
    """
    stub = agent_pb2_grpc.AgentStub(_channel(addr, tls))
    try:
        response = stub.Drain(agent_pb2.AgentDrainRequest(reason=reason), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise _rpc_error(addr, "Drain", exc, tls) from exc
    return response.accepted, response.message


def request_restart(
    addr: str, reason: str, timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, *,
    tls: AgentTLS | None = None
) -> tuple[bool, int]:
    """Ask the agent at ``addr`` for a new round with the same members: (accepted, round).

    ``round`` is the round the restart was requested for. Not retried: a
    repeated request could restart the group twice. Raises like
    :func:`request_drain`, and RateLimitedError (RESOURCE_EXHAUSTED) when an
    operator restart of the job was taken too recently.
    """
    stub = agent_pb2_grpc.AgentStub(_channel(addr, tls))
    try:
        response = stub.RequestRestart(
            agent_pb2.AgentRequestRestartRequest(reason=reason), timeout=timeout_s
        )
    except grpc.RpcError as exc:
        raise _rpc_error(addr, "RequestRestart", exc, tls) from exc
    return response.accepted, response.round


class HealthWatcher:
    """Follows one peer's health with the ``grpc.health.v1`` Watch stream in a daemon thread.

    ``on_change(status)`` is called from that thread with a :class:`PeerHealth`
    (a str) each time the observed status differs from the last one, the first
    observation included; UNREACHABLE when the stream cannot be opened or
    breaks. It then reconnects with exponential backoff from
    ``initial_backoff_s`` to ``max_backoff_s``. An exception from ``on_change``
    is logged and does not stop the watcher.
    """

    def __init__(
        self,
        addr: str,
        on_change: Callable[[PeerHealth], None],
        *,
        service: str = "",
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 2.0,
        tls: AgentTLS | None = None,
    ):
        self._addr = addr
        self._tls = tls
        self._tls_problem: str | None = None  # the last one logged
        self._on_change = on_change
        self._service = service
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self._status: PeerHealth | None = None
        self._thread = threading.Thread(target=self._run, name=f"health-watch-{addr}", daemon=True)

    @property
    def status(self) -> PeerHealth | None:
        """The last status seen, None before the first."""
        return self._status

    def start(self) -> HealthWatcher:
        """Start watching; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop watching and wait up to ``timeout_s`` for the thread; no on_change call follows."""
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _observe(self, status: PeerHealth) -> None:
        if status == self._status or self._stopped.is_set():
            return
        # Peers flip to NOT_SERVING and back at every round change: only
        # losing a peer is worth an operator's attention.
        logger.log(logging.WARNING if status is PeerHealth.UNREACHABLE else logging.DEBUG,
                   "Health of the agent at %s changed from %s to %s.",
                   self._addr, self._status or "nothing seen", status)
        self._status = status
        try:
            self._on_change(status)
        except Exception:  # noqa: BLE001 (a broken callback must not end the watch)
            logger.exception("The health callback for the agent at %s failed.", self._addr)

    def _note_tls_problem(self, exc: grpc.RpcError) -> None:
        """Warn, once per distinct problem, when the watch fails in the TLS
        handshake: a misconfiguration, which retrying does not mend."""
        tls_error = _tls_error(self._addr, "Watch", exc, self._tls)
        problem = str(tls_error) if tls_error is not None else None
        if problem is not None and problem != self._tls_problem:
            logger.warning("Cannot watch the health of the agent at %s: %s.", self._addr,
                           problem)
        self._tls_problem = problem

    def _run(self) -> None:
        backoff_s = self._initial_backoff_s
        request = health_pb2.HealthCheckRequest(service=self._service)
        while not self._stopped.is_set():
            try:
                # Looked up each time: close_channels() may have replaced the cached channel.
                call = health_pb2_grpc.HealthStub(_channel(self._addr, self._tls)).Watch(request)
                with self._lock:
                    self._call = call
                if self._stopped.is_set():  # stop() ran before the call was visible to it
                    call.cancel()
                    break
                for response in call:
                    backoff_s = self._initial_backoff_s
                    self._observe(_health_from_status(response.status))
                why = "the stream ended"
            except grpc.RpcError as exc:
                why = f"{exc.code().name}: {exc.details()}"
                self._note_tls_problem(exc)
            except (ValueError, ConfigError) as exc:  # channel closed under us; TLS files gone
                why = str(exc)
            if self._stopped.is_set():
                break
            logger.debug("Health watch of the agent at %s broke (%s); retrying in %.1f s.",
                         self._addr, why, backoff_s)
            self._observe(PeerHealth.UNREACHABLE)
            self._stopped.wait(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
        with self._lock:
            self._call = None


class GrpcPeerMesh:
    """How an agent reaches the other agents of its job, over gRPC (with
    mutual TLS when ``tls`` is given: this agent's own certificate).

    The agent's loop depends only on these calls, so the fault simulator
    swaps in a fake mesh whose links it cuts at will.
    """

    def __init__(self, tls: AgentTLS | None = None):
        """Raises ConfigError when ``tls``'s files cannot be read (read now,
        so that the calls below, which never raise, cannot fail on them)."""
        self._tls = tls
        if tls is not None:
            tls.channel_credentials()

    def watch(self, addr: str, on_change: Callable[[str], None]) -> HealthWatcher:
        """Follow the health of the agent at ``addr``; stop() the result to end it."""
        return HealthWatcher(addr, on_change, tls=self._tls).start()

    def answers(self, addr: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        """Whether an agent answers at ``addr`` within ``timeout_s`` (any health status counts)."""
        return check_health(addr, timeout_s, tls=self._tls) is not PeerHealth.UNREACHABLE

    def probe(self, addr: str, on_silent: Callable[[float], None]) -> PeerProbe:
        """Probe the agent at ``addr`` (:mod:`agent.probe`); stop() the result to end it."""
        return PeerProbe(addr, lambda on_answer: check_health_async(addr, on_answer,
                                                                    tls=self._tls),
                         on_silent).start()

    def check_store(self, addrs: tuple[str, ...],
                    on_answer: Callable[[tuple[tuple[str, float], ...], int], None]) -> None:
        """Ask the agents at ``addrs``, in parallel and in the background,
        when etcd last confirmed their lease; ``on_answer`` gets ``(addr,
        age_s)`` of each that answered (-1: never) and how many answered."""
        def ask() -> None:
            answers = self._ask_all(addrs, asker_has_store=False, asker="")
            ages = tuple((a, r.confirmed_age_s) for a, r in zip(addrs, answers) if r is not None)
            on_answer(ages, len(ages))

        threading.Thread(target=ask, name="peers-store-check", daemon=True).start()

    def fence(self, addrs: tuple[str, ...], asker: str) -> bool:
        """Tell the agents at ``addrs`` that ``asker`` reaches etcd (so the
        ones cut off from it stop their workers); True when none of them
        still runs workers (an agent that does not answer counts as stopped)."""
        answers = self._ask_all(addrs, asker_has_store=True, asker=asker)
        return not any(r is not None and r.workers_running for r in answers)

    def collect_stacks(self, addrs: tuple[str, ...], round_number: int,
                       timeout_s: float) -> list[RankStack]:
        """The stack summaries of the workers of ``round_number`` at the agents
        at ``addrs``, asked in parallel, each within ``timeout_s``; those that
        do not answer add nothing. Never raises."""
        if not addrs:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(addrs))) as pool:
            answers = pool.map(lambda a: collect_stacks(a, round_number, timeout_s=timeout_s,
                                                        tls=self._tls), addrs)
            return [r for ranks in answers for r in ranks]

    def _ask_all(self, addrs, *, asker_has_store: bool, asker: str) -> list:
        if not addrs:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(addrs))) as pool:
            return list(pool.map(lambda a: store_health(a, asker_has_store=asker_has_store,
                                                        asker=asker, tls=self._tls), addrs))
