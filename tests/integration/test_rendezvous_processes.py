"""Real node processes against a real etcd: form, lose, regain, fence."""

from __future__ import annotations

import signal
import time

import pytest

from elastic.keyspace import JobKeys
from elastic.fence import fenced_put
from tests.integration.procs import MemberProcess
from tests.waiting import LOADED_SLACK_S

pytestmark = pytest.mark.integration

LEASE_TTL = 2.0


@pytest.fixture
def members(etcd_endpoint, job_id):
    started: list[MemberProcess] = []

    def start(node_id: str, nnodes: str = "2:4", **kw) -> MemberProcess:
        kw.setdefault("lease_ttl", LEASE_TTL)
        p = MemberProcess(etcd_endpoint, job_id, node_id, nnodes, **kw)
        started.append(p)
        # One at a time, so join order (and so rank order) is the start order.
        p.wait_for(lambda o: o.get("event") == "registered")
        return p

    yield start
    for p in started:
        p.stop()


def test_three_form_one_killed_survivors_reform_then_a_fourth_joins(members, etcd_store, job_id):
    n1, n2, n3 = members("n1"), members("n2"), members("n3")
    for p in (n1, n2, n3):
        first = p.wait_round(["n1", "n2", "n3"])
    assert first["world_size"] == 3
    # Everyone agrees on the same round number.
    numbers = {p.wait_round(["n1", "n2", "n3"])["number"] for p in (n1, n2, n3)}
    assert len(numbers) == 1

    killed_at = time.monotonic()
    n3.proc.kill()  # SIGKILL: no goodbye, only the lease expiry tells
    seen = [p.wait_round(["n1", "n2"], timeout_s=LEASE_TTL + LOADED_SLACK_S + 1,
                         after=first["number"])
            for p in (n1, n2)]
    elapsed = time.monotonic() - killed_at
    # The lease's expiry forms the round (not a later poll); the slack is the machine's.
    assert elapsed <= LEASE_TTL + LOADED_SLACK_S, f"survivors re-formed after {elapsed:.2f} s"
    second = seen[0]
    assert "lost n3" in second["reason"]
    assert [s["node_rank"] for s in seen] == [0, 1]

    n4 = members("n4")
    for p in (n1, n2, n4):
        third = p.wait_round(["n1", "n2", "n4"], after=second["number"])
    assert third["number"] == second["number"] + 1
    assert "joined n4" in third["reason"]
    assert n4.wait_round(["n1", "n2", "n4"])["node_rank"] == 2


def test_node_of_an_older_round_cannot_commit_a_fenced_write(members, etcd_store, job_id):
    n1, n2, n3 = members("n1"), members("n2"), members("n3")
    for p in (n1, n2, n3):
        together = p.wait_round(["n1", "n2", "n3"])

    n3.signal(signal.SIGSTOP)  # frozen: its lease expires, the others move on
    n1.wait_round(["n1", "n2"], timeout_s=LEASE_TTL + 5, after=together["number"])
    n3.signal(signal.SIGUSR1)  # delivered on wake-up: write for the round it was in
    n3.signal(signal.SIGCONT)
    answer = n3.wait_for(lambda o: o.get("event") == "fenced_write")
    assert answer["ok"] is False
    assert "the current round is" in answer["error"]
    assert etcd_store.get(JobKeys(job_id).prefix + "fence-test/n3") is None

    # The same write for the current round goes through.
    keys = JobKeys(job_id)
    current = etcd_store.get(keys.round).version
    fenced_put(etcd_store, keys, keys.prefix + "fence-test/ok", b"1", current)
    assert etcd_store.get(JobKeys(job_id).prefix + "fence-test/ok").value == b"1"


def test_frozen_node_comes_back_as_a_newcomer(members):
    n1, n2 = members("n1", nnodes="1:3"), members("n2", nnodes="1:3")
    both = n1.wait_round(["n1", "n2"])
    n2.signal(signal.SIGSTOP)
    alone = n1.wait_round(["n1"], timeout_s=LEASE_TTL + 5, after=both["number"])
    n2.signal(signal.SIGCONT)
    # Its lease is gone; it registers again and is taken back in.
    back = n2.wait_round(["n1", "n2"], timeout_s=LEASE_TTL + 10, after=alone["number"])
    assert back["node_rank"] == 1


def test_nodes_beyond_max_wait_as_standby_and_fill_in_after_a_loss(members):
    n1, n2 = members("n1", nnodes="2:2"), members("n2", nnodes="2:2")
    n1.wait_round(["n1", "n2"])
    n3 = members("n3", nnodes="2:2")
    standby = n3.wait_for(lambda o: o.get("event") == "round")
    assert standby["node_rank"] is None and standby["members"] == ["n1", "n2"]
    n2.proc.kill()
    for p in (n1, n3):
        p.wait_round(["n1", "n3"], timeout_s=LEASE_TTL + 5, after=standby["number"])


def test_restart_request_gives_a_new_round_with_the_same_members(members, etcd_endpoint, job_id):
    from agent import ctl

    n1, n2 = members("n1"), members("n2")
    before = n1.wait_round(["n1", "n2"])
    assert ctl.main(["restart", "--etcd", etcd_endpoint, "--job-id", job_id,
                     "--reason", "test"]) == 0
    after = n2.wait_for(lambda o: o.get("event") == "round" and o["number"] > before["number"])
    assert after["members"] == ["n1", "n2"]
    assert "restart requested by elasticctl: test" in after["reason"]
