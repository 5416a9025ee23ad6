"""Marks shared by test modules."""

from __future__ import annotations

import pytest

# Tests that keep both cores busy on their own (the simulator's 10,000 schedules, the short
# chaos campaign). `make test` runs the suite on two xdist workers with --dist loadgroup:
# these share one worker and run one after the other, while the other worker takes the
# tests that mostly wait (for etcd, for rounds, for worker processes).
CPU_BOUND = pytest.mark.xdist_group("cpu-bound")
