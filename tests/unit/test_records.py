"""Records read back from etcd are hostile input: whatever a key holds, a parser
returns a valid record or raises MalformedRecordError naming the key and the
field, and no record carries free text larger than MAX_REASON_CHARS."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic.errors import ConfigError, MalformedRecordError
from elastic.events import Event, event_op
from elastic.keyspace import JobKeys
from elastic.records import MAX_REASON_CHARS, cap_text, validate_id
from elastic.rendezvous.api import Member, NodeInfo, Outcome, RestartRequest, Round
from tests.fakes.clock import FakeClock

KEYS = JobKeys("job")
NODE_KEY = KEYS.node("a")
ROUND_KEY = KEYS.round
REQUEST_KEY = KEYS.restart_requests + "000000000003-a"
EVENT_KEY = KEYS.events + "a/0003"
HUGE = "x" * 800_000  # ~0.8 MB: over half of etcd's 1.5 MiB request limit on its own

# --- What a valid record is (written independently of the parsers) --------------------------------


def _is_int(value, low, high=None):
    return (type(value) is int and value >= low and (high is None or value <= high))


def _is_id(value):
    try:
        validate_id("id", value)
    except ConfigError:
        return False
    return True


def _is_time(value):
    return type(value) is float and math.isfinite(value)


def _is_text(value):
    return type(value) is str and len(value) <= MAX_REASON_CHARS


def assert_valid_node(info, key):
    assert _is_id(info.node_id) and key.endswith("/" + info.node_id)
    assert type(info.host) is str and type(info.addr) is str and type(info.version) is str
    assert _is_int(info.nproc, 1) and _is_int(info.master_port, 0, 65535)


def assert_valid_round(rnd, version):
    assert _is_int(rnd.number, 1) and rnd.number == version
    assert [m.node_rank for m in rnd.members] == list(range(len(rnd.members)))
    assert len(set(rnd.node_ids)) == len(rnd.members)
    for m in rnd.members:
        assert _is_id(m.node_id) and _is_int(m.nproc, 1)
        assert type(m.host) is str and type(m.addr) is str
    assert type(rnd.master_addr) is str and _is_int(rnd.master_port, 0, 65535)
    assert _is_text(rnd.reason) and (rnd.leader == "" or _is_id(rnd.leader))
    assert _is_time(rnd.created_at) and all(_is_time(t) for t in rnd.failures)
    assert isinstance(rnd.outcome, Outcome)


def assert_valid_request(req):
    assert _is_id(req.node_id) and _is_int(req.round, 0)
    assert _is_text(req.reason) and type(req.failure) is bool


def assert_valid_event(event):
    assert _is_time(event.time) and _is_id(event.node_id) and _is_int(event.round, 0)
    assert type(event.kind) is str and _is_text(event.message)


# --- Strategies: any bytes, any JSON, and valid records with some fields made hostile -----------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20)
    | st.floats(allow_nan=True, allow_infinity=True),  # json reads NaN and Infinity
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)
# Values that are almost right, beside the arbitrary ones.
hostile = (st.sampled_from([0, -1, 1, 65535, 65536, 2**70, True, False, 1.0, "1", "", "a",
                            "../x", "a/b", float("nan"), float("inf"), None, [None], {}])
           | json_values)


@st.composite
def spoiled(draw, valid):
    """A valid record from ``valid``, often with a few fields removed or replaced."""
    obj = draw(valid)
    for name in draw(st.lists(st.sampled_from(sorted(obj)), max_size=2)):
        if draw(st.booleans()):
            obj.pop(name, None)
        else:
            obj[name] = draw(hostile)
    return obj


texts = st.text(max_size=10)
valid_node = st.fixed_dictionaries({
    "node_id": st.just("a"), "host": texts, "nproc": st.integers(1, 8), "addr": texts,
    "master_port": st.integers(0, 65535), "version": texts})


@st.composite
def valid_members(draw):
    node_ids = draw(st.lists(st.sampled_from("abcd"), unique=True, max_size=3))
    return [draw(spoiled(st.fixed_dictionaries({
        "node_id": st.just(n), "node_rank": st.just(rank), "host": texts,
        "nproc": st.integers(1, 8), "addr": texts}))) for rank, n in enumerate(node_ids)]


valid_round = st.fixed_dictionaries({
    "number": st.just(1), "members": valid_members(), "master_addr": texts,
    "master_port": st.integers(0, 65535), "reason": texts, "leader": st.sampled_from(["a", ""]),
    "created_at": st.floats(0, 2e9), "failures": st.lists(st.floats(0, 2e9) | hostile,
                                                            max_size=2),
    "outcome": st.sampled_from(["", "succeeded", "failed"])})
valid_request = st.fixed_dictionaries({
    "node_id": st.sampled_from(["a", "elasticctl"]), "round": st.integers(0, 9),
    "reason": texts, "failure": st.booleans()})
valid_event = st.fixed_dictionaries({
    "time": st.floats(0, 2e9) | st.integers(0, 2**31), "node_id": st.just("a"),
    "round": st.integers(0, 9), "kind": texts, "message": texts})


def raw_records(valid):
    """Bytes as a key might hold them: any bytes, any JSON, or a (spoiled) record."""
    return (st.binary(max_size=40)
            | (spoiled(valid) | json_values).map(lambda v: json.dumps(v).encode()))


PROPERTY = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def parses_or_refuses(parse, key):
    """The parser's result, or None when it refused with a MalformedRecordError for ``key``."""
    try:
        return parse()
    except MalformedRecordError as exc:
        assert exc.key == key
        return None


