"""A large roster's buckets by node id: a node finds itself in its own bucket
alone, with everything else it needs to run the round (its placement), a
bucket proves it belongs to the round that names it, and a round of any size
is written in transactions etcd takes."""

from __future__ import annotations

import dataclasses
import zlib

import pytest

from elastic.errors import MalformedRecordError
from elastic.keyspace import JobKeys
from elastic.rendezvous import buckets, roster, round_record
from elastic.rendezvous.api import Member
from elastic.rendezvous.buckets import BucketRoster, NotHeldError
from elastic.rendezvous.placement import placements
from elastic.rendezvous.round_record import EARLIER_TXN_PUTS, TXN_ROSTER_BYTES
from elastic.store.api import Put
from tests.unit.test_roster import a_round, members

KEYS = JobKeys("j")
IDS = [f"node{i:05d}" for i in range(1000)]


def sealed(ids):
    """``(count, root, sealed buckets)`` of the roster of ``ids``."""
    return sealed_members(members(ids))


def sealed_members(ms):
    return round_record.roster_buckets(roster.canonical(ms))


def held(ids, me, ms=None):
    """What node ``me`` holds of the roster of ``ids`` (members ``ms``, by
    default ``members(ids)``) after reading its bucket."""
    ms = ms or members(ids)
    count, root, stored = sealed_members(ms)
    number = buckets.bucket_of(me, count)
    text = buckets.open_bucket("k", stored[number], number, count, root)
    return BucketRoster("k", "name", len(ids), sum(m.nproc for m in ms), number, count, text)


def bucket_view(whole, me, delta=None):
    """The round ``whole`` as a large job's node ``me`` holds it: its own
    bucket of the roster (and the round record's ``delta``, if any)."""
    raw = roster.canonical(whole.members)
    count, root, stored = round_record.roster_buckets(raw)
    number = buckets.bucket_of(me, count)
    text = buckets.open_bucket("k", stored[number], number, count, root)
    held = BucketRoster("k", roster.digest(raw), len(whole.members), whole.world_size, number,
                        count, text, delta)
    return dataclasses.replace(whole, members=held)


def racked(ids):
    """Members of unequal nproc on three racks, one without an address."""
    return tuple(Member(n, i, f"{n}.example.com", 1 + i % 4,
                        "" if i == 5 else f"{n}.example.com:29400", "ABC"[i % 3])
                 for i, n in enumerate(ids))


def test_every_member_is_found_in_its_own_bucket_with_its_rank():
    count, root, stored = sealed(IDS)
    assert count == buckets.count_for(len(IDS)) == 16
    for rank in (0, 1, 517, 999):
        me = IDS[rank]
        found = held(IDS, me).member(me)
        assert found == members(IDS)[rank]
    # An id of the same bucket that is no member is known not to be one.
    stranger = next(f"x{i}" for i in range(1000) if buckets.bucket_of(f"x{i}", count)
                    == buckets.bucket_of(IDS[0], count))
    assert held(IDS, IDS[0]).member(stranger) is None


def test_every_member_finds_in_its_bucket_the_placement_the_whole_list_gives():
    ms = racked(IDS)
    whole = placements(ms)
    count = buckets.count_for(len(IDS))
    mine = {b: held(IDS, next(n for n in IDS if buckets.bucket_of(n, count) == b), ms)
            for b in range(count)}
    for me in IDS:
        assert mine[buckets.bucket_of(me, count)].placement(me) == whole[me]
    # The placement is the whole list's: dense first ranks, a ring by node
    # rank, buddies on other racks.
    assert whole[IDS[2]].first_rank == 1 + 2
    assert whole[IDS[999]].ring_next.node_id == IDS[0]
    assert all(ms[int(m[4:])].rack != ms[int(p.buddy.node_id[4:])].rack
               for m, p in whole.items())


def test_a_bucket_of_the_earlier_form_finds_members_but_places_nobody():
    count = 16
    number = buckets.bucket_of("node00000", count)
    earlier = BucketRoster("k", "n", 10, 80, number, count, b"0\tnode00000\th.example.com\t8\t\t\n")
    assert earlier.member("node00000").nproc == 8
    assert earlier.placement("node00000") is None


@pytest.mark.parametrize("placement, expected", [
    ("80\tb\t\tc\t\td\t", "first rank"),  # beyond the world of 80
    ("0\tb\tnot an address\tc\t\td\t", "no valid address"),
    ("0\tb\t\t\t\td\t", "peers"),  # a buddy missing in a roster of 10
    ("0\tb c\t\tc\t\td\t", "invalid node id"),
])
def test_a_placement_that_is_not_valid_is_refused_naming_the_key(placement, expected):
    count = 16
    number = buckets.bucket_of("node00000", count)
    line = f"0\tnode00000\th.example.com\t8\t\t\t{placement}\n".encode()
    mine = BucketRoster("the/key", "n", 10, 80, number, count, line)
    with pytest.raises(MalformedRecordError, match=expected) as err:
        mine.placement("node00000")
    assert err.value.key == "the/key"


