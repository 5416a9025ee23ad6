"""A worker's step times for the agent: what is timed and what is not."""

from __future__ import annotations

import pytest

from elastic.worker.step_timer import StepTimer


def test_steps_are_timed_from_the_end_of_the_step_before_and_averaged_per_beat():
    timer = StepTimer()
    timer.step_ended(10.0)  # the first step: from the start, never timed
    assert timer.take() == 0.0
    timer.step_ended(10.2)
    timer.step_ended(10.6)
    assert timer.take() == pytest.approx(0.3)
    assert timer.take() == 0.0, "each beat sends the steps since the last one"


def test_a_step_with_a_save_or_a_hold_is_not_timed_and_the_next_one_is():
    timer = StepTimer()
    timer.step_ended(0.0)
    timer.untimed()  # a checkpoint save in this step
    timer.step_ended(5.0)
    timer.step_ended(5.1)
    assert timer.take() == pytest.approx(0.1)
