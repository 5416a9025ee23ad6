"""The goodput bench's merge of the agents' scraped metric (bench/goodput_metric.py):
one observer's increments per interval, another's while its node is out of the job."""

from __future__ import annotations

import pytest

from bench.goodput_metric import AgentSample, compare, merge, parse


def sample(running: bool, productive: float, recovery: float = 0.0) -> AgentSample:
    return AgentSample(running, {("productive", "steps"): productive,
                                 ("recovery", "node_left"): recovery})


def test_a_frozen_node_s_agent_hands_over_to_the_one_that_sees_the_job():
    """a and b both train (a observes); a freezes (it stops answering) and b
    recovers, then trains alone; a thaws as a standby: b stays the observer."""
    rounds = [
        (0.0, {"a1": sample(True, 10.0), "b1": sample(True, 10.5)}),
        (1.0, {"a1": sample(True, 11.0), "b1": sample(True, 11.0)}),
        (2.0, {"b1": sample(False, 11.0, 1.0)}),  # a frozen: no answer
        (3.0, {"b1": sample(True, 11.0, 2.0)}),
        (4.0, {"a1": sample(False, 11.0, 3.0), "b1": sample(True, 12.0, 2.0)}),
        (5.0, {"a1": sample(False, 11.0, 4.0), "b1": sample(True, 13.0, 2.0)}),
    ]
    m = merge(rounds, 0.0, 5.0)
    assert m["productive_s"] == 3.0  # 1 (a) + 0 + 0 + 1 + 1 (b)
    assert m["recovery_s"] == 2.0  # b's, never the thawed a's standby time
    assert m["observer_changes"] == 1
    assert m["span_s"] == 5.0 and m["goodput"] == pytest.approx(0.6)
    assert m["lost_by_cause"] == {"node_left": 2.0}


def test_an_observer_that_misses_scrapes_covers_the_gap_when_it_answers_again():
    rounds = [(0.0, {"a1": sample(True, 1.0), "b1": sample(True, 1.0)})]
    rounds += [(float(t), {}) for t in range(1, 30)]  # a loaded machine: nobody in time
    rounds += [(30.0, {"a1": sample(True, 28.0)})]
    m = merge(rounds, 0.0, 30.0)
    assert m["productive_s"] == 27.0 and m["unobserved_s"] == 0.0


def test_a_gap_after_every_agent_was_replaced_is_unobserved():
    """Both nodes died after 1.0; the new agents answer from 2.0: what happened
    between nobody could say, and counting starts again from there."""
    rounds = [(0.0, {"a1": sample(True, 1.0)}), (1.0, {"a1": sample(True, 2.0)})]
    rounds += [(float(t), {"a2": sample(t >= 14, max(0.0, t - 14.0))}) for t in range(2, 20)]
    m = merge(rounds, 0.0, 19.0)
    assert m["unobserved_s"] == pytest.approx(1.0)
    assert m["productive_s"] == pytest.approx(1.0 + 5.0)


def test_the_window_bounds_the_scrapes_taken():
    rounds = [(t, {"a1": sample(True, t)}) for t in range(10)]
    assert merge(rounds, 2.0, 6.0)["productive_s"] == 4.0


def test_within_two_percent_of_the_bench_s_figure_relatively():
    assert compare(0.95, 0.96)["met"] is True
    assert compare(0.93, 0.96)["met"] is False
    assert compare(None, 0.96)["met"] is False


def test_an_agent_s_metrics_text_is_read():
    text = ('# TYPE elasticd_goodput_seconds counter\n'
            'elasticd_goodput_seconds_total{job_id="j",node_id="a",kind="productive",'
            'cause="steps"} 12.5\n'
            '# TYPE elasticd_agent_state gauge\n'
            'elasticd_agent_state{job_id="j",node_id="a",state="RUNNING"} 1.0\n'
            'elasticd_agent_state{job_id="j",node_id="a",state="STANDBY"} 0.0\n')
    s = parse(text)
    assert s.running and s.seconds == {("productive", "steps"): 12.5}
