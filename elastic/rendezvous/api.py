"""Rendezvous records: what nodes, the leader and operators write under a
job's prefix in etcd (registrations, rounds, standbys, drain and restart
requests, reports).

Records are JSON objects in etcd; ``from_json`` validates them and raises
:class:`~elastic.errors.MalformedRecordError` naming the key, so garbage written
by hand or by an incompatible version is reported rather than crashing a node.
The limits and field readers they share are :mod:`elastic.records`; the
settings of a rendezvous, :mod:`elastic.rendezvous.config`; the leader's
decision types, :mod:`elastic.rendezvous.decisions`.
"""

from __future__ import annotations

import enum
import functools
import json
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from elastic.errors import MalformedRecordError
from elastic.records import (
    MAX_NPROC,
    FieldsAsJson,
    addr_field,
    cap_text,
    element_fields,
    host_field,
    id_field,
    int_field,
    load_object,
    port_field,
    text_field,
    time_field,
    typed_field,
    valid_addr,
)
from elastic.rendezvous.placement import Placement, placements

# A rack's name (--rack) is a short label.
MAX_RACK_CHARS = 64


@dataclass(frozen=True)
class NodeInfo(FieldsAsJson):
    """What an agent registers about itself under ``nodes/<node_id>`` (with its lease)."""

    node_id: str
    host: str
    nproc: int = 1
    addr: str = ""  # host:port of the agent's gRPC server, "" if it serves none
    master_port: int = 0  # a port free on ``host`` for the workers' rendezvous if rank 0
    version: str = ""
    # The round whose workers this agent still runs when it registers (again,
    # after its lease ran out during an etcd outage); 0 when it runs none.
    running_round: int = 0
    # Where the node sits (--rack): the memory tier replicates across racks. "" when
    # not said, and then left out of the record.
    rack: str = ""

    def to_json(self) -> bytes:
        return json.dumps(_without_empty_rack(asdict(self)), sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "NodeInfo":
        """Parse the record at ``key`` (``.../nodes/<node_id>``).

        Raises MalformedRecordError naming the key and the field when it is not
        a JSON object of correctly typed fields, ``nproc`` < 1, a port is outside
        0..65535, ``host`` is not a host name or ``addr`` not HOST:PORT, or
        ``node_id`` is not a valid id or not the key's.
        """
        obj = load_object(key, raw)
        info = cls(
            node_id=id_field(key, obj, "node_id"),
            host=host_field(key, obj, "host"),
            nproc=int_field(key, obj, "nproc", 1, MAX_NPROC),
            addr=addr_field(key, obj, "addr", ""),
            master_port=port_field(key, obj, "master_port", 0),
            version=text_field(key, obj, "version", "", limit=64),
            running_round=int_field(key, obj, "running_round", 0, default=0),
            rack=text_field(key, obj, "rack", "", limit=MAX_RACK_CHARS),
        )
        if not key.endswith("/" + info.node_id):
            raise MalformedRecordError(key, f"node_id {info.node_id!r} does not match the key")
        return info


class Outcome(enum.StrEnum):
    """How the job ended, as a round records it. A ``str`` enum: the record's
    JSON holds the value, and an outcome is false only while the job runs."""

    NONE = ""  # the job runs
    SUCCEEDED = "succeeded"  # every member's workers exited 0
    FAILED = "failed"  # the restart budget is spent, or the exit barrier timed out


@dataclass(frozen=True)
class Member:
    """A node's place in a round: its dense ``node_rank`` and first global rank."""

    node_id: str
    node_rank: int
    host: str
    nproc: int
    addr: str = ""
    rack: str = ""  # the node's NodeInfo.rack


def _without_empty_rack(obj: dict) -> dict:
    """A record's fields with ``rack`` left out when empty: records of nodes that
    say no rack stay as they were before the field existed."""
    if not obj.get("rack"):
        obj.pop("rack", None)
    return obj


@dataclass(frozen=True)
class Round:
    """A committed round: who trains, in what order, and where rank 0 listens.

    ``number`` equals the version of the ``round`` key in etcd (the fencing
    token): every round write increments it by exactly one. ``failures`` holds
    the wall times of the failures counted against the restart budget. A round
    with an ``outcome`` (:class:`Outcome`, not NONE) is the job's last: nobody
    starts workers for it, and agents exit. ``continues``: the number of the
    round whose workers this one keeps running, unchanged (0: a round of its
    own). The leader writes such a round when a malformed record replaced the
    round key: the write moved the fencing token on, but not the workers.

    ``members``: a tuple, or a roster read from etcd
    (:class:`elastic.rendezvous.roster.Roster`), a sequence that builds its
    members when first used whole and finds one (:meth:`member`) without
    building the others, or one bucket of a large roster
    (:class:`elastic.rendezvous.buckets.BucketRoster`, see
    :attr:`holds_members`).
    """

    number: int
    members: Sequence[Member]
    master_addr: str
    master_port: int
    reason: str
    leader: str
    created_at: float  # wall-clock seconds, for humans
    failures: tuple[float, ...] = ()
    outcome: Outcome = Outcome.NONE
    continues: int = 0

    def __post_init__(self) -> None:
        # Capped here, not only where reasons come from, so that no round written
        # can outgrow etcd's request limit whatever produced its reason.
        object.__setattr__(self, "reason", cap_text(self.reason))
        # Raises ValueError for a string that is no Outcome's value.
        object.__setattr__(self, "outcome", Outcome(self.outcome))

    @property
    def world_size(self) -> int:
        # A roster held in part knows it from the round record.
        known = getattr(self.members, "world_size", None)
        return known if known is not None else sum(m.nproc for m in self.members)

    @property
    def workers_round(self) -> int:
        """The round number this round's workers were started with (their
        ``ELASTIC_ROUND``): ``continues``, or this round's own number."""
        return self.continues or self.number

    def continued(self, number: int, reason: str, leader: str, created_at: float) -> "Round":
        """This round written again as round ``number``, its workers kept."""
        return replace(self, number=number, reason=reason, leader=leader,
                       created_at=created_at, continues=self.workers_round)

    def continued_by(self, other: "Round") -> bool:
        """Whether ``other`` keeps the workers of this round running: it
        continues them, with the same members, ranks and rank 0's address."""
        return (other.continues == self.workers_round and not other.outcome
                and (other.members, other.master_addr, other.master_port)
                == (self.members, self.master_addr, self.master_port))

    def check_members(self) -> None:
        """Build and check every member: raises MalformedRecordError naming
        the key and field when a roster's line is not a valid member or an
        id repeats (a roster builds them once, on its first whole use)."""
        _ = self.members[:0]

    @property
    def holds_members(self) -> bool:
        """Whether every member is held here: False for a large job's round
        taken from this node's bucket of its roster, which knows this node's
        line, the size and the world size (``RendezvousNode.latest_round``
        reads the rest)."""
        return getattr(self.members, "whole", True)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    def member(self, node_id: str) -> Member | None:
        # A roster finds one member in its text: a node looks itself up in
        # every round, at O(members) C-speed work rather than O(members) objects.
        find = getattr(self.members, "member", None)
        return find(node_id) if find is not None else self._by_id.get(node_id)

    @functools.cached_property
    def _by_id(self) -> dict[str, Member]:
        # Every node looks itself up in every round: O(1), not O(members).
        return {m.node_id: m for m in self.members}

    def placement(self, node_id: str) -> Placement | None:
        """Member ``node_id``'s first rank, ring peer, buddy and source
        (:mod:`elastic.rendezvous.placement`); None when it is no member, or
        when this round holds one bucket of an earlier form, which places
        nobody (read the round whole). Raises MalformedRecordError when the
        members are built (a whole roster) or its line read (a bucket) and fail."""
        find = getattr(self.members, "placement", None)
        return find(node_id) if find is not None else self._placements.get(node_id)

    @functools.cached_property
    def _placements(self) -> dict[str, Placement]:
        return placements(self.members)

    def membership_change(self, before: "Round") -> tuple[bool, bool] | None:
        """``(left, joined)``: whether some member of ``before`` is no member
        of this round, and whether some member of this one was none of
        ``before``'s. None when this node cannot tell without both lists
        whole: a large job's round taken from its bucket whose roster is
        neither ``before``'s nor a delta from it that the round carries."""
        if self.holds_members and before.holds_members:
            old, new = set(before.node_ids), set(self.node_ids)
            return bool(old - new), bool(new - old)
        name, before_name = (getattr(self.members, "name", None),
                             getattr(before.members, "name", None))
        if name is not None and name == before_name:
            return False, False
        change = getattr(self.members, "change_from", None)
        return change(before_name) if change is not None and before_name else None

    def held_members(self) -> Sequence[Member]:
        """The members held here: every one, or those of this node's bucket
        of a large roster (about BUCKET_MEMBERS, a sample that costs nothing
        more to read). Raises MalformedRecordError as :meth:`placement`."""
        held = getattr(self.members, "held", None)
        return held() if held is not None else self.members

    def to_json(self) -> bytes:
        obj = asdict(replace(self, members=()))
        obj["world_size"] = self.world_size
        obj["members"] = [_without_empty_rack(asdict(m)) for m in self.members]
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes, version: int) -> "Round":
        """Parse the round record stored at ``key`` whose etcd version is ``version``.

        Raises MalformedRecordError naming the key and the field when a field
        is missing or mistyped, ``number`` differs from ``version``, a member id
        is invalid or repeated, node ranks are not 0..n-1 in order, ``nproc`` <
        1, a port is outside 0..65535, a time is not finite, or ``outcome`` is
        not an :class:`Outcome`'s value. ``reason`` is capped at MAX_REASON_CHARS.
        """
        obj = load_object(key, raw)
        members = tuple(member_from_json(key, i, m)
                        for i, m in enumerate(typed_field(key, obj, "members", list)))
        return cls.from_fields(key, obj, version, members)

    @classmethod
    def from_fields(cls, key: str, obj: dict, version: int,
                    members: Sequence[Member]) -> "Round":
        """The round whose fields but ``members`` are the record ``obj`` at
        ``key`` (etcd version ``version``), and whose members are ``members``
        (read from wherever the record says they are). Raises
        MalformedRecordError as :meth:`from_json` does; a roster's members
        are checked as it builds them (see :class:`Round`)."""
        number = int_field(key, obj, "number", 1)
        if number != version:
            raise MalformedRecordError(
                key, f"round number {number} does not match the key's version {version}"
            )
        if isinstance(members, tuple):  # a roster's ranks are its lines' order
            if [m.node_rank for m in members] != list(range(len(members))):
                raise MalformedRecordError(key, "node ranks are not 0..n-1 in order")
            if len({m.node_id for m in members}) != len(members):
                raise MalformedRecordError(key, "field 'members' names a node twice")
        leader = typed_field(key, obj, "leader", str, "")
        if leader:  # "" in records written before the leader was recorded
            leader = id_field(key, obj, "leader")
        continues = int_field(key, obj, "continues", 0, number - 1, default=0)
        outcome = typed_field(key, obj, "outcome", str, "")
        if outcome not in _OUTCOME_VALUES:
            raise MalformedRecordError(key, f"field 'outcome' is {cap_text(outcome, 64)!r}, "
                                            f"expected one of {_OUTCOME_VALUES}")
        return cls(
            number=number,
            members=members,
            master_addr=host_field(key, obj, "master_addr"),
            master_port=port_field(key, obj, "master_port"),
            reason=text_field(key, obj, "reason"),
            leader=leader,
            created_at=time_field(key, obj, "created_at") if "created_at" in obj else 0.0,
            failures=tuple(time_field(key, obj, f"failures[{i}]", t)
                           for i, t in enumerate(typed_field(key, obj, "failures", list, []))),
            outcome=Outcome(outcome),
            continues=continues,
        )


