"""The agent's pure reaction function, driven with explicit times: no store,
no processes, no sleeping. Each test: a scenario, an event, the commands."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.gpu_health import GpuAction, GpuDecision
from agent.health import PeerHealth
from agent.lifecycle import AgentState as S
from agent.lifecycle import check_path
from agent.reactor import (
    ATTRIBUTION_WAIT_S,
    STORE_DOUBT_KEEPALIVES,
    AttributeHang,
    HangAttributed,
    hangs_count_from,
    AgentView,
    CheckPeersStore,
    DrainRequested,
    Fail,
    GaveUp,
    GpuChecked,
    HeartbeatReply,
    Joined,
    LeaseState,
    Leave,
    PeerHealthChanged,
    PeerSilent,
    Report,
    RequestRestart,
    RoundCommitted,
    Settings,
    Signalled,
    StartWorkers,
    StopCause,
    StopGrace,
    StopWorkers,
    Tick,
    Transition,
    WatchPeer,
    WorkerExited,
    heartbeat_reply,
    next_tick_at,
    react,
    reports_for_new_lease,
    store_health,
)
from elastic.errors import RendezvousTimeoutError
from elastic.store.api import KEEPALIVE_TTL_FRACTION
from elastic.rendezvous.api import Member, ReportKind, Round
from tests.unit.test_roster_buckets import bucket_view

SETTINGS = Settings(node_id="a", nproc=2, lease_ttl_s=4.0, join_timeout_s=60.0, job_id="j")


def round_of(number, *ids, outcome=""):
    return Round(number=number,
                 members=tuple(Member(i, r, "127.0.0.1", 2, addr=f"{i}:1")
                               for r, i in enumerate(ids)),
                 master_addr="127.0.0.1", master_port=1, reason="why", leader=ids[0],
                 created_at=0.0, outcome=outcome)


def bucket_round(number, *ids, delta=None):
    """Node "a"'s round of ``ids`` as a large job's node holds it."""
    return bucket_view(round_of(number, *ids), "a", delta)


def running(number=3, *ids, **extra):
    """A view of node "a" whose workers run in round ``number``."""
    return AgentView(state=S.RUNNING, round=round_of(number, *(ids or ("a", "b"))),
                     started_at=100.0, rounds_started=1, **extra)


def peer(health):
    """Ring peer b's agent now reports ``health``."""
    return PeerHealthChanged("b", health)


def kinds(commands):
    return [type(c).__name__ for c in commands]


def transitions(commands):
    return [c.to for c in commands if isinstance(c, Transition)]


