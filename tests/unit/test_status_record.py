"""The status record (agent/status_record.py): what an agent writes to etcd and
answers over gRPC, read back by elasticctl status. One shape, both ways."""

from __future__ import annotations

import json

import pytest

from agent.status import render
from agent.status_record import StatusRecord, StragglerRow, WorkerRow
from elastic.errors import MalformedRecordError
from elastic.records import MAX_REASON_CHARS

KEY = "/elastic/j/status/a"
ROWS = (WorkerRow(0, 4, 101, "running", 9, 2.5, 0.3, judged=True),
        WorkerRow(1, 5, 102, "succeeded", 12, 1.25, 1.0))


def record(**overrides) -> StatusRecord:
    fields = dict(node_id="a", state="RUNNING", round_number=3, node_rank=1, workers=ROWS,
                  restarts=2, last_failure="worker rank 3 exited with 1")
    fields.update(overrides)
    return StatusRecord.of(**fields)


def test_the_node_is_at_its_newest_step_and_its_slowest_rate():
    assert (record().last_step, record().step_rate) == (12, 1.25)
    assert (record(workers=()).last_step, record(workers=()).step_rate) == (-1, 0.0)


def test_the_json_record_keeps_its_fields_and_reads_back_the_same():
    raw = record().to_json()
    obj = json.loads(raw)
    assert sorted(obj) == ["last_failure", "last_step", "node_id", "node_rank", "restarts",
                           "round", "state", "step_rate", "workers"]
    assert obj["workers"][1] == {"local_rank": 1, "rank": 5, "pid": 102, "state": "succeeded",
                                 "last_step": 12, "step_rate": 1.25, "heartbeat_age_s": 1.0,
                                 "exit_code": 0, "judged": False}
    assert obj["workers"][0]["judged"] is True
    assert raw == json.dumps(obj, sort_keys=True).encode()
    assert StatusRecord.from_json(KEY, raw) == record()
    assert StatusRecord.from_json(KEY, record(node_rank=None).to_json()).node_rank is None


@pytest.mark.parametrize("obj,field", [
    ({"workers": [{"step_rate": "x"}]}, "workers[0].step_rate"),
    ({"workers": [5]}, "workers[0]"),
    ({"last_step": "y"}, "last_step"),
    ({"node_rank": -1}, "node_rank"),
    ({"step_rate": 1e400}, "step_rate"),
])
def test_a_malformed_record_is_refused_naming_the_field(obj, field):
    with pytest.raises(MalformedRecordError, match=field.replace("[", r"\[").replace("]", r"\]")):
        StatusRecord.from_json(KEY, json.dumps(obj).encode())


def test_the_grpc_answer_carries_the_same_record():
    resp = record().to_pb("j", 8, "1.0")
    assert (resp.job_id, resp.world_size, resp.version, resp.node_rank) == ("j", 8, "1.0", 1)
    assert StatusRecord.from_pb(resp) == record()
    assert record(node_rank=None).to_pb("j", 0, "").node_rank == -1
    assert StatusRecord.from_pb(record(node_rank=None).to_pb("j", 0, "")).node_rank is None


def test_an_answer_s_text_is_made_printable_and_capped():
    resp = record(state="RUNNING\x1b[2J", last_failure="x" * 5000,
                  workers=(WorkerRow(0, 0, 1, "\x1b" * 100),)).to_pb("j", 1, "")
    read = StatusRecord.from_pb(resp)
    assert "\x1b" not in read.state and len(read.state) <= 32
    assert len(read.last_failure) <= MAX_REASON_CHARS
    assert "\x1b" not in read.workers[0].state and len(read.workers[0].state) <= 32


def test_the_summary_is_what_elasticctl_status_shows():
    summary = record().summary("etcd")
    assert list(summary) == ["source", "state", "round", "node_rank", "workers", "last_step",
                             "step_rate", "restarts", "last_failure"]
    assert summary["source"] == "etcd" and summary["workers"][0]["pid"] == 101


