"""The round's members as a roster, and the round record that carries or names
it: encoding, hostile input, deltas, and what a commit writes."""

from __future__ import annotations

import base64
import json
import re
import zlib

import pytest

from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.rendezvous import roster, round_record
from elastic.rendezvous.api import Member, Round
from elastic.store.api import Delete, Put
from tests.fakes.memory_store import MemoryStore

KEYS = JobKeys("j")


def members(ids, rack=""):
    return tuple(Member(node_id=n, node_rank=i, host=f"{n}.example.com", nproc=8,
                        addr=f"{n}.example.com:29400", rack=rack) for i, n in enumerate(ids))


def a_round(ids, number=1, **fields):
    ms = members(ids)
    return Round(number=number, members=ms, master_addr=ms[0].host, master_port=29500,
                 reason="formed", leader=ms[0].node_id, created_at=1.0, **fields)


def test_a_roster_unpacks_to_its_members_and_is_named_by_them_alone():
    ms = members(["a", "b", "c"], rack="r1")
    name, packed = roster.pack(ms)
    assert roster.unpack("k", packed, name) == ms
    assert roster.pack(members(["a", "b", "c"], rack="r1"))[0] == name
    assert roster.pack(members(["b", "a", "c"], rack="r1"))[0] != name  # ranks are in it


def line_form(text: str) -> tuple[bytes, str]:
    """A roster of the line form holding ``text`` as it is, and its name."""
    return zlib.compress(text.encode()), roster.digest(text.encode())


@pytest.mark.parametrize("packed, expected", [
    (b"not zlib", "does not decompress"),
    (zlib.compress(b"[]")[:-3], "truncated"),
    (zlib.compress(b"\xff\xfe"), "not UTF-8"),
    (zlib.compress(b"a\th\t8\t\t"), "last line is not ended"),
    # The first form (a JSON list of rows) is read whole, every row checked.
    (zlib.compress(b'[["a", "h"'), "not JSON"),
    (zlib.compress(b'[["a", "h", 8, ""]]'), "members[0]"),
    (zlib.compress(b'[["a", "no host!", 8, "", ""]]'), "members[0].host"),
    (zlib.compress(b'[["a", "h", 0, "", ""]]'), "members[0].nproc"),
])
def test_a_roster_that_is_not_one_is_refused_naming_the_key(packed, expected):
    try:  # the name of what it holds: the checks after the digest's are reached
        name = roster.digest(zlib.decompress(packed))
    except zlib.error:
        name = "0" * roster.DIGEST_CHARS
    with pytest.raises(MalformedRecordError, match=re.escape(expected)) as err:
        roster.unpack("/elastic/v1/j/rosters/x/0000", packed, name)
    assert err.value.key == "/elastic/v1/j/rosters/x/0000"


@pytest.mark.parametrize("bad_line, expected", [
    ("b\tno host!\t8\t\t\n", "members[1].host"),
    ("b\th\t0\t\t\n", "members[1].nproc"),
    ("b\th\teight\t\t\n", "members[1]' is not a line"),
    ("b\th\t8\t\n", "members[1]' is not a line"),
    ("b\th\t8\tnot an address\t\n", "members[1].addr"),
    ("-b\th\t8\t\t\n", "members[1].node_id"),
    ("a\th\t8\t\t\n", "names a node twice"),
])
def test_a_field_of_a_line_is_checked_when_it_is_first_used(bad_line, expected):
    # Node a finds itself without the others being built; the list used
    # whole (as an agent uses it) is refused, naming the key and field.
    packed, name = line_form("a\th\t8\th:1\t\n" + bad_line + "c\th\t8\t\t\n")
    members_read = roster.unpack("k", packed, name)
    assert len(members_read) == 3
    assert members_read.member("a") == Member("a", 0, "h", 8, "h:1")
    assert members_read.member("nobody") is None
    with pytest.raises(MalformedRecordError, match=re.escape(expected)) as err:
        list(members_read)
    assert err.value.key == "k"


def test_a_member_found_alone_is_the_one_the_whole_list_holds():
    ms = members(["a", "b", "c", "ab"], rack="r1")
    name, packed = roster.pack(ms)
    found = [roster.unpack("k", packed, name).member(m.node_id) for m in ms]
    assert found == list(ms)  # "b" is not taken for the end of "ab", nor "a" for "ab"


@pytest.mark.parametrize("dense", [False, True])
def test_a_roster_is_never_inflated_past_the_bound(monkeypatch, dense):
    monkeypatch.setattr(roster, "MAX_UNPACKED_BYTES", 1 << 20)
    with pytest.raises(MalformedRecordError, match="larger than"):
        roster.unpack("k", roster.compress(bytes((1 << 20) + 1), dense),
                      "0" * roster.DIGEST_CHARS)


