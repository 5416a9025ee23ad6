"""The status record: what an agent says about itself, in etcd and over gRPC.

An agent writes its :class:`StatusRecord` under ``status/<node>`` (with its
lease, :mod:`agent.publishing`) and answers the ``Status`` RPC with the same
record as protobuf; ``elasticctl status`` (:mod:`agent.status`) reads either
back. ``last_step`` and ``step_rate`` are the node's progress
(:func:`agent.health.node_progress`): the newest step of its workers and the
slowest rate.

A record read back is another process's word: :meth:`StatusRecord.from_json`
and :meth:`StatusRecord.from_pb` check every field and make its text
printable and capped, so that a record anyone wrote renders without surprises.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable

from agent.health import node_progress
from agent.stragglers import BUSY, WALL
from elastic.errors import MalformedRecordError
from elastic.records import (
    MAX_NPROC,
    FieldsAsJson,
    cap_text,
    element_fields,
    int_field,
    load_object,
    text_field,
    typed_field,
)
from elastic.v1 import agent_pb2

# Worker states (``WorkerRow.state``) and agent states are short words.
_STATE_CHARS = 32
_NODE_ID_CHARS = 128
_ACTION_CHARS = 256
# Stragglers listed in one record at most (the leader's; others list none).
MAX_STRAGGLERS = 64


@dataclass(frozen=True)
class WorkerRow:
    """One worker of the round running on the node."""

    local_rank: int
    rank: int
    pid: int
    state: str  # "starting", "running", "succeeded"
    last_step: int = -1
    step_rate: float = 0.0  # steps per second over its recent heartbeats
    heartbeat_age_s: float = -1.0  # seconds since its last heartbeat, -1 if none yet
    exit_code: int = 0
    # Hang detection judges its progress: it reported some (an optimizer step
    # or elastic.step), or the script did in an earlier round here.
    judged: bool = False

    @classmethod
    def from_dict(cls, key: str, i: int, row: Any) -> "WorkerRow":
        """Row ``i`` of the record at ``key``; MalformedRecordError naming the field."""
        named, field = element_fields(key, "workers", i, row)
        return cls(
            local_rank=int_field(key, named, field("local_rank"), 0, default=0),
            rank=int_field(key, named, field("rank"), 0, default=0),
            pid=int_field(key, named, field("pid"), 0, default=0),
            state=text_field(key, named, field("state"), "?", limit=_STATE_CHARS),
            last_step=int_field(key, named, field("last_step"), -1, default=-1),
            step_rate=_number(key, named, field("step_rate")),
            heartbeat_age_s=_number(key, named, field("heartbeat_age_s"), low=-1.0),
            exit_code=int_field(key, named, field("exit_code"), -255, 255, default=0),
            judged=typed_field(key, named, field("judged"), bool, False))

    @classmethod
    def from_pb(cls, w: agent_pb2.WorkerStatus) -> "WorkerRow":
        return cls(local_rank=w.local_rank, rank=w.rank, pid=w.pid,
                   state=cap_text(w.state, _STATE_CHARS), last_step=w.last_step,
                   step_rate=w.step_rate, heartbeat_age_s=w.heartbeat_age_s,
                   exit_code=w.exit_code, judged=w.judged)


def _nested_fields(key: str, name: str, obj: Any) -> dict[str, Any]:
    """The fields of the object in field ``name`` of the record at ``key``,
    each named as it sits in the record (``name.field``), for errors;
    MalformedRecordError when it is not an object."""
    if not isinstance(obj, dict):
        raise MalformedRecordError(key, f"field {name!r} is not an object")
    return {f"{name}.{field}": value for field, value in obj.items()}


@dataclass(frozen=True)
class MemoryTierRow:
    """The memory tier on a node (``--memory-tier``): what it holds, whom it
    replicates to, how far its buddy's copy trails, and the most it may need
    (``need_bytes``: twice its own snapshot plus twice the replica it holds)."""

    own_bytes: int = 0
    own_slots: int = 0
    replica_bytes: int = 0
    replica_slots: int = 0
    replica_source: str = ""
    buddy: str = ""
    newest_own_step: int = -1
    acked_step: int = -1
    lag_steps: int = 0
    need_bytes: int = 0
    replication_bytes_per_s: float = 0.0
    free_bytes: int = 0

    @classmethod
    def from_dict(cls, key: str, obj: Any) -> "MemoryTierRow":
        """The ``memory_tier`` object of the record at ``key``; MalformedRecordError
        naming the field."""
        named = _nested_fields(key, "memory_tier", obj)

        def count(name: str, low: int = 0) -> int:
            return int_field(key, named, f"memory_tier.{name}", low, default=low)

        return cls(own_bytes=count("own_bytes"), own_slots=count("own_slots"),
                   replica_bytes=count("replica_bytes"), replica_slots=count("replica_slots"),
                   replica_source=text_field(key, named, "memory_tier.replica_source",
                                             limit=_NODE_ID_CHARS),
                   buddy=text_field(key, named, "memory_tier.buddy", limit=_NODE_ID_CHARS),
                   newest_own_step=count("newest_own_step", -1),
                   acked_step=count("acked_step", -1), lag_steps=count("lag_steps"),
                   need_bytes=count("need_bytes"),
                   replication_bytes_per_s=_number(key, named,
                                                   "memory_tier.replication_bytes_per_s"),
                   free_bytes=count("free_bytes"))

    def to_pb(self) -> agent_pb2.MemoryTierStatus:
        return agent_pb2.MemoryTierStatus(**dataclasses.asdict(self))

    @classmethod
    def from_pb(cls, m: agent_pb2.MemoryTierStatus) -> "MemoryTierRow":
        """The row an agent sent, its text made printable and capped, its numbers
        clamped to what can be true."""
        rate = m.replication_bytes_per_s
        return cls(own_bytes=max(0, m.own_bytes), own_slots=max(0, m.own_slots),
                   replica_bytes=max(0, m.replica_bytes),
                   replica_slots=max(0, m.replica_slots),
                   replica_source=cap_text(m.replica_source, _NODE_ID_CHARS),
                   buddy=cap_text(m.buddy, _NODE_ID_CHARS),
                   newest_own_step=max(-1, m.newest_own_step),
                   acked_step=max(-1, m.acked_step), lag_steps=max(0, m.lag_steps),
                   need_bytes=max(0, m.need_bytes),
                   replication_bytes_per_s=rate if math.isfinite(rate) and rate > 0 else 0.0,
                   free_bytes=max(0, m.free_bytes))

    def line(self, node_id: str) -> str:
        """One line for ``elasticctl status``."""
        acked = str(self.acked_step) if self.acked_step >= 0 else "none"
        newest = str(self.newest_own_step) if self.newest_own_step >= 0 else "none"
        held = (f"{human_bytes(self.replica_bytes)} in {self.replica_slots} slots of "
                f"{self.replica_source}" if self.replica_source else
                f"{human_bytes(self.replica_bytes)} in {self.replica_slots} slots")
        return (f"memory tier {node_id}: own {human_bytes(self.own_bytes)} in "
                f"{self.own_slots} slots (newest step {newest}), replicas {held}; buddy "
                f"{self.buddy or 'none'} has step {acked} (lag {self.lag_steps}, "
                f"{human_bytes(int(self.replication_bytes_per_s))}/s); needs up to "
                f"{human_bytes(self.need_bytes)}, {human_bytes(self.free_bytes)} free")


# Causes a goodput row names (agent.goodput.RESTART_CAUSES): short words, a few.
_CAUSE_CHARS = 32
MAX_GOODPUT_CAUSES = 16


@dataclass(frozen=True)
class GoodputRow:
    """Where the job's wall time went as the node sees it (:mod:`agent.goodput`):
    seconds by kind, the repeated and recovery seconds of each restart cause
    that lost any, and the ETTR over ``window_s`` (-1: nothing accounted yet)."""

    ettr: float = -1.0
    window_s: float = 0.0
    productive_s: float = 0.0
    repeated_s: float = 0.0
    recovery_s: float = 0.0
    other_s: float = 0.0
    lost_by_cause: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_dict(cls, key: str, obj: Any) -> "GoodputRow":
        """The ``goodput`` object of the record at ``key``; MalformedRecordError
        naming the field."""
        named = _nested_fields(key, "goodput", obj)
        pairs = typed_field(key, named, "goodput.lost_by_cause", list, [])
        if len(pairs) > MAX_GOODPUT_CAUSES or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise MalformedRecordError(key, "field 'goodput.lost_by_cause' is not a short list "
                                            "of [cause, seconds] pairs")
        lost = tuple((cap_text(c, _CAUSE_CHARS),
                      _number(key, {"goodput.lost_by_cause": s}, "goodput.lost_by_cause"))
                     for c, s in pairs)
        return cls(ettr=_number(key, named, "goodput.ettr", low=-1.0),
                   window_s=_number(key, named, "goodput.window_s"),
                   productive_s=_number(key, named, "goodput.productive_s"),
                   repeated_s=_number(key, named, "goodput.repeated_s"),
                   recovery_s=_number(key, named, "goodput.recovery_s"),
                   other_s=_number(key, named, "goodput.other_s"), lost_by_cause=lost)

    @property
    def accounted_s(self) -> float:
        return self.productive_s + self.repeated_s + self.recovery_s + self.other_s

    def line(self, node_id: str) -> str:
        """One line for ``elasticctl status``."""
        ettr = f"{100 * self.ettr:.1f} %" if self.ettr >= 0 else "-"
        causes = ", ".join(f"{c} {s:.0f} s" for c, s in self.lost_by_cause)
        return (f"goodput (as node {node_id} sees it): ETTR {ettr} over the last "
                f"{self.window_s / 60:g} min; productive {self.productive_s:.0f} s, repeated "
                f"{self.repeated_s:.0f} s, recovery {self.recovery_s:.0f} s"
                + (f" ({causes})" if causes else "") + f", other {self.other_s:.0f} s")


@dataclass(frozen=True)
class StragglerRow:
    """A rank the leader names a straggler now (:mod:`agent.stragglers`): its
    windowed time per step by ``measure`` ("wall" or "busy"), its peers'
    median of it, how long it has been that slow, and what the leader did
    (``action``)."""

    rank: int
    node_id: str
    step_s: float
    peers_s: float
    slow_for_s: float
    action: str
    measure: str = WALL

    @classmethod
    def from_dict(cls, key: str, i: int, row: Any) -> "StragglerRow":
        """Row ``i`` of the record at ``key``; MalformedRecordError naming the field."""
        named, field = element_fields(key, "stragglers", i, row)
        return cls(rank=int_field(key, named, field("rank"), 0),
                   node_id=text_field(key, named, field("node_id"), limit=_NODE_ID_CHARS),
                   step_s=_number(key, named, field("step_s")),
                   peers_s=_number(key, named, field("peers_s")),
                   slow_for_s=_number(key, named, field("slow_for_s")),
                   action=text_field(key, named, field("action"), limit=_ACTION_CHARS),
                   measure=BUSY if named.get(field("measure")) == BUSY else WALL)

    @classmethod
    def from_pb(cls, s: agent_pb2.StragglerStatus) -> "StragglerRow":
        """The row an agent sent, its text made printable and capped, its times
        clamped to what can be true."""
        def seconds(x: float) -> float:
            return x if math.isfinite(x) and x > 0 else 0.0

        return cls(rank=max(0, s.rank), node_id=cap_text(s.node_id, _NODE_ID_CHARS),
                   step_s=seconds(s.step_s), peers_s=seconds(s.peers_s),
                   slow_for_s=seconds(s.slow_for_s), action=cap_text(s.action, _ACTION_CHARS),
                   measure=BUSY if s.measure == BUSY else WALL)

    def line(self) -> str:
        """One line for ``elasticctl status``."""
        ratio = f"{self.step_s / self.peers_s:.2f}x" if self.peers_s > 0 else "slower than"
        took = (f"busy {self.step_s:.3f} s per step" if self.measure == BUSY
                else f"steps of {self.step_s:.3f} s")
        return (f"straggler: rank {self.rank} (node {self.node_id}), {took}, {ratio} its "
                f"peers' median of {self.peers_s:.3f} s, for {self.slow_for_s:.0f} s; "
                f"{self.action}")


def human_bytes(n: int) -> str:
    """``n`` bytes as people read them: 512 B, 1.5 KiB, 3.2 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class StatusRecord(FieldsAsJson):
    """An agent's status: its state, its round, its workers and its progress."""

    node_id: str
    state: str  # the agent's lifecycle state, e.g. "RUNNING"
    round: int
    node_rank: int | None  # None: not a member of the round
    workers: tuple[WorkerRow, ...]
    last_step: int
    step_rate: float
    restarts: int  # rounds this agent started workers in, minus one
    last_failure: str
    memory_tier: MemoryTierRow | None = None  # None: the memory tier is off
    # In the etcd record only (not in the Status RPC's answer): None when not accounted.
    goodput: GoodputRow | None = None
    # The ranks the leader names stragglers now; the leader's record alone has any.
    stragglers: tuple[StragglerRow, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(_without_absent(dataclasses.asdict(self)), sort_keys=True).encode()

    @classmethod
    def of(cls, node_id: str, state: str, round_number: int, node_rank: int | None,
           workers: Iterable[WorkerRow], restarts: int, last_failure: str) -> "StatusRecord":
        """The record of these workers, with the node's progress worked out from them."""
        rows = tuple(workers)
        last_step, step_rate = node_progress((w.last_step, w.step_rate) for w in rows)
        return cls(node_id, state, round_number, node_rank, rows, last_step, step_rate,
                   restarts, last_failure)

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "StatusRecord":
        """Parse the record at ``key`` (``.../status/<node>``).

        Raises MalformedRecordError naming the key and the field when it is not
        a JSON object, a count is not an integer in range, a rate or an age is
        not a finite number, or ``workers`` is not a list of worker objects."""
        obj = load_object(key, raw)
        rows = typed_field(key, obj, "workers", list, [])
        if len(rows) > MAX_NPROC:
            raise MalformedRecordError(key, f"field 'workers' lists {len(rows)} workers")
        workers = tuple(WorkerRow.from_dict(key, i, row) for i, row in enumerate(rows))
        node_rank = typed_field(key, obj, "node_rank", (int, type(None)), None)
        if node_rank is not None:
            node_rank = int_field(key, obj, "node_rank", 0)
        return cls(node_id=text_field(key, obj, "node_id", limit=_NODE_ID_CHARS),
                   state=text_field(key, obj, "state", "?", limit=_STATE_CHARS),
                   round=int_field(key, obj, "round", 0, default=0), node_rank=node_rank,
                   workers=workers, last_step=int_field(key, obj, "last_step", -1, default=-1),
                   step_rate=_number(key, obj, "step_rate"),
                   restarts=int_field(key, obj, "restarts", 0, default=0),
                   last_failure=text_field(key, obj, "last_failure"),
                   memory_tier=MemoryTierRow.from_dict(key, obj["memory_tier"])
                   if obj.get("memory_tier") is not None else None,
                   goodput=GoodputRow.from_dict(key, obj["goodput"])
                   if obj.get("goodput") is not None else None,
                   stragglers=_stragglers(key, obj))

    def to_pb(self, job_id: str, world_size: int, version: str
              ) -> agent_pb2.AgentStatusResponse:
        """The answer to the ``Status`` RPC."""
        return agent_pb2.AgentStatusResponse(
            job_id=job_id, node_id=self.node_id, state=self.state, round=self.round,
            node_rank=-1 if self.node_rank is None else self.node_rank, world_size=world_size,
            workers=[agent_pb2.WorkerStatus(**dataclasses.asdict(w)) for w in self.workers],
            restarts=self.restarts, last_failure=self.last_failure, version=version,
            memory_tier=self.memory_tier.to_pb() if self.memory_tier is not None else None,
            stragglers=[agent_pb2.StragglerStatus(**dataclasses.asdict(x))
                        for x in self.stragglers])

    @classmethod
    def from_pb(cls, resp: agent_pb2.AgentStatusResponse) -> "StatusRecord":
        """The record in an agent's answer to the ``Status`` RPC, its text made
        printable and capped."""
        record = cls.of(cap_text(resp.node_id, _NODE_ID_CHARS),
                        cap_text(resp.state, _STATE_CHARS), resp.round,
                        resp.node_rank if resp.node_rank >= 0 else None,
                        (WorkerRow.from_pb(w) for w in resp.workers[:MAX_NPROC]),
                        resp.restarts, cap_text(resp.last_failure))
        if resp.HasField("memory_tier"):
            record = dataclasses.replace(record,
                                         memory_tier=MemoryTierRow.from_pb(resp.memory_tier))
        if resp.stragglers:
            record = dataclasses.replace(record, stragglers=tuple(
                StragglerRow.from_pb(x) for x in resp.stragglers[:MAX_STRAGGLERS]))
        return record

    def summary(self, source: str) -> dict:
        """What ``elasticctl status`` shows of the node's agent; ``source``:
        "agent" (asked live) or "etcd" (the record it last published)."""
        fields = _without_absent(dataclasses.asdict(self))
        del fields["node_id"]
        if "stragglers" in fields:
            fields["stragglers"] = list(fields["stragglers"])
        return {"source": source, **fields, "workers": list(fields["workers"])}


def _without_absent(fields: dict[str, Any]) -> dict[str, Any]:
    """A record's fields less the optional ones it does not have (no memory
    tier, no goodput, no stragglers), which the JSON and the summary leave out."""
    for optional in ("memory_tier", "goodput", "stragglers"):
        if fields[optional] in (None, ()):
            del fields[optional]
    return fields


def _stragglers(key: str, obj: dict) -> tuple[StragglerRow, ...]:
    rows = typed_field(key, obj, "stragglers", list, [])
    if len(rows) > MAX_STRAGGLERS:
        raise MalformedRecordError(key, f"field 'stragglers' lists {len(rows)} ranks")
    return tuple(StragglerRow.from_dict(key, i, row) for i, row in enumerate(rows))


def _number(key: str, obj: dict, name: str, low: float = 0.0) -> float:
    """A finite number >= ``low`` (0.0 when absent); MalformedRecordError otherwise."""
    value = typed_field(key, obj, name, (int, float), 0.0)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < low:
        raise MalformedRecordError(key, f"field {name!r} is {number!r}, expected a finite "
                                        f"number >= {low:g}")
    return number