def test_a_bucket_knows_the_rosters_size_but_refuses_whole_use_and_other_buckets():
    mine = held(IDS, IDS[3])
    assert len(mine) == 1000 and mine.world_size == 8000
    other = next(n for n in IDS if not mine.holds(n))
    with pytest.raises(NotHeldError):
        mine.member(other)
    with pytest.raises(NotHeldError):
        list(mine)
    with pytest.raises(NotHeldError):
        mine[0]


@pytest.mark.parametrize("tamper, expected", [
    (lambda s, n: s[n + 1], "not bucket"),  # another bucket of the same roster
    (lambda s, n: s[n][:40] + s[n][41:], "proof"),  # its proof cut short
    (lambda s, n: s[n][:-3], "truncated"),
    (lambda s, n: s[n].split(b"\n")[0] + b"\n" + zlib.compress(b"0\tnode00000\th\t8\t\t\n"),
     "not bucket"),  # lines of someone else's making under a true proof
    (lambda s, n: s[n].split(b"\n")[0] + b"\n" + zlib.compress(b"\0" * ((4 << 20) + 1)),
     "too large"),
])
def test_a_bucket_that_is_not_the_one_the_round_names_is_refused_naming_the_key(
        tamper, expected):
    count, root, stored = sealed(IDS)
    number = 2
    with pytest.raises(MalformedRecordError, match=expected) as err:
        buckets.open_bucket("the/key", tamper(list(stored), number), number, count, root)
    assert err.value.key == "the/key"


def test_a_line_of_another_bucket_or_a_repeated_id_is_refused():
    count = 16
    number = buckets.bucket_of("node00000", count)
    line = b"0\tnode00000\th.example.com\t8\t\t\n"
    with pytest.raises(MalformedRecordError, match="another bucket"):
        BucketRoster("k", "n", 10, 80, (number + 1) % count, count, line)
    with pytest.raises(MalformedRecordError, match="repeats"):
        BucketRoster("k", "n", 10, 80, number, count, line + line)
    bad_rank = BucketRoster("k", "n", 10, 80, number, count, line.replace(b"0\t", b"99\t", 1))
    with pytest.raises(MalformedRecordError, match="rank"):
        bad_rank.member("node00000")


def test_a_node_resolves_a_large_round_from_the_head_and_its_bucket_alone(monkeypatch):
    monkeypatch.setattr(round_record, "INLINE_BYTES", 0)
    first = a_round(IDS)
    earlier, ops, name = round_record.commit_ops(KEYS, first, None, "")
    writes = {op.key: op.value for txn in earlier + [ops] for op in txn if isinstance(op, Put)}
    head = round_record.parse_head(KEYS.round, writes[KEYS.round], 1)
    me = IDS[700]
    read = round_record.bucket_reads(KEYS, head, me)
    assert [op.key for op in read] == [KEYS.round, KEYS.roster_bucket(
        name, buckets.bucket_of(me, head.buckets[0]))]
    mine = round_record.resolve(head, None, "", None, {name: writes[read[1].key]}, me)
    assert mine.member(me).node_rank == 700
    assert mine.world_size == first.world_size and len(mine.members) == len(IDS)
    # Nothing read at its bucket: the round's roster is reported missing.
    with pytest.raises(MalformedRecordError, match="bucket .* is not stored"):
        round_record.resolve(head, None, "", None, {name: None}, me)
    # A read made for another head's roster is no read of this one: read again.
    assert round_record.resolve(head, None, "", None, {"0" * 32: b""}, me) is None


def test_a_round_of_many_buckets_is_written_in_transactions_etcd_takes(monkeypatch):
    # 512 buckets of two members stand for a job of 32,768 nodes.
    monkeypatch.setattr(round_record, "INLINE_BYTES", 0)
    monkeypatch.setattr(buckets, "BUCKET_MEMBERS", 2)
    big = a_round([f"many{i:04d}" for i in range(1000)])
    earlier, ops, name = round_record.commit_ops(KEYS, big, None, "")
    assert len(ops[0].value) < 1024  # the watched record: the buckets are named by one root
    assert len(ops) <= round_record.TXN_ROSTER_PUTS + 3  # room for the served requests
    assert len(earlier) > 1
    for txn in earlier:
        assert len(txn) <= EARLIER_TXN_PUTS
        assert sum(len(op.value) for op in txn) <= TXN_ROSTER_BYTES
    written = [op.key for txn in earlier for op in txn]
    assert len([k for k in written if k.startswith(KEYS.buckets_of(name))]) == 512


def test_what_a_node_reads_to_find_itself_stays_a_few_kilobytes_at_any_size():
    small = max(len(b) for b in sealed(IDS)[2])
    large = max(len(b) for b in sealed([f"node{i:05d}" for i in range(8000)])[2])
    assert small < 3072 and large < 1.25 * small
