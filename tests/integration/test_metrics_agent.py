"""elasticd --metrics-port end to end: one real agent, real DDP workers (gloo),
a real etcd, an injected worker crash; /metrics scraped over HTTP while the
job runs must show the restart with its reason, the time to recover, and the
checkpoint saved before the crash and restored after it."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic.net import free_port
from tests.integration.procs import AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def scrape(url: str) -> dict[tuple[str, frozenset], float] | None:
    """Every sample at ``url`` by (name, labels); None while it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples, name: str, **labels) -> float:
    """The sum of the ``name`` samples that carry ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= ls)


def test_a_worker_crash_shows_in_the_scraped_metrics(etcd_endpoint, job_id, tmp_path):
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    agent = AgentProcess(
        etcd_endpoint, job_id, "a", "1",
        ["--steps", "40", "--step-time", "0.1", "--ckpt-every", "4", "--crash", "1:9",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        extra=("--metrics-port", str(port)))
    try:
        agent.wait_output(f"serves Prometheus metrics at {url}", timeout_s=20)
        deadline = time.monotonic() + 60
        seen = None
        while time.monotonic() < deadline and agent.proc.poll() is None:
            samples = scrape(url)
            if samples and sample(samples, "elasticd_recover_seconds_count") >= 1 \
                    and sample(samples, "elasticd_checkpoint_restore_seconds_count") >= 1:
                seen = samples
                break
            time.sleep(0.2)
        assert seen is not None, (f"no recovery and restore seen in /metrics; agent "
                                  f"output:\n{agent.text}")
        restarts = {dict(ls)["reason"]: v for (n, ls), v in seen.items()
                    if n == "elasticd_restarts_total"}
        assert restarts["worker_exit"] == 1, restarts
        assert sum(restarts.values()) == 1, restarts
        assert sample(seen, "elasticd_recover_seconds_count", reason="worker_exit") == 1
        assert sample(seen, "elasticd_recover_seconds_sum", reason="worker_exit") > 0
        assert sample(seen, "elasticd_detect_seconds_count", reason="worker_exit") == 1
        assert sample(seen, "elasticd_rounds_started_total") == 2
        assert sample(seen, "elasticd_agent_state", state="RUNNING") == 1
        assert sample(seen, "elasticd_world_size") == 2
        assert sample(seen, "elasticd_rendezvous_seconds_count") == 2
        # Saved at step 3 (and 7) before the crash at step 9; restored once after it.
        assert sample(seen, "elasticd_checkpoint_save_seconds_count") >= 1
        assert sample(seen, "elasticd_checkpoint_save_bytes_total") > 0
        assert sample(seen, "elasticd_checkpoint_restore_seconds_count") == 1
        assert sample(seen, "elasticd_checkpoint_restore_bytes_total") > 0
        agent.proc.terminate()  # leaves the job; its metrics server goes with it
        agent.wait_exit(30)
    finally:
        agent.stop()
    assert scrape(url) is None, "the metrics server outlived its agent"