_OUTCOME_VALUES = tuple(outcome.value for outcome in Outcome)


def member_from_json(key: str, index: int, obj: Any) -> Member:
    """Member ``index`` of the round's members read at ``key``; MalformedRecordError
    naming the field (``members[index].host``) if invalid."""
    named, name = element_fields(key, "members", index, obj)
    return Member(
        node_id=id_field(key, named, name("node_id")),
        node_rank=int_field(key, named, name("node_rank"), 0),
        host=host_field(key, named, name("host")),
        nproc=int_field(key, named, name("nproc"), 1, MAX_NPROC),
        addr=addr_field(key, named, name("addr"), ""),
        rack=text_field(key, named, name("rack"), "", limit=MAX_RACK_CHARS),
    )


@dataclass(frozen=True)
class Standbys:
    """The ``standbys`` record: agent addresses of registered non-members (the
    leader publishes the STANDBY_WITNESSES longest registered)."""

    addrs: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps({"addrs": list(self.addrs)}).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Standbys":
        """Raises MalformedRecordError naming the key when invalid: ``addrs`` is
        not a list of HOST:PORT addresses (which members dial), or has more
        than MAX_STANDBYS of them."""
        addrs = typed_field(key, load_object(key, raw), "addrs", list)
        if len(addrs) > MAX_STANDBYS:
            raise MalformedRecordError(key, f"field 'addrs' lists {len(addrs)} addresses, "
                                            f"more than {MAX_STANDBYS}")
        for i, addr in enumerate(addrs):
            if not isinstance(addr, str) or not valid_addr(addr):
                shown = cap_text(addr, 64) if isinstance(addr, str) else type(addr).__name__
                raise MalformedRecordError(key, f"field 'addrs[{i}]' is not HOST:PORT: "
                                                f"{shown!r}")
        return cls(tuple(addrs))