class TestRounds:
    def test_a_round_this_agent_is_not_registered_for_starts_no_worker(self):
        # A fresh agent of node a (its predecessor died) sees the round formed with
        # the predecessor, before it registered or after: its workers would join a
        # group formed without it. The round formed once it registered starts them.
        for registered_after in (None, 3):
            stale = RoundCommitted(round_of(3, "a", "b"), registered_after=registered_after)
            view, commands = react(AgentView(), stale, 10.0, SETTINGS)
            assert commands == [] and view.state is S.JOINING
        view, commands = react(view, RoundCommitted(round_of(4, "a", "b"), registered_after=3),
                               11.0, SETTINGS)
        assert view.state is S.RUNNING and StartWorkers(round_of(4, "a", "b"), 0) in commands
        # A node whose workers run is not held by it (its lease may be lost while etcd
        # is down), nor is a round that leaves this node out, nor the job's end.
        running_view, commands = react(running(3), RoundCommitted(
            round_of(4, "a", "b"), registered_after=None), 12.0, SETTINGS)
        assert running_view.round.number == 4 and "StartWorkers" in kinds(commands)
        ended, _ = react(AgentView(), RoundCommitted(round_of(5, "a", "b", outcome="failed"),
                                                     registered_after=None), 13.0, SETTINGS)
        assert ended.state is S.FAILED

    def test_first_round_starts_workers_reports_started_and_watches_the_ring_peer(self):
        view, commands = react(AgentView(), RoundCommitted(round_of(1, "a", "b")), 10.0,
                               SETTINGS)
        assert view.state is S.RUNNING and view.round.number == 1
        assert transitions(commands) == [S.STARTING, S.RUNNING]
        assert StartWorkers(round_of(1, "a", "b"), 0) in commands
        assert Report(ReportKind.STARTED, 1) in commands
        assert WatchPeer("b", "b:1") in commands

    def test_a_new_round_stops_the_old_workers_before_starting_new_ones(self):
        view, commands = react(running(3), RoundCommitted(round_of(4, "b", "a")), 10.0,
                               SETTINGS)
        assert transitions(commands) == [S.STOPPING, S.JOINING, S.STARTING, S.RUNNING]
        stop = kinds(commands).index("StopWorkers")
        assert stop < kinds(commands).index("StartWorkers")
        assert view.rounds_started == 2

    def test_the_same_or_an_older_round_changes_nothing(self):
        for number in (3, 2):
            view, commands = react(running(3), RoundCommitted(round_of(number, "a", "b")), 10.0,
                                   SETTINGS)
            assert commands == [] and view.round.number == 3

    def test_a_round_without_this_node_makes_it_a_standby(self):
        view, commands = react(running(3), RoundCommitted(round_of(4, "b", "c")), 10.0,
                               SETTINGS)
        assert view.state is S.STANDBY
        assert transitions(commands) == [S.STOPPING, S.JOINING, S.STANDBY]

    def test_a_round_without_this_node_after_a_drain_request_makes_it_leave(self):
        view, commands = react(running(3), RoundCommitted(round_of(4, "b"),
                                                          drain_requested=True), 10.0, SETTINGS)
        assert view.state is S.SUCCEEDED and view.outcome_reason == "drained: drain requested"
        assert Leave("drain requested") in commands

    def test_a_done_node_given_a_new_round_that_is_not_final_starts_its_workers_again(self):
        # A member failed after this node's workers had all exited 0: the job is
        # not over, the new round needs this node's workers again (after a stop
        # that sweeps any left of the old round).
        done = dataclasses.replace(running(3), state=S.DONE, exited_ok=frozenset({0, 1}))
        view, commands = react(done, RoundCommitted(round_of(4, "a", "c")), 10.0, SETTINGS)
        assert view.state is S.RUNNING and view.round.number == 4
        assert view.exited_ok == frozenset() and view.rounds_started == 2
        assert transitions(commands) == [S.STOPPING, S.JOINING, S.STARTING, S.RUNNING]
        assert kinds(commands).index("StopWorkers") < kinds(commands).index("StartWorkers")
        assert StartWorkers(round_of(4, "a", "c"), 1) in commands
        assert Report(ReportKind.STARTED, 4) in commands

    def test_the_same_round_written_again_keeps_the_workers_running(self):
        # A malformed record replaced round 3; the leader wrote it again as round 5.
        again = round_of(3, "a", "b").continued(5, "written again", "a", 1.0)
        for state in (S.RUNNING, S.DONE):
            before = dataclasses.replace(running(3), state=state)
            view, commands = react(before, RoundCommitted(again), 10.0, SETTINGS)
            assert view == dataclasses.replace(before, round=again)
            assert kinds(commands) == ["Note"]
            assert "round 5 continues round 3" in commands[0].message
        # Its workers (of round 3) still count: a crash fails the round it is now.
        view, _ = react(running(3), RoundCommitted(again), 10.0, SETTINGS)
        view, commands = react(view, WorkerExited(3, 1, 1, 99, 1), 11.0, SETTINGS)
        assert view.state is S.JOINING
        assert RequestRestart(5, "worker rank 1 (pid 99) exited with 1", failure=True) in commands

    def test_a_continuation_of_workers_this_node_does_not_run_starts_none(self):
        # No worker started for it would find its group: the leader forms a new
        # round for the restart this node requested (or the members it lacks).
        again = round_of(3, "a", "b").continued(5, "x", "a", 1.0)
        stopped = dataclasses.replace(running(3), state=S.JOINING)  # after a local failure
        assert react(stopped, RoundCommitted(again), 10.0, SETTINGS) == (stopped, [])
        other = round_of(3, "a", "c").continued(5, "x", "a", 1.0)  # not what runs here
        assert react(running(3), RoundCommitted(other), 10.0, SETTINGS) == (running(3), [])

    def test_a_member_that_never_saw_the_round_a_continuation_keeps_asks_for_a_new_one(self):
        # Round 3 replaced round 2 and was itself replaced (by a malformed
        # record) before this node saw it: its group waits for this node's
        # workers, and nothing this node sent asks for the round that starts them.
        again = round_of(3, "a", "b").continued(5, "x", "b", 1.0)
        stopped = dataclasses.replace(running(2), state=S.JOINING)
        view, commands = react(stopped, RoundCommitted(again), 10.0, SETTINGS)
        assert view == stopped
        assert commands == [RequestRestart(5, "round 5 continues round 3, whose workers this "
                                              "node never started", failure=False)]

    def test_job_success_ends_the_agent_and_sweeps_the_workers(self):
        done = dataclasses.replace(running(3), state=S.DONE)
        view, commands = react(done, RoundCommitted(round_of(4, "a", "b", outcome="succeeded")),
                               10.0, SETTINGS)
        assert view.state is S.SUCCEEDED and view.outcome_reason == "why"
        assert transitions(commands) == [S.STOPPING, S.SUCCEEDED]

    def test_job_failure_stops_running_workers(self):
        view, commands = react(running(3), RoundCommitted(round_of(4, "a", "b",
                                                                   outcome="failed")), 10.0,
                               SETTINGS)
        assert view.state is S.FAILED
        assert StopWorkers("job failed", StopGrace.FAILURE, StopCause.JOB_ENDED) in commands


class TestWorkerExits:
    def test_a_crash_requests_a_counted_restart_first_then_stops_the_workers(self):
        # The request first: the leader forms the next round while the workers stop.
        view, commands = react(running(3), WorkerExited(3, 1, 1, 99, 1), 10.0, SETTINGS)
        assert view.state is S.JOINING
        assert view.last_failure == "worker rank 1 (pid 99) exited with 1"
        assert kinds(commands).index("RequestRestart") < kinds(commands).index("StopWorkers")
        assert RequestRestart(3, "worker rank 1 (pid 99) exited with 1", failure=True) in commands

    def test_exits_of_other_rounds_or_stopped_workers_are_ignored(self):
        for exit_ in (WorkerExited(2, 0, 0, 9, 1), WorkerExited(3, 0, 0, 9, -9, stopped=True)):
            assert react(running(3), exit_, 10.0, SETTINGS) == (running(3), [])

    def test_all_workers_exit_0_means_done_at_the_barrier_not_success(self):
        view, first = react(running(3), WorkerExited(3, 0, 0, 9, 0), 10.0, SETTINGS)
        assert first == [] and view.state is S.RUNNING
        view, commands = react(view, WorkerExited(3, 1, 1, 10, 0), 11.0, SETTINGS)
        assert view.state is S.DONE
        assert transitions(commands) == [S.DONE]
        assert Report(ReportKind.DONE, 3) in commands
        assert not any(isinstance(c, StopWorkers) for c in commands)


def hang(view, tick, now, settings=SETTINGS, attributed=None):
    """A hang verdict at ``now``, answered at once with the attribution
    ``attributed`` (default: the verdict unchanged); the last reaction."""
    view, asked = react(view, tick, now, settings)
    assert asked == [AttributeHang(view.round_number, "; ".join(tick.hung))]
    return react(view, HangAttributed(view.round_number, attributed or "; ".join(tick.hung)),
                 now + 1.0, settings)


