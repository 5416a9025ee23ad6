"""The sending side of memory-tier replication: one slot to the buddy's ``Replicate`` RPC.

:meth:`ReplicaClient.send_slot` sends ``begin``, the slot's files in chunks
of at most :data:`agent.memory_receiver.MAX_CHUNK_BYTES`, its manifest, and
``finish``, over a channel to the buddy's ``--listen`` address (mutual TLS
with the agent's ``--tls-*`` files, as every call between agents). Before
``finish`` it checks :func:`layout.still_same`: when the worker started the
slot over meanwhile, the copy is abandoned (the receiver's slot stays
incomplete) and the caller sends the newer snapshot instead.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Iterator

import grpc

from agent.memory_receiver import MAX_CHUNK_BYTES
from agent.tls import AgentTLS
from elastic.checkpoint.memory import layout
from elastic.errors import AgentUnreachableError, ElasticError
from elastic.net import fast_reconnect_options
from elastic.v1 import agent_pb2, agent_pb2_grpc

CALL_TIMEOUT_S = 10.0
# Chunks in flight at once: the receiver writes each at its offset, so their
# order does not matter, and a window keeps the connection busy while each
# call's round trip and write complete.
WINDOW = 4
_OPTIONS = [*fast_reconnect_options(), ("grpc.enable_http_proxy", 0)]


class ReplicaClient:
    """Sends slots to buddies; one cached channel per address."""

    def __init__(self, job_id: str, node_id: str, tls: AgentTLS | None):
        self._job_id = job_id
        self._node_id = node_id
        self._tls = tls
        self._stubs: dict[str, agent_pb2_grpc.AgentStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _stub(self, addr: str) -> agent_pb2_grpc.AgentStub:
        with self._lock:
            stub = self._stubs.get(addr)
            if stub is None:
                channel = (grpc.insecure_channel(addr, options=_OPTIONS) if self._tls is None
                           else grpc.secure_channel(addr, self._tls.channel_credentials(),
                                                    options=_OPTIONS
                                                    + self._tls.channel_options()))
                self._channels.append(channel)
                stub = self._stubs[addr] = agent_pb2_grpc.AgentStub(channel)
            return stub

    def send_slot(self, addr: str, round_number: int, info: layout.SlotInfo,
                  stop: threading.Event | None = None) -> int | None:
        """Send the slot ``info`` to the agent at ``addr``; the bytes sent, or
        None when the slot changed during the copy or ``stop`` was set
        (abandoned: the receiver's slot stays incomplete). Raises
        AgentUnreachableError when the buddy does not answer, ElasticError
        when it refuses (naming its reason), OSError when the slot's files
        cannot be read."""
        stub = self._stub(addr)
        base = dict(job_id=self._job_id, source=self._node_id, round=round_number,
                    slot=info.key.name)
        with open(os.path.join(info.path, layout.MANIFEST), "rb") as f:
            manifest = f.read(layout.MAX_MANIFEST_BYTES + 1)
        total = info.manifest.nbytes + len(manifest)
        _wait(addr, stub.Replicate.future(agent_pb2.AgentReplicateRequest(
            **base, begin=True, total_bytes=total), timeout=CALL_TIMEOUT_S))
        in_flight: collections.deque = collections.deque()
        try:
            for name, size in sorted(info.manifest.files.items()):
                for request in self._chunks(base, info.path, name, size):
                    if stop is not None and stop.is_set():
                        return None
                    if len(in_flight) >= WINDOW:
                        _wait(addr, in_flight.popleft())
                    in_flight.append(stub.Replicate.future(request, timeout=CALL_TIMEOUT_S))
                if not layout.still_same(info):
                    return None
            for offset in range(0, len(manifest), MAX_CHUNK_BYTES):
                in_flight.append(stub.Replicate.future(agent_pb2.AgentReplicateRequest(
                    **base, file=layout.MANIFEST, offset=offset,
                    data=manifest[offset:offset + MAX_CHUNK_BYTES]), timeout=CALL_TIMEOUT_S))
            while in_flight:
                _wait(addr, in_flight.popleft())
        finally:
            for call in in_flight:  # abandoned or failed: the rest is not waited for
                call.cancel()
        if not layout.still_same(info):
            return None
        _wait(addr, stub.Replicate.future(agent_pb2.AgentReplicateRequest(**base, finish=True),
                                          timeout=CALL_TIMEOUT_S))
        return total

    @staticmethod
    def _chunks(base: dict, slot_dir: str, name: str, size: int
                ) -> Iterator[agent_pb2.AgentReplicateRequest]:
        """The requests that carry the first ``size`` bytes of the slot's file
        ``name`` (its size in the manifest; one empty chunk creates an empty file)."""
        fd = os.open(os.path.join(slot_dir, name), os.O_RDONLY | os.O_NOFOLLOW)
        sent = 0
        try:
            while True:
                data = os.pread(fd, min(MAX_CHUNK_BYTES, size - sent), sent)
                yield agent_pb2.AgentReplicateRequest(**base, file=name, offset=sent, data=data)
                sent += len(data)
                if sent >= size or not data:
                    return
        finally:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            channels, self._channels, self._stubs = self._channels, [], {}
        for channel in channels:
            channel.close()


def _wait(addr: str, call: grpc.Future) -> None:
    """The call's answer; AgentUnreachableError or ElasticError when it failed."""
    try:
        call.result()
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise AgentUnreachableError(f"buddy agent at {addr} did not answer Replicate "
                                        f"({code.name})") from None
        raise ElasticError(f"buddy agent at {addr} refused Replicate: {code.name}: "
                           f"{exc.details()}") from None

