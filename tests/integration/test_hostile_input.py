"""Hostile input against a running agent: etcd keys, gRPC requests, its worker socket.

One real agent (``elasticd``, light workers from scripts/progress_worker.py)
on a real etcd serves the whole module: for each key the agent reads, garbage,
wrong types, huge values, control characters and path traversal are written
while it runs, and each time the agent must stay up and keep serving, the
job must carry on (its round, its leader), and the committed checkpoint must
stay as it was (or advance through a valid commit). Then malformed and
oversized gRPC requests to its TCP server and its worker socket must be
answered with a clear status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
UNIMPLEMENTED), with the agent still up. Nothing it logs, and nothing
elasticctl prints, may carry a raw control character.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from elastic.checkpoint.etcd_log import decode_latest
from elastic.keyspace import JobKeys
from elastic.records import MAX_RECORD_BYTES
from elastic.rendezvous.api import NodeInfo, Round
from elastic.rendezvous.round_record import read_round
from elastic.store.etcd import EtcdStore
from elastic.v1 import agent_pb2, agent_pb2_grpc
from tests.integration.procs import REPO, AgentProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NODE = "a"
SCRIPT = "tests/integration/scripts/progress_worker.py"
# What a terminal obeys or a log line hides: must never come out raw.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
HOSTILE_TEXT = "\x1b[2J\x1b[31mowned\r\nINFO forged line\u202eevil"
DEEP = b"[" * 50_000 + b"]" * 50_000
HUGE = json.dumps({"reason": "x" * (MAX_RECORD_BYTES + 100_000)}).encode()  # < etcd's 1.5 MiB


def garbage(record: dict | None = None) -> list[bytes]:
    """Values no reader may crash on: bytes, wrong JSON, deep nesting, huge, and
    ``record`` (when given) with hostile fields."""
    values = [b"\xff\xfe\x00garbage", b"", b"[]", b"null", b"{\"a\": NaN}", DEEP, HUGE]
    if record is not None:
        values.append(json.dumps(record).encode())
    return values


class Job:
    """The module's agent and what the tests need to talk to it."""

    def __init__(self, endpoint: str, job_id: str, tmp):
        self.keys = JobKeys(job_id)
        self.job_id = job_id
        self.endpoint = endpoint
        self.store = EtcdStore(endpoint)
        progress = tmp / "progress"
        progress.mkdir()
        self.state_dir = tmp / "state"
        self.agent = AgentProcess(
            endpoint, job_id, NODE, "1",
            ["--progress-dir", str(progress), "--work-s", "600", "--step-s", "0.2"],
            nproc=1, script=SCRIPT, hang_timeout=0,
            extra=("--no-prestart", "--state-dir", str(self.state_dir), "--max-restarts", "20"))
        self.socket = str(self.state_dir / job_id / NODE / "agent.sock")
        self.addr = ""
        self.committed = b""

    def close(self) -> None:
        self.agent.stop()
        self.store.close()

    # --- what the agent shows ---

    def status(self, timeout_s: float = 3.0) -> agent_pb2.AgentStatusResponse:
        with grpc.insecure_channel(self.addr) as channel:
            return agent_pb2_grpc.AgentStub(channel).Status(agent_pb2.AgentStatusRequest(),
                                                            timeout=timeout_s)

    def round(self) -> Round | None:
        try:
            return read_round(self.store, self.keys)
        except Exception:  # noqa: BLE001 - garbage is what the tests write
            return None

    def wait_running(self, timeout_s: float = 30.0, after: int = 0) -> Round:
        """The round the agent runs workers of, once it runs a valid one above ``after``."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.agent.proc.poll() is None, f"the agent exited:\n{self.agent.text}"
            current = self.round()
            try:
                status = self.status() if self.addr else None
            except grpc.RpcError:
                status = None
            if (current is not None and current.number > after and status is not None
                    and status.state == "RUNNING" and status.round == current.number):
                return current
            if time.monotonic() > deadline:
                raise AssertionError(f"the agent did not run a round above {after} within "
                                     f"{timeout_s} s (round {current}, status {status}); "
                                     f"output tail:\n{''.join(self.agent.output[-30:])}")
            time.sleep(0.1)

    def wait_logged(self, needle: str, timeout_s: float = 10.0) -> None:
        self.agent.wait_output(needle, timeout_s)

    def worker_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix:{self.socket}")

    def commit(self, step: int, path: str | None = None
               ) -> agent_pb2.WorkerChannelCommitCheckpointResponse:
        entry = agent_pb2.CheckpointEntry(
            step=step, round=self.round().number, world_size=1,
            path=path if path is not None else f"step-{step:012d}", time=time.time())
        with self.worker_channel() as channel:
            return agent_pb2_grpc.WorkerChannelStub(channel).CommitCheckpoint(
                agent_pb2.WorkerChannelCommitCheckpointRequest(entry=entry), timeout=5)

    def latest_raw(self) -> bytes | None:
        kv = self.store.get(self.keys.checkpoint_latest)
        return kv.value if kv else None

    def assert_carries_on(self, rnd: Round) -> None:
        """Up, serving, in the same round, leading, and the commit untouched."""
        assert self.agent.proc.poll() is None, self.agent.text
        status = self.status()
        assert status.state == "RUNNING" and status.round == rnd.number, status
        assert self.round() == rnd, "the garbage changed the job's round"
        assert self.latest_raw() == self.committed, "the committed checkpoint was touched"
        leader = self.store.get(self.keys.leader)
        assert leader is not None and leader.value == NODE.encode() and leader.lease


def ctl(endpoint: str, job_id: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.ctl", *args, "--etcd", endpoint,
                           "--job-id", job_id], cwd=REPO, capture_output=True, text=True,
                          timeout=30)


@pytest.fixture(scope="module")
def job(etcd_server, tmp_path_factory):
    job = Job(etcd_server.endpoint, f"hostile-{uuid.uuid4().hex[:8]}",
              tmp_path_factory.mktemp("hostile"))
    try:
        deadline = time.monotonic() + 30
        while not job.addr:
            kv = job.store.get(job.keys.node(NODE))
            if kv is not None:
                job.addr = NodeInfo.from_json(kv.key, kv.value).addr
            assert time.monotonic() < deadline and job.agent.proc.poll() is None, job.agent.text
            time.sleep(0.1)
        job.wait_running()
        response = job.commit(5)
        assert response.committed, response.message
        job.committed = job.latest_raw()
        assert decode_latest(job.keys.checkpoint_latest, job.committed).step == 5
        yield job
    finally:
        job.close()
    text = job.agent.text
    assert "Traceback" not in text, text
    assert not RAW_CONTROL.search(text), [line for line in job.agent.output
                                          if RAW_CONTROL.search(line)][:5]


def test_the_socket_and_logs_are_private(job):
    node_dir = job.state_dir / job.job_id / NODE
    for directory in (node_dir, node_dir / "logs", node_dir / "logs" / "round-1"):
        info = os.lstat(directory)
        assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.geteuid(), directory
    assert os.stat(job.socket).st_mode & 0o777 == 0o600
    assert os.stat(node_dir / "logs" / "round-1" / "rank-0.log").st_mode & 0o077 == 0


# --- etcd: every key the agent reads -------------------------------------------------------------

def _round_like(number: int) -> dict:
    return {"number": number, "members": [{"node_id": "../../etc", "node_rank": 0, "host": "h",
                                           "nproc": 1}], "master_addr": "h\x1b[2J",
            "master_port": 99999, "reason": HOSTILE_TEXT, "leader": "a", "created_at": 1e300}


def test_garbage_rounds_are_refused_and_the_leader_forms_a_valid_round_on_top(job):
    before = job.wait_running()
    for value in garbage(_round_like(before.number + 1)):
        job.store.put(job.keys.round, value)
    job.wait_logged(f"malformed record at key '{job.keys.round}'")
    after = job.wait_running(after=before.number)
    assert after.node_ids == (NODE,) and after.master_addr == "127.0.0.1"
    assert job.latest_raw() == job.committed


def test_garbage_over_the_round_restarts_no_worker(job):
    # The leader writes the round again on top (Round.continues); the workers
    # run on, and their checkpoint commits are fenced by the round that continues
    # theirs, while the record keeps their own round (the one their memory
    # snapshots carry, which a restore compares it with).
    before = job.wait_running()
    status = job.status()
    job.store.put(job.keys.round, b"\xff\xfe not a round")
    after = job.wait_running(after=before.number)
    assert after.continues == before.workers_round and after.members == before.members
    again = job.status()
    assert [w.pid for w in again.workers] == [w.pid for w in status.workers]
    assert again.restarts == status.restarts
    entry = agent_pb2.CheckpointEntry(step=6, round=before.workers_round, world_size=1,
                                      path=f"step-{6:012d}", time=time.time())
    with job.worker_channel() as channel:
        response = agent_pb2_grpc.WorkerChannelStub(channel).CommitCheckpoint(
            agent_pb2.WorkerChannelCommitCheckpointRequest(entry=entry), timeout=5)
    assert response.committed, response.message
    job.committed = job.latest_raw()
    assert decode_latest(job.keys.checkpoint_latest, job.committed).round == before.workers_round
    assert after.number > before.workers_round


KEY_GROUPS = {
    "nodes/<id>": lambda k: [(k.node("evil"), v) for v in garbage(
        {"node_id": "evil", "host": "h\nforged", "nproc": -1, "addr": "unix:/tmp/x"})]
        + [(k.nodes + "../round", json.dumps({"node_id": "round", "host": "h"}).encode()),
           (k.nodes + "x/evil", b'{"node_id": "evil", "host": "h", "nproc": 1}')],
    "leader": lambda k: [(k.leader, v) for v in (b"\xff\xfe", HUGE, b"a\n", b"evil")],
    "requests/restart/...": lambda k: [(f"{k.restart_requests}{99:012d}-evil", v) for v in garbage(
        {"node_id": "../x", "round": -1, "reason": HOSTILE_TEXT, "failure": "yes"})],
    "requests/drain/<id>": lambda k: [(k.drain_request(NODE), v) for v in garbage(
        {"by": "../etc", "reason": HOSTILE_TEXT})] + [(k.drain_requests + "../a", b"{}")],
    # Garbage as this node's "done" would end the job if it were read as one;
    # its "started" is the agent's own key (under its lease): another node's.
    "requests/started|done|suspect/<id>": lambda k: [
        (key, v) for key in (k.done_report(NODE), k.suspect_report(NODE),
                             k.started_report("b"), k.done_reports + "../" + NODE)
        for v in garbage({"round": "1", "by": "a\x1b"})],
    "status/<id>": lambda k: [(k.status_of(n), v) for n in ("evil", "other") for v in garbage(
        {"state": HOSTILE_TEXT, "workers": [{"step_rate": "x"}, 5], "last_step": "y"})],
    "config": lambda k: [(k.config, v) for v in garbage({"min_nodes": "x", "max_nodes": 1e300})],
    "standbys": lambda k: [(k.standbys, v) for v in garbage(
        {"addrs": ["unix:/tmp/evil.sock", "h h:1", 5]})],
    "events": lambda k: [(f"{k.events}evil/{i:04d}", v) for i, v in enumerate(garbage(
        {"time": 1e300, "node_id": "evil", "round": 1, "kind": "\x1b[2J", "message": "m"}))]
        + [(f"{k.events}evil/9999", json.dumps(
            {"time": time.time(), "node_id": "evil", "round": 1, "kind": "state",
             "message": HOSTILE_TEXT}).encode())],
}


@pytest.mark.parametrize("group", sorted(KEY_GROUPS))
def test_hostile_values_in_each_key_leave_the_job_running(job, group):
    rnd = job.wait_running()
    writes = KEY_GROUPS[group](job.keys)
    for key, value in writes:
        job.store.put(key, value)
    if group == "leader":
        # Not a leader's record (garbage, no lease): the agent takes its place back.
        deadline = time.monotonic() + 10
        while (kv := job.store.get(job.keys.leader)) is None or kv.value != NODE.encode():
            assert time.monotonic() < deadline, f"leader key stuck at {kv}:\n{job.agent.text}"
            time.sleep(0.1)
        job.wait_logged("which no leader wrote; taking its place")
    elif group not in ("config", "status/<id>", "events"):
        # The leader saw and refused each key (it logs every malformed record once).
        for key in dict(writes):
            job.wait_logged(f"malformed record at key {key!r}")
    time.sleep(1.0)  # what a valid record would have done (drain, restart...) shows by now
    job.assert_carries_on(rnd)
    if group in CTL_READS:
        # elasticctl reads the same keys: clear output, no traceback, nothing raw.
        for args in CTL_READS[group]:
            out = ctl(job.endpoint, job.job_id, *args)
            assert out.returncode == 0, (args, out.stderr)
            assert "Traceback" not in out.stderr and not RAW_CONTROL.search(out.stdout), args
    for key, _ in writes:
        if key != job.keys.leader:
            job.store.delete(key)


# What elasticctl reads of each group's keys (each run is a process: only these).
CTL_READS = {
    "nodes/<id>": [["status"]],
    "status/<id>": [["status"], ["status", "--json"]],
    "events": [["events"], ["events", "--json"], ["checkpoints"]],
    "config": [["status", "--json"]],
}


def test_a_valid_restart_request_with_control_characters_is_served_and_shown_escaped(job):
    rnd = job.wait_running()
    job.store.put(f"{job.keys.restart_requests}{rnd.number:012d}-evil", json.dumps(
        {"node_id": "evil", "round": rnd.number, "reason": HOSTILE_TEXT}).encode())
    after = job.wait_running(after=rnd.number)
    assert "\\x1b[2J" in after.reason and not RAW_CONTROL.search(after.reason)
    assert job.latest_raw() == job.committed


def test_hostile_checkpoint_records_are_refused_and_a_valid_commit_replaces_them(job):
    job.wait_running()
    with job.worker_channel() as channel:
        stub = agent_pb2_grpc.WorkerChannelStub(channel)
        # A worker cannot commit a path outside the checkpoint root.
        for path in ("../../etc", "/etc", "step-1/../..", ".hidden", "a\nb"):
            with pytest.raises(grpc.RpcError) as info:
                job.commit(6, path)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
            assert "'path'" in info.value.details()
        assert job.latest_raw() == job.committed

        base = {"step": 7, "round": 1, "world_size": 1, "time": 1.0}
        for value in garbage({**base, "path": "../../etc"}) + [
                json.dumps({**base, "path": "/etc/shadow"}).encode(),
                json.dumps({**base, "path": "step-7", "time": float("nan")}).encode(),
                json.dumps({**base, "path": "step-7", "step": 2**64}).encode()]:
            job.store.put(job.keys.checkpoint_latest, value)
            with pytest.raises(grpc.RpcError) as info:
                stub.LatestCheckpoint(agent_pb2.WorkerChannelLatestCheckpointRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"malformed record at key '{job.keys.checkpoint_latest}'" in \
                info.value.details()
            assert job.agent.proc.poll() is None
        out = ctl(job.endpoint, job.job_id, "checkpoints")  # a finding, not a failure
        assert out.returncode == 0 and "problem: malformed record" in out.stdout, out.stderr
        assert "Traceback" not in out.stderr

        # The next valid commit advances it: nothing is stuck on the garbage.
        assert job.commit(8).committed
        latest = stub.LatestCheckpoint(agent_pb2.WorkerChannelLatestCheckpointRequest(),
                                       timeout=5)
    assert latest.found and latest.entry.step == 8 and latest.entry.path == "step-000000000008"
    job.committed = job.latest_raw()


# --- gRPC: the TCP server and the worker socket -----------------------------------------------

def _raw(channel: grpc.Channel, method: str, payload: bytes) -> grpc.RpcError:
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as info:
        call(payload, timeout=5)
    return info.value


def test_malformed_and_oversized_requests_to_the_tcp_server_are_refused_clearly(job):
    rnd = job.wait_running()
    with grpc.insecure_channel(job.addr, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = agent_pb2_grpc.AgentStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Drain(agent_pb2.AgentDrainRequest(reason="x" * (10 << 20)), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for method in ("/elastic.v1.Agent/Drain", "/elastic.v1.Agent/RequestRestart",
                       "/elastic.v1.Agent/Status", "/grpc.health.v1.Health/Check"):
            # Bytes that are not the method's message; its string field 1 not UTF-8
            # (Status has no field 1: an unknown field is no error in protobuf).
            payloads = [b"\xff\xff\xff\xff"] + ([] if method.endswith("Status")
                                                  else [b"\x0a\x02\xff\xfe"])
            for payload in payloads:
                error = _raw(ch, method, payload)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error)
                assert method in error.details()
        assert _raw(ch, "/elastic.v1.Agent/Nope", b"").code() == grpc.StatusCode.UNIMPLEMENTED
        assert _raw(ch, "/evil.Service/Drain", b"").code() == grpc.StatusCode.UNIMPLEMENTED
        # A reason full of control characters is logged escaped (checked at teardown).
        with pytest.raises(grpc.RpcError) as info:
            stub.Drain(agent_pb2.AgentDrainRequest(reason="x" * (2 << 20)), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    job.assert_carries_on(rnd)


@pytest.mark.parametrize("fields, field", [
    ({"rank": -1}, "rank"),
    ({"local_rank": -5}, "local_rank"),
    ({"local_rank": 7}, "local_rank"),  # this node runs one worker
    ({"step": 2**62}, "step"),
    ({"step": -2}, "step"),
    ({"saving_for_s": math.nan}, "saving_for_s"),
    ({"saving_for_s": math.inf}, "saving_for_s"),
    ({"saving_for_s": -1.0}, "saving_for_s"),
    ({"round": -3}, "round"),
    ({"snapshots": -1}, "snapshots"),
])
def test_absurd_heartbeats_are_invalid_arguments(job, fields, field):
    rnd = job.wait_running()
    request = agent_pb2.WorkerChannelHeartbeatRequest(
        **{"rank": 0, "local_rank": 0, "pid": os.getpid(), "round": rnd.number, "step": 1,
           **fields})
    with job.worker_channel() as channel:
        stub = agent_pb2_grpc.WorkerChannelStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"'{field}'" in info.value.details() and "Heartbeat" in info.value.details()
    job.assert_carries_on(rnd)


def test_malformed_and_oversized_requests_to_the_worker_socket_are_refused_clearly(job):
    rnd = job.wait_running()
    with grpc.insecure_channel(f"unix:{job.socket}",
                               options=[("grpc.max_send_message_length", -1)]) as channel:
        for method in ("Heartbeat", "CommitCheckpoint", "ReportCheckpointFailure",
                       "ReportRestore"):
            error = _raw(channel, f"/elastic.v1.WorkerChannel/{method}", b"\xff\xff\xff")
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, method
        stub = agent_pb2_grpc.WorkerChannelStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ReportCheckpointFailure(agent_pb2.WorkerChannelReportCheckpointFailureRequest(
                step=1, round=rnd.number, rank=0, message="x" * (3 << 20)), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            stub.ReportRestore(agent_pb2.WorkerChannelReportRestoreRequest(
                step=1, round=rnd.number, rank=0, restore_s=math.nan), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'restore_s'" in info.value.details()
        # The agent's workers' TCP service is not on the socket, nor is control.
        assert _raw(channel, "/elastic.v1.Agent/Drain", b"").code() == \
            grpc.StatusCode.UNIMPLEMENTED
        # Still answering: a valid heartbeat of the running round.
        response = stub.Heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(
            rank=0, local_rank=0, pid=os.getpid(), round=rnd.workers_round, step=1), timeout=5)
        assert not response.stop_requested
    job.assert_carries_on(rnd)