class TestTicks:
    def test_a_hung_worker_fails_the_round_with_the_attributed_reason(self):
        view, asked = react(running(3), Tick(hung=("rank 0 sent no heartbeat",)), 10.0,
                            SETTINGS)
        assert view.state is S.RUNNING, "nothing stops before the stacks are read"
        assert asked == [AttributeHang(3, "rank 0 sent no heartbeat")]
        assert react(view, Tick(hung=("rank 0 sent no heartbeat",)), 10.5, SETTINGS)[1] == []
        view, commands = react(view, HangAttributed(3, "rank 0 is in x.py:1 in f [...]"), 11.0,
                               SETTINGS)
        assert view.state is S.JOINING
        assert RequestRestart(3, "rank 0 is in x.py:1 in f [...]", failure=True) in commands

    def test_a_lost_attribution_fails_the_round_with_the_verdict_alone(self):
        view, _ = react(running(3), Tick(hung=("rank 0 made no progress",)), 10.0, SETTINGS)
        assert react(view, Tick(hung=("rank 0 made no progress",)), 14.9, SETTINGS)[1] == []
        view, commands = react(view, Tick(hung=("rank 0 made no progress",)), 15.1, SETTINGS)
        assert RequestRestart(3, "rank 0 made no progress", failure=True) in commands
        assert next_tick_at(running(3, hang_pending=(10.0, None)), Tick(), 14.0,
                            SETTINGS) == 10.0 + ATTRIBUTION_WAIT_S

    def test_an_attribution_for_a_round_already_stopped_changes_nothing(self):
        view, _ = react(running(3), Tick(hung=("rank 0",)), 10.0, SETTINGS)
        view, _ = react(view, WorkerExited(3, 1, 1, 99, 1), 10.5, SETTINGS)
        assert react(view, HangAttributed(3, "late"), 11.0, SETTINGS)[1] == []

    def test_no_hang_is_judged_while_etcd_is_in_doubt_and_that_time_never_counts(self):
        late = STORE_DOUBT_KEEPALIVES * KEEPALIVE_TTL_FRACTION * SETTINGS.lease_ttl_s + 0.1
        # A keep-alive late: a rank waiting on a commit through etcd is not hung.
        view, commands = react(running(3), Tick(hung=("rank 0",), lease_unconfirmed_s=late),
                               10.0, SETTINGS)
        assert kinds(commands) in ([], ["CheckPeersStore"]) and view.store_doubt_since == 10.0
        assert hangs_count_from(view, 12.0) == 12.0
        # etcd noted down for everyone: still no verdict.
        noted = dataclasses.replace(view, store_down_noted=True)
        assert not any(isinstance(c, AttributeHang)
                       for c in react(noted, Tick(hung=("rank 0",)), 13.0, SETTINGS)[1])
        # Back: the verdicts count from here, not from before the outage.
        view, commands = react(view, Tick(), 20.0, SETTINGS)
        assert view.store_doubt_since is None and hangs_count_from(view, 25.0) == 20.0
        view, commands = react(view, Tick(hung=("rank 0",)), 30.0, SETTINGS)
        assert commands == [AttributeHang(3, "rank 0")]

    def test_a_peer_not_serving_for_longer_than_a_ttl_fails_the_round(self):
        view, _ = react(running(3), peer(PeerHealth.NOT_SERVING), 10.0, SETTINGS)
        assert react(view, Tick(), 14.0, SETTINGS)[1] == []
        view, commands = react(view, Tick(), 14.1, SETTINGS)
        assert view.state is S.JOINING
        assert any(isinstance(c, RequestRestart) and "NOT_SERVING" in c.reason for c in commands)

    def test_a_peer_repeating_not_serving_does_not_restart_the_clock(self):
        # The health watch reports NOT_SERVING at every poll: the TTL counts
        # from the first report, not the latest.
        view = running(3)
        for now in (10.0, 11.0, 12.0, 13.0, 14.0):
            view, commands = react(view, peer(PeerHealth.NOT_SERVING), now, SETTINGS)
            assert commands == []
        assert view.peer_unhealthy == ("b", 10.0)
        view, commands = react(view, Tick(), 14.1, SETTINGS)
        assert view.state is S.JOINING
        assert any(isinstance(c, RequestRestart) and "NOT_SERVING" in c.reason for c in commands)

    def test_a_peer_serving_again_restarts_the_clock(self):
        view, _ = react(running(3), peer(PeerHealth.NOT_SERVING), 10.0, SETTINGS)
        view, _ = react(view, peer(PeerHealth.SERVING), 12.0, SETTINGS)
        view, _ = react(view, peer(PeerHealth.NOT_SERVING), 13.0, SETTINGS)
        assert react(view, Tick(), 16.0, SETTINGS)[1] == []
        assert react(view, Tick(), 17.1, SETTINGS)[0].state is S.JOINING

    def test_an_unreachable_peer_is_reported_once_as_a_suspect(self):
        view, commands = react(running(3), peer(PeerHealth.UNREACHABLE), 10.0, SETTINGS)
        assert Report(ReportKind.SUSPECT, 3, about="b") in commands
        assert view.state is S.RUNNING  # the lease, not this, decides who is gone
        assert react(view, peer(PeerHealth.UNREACHABLE), 11.0, SETTINGS)[1] == []

    def test_never_included_within_the_join_timeout_fails_naming_the_registration_problem(self):
        view = AgentView(state=S.JOINING, waiting_since=0.0)
        assert react(view, Tick(), 60.0, SETTINGS)[1] == []
        _, commands = react(view, Tick(registration_problem="id held by a live agent"), 60.1,
                            SETTINGS)
        (fail,) = commands
        assert isinstance(fail, Fail) and isinstance(fail.error, RendezvousTimeoutError)
        assert "within 60 s (id held by a live agent)" in str(fail.error)


