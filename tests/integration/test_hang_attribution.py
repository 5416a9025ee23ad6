"""Hang detection for any script, and the reason that names who broke the job.

Real agents (two nodes, two workers each, a real etcd), a plain torch script
that never imports ``elastic`` (tests/integration/scripts/stuck_rank.py): its
optimizer steps are its progress. In the first round one rank gets stuck at
step 5 (where and how: the scenario); the test asserts that the agents judge
the hang within seconds and that the failure's reason names the stuck rank,
its node and its place (or, when all ranks wait together, says so), then that
the job restarts and completes.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from elastic.keyspace import JobKeys
from tests.integration.procs import REPO, AgentProcess, read_progress, wait_progress
from tests.proctable import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = "tests/integration/scripts/stuck_rank.py"
HANG = ("--hang-timeout-first", "20")


def line_of(text: str) -> int:
    """The line of SCRIPT that holds ``text`` (so the test names a place, not a number)."""
    lines = (Path(REPO) / SCRIPT).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


@pytest.fixture
def job(etcd_endpoint, job_id, tmp_path):
    """Start nodes a and b on ``scenario``; yields a function that returns both agents."""
    started: list[AgentProcess] = []

    def start(scenario: str, stuck_rank: int = 1, step_s: float = 0.05,
              env: dict[str, str] | None = None, stuck_runs: int = 1
              ) -> tuple[AgentProcess, AgentProcess, Path]:
        progress = tmp_path / "progress.jsonl"
        args = ["--scenario", scenario, "--stuck-rank", str(stuck_rank), "--stuck-step", "5",
                "--stuck-runs", str(stuck_runs),
                "--steps", "10", "--step-s", str(step_s), "--progress-file", str(progress)]
        for node in ("a", "b"):
            started.append(AgentProcess(etcd_endpoint, job_id, node, "2", args, nproc=2,
                                        hang_timeout=2.0, extra=HANG, script=SCRIPT, env=env))
        return started[0], started[1], progress

    yield start
    for a in started:
        a.stop()
        print(f"--- agent {a.node_id}: last lines of its output ---\n" + "".join(a.output[-40:]))


def node_of(rank: int, text: str, round_number: int = 1) -> str:
    """The node that ran ``rank`` in a round, as its agent logged its stack
    (node ranks follow the order of registration: a's may be 1)."""
    found = re.search(rf"node (\w+) round {round_number}: stack of rank {rank} at the hang",
                      text)
    assert found, f"no agent logged the stack of rank {rank}"
    return found.group(1)


def finished(a: AgentProcess, b: AgentProcess) -> str:
    assert a.wait_exit(90) == 0, a.text
    assert b.wait_exit(30) == 0, b.text
    return a.text + b.text


def restarted_and_completed(progress: Path, stuck_runs: int = 1) -> None:
    records = read_progress(progress)
    for run in range(stuck_runs):
        assert max(r["step"] for r in records if r["restart"] == run) == 4
    assert max(r["step"] for r in records if r["restart"] >= stuck_runs) == 9


def test_a_rank_stuck_in_data_loading_is_named_with_its_place(job, etcd_store, job_id):
    a, b, progress = job("data", stuck_rank=3)
    text = finished(a, b)
    node = node_of(3, text)
    reason = (f"rank 3 (node {node}) is in stuck_rank.py:{line_of('time.sleep(3600)')} in "
              "next_batch while the 3 others wait in all_reduce (step 4)")
    assert reason in text and "made no progress for" in text
    restarted_and_completed(progress)
    # The reason is in the job's events (elasticctl events, status) ...
    events = [kv.value.decode() for kv in etcd_store.get_prefix(JobKeys(job_id).events)[0]]
    assert any(reason in e for e in events), events
    # ... and the full stacks are kept beside the rank's log.
    kept = re.search(rf"node {node} round 1: stack of rank 3 at the hang: .* \(full stacks: "
                     r"(\S+)\)", text)
    dump = Path(kept.group(1)).read_text()
    assert "in next_batch" in dump and "Thread 0x" in dump


def test_a_rank_sleeping_in_native_code_is_named_with_its_place(job):
    # Stuck twice: in round 1 (workers warm, or cold) and in round 2 (forked from
    # the template): each process that runs the script dumps its stacks.
    a, b, progress = job("native", stuck_rank=1, stuck_runs=2)
    text = finished(a, b)
    for round_number in (1, 2):
        reason = (f"rank 1 (node {node_of(1, text, round_number)}) is in "
                  f"stuck_rank.py:{line_of('libc.sleep(3600)')} in native_wait "
                  "while the 3 others wait in all_reduce (step 4)")
        assert re.search(rf"round {round_number + 1} committed \(round {round_number}: restart "
                         rf"requested by \w+: {re.escape(reason)}", text), text[-3000:]
    restarted_and_completed(progress, stuck_runs=2)


def test_a_rank_in_a_collective_its_peers_never_enter_is_named(job):
    a, b, progress = job("collective", stuck_rank=2)
    text = finished(a, b)
    assert (f"rank 2 (node {node_of(2, text)}) waits in barrier "
            f"(stuck_rank.py:{line_of('dist.barrier()')} in main) while the 3 others wait in "
            "all_reduce (step 4)") in text
    restarted_and_completed(progress)


def test_all_ranks_in_the_same_collective_is_called_a_network_or_peer_problem(job):
    # torch's flight recorder (gloo records too) says who entered last: rank 2,
    # a second after the others.
    a, b, progress = job("all", stuck_rank=2, env={"TORCH_FR_BUFFER_SIZE": "64"})
    text = finished(a, b)
    assert (f"all 4 ranks wait in all_reduce (step 4): likely a network or peer problem; the "
            f"last to enter was rank 2 (node {node_of(2, text)})") in text
    kept = re.search(r"stack of rank 2 at the hang: .* \(full stacks: (\S+)\)", text)
    assert '"profiling_name":"gloo:all_reduce"' in Path(kept.group(1) + ".fr.json").read_text()
    restarted_and_completed(progress)


def test_a_frozen_rank_is_named_as_not_answering(job):
    a, b, progress = job("none", step_s=0.5)
    records = wait_progress(progress, lambda rs: any(r["step"] >= 3 for r in rs))
    frozen = next(r["pid"] for r in records if r["rank"] == 1)
    os.kill(frozen, signal.SIGSTOP)
    try:
        text = finished(a, b)
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert re.search(r"rank 1 \(node [ab]\) did not answer \(frozen: stopped, or stuck in the "
                     r"kernel\) while the 3 others wait in all_reduce \(step \d\)", text), text
