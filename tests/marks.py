"""Marks shared by test modules."""

from __future__ import annotations

import pytest

# The simulator's many-schedule tests (tests/sim/test_simulator.py: the 10,000 mixed
# schedules in four parts, 300 of each other profile), each a pool of two processes that
# keeps both cores busy: they share one xdist worker and run one after the other.
# `make test` runs the suite on two workers with --dist loadgroup, which queues the
# largest group first and then the other tests in the order collected: this group starts
# at once on one worker while the other starts the chaos campaign (tests/chaos, collected
# first), which mostly waits (on its faults, their hold times and recoveries) and leaves
# the cores to the simulator. Run one after the other on one worker, as they were, the
# campaign's waits left a core idle beside the waiting integration tests.
SIMULATOR = pytest.mark.xdist_group("simulator")
