"""The replicator wakes when a worker says it completed a snapshot
(agent.memory_replication.Replicator.heard), not at its next look: its safety-net
polls are set an hour apart here, so only the wake can send a new snapshot in time.
The same counts pace a planned stop (SnapshotPace): it waits for the next snapshot,
a few intervals at most."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from agent import memory_replication
from agent.memory_replication import Replicator, SnapshotsTaken
from agent.memory_tier import MemoryDir
from elastic.checkpoint.memory import layout
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Member, Round

ROUND = Round(number=1, members=(Member("a", 0, "127.0.0.1", 1, addr="a:1"),
                                 Member("b", 1, "127.0.0.1", 1, addr="b:1")),
              master_addr="127.0.0.1", master_port=1, reason="test", leader="a", created_at=0.0)


class Buddy:
    """The replica client's place: records each slot sent to the buddy (node b)."""

    def __init__(self):
        self.sent: list[int] = []  # steps, in the order sent

    def send_slot(self, addr, round_number, info, stop=None):
        assert (addr, round_number) == ("b:1", 1)
        self.sent.append(info.manifest.step)
        return info.manifest.nbytes

    def close(self):
        pass


def stage(memory_dir: str, step: int) -> None:
    """Rank 0's snapshot of ``step`` in its next slot, by the slot protocol."""
    path = os.path.join(layout.own_dir(memory_dir), layout.SlotKey(1, 0, step % 2).name)
    layout.begin_write(path)
    with open(os.path.join(path, layout.LOCAL), "wb") as f:
        f.write(b"step %d" % step)
    layout.finish_write(path, layout.Manifest(
        job_id="job", node_id="a", round=1, step=step, rank=0, world_size=2,
        files={layout.LOCAL: len(b"step %d" % step)}))


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@pytest.fixture
def replicator(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_replication, "POLL_RUNNING_S", 3600.0)
    monkeypatch.setattr(memory_replication, "POLL_IDLE_S", 3600.0)
    memory = MemoryDir(str(tmp_path), str(tmp_path), str(tmp_path / "a"), "token")
    buddy = Buddy()
    r = Replicator(memory, "a", 1, lambda: ROUND, lambda: True, buddy, threading.Lock(),
                   JobLogger(logging.getLogger("test"), "job", "a"))
    stage(memory.path, 0)
    r.start()
    assert wait_until(lambda: buddy.sent == [0]), "the first pass sends what is there"
    try:
        yield r, buddy, memory.path
    finally:
        r.stop()


def test_a_snapshot_heard_is_sent_at_once(replicator):
    r, buddy, path = replicator
    stage(path, 1)
    r.heard(SnapshotsTaken(local_rank=0, pid=41, count=2))
    assert wait_until(lambda: buddy.sent == [0, 1]), buddy.sent


def test_a_count_heard_again_wakes_nothing_and_a_new_worker_does(replicator):
    r, buddy, path = replicator
    stage(path, 1)
    r.heard(SnapshotsTaken(local_rank=0, pid=41, count=2))
    assert wait_until(lambda: buddy.sent == [0, 1])
    stage(path, 2)
    r.heard(SnapshotsTaken(local_rank=0, pid=41, count=2))  # a periodic beat: nothing new
    time.sleep(0.5)
    assert buddy.sent == [0, 1]
    r.heard(SnapshotsTaken(local_rank=0, pid=42, count=2))  # a restarted worker, same count
    assert wait_until(lambda: buddy.sent == [0, 1, 2]), buddy.sent


def test_a_negative_count_is_no_heartbeat_a_worker_sends():
    from agent.grpc_input import check_heartbeat
    from elastic.errors import InvalidRequestError
    from elastic.v1 import agent_pb2

    check_heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(step=3, snapshots=4))
    with pytest.raises(InvalidRequestError, match="snapshots"):
        check_heartbeat(agent_pb2.WorkerChannelHeartbeatRequest(step=3, snapshots=-1))


class StepClock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


def paced(clock, interval_s, *ranks):
    """A pace that heard two snapshots of each rank ``interval_s`` apart."""
    pace = memory_replication.SnapshotPace(clock)
    for count in (1, 2):
        for rank in ranks:
            pace.heard(SnapshotsTaken(local_rank=rank, pid=40 + rank, count=count))
        clock.now += interval_s
    return pace


def test_a_planned_stop_waits_until_every_worker_took_its_next_snapshot():
    clock = StepClock()
    pace = paced(clock, 0.13, 0, 1)
    waited = []
    waiter = threading.Thread(target=lambda: waited.append(pace.wait_for_next()))
    waiter.start()
    time.sleep(0.05)
    pace.heard(SnapshotsTaken(local_rank=0, pid=40, count=3))
    time.sleep(0.02)
    assert not waited  # rank 1 has not taken it yet
    pace.heard(SnapshotsTaken(local_rank=1, pid=41, count=3))
    waiter.join(timeout=1)
    assert waited == [True]


def test_workers_that_take_no_snapshot_hold_a_stop_a_few_intervals_only():
    pace = paced(StepClock(), 0.1, 0, 1)  # stuck in a collective: no snapshot comes
    started = time.monotonic()
    assert pace.wait_for_next() is False
    assert 0.3 - 0.02 <= time.monotonic() - started < 0.8  # 3 intervals


def test_a_pace_not_known_yet_holds_nothing():
    clock = StepClock()
    pace = memory_replication.SnapshotPace(clock)
    assert pace.wait_for_next() is False  # no worker heard from
    pace.heard(SnapshotsTaken(local_rank=0, pid=40, count=1))
    assert pace.wait_for_next() is False  # one snapshot: no interval
    clock.now += 0.1
    pace.heard(SnapshotsTaken(local_rank=0, pid=41, count=2))  # a new process: a new pace
    started = time.monotonic()
    assert pace.wait_for_next() is False and time.monotonic() - started < 0.05