def test_a_dense_roster_reads_as_the_same_members_and_a_cut_one_is_refused():
    ms = members([f"n{i}" for i in range(200)])
    name, packed = roster.pack(ms, dense=True)
    assert packed != roster.pack(ms)[1] and roster.unpack("k", packed, name) == ms
    with pytest.raises(MalformedRecordError, match="truncated"):
        roster.unpack("k", packed[:-20], name)


def test_a_rack_that_is_not_printable_is_read_as_every_record_reads_it():
    # The quick check of a line gives way to the one reader of a member's fields.
    packed, name = line_form("a\th\t8\t\tr\x1b1\n")
    assert roster.unpack("k", packed, name).member("a").rack == "r\\x1b1"


def test_a_roster_is_refused_when_it_is_not_the_one_the_round_names():
    name, packed = roster.pack(members(["a"]))
    other, _ = roster.pack(members(["b"]))
    with pytest.raises(MalformedRecordError, match=f"not the one named {other}"):
        roster.unpack("k", packed, other)


def test_a_delta_rebuilds_the_roster_after_nodes_left_and_joined():
    old, new = members(["a", "b", "c", "d"]), members(["a", "c", "d", "e", "f"])
    change = roster.delta(old, new)
    assert change["left"] == ["b"] and [row[0] for row in change["joined"]] == ["e", "f"]
    new_name = roster.pack(new)[0]
    assert roster.apply_delta("k", old, change, new_name) == new
    # ... and from a roster read from etcd, whose lines it keeps as they are.
    base = roster.unpack("k", roster.pack(old)[1], roster.pack(old)[0])
    assert roster.apply_delta("k", base, change, new_name) == new


def test_no_delta_when_the_survivors_changed_order_or_fields_or_it_is_too_large():
    old = members(["a", "b", "c"])
    assert roster.delta(old, members(["b", "a", "c"])) is None
    moved = (old[0], Member("b", 1, "elsewhere.example.com", 8, "b.example.com:29400"), old[2])
    assert roster.delta(old, moved) is None
    many = members(["a", "b", "c"] + [f"joiner{i:04d}" for i in range(400)])
    assert roster.delta(old, many) is None  # over MAX_DELTA_BYTES: nodes read the roster


def test_a_delta_that_does_not_give_the_named_roster_gives_nothing():
    old, new = members(["a", "b"]), members(["a", "c"])
    change = roster.delta(old, new)
    wrong = roster.pack(members(["a", "d"]))[0]
    assert roster.apply_delta("k", old, change, wrong) is None
    with pytest.raises(MalformedRecordError, match="delta"):
        roster.apply_delta("k", old, {"left": "b"}, wrong)


# -- the round record ------------------------------------------------------


def test_a_small_round_carries_its_roster_once_and_reads_alone():
    record = a_round(["a", "b", "c"])
    head, name, stored = round_record.head_of(record, None, "")
    assert b'"packed"' in head and b'"members"' not in head
    parsed = round_record.parse_head(KEYS.round, head, 1)
    assert round_record.resolve(parsed, None, "") == record
    # A restart keeps the members: its head carries no roster; the nodes that
    # followed hold it, and one that did not reads it where it is stored.
    again = a_round(["a", "b", "c"], number=2)
    head, same, kept = round_record.head_of(again, record, name)
    assert same == name and kept == stored and b'"packed"' not in head
    parsed = round_record.parse_head(KEYS.round, head, 2)
    assert round_record.resolve(parsed, record, name) == again
    assert round_record.resolve(parsed, None, "") is None
    assert round_record.resolve(parsed, None, "", {name: stored}) == again


def test_a_large_round_names_its_stored_roster_and_carries_a_delta_from_the_one_before(
        monkeypatch):
    monkeypatch.setattr(round_record, "INLINE_BYTES", 0)
    first = a_round(["a", "b", "c"])
    earlier, ops, name = round_record.commit_ops(KEYS, first, None, "")
    assert earlier == [] and ops[0].key == KEYS.round
    # Stored whole, and in its one bucket (three members), which the head names.
    assert [op.key for op in ops[1:]] == [KEYS.roster_chunk(name, 0),
                                          KEYS.roster_bucket(name, 0)]
    assert round_record.parse_head(KEYS.round, ops[0].value, 1).buckets[0] == 1
    second = a_round(["a", "c", "d"], number=2)
    earlier, ops, second_name = round_record.commit_ops(KEYS, second, first, name)
    # The roster it replaces goes, whole and in buckets.
    assert Delete(KEYS.roster(name), prefix=True) in ops
    assert Delete(KEYS.buckets_of(name), prefix=True) in ops
    head = round_record.parse_head(KEYS.round, ops[0].value, 2)
    assert head.packed is None and head.delta["base"] == name and head.buckets is not None
    # A node that holds the first round rebuilds the second without a read ...
    assert round_record.resolve(head, first, name) == second
    # ... one that does not reads it (None: nothing read yet).
    assert round_record.resolve(head, None, "") is None
    stored = {second_name: ops[1].value}
    assert round_record.resolve(head, None, "", stored) == second
    with pytest.raises(MalformedRecordError, match="is not stored"):
        round_record.resolve(head, None, "", {})


