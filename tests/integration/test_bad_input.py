"""Bad input gets a clear one-line error, a documented exit code, and loses nothing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from elastic.errors import EXIT_BAD_INPUT, EXIT_STORE
from elastic.keyspace import JobKeys
from tests.integration.procs import REPO, MemberProcess
from tests.waiting import LOADED_SLACK_S

pytestmark = pytest.mark.integration


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_unreachable_etcd_is_named_within_the_connect_timeout():
    started = time.monotonic()
    out = run("-m", "agent.ctl", "status", "--etcd", "http://127.0.0.1:1", "--job-id", "j",
              "--connect-timeout", "2")
    elapsed = time.monotonic() - started
    assert out.returncode == EXIT_STORE
    assert "127.0.0.1:1" in out.stderr and "within 2.0 s" in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert elapsed < 2.0 + 3.0 + LOADED_SLACK_S  # the timeout plus interpreter start-up


def test_silent_etcd_times_out_at_the_connect_timeout():
    # A loopback socket that accepts connections but never speaks: the client
    # must give up at its connect timeout instead of hanging.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = "http://127.0.0.1:%d" % silent.getsockname()[1]
        started = time.monotonic()
        out = run("-m", "agent.member", "--etcd", endpoint, "--job-id", "j", "--nnodes", "1",
                  "--connect-timeout", "1")
    assert out.returncode == EXIT_STORE
    assert endpoint.split("//")[1] in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - started < 1.0 + 3.0 + LOADED_SLACK_S


@pytest.mark.parametrize("nnodes,needle", [
    ("3:2", "MIN (3) must not be greater than MAX (2)"),
    ("0", "at least 1"),
    ("two", "expected a node count"),
])
def test_bad_nnodes_is_refused(nnodes, needle):
    out = run("-m", "agent.member", "--etcd", "http://127.0.0.1:1", "--job-id", "j",
              "--nnodes", nnodes)
    assert out.returncode == EXIT_BAD_INPUT
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_bad_ids_are_refused(etcd_endpoint):
    out = run("-m", "agent.ctl", "status", "--etcd", etcd_endpoint, "--job-id", "../etc")
    assert out.returncode == EXIT_BAD_INPUT
    assert "invalid job id '../etc'" in out.stderr


def test_garbage_under_the_job_is_reported_with_its_key_and_nodes_carry_on(
        etcd_endpoint, etcd_store, job_id):
    keys = JobKeys(job_id)
    etcd_store.put(keys.round, b"{not json")
    etcd_store.put(keys.node("bogus"), b"\xff\xfe")
    etcd_store.put(keys.restart_requests + "junk", b"[1, 2]")
    a = MemberProcess(etcd_endpoint, job_id, "a", "2")
    a.wait_for(lambda o: o.get("event") == "registered")
    b = MemberProcess(etcd_endpoint, job_id, "b", "2")
    try:
        # The garbage round is replaced by a real one on top of it.
        for p in (a, b):
            r = p.wait_round(["a", "b"])
        assert r["number"] == 2  # version 1 was the garbage
        status = run("-m", "agent.ctl", "status", "--etcd", etcd_endpoint, "--job-id", job_id,
                     "--json")
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["round"]["members"] == ["a", "b"]
        assert any(keys.node("bogus") in p for p in data["problems"])
        # Whoever leads logged the bad node record once, naming the key, and kept going.
        logs = "".join(a.stderr + b.stderr)
        assert logs.count(f"malformed record at key '{keys.node('bogus')}'") == 1
        assert a.proc.poll() is None and b.proc.poll() is None
    finally:
        a.stop()
        b.stop()


def test_duplicate_node_id_is_refused_while_the_first_lives(etcd_endpoint, job_id):
    # The second waits (an agent restarted by systemd would find its old
    # lease gone by then), and is refused when the first stays alive.
    first = MemberProcess(etcd_endpoint, job_id, "same", "1")
    try:
        first.wait_for(lambda o: o.get("event") == "registered")
        out = run("-m", "agent.member", "--etcd", etcd_endpoint, "--job-id", job_id,
                  "--nnodes", "1", "--node-id", "same", "--join-timeout", "2")
        assert out.returncode == 4
        assert "node id 'same' is already registered by a live agent" in out.stderr
        assert first.proc.poll() is None
    finally:
        first.stop()


def test_drain_of_an_unregistered_node_is_refused_and_writes_nothing(
        etcd_endpoint, etcd_store, job_id):
    keys = JobKeys(job_id)
    etcd_store.put(keys.node("a"), b"{}")
    etcd_store.put(keys.node("b"), b"{}")

    out = run("-m", "agent.ctl", "drain", "c", "--etcd", etcd_endpoint, "--job-id", job_id)

    assert out.returncode == EXIT_BAD_INPUT
    assert out.stderr.strip().splitlines() == [
        f"elasticctl: error: node 'c' is not registered in job {job_id} "
        "(registered: a, b); nothing to drain"]
    assert etcd_store.get(keys.drain_request("c")) is None
    assert etcd_store.get_prefix(keys.drain_requests)[0] == []

    # A registered node is still drained.
    ok = run("-m", "agent.ctl", "drain", "b", "--etcd", etcd_endpoint, "--job-id", job_id)
    assert ok.returncode == 0, ok.stderr
    assert etcd_store.get(keys.drain_request("b")) is not None


@pytest.mark.parametrize("make, needle", [
    (lambda tmp: (tmp / "real").mkdir() or (tmp / "state").symlink_to(tmp / "real"),
     "is a symbolic link"),
    (lambda tmp: (tmp / "state").write_text("not a directory"), "is not a directory"),
])
def test_a_state_dir_that_is_not_a_private_directory_is_refused(etcd_endpoint, job_id, tmp_path,
                                                                 make, needle):
    make(tmp_path)
    (tmp_path / "train.py").write_text("")
    out = run("-m", "agent.daemon", "--etcd", etcd_endpoint, "--job-id", job_id, "--nnodes", "1",
              "--advertise-addr", "127.0.0.1", "--listen", "127.0.0.1:0", "--state-dir",
              str(tmp_path / "state"), str(tmp_path / "train.py"))
    assert out.returncode == EXIT_BAD_INPUT, out.stderr
    assert needle in out.stderr and str(tmp_path / "state") in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "real" / job_id).exists()
