"""elasticd end to end: real agents, real DDP workers (gloo), a real etcd, real kills."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from agent import peers
from elastic import worker_env
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import DrainRequest, NodeInfo, Round
from elastic.rendezvous.round_record import read_round
from tests.integration.procs import REPO, AgentProcess, read_progress, wait_progress
from tests.proctable import alive
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
def agents(etcd_endpoint, job_id):
    started: list[AgentProcess] = []

    def start(node_id: str, script_args: list[str], nnodes: str = "2", **kw) -> AgentProcess:
        a = AgentProcess(etcd_endpoint, job_id, node_id, nnodes, script_args, **kw)
        started.append(a)
        return a

    yield start
    for a in started:
        a.stop()
        # Shown with a failing test's report ("Captured stdout teardown").
        print(f"--- agent {a.node_id}: last lines of its output ---\n" + "".join(a.output[-60:]))


def final_round(store, job_id) -> Round:
    return read_round(store, JobKeys(job_id))


# For a node whose workers this test never restarts (it is killed, frozen or drained
# after its first round): a warm set would only be replaced by one nobody uses, whose
# `import torch` competes with the training the test watches.
NO_RESTART_HERE = ("--no-prestart",)


def registered_addr(store, job_id, node_id) -> str:
    """The gRPC address the agent ``node_id`` registered in etcd."""
    kv = store.get(JobKeys(job_id).node(node_id))
    return NodeInfo.from_json(kv.key, kv.value).addr


def train_args(tmp_path, steps=40, step_time=0.05, extra=()):
    progress = tmp_path / "progress.jsonl"
    return progress, ["--steps", str(steps), "--step-time", str(step_time),
                      "--progress-file", str(progress), *extra]


def two_nodes_training(agents, tmp_path):
    """Nodes a and b (b never restarts workers itself) train 60 steps on 4 workers;
    returns once they made step 3 together: the progress file, both agents, and the
    pids of b's workers."""
    progress, args = train_args(tmp_path, steps=60)
    a = agents("a", args, nnodes="1:2")
    b = agents("b", args, nnodes="1:2", extra=NO_RESTART_HERE)
    records = wait_progress(progress, lambda rs: any(r["step"] >= 3 and r["world"] == 4
                                                     for r in rs))
    return progress, a, b, {r["pid"] for r in records if r["world"] == 4 and r["rank"] >= 2}


def test_worker_sigkill_restarts_the_group_and_the_job_completes(agents, tmp_path, etcd_store,
                                                                  job_id):
    progress, args = train_args(tmp_path)
    a, b = agents("a", args), agents("b", args)
    records = wait_progress(progress, lambda rs: any(r["step"] >= 5 for r in rs))
    victim = next(r["pid"] for r in records if r["rank"] == 3)
    os.kill(victim, signal.SIGKILL)
    assert a.wait_exit(120) == 0, a.text
    assert b.wait_exit(30) == 0, b.text
    records = read_progress(progress)
    assert {r["restart"] for r in records} >= {0, 1}
    last = [r for r in records if r["restart"] >= 1]
    assert max(r["step"] for r in last) == 39 and {r["world"] for r in last} == {4}
    final = final_round(etcd_store, job_id)
    assert final.outcome == "succeeded"
    assert "killed by signal 9" in a.text + b.text
    assert f"pid {victim}" in a.text + b.text


def test_worker_sigstop_is_detected_as_a_hang(agents, tmp_path, job_id):
    progress, args = train_args(tmp_path, steps=30)
    a, b = agents("a", args, hang_timeout=3), agents("b", args, hang_timeout=3)
    records = wait_progress(progress, lambda rs: any(r["step"] >= 5 for r in rs))
    frozen = next(r["pid"] for r in records if r["rank"] == 1)
    os.kill(frozen, signal.SIGSTOP)
    try:
        assert a.wait_exit(120) == 0, a.text
        assert b.wait_exit(30) == 0
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert "sent no heartbeat" in a.text or "made no progress" in a.text + b.text
    assert not alive(frozen), "the hung worker must have been killed"
    assert any(r["restart"] >= 1 for r in read_progress(progress))


def test_agent_sigkill_survivor_reforms_alone_and_no_worker_is_left(agents, tmp_path, job_id):
    progress, a, b, b_pids = two_nodes_training(agents, tmp_path)
    b.proc.kill()  # the agent: its workers must die with it
    deadline = time.monotonic() + 3
    while any(alive(p) for p in b_pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in b_pids), "workers outlived their SIGKILLed agent"
    assert a.wait_exit(150) == 0, a.text
    after = [r for r in read_progress(progress) if r["world"] == 2]
    assert after and max(r["step"] for r in after) == 59
    # Gone by its lease, or left out earlier because its agent did not answer.
    assert "lost b" in a.text or "left out b (agent does not answer)" in a.text


