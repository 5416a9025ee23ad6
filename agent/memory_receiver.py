"""The receiving side of memory-tier replication: the ``Replicate`` RPC's rules.

A buddy sends each snapshot slot as ``begin`` (the slot's total bytes), then
chunks of its files (the manifest among them, as the file ``manifest.json``),
then ``finish``. Everything in a request is input from the network, checked
before a byte is written (:meth:`ReplicaReceiver.receive`):

* the job id is this agent's, the source is a valid node id, not this node,
  and a member of the round this agent knows (FencedError otherwise);
* the slot's name is a slot's name, a file's name a plain name inside the slot;
* ``begin``'s total fits the memory root's free space, less a reserve; chunks
  stay within the slot's announced total and within their file;
* at ``finish`` the manifest parses (:meth:`Manifest.from_json`), names this
  job and the source, agrees with the slot's name, and every file it lists is
  there with its size (files it does not list are removed).

The replica is written with the layout's protocol: ``begin`` makes the slot
incomplete (:func:`layout.begin_write`), ``finish`` makes it complete
(:func:`layout.finish_write`), so a replica torn by a lost sender is never
complete. Refusals raise InvalidRequestError (INVALID_ARGUMENT for the
caller; also when the slot cannot be written: a full memory root, a slot
freed meanwhile) or FencedError (FAILED_PRECONDITION).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from typing import Callable

from elastic.checkpoint.memory import layout
from elastic.errors import ConfigError, FencedError, InvalidRequestError
from elastic.records import cap_text
from elastic.rendezvous.api import Round
from elastic.v1 import agent_pb2

# A chunk's data stays under the server's 1 MiB request limit (agent.grpc_input)
# with room for the request's other fields.
MAX_CHUNK_BYTES = (1 << 20) - (16 << 10)
# Left free on the memory root whatever a buddy sends: the workers' own
# snapshots need it first.
RESERVE_BYTES = 64 << 20
# Slots of one source being received at once (one per rank is the most a sender has).
MAX_PENDING_PER_SOURCE = 64
_INCOMING_MANIFEST = ".manifest.incoming"
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")


@dataclasses.dataclass
class _Pending:
    total: int
    received: int = 0


def may_send(known: Round, receiver: str, source: str) -> bool:
    """Whether node ``receiver``, which knows the round ``known``, takes
    replicas from ``source``: a member it holds, or its own source (all a
    large job's node is told of the members beyond its bucket; another member
    of such a round is refused until it learns the round and sends to its own
    buddy). Raises MalformedRecordError when a line it reads does not read."""
    placed = known.placement(receiver)
    if placed is not None and placed.source is not None and placed.source.node_id == source:
        return True
    if known.holds_members:
        return known.member(source) is not None
    return any(m.node_id == source for m in known.held_members())


class ReplicaReceiver:
    """Writes the replicas buddies send into ``memory_dir``/replicas/.

    ``round_of()`` is the round this agent knows (any thread); ``free()`` the
    bytes free on the memory root; ``lock`` is held while files change (the
    replicator's freeing holds it too)."""

    def __init__(self, memory_dir: str, job_id: str, node_id: str,
                 round_of: Callable[[], Round | None], free: Callable[[], int],
                 lock: threading.Lock):
        self._dir = memory_dir
        self._job_id = job_id
        self._node_id = node_id
        self._round_of = round_of
        self._free = free
        self._lock = lock
        self._pending: dict[tuple[str, str], _Pending] = {}

    def receive(self, req: agent_pb2.AgentReplicateRequest) -> int:
        """Apply one request; returns the bytes left free on the memory root.
        Raises InvalidRequestError or FencedError (the module docstring)."""
        source = self._check_sender(req)
        if layout.parse_slot_name(req.slot) is None:
            raise InvalidRequestError(f"Replicate: slot {_shown(req.slot)} is not a slot name")
        slot_dir = os.path.join(layout.replica_dir(self._dir, source), req.slot)
        try:
            with self._lock:
                if req.begin:
                    self._begin(source, req.slot, slot_dir, req.total_bytes)
                elif req.finish:
                    self._finish(source, req.slot, slot_dir)
                else:
                    self._chunk(source, req, slot_dir)
        except OSError as exc:  # the memory root is full, or the slot was freed meanwhile
            self._pending.pop((source, req.slot), None)
            raise InvalidRequestError(f"Replicate: node {self._node_id} cannot write slot "
                                      f"{req.slot} of node {source}: "
                                      f"{exc.strerror or exc}") from None
        return self._free()

    def _check_sender(self, req: agent_pb2.AgentReplicateRequest) -> str:
        if req.job_id != self._job_id:
            raise InvalidRequestError(f"Replicate: job {_shown(req.job_id)}, but this agent "
                                      f"serves job {self._job_id}")
        try:
            layout.replica_dir(self._dir, req.source)
        except ConfigError:
            raise InvalidRequestError(f"Replicate: source {_shown(req.source)} is not a node "
                                      "id") from None
        if req.source == self._node_id:
            raise InvalidRequestError("Replicate: a node does not replicate to itself")
        known = self._round_of()
        if known is None or not may_send(known, self._node_id, req.source):
            raise FencedError(f"Replicate: node {req.source} is not a member of round "
                              f"{known.number if known else 0} as node {self._node_id} "
                              "knows it")
        return req.source

    def _begin(self, source: str, slot: str, slot_dir: str, total: int) -> None:
        room = self._free() - RESERVE_BYTES
        if not 0 < total <= room:
            raise InvalidRequestError(
                f"Replicate: slot {slot} of node {source} would take {total} bytes; the "
                f"memory root has {max(room, 0)} free beyond its reserve of {RESERVE_BYTES}")
        mine = [k for k in self._pending if k[0] == source and k[1] != slot]
        for key in mine[:max(0, len(mine) - MAX_PENDING_PER_SOURCE + 1)]:
            del self._pending[key]
        os.makedirs(os.path.dirname(slot_dir), mode=layout.DIR_MODE, exist_ok=True)
        layout.begin_write(slot_dir)
        # The slot's earlier files go: chunks are written in place, and a
        # longer file of an earlier snapshot would keep its tail.
        for name in os.listdir(slot_dir):
            os.unlink(os.path.join(slot_dir, name))
        self._pending[(source, slot)] = _Pending(total)

    def _chunk(self, source: str, req: agent_pb2.AgentReplicateRequest, slot_dir: str) -> None:
        pending = self._pending.get((source, req.slot))
        if pending is None:
            raise InvalidRequestError(f"Replicate: a chunk of slot {req.slot} of node "
                                      f"{source} without its begin")
        if not _FILE.fullmatch(req.file):
            raise InvalidRequestError(f"Replicate: file {_shown(req.file)} is not a plain "
                                      "name inside the slot")
        size = len(req.data)
        if size > MAX_CHUNK_BYTES or req.offset < 0 or req.offset + size > pending.total \
                or pending.received + size > pending.total:
            raise InvalidRequestError(
                f"Replicate: {size} bytes at offset {req.offset} of {req.file} exceed slot "
                f"{req.slot}'s announced {pending.total} bytes")
        name = _INCOMING_MANIFEST if req.file == layout.MANIFEST else req.file
        fd = os.open(os.path.join(slot_dir, name), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW,
                     layout.FILE_MODE)
        try:
            os.pwrite(fd, req.data, req.offset)
        finally:
            os.close(fd)
        pending.received += size

    def _finish(self, source: str, slot: str, slot_dir: str) -> None:
        if self._pending.pop((source, slot), None) is None:
            raise InvalidRequestError(f"Replicate: finish of slot {slot} of node {source} "
                                      "without its begin")
        manifest = self._manifest(source, slot, slot_dir)
        for name in os.listdir(slot_dir):
            if name not in manifest.files and name != _INCOMING_MANIFEST:
                os.unlink(os.path.join(slot_dir, name))
        for name, size in manifest.files.items():
            try:
                got = os.lstat(os.path.join(slot_dir, name)).st_size
            except FileNotFoundError:
                got = -1
            if got != size:
                raise InvalidRequestError(f"Replicate: slot {slot} of node {source}: {name} "
                                          f"has {got} bytes, its manifest says {size}")
        layout.finish_write(slot_dir, manifest)
        os.unlink(os.path.join(slot_dir, _INCOMING_MANIFEST))

    def _manifest(self, source: str, slot: str, slot_dir: str) -> layout.Manifest:
        """The manifest received for the slot, checked against the request."""
        try:
            with open(os.path.join(slot_dir, _INCOMING_MANIFEST), "rb") as f:
                data = f.read(layout.MAX_MANIFEST_BYTES + 1)
            if len(data) > layout.MAX_MANIFEST_BYTES:
                raise ValueError(f"over {layout.MAX_MANIFEST_BYTES} bytes")
            manifest = layout.Manifest.from_json(data)
        except FileNotFoundError:
            raise InvalidRequestError(f"Replicate: slot {slot} of node {source} finished "
                                      "without its manifest") from None
        except ValueError as exc:
            raise InvalidRequestError(f"Replicate: slot {slot} of node {source}: malformed "
                                      f"manifest: {exc}") from None
        key = layout.parse_slot_name(slot)
        if (manifest.job_id, manifest.node_id) != (self._job_id, source) or key is None \
                or (manifest.round, manifest.rank) != (key.round, key.rank):
            raise InvalidRequestError(
                f"Replicate: slot {slot} of node {source}: its manifest is of job "
                f"{manifest.job_id}, node {manifest.node_id}, round {manifest.round}, rank "
                f"{manifest.rank}")
        return manifest


def _shown(value: str) -> str:
    return cap_text(repr(value), 80)
