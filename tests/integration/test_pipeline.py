"""examples/pipeline.py end to end: real elasticd agents, real pipeline stages over gloo.

- Bitwise oracle: a 2-stage run whose workers are SIGKILLed at seeded random
  steps in three different rounds ends with the same parameters (SHA-256 over
  the full model) as an uninterrupted run, and every step it ran, replays
  included, had the uninterrupted run's loss.
- Resharding: a checkpoint saved by 2 stages resumes with 1 and with 4 stages
  under new job ids (no commit-log entry: restore falls back to the
  directories marked COMMITTED); the loss curve continues the uninterrupted
  one and every sample of the epoch is trained on exactly once across the
  change.

The runs share one configuration (model, data, seed); only the number of
stages, the steps and the checkpoint cadence change, none of which enters the
arithmetic, so the uninterrupted 2-stage run is the reference of every test.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
import uuid

import pytest

from tests.integration.procs import AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SCRIPT = "examples/pipeline.py"
NUM_SAMPLES = 512
GLOBAL_BATCH = 32
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH  # 16
REFERENCE_STEPS = 40  # two and a half epochs: the runs cross epoch boundaries
# Relative tolerance of the resharded loss against the uninterrupted one; see
# test_checkpoint_of_2_stages_resumes_with_1_and_4_stages.
LOSS_RTOL = 1e-5


def script_args(tmp, name: str, steps: int, ckpt_every: int, step_time: float = 0.0
                ) -> tuple[str, str, list[str]]:
    """(progress file, result file, the script's arguments) for one run."""
    progress, result = str(tmp / f"{name}.jsonl"), str(tmp / f"{name}.json")
    return progress, result, [
        "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--step-time", str(step_time),
        "--num-samples", str(NUM_SAMPLES), "--global-batch", str(GLOBAL_BATCH),
        "--microbatches", "4", "--depth", "8", "--threads", "1",
        "--progress-file", progress, "--result-file", result]


def start_agent(endpoint: str, job_id: str, nproc: int, checkpoint_dir, args: list[str], *,
                prestart: bool) -> AgentProcess:
    extra = ["--checkpoint-dir", str(checkpoint_dir), "--max-restarts", "10"]
    if not prestart:
        extra.append("--no-prestart")  # no warm workers to compete for the 2 cores
    # A generous hang timeout: deaths are seen by exit, and on 2 cores a warm-up of
    # the next workers can slow a step far beyond the default.
    return AgentProcess(endpoint, job_id, "n0", "1", args, nproc=nproc, hang_timeout=60,
                        extra=tuple(extra), script=SCRIPT)


def run_to_end(agent: AgentProcess, timeout_s: float = 240.0) -> None:
    try:
        code = agent.wait_exit(timeout_s)
    finally:
        agent.stop()
    assert code == 0, agent.text[-6000:]


def read_records(path: str) -> list[dict]:
    """The progress lines written so far; a last line still being written is left out."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]


def wait_records(path: str, agent: AgentProcess, predicate, timeout_s: float = 120.0
                 ) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_records(path)
        if predicate(records):
            return records
        if time.monotonic() > deadline or agent.proc.poll() is not None:
            raise AssertionError(f"progress never matched (agent exit {agent.proc.poll()}); "
                                 f"last records: {records[-4:]}\n{agent.text[-3000:]}")
        time.sleep(0.05)


def read_result(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def losses_by_step(records: list[dict]) -> dict[int, list[float]]:
    """Every loss the last stage reported, by step (a replayed step reports twice)."""
    found: dict[int, list[float]] = {}
    for r in records:
        if r["loss"] is not None:
            found.setdefault(r["step"], []).append(r["loss"])
    return found


def check_same_batch_on_every_stage(records: list[dict]) -> None:
    """Pure pipeline parallelism: all stages of a run train on the same global batch."""
    by_run_step: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    for r in records:
        by_run_step.setdefault((r["restart"], r["step"]), set()).add(tuple(r["samples"]))
    odd = {key: batches for key, batches in by_run_step.items() if len(batches) != 1}
    assert not odd, f"stages of one step saw different batches: {odd}"


@pytest.fixture(scope="module")
def reference(etcd_server, tmp_path_factory) -> dict:
    """The uninterrupted 2-stage run: its result and one loss per step."""
    tmp = tmp_path_factory.mktemp("pipeline-reference")
    progress, result, args = script_args(tmp, "reference", REFERENCE_STEPS, ckpt_every=4)
    job = f"pp-reference-{uuid.uuid4().hex[:8]}"
    run_to_end(start_agent(etcd_server.endpoint, job, 2, tmp / "ckpt", args, prestart=False))
    records = read_records(progress)
    losses = losses_by_step(records)
    assert sorted(losses) == list(range(REFERENCE_STEPS))
    assert all(len(v) == 1 for v in losses.values())
    assert {r["restart"] for r in records} == {0}
    check_same_batch_on_every_stage(records)
    curve = {step: v[0] for step, v in losses.items()}
    # A real model learning: the last epoch's mean loss is far below the first steps'.
    last_epoch = [curve[s] for s in range(REFERENCE_STEPS - STEPS_PER_EPOCH, REFERENCE_STEPS)]
    assert sum(last_epoch) / len(last_epoch) < 0.2 * (curve[0] + curve[1]) / 2, curve
    return {"result": read_result(result), "loss": curve}


def kill_a_worker(agent: AgentProcess, progress: str, restart: int, rng: random.Random
                  ) -> dict:
    """SIGKILL a random rank of run ``restart`` once both ranks finished a random step
    3 to 6 steps after the one that run started at; what was done, for messages."""
    def mine(records: list[dict]) -> list[dict]:
        return [r for r in records if r["restart"] == restart]

    first = min(r["step"] for r in mine(wait_records(progress, agent, mine)))
    at = first + rng.randint(3, 6)
    victim = rng.randrange(2)
    records = wait_records(progress, agent,
                           lambda rs: {r["rank"] for r in mine(rs) if r["step"] >= at} == {0, 1})
    pid = next(r["pid"] for r in mine(records) if r["rank"] == victim)
    os.kill(pid, signal.SIGKILL)
    return {"restart": restart, "first_step": first, "at_step": at, "rank": victim, "pid": pid}


def test_sigkilled_workers_resume_bitwise_identical(etcd_endpoint, job_id, tmp_path, reference):
    rng = random.Random(20240607)
    progress, result, args = script_args(tmp_path, "killed", REFERENCE_STEPS, ckpt_every=3,
                                         step_time=0.1)
    agent = start_agent(etcd_endpoint, job_id, 2, tmp_path / "ckpt", args, prestart=True)
    kills = []
    try:
        for restart in range(3):
            kills.append(kill_a_worker(agent, progress, restart, rng))
        run_to_end(agent, timeout_s=300)
    finally:
        agent.stop()

    records = read_records(progress)
    assert {r["restart"] for r in records} == {0, 1, 2, 3}, kills
    assert agent.text.count("killed by signal 9") >= 3, agent.text[-4000:]
    firsts = {k: min(r["step"] for r in records if r["restart"] == k) for k in (1, 2, 3)}
    assert all(step > 0 for step in firsts.values()), \
        f"a restart started from scratch, not from a checkpoint: {firsts}; kills {kills}"
    assert max(r["step"] for r in records if r["restart"] == 3) == REFERENCE_STEPS - 1
    check_same_batch_on_every_stage(records)
    # every step ran, replays after a kill included, with the reference's loss
    for step, seen in losses_by_step(records).items():
        assert set(seen) == {reference["loss"][step]}, (step, seen, kills)
    final = read_result(result)
    assert final["start"] == firsts[3]
    assert final["sha256"] == reference["result"]["sha256"], (final, kills)
    assert final["final_loss"] == reference["result"]["final_loss"]


def test_checkpoint_of_2_stages_resumes_with_1_and_4_stages(etcd_endpoint, job_id, tmp_path,
                                                            reference):
    """Train 2 stages to the middle of the first epoch, then resume that checkpoint with 1
    stage and, separately, with 4 to the end of the epoch.

    Tolerance of the loss: relative 1e-5. Every stage layout runs the same float32
    operations on the same micro-batches in the same order (a stage is the full model's
    own layers; AdamW updates each tensor elementwise), so the curve is expected to be
    bit for bit the reference's, and is on this build. What may legitimately differ is
    kernel choice or reduction order between processes (e.g. another intra-op thread
    count): a few float32 roundings (~1e-7 each) per operation, far below 1e-5 after 8
    steps. A wrong resume is far above it: tried on this model from step 8, a skipped
    batch, a repeated batch or a fresh optimizer state moves the loss of every step after
    its first update by 3.5 % to 350 % (a fresh optimizer leaves the first loss as it is:
    it is computed before the update).
    """
    half = STEPS_PER_EPOCH // 2
    root = tmp_path / "ckpt"
    progress, _, args = script_args(tmp_path, "first-half", half, ckpt_every=4)
    run_to_end(start_agent(etcd_endpoint, job_id, 2, root, args, prestart=False))
    first = read_records(progress)
    assert {r["step"] for r in first} == set(range(half))
    # Saved under elasticd, the commit log of this job is in etcd, not beside the
    # checkpoints: a new job finds no entry and must go by the COMMITTED markers.
    assert not os.path.exists(root / "latest")
    assert os.path.exists(root / f"step-{half - 1:012d}" / "COMMITTED")
    first_samples = [s for r in first if r["rank"] == 0 for s in r["samples"]]

    for stages in (1, 4):
        resumed_root = tmp_path / f"ckpt-{stages}"
        shutil.copytree(root, resumed_root)  # each resume saves into a root of its own
        progress, result, args = script_args(tmp_path, f"resume-{stages}", STEPS_PER_EPOCH,
                                             ckpt_every=4)
        run_to_end(start_agent(etcd_endpoint, f"{job_id}-s{stages}", stages, resumed_root,
                               args, prestart=False))
        records = read_records(progress)
        assert {r["world"] for r in records} == {stages}
        assert {r["rank"] for r in records} == set(range(stages))
        assert {r["step"] for r in records} == set(range(half, STEPS_PER_EPOCH)), \
            f"{stages} stages did not resume at step {half}"
        assert read_result(result)["start"] == half
        check_same_batch_on_every_stage(records)

        losses = losses_by_step(records)
        for step in range(half, STEPS_PER_EPOCH):
            [loss] = losses[step]
            expected = reference["loss"][step]
            assert abs(loss - expected) <= LOSS_RTOL * abs(expected), \
                (stages, step, loss, expected)

        samples = first_samples + [s for r in records if r["rank"] == 0 for s in r["samples"]]
        assert len(samples) == NUM_SAMPLES and sorted(samples) == list(range(NUM_SAMPLES)), \
            f"with {stages} stages some sample was skipped or repeated across the change"
