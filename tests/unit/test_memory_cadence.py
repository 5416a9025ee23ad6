"""How often the memory tier snapshots: k from the measured cost, agreed once."""

from __future__ import annotations

import pytest

from elastic.checkpoint.memory.cadence import (
    CALIBRATION_STEPS,
    MAX_EVERY,
    Cadence,
    choose_every,
    parse_every,
)
from elastic.errors import ConfigError


class TestChooseEvery:
    def test_cheap_snapshots_every_step(self):
        assert choose_every(cost_s=0.001, interval_s=0.2) == 1  # 0.5%

    def test_the_smallest_k_within_one_percent(self):
        # 5 ms per snapshot, 100 ms steps: k=5 gives exactly 1%, k=4 1.25%
        assert choose_every(cost_s=0.005, interval_s=0.1) == 5
        assert choose_every(cost_s=0.0051, interval_s=0.1) == 6

    def test_free_snapshots_and_untimeable_steps(self):
        assert choose_every(0.0, 0.1) == 1
        assert choose_every(0.01, 0.0) == MAX_EVERY

    def test_parse(self):
        assert parse_every("auto") is None and parse_every(3) == 3
        for bad in (0, -1, "3", 2.5, True):
            with pytest.raises(ConfigError, match="memory_every"):
                parse_every(bad)


class TestCadence:
    def test_fixed_every_snapshots_its_multiples(self):
        cadence = Cadence(3, agree=lambda k: pytest.fail("no agreement for a fixed k"))
        assert [s for s in range(10) if cadence.due(s)] == [0, 3, 6, 9]

    def test_calibrates_then_fixes_the_agreed_k_once(self):
        agreed = []

        def agree(k):
            agreed.append(k)
            return 7  # another rank measured more

        cadence = Cadence(None, agree)
        now = 0.0
        due = []
        for step in range(20):
            now += 0.1  # 100 ms steps
            is_due = cadence.due(step)
            due.append(is_due)
            cadence.record(now, 0.004 if is_due else 0.0)
            now += 0.004 if is_due else 0.0
        assert due[:CALIBRATION_STEPS] == [True] * CALIBRATION_STEPS
        assert agreed == [4]  # 4 ms / (k * 100 ms) <= 1%: k = 4, proposed once
        assert cadence.every == 7
        assert [s for s in range(CALIBRATION_STEPS, 20) if due[s]] == \
            [s for s in range(CALIBRATION_STEPS, 20) if s % 7 == 0]

    def test_a_group_s_costly_first_steps_do_not_set_k(self):
        # the first snapshots pay once-only costs (mapping, an LR warm-up's objects):
        # the steady steps' cost decides
        cadence = Cadence(None, agree=max)
        now = 0.0
        for step in range(CALIBRATION_STEPS):
            now += 0.064
            assert cadence.due(step)
            cost = 0.002 if step < 4 else 0.0004
            cadence.record(now, cost)
            now += cost
        assert cadence.proposal() == 1  # 0.4 ms of a 64 ms step: 0.6%

    def test_the_interval_leaves_the_snapshot_out(self):
        cadence = Cadence(None, agree=max)
        cadence.record(1.0, 0.5)   # a slow first snapshot (mapping the memory)
        cadence.record(1.6, 0.01)  # 0.1 s of training after it
        cadence.record(1.71, 0.01)
        assert cadence.proposal() == choose_every(0.01, 0.1)