class TestFrozenPeer:
    """--freeze-timeout 1: a ring peer whose agent answered no probe for that long."""

    FREEZE = dataclasses.replace(SETTINGS, freeze_timeout_s=1.0)

    def test_a_peer_silent_for_the_freeze_timeout_is_reported_frozen_once_per_round(self):
        view, commands = react(running(3), PeerSilent("b", 0.75), 10.0, self.FREEZE)
        assert commands == []  # not yet
        view, commands = react(view, PeerSilent("b", 1.0), 10.25, self.FREEZE)
        assert Report(ReportKind.FROZEN, 3, about="b", silent_s=1.0) in commands
        assert view.state is S.RUNNING  # the leader decides; its round stops the workers
        assert react(view, PeerSilent("b", 1.25), 10.5, self.FREEZE)[1] == []
        view, _ = react(view, RoundCommitted(round_of(4, "a", "b")), 11.0, self.FREEZE)
        _, commands = react(view, PeerSilent("b", 1.0), 12.0, self.FREEZE)
        assert Report(ReportKind.FROZEN, 4, about="b", silent_s=1.0) in commands

    def test_a_freeze_timeout_of_zero_reports_nothing(self):
        assert react(running(3), PeerSilent("b", 60.0), 10.0, SETTINGS)[1] == []

    def test_only_the_ring_peer_of_the_running_round_is_reported(self):
        # a's ring peer in (a, b, c) is b: a late probe of c (the peer of an
        # earlier round) reports nothing.
        view = running(3, "a", "b", "c")
        assert react(view, PeerSilent("c", 2.0), 10.0, self.FREEZE)[1] == []
        for state in (S.STARTING, S.STANDBY, S.DONE):
            stopped = dataclasses.replace(running(3), state=state)
            assert react(stopped, PeerSilent("b", 2.0), 10.0, self.FREEZE)[1] == []
        joining_afresh = AgentView(state=S.JOINING)
        assert react(joining_afresh, PeerSilent("b", 2.0), 10.0, self.FREEZE)[1] == []

    def test_a_peer_whose_death_broke_the_workers_is_still_watched_and_reported(self):
        # The dead peer b leads: a's workers fail on the broken collective
        # before a's probes count b silent, and only a can end b's lease.
        view, commands = react(running(3), WorkerExited(3, 0, 0, 9, 1), 10.0, self.FREEZE)
        assert view.state is S.JOINING
        assert not any(isinstance(c, WatchPeer) for c in commands)  # b is still probed
        view, commands = react(view, PeerSilent("b", 1.0), 10.8, self.FREEZE)
        assert Report(ReportKind.FROZEN, 3, about="b", silent_s=1.0) in commands
        assert react(view, PeerSilent("b", 1.25), 11.0, self.FREEZE)[1] == []  # once

    def test_the_old_rounds_peer_is_let_go_when_the_next_round_comes(self):
        stopped, _ = react(running(3), WorkerExited(3, 0, 0, 9, 1), 10.0, self.FREEZE)
        view, commands = react(stopped, RoundCommitted(round_of(4, "a", "c")), 11.0,
                               self.FREEZE)
        assert commands.index(WatchPeer(None)) < commands.index(WatchPeer("c", "c:1"))
        standby, commands = react(stopped, RoundCommitted(round_of(4, "b", "c")), 11.0,
                                  self.FREEZE)
        assert standby.state is S.STANDBY and WatchPeer(None) in commands
        assert react(standby, PeerSilent("b", 2.0), 12.0, self.FREEZE)[1] == []


