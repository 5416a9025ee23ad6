"""Goodput end to end: one real agent (--metrics-port), two real DDP workers
(gloo), a real etcd. The test SIGKILLs a worker past the last checkpoint; the
new round restores the checkpoint and does the steps after it again. The
scraped elasticd_goodput_seconds must charge the time lost to the kill
(recovery plus repeated steps) and the productive time as the workers' own
progress file measures them."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agent import status as status_view
from elastic.net import free_port
from tests.integration.procs import AgentProcess
from tests.integration.test_metrics_agent import sample, scrape

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEP_S = 0.1
CKPT_EVERY = 10
KILL_AT = 25  # rank 0 has made this step: 20..24 (at least) will be done again
# Heartbeats come every 0.4 s (--hang-timeout 2), and the accounting trails them.
TOLERANCE_S = 0.5


def progress(path) -> list[dict]:
    """The workers' records so far (a line still being written is left for later)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def rank0_times(records, restart: int) -> dict[int, float]:
    """step -> time of rank 0's record of it, in the run ``restart``."""
    return {r["step"]: r["t"] for r in records if r["rank"] == 0 and r["restart"] == restart}


def test_a_killed_worker_s_lost_time_is_recovery_and_repeated_steps(etcd_endpoint, etcd_store,
                                                                    job_id, tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    path = str(tmp_path / "progress.jsonl")
    agent = AgentProcess(
        etcd_endpoint, job_id, "a", "1",
        ["--steps", "100000", "--step-time", str(STEP_S), "--ckpt-every", str(CKPT_EVERY),
         "--progress-file", path, "--checkpoint-dir", str(tmp_path / "ckpt")],
        hang_timeout=2.0, extra=("--metrics-port", str(port)))
    try:
        agent.wait_output(f"serves Prometheus metrics at {url}", timeout_s=20)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                r["rank"] == 0 and r["step"] >= KILL_AT for r in progress(path)):
            time.sleep(0.02)
        victim = next(r["pid"] for r in progress(path) if r["rank"] == 1)
        os.kill(victim, signal.SIGKILL)  # the fault: past the checkpoint of step 19

        # Scrape once the new round is past every step the first one made.
        seen, newest = None, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and agent.proc.poll() is None:
            records = progress(path)
            first_run = rank0_times(records, 0)
            samples = scrape(url)
            if samples and rank0_times(records, 1) \
                    and sample(samples, "elasticd_step") > max(first_run) + 10:
                seen, newest = samples, int(sample(samples, "elasticd_step"))
                break
            time.sleep(0.2)
        assert seen is not None, f"the new round did not get past the kill:\n{agent.text}"
        records = progress(path)
        # elasticctl status: one line, from the record the agent published in etcd.
        status = status_view.collect(etcd_store, job_id, query_agents=False)
        line = [x for x in status_view.render(status).splitlines() if x.startswith("goodput")]
    finally:
        agent.stop()

    first, second = rank0_times(records, 0), rank0_times(records, 1)
    resumed = min(second)  # the first step the new round made: the checkpoint's next
    assert resumed == CKPT_EVERY * (KILL_AT // CKPT_EVERY)  # restored step 19: resumes at 20
    redone = [s for s in first if s >= resumed]
    assert len(redone) >= KILL_AT - resumed

    def seconds(kind, cause):
        return sample(seen, "elasticd_goodput_seconds_total", kind=kind, cause=cause)

    # Lost to the kill: from where the first run was at step `resumed` to where
    # the second run is at the same step again.
    lost = second[resumed] - first[resumed]
    assert seconds("recovery", "worker_exit") > 0
    assert seconds("repeated", "worker_exit") > 0.5 * STEP_S * (len(redone) - 2)
    assert seconds("recovery", "worker_exit") + seconds("repeated", "worker_exit") \
        == pytest.approx(lost, abs=TOLERANCE_S)
    # Productive: each step up to the newest the agent heard of, once.
    kept = (first[resumed] - first[0]) + (second[newest] - second[resumed])
    assert seconds("productive", "steps") == pytest.approx(kept, abs=TOLERANCE_S)
    for cause in ("worker_hang", "node_left", "peer_failure"):  # nothing else went wrong
        assert seconds("recovery", cause) == seconds("repeated", cause) == 0
    accounted = sample(seen, "elasticd_goodput_seconds_total")
    assert sample(seen, "elasticd_ettr") == pytest.approx(
        seconds("productive", "steps") / accounted, abs=0.02)
    assert status["goodput"]["node_id"] == "a"
    assert len(line) == 1 and line[0].startswith("goodput (as node a sees it): ETTR "), line