def test_a_half_written_round_is_invisible_and_only_its_roster_stays_once_it_commits(
        monkeypatch):
    # A roster too large for the head's transaction goes first, in chunks;
    # until the head that names it commits, readers see the round before.
    monkeypatch.setattr(round_record, "INLINE_BYTES", 0)
    monkeypatch.setattr(round_record, "TXN_ROSTER_BYTES", 0)
    monkeypatch.setattr(round_record, "CHUNK_BYTES", 16)
    store = MemoryStore()
    first = a_round(["a", "b", "c"])
    earlier, ops, name = round_record.commit_ops(KEYS, first, None, "")
    for txn in earlier:
        store.txn([], txn)
    store.txn([], ops)
    second = a_round(["a", "b", "d"], number=2)
    earlier, ops, _ = round_record.commit_ops(KEYS, second, first, name)
    assert len(earlier) > 1 and all(len(t) == 1 and isinstance(t[0], Put) for t in earlier)
    for txn in earlier:  # the leader stops here: its head never commits
        store.txn([], txn)
        assert round_record.read_round(store, KEYS) == first
    store.txn([], ops)
    assert round_record.read_round(store, KEYS) == second
    kept = {kv.key.split("/")[-2] for kv in store.get_prefix(KEYS.rosters)[0]}
    assert kept == {round_record.roster_of(second)}
    kept = {kv.key.split("/")[-2] for kv in store.get_prefix(KEYS.roster_buckets)[0]}
    assert kept == {round_record.roster_of(second)}


@pytest.mark.parametrize("change, expected", [
    ({"roster": "xyz"}, "field 'roster'"),
    ({"packed": "not base64!"}, "field 'packed'"),
    ({"nnodes": "3"}, "field 'nnodes'"),
    ({"delta": {"base": 7, "left": [], "joined": []}}, "delta.base"),
    ({"outcome": "exploded"}, "field 'outcome'"),
    ({"buckets": {"count": 3, "root": "0" * 32}}, "field 'buckets'"),
    ({"buckets": {"count": 4, "root": "not a digest"}}, "field 'buckets'"),
    ({"number": 2}, "does not match the key's version"),
])
def test_a_head_that_is_not_one_is_refused_naming_the_key_and_field(change, expected):
    head, _, _ = round_record.head_of(a_round(["a", "b"]), None, "")
    raw = json.dumps({**json.loads(head), **change}).encode()
    with pytest.raises(MalformedRecordError, match=expected) as err:
        round_record.parse_head(KEYS.round, raw, 1)
    assert err.value.key == KEYS.round


def test_a_head_whose_roster_has_another_count_of_members_is_refused():
    head, _, _ = round_record.head_of(a_round(["a", "b"]), None, "")
    raw = json.dumps({**json.loads(head), "nnodes": 3}).encode()
    with pytest.raises(MalformedRecordError, match="nnodes"):
        round_record.resolve(round_record.parse_head(KEYS.round, raw, 1), None, "")


def test_a_round_of_the_whole_form_is_still_read():
    record = a_round(["a", "b"])
    head = round_record.parse_head(KEYS.round, record.to_json(), 1)
    assert round_record.resolve(head, None, "") == record
    assert head.roster == round_record.roster_of(record)


def test_the_watched_record_stays_small_at_any_size(monkeypatch):
    ids = [f"node{i:05d}" for i in range(16384)]
    first = a_round(ids)
    head, name, stored = round_record.head_of(first, None, "")
    assert len(head) < 1024 and stored is not None
    # Stored apart, every node reads it: packed densely (xz), half zlib's size.
    assert len(stored) < 0.6 * len(roster.pack(first.members)[1])
    assert round_record.resolve(round_record.parse_head(KEYS.round, head, 1), None, "",
                                {name: stored}) == first
    replaced = a_round(ids[:-1] + ["spare"], number=2)
    head, _, _ = round_record.head_of(replaced, first, name)
    assert len(head) < 2048 and b'"delta"' in head
    inline = round_record.head_of(a_round(ids[:1000]), None, "")[0]
    assert len(base64.b64decode(json.loads(inline)["packed"])) <= round_record.INLINE_BYTES