class TestPartition:
    """Cut off from etcd: ask the peers; stop only if one of them still has it."""

    def test_an_unconfirmed_lease_asks_members_and_standbys_again_every_quarter_ttl(self):
        view = AgentView(state=S.RUNNING, round=round_of(3, "a", "b", "c"), started_at=0.0,
                         rounds_started=1)
        standbys = ("d:1",)
        assert react(view, Tick(lease_unconfirmed_s=2.0, standby_addrs=standbys), 10.0,
                     SETTINGS)[1] == []
        view, commands = react(view, Tick(lease_unconfirmed_s=2.1, standby_addrs=standbys),
                               10.0, SETTINGS)
        assert commands == [CheckPeersStore(("b:1", "c:1", "d:1"))]
        assert react(view, Tick(lease_unconfirmed_s=2.5), 10.9, SETTINGS)[1] == []
        assert react(view, Tick(lease_unconfirmed_s=3.1), 11.0, SETTINGS)[1] != []

    def test_a_peer_with_etcd_means_this_node_is_cut_off_kill_before_the_lease_can_expire(self):
        # TTL 4: at 2.5 s unconfirmed it may still be a reconnect to another
        # etcd member (a leader election); at 0.7 TTL it stops at once.
        early, commands = react(running(3), LeaseState(2.5, (("b:1", 0.4),), 1), 10.0, SETTINGS)
        assert commands == [] and early.state is S.RUNNING
        view, commands = react(early, Tick(lease_unconfirmed_s=2.8), 10.3, SETTINGS)
        assert view.state is S.JOINING
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert stop.fast
        assert "cut off from etcd for 2.8 s while 1 of 1 peers still reach it" in stop.reason
        # When back, a new round (not a failure) brings everyone together again.
        assert RequestRestart(3, stop.reason, failure=False) in commands

    @pytest.mark.parametrize("asked,answered,why", [
        (2, 0, "only 0 of 2 peers answered"),  # cut off from everyone
        (3, 2, "only 2 of 3 peers answered"),  # the silent one may have etcd
        (0, 0, "there is no peer to ask"),  # alone: nothing proves an outage
    ])
    def test_an_outage_is_proven_only_when_every_peer_answers_without_etcd(self, asked,
                                                                           answered, why):
        view, commands = react(running(3), LeaseState(2.8, (), asked, peers_answered=answered),
                               10.0, SETTINGS)
        assert view.state is S.JOINING
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert stop.fast and why in stop.reason

    def test_no_peer_with_etcd_means_etcd_is_down_and_training_goes_on(self):
        view, commands = react(running(3), LeaseState(2.5, (), 3), 10.0, SETTINGS)
        assert view.state is S.RUNNING
        assert kinds(commands) == ["Note"] and "training goes on" in commands[0].message
        assert react(view, LeaseState(3.0, (), 3), 11.0, SETTINGS)[1] == []  # said once

    def test_a_peer_confirmed_just_before_an_outage_of_etcd_is_no_proof(self):
        # etcd went down for everyone 1.6 s ago: this node's last keep-alive
        # landed 2.8 s ago, the peer's just before the outage (1.6 s ago),
        # less than one keep-alive interval (TTL/3) after this node's.
        view, commands = react(running(3), LeaseState(2.8, (("b:1", 1.6), ("c:1", 2.0)), 2),
                               10.0, SETTINGS)
        assert view.state is S.RUNNING and kinds(commands) == ["Note"]
        # A peer confirmed after this node's keep-alives stopped is proof.
        view, commands = react(running(3), LeaseState(2.8, (("b:1", 1.4), ("c:1", 2.0)), 2),
                               10.0, SETTINGS)
        assert view.state is S.JOINING and "1 of 2 peers still reach it" in str(commands)

    def test_a_peer_confirmed_within_a_keepalive_is_asked_again_not_taken_for_an_outage(self):
        # This node cut off 2.2 s ago (TTL 4, keep-alive 1.33 s); peer c, which never
        # lost etcd, last renewed 1.0 s ago. That proves neither an outage nor c's
        # etcd: taken for an outage, c's next renewal would pass for etcd's return
        # and the workers would stop past the lease's expiry.
        view, commands = react(running(3), LeaseState(2.2, (("b:1", 2.0), ("c:1", 1.0)), 2),
                               10.0, SETTINGS)
        assert view.state is S.RUNNING and commands == [] and not view.store_down_noted
        # Asked again: c renewed since, b did not. This node is cut off.
        view, commands = react(view, LeaseState(3.0, (("b:1", 2.8), ("c:1", 0.3)), 2),
                               10.8, SETTINGS)
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert view.state is S.JOINING and "cut off from etcd for 3.0 s" in stop.reason

    def test_a_peer_back_first_after_an_outage_of_etcd_leaves_time_to_reconnect(self):
        # etcd was down for everyone (proven), then a peer renewed 0.2 s ago:
        # etcd is back, and a new etcd leader renewed this node's lease too.
        down, _ = react(running(3), LeaseState(2.5, (("b:1", 2.2),), 1), 10.0, SETTINGS)
        assert down.store_down_noted
        view, commands = react(down, LeaseState(19.9, (("b:1", 0.2),), 1), 27.4, SETTINGS)
        assert view.state is S.RUNNING and commands == []
        assert react(view, Tick(lease_unconfirmed_s=20.5), 28.0, SETTINGS)[0].state is S.RUNNING
        # Still not renewed 0.7 TTL after the peer came back: this node is cut off.
        view, commands = react(view, Tick(lease_unconfirmed_s=22.5), 30.0, SETTINGS)
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert view.state is S.JOINING and "cut off from etcd for 2.8 s" in stop.reason

    def test_a_lease_confirmed_again_before_the_deadline_keeps_the_workers(self):
        # An etcd leader election: peers reached etcd, this node reconnected in time.
        early, _ = react(running(3), LeaseState(2.5, (("b:1", 0.4),), 1), 10.0, SETTINGS)
        view, _ = react(early, Tick(lease_unconfirmed_s=0.3), 10.5, SETTINGS)
        assert view.state is S.RUNNING and view.cut_off == ""
        assert react(view, Tick(lease_unconfirmed_s=0.8), 11.0, SETTINGS)[1] == []

    def test_an_answer_after_the_lease_was_confirmed_again_changes_nothing(self):
        assert react(running(3), LeaseState(0.5, (("b:1", 0.4),), 1), 10.0, SETTINGS)[1] == []


def test_drain_stops_workers_and_leaves():
    view, commands = react(running(3), DrainRequested("maintenance"), 10.0, SETTINGS)
    assert view.state is S.SUCCEEDED
    assert transitions(commands) == [S.DRAINING, S.SUCCEEDED]
    assert kinds(commands).index("StopWorkers") < kinds(commands).index("Leave")
    # The leader learns of the drain before the peers' workers fail on this node.
    assert kinds(commands).index("AnnounceDrain") < kinds(commands).index("StopWorkers")


def test_sigterm_drains_the_node_and_exits_with_the_drain_code():
    view, commands = react(running(3), Signalled(15), 10.0, SETTINGS)
    in_kubernetes, _ = react(running(3), Signalled(15), 10.0,
                             dataclasses.replace(SETTINGS, drain_exit_code=143))

    assert view.state is S.SUCCEEDED and view.exit_code == 0
    assert transitions(commands) == [S.DRAINING, S.SUCCEEDED]
    assert kinds(commands).index("StopWorkers") < kinds(commands).index("Leave")
    assert view.outcome_reason == "drained: received SIGTERM"
    assert in_kubernetes.exit_code == 143


def test_sigint_drains_too_and_exits_as_the_shell_reports_it():
    view, _ = react(running(3), Signalled(2), 10.0, SETTINGS)
    assert view.state is S.SUCCEEDED and view.exit_code == 130


def test_a_final_agent_reacts_to_nothing():
    final = AgentView(state=S.SUCCEEDED)
    assert react(final, RoundCommitted(round_of(9, "a")), 1.0, SETTINGS) == (final, [])


def test_an_unknown_event_is_a_bug():
    with pytest.raises(TypeError):
        react(AgentView(), object(), 1.0, SETTINGS)


