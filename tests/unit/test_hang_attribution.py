"""The hang reason names the odd rank out and its place, or says that all wait together.

Each test builds what every rank's agent read of its dump (a :class:`RankStack`
per rank) and asserts the one line :func:`attribute` writes from it.
"""

from __future__ import annotations

import pytest

from agent.hang_attribution import (
    MAX_ATTRIBUTION_CHARS,
    Attribution,
    HangKind,
    RankStack,
    attribute,
)


def waiting(rank, node, collective="all_reduce", step=1234, age=5.0):
    return RankStack(rank, node, True, place="train.py:60 in train_step",
                     collective=collective, step=step, progress_age_s=age)


def test_a_rank_in_data_loading_is_named_while_the_others_wait_in_a_collective():
    ranks = [waiting(r, "ab"[r // 4]) for r in range(8) if r != 5]
    ranks.append(RankStack(5, "c", True, place="train.py:88 in next_batch", step=1233))
    assert attribute(ranks).reason == ("rank 5 (node c) is in train.py:88 in next_batch while the 7 "
                                "others wait in all_reduce (step 1234)")


def test_a_rank_in_another_collective_is_named_with_its_collective_and_place():
    ranks = [waiting(0, "a"), waiting(2, "b"), waiting(3, "b"),
             RankStack(1, "a", True, place="train.py:40 in sync", collective="barrier")]
    assert attribute(ranks).reason == ("rank 1 (node a) waits in barrier (train.py:40 in sync) while "
                                "the 3 others wait in all_reduce (step 1234)")


def test_a_rank_that_did_not_answer_is_named_as_frozen():
    ranks = [waiting(0, "a"), waiting(1, "a"), waiting(2, "b"), RankStack(3, "b", False)]
    assert attribute(ranks).reason.startswith(
        "rank 3 (node b) did not answer (frozen: stopped, or stuck in the kernel) while the 3 "
        "others wait in all_reduce")


def test_all_in_the_same_collective_names_the_last_to_enter_by_its_latest_progress():
    ranks = [waiting(0, "a", age=9.0), waiting(1, "a", age=7.5), waiting(2, "b", age=4.0),
             waiting(3, "b", age=6.0)]
    assert attribute(ranks).reason == ("all 4 ranks wait in all_reduce (step 1234): likely a network "
                                "or peer problem; the last to enter was rank 2 (node b)")


def test_all_in_the_same_collective_without_progress_known_names_no_last():
    ranks = [waiting(r, "a", age=-1.0, step=-1) for r in range(2)]
    assert attribute(ranks).reason == "all 2 ranks wait in all_reduce: likely a network or peer problem"


def test_one_rank_against_one_other_reads_in_the_singular():
    ranks = [waiting(0, "a"), RankStack(1, "b", True, place="x.py:3 in f")]
    assert attribute(ranks).reason == ("rank 1 (node b) is in x.py:3 in f while the other rank waits "
                                "in all_reduce (step 1234)")


def test_ranks_each_elsewhere_are_all_listed():
    ranks = [RankStack(r, "a", True, place=f"x.py:{r} in f") for r in range(3)]
    assert attribute(ranks).reason == ("the ranks are each elsewhere: rank 0 (node a) is in x.py:0 "
                                "in f; rank 1 (node a) is in x.py:1 in f; rank 2 (node a) is in "
                                "x.py:2 in f")


def test_no_stack_read_says_so_and_no_rank_says_nothing():
    assert attribute([RankStack(0, "a", False), RankStack(1, "b", False)]) == Attribution(
        "no rank's stack could be read (2 asked)", HangKind.NO_STACKS)
    assert attribute([]).reason == ""


def test_many_odd_ranks_are_counted_past_the_first_three_and_the_line_is_bounded():
    ranks = [waiting(r, "a") for r in range(6)]
    odd = [RankStack(r, "b", True, place="y.py:1 in g") for r in range(6, 11)]
    assert "rank 8 (node b) is in y.py:1 in g; and 2 more ranks elsewhere while the 6 others" \
        in attribute(ranks + odd).reason
    long_names = [RankStack(r, "n" * 300, True, place="y.py:1 in g") for r in range(6, 11)]
    assert len(attribute(ranks + long_names).reason) <= MAX_ATTRIBUTION_CHARS


def test_the_flight_recorder_s_entry_times_name_the_last_to_enter_over_progress():
    ranks = [waiting(0, "a", age=1.0), waiting(1, "a", age=9.0), waiting(2, "b", age=5.0)]
    ranks = [RankStack(**{**r.__dict__, "entered_ns": ns})
             for r, ns in zip(ranks, (100, 300, 200))]
    assert attribute(ranks).reason.endswith("the last to enter was rank 1 (node a)")


@pytest.mark.parametrize("ranks,kind", [
    ([waiting(0, "a"), waiting(1, "a"), RankStack(2, "b", True, place="x.py:1 in f")],
     HangKind.RANK_ELSEWHERE),
    ([waiting(0, "a"), waiting(1, "a"), RankStack(2, "b", False)], HangKind.RANK_FROZEN),
    ([waiting(0, "a"), waiting(1, "b")], HangKind.ALL_IN_COLLECTIVE),
    ([RankStack(r, "a", True, place="x.py:1 in f") for r in range(2)], HangKind.ALL_AT_ONE_PLACE),
    ([RankStack(r, "a", True, place=f"x.py:{r} in f") for r in range(2)], HangKind.SCATTERED),
])
def test_each_rule_says_which_it_is_for_the_metrics(ranks, kind):
    assert attribute(ranks).kind is kind
