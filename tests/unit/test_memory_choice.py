"""The memory tier's pure restore rules (elastic.checkpoint.memory.choice): which
snapshot, and who sends which slot to whom. Each rule of the module docstring has
its test here; the reasons are asserted, not only the outcome."""

from __future__ import annotations

import pytest

from elastic.checkpoint.memory.choice import (
    DISK,
    MEMORY,
    DiskLatest,
    SlotSeen,
    Transfer,
    choose,
    plan_transfers,
)
from elastic.checkpoint.memory.layout import SlotKey


def snapshot(round_, step, world, ranks=None, reader=None, slot=0):
    """The slots of ``ranks`` (default: all) of one snapshot, each read by the
    new rank ``reader`` (default: the same number as the old rank)."""
    ranks = range(world) if ranks is None else ranks
    return [SlotSeen(rank if reader is None else reader, SlotKey(round_, rank, slot), step, world)
            for rank in ranks]


class TestCompleteness:
    def test_a_set_with_every_rank_is_chosen(self):
        choice = choose(snapshot(3, 41, 4), None)
        assert (choice.source, choice.round, choice.step, choice.world_size) == (MEMORY, 3, 41, 4)
        assert choice.label == "memory:round-3/step-41"
        assert "complete" in choice.reason

    def test_a_set_missing_a_rank_is_not(self):
        choice = choose(snapshot(3, 41, 4, ranks=[0, 1, 3]), None)
        assert choice.source == DISK
        assert "no complete memory snapshot (1 incomplete" in choice.reason

    def test_the_newest_complete_step_wins_over_a_newer_incomplete_one(self):
        # rank 2 died while writing step 42: its slot of 42 is torn (never listed)
        seen = snapshot(3, 41, 4, slot=0) + snapshot(3, 42, 4, ranks=[0, 1, 3], slot=1)
        choice = choose(seen, None)
        assert (choice.source, choice.step) == (MEMORY, 41)

    def test_slots_of_different_rounds_are_never_mixed(self):
        # ranks 0-1 of round 3 and ranks 2-3 of round 2 at the same step: no round is complete
        seen = snapshot(3, 41, 4, ranks=[0, 1]) + snapshot(2, 41, 4, ranks=[2, 3])
        assert choose(seen, None).source == DISK

    def test_a_zombie_of_an_older_round_is_ignored_even_at_a_higher_step(self):
        # a zombie of round 2 went on stepping and wrote step 50 after round 3 took 41
        seen = snapshot(3, 41, 4) + snapshot(2, 50, 4, slot=1)
        choice = choose(seen, None)
        assert (choice.round, choice.step) == (3, 41)

    def test_world_size_comes_from_the_snapshot_not_the_new_group(self):
        # taken by 2 ranks, read by 4 new ranks (two per node): complete for 2
        seen = snapshot(5, 9, 2, reader=0) + snapshot(5, 9, 2, reader=1)
        choice = choose(seen, None)
        assert (choice.source, choice.world_size) == (MEMORY, 2)
        assert choice.holders == {0: {0: SlotKey(5, 0, 0), 1: SlotKey(5, 0, 0)},
                                  1: {0: SlotKey(5, 1, 0), 1: SlotKey(5, 1, 0)}}


class TestAgainstDisk:
    def test_disk_of_a_newer_round_wins_whatever_the_step(self):
        choice = choose(snapshot(3, 41, 4), DiskLatest(step=30, round=4))
        assert choice.source == DISK
        assert "newer round" in choice.reason

    def test_a_newer_disk_step_wins(self):
        choice = choose(snapshot(3, 41, 4), DiskLatest(step=50, round=3))
        assert choice.source == DISK
        assert "disk commit step 50 is newer" in choice.reason

    def test_at_an_equal_step_memory_is_used(self):
        choice = choose(snapshot(3, 40, 4), DiskLatest(step=40, round=3))
        assert choice.source == MEMORY
        assert "not older than disk commit step 40" in choice.reason

    def test_memory_newer_than_an_older_rounds_commit_is_used(self):
        assert choose(snapshot(3, 41, 4), DiskLatest(step=39, round=1)).source == MEMORY

    def test_nothing_anywhere_is_disk(self):
        assert choose([], None).source == DISK


class TestTransfers:
    def test_a_slot_on_the_receivers_node_is_not_sent(self):
        holders = choose(snapshot(1, 5, 2), None).holders
        assert plan_transfers({0: [0], 1: [1]}, holders) == []

    def test_a_slot_elsewhere_is_sent_by_a_holder(self):
        # node B died; its ranks' slots are replicas on node A (new ranks 0 and 1)
        seen = snapshot(1, 5, 4, ranks=[0, 1, 2, 3], reader=0) \
            + snapshot(1, 5, 4, ranks=[0, 1, 2, 3], reader=1)
        holders = choose(seen, None).holders
        plan = plan_transfers({r: [r] for r in range(4)}, holders)
        assert plan == [Transfer(receiver=2, source=2, sender=0),
                        Transfer(receiver=3, source=3, sender=1)]  # spread over the holders

    def test_a_slot_nobody_holds_is_an_error(self):
        with pytest.raises(ValueError, match="old rank 1"):
            plan_transfers({0: [1]}, {0: {0: SlotKey(1, 0, 0)}})
