"""Hang detection for any script, and the reason that names who broke the job.

Real agents (two nodes, two workers each, a real etcd), a plain torch script
that never imports ``elastic`` (tests/integration/scripts/stuck_rank.py): its
optimizer steps are its progress. A rank gets stuck at step 5 (where and how:
the scenario); the tests assert that the agents judge the hang within seconds
and that the failure's reason names the stuck rank, its node and its place
(or, when all ranks wait together, says so), then that the job restarts and
completes.

The scenarios of one rank stuck apart from the others run in one job, one
after the other (``PLAN``: each run's hang restarts the job into the next
run), so their agents and workers start, and import torch, once; each test
asserts what its run left in the agents' logs. The scenario where all ranks
wait together needs torch's flight recorder on: a job of its own.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic.events import parse_events
from elastic.keyspace import JobKeys
from elastic.store.etcd import EtcdStore
from tests.integration.procs import (
    PLAIN_TORCH_ENV,
    REPO,
    AgentProcess,
    read_progress,
    wait_progress,
)
from tests.proctable import alive

# The first test of the module also waits for the shared job: its cold start, then five hangs.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = "tests/integration/scripts/stuck_rank.py"
HANG = ("--hang-timeout-first", "20", "--max-restarts", "10")
# The shared job's runs (restart count 0, 1, ...: rounds 1, 2, ...), each (scenario,
# stuck rank): native code twice, first in a worker started with the job (warm, or cold),
# then in one forked from the template (each process that runs the script dumps its
# stacks); then the data loader, the collective its peers never enter, and a rank the
# test freezes. The run after them trains to the end.
PLAN = (("native", 1), ("native", 1), ("data", 3), ("collective", 2), ("none", 1))
RUN = {"native": 0, "data": 2, "collective": 3, "none": 4}  # each scenario's first run
FROZEN_RANK = 1


def line_of(text: str) -> int:
    """The line of SCRIPT that holds ``text`` (so the test names a place, not a number)."""
    lines = (Path(REPO) / SCRIPT).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def start_nodes(endpoint: str, job_id: str, plan, progress: Path, step_s: float = 0.05,
                env: dict[str, str] | None = None) -> list[AgentProcess]:
    """Nodes a and b running SCRIPT on ``plan``."""
    args = ["--plan", ",".join(f"{scenario}:{rank}" for scenario, rank in plan),
            "--stuck-step", "5", "--steps", "10", "--step-s", str(step_s),
            "--progress-file", str(progress)]
    return [AgentProcess(endpoint, job_id, node, "2", args, nproc=2, hang_timeout=2.0,
                         extra=HANG, script=SCRIPT, env={**PLAIN_TORCH_ENV, **(env or {})})
            for node in ("a", "b")]


def stop_and_show(agents: list[AgentProcess]) -> None:
    for a in agents:
        a.stop()
        print(f"--- agent {a.node_id}: last lines of its output ---\n" + "".join(a.output[-40:]))


def finished(a: AgentProcess, b: AgentProcess) -> str:
    assert a.wait_exit(120) == 0, a.text
    assert b.wait_exit(30) == 0, b.text
    return a.text + b.text


@dataclass
class Job:
    job_id: str
    text: str  # both agents' logs
    progress: Path
    events: list[str]  # the messages of the job's events in etcd
    stragglers: list[str]  # those of its straggler events


def run_stuck_job(endpoint: str, directory: Path) -> Job:
    """The job that runs PLAN to its end; the test freezes (SIGSTOP) rank FROZEN_RANK in
    the run of scenario "none" once it made step 3."""
    progress = directory / "progress.jsonl"
    job_id = "test-" + uuid.uuid4().hex[:8]
    agents = start_nodes(endpoint, job_id, PLAN, progress)
    frozen = None
    try:
        records = wait_progress(progress, lambda rs: any(
            r["restart"] == RUN["none"] and r["step"] >= 3 for r in rs), timeout_s=240)
        frozen = next(r["pid"] for r in records
                      if r["restart"] == RUN["none"] and r["rank"] == FROZEN_RANK)
        os.kill(frozen, signal.SIGSTOP)
        text = finished(*agents)
    finally:
        if frozen is not None and alive(frozen):
            os.kill(frozen, signal.SIGKILL)
        stop_and_show(agents)
    keys = JobKeys(job_id)
    with EtcdStore(endpoint) as store:
        events, _ = parse_events(keys, store.get_prefix(keys.events)[0])
    return Job(job_id, text, progress, [e.message for _, e in events],
               [e.message for _, e in events if e.kind == "straggler"])


@pytest.fixture(scope="module")
def stuck_job(etcd_server, tmp_path_factory):
    """The job of run_stuck_job, run once per session: `make test`'s two xdist workers
    each run some of this module's tests, and the first to ask runs the job while the
    other waits for its record (one cold start of torch on the suite's two cores, not two
    at once)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    directory = (tmp_path_factory.getbasetemp().parent / f"stuck-job-{run_id}" if run_id
                 else tmp_path_factory.mktemp("hangs"))
    directory.mkdir(exist_ok=True)
    record = directory / "job.json"
    with open(directory / "job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not record.exists():
            job = run_stuck_job(etcd_server.endpoint, directory)
            record.write_text(json.dumps({**dataclasses.asdict(job),
                                          "progress": str(job.progress)}))
    job = Job(**json.loads(record.read_text()))
    # As for every job in the session's etcd (conftest.no_straggler_named_unless_expected).
    assert not job.stragglers
    return dataclasses.replace(job, progress=Path(job.progress))


def node_of(rank: int, text: str, round_number: int) -> str:
    """The node that ran ``rank`` in a round, as its agent logged its stack
    (node ranks follow the order of registration: a's may be 1)."""
    found = re.search(rf"node (\w+) round {round_number}: stack of rank {rank} at the hang",
                      text)
    assert found, f"no agent logged the stack of rank {rank} in round {round_number}"
    return found.group(1)


def restart_for(round_number: int, reason: str, text: str) -> None:
    """The next round was committed for ``round_number``'s hang, with ``reason``."""
    assert re.search(rf"round {round_number + 1} committed \(round {round_number}: restart "
                     rf"requested by \w+: {re.escape(reason)}", text), text[-3000:]


def stuck_at_step_5_then_completed(progress: Path, runs: range) -> None:
    """Each of ``runs`` made steps 0-4 and no more; the run after the last hang made all 10."""
    records = read_progress(progress)
    for run in runs:
        assert max(r["step"] for r in records if r["restart"] == run) == 4, run
    last = max(r["restart"] for r in records)
    assert max(r["step"] for r in records if r["restart"] == last) == 9


def test_a_rank_sleeping_in_native_code_is_named_with_its_place(stuck_job):
    # Stuck twice: in round 1 (workers warm, or cold) and in round 2 (forked from the
    # template).
    for run in (RUN["native"], RUN["native"] + 1):
        round_number = run + 1
        reason = (f"rank 1 (node {node_of(1, stuck_job.text, round_number)}) is in "
                  f"stuck_rank.py:{line_of('libc.sleep(3600)')} in native_wait "
                  "while the 3 others wait in all_reduce (step 4)")
        restart_for(round_number, reason, stuck_job.text)
    stuck_at_step_5_then_completed(stuck_job.progress, range(RUN["native"], RUN["native"] + 2))


def test_a_rank_stuck_in_data_loading_is_named_with_its_place(stuck_job):
    round_number = RUN["data"] + 1
    node = node_of(3, stuck_job.text, round_number)
    reason = (f"rank 3 (node {node}) is in stuck_rank.py:{line_of('time.sleep(3600)')} in "
              "next_batch while the 3 others wait in all_reduce (step 4)")
    restart_for(round_number, reason, stuck_job.text)
    assert re.search(rf"round {round_number}: {re.escape(reason)} \[[^]]*made no progress for",
                     stuck_job.text), stuck_job.text[-3000:]
    stuck_at_step_5_then_completed(stuck_job.progress, range(RUN["data"], RUN["data"] + 1))
    # The reason is in the job's events (elasticctl events, status) ...
    assert any(reason in e for e in stuck_job.events), stuck_job.events
    # ... and the full stacks are kept beside the rank's log.
    kept = re.search(rf"node {node} round {round_number}: stack of rank 3 at the hang: .* "
                     r"\(full stacks: (\S+)\)", stuck_job.text)
    dump = Path(kept.group(1)).read_text()
    assert "in next_batch" in dump and "Thread 0x" in dump


def test_a_rank_in_a_collective_its_peers_never_enter_is_named(stuck_job):
    round_number = RUN["collective"] + 1
    restart_for(round_number,
                f"rank 2 (node {node_of(2, stuck_job.text, round_number)}) waits in barrier "
                f"(stuck_rank.py:{line_of('dist.barrier()')} in main) while the 3 others wait "
                "in all_reduce (step 4)", stuck_job.text)
    stuck_at_step_5_then_completed(stuck_job.progress,
                                   range(RUN["collective"], RUN["collective"] + 1))


def test_a_frozen_rank_is_named_as_not_answering(stuck_job):
    round_number = RUN["none"] + 1
    assert re.search(rf"round {round_number + 1} committed \(round {round_number}: restart "
                     r"requested by \w+: rank 1 \(node [ab]\) did not answer \(frozen: stopped, "
                     r"or stuck in the kernel\) while the 3 others wait in all_reduce "
                     r"\(step \d\)", stuck_job.text), stuck_job.text[-3000:]


@pytest.fixture
def job(etcd_endpoint, job_id, tmp_path):
    """Start nodes a and b on a plan; yields a function that returns both agents."""
    started: list[AgentProcess] = []

    def start(plan, env: dict[str, str] | None = None
              ) -> tuple[AgentProcess, AgentProcess, Path]:
        progress = tmp_path / "progress.jsonl"
        started.extend(start_nodes(etcd_endpoint, job_id, plan, progress, env=env))
        return started[0], started[1], progress

    yield start
    stop_and_show(started)


def test_all_ranks_in_the_same_collective_is_called_a_network_or_peer_problem(job):
    # torch's flight recorder (gloo records too) says who entered last: rank 2,
    # a second after the others.
    a, b, progress = job([("all", 2)], env={"TORCH_FR_BUFFER_SIZE": "64"})
    text = finished(a, b)
    assert (f"all 4 ranks wait in all_reduce (step 4): likely a network or peer problem; the "
            f"last to enter was rank 2 (node {node_of(2, text, 1)})") in text
    kept = re.search(r"stack of rank 2 at the hang: .* \(full stacks: (\S+)\)", text)
    assert '"profiling_name":"gloo:all_reduce"' in Path(kept.group(1) + ".fr.json").read_text()
    stuck_at_step_5_then_completed(progress, range(1))