class TestNextTick:
    """How long the loop may sleep: until time alone could change a Tick's verdict."""

    def test_a_steady_node_sleeps_until_its_lease_has_gone_unconfirmed_for_half_a_ttl(self):
        # TTL 4: peers are asked once the lease is unconfirmed for over 2 s.
        assert next_tick_at(running(3), Tick(lease_unconfirmed_s=0.5), 10.0, SETTINGS) == 11.5

    def test_a_worker_that_could_be_judged_hung_sooner_wakes_it_sooner(self):
        tick = Tick(lease_unconfirmed_s=0.5, next_hang_at=10.7)
        assert next_tick_at(running(3), tick, 10.0, SETTINGS) == 10.7

    def test_an_unhealthy_peer_wakes_it_when_a_ttl_of_unhealth_has_passed(self):
        view = running(3, peer_unhealthy=("b", 7.5))  # sooner than the lease's 12.0
        assert next_tick_at(view, Tick(lease_unconfirmed_s=0.0), 10.0, SETTINGS) == 11.5

    @pytest.mark.parametrize("view,tick", [
        (running(3), Tick(lease_unconfirmed_s=2.1)),  # in doubt: ask every quarter TTL
        (running(3, peers_asked_at=9.0), Tick(lease_unconfirmed_s=0.5)),  # reset pending
        (running(3, cut_off_since=9.0, cut_off="x"), Tick(lease_unconfirmed_s=0.5)),
        (AgentView(state=S.JOINING, waiting_since=0.0), Tick()),  # a round forming
    ])
    def test_time_matters_at_every_pass_while_a_round_forms_or_the_lease_is_in_doubt(self, view,
                                                                                   tick):
        assert next_tick_at(view, tick, 10.0, SETTINGS) == 10.0

    @given(unconfirmed=st.floats(0.0, 2.0), unhealthy_for=st.none() | st.floats(0.0, 4.0),
           fraction=st.floats(0.0, 0.999))
    def test_no_verdict_changes_before_the_deadline(self, unconfirmed, unhealthy_for, fraction):
        # Nothing arrives meanwhile: the lease ages with the clock, the peer stays unhealthy.
        now = 100.0
        view = running(3, peer_unhealthy=None if unhealthy_for is None
                       else ("b", now - unhealthy_for))
        wake_at = next_tick_at(view, Tick(lease_unconfirmed_s=unconfirmed), now, SETTINGS)
        assert wake_at >= now
        then = now + (wake_at - now) * fraction
        assert react(view, Tick(lease_unconfirmed_s=unconfirmed + then - now), then,
                     SETTINGS) == react(view, Tick(lease_unconfirmed_s=unconfirmed), now,
                                        SETTINGS)
        # ... and at the deadline, or just after, one does.
        late = wake_at + 0.01
        assert react(view, Tick(lease_unconfirmed_s=unconfirmed + late - now), late,
                     SETTINGS) != react(view, Tick(lease_unconfirmed_s=unconfirmed), now,
                                        SETTINGS)



class TestStopGrace:
    """Which grace each stop gives the workers: the drain's for planned stops,
    the failure's where survivors may be stuck in a collective (issue 23, defect 5)."""

    @staticmethod
    def grace(commands):
        return next(c for c in commands if isinstance(c, StopWorkers)).grace

    def test_a_local_failure_and_a_hang_stop_with_the_failure_grace(self):
        _, crashed = react(running(3), WorkerExited(3, 1, 1, 99, 1), 10.0, SETTINGS)
        _, hung = hang(running(3), Tick(hung=("rank 1",)), 200.0)
        assert self.grace(crashed) is StopGrace.FAILURE
        assert self.grace(hung) is StopGrace.FAILURE

    @pytest.mark.parametrize("members,failures,grace", [
        (("a", "b"), (50.0,), StopGrace.FAILURE),  # a failure elsewhere in the round
        (("a",), (), StopGrace.FAILURE),  # b lost, drained or left out
        (("a", "b"), (), StopGrace.FAILURE),  # b restarted, or an operator's restart
        (("a", "c"), (), StopGrace.FAILURE),  # b gone, c joined
        (("a", "b", "c"), (50.0,), StopGrace.FAILURE),  # a failure, and c joined
        (("a", "b", "c"), (), StopGrace.DRAIN),  # a scale-up only
    ])
    def test_a_new_round_stops_with_the_failure_grace_unless_it_only_adds_members(
            self, members, failures, grace):
        new = dataclasses.replace(round_of(4, *members), failures=failures)
        _, commands = react(running(3), RoundCommitted(new), 10.0, SETTINGS)
        assert self.grace(commands) is grace

    def test_a_failure_that_ages_out_of_the_window_is_not_taken_for_a_new_one(self):
        old = dataclasses.replace(round_of(3, "a", "b"), failures=(40.0, 50.0))
        view = dataclasses.replace(running(3), round=old)
        new = dataclasses.replace(round_of(4, "a", "b", "c"), failures=(50.0,))
        assert self.grace(react(view, RoundCommitted(new), 10.0, SETTINGS)[1]) \
            is StopGrace.DRAIN
        new = dataclasses.replace(new, failures=(50.0, 60.0))
        assert self.grace(react(view, RoundCommitted(new), 10.0, SETTINGS)[1]) \
            is StopGrace.FAILURE

    def test_drains_and_signals_give_the_drain_grace(self):
        for event in (DrainRequested("maintenance"), Signalled(15), Signalled(2)):
            assert self.grace(react(running(3), event, 10.0, SETTINGS)[1]) is StopGrace.DRAIN

    def test_the_job_s_end_gives_the_drain_grace_for_success_the_failure_grace_for_failure(self):
        for outcome, grace in (("succeeded", StopGrace.DRAIN), ("failed", StopGrace.FAILURE)):
            _, commands = react(running(3), RoundCommitted(round_of(4, "a", "b",
                                                                   outcome=outcome)),
                                10.0, SETTINGS)
            assert self.grace(commands) is grace

    def test_cut_off_from_etcd_gives_none(self):
        _, commands = react(running(3), LeaseState(2.8, (("b:1", 0.4),), 1), 10.0, SETTINGS)
        assert self.grace(commands) is StopGrace.NONE


@pytest.mark.parametrize("grace,seconds", [(StopGrace.DRAIN, 90.0), (StopGrace.FAILURE, 3.0),
                                           (StopGrace.NONE, 0.0)])
def test_each_grace_in_seconds(grace, seconds):
    assert StopWorkers("why", grace, StopCause.REQUESTED).grace_s(90.0, 3.0) == seconds


