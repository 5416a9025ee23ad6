"""The memory tier's agent side end to end: real agents, a real etcd, workers that
stage snapshots (tests/integration/scripts/memory_worker.py, or examples/ddp.py
where the snapshots' steps matter), real SIGKILLs.

Each node's snapshots reach its buddy byte for byte; ``elasticctl status``
shows the tier; the node's memory directory is freed when the agent exits,
and when it is SIGKILLed (by its reaper, which does not outlive it); a planned
stop waits for the next snapshot, so a scale-up redoes no step."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest

from agent import status as status_view
from agent.memory_tier import user_base
from agent.status_record import human_bytes
from elastic.checkpoint.memory import layout
from elastic.keyspace import JobKeys
from elastic.rendezvous.round_record import read_round
from tests.integration.procs import AgentProcess, wait_progress
from tests.proctable import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = "tests/integration/scripts/memory_worker.py"
MEMORY = ("--memory-tier", "--no-prestart")
STEPS = 4
SLOT_BYTES = 3 << 20  # several chunks of the Replicate RPC


@pytest.fixture
def agents(etcd_endpoint, job_id):
    started: list[AgentProcess] = []

    def start(node_id: str, nnodes: str = "2", extra: tuple[str, ...] = ()) -> AgentProcess:
        a = AgentProcess(etcd_endpoint, job_id, node_id, nnodes,
                         ["--steps", str(STEPS), "--bytes", str(SLOT_BYTES)], nproc=2,
                         script=SCRIPT, extra=MEMORY + extra)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()
        print(f"--- agent {a.node_id}: last lines of its output ---\n" + "".join(a.output[-40:]))
    # A SIGKILLed agent's reaper frees its node's directory, not the job's: leave
    # /dev/shm as the test found it.
    shutil.rmtree(os.path.join(user_base("/dev/shm"), job_id), ignore_errors=True)


def node_dir(job_id: str, node_id: str) -> str:
    return os.path.join(user_base("/dev/shm"), job_id, node_id)


def reaper_pid(agent: AgentProcess) -> int:
    agent.wait_output("reaper pid")
    return int(re.search(r"reaper pid (\d+)", agent.text).group(1))


def wait_until(predicate, timeout_s: float, what: str, seen=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what} {seen()}")
        time.sleep(0.05)


def newest_steps(directory: str) -> dict[int, int]:
    """The newest complete step of each rank among the slots in ``directory``."""
    steps: dict[int, int] = {}
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        info = layout.read_slot(os.path.join(directory, name))
        if info is not None:
            steps[info.key.rank] = max(steps.get(info.key.rank, -1), info.manifest.step)
    return steps


def test_each_node_replicates_to_its_buddy_byte_for_byte_and_frees_on_exit(
        agents, etcd_store, job_id):
    a, b = agents("a", extra=("--rack", "r1")), agents("b", extra=("--rack", "r2"))
    a_dir, b_dir = node_dir(job_id, "a"), node_dir(job_id, "b")
    reapers = [reaper_pid(a), reaper_pid(b)]
    # a's replicas lie on b, b's on a (two members: each is the other's buddy).
    a_on_b = os.path.join(b_dir, layout.REPLICAS, "a")
    b_on_a = os.path.join(a_dir, layout.REPLICAS, "b")
    wait_until(lambda: len(newest_steps(a_on_b)) == 2 and len(newest_steps(b_on_a)) == 2
               and set(newest_steps(a_on_b).values()) == {STEPS - 1}
               and set(newest_steps(b_on_a).values()) == {STEPS - 1}, 30,
               "both nodes' newest snapshots replicated")
    for own, replica in ((a_dir, a_on_b), (b_dir, b_on_a)):
        compared = 0
        for name in os.listdir(replica):
            copy = layout.read_slot(os.path.join(replica, name))
            source = layout.read_slot(os.path.join(own, layout.OWN, name))
            if copy is None or source is None or copy.manifest.step != source.manifest.step:
                continue  # being written again, or written since: replication skips to the newest
            compared += 1
            for file in (layout.DATA, layout.LOCAL, layout.MANIFEST):
                with open(os.path.join(own, layout.OWN, name, file), "rb") as f:
                    original = f.read()
                with open(os.path.join(replica, name, file), "rb") as f:
                    assert f.read() == original, f"{replica}/{name}/{file} differs"
        assert compared >= 2  # at least each rank's newest snapshot

    def memory_line() -> str:
        text = status_view.render(status_view.collect(etcd_store, job_id))
        return next((x for x in text.splitlines() if x.startswith("memory tier a:")), "")

    def replicas_held() -> str:
        """What a holds of b, as its status should show it: one or both slots of
        each rank (a snapshot the worker overwrote before it was sent is skipped),
        3 MiB (and a few bytes) each; a slot being written (unreadable) is not held."""
        slots = (layout.read_slot(os.path.join(b_on_a, name)) for name in os.listdir(b_on_a))
        held = [slot for slot in slots if slot is not None]
        return (f"replicas {human_bytes(sum(i.manifest.nbytes for i in held))} in {len(held)} "
                "slots of b")

    # Read again at each look: the newest snapshot may still be on its way to a.
    wait_until(lambda: replicas_held() in memory_line(), 10, "the replicas held in the status",
               memory_line)
    line = memory_line()
    assert f"own 12.0 MiB in 4 slots (newest step {STEPS - 1})" in line
    assert f"buddy b has step {STEPS - 1} (lag 0" in line
    assert "needs up to 24.0 MiB" in line  # twice 2 x 3 MiB, own and replicated
    # where the nodes sit reaches the round
    assert {m.node_id: m.rack for m in read_round(etcd_store, JobKeys(job_id)).members} \
        == {"a": "r1", "b": "r2"}

    a.proc.send_signal(signal.SIGTERM)
    b.proc.send_signal(signal.SIGTERM)
    a.wait_exit(30), b.wait_exit(30)
    assert not os.path.exists(os.path.dirname(a_dir))  # the job's directory too, once empty
    assert not any(alive(p) for p in reapers), "a reaper outlived its agent's normal exit"


def test_a_sigkilled_agent_leaves_no_memory_behind(agents, job_id):
    a = agents("a", nnodes="1")
    a_dir = node_dir(job_id, "a")
    reaper = reaper_pid(a)
    wait_until(lambda: newest_steps(os.path.join(a_dir, layout.OWN)), 30,
               "a worker's first snapshot")
    with open(os.path.join(a_dir, layout.OWN, "stray"), "wb") as f:
        f.write(b"x" * 4096)

    a.proc.kill()
    wait_until(lambda: not os.path.exists(a_dir), 2.0, "the SIGKILLed agent's memory freed")
    wait_until(lambda: not alive(reaper), 2.0, "the reaper gone after freeing it")
    assert not os.path.exists(os.path.dirname(a_dir)), "the job's directory too, once empty"


def rounds_in(directory: str) -> set[int]:
    """The rounds of the slot directories (complete or not) in ``directory``."""
    names = os.listdir(directory) if os.path.isdir(directory) else ()
    return {key.round for key in map(layout.parse_slot_name, names) if key is not None}


def test_a_new_round_frees_the_old_rounds_snapshots_own_and_replicated(
        agents, etcd_store, job_id):
    a, b = agents("a"), agents("b")
    a_dir, b_dir = node_dir(job_id, "a"), node_dir(job_id, "b")
    places = [os.path.join(a_dir, layout.OWN), os.path.join(b_dir, layout.OWN),
              os.path.join(a_dir, layout.REPLICAS, "b"), os.path.join(b_dir, layout.REPLICAS, "a")]
    wait_until(lambda: all(newest_steps(p) for p in places), 30, "round 1 staged and replicated")
    first = max(rounds_in(places[0]))

    a_node = next(n for n in status_view.collect(etcd_store, job_id)["nodes"]
                  if n["node_id"] == "a")
    os.kill(a_node["agent"]["workers"][0]["pid"], signal.SIGKILL)  # a new round follows

    # Once every worker of a node staged in the new round, the old round is gone there.
    wait_until(lambda: all(rounds_in(p) and min(rounds_in(p)) > first for p in places), 30,
               "the old round's slots freed on both nodes", lambda: [rounds_in(p) for p in places])


@pytest.mark.timeout(300)
def test_a_scale_up_stops_the_workers_after_a_snapshot_so_no_step_is_redone(
        etcd_endpoint, job_id, tmp_path):
    # A snapshot every 3 steps: a stop at a random moment would redo up to 2.
    progress = str(tmp_path / "progress.jsonl")
    script_args = ["--steps", "100000", "--step-time", "0.1", "--memory-every", "3",
                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--ckpt-every", "100000",
                   "--progress-file", progress]
    started = []
    try:
        started.append(AgentProcess(etcd_endpoint, job_id, "a", "1:2", script_args, nproc=1,
                                    extra=MEMORY))
        # Past the tier's first 10 steps (a snapshot at each, to time them), so that
        # the agent knows the pace of one every 3 steps when it stops a's worker.
        wait_progress(progress, lambda records: sum(r["world"] == 1 for r in records) >= 25)

        started.append(AgentProcess(etcd_endpoint, job_id, "b", "1:2", script_args, nproc=1,
                                    extra=MEMORY))  # a planned scale-up: a stops for it
        records = wait_progress(progress, lambda records: any(r["world"] == 2 for r in records))
    finally:
        for a in started:
            a.stop()
        shutil.rmtree(os.path.join(user_base("/dev/shm"), job_id), ignore_errors=True)

    alone = [r["step"] for r in records if r["world"] == 1]
    together = [r["step"] for r in records if r["world"] == 2]
    assert together[0] > alone[-1], (
        f"the scale-up redid steps {together[0]}..{alone[-1]}: a's workers were stopped "
        f"between snapshots\n" + "".join(started[0].output[-30:]))
