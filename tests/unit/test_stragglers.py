"""The leader's straggler rule, driven with explicit times: no agents, no sleeping."""

from __future__ import annotations

import random
import statistics

from agent.stragglers import (
    MIN_EXCESS_S,
    median_without,
    RankTime,
    StragglerPolicy,
    StragglerState,
    judge,
)

POLICY = StragglerPolicy(threshold=1.2, window_s=60.0)
PERIOD_S = POLICY.period_s()


def times(*step_s: float, nodes_of: int = 2) -> list[RankTime]:
    """Rank r runs on node "n<r // nodes_of>"."""
    return [RankTime(r, f"n{r // nodes_of}", s) for r, s in enumerate(step_s)]


def run(observations, policy=POLICY, start=0.0):
    """Feed ``observations`` (a list of times lists), one per period; every
    naming as (time, straggler), every clearance as (time, straggler)."""
    state, named, cleared = StragglerState(), [], []
    for i, observed in enumerate(observations):
        now = start + i * policy.period_s()
        j = judge(state, observed, now, policy)
        state = j.state
        named += [(now, s) for s in j.named]
        cleared += [(now, s) for s in j.cleared]
    return state, named, cleared


def periods(seconds: float) -> int:
    return int(seconds / PERIOD_S) + 1


def test_a_rank_slower_by_the_threshold_throughout_is_named_once_when_its_window_is_full():
    slow = [times(0.100, 0.101, 0.130, 0.099)] * periods(120)  # rank 2: 1.3x its peers

    _, named, cleared = run(slow)

    assert [(at, s.rank, s.node_id) for at, s in named] == [(60.0, 2, "n1")]
    s = named[0][1]
    assert s.peers_s == 0.100 and s.step_s == 0.130 and s.slow_since == 0.0
    assert s.reason(60.0) == ("rank 2 (node n1) is a straggler: its steps take 0.130 s, "
                              "1.30x its peers' median of 0.100 s, for 60 s")
    assert cleared == []


def test_a_rank_slow_for_less_than_its_window_is_not_named():
    healthy, slow = times(0.1, 0.1, 0.1, 0.1), times(0.1, 0.1, 0.1, 0.2)
    # Slow for 55 s, then healthy, then slow again for 55 s: never a whole window.
    observations = [slow] * periods(55) + [healthy] + [slow] * periods(55)

    _, named, _ = run(observations)

    assert named == []


def test_a_healthy_noisy_job_names_nobody_over_an_hour():
    rng = random.Random(7)
    # 64 ranks, step times within +-15% of 0.2 s at every observation (the
    # agents' medians; raw steps are noisier), and rank 0 always 5% slower
    # (it logs and commits checkpoints).
    observations = [
        [RankTime(r, f"n{r // 8}", 0.2 * (1.05 if r == 0 else 1.0) * rng.uniform(0.85, 1.15))
         for r in range(64)]
        for _ in range(periods(3600))]

    _, named, _ = run(observations)

    assert named == []


def test_a_whole_job_slowing_down_names_nobody():
    observations = [times(*[0.1 * (1 + i / 10)] * 8) for i in range(periods(300))]

    _, named, _ = run(observations)

    assert named == []


def test_a_slow_node_is_named_rank_by_rank_with_its_node():
    # Node n1 (ranks 2 and 3) of four nodes runs at half speed.
    slow = [times(0.1, 0.1, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1)] * periods(70)

    _, named, _ = run(slow)

    assert sorted((s.rank, s.node_id) for _, s in named) == [(2, "n1"), (3, "n1")]


def test_a_named_rank_stays_named_above_the_clear_ratio_and_is_cleared_below_it():
    slow, hovering, healthy = (times(0.1, 0.1, 0.13), times(0.1, 0.1, 0.115),
                               times(0.1, 0.1, 0.105))
    # Named; then it hovers between the clear ratio (1.1) and the threshold;
    # then it recovers; then it is slow again for a whole window.
    observations = ([slow] * periods(60) + [hovering] * periods(120) + [healthy]
                    + [slow] * periods(60))

    _, named, cleared = run(observations)

    assert len(named) == 2, "named once per episode, again only after it ended"
    assert len(cleared) == 1
    assert cleared[0][1].step_s == 0.105, "cleared with its time then"
    first, second = named[0][0], named[1][0]
    assert cleared[0][0] == (periods(60) + periods(120)) * PERIOD_S
    assert first < cleared[0][0] < second


def test_hovering_at_the_threshold_never_fills_a_window():
    # Alternately just above and just under the threshold.
    observations = [times(0.1, 0.1, 0.125 if i % 2 else 0.115) for i in range(periods(300))]

    _, named, _ = run(observations)

    assert named == []


def test_a_few_milliseconds_are_not_a_straggler_however_short_the_steps():
    excess = MIN_EXCESS_S / 2
    observations = [times(0.002, 0.002, 0.002 + excess)] * periods(300)  # 2.25x, but tiny

    _, named, _ = run(observations)

    assert named == []


def test_two_ranks_compare_with_each_other_and_one_rank_alone_is_never_judged():
    _, named, _ = run([times(0.1, 0.2)] * periods(60))
    assert [s.rank for _, s in named] == [1]

    _, named, _ = run([times(0.5)] * periods(300))
    assert named == []


def test_a_rank_that_disappears_ends_its_episode_even_as_another_is_named():
    # Rank 2 is named; later rank 3 is named at the observation where rank 2 has no time.
    observations = ([times(0.1, 0.1, 0.2, 0.1, 0.1)] * periods(60)
                    + [times(0.1, 0.1, 0.2, 0.2, 0.1)] * (periods(60) - 1)
                    + [[t for t in times(0.1, 0.1, 0.2, 0.2, 0.1) if t.rank != 2]])

    state, named, cleared = run(observations)

    assert [s.rank for _, s in named] == [2, 3]
    assert [s.rank for _, s in cleared] == [2]
    assert named[1][0] == cleared[0][0], "at the same observation"
    assert list(state.named) == [3]


def test_the_period_fits_several_observations_in_a_window_and_is_at_most_5_s():
    assert StragglerPolicy(window_s=60).period_s() == 5.0
    assert StragglerPolicy(window_s=6).period_s() == 1.0
    assert StragglerPolicy(window_s=0.1).period_s() == 0.25


def test_the_peers_median_is_the_median_of_the_others():
    rng = random.Random(3)
    for n in (2, 3, 4, 5, 10, 11):
        values = sorted(rng.choice((0.1, 0.2, 0.3, rng.random())) for _ in range(n))
        for i, v in enumerate(values):
            assert median_without(values, i) == statistics.median(values[:i] + values[i + 1:])


def test_a_job_of_16384_nodes_of_8_ranks_names_its_one_slow_rank():
    # Its cost at this size: bench/stragglers.py.
    rng = random.Random(5)
    observed = [RankTime(r, f"n{r // 8}", 0.2 * rng.uniform(0.95, 1.05) + (0.2 if r == 77 else 0))
                for r in range(131_072)]
    j = judge(StragglerState(slow_since={77: 0.0}), observed, POLICY.window_s, POLICY)
    assert [(s.rank, s.node_id) for s in j.named] == [(77, "n9")]