def test_a_failure_never_waits_longer_than_a_drain():
    assert StopWorkers("why", StopGrace.FAILURE, StopCause.WORKER_EXIT).grace_s(1.0, 3.0) == 1.0


class TestStopCauses:
    """Each stop carries why (a restart or not) and how long the fault went
    undetected here: what the metrics count, never read from a reason's text."""

    @staticmethod
    def stop(commands):
        (stop,) = [c for c in commands if isinstance(c, StopWorkers)]
        return stop.cause, stop.detect_s

    def test_a_worker_exit_is_detected_at_once(self):
        _, commands = react(running(3), WorkerExited(3, 1, 1, 99, 1), 10.0, SETTINGS)
        assert self.stop(commands) == (StopCause.WORKER_EXIT, 0.0)

    def test_a_hang_is_detected_from_the_last_sign_of_life_when_known(self):
        _, commands = hang(running(3), Tick(hung=("rank 1",), hung_since=8.5), 40.0)
        assert self.stop(commands) == (StopCause.WORKER_HANG, 31.5)
        _, commands = hang(running(3), Tick(hung=("rank 1",)), 40.0)
        assert self.stop(commands) == (StopCause.WORKER_HANG, None)

    def test_an_unhealthy_peer_is_detected_from_its_first_not_serving(self):
        view = running(3, peer_unhealthy=("b", 10.0))
        _, commands = react(view, Tick(), 14.5, SETTINGS)
        assert self.stop(commands) == (StopCause.PEER_UNHEALTHY, 4.5)

    def test_a_cut_off_is_detected_from_the_lease_last_confirmed(self):
        _, commands = react(running(3), LeaseState(3.0, (("b:1", 0.1),), 1), 10.0, SETTINGS)
        assert self.stop(commands) == (StopCause.STORE_CUT_OFF, 3.0)
        early, _ = react(running(3), LeaseState(2.5, (("b:1", 0.4),), 1), 10.0, SETTINGS)
        _, commands = react(early, Tick(lease_unconfirmed_s=2.9), 10.3, SETTINGS)
        assert self.stop(commands) == (StopCause.STORE_CUT_OFF, 2.9)

    @pytest.mark.parametrize("members,failures,cause", [
        (("a",), (), StopCause.NODE_LEFT),
        (("a", "c"), (9.0,), StopCause.NODE_LEFT),  # someone left: whatever else changed
        (("a", "b"), (9.0,), StopCause.PEER_FAILURE),
        (("a", "b", "c"), (9.0,), StopCause.PEER_FAILURE),
        (("a", "b", "c"), (), StopCause.NODE_JOINED),
        (("b", "a"), (), StopCause.REQUESTED),
    ])
    def test_a_new_round_is_classified_by_its_members_and_failures(self, members, failures,
                                                                   cause):
        new = dataclasses.replace(round_of(4, *members), failures=failures)
        _, commands = react(running(3), RoundCommitted(new), 10.0, SETTINGS)
        assert self.stop(commands) == (cause, None) and cause.restart

    def test_a_large_jobs_round_is_classified_by_its_delta_or_else_as_someone_leaving(self):
        old = bucket_round(3, "a", "b", "c")
        view = dataclasses.replace(running(3), round=old)
        joined = bucket_round(4, "a", "b", "c", "d", delta={
            "base": old.members.name, "left": [], "joined": [["d", "h", 2, "d:1", ""]]})
        _, commands = react(view, RoundCommitted(joined), 10.0, SETTINGS)
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert (stop.cause, stop.grace) == (StopCause.NODE_JOINED, StopGrace.DRAIN)
        # No delta from the running round's roster: who left cannot be told
        # here, and survivors may be stuck in a collective.
        _, commands = react(view, RoundCommitted(bucket_round(4, "a", "b", "c", "d")), 10.0,
                            SETTINGS)
        stop = next(c for c in commands if isinstance(c, StopWorkers))
        assert (stop.cause, stop.grace) == (StopCause.NODE_LEFT, StopGrace.FAILURE)

    def test_the_reason_s_text_never_decides(self):
        a = round_of(4, "a")
        b = dataclasses.replace(a, reason="restart requested by b: worker exited with 1")
        assert self.stop(react(running(3), RoundCommitted(a), 10.0, SETTINGS)[1]) == \
            self.stop(react(running(3), RoundCommitted(b), 10.0, SETTINGS)[1])

    @pytest.mark.parametrize("event,cause", [
        (RoundCommitted(round_of(4, "a", "b", outcome="succeeded")), StopCause.JOB_ENDED),
        (RoundCommitted(round_of(4, "a", "b", outcome="failed")), StopCause.JOB_ENDED),
        (DrainRequested("maintenance"), StopCause.LEAVING),
        (Signalled(15), StopCause.LEAVING),
        (RoundCommitted(round_of(4, "b"), drain_requested=True), StopCause.LEAVING),
    ])
    def test_the_end_of_the_job_and_leaving_it_are_no_restarts(self, event, cause):
        _, commands = react(running(3), event, 10.0, SETTINGS)
        causes = [c.cause for c in commands if isinstance(c, StopWorkers)]
        assert causes and set(causes) == {cause} and not cause.restart


class TestJoiningAndGivingUp:
    def test_an_agent_starts_in_init_and_joins_once(self):
        view, commands = react(AgentView(state=S.INIT), Joined("registered"), 1.0, SETTINGS)
        assert view.state is S.JOINING and commands == [Transition(S.JOINING, "registered", 0)]
        assert react(view, Joined("again"), 2.0, SETTINGS) == (view, [])

    def test_giving_up_ends_failed_with_the_reason(self):
        view, commands = react(running(3), GaveUp("etcd refused"), 1.0, SETTINGS)
        assert view.state is S.FAILED and view.outcome_reason == "etcd refused"
        assert commands == [Transition(S.FAILED, "etcd refused", 3)]
        assert react(view, GaveUp("later"), 2.0, SETTINGS) == (view, [])