# A member cut off from etcd asks every standby at once: more than this is no
# list the leader wrote.
MAX_STANDBYS = 4096
# How many standbys the leader publishes: a handful of witnesses tells a
# member whether etcd answers outside its partition, and a short list that
# stops changing once that many nodes registered keeps the record from being
# rewritten to every node at every registration (N^2 watch events at start).
STANDBY_WITNESSES = 8


@dataclass(frozen=True)
class DrainRequest(FieldsAsJson):
    """``requests/drain/<node_id>``: take that node out at the next round
    (written by the node itself on SIGTERM, or by ``elasticctl drain``)."""

    by: str  # a node id, or "elasticctl"
    reason: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", cap_text(self.reason))

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "DrainRequest":
        """Raises MalformedRecordError naming the key and the field when ``by``
        is not a valid id or ``reason`` not text (capped at MAX_REASON_CHARS)."""
        obj = load_object(key, raw)
        return cls(by=id_field(key, obj, "by"), reason=text_field(key, obj, "reason"))


@dataclass(frozen=True)
class RestartRequest(FieldsAsJson):
    """Someone asks for a new round with the same members (e.g. a worker failed)."""

    node_id: str  # who asks: a node id, or "elasticctl"
    round: int  # the round it is about; requests about older rounds are stale
    reason: str
    failure: bool = False  # counts against the restart budget (a crash, a hang)

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", cap_text(self.reason))

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "RestartRequest":
        """Parse the request at ``key``. Raises MalformedRecordError naming the key
        and the field when a field is missing or mistyped, ``node_id`` is not a
        valid id or ``round`` is negative. ``reason`` is capped at MAX_REASON_CHARS."""
        obj = load_object(key, raw)
        return cls(
            node_id=id_field(key, obj, "node_id"),
            round=int_field(key, obj, "round", 0),
            reason=text_field(key, obj, "reason"),
            failure=typed_field(key, obj, "failure", bool, False),
        )


