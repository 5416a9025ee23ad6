"""A short chaos campaign: every fault kind once, against real agents, etcd and namespaces.

Runs ``tests.chaos`` in-process with a fixed seed (fixed-size variant, with the
bitwise weights oracle). Without root (no network namespaces, no checkpoint
tmpfs) it falls back to loopback and injects only the faults that need
neither. On failure the message is the campaign's summary: the invariants,
the replay command and the kept logs. The ``memory`` variant (``make chaos
VARIANT=memory``) takes minutes and is not run here.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.__main__ import render
from tests.chaos.campaign import run_campaign
from tests.chaos.faults import KINDS
from tests.marks import STARTS_FIRST

# Collected before the simulator's tests, it starts first (tests/marks.py).
pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600), STARTS_FIRST]

SEED = int(os.environ.get("CHAOS_SEED", "1"))


def test_short_campaign_every_fault_kind_once():
    report = run_campaign(SEED, len(KINDS), "fixed", say=lambda m: print(m, flush=True))
    summary = render(report)
    print(summary)
    injected = {f.kind for f in report.faults}
    assert injected | set(report.skipped_kinds) == set(KINDS), summary
    assert report.ok, summary
