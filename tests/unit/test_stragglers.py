"""The leader's straggler rule, driven with explicit times: no agents, no sleeping."""

from __future__ import annotations

import random
import statistics

from agent.stragglers import (
    BUSY,
    MIN_EXCESS_S,
    WALL,
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


def lockstep(wall_s: float, *busy_s: float, nodes_of: int = 2) -> list[RankTime]:
    """Ranks that wait for each other every step: one wall time, each its busy time."""
    return [RankTime(r, f"n{r // nodes_of}", wall_s, b) for r, b in enumerate(busy_s)]


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


# --- busy time: the rank that makes a lockstep job wait ---------------------------------------


def test_in_lockstep_the_rank_its_peers_wait_for_is_named_by_its_busy_time():
    # Every rank's steps take 0.110 s; rank 3 is busy 0.105 s of it, its peers
    # about 0.055 s (they wait the rest for it in the allreduce).
    slow = [lockstep(0.110, 0.054, 0.055, 0.056, 0.105)] * periods(120)

    _, named, _ = run(slow)

    [(at, s)] = named
    assert (at, s.rank, s.node_id, s.measure) == (60.0, 3, "n1", BUSY)
    assert (s.step_s, s.peers_s) == (0.105, 0.055)
    assert s.reason(60.0) == ("rank 3 (node n1) is a straggler: busy 0.105 s per step, "
                              "1.91x its peers' median of 0.055 s, for 60 s")


def test_a_rank_slow_by_both_measures_is_named_by_its_wall_time():
    slow = [[RankTime(0, "n0", 0.1, 0.05), RankTime(1, "n0", 0.1, 0.05),
             RankTime(2, "n1", 0.2, 0.15)]] * periods(60)

    _, named, _ = run(slow)

    assert [(s.rank, s.measure, s.step_s) for _, s in named] == [(2, WALL, 0.2)]


def test_a_rank_busy_for_milliseconds_is_not_judged_on_noise():
    # Ranks that mostly wait: 4x its peers' busy time, but 3 ms.
    observations = [lockstep(0.100, 0.001, 0.001, 0.001, 0.004)] * periods(300)

    _, named, _ = run(observations)

    assert named == []


def test_a_rank_busier_by_a_sliver_of_a_long_step_is_not_named():
    # Steps of 1 s; rank 0 is busy 0.1 s (it logs), its peers 0.02 s: 5x, but
    # without its extra 80 ms the job's steps would be under 10% faster.
    observations = [lockstep(1.0, 0.10, 0.02, 0.02, 0.02)] * periods(300)

    _, named, _ = run(observations)

    assert named == []
    # The same excess in steps of 0.3 s is a sixth of them and more: named.
    _, named, _ = run([lockstep(0.3, 0.10, 0.02, 0.02, 0.02)] * periods(60))
    assert [(s.rank, s.measure) for _, s in named] == [(0, BUSY)]


def test_ranks_busy_for_their_whole_steps_name_nobody():
    # Where every rank spins while it waits (a CUDA sync), busy is wall for all.
    rng = random.Random(11)
    observations = [[RankTime(r, f"n{r // 8}", w, w * rng.uniform(0.97, 1.0)) for r in range(16)]
                    for w in (0.2 * rng.uniform(0.9, 1.1) for _ in range(periods(3600)))]

    _, named, _ = run(observations)

    assert named == []


def test_a_healthy_noisy_lockstep_job_names_nobody_over_an_hour():
    rng = random.Random(13)
    # 64 ranks in lockstep: one wall time per observation, within +-15% of
    # 0.2 s; busy times within +-30% of 0.05 s, rank 0 always 10% busier.
    observations = [
        [RankTime(r, f"n{r // 8}", wall, 0.05 * (1.1 if r == 0 else 1.0) * rng.uniform(0.7, 1.3))
         for r in range(64)]
        for wall in (0.2 * rng.uniform(0.85, 1.15) for _ in range(periods(3600)))]

    _, named, _ = run(observations)

    assert named == []


def test_only_ranks_that_measure_busy_time_are_compared_by_it():
    # Ranks 0 and 1 send no busy time (an older worker, CUDA); rank 2 and 3 do.
    observed = [RankTime(0, "n0", 0.1), RankTime(1, "n0", 0.1),
                RankTime(2, "n1", 0.1, 0.09), RankTime(3, "n1", 0.1, 0.03)]
    _, named, _ = run([observed] * periods(60))
    assert [(s.rank, s.measure, s.peers_s) for _, s in named] == [(2, BUSY, 0.03)]

    # One rank alone with a busy time has no peers to be compared with.
    alone = observed[:3]
    _, named, _ = run([alone] * periods(300))
    assert named == []


def test_a_rank_named_by_busy_time_is_cleared_when_its_busy_time_comes_back():
    slow, healthy = lockstep(0.11, 0.05, 0.05, 0.105), lockstep(0.06, 0.05, 0.05, 0.052)

    _, named, cleared = run([slow] * periods(60) + [healthy])

    assert [s.measure for _, s in named] == [BUSY]
    [(_, s)] = cleared
    assert (s.rank, s.measure, s.step_s, s.peers_s) == (2, BUSY, 0.052, 0.05)
    assert s.took() == "busy 0.052 s per step"