class TestAnswers:
    """What the agent's other threads answer from the view, with ``now`` passed in."""

    def test_a_heartbeat_of_the_running_round_counts_one_of_another_round_is_told_to_stop(self):
        assert heartbeat_reply(running(3), 3, 9.0, 10.0, SETTINGS) == HeartbeatReply(
            current=True, stop=False, hold=False)
        stale = heartbeat_reply(running(3), 2, 9.0, 10.0, SETTINGS)
        assert not stale.current and stale.stop

    def test_workers_of_a_node_not_running_are_told_to_stop_those_of_a_done_one_are_not(self):
        stopped = dataclasses.replace(running(3), state=S.JOINING)
        assert heartbeat_reply(stopped, 3, 9.0, 10.0, SETTINGS).stop
        done = dataclasses.replace(running(3), state=S.DONE)
        assert not heartbeat_reply(done, 3, 9.0, 10.0, SETTINGS).stop

    def test_workers_hold_while_the_lease_is_unconfirmed_for_half_a_ttl(self):
        # TTL 4: hold once the lease has gone unconfirmed for over 2 s.
        assert not heartbeat_reply(running(3), 3, 8.0, 10.0, SETTINGS).hold
        assert heartbeat_reply(running(3), 3, 7.9, 10.0, SETTINGS).hold
        assert not heartbeat_reply(running(3), 3, None, 10.0, SETTINGS).hold  # never confirmed
        # ... unless etcd is proven down for everyone: training goes on.
        down = running(3, store_down_noted=True)
        assert not heartbeat_reply(down, 3, 7.0, 10.0, SETTINGS).hold

    def test_a_peer_with_etcd_proves_a_node_with_an_unconfirmed_lease_cut_off(self):
        reply = store_health(running(3), True, 7.0, True, "b", 10.0, SETTINGS)
        assert (reply.reachable, reply.lease_age_s, reply.running) == (False, 3.0, True)
        assert reply.cut_off == LeaseState(3.0, (("b", 0.0),), 1)

    @pytest.mark.parametrize("view,registered,confirmed_at,asker_has_store", [
        (running(3), True, 9.0, True),  # reachable: nothing proven
        (running(3), True, 7.0, False),  # the asker does not reach etcd either
        (AgentView(state=S.JOINING), True, 7.0, True),  # no workers to stop
    ])
    def test_nothing_else_proves_it(self, view, registered, confirmed_at, asker_has_store):
        reply = store_health(view, registered, confirmed_at, asker_has_store, "b", 10.0,
                             SETTINGS)
        assert reply.cut_off is None

    def test_an_unregistered_or_never_confirmed_node_does_not_reach_etcd(self):
        assert not store_health(running(3), False, 9.0, False, "", 10.0, SETTINGS).reachable
        never = store_health(running(3), True, None, True, "", 10.0, SETTINGS)
        assert never.lease_age_s == -1.0 and never.cut_off == LeaseState(-1.0,
                                                                          (("a peer", 0.0),), 1)

    def test_a_new_lease_reports_done_again(self):
        done = dataclasses.replace(running(3), state=S.DONE)
        assert reports_for_new_lease(done) == [Report(ReportKind.DONE, 3)]
        assert reports_for_new_lease(running(3)) == []


# -- The reactor's transitions follow the lifecycle table ------------------------------

_MEMBERS = st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True)
_EVENT = st.one_of(
    st.tuples(st.just("round"), _MEMBERS, st.sampled_from(["", "", "", "succeeded", "failed"]),
              st.booleans(), st.booleans()),
    st.tuples(st.just("exit"), st.integers(0, 1), st.sampled_from([0, 0, 1]), st.booleans()),
    st.tuples(st.just("peer"), st.sampled_from(list(PeerHealth))),
    st.tuples(st.just("lease"), st.floats(0.0, 4.0), st.floats(-1.0, 4.0), st.integers(0, 2)),
    st.tuples(st.just("tick"), st.booleans(), st.floats(0.0, 4.0)),
    st.tuples(st.just("gpus"), st.sampled_from(list(GpuAction))),
    st.tuples(st.just("drain"),), st.tuples(st.just("signal"), st.sampled_from([2, 15])),
    st.tuples(st.just("give up"),))


def _event(view, spec, number):
    kind = spec[0]
    if kind == "round":
        _, members, outcome, drain, again = spec
        if again and view.round is not None:  # the workers' round written again
            return RoundCommitted(view.round.continued(number, "again", members[0], 1.0))
        return RoundCommitted(round_of(number, *members, outcome=outcome), drain_requested=drain)
    if kind == "exit":
        _, rank, code, stopped = spec
        return WorkerExited(view.round_number, rank, rank, 9, code, stopped=stopped)
    if kind == "peer":
        return PeerHealthChanged("b", spec[1])
    if kind == "lease":
        return LeaseState(spec[1], (("b:1", spec[2]),), 1 + spec[3] % 2, peers_answered=spec[3])
    if kind == "tick":
        return Tick(hung=("rank 0",) if spec[1] else (), lease_unconfirmed_s=spec[2])
    if kind == "gpus":
        return GpuChecked(view.round_number, GpuDecision(spec[1], "r", wake_at=None))
    if kind == "drain":
        return DrainRequested("maintenance")
    if kind == "signal":
        return Signalled(spec[1])
    return GaveUp("an error")


@given(events=st.lists(_EVENT, max_size=25), gpu_check=st.sampled_from(["off", "enforce"]))
def test_every_reaction_moves_along_the_lifecycle_table(events, gpu_check):
    settings = dataclasses.replace(SETTINGS, gpu_check=gpu_check)
    view, now = AgentView(state=S.INIT), 0.0
    for i, spec in enumerate([("joined",)] + events):
        now += 0.7
        event = Joined("registered") if spec[0] == "joined" else _event(view, spec, i + 1)
        after, commands = react(view, event, now, settings)
        check_path(view.state, [c.to for c in commands if isinstance(c, Transition)],
                   after.state)
        assert after.state not in (S.STOPPING, S.DRAINING), "a state passed through was kept"
        view = after