def test_elasticctl_status_shows_how_many_workers_hang_detection_judges():
    agent = json.loads(record().to_json())
    status = {"job_id": "j", "round": None, "leader": "a", "checkpoint": None, "problems": [],
              "nodes": [{"node_id": "a", "node_rank": 1, "role": "default", "host": "h",
                         "nproc": 2, "agent": agent}]}
    header, row = render(status, now=0.0).splitlines()[-2:]
    assert header.split()[6] == "JUDGED" and row.split()[6] == "1/2"


STRAGGLER = StragglerRow(rank=3, node_id="b", step_s=0.105, peers_s=0.055, slow_for_s=64.0,
                         action="drained node b: a standby waits to take its place")


def test_the_leader_s_record_carries_its_stragglers_in_json_grpc_and_elasticctl_status():
    leader = record(node_rank=0)
    leader = StatusRecord(**{**leader.__dict__, "stragglers": (STRAGGLER,)})

    assert StatusRecord.from_json(KEY, leader.to_json()) == leader
    assert StatusRecord.from_pb(leader.to_pb("j", 4, "")) == leader
    assert "stragglers" not in json.loads(record().to_json()), "others' records stay as they were"
    status = {"job_id": "j", "round": None, "leader": "a", "checkpoint": None, "problems": [],
              "nodes": [{"node_id": "a", "node_rank": 0, "role": "member", "host": "h",
                         "nproc": 2, "agent": leader.summary("agent")}]}
    assert render(status, now=0.0).splitlines()[-1] == (
        "straggler: rank 3 (node b), steps of 0.105 s, 1.91x its peers' median of 0.055 s, "
        "for 64 s; drained node b: a standby waits to take its place")


def test_a_straggler_named_by_its_busy_time_says_so_and_an_older_row_is_by_wall_time():
    busy = StragglerRow(3, "b", 0.105, 0.055, 64.0, "reported", measure="busy")
    leader = StatusRecord(**{**record(node_rank=0).__dict__, "stragglers": (busy,)})

    assert StatusRecord.from_json(KEY, leader.to_json()) == leader
    assert StatusRecord.from_pb(leader.to_pb("j", 4, "")) == leader
    assert busy.line() == ("straggler: rank 3 (node b), busy 0.105 s per step, 1.91x its "
                           "peers' median of 0.055 s, for 64 s; reported")
    obj = json.loads(leader.to_json())
    del obj["stragglers"][0]["measure"]  # written by an agent older than the field
    [older] = StatusRecord.from_json(KEY, json.dumps(obj).encode()).stragglers
    assert older.measure == "wall" and older.line().startswith(
        "straggler: rank 3 (node b), steps of 0.105 s")


@pytest.mark.parametrize("row,field", [
    ({"rank": -1}, "stragglers[0].rank"),
    ({"step_s": "slow"}, "stragglers[0].step_s"),
    ({"peers_s": -0.1}, "stragglers[0].peers_s"),
])
def test_a_malformed_straggler_row_is_refused_naming_the_field(row, field):
    obj = json.loads(record().to_json())
    obj["stragglers"] = [{**STRAGGLER.__dict__, **row}]
    with pytest.raises(MalformedRecordError, match=field.replace("[", r"\[").replace("]", r"\]")):
        StatusRecord.from_json(KEY, json.dumps(obj).encode())


def test_a_straggler_row_sent_over_grpc_is_made_printable_and_capped():
    leader = StatusRecord(**{**record().__dict__, "stragglers": (
        StragglerRow(3, "b\x1b[2J", float("nan"), -1.0, 5.0, "x" * 5000),)})
    [row] = StatusRecord.from_pb(leader.to_pb("j", 4, "")).stragglers
    assert "\x1b" not in row.node_id and len(row.action) <= 256
    assert (row.step_s, row.peers_s) == (0.0, 0.0)
    assert "slower than its peers' median" in row.line()