def test_an_agent_restarted_at_once_starts_no_worker_for_the_round_of_its_predecessor(
        agents, tmp_path, job_id):
    # b's agent is killed and started again at once, while a's workers are stopped (so
    # they cannot see b's fail and a keeps the round): without warm workers to wait for,
    # the new agent takes over the dead one's registration and registers while the
    # round its predecessor ran still names b. That round's group is gone: b starts
    # nothing for it, only for the round formed after it registered.
    progress, a, b, _ = two_nodes_training(agents, tmp_path)
    a_pids = {r["pid"] for r in read_progress(progress) if r["world"] == 4 and r["rank"] < 2}
    for pid in a_pids:
        os.kill(pid, signal.SIGSTOP)
    b.proc.kill()
    _, args = train_args(tmp_path, steps=60)
    fresh = agents("b", args, nnodes="1:2", extra=NO_RESTART_HERE)
    registered = wait_until(lambda: re.search(r"registered \(nproc 2, host [^)]*\) after round "
                                              r"(\d+)", fresh.text), 30, "b registered again")
    for pid in a_pids:
        if alive(pid):
            os.kill(pid, signal.SIGCONT)
    after = int(registered.group(1))
    assert a.wait_exit(150) == 0, a.text
    assert fresh.wait_exit(30) == 0, fresh.text
    started = [int(n) for n in re.findall(r"round (\d+): \w+ -> STARTING", fresh.text)]
    assert started and min(started) > after, (after, started)
    assert max(r["step"] for r in read_progress(progress)) == 59


def test_a_node_whose_first_round_waits_for_its_template_is_not_taken_for_a_failed_one(
        agents, tmp_path, job_id):
    # a's template imports for 3 s, longer than the lease TTL (2 s) after which the
    # other members count a member that does not serve as failed; a's first round
    # waits for that template.
    (tmp_path / "slowpre.py").write_text("import time\ntime.sleep(3)\n")
    progress, args = train_args(tmp_path, steps=20)
    a = agents("a", args, env={worker_env.PRELOAD: "slowpre",
                               "PYTHONPATH": f"{tmp_path}:{REPO}"})
    b = agents("b", args, extra=NO_RESTART_HERE)
    assert a.wait_exit(120) == 0, a.text
    assert b.wait_exit(30) == 0, b.text
    assert "the round waited" in a.text
    assert "NOT_SERVING" not in b.text
    assert {r["restart"] for r in read_progress(progress)} == {0}


def test_frozen_node_survivor_reforms(agents, tmp_path, job_id):
    progress, a, b, b_pids = two_nodes_training(agents, tmp_path)
    frozen = [b.proc.pid, *b_pids]
    for pid in frozen:  # the whole node: agent and workers
        os.kill(pid, signal.SIGSTOP)
    try:
        assert a.wait_exit(150) == 0, a.text
    finally:
        for pid in frozen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    after = [r for r in read_progress(progress) if r["world"] == 2]
    assert after and max(r["step"] for r in after) == 59
    assert "lost b" in a.text


def test_restart_budget_spent_fails_every_agent_with_the_reason(agents, tmp_path, job_id):
    _, args = train_args(tmp_path, steps=50, extra=("--crash", "1:2", "--crash-always"))
    a = agents("a", args, extra=("--max-restarts", "1"))
    b = agents("b", args, extra=("--max-restarts", "1"))
    assert a.wait_exit(150) == 1, a.text
    assert b.wait_exit(30) == 1, b.text
    for agent in (a, b):
        assert "restart budget spent" in agent.text


def test_incompatible_settings_for_a_running_job_are_refused(agents, tmp_path, etcd_endpoint,
                                                             job_id):
    _, args = train_args(tmp_path, steps=1000)
    # Alone it never forms a round, so it never needs workers: none warm either.
    a = agents("a", args, nnodes="2", extra=("--no-prestart",))
    a.wait_output("registered with the rendezvous")
    other = subprocess.run(
        [sys.executable, "-m", "agent.daemon", "--etcd", etcd_endpoint, "--job-id", job_id,
         "--nnodes", "2:4", "examples/ddp.py"], cwd=REPO, capture_output=True, text=True,
        timeout=60)
    assert other.returncode == 2
    assert "already running with other settings" in other.stderr
    assert "max_nodes 2 (this agent: 4)" in other.stderr


