"""Marks shared by test modules."""

from __future__ import annotations

import pytest

# Tests that start before all others (tests/conftest.py sorts them first, in the order
# collected): the short chaos campaign, the suite's longest test, which mostly waits (on
# its faults, their hold times and recoveries), then the simulator's many-schedule tests
# (the 10,000 mixed schedules in four parts, 300 of each other profile), each a pool of
# two processes that keeps both cores busy. `make test` runs the suite on two xdist
# workers with --dist loadgroup, which hands out the tests in that order: the campaign
# starts on one worker while the other runs the simulator, which fills the cores the
# campaign leaves idle; the integration tests, which mostly wait too, come after.
# (xdist_group marks are not used: pytest 9.2 ignores the node id xdist 3.8 rewrites for
# them, so a group is silently spread over the workers, pytest-xdist issue #1386.)
STARTS_FIRST = pytest.mark.starts_first
