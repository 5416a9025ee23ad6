"""Which grace a stop gives workers that ignore SIGTERM, with real agents, etcd and workers.

A worker blocked in an NCCL collective whose peer is gone never runs its
SIGTERM handler: after a failure only SIGKILL ends it, so waiting the drain's
grace (time for a final checkpoint: 90 s in the Kubernetes overlay) would only
delay the restart. The workers here ignore SIGTERM to stand for them.
"""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.integration.procs import AgentProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = "tests/integration/scripts/stubborn_worker.py"
DRAIN_GRACE_S = 6.0
FAILURE_GRACE_S = 0.5


def starts(path) -> list[tuple[str, int]]:
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        return []
    return [(lines[i], int(lines[i + 1])) for i in range(0, len(lines), 3)]


def stops(agent: AgentProcess) -> list[float]:
    """The grace of each stop of running workers, in the order the agent logged them."""
    return [float(g) for g in re.findall(r"stopping [1-9]\d* running workers \(grace ([\d.]+) s\)",
                                         agent.text)]


def test_a_failure_kills_stubborn_survivors_after_the_short_grace_a_drain_waits_the_long_one(
        etcd_endpoint, job_id, tmp_path):
    started = tmp_path / "starts"
    args = ["--starts", str(started), "--fail-node", "a", "--fail-after", "2"]
    # One round with both from the start (settle), no warm workers (nothing to import).
    extra = ("--no-prestart", "--settle", "3", "--stop-grace", str(DRAIN_GRACE_S))
    # Given as its variable: an agent that does not know it warns and goes on.
    env = {"ELASTIC_FAILURE_STOP_GRACE": str(FAILURE_GRACE_S)}
    agents = [AgentProcess(etcd_endpoint, job_id, node, "1:2", args, nproc=1, extra=extra,
                           script=SCRIPT, env=env) for node in ("a", "b")]
    a, b = agents
    try:
        # a's worker fails: b's survivor ignores SIGTERM and must be killed after
        # the failure grace, and a new round starts on both.
        wait_until(lambda: len({n for n, r in starts(started) if r > min(
            r0 for _, r0 in starts(started))}) == 2, 40, "a second round on both nodes",
            context=lambda: a.text[-3000:] + b.text[-3000:])
        assert stops(b) == [FAILURE_GRACE_S], b.text
        assert f"outlived the {FAILURE_GRACE_S:.1f} s grace period" in b.text

        # b drains (SIGTERM, as systemctl stop or a pod's end): its worker gets the
        # long grace; a, whose peer left, stops its own with the short one.
        drain_at = time.monotonic()
        b.proc.send_signal(signal.SIGTERM)
        assert b.wait_exit(DRAIN_GRACE_S + 30) == 0, b.text
        assert time.monotonic() - drain_at >= DRAIN_GRACE_S
        assert stops(b) == [FAILURE_GRACE_S, DRAIN_GRACE_S], b.text
        assert f"outlived the {DRAIN_GRACE_S:.1f} s grace period" in b.text
        wait_until(lambda: len(stops(a)) == 1, 30, "a's stop after b left",
                   context=lambda: a.text[-3000:])
        assert stops(a) == [FAILURE_GRACE_S], a.text
    finally:
        for agent in agents:
            agent.stop()
            print(f"--- agent {agent.node_id} ---\n" + "".join(agent.output[-60:]))