class ReportKind(enum.Enum):
    """What a node reports to the leader (one key per kind and node under ``requests/``)."""

    STARTED = "started"  # this node started the workers of ``round``
    DONE = "done"  # this node's workers of ``round`` all exited 0
    SUSPECT = "suspect"  # the agent of the node named in the key did not answer ``by``
    FROZEN = "frozen"  # ...answered none of ``by``'s probes for a while (FrozenReport)


@dataclass(frozen=True)
class Report(FieldsAsJson):
    """A node's report to the leader, written under the reporter's lease."""

    round: int
    by: str

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "Report":
        """Raises MalformedRecordError naming the key and field when invalid."""
        obj = load_object(key, raw)
        return cls(round=int_field(key, obj, "round", 0), by=id_field(key, obj, "by"))


@dataclass(frozen=True)
class FrozenReport(FieldsAsJson):
    """``requests/frozen/<node_id>``: while both ran round ``round``, that
    node's agent answered none of ``by``'s probes for ``silent_s`` seconds.
    ``confirmed_by``: the node that confirmed the report and revoked the
    frozen node's lease ("" until then; the leader's fence need not wait for
    a node so proven unanswering). Under its writer's lease."""

    round: int
    by: str
    silent_s: float
    confirmed_by: str = ""

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "FrozenReport":
        """Raises MalformedRecordError naming the key and field when ``round``
        is negative, ``silent_s`` not a finite number of seconds >= 0, ``by``
        or (when not "") ``confirmed_by`` not a valid id."""
        obj = load_object(key, raw)
        confirmed_by = typed_field(key, obj, "confirmed_by", str, "")
        return cls(round=int_field(key, obj, "round", 0), by=id_field(key, obj, "by"),
                   silent_s=time_field(key, obj, "silent_s"),
                   confirmed_by=id_field(key, obj, "confirmed_by") if confirmed_by else "")
