"""Operator restarts, at most one per interval per job: the pure decision (time
moved by passing another ``now``), its I/O against the in-memory store, and
elasticctl restart on top of it."""

from __future__ import annotations

import argparse

import pytest

from agent import ctl
from elastic.errors import RateLimitedError
from elastic.keyspace import JobKeys
from elastic.rendezvous.api import RestartRequest
from elastic.rendezvous.operator import (
    OperatorRestart,
    decide_operator_restart,
    request_operator_restart,
)
from tests.fakes.clock import FakeClock
from tests.fakes.memory_store import MemoryStore

T0 = 1_700_000_000.0


def test_the_first_operator_restart_is_allowed():
    gate = decide_operator_restart(None, T0, 60.0)
    assert gate.allowed and gate.next_at == T0


def test_a_second_within_the_interval_is_refused_saying_when_the_next_is_allowed():
    last = OperatorRestart(at=T0, by="node-a", round=3)
    gate = decide_operator_restart(last, T0 + 15.0, 60.0)
    assert not gate.allowed
    assert gate.next_at == T0 + 60.0
    assert "taken 15 s ago" in gate.reason and "by node-a, for round 3" in gate.reason
    assert "in 45 s (--operator-restart-interval 60 s)" in gate.reason


def test_the_next_is_allowed_once_the_interval_has_passed():
    last = OperatorRestart(at=T0, by="elasticctl", round=3)
    assert not decide_operator_restart(last, T0 + 59.9, 60.0).allowed
    gate = decide_operator_restart(last, T0 + 60.0, 60.0)
    assert gate.allowed and "60 s ago" in gate.reason


def test_interval_zero_turns_the_limit_off():
    last = OperatorRestart(at=T0, by="elasticctl", round=3)
    assert decide_operator_restart(last, T0 + 1.0, 0.0).allowed


def test_a_record_from_the_future_does_not_block_for_longer_than_one_interval():
    # A clock that was an hour ahead when the last one was taken.
    last = OperatorRestart(at=T0 + 3600.0, by="elasticctl", round=3)
    assert not decide_operator_restart(last, T0 + 3600.0 - 30.0, 60.0).allowed
    gate = decide_operator_restart(last, T0, 60.0)
    assert gate.allowed and "in the future" in gate.reason


def request(by: str = "node-a", round_: int = 3) -> RestartRequest:
    return RestartRequest(node_id=by, round=round_, reason="operator asked")


def test_requests_through_any_agent_share_one_limit_per_job():
    clock = FakeClock(wall_s=T0)
    store, keys = MemoryStore(clock), JobKeys("job-1")
    request_operator_restart(store, keys, request("node-a"), interval_s=60.0, now=clock.wall())
    assert store.get(keys.restart_request(3, "node-a")) is not None

    clock.advance(10.0)
    with pytest.raises(RateLimitedError, match="restart of job job-1 refused: an operator "
                                               "restart was taken 10 s ago") as refused:
        request_operator_restart(store, keys, request("node-b"), interval_s=60.0,
                                 now=clock.wall())
    assert refused.value.next_at == T0 + 60.0
    assert store.get(keys.restart_request(3, "node-b")) is None  # nothing written

    clock.advance(50.0)
    request_operator_restart(store, keys, request("node-b", 4), interval_s=60.0,
                             now=clock.wall())
    assert store.get(keys.restart_request(4, "node-b")) is not None
    taken = store.get(keys.operator_restart)
    assert OperatorRestart.from_json(taken.key, taken.value) == OperatorRestart(
        at=T0 + 60.0, by="node-b", round=4)


def test_a_malformed_record_does_not_block_restarts():
    store, keys = MemoryStore(FakeClock()), JobKeys("job-1")
    store.put(keys.operator_restart, b"garbage")
    request_operator_restart(store, keys, request(), interval_s=60.0, now=T0)
    assert store.get(keys.restart_request(3, "node-a")) is not None


def ctl_args(interval: str = "60") -> argparse.Namespace:
    return argparse.Namespace(job_id="job-1", reason="try again", json=False,
                              operator_restart_interval=interval)


def test_elasticctl_restart_is_limited_like_the_agents_restarts(monkeypatch):
    store, keys = MemoryStore(FakeClock()), JobKeys("job-1")
    now = [T0]
    monkeypatch.setattr(ctl.time, "time", lambda: now[0])
    restart = ctl.COMMANDS["restart"]
    assert restart(store, ctl_args()) == "restart of job job-1 requested for round 0"
    assert store.get(keys.restart_request(0, "elasticctl")) is not None
    now[0] += 5.0
    with pytest.raises(RateLimitedError, match="next is allowed from .* in 55 s"):
        restart(store, ctl_args())
    # An operator who means it may lift the limit for one request.
    assert "requested" in restart(store, ctl_args("0"))


def test_elasticctl_refuses_a_bad_interval_before_writing(capsys):
    code = ctl.main(["restart", "--etcd", "http://127.0.0.1:1", "--job-id", "j",
                     "--operator-restart-interval", "soon"])
    assert code == 2
    assert "--operator-restart-interval 'soon'" in capsys.readouterr().err
