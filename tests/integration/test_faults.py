"""Regression tests for DESIGN.md's failure table, with real agents, a real etcd and real faults.

Every test starts real ``elasticd`` processes (one worker each, no torch: the
workers are ``scripts/progress_worker.py``, which appends timestamped progress
lines to a file per process), injects one fault (SIGKILL of an agent, a
straggling worker, a TCP proxy cut between an agent and etcd) and asserts
what the "what must happen" column promises. Waits poll with generous
deadlines and fail early, with the agents' output, when an agent exits
unexpectedly. Every process a test starts carries ``FAULTS_TEST_TAG=<tag>``
in its environment (workers inherit it), so teardown finds and kills all of
them, whatever state the test left them in.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from elastic.keyspace import JobKeys
from elastic.rendezvous.api import Outcome
from elastic.rendezvous.round_record import read_round
from tests.integration.procs import REPO
from tests.proctable import alive, pids_with_env
from tests.integration.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.integration]

SCRIPT = os.path.join(REPO, "tests", "integration", "scripts", "progress_worker.py")
TAG_ENV = "FAULTS_TEST_TAG"
LEASE_TTL = 3.0
WRITE_TOLERANCE_S = 0.25  # a worker's file write vs. the moment it is stopped


# ------------------------------------------------------------------ processes


class Agent:
    """One ``elasticd`` with one worker; stdout and stderr collected separately."""

    def __init__(self, etcd: str, job_id: str, node_id: str, nnodes: str,
                 script_args: list[str], *, tag: str, log_dir: str, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        self.node_id = node_id
        cmd = [sys.executable, "-m", "agent.daemon", "--etcd", etcd, "--job-id", job_id,
               "--node-id", node_id, "--nnodes", nnodes, "--nproc-per-node", "1",
               "--lease-ttl", f"{LEASE_TTL:g}", "--hang-timeout", "0", "--settle", "0.3",
               "--stop-grace", "1", "--no-prestart", "--advertise-addr", "127.0.0.1",
               "--listen", "127.0.0.1:0", "--log-dir", log_dir, *extra, SCRIPT, *script_args]
        base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, TAG_ENV: tag, **(env or {})})
        self.started_at = time.time()
        self.exited_at: float | None = None  # wall time the exit was first observed
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, e), daemon=True)
                         for s, e in ((self.proc.stdout, False), (self.proc.stderr, True))]
        for t in self._readers:
            t.start()

    def _read(self, stream, is_err: bool) -> None:
        for line in stream:
            self.lines.append(line)
            if is_err:
                self.stderr.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def tail(self, n: int = 30) -> str:
        return f"--- {self.node_id} (pid {self.proc.pid}) output tail:\n" + "".join(self.lines[-n:])

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code

    def wait_exit(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.node_id} did not exit within {timeout_s:g} s\n"
                                     + self.tail())
            time.sleep(0.05)
        for t in self._readers:
            t.join(timeout=5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.poll()


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries ``FAULTS_TEST_TAG=<tag>``."""
    return pids_with_env(f"{TAG_ENV}={tag}")