@PROPERTY
@given(raw_records(valid_node))
def test_node_info_parses_to_a_valid_record_or_refuses(raw):
    info = parses_or_refuses(lambda: NodeInfo.from_json(NODE_KEY, raw), NODE_KEY)
    if info is not None:
        assert_valid_node(info, NODE_KEY)


@PROPERTY
@given(raw_records(valid_round), st.integers(0, 2))
def test_round_parses_to_a_valid_record_or_refuses(raw, version):
    rnd = parses_or_refuses(lambda: Round.from_json(ROUND_KEY, raw, version), ROUND_KEY)
    if rnd is not None:
        assert_valid_round(rnd, version)


@PROPERTY
@given(raw_records(valid_request))
def test_restart_request_parses_to_a_valid_record_or_refuses(raw):
    req = parses_or_refuses(lambda: RestartRequest.from_json(REQUEST_KEY, raw), REQUEST_KEY)
    if req is not None:
        assert_valid_request(req)


@PROPERTY
@given(raw_records(valid_event))
def test_event_parses_to_a_valid_record_or_refuses(raw):
    event = parses_or_refuses(lambda: Event.from_json(EVENT_KEY, raw), EVENT_KEY)
    if event is not None:
        assert_valid_event(event)


# --- Each hostile value is refused with the key and the field named -------------------------------

GOOD_MEMBER = {"node_id": "a", "node_rank": 0, "host": "h", "nproc": 1, "addr": "h:1"}
GOOD_ROUND = {"number": 1, "members": [GOOD_MEMBER], "master_addr": "h", "master_port": 29500,
              "reason": "max reached", "leader": "a", "created_at": 1.5, "failures": [1.0],
              "outcome": ""}
GOOD_NODE = {"node_id": "a", "host": "h", "nproc": 2, "addr": "h:1", "master_port": 29500,
             "version": "0.1.0"}
GOOD_REQUEST = {"node_id": "a", "round": 3, "reason": "worker 1 exited with 1", "failure": True}
GOOD_EVENT = {"time": 1.5, "node_id": "a", "round": 3, "kind": "state", "message": "m"}


def _with(record, **changes):
    return json.dumps({**record, **changes}).encode()


@pytest.mark.parametrize("changes, field", [
    ({"created_at": "x"}, "created_at"),
    ({"created_at": float("nan")}, "created_at"),
    ({"failures": "abc"}, "failures"),
    ({"failures": [None]}, "failures[0]"),
    ({"failures": [1.0, float("inf")]}, "failures[1]"),
    ({"master_port": "x"}, "master_port"),
    ({"master_port": -1}, "master_port"),
    ({"master_port": 65536}, "master_port"),
    ({"number": True}, "number"),
    ({"members": [{**GOOD_MEMBER, "addr": 5}]}, "members[0].addr"),
    ({"members": [{**GOOD_MEMBER, "nproc": 0}]}, "members[0].nproc"),
    ({"members": [{**GOOD_MEMBER, "node_rank": -1}]}, "members[0].node_rank"),
    ({"members": [{**GOOD_MEMBER, "node_id": "../etc"}]}, "members[0].node_id"),
    ({"members": [GOOD_MEMBER, {**GOOD_MEMBER, "node_rank": 1}]}, "members"),
    ({"leader": 7}, "leader"),
    ({"outcome": "maybe"}, "outcome"),
    ({"reason": ["a list"]}, "reason"),
    ({"continues": 1}, "continues"),  # not an earlier round than this one (number 1)
    ({"continues": -1}, "continues"),
    ({"continues": "1"}, "continues"),
])
def test_hostile_round_fields_are_refused_by_name(changes, field):
    with pytest.raises(MalformedRecordError) as info:
        Round.from_json(ROUND_KEY, _with(GOOD_ROUND, **changes), 1)
    assert info.value.key == ROUND_KEY
    assert repr(field) in info.value.problem