@pytest.mark.parametrize("argv,code,needle", [
    (["--standalone", "--job-id", "j", "--nnodes", "1", "missing.py"], 2,
     "training script 'missing.py' not found"),
    (["--standalone", "--job-id", "j", "--nnodes", "1", "--nproc-per-node", "-2",
      "examples/ddp.py"], 2, "--nproc-per-node '-2': must be greater than 0"),
    (["--etcd", "http://127.0.0.1:1", "--job-id", "j", "--nnodes", "1", "--connect-timeout",
      "1", "examples/ddp.py"], 3, "127.0.0.1:1"),
])
def test_bad_input_is_one_clear_line(argv, code, needle):
    out = subprocess.run([sys.executable, "-m", "agent.daemon", *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out.stderr


def test_status_shows_agents_workers_and_failures(agents, tmp_path, etcd_endpoint, etcd_store,
                                                 job_id):
    progress, args = train_args(tmp_path, steps=400, extra=("--crash", "0:3"))
    a = agents("a", args, nnodes="1")
    wait_progress(progress, lambda rs: any(r["restart"] == 1 and r["step"] >= 8 for r in rs))
    # Heartbeats reach the agent a little after the steps: wait until both workers' have.
    addr = registered_addr(etcd_store, job_id, "a")
    deadline = time.monotonic() + 15
    while not ((live := peers.query_status(addr)) and len(live.workers) == 2
               and all(w.last_step >= 8 and w.step_rate > 0 for w in live.workers)):
        assert time.monotonic() < deadline, f"the workers' steps never reached a: {live}"
        time.sleep(0.1)
    out = subprocess.run([sys.executable, "-m", "agent.ctl", "status", "--json", "--etcd",
                          etcd_endpoint, "--job-id", job_id], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    [node] = data["nodes"]
    assert node["agent"]["state"] == "RUNNING"
    assert node["agent"]["restarts"] == 1
    assert "exited with 13" in node["agent"]["last_failure"]
    assert [w["state"] for w in node["agent"]["workers"]] == ["running", "running"]
    assert all(w["last_step"] >= 8 for w in node["agent"]["workers"])
    assert node["agent"]["step_rate"] > 0
    events = subprocess.run([sys.executable, "-m", "agent.ctl", "events", "--etcd",
                             etcd_endpoint, "--job-id", job_id], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert "RUNNING -> STOPPING: worker rank 0" in events.stdout
    a.stop()


def test_a_node_joining_mid_run_is_included_and_a_drained_node_leaves_the_job_going_on(
        agents, tmp_path, etcd_endpoint, job_id):
    # One job, two membership changes (each once a test of its own, which paid for a
    # second pair of agents and their workers' `import torch`): b joins a running job,
    # then is drained out of it.
    progress, args = train_args(tmp_path, steps=80)
    a = agents("a", args, nnodes="1:2")
    wait_progress(progress, lambda rs: any(r["step"] >= 3 and r["world"] == 2 for r in rs))
    b = agents("b", args, nnodes="1:2", extra=NO_RESTART_HERE)
    wait_progress(progress, lambda rs: any(r["step"] >= 3 and r["world"] == 4 for r in rs))
    assert "joined b" in a.text

    out = subprocess.run([sys.executable, "-m", "agent.ctl", "drain", "b", "--json", "--etcd",
                          etcd_endpoint, "--job-id", job_id], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"requested": "drain", "node_id": "b"}
    assert b.wait_exit(60) == 0, b.text
    assert "DRAINING" in b.text
    assert a.wait_exit(150) == 0, a.text
    assert "drained b" in a.text
    records = read_progress(progress)
    drained_at = max(r["t"] for r in records if r["world"] == 4)
    after = [r for r in records if r["world"] == 2 and r["t"] > drained_at]
    assert after and max(r["step"] for r in after) == 79


def test_a_drain_request_left_by_a_killed_agent_does_not_drain_the_next_agent_of_its_node(
        agents, tmp_path, etcd_store, job_id):
    # Node a's previous agent announced its drain (SIGTERM) and was killed before it
    # could leave and remove the request: the agent started next on a trains.
    keys = JobKeys(job_id)
    etcd_store.put(keys.drain_request("a"), DrainRequest(by="a", reason="SIGTERM").to_json())
    progress, args = train_args(tmp_path, steps=10)
    a = agents("a", args, nnodes="1", extra=NO_RESTART_HERE)
    assert a.wait_exit(90) == 0, a.text
    assert "DRAINING" not in a.text
    assert max(r["step"] for r in read_progress(progress)) == 9
    assert etcd_store.get(keys.drain_request("a")) is None


def test_operator_restart_is_not_a_failure(agents, tmp_path, etcd_endpoint, etcd_store, job_id):
    progress, args = train_args(tmp_path, steps=60)
    a = agents("a", args, nnodes="1", extra=("--max-restarts", "0"))
    wait_progress(progress, lambda rs: any(r["step"] >= 3 for r in rs))
    out = subprocess.run([sys.executable, "-m", "agent.ctl", "restart", "--reason", "new data",
                          "--etcd", etcd_endpoint, "--job-id", job_id], cwd=REPO,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert a.wait_exit(150) == 0, a.text  # with a budget of 0, a counted failure would end it
    assert "restart requested by elasticctl: new data" in a.text
    assert any(r["restart"] == 1 for r in read_progress(progress))
    assert final_round(etcd_store, job_id).failures == ()