class Cluster:
    """The agents, proxies and files of one test; ``teardown`` ends all of them."""

    def __init__(self, etcd_endpoint: str, job_id: str, tmp_path):
        self.etcd = etcd_endpoint
        self.job_id = job_id
        self.keys = JobKeys(job_id)
        self.tmp = tmp_path
        self.tag = f"{job_id}-{uuid.uuid4().hex[:6]}"
        self.progress_dir = tmp_path / "progress"
        self.progress_dir.mkdir()
        self.agents: list[Agent] = []
        self.proxies: list[TcpProxy] = []

    def start(self, node_id: str, nnodes: str, *, work_s: float = 60.0, final: str | None = None,
              hold: str | None = None, etcd: str | None = None, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> Agent:
        args = ["--progress-dir", str(self.progress_dir), "--work-s", f"{work_s:g}"]
        if final:
            args += ["--final", final]
        if hold:
            args += ["--hold-file", hold]
        log_dir = str(self.tmp / "logs" / node_id)
        agent = Agent(etcd or self.etcd, self.job_id, node_id, nnodes, args, tag=self.tag,
                      log_dir=log_dir, extra=extra, env=env)
        self.agents.append(agent)
        return agent

    def proxy(self) -> TcpProxy:
        p = TcpProxy.for_url(self.etcd.split(",")[0])
        self.proxies.append(p)
        return p

    def records(self) -> list[dict]:
        """Every progress line of every worker so far, in time order."""
        out = []
        for path in self.progress_dir.glob("*.jsonl"):
            with open(path) as f:
                for line in f:
                    if line.endswith("\n"):  # a line being written is not read half
                        out.append(json.loads(line))
        return sorted(out, key=lambda r: r["t"])

    def tails(self) -> str:
        return "\n".join(a.tail() for a in self.agents)

    def wait_until(self, predicate, timeout_s: float, what: str, *, running=()):
        """Poll ``predicate`` until it returns something truthy and return that.

        Fails at once, with the agents' output, if an agent in ``running``
        exits meanwhile, and after ``timeout_s`` otherwise.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            for a in running:
                code = a.poll()
                if code is not None:
                    raise AssertionError(f"while waiting for {what}: agent {a.node_id} exited "
                                         f"with code {code}\n{self.tails()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:g} s\n{self.tails()}")
            time.sleep(0.1)

    def teardown(self) -> list[int]:
        """Kill every agent, proxy and tagged process; return the pids that had
        to be killed after the agents were gone (leaked workers)."""
        for a in self.agents:
            a.kill()
        for p in self.proxies:
            p.close()
        deadline = time.monotonic() + 5  # PDEATHSIG is asynchronous
        leaked = tagged_pids(self.tag)
        while leaked and time.monotonic() < deadline:
            time.sleep(0.1)
            leaked = tagged_pids(self.tag)
        for pid in leaked:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return leaked


@pytest.fixture
def cluster(etcd_endpoint, job_id, tmp_path):
    c = Cluster(etcd_endpoint, job_id, tmp_path)
    try:
        yield c
    finally:
        leaked = c.teardown()
        deadline = time.monotonic() + 5
        while tagged_pids(c.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tagged_pids(c.tag)
        assert not left, f"processes of this test survived teardown: {left}"
        if leaked:
            print(f"teardown killed processes left behind 5 s after their agents: {leaked}")


def round_version(store, keys: JobKeys) -> int:
    kv = store.get(keys.round)
    return kv.version if kv else 0


def status_state(store, keys: JobKeys, node_id: str) -> str | None:
    kv = store.get(keys.status_of(node_id))
    return json.loads(kv.value).get("state") if kv else None


def workers_of(records: list[dict], node: str) -> dict[int, list[dict]]:
    """A node's progress lines by worker pid."""
    out: dict[int, list[dict]] = {}
    for r in records:
        if r["node"] == node:
            out.setdefault(r["pid"], []).append(r)
    return out


# ------------------------------------------- 1. agent restarted with its node id


@pytest.mark.timeout(90)
def test_agent_restarted_with_the_same_node_id_takes_its_place_back(cluster, etcd_store,
                                                                   tmp_path):
    hold = tmp_path / "hold"  # no worker finishes before the new round has formed
    hold.touch()
    a = cluster.start("node-a", "2", work_s=6, hold=str(hold))
    b = cluster.start("node-b", "2", work_s=6, hold=str(hold))
    first = cluster.wait_until(
        lambda: [r for r in cluster.records() if r["step"] >= 1]
        if {r["node"] for r in cluster.records() if r["step"] >= 1} == {"node-a", "node-b"}
        else None, 30, "both nodes' workers to make a step", running=(a, b))
    r0 = max(r["round"] for r in first)
    old_a_worker = next(r["pid"] for r in first if r["node"] == "node-a")

    a.kill()  # SIGKILL, as a crash would: its worker dies with it (PDEATHSIG)
    cluster.wait_until(lambda: not alive(old_a_worker), 5,
                       f"node-a's worker pid {old_a_worker} to die with its SIGKILLed agent")
    time.sleep(1.0)  # systemd's RestartSec
    a2 = cluster.start("node-a", "2", work_s=6, hold=str(hold))  # same --node-id and address

    new = cluster.wait_until(
        lambda: [r for r in cluster.records() if r["node"] == "node-a" and r["round"] > r0],
        30, f"the restarted node-a's worker to run in a round after {r0} (the restarted "
        "agent must take its place back, not be refused as a duplicate)", running=(a2, b))
    new_round = new[0]["round"]
    assert new[0]["pid"] != old_a_worker
    hold.unlink()  # from now on every worker ends 6 s after its start
    assert a2.wait_exit(30) == 0, a2.tail()
    assert b.wait_exit(15) == 0, "the survivor must end with the job\n" + b.tail()

    records = cluster.records()
    together = ({r["round"] for r in records if r["node"] == "node-a" and r["round"] > r0}
                & {r["round"] for r in records if r["node"] == "node-b" and r["round"] > r0})
    assert together, (f"a round after {r0} must hold both nodes, but node-b ran no worker in "
                      f"node-a's round {new_round}\n{cluster.tails()}")
    assert read_round(etcd_store, cluster.keys).outcome is Outcome.SUCCEEDED


# ----------------------------------------------------------- 2. exit barrier


@pytest.mark.timeout(90)
def test_job_end_waits_for_a_straggling_node_and_never_kills_it(cluster, tmp_path):
    final_file = tmp_path / "final-model.json"
    a = cluster.start("node-a", "2", work_s=1)
    b = cluster.start("node-b", "2", work_s=6, final=str(final_file))
    cluster.wait_until(
        lambda: [r for r in cluster.records() if r["node"] == "node-a" and r["step"] >= 10],
        30, "node-a's worker to finish its short work", running=(a, b))
    b_pid = cluster.wait_until(
        lambda: next((r["pid"] for r in cluster.records() if r["node"] == "node-b"), None),
        10, "node-b's worker to start", running=(a, b))

    # Neither agent may end the job while node-b's worker is still working.
    while True:
        ended = [x for x in (a, b) if x.poll() is not None]
        if ended and not final_file.exists():
            now = "is still running" if alive(b_pid) else "is gone"
            raise AssertionError(
                f"{ended[0].node_id} exited with {ended[0].proc.returncode} while node-b's "
                f"worker (pid {b_pid}) had not written its final model yet (the worker "
                f"{now})\n{cluster.tails()}")
        if len(ended) == 2:
            break
        if time.time() - a.started_at > 45:
            raise AssertionError(f"the job did not end within 45 s\n{cluster.tails()}")
        time.sleep(0.05)

    done = json.loads(final_file.read_text())
    assert a.exited_at >= done["t"] and b.exited_at >= done["t"]
    assert a.wait_exit(5) == 0, a.tail()
    assert b.wait_exit(5) == 0, b.tail()
    assert f"pid {b_pid}) exited with code 0" in b.text, (
        f"node-b's agent must report its worker pid {b_pid} as exited 0\n{b.tail()}")
    rank_logs = list((tmp_path / "logs" / "node-b").glob("round-*/rank-*.log"))
    assert any(f"pid {b_pid}: done" in p.read_text() for p in rank_logs), rank_logs


@pytest.mark.timeout(90)
def test_straggler_past_the_exit_barrier_timeout_fails_the_job_and_is_stopped(cluster):
    # ELASTIC_EXIT_BARRIER_TIMEOUT is --exit-barrier-timeout's variable (agent/config.py
    # derives it from the option's name); through the environment the scenario also runs,
    # and fails by its assertions, on an agent that does not know the option yet.
    barrier = {"ELASTIC_EXIT_BARRIER_TIMEOUT": "3"}
    a = cluster.start("node-a", "2", work_s=1, env=barrier)
    b = cluster.start("node-b", "2", work_s=60, env=barrier)
    cluster.wait_until(
        lambda: [r for r in cluster.records() if r["node"] == "node-a" and r["step"] >= 10],
        30, "node-a's worker to finish its short work", running=(a, b))
    b_pid = next(r["pid"] for r in cluster.records() if r["node"] == "node-b")

    assert a.wait_exit(20) == 1, "past the exit barrier the job fails\n" + a.tail()
    assert b.wait_exit(10) == 1, "past the exit barrier the job fails\n" + b.tail()
    for agent in (a, b):
        failed = [line for line in agent.stderr if "failed:" in line and "elasticd: job" in line]
        assert failed, f"{agent.node_id} printed no failure reason on stderr\n{agent.tail()}"
        assert "node-b" in failed[-1] and "exit barrier" in failed[-1].lower(), (
            f"{agent.node_id}'s failure reason must name the straggler node-b and the exit "
            f"barrier: {failed[-1]!r}")
    cluster.wait_until(lambda: not alive(b_pid), 5,
                       f"node-b's straggling worker pid {b_pid} to be stopped")


# ------------------------------------------------------------- 3. partitions


@pytest.mark.timeout(120)
def test_nodes_cut_off_from_etcd_stop_their_workers_before_a_standby_takes_over(
        cluster, etcd_store):
    proxies = {n: cluster.proxy() for n in ("node-a", "node-b", "node-c")}
    a = cluster.start("node-a", "1:2", etcd=proxies["node-a"].endpoint)
    b = cluster.start("node-b", "1:2", etcd=proxies["node-b"].endpoint)
    first = cluster.wait_until(
        lambda: [r for r in cluster.records() if r["step"] >= 1]
        if {r["node"] for r in cluster.records() if r["step"] >= 1} == {"node-a", "node-b"}
        else None, 30, "node-a and node-b to train together", running=(a, b))
    r1 = max(r["round"] for r in first)
    c = cluster.start("node-c", "1:2", etcd=proxies["node-c"].endpoint)
    cluster.wait_until(lambda: status_state(etcd_store, cluster.keys, "node-c") == "STANDBY",
                       20, "node-c to wait as a standby", running=(a, b, c))
    ab_pids = {pid for node in ("node-a", "node-b")
               for pid in workers_of(cluster.records(), node)}

    cut_at = time.time()
    proxies["node-a"].cut()  # a and b lose etcd; they still reach each other and c
    proxies["node-b"].cut()

    c_records = cluster.wait_until(
        lambda: [r for r in cluster.records() if r["node"] == "node-c"], 30,
        "node-c to form a round alone and train", running=(c,))
    cluster.wait_until(lambda: not any(alive(p) for p in ab_pids), 5,
                       f"the workers of node-a and node-b (pids {sorted(ab_pids)}) to stop: "
                       f"node-c trains in round {c_records[0]['round']} since "
                       f"{c_records[0]['t'] - cut_at:.1f} s after the cut (zombie group)")
    records = cluster.records()
    ab_last = max(r["t"] for r in records if r["node"] in ("node-a", "node-b"))
    c_first = min(r["t"] for r in records if r["node"] == "node-c")
    assert ab_last <= c_first + WRITE_TOLERANCE_S, (
        f"node-a/node-b trained until {ab_last - cut_at:.2f} s after the cut, node-c from "
        f"{c_first - cut_at:.2f} s: two groups trained at the same time\n{cluster.tails()}")
    assert ab_last <= cut_at + LEASE_TTL + WRITE_TOLERANCE_S, (
        f"node-a/node-b trained until {ab_last - cut_at:.2f} s after the cut: past the "
        f"lease TTL ({LEASE_TTL:g} s), when etcd may already have expired their leases")
    assert all(r["round"] > r1 for r in c_records)

    proxies["node-a"].restore()
    proxies["node-b"].restore()
    for node, agent in (("node-a", a), ("node-b", b)):
        cluster.wait_until(
            lambda n=node: etcd_store.get(cluster.keys.node(n)) is not None
            and status_state(etcd_store, cluster.keys, n) in ("STANDBY", "RUNNING"),
            25, f"{node} to register again (as a standby or in a new round) after the restore",
            running=(a, b, c))
    for agent in (a, b, c):
        assert agent.poll() is None, agent.tail()
        assert "Traceback" not in agent.text, agent.tail()


@pytest.mark.timeout(120)
def test_etcd_gone_for_everyone_training_goes_on_and_the_round_is_kept(cluster, etcd_store):
    proxies = {n: cluster.proxy() for n in ("node-a", "node-b")}
    a = cluster.start("node-a", "2", etcd=proxies["node-a"].endpoint)
    b = cluster.start("node-b", "2", etcd=proxies["node-b"].endpoint)
    cluster.wait_until(
        lambda: {r["node"] for r in cluster.records() if r["step"] >= 1} == {"node-a", "node-b"},
        30, "node-a and node-b to train together", running=(a, b))
    pids = {node: set(workers_of(cluster.records(), node)) for node in ("node-a", "node-b")}
    version = round_version(etcd_store, cluster.keys)

    cut_at = time.time()
    for p in proxies.values():
        p.cut()
    while time.time() < cut_at + 2 * LEASE_TTL:  # the outage: twice the lease TTL
        for agent in (a, b):
            assert agent.poll() is None, f"an etcd outage must not end an agent\n{agent.tail()}"
        time.sleep(0.1)
    records = cluster.records()
    for node, node_pids in pids.items():
        assert set(workers_of(records, node)) == node_pids, (
            f"{node}'s workers changed during the outage\n{cluster.tails()}")
        assert all(alive(p) for p in node_pids), f"{node}'s worker died during the outage"
        last = max(r["t"] for r in records if r["node"] == node)
        assert last >= cut_at + 2 * LEASE_TTL - 1.0, (
            f"{node} stopped making progress {last - cut_at:.1f} s into the outage")

    restored_at = time.time()
    for p in proxies.values():
        p.restore()
    for node in pids:
        cluster.wait_until(lambda n=node: etcd_store.get(cluster.keys.node(n)) is not None, 20,
                           f"{node} to be registered again after etcd is back",
                           running=(a, b))
    settle_until = time.time() + LEASE_TTL  # give a late restart the time to show
    while time.time() < settle_until:
        time.sleep(0.1)
    records = cluster.records()
    for node, node_pids in pids.items():
        assert set(workers_of(records, node)) == node_pids and all(alive(p) for p in node_pids), (
            f"{node}'s workers were restarted after the outage\n{cluster.tails()}")
        last = max(r["t"] for r in records if r["node"] == node)
        assert last > restored_at, f"{node} made no progress after etcd came back"
    assert round_version(etcd_store, cluster.keys) == version, (
        f"the round moved from {version} to {round_version(etcd_store, cluster.keys)} "
        f"because of an etcd outage\n{cluster.tails()}")
    for agent in (a, b):
        assert agent.poll() is None and "Traceback" not in agent.text, agent.tail()