@pytest.mark.parametrize("changes, field", [
    ({"nproc": -2}, "nproc"),
    ({"nproc": True}, "nproc"),
    ({"master_port": -1}, "master_port"),
    ({"master_port": 70000}, "master_port"),
    ({"master_port": "29500"}, "master_port"),
    ({"addr": 5}, "addr"),
    ({"version": None}, "version"),
    ({"node_id": 5}, "node_id"),
])
def test_hostile_node_fields_are_refused_by_name(changes, field):
    with pytest.raises(MalformedRecordError) as info:
        NodeInfo.from_json(NODE_KEY, _with(GOOD_NODE, **changes))
    assert info.value.key == NODE_KEY and repr(field) in info.value.problem


@pytest.mark.parametrize("parse, record, changes, field", [
    (RestartRequest.from_json, GOOD_REQUEST, {"round": -1}, "round"),
    (RestartRequest.from_json, GOOD_REQUEST, {"failure": "false"}, "failure"),
    (RestartRequest.from_json, GOOD_REQUEST, {"node_id": "a b"}, "node_id"),
    (RestartRequest.from_json, GOOD_REQUEST, {"reason": 12}, "reason"),
    (Event.from_json, GOOD_EVENT, {"time": "x"}, "time"),
    (Event.from_json, GOOD_EVENT, {"time": float("inf")}, "time"),
    (Event.from_json, GOOD_EVENT, {"round": -1}, "round"),
    (Event.from_json, GOOD_EVENT, {"message": None}, "message"),
    (Event.from_json, GOOD_EVENT, {"node_id": ""}, "node_id"),
])
def test_hostile_request_and_event_fields_are_refused_by_name(parse, record, changes, field):
    with pytest.raises(MalformedRecordError) as info:
        parse("k", _with(record, **changes))
    assert info.value.key == "k" and repr(field) in info.value.problem


def test_valid_records_round_trip():
    rnd = Round.from_json(ROUND_KEY, _with(GOOD_ROUND), 1)
    assert Round.from_json(ROUND_KEY, rnd.to_json(), 1) == rnd
    again = rnd.continued(3, "written again", "a", 2.0)
    assert Round.from_json(ROUND_KEY, again.to_json(), 3) == again
    assert (again.continues, again.workers_round, rnd.workers_round) == (1, 1, 1)
    assert again.continued(5, "and again", "a", 3.0).continues == 1
    assert rnd.continued_by(again) and not again.continued_by(rnd)
    assert rnd.members == (Member("a", 0, "h", 1, "h:1"),) and rnd.failures == (1.0,)
    node = NodeInfo.from_json(NODE_KEY, _with(GOOD_NODE))
    assert NodeInfo.from_json(NODE_KEY, node.to_json()) == node
    req = RestartRequest.from_json(REQUEST_KEY, _with(GOOD_REQUEST))
    assert req == RestartRequest("a", 3, "worker 1 exited with 1", failure=True)
    event = Event.from_json(EVENT_KEY, _with(GOOD_EVENT))
    assert event == Event(time=1.5, node_id="a", round=3, kind="state", message="m")


# --- Hostile sizes: free text is capped in every record -------------------------------------------

def test_cap_text_keeps_the_start_and_says_how_much_was_cut():
    assert cap_text("short") == "short"
    capped = cap_text("abc" + HUGE)
    assert len(capped) <= MAX_REASON_CHARS
    assert capped.startswith("abcxxx")
    kept = capped.index("...")
    assert capped.endswith(f"... [{len(HUGE) + 3 - kept} more characters]")
    assert cap_text(capped) == capped  # capping twice changes nothing
    assert len(cap_text("y" * 50, limit=10)) <= 10


def test_a_huge_restart_reason_is_capped_on_construction_and_when_read():
    req = RestartRequest(node_id="elasticctl", round=3, reason=HUGE)
    assert len(req.reason) <= MAX_REASON_CHARS and len(req.to_json()) < 2048

    read = RestartRequest.from_json(REQUEST_KEY, _with(GOOD_REQUEST, reason=HUGE))
    assert len(read.reason) <= MAX_REASON_CHARS


def test_a_huge_round_reason_is_capped_so_no_round_written_is_large():
    rnd = Round(number=2, members=(Member("a", 0, "h", 1),), master_addr="h", master_port=1,
                reason=HUGE, leader="a", created_at=0.0)
    assert len(rnd.reason) <= MAX_REASON_CHARS and len(rnd.to_json()) < 4096

    read = Round.from_json(ROUND_KEY, _with(GOOD_ROUND, reason=HUGE), 1)
    assert len(read.reason) <= MAX_REASON_CHARS


def test_a_huge_event_message_is_capped_before_it_is_written():
    put = event_op(KEYS, FakeClock(), "a", 3, "state", "RUNNING -> STOPPING: " + HUGE)
    assert len(put.value) < 4096
    event = Event.from_json(put.key, put.value)
    assert event.message.startswith("RUNNING -> STOPPING: xxx")
    assert len(event.message) <= MAX_REASON_CHARS

    read = Event.from_json(EVENT_KEY, _with(GOOD_EVENT, message=HUGE))
    assert len(read.message) <= MAX_REASON_CHARS
