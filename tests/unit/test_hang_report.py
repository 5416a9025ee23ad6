"""The reason of a hang verdict, put together from this node's and the peers' stacks."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading

from agent.hang_attribution import Attribution, HangKind, RankStack
from agent.hang_report import HangReporter, VerdictOnly
from elastic.errors import StoreError
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Member, Round
from tests.fakes.clock import FakeClock
from tests.unit.test_roster_buckets import bucket_view

ROUND = Round(number=4, members=(Member("a", 0, "h", 1, addr="a:1"),
                                 Member("b", 1, "h", 1, addr="b:1"),
                                 Member("c", 2, "h", 1, addr="c:1")),
              master_addr="h", master_port=1, reason="why", leader="a", created_at=0.0)


class Peers:
    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def collect_stacks(self, addrs, round_number, timeout_s):
        self.asked.append((addrs, round_number))
        return self.answers


class Collector:
    """This node's one worker: rank 0, waiting in all_reduce."""

    def __init__(self):
        self.calls = 0

    def collect(self, round_number, workers, health, now, timeout_s):
        self.calls += 1
        return [RankStack(0, "a", True, place="t.py:9 in main", collective="all_reduce",
                          step=7)]

    def path(self, round_number, rank):
        return f"/logs/round-{round_number}/rank-{rank}.stacks"


def reporter(peers, workers=lambda: [object()], collector=None, read_whole=lambda: None):
    return HangReporter(collector or Collector(), peers, "a", workers_of=workers,
                        health_of=lambda: [], clock=FakeClock(),
                        log=JobLogger(logging.getLogger("test"), "j", "a", lambda: 4),
                        read_whole=read_whole)


def test_the_reason_puts_the_attribution_before_the_verdict_and_names_silent_nodes():
    peers = Peers([RankStack(1, "b", True, place="t.py:3 in load", step=6)])
    found = reporter(peers).reason(ROUND, "rank 0 made no progress for 3.0 s")
    reason = found.reason
    assert found.kind is HangKind.RANK_ELSEWHERE
    assert peers.asked == [(("b:1", "c:1"), 4)]
    assert reason == ("rank 1 (node b) is in t.py:3 in load while the other rank waits in "
                      "all_reduce (step 7); no stacks from node(s) c "
                      "[rank 0 made no progress for 3.0 s]")


def test_a_large_jobs_round_is_read_whole_to_ask_every_peer_or_else_its_bucket():
    large = dataclasses.replace(ROUND, members=ROUND.members + tuple(
        Member(f"n{i}", 3 + i, "h", 1, addr=f"n{i}:1") for i in range(200)))
    mine = bucket_view(large, "a")
    peers = Peers([])
    reporter(peers, read_whole=lambda: large).reason(mine, "hung")
    assert peers.asked == [(tuple(m.addr for m in large.members[1:]), 4)]
    # The read fails: the members of this node's bucket are asked.
    peers.asked.clear()
    reporter(peers, read_whole=failing_read).reason(mine, "hung")
    held = tuple(m.addr for m in mine.held_members() if m.node_id != "a")
    assert peers.asked == [(held, 4)] and 0 < len(held) < 100


def failing_read():
    raise StoreError("etcd is slow")


def test_once_the_workers_are_stopped_a_peer_gets_the_stacks_read_last():
    collector = Collector()
    live = [[object()]]
    r = reporter(Peers([]), workers=lambda: live[0], collector=collector)
    first = r.local(4)
    live[0] = []
    assert r.local(4) == first and collector.calls == 1
    live[0] = [object()]
    r.local(5)
    assert collector.calls == 2


def test_the_stacks_are_logged_under_the_round_of_the_workers_not_the_latest(caplog):
    # The logger's current round is 4 (the next round, committed while they were read).
    caplog.set_level(logging.INFO, logger="test")
    reporter(Peers([])).local(3)
    assert ("job j node a round 3: stack of rank 0 at the hang: waits in all_reduce "
            "(t.py:9 in main) (full stacks: /logs/round-3/rank-0.stacks)") in caplog.messages


class SlowPeers(Peers):
    """Peers whose answer waits until the test releases it."""

    def __init__(self, answers):
        super().__init__(answers)
        self.release = threading.Event()

    def collect_stacks(self, addrs, round_number, timeout_s):
        assert self.release.wait(10), "the test never released the peers"
        return super().collect_stacks(addrs, round_number, timeout_s)


def test_report_returns_while_the_peers_are_still_asked_and_delivers_the_reason_later():
    peers = SlowPeers([RankStack(1, "b", True, place="t.py:3 in load", step=6)])
    delivered: queue.Queue = queue.Queue()
    reporter(peers).report(ROUND, "rank 0 made no progress for 3.0 s", delivered.put)
    assert delivered.empty(), "report waited for the peers: it would block the agent's loop"
    peers.release.set()
    found = delivered.get(timeout=10)
    assert found.kind is HangKind.RANK_ELSEWHERE and found.reason.startswith("rank 1 (node b)")


def test_the_verdict_alone_is_delivered_at_once_in_the_callers_thread():
    delivered = []
    VerdictOnly().report(ROUND, "rank 0 made no progress", delivered.append)
    assert delivered == [Attribution("rank 0 made no progress", HangKind.NO_STACKS)]
