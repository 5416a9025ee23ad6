"""The leader's pure decisions, driven with explicit times: no store, no sleeping."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.errors import ConfigError
from elastic.rendezvous.api import FrozenReport, Member, NodeInfo, Outcome, RestartRequest, Round
from elastic.rendezvous.config import RendezvousConfig, default_freeze_timeout_s, parse_nnodes
from elastic.rendezvous.decisions import (
    FENCE_PATIENCE_TTLS,
    Action,
    Observed,
    decide,
    fence_lost_members,
    revoke_frozen,
    takeover_failed,
)


def cfg(min_nodes=2, max_nodes=4, settle_s=1.0):
    return RendezvousConfig(job_id="j", min_nodes=min_nodes, max_nodes=max_nodes,
                            settle_s=settle_s)


def nodes(*ids):
    return tuple(NodeInfo(node_id=i, host="127.0.0.1") for i in ids)


def round_of(number, *ids):
    return Round(number=number,
                 members=tuple(Member(i, r, "127.0.0.1", 1) for r, i in enumerate(ids)),
                 master_addr="127.0.0.1", master_port=1, reason="", leader=ids[0],
                 created_at=0.0)


class TestFirstRound:
    def test_waits_below_min_and_says_how_many_are_missing(self):
        d = decide(Observed(None, nodes("a"), {"a": 0.0}), 100.0, cfg(min_nodes=3))
        assert d.action is Action.WAIT
        assert "waiting for 2 more (min 3)" in d.reason
        assert d.wake_at is None  # only a new node can change this

    def test_closes_at_once_when_max_present(self):
        d = decide(Observed(None, nodes("a", "b", "c", "d"), dict.fromkeys("abcd", 9.9)), 10.0,
                   cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b", "c", "d")
        assert "max reached" in d.reason

    def test_min_present_waits_for_settle_window_from_last_arrival(self):
        obs = Observed(None, nodes("a", "b"), {"a": 0.0, "b": 5.0})
        d = decide(obs, 5.4, cfg(settle_s=1.0))
        assert d.action is Action.WAIT
        assert d.wake_at == pytest.approx(6.0)
        d = decide(obs, 6.0, cfg(settle_s=1.0))
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b")

    def test_extra_nodes_beyond_max_are_standbys_in_join_order(self):
        obs = Observed(None, nodes("a", "b", "c", "d", "e"), dict.fromkeys("abcde", 0.0))
        d = decide(obs, 0.0, cfg(max_nodes=3))
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b", "c")
        assert "2 beyond max wait as standby" in d.reason

    def test_draining_nodes_are_not_candidates(self):
        obs = Observed(None, nodes("a", "b", "c"), dict.fromkeys("abc", 0.0),
                       draining=frozenset({"b"}))
        d = decide(obs, 10.0, cfg())
        assert d.members == ("a", "c")


class TestLaterRounds:
    def test_healthy_round_stands_and_counts_standbys(self):
        obs = Observed(round_of(3, "a", "b"), nodes("a", "b", "c"), {"c": 0.0})
        d = decide(obs, 10.0, cfg(max_nodes=2))
        assert d.action is Action.WAIT
        assert d.reason == "round 3 stands with 2 members, 1 standby"

    def test_lost_member_closes_at_once_with_survivors_in_old_order(self):
        obs = Observed(round_of(3, "c", "a", "b"), nodes("a", "b"), {})
        d = decide(obs, 10.0, cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b")  # c is gone; a and b keep their relative order
        assert "lost c" in d.reason

    def test_lost_member_takes_a_settled_standby_along(self):
        obs = Observed(round_of(3, "a", "b"), nodes("a", "c", "d"), {"c": 0.0, "d": 0.5})
        d = decide(obs, 10.0, cfg(max_nodes=2))
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "c")  # c joined before d

    def test_below_min_after_a_loss_waits(self):
        obs = Observed(round_of(2, "a", "b", "c"), nodes("a"), {})
        d = decide(obs, 10.0, cfg(min_nodes=2))
        assert d.action is Action.WAIT
        assert "lost b, c" in d.reason and "waiting for 1 more" in d.reason

    def test_restart_request_for_current_round_gives_same_members(self):
        obs = Observed(round_of(5, "b", "a"), nodes("a", "b"), {},
                       restart_requests=(RestartRequest("a", 5, "worker 1 exited with 1"),))
        d = decide(obs, 10.0, cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("b", "a")
        assert "restart requested by a: worker 1 exited with 1" in d.reason

    def test_stale_restart_request_is_ignored(self):
        obs = Observed(round_of(5, "a", "b"), nodes("a", "b"), {},
                       restart_requests=(RestartRequest("a", 4, "old"),))
        assert decide(obs, 10.0, cfg()).action is Action.WAIT

    def test_joiner_scales_up_after_settling(self):
        obs = Observed(round_of(2, "a", "b"), nodes("a", "b", "c"), {"c": 10.0})
        d = decide(obs, 10.5, cfg())
        assert d.action is Action.WAIT and d.wake_at == pytest.approx(11.0)
        d = decide(obs, 11.0, cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b", "c")
        assert "joined c" in d.reason

    def test_joiner_filling_max_needs_no_settling(self):
        obs = Observed(round_of(2, "a", "b", "c"), nodes("a", "b", "c", "d"), {"d": 10.0})
        d = decide(obs, 10.0, cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b", "c", "d")

    def test_joiner_waits_for_the_next_checkpoint_when_asked_to(self):
        config = dataclasses.replace(cfg(max_nodes=3), scale_up_wait_s=60.0)
        obs = Observed(round_of(2, "a", "b"), nodes("a", "b", "c"), {"c": 10.0},
                       started={"a": 2, "b": 2})
        d = decide(obs, 12.0, config)
        assert d.action is Action.WAIT and "joining at the next checkpoint" in d.reason
        assert d.wake_at == pytest.approx(70.0)
        # A checkpoint committed after c registered: grow now, nothing to redo.
        d = decide(dataclasses.replace(obs, checkpointed_since=frozenset("abc")), 12.5, config)
        assert d.action is Action.CLOSE_ROUND and d.members == ("a", "b", "c")
        # No checkpoint within the wait: grow anyway.
        d = decide(obs, 70.0, config)
        assert d.action is Action.CLOSE_ROUND and "joined c" in d.reason

    def test_a_waiting_joiner_joins_a_round_formed_for_another_reason(self):
        config = dataclasses.replace(cfg(max_nodes=3), scale_up_wait_s=60.0)
        obs = Observed(round_of(2, "a", "b"), nodes("a", "b", "c"), {"c": 10.0},
                       restart_requests=(RestartRequest("a", 2, "worker 1 exited with 1"),))
        d = decide(obs, 12.0, config)
        assert d.action is Action.CLOSE_ROUND and d.members == ("a", "b", "c")

    def test_drained_member_leaves_in_the_next_round(self):
        obs = Observed(round_of(2, "a", "b", "c"), nodes("a", "b", "c"), {},
                       draining=frozenset({"b"}))
        d = decide(obs, 10.0, cfg())
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "c")
        assert "drained b" in d.reason

    def test_failures_reported_while_a_member_drains_cost_no_budget(self):
        obs = Observed(round_of(2, "a", "b", "c"), nodes("a", "b", "c"), {},
                       draining=frozenset({"b"}),
                       restart_requests=(RestartRequest("a", 2, "worker rank 0 exited with 1",
                                                        failure=True),))
        d = decide(obs, 10.0, dataclasses.replace(cfg(), max_restarts=0))
        assert d.action is Action.CLOSE_ROUND and d.members == ("a", "c")
        assert d.failures == ()

    def test_garbage_round_is_treated_as_no_round(self):
        d = decide(Observed(None, nodes("a", "b"), {"a": 0.0, "b": 0.0}), 10.0, cfg())
        assert d.action is Action.CLOSE_ROUND


class TestParseNnodes:
    @pytest.mark.parametrize("text,expected", [("3", (3, 3)), ("2:4", (2, 4)), ("1:1", (1, 1))])
    def test_valid(self, text, expected):
        assert parse_nnodes(text) == expected

    @pytest.mark.parametrize("text,needle", [
        ("3:2", "MIN (3) must not be greater than MAX (2)"),
        ("0", "at least 1"),
        ("a:b", "expected a node count"),
        ("1:2:3", "expected a node count"),
        ("-1:2", "expected a node count"),
        ("", "expected a node count"),
    ])
    def test_invalid_is_refused_with_the_value(self, text, needle):
        with pytest.raises(ConfigError) as info:
            parse_nnodes(text)
        assert needle in str(info.value)
        assert repr(text) in str(info.value)

    def test_config_validates_ids_and_times(self):
        with pytest.raises(ConfigError, match="invalid job id"):
            RendezvousConfig(job_id="a/b", min_nodes=1, max_nodes=1)
        with pytest.raises(ConfigError, match="lease TTL"):
            RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1, lease_ttl_s=0.5)


class TestRestartBudget:
    def failing(self, number, failures, now_failures=1):
        reqs = tuple(RestartRequest(f"n{i}", number, "worker exited with 1", failure=True)
                     for i in range(now_failures))
        r = round_of(number, "a", "b")
        r = Round(**{**r.__dict__, "failures": failures})
        return Observed(r, nodes("a", "b"), {}, restart_requests=reqs,
                        started=dict.fromkeys("ab", number))

    def test_a_failure_is_counted_once_per_round_however_many_nodes_report_it(self):
        d = decide(self.failing(3, (), now_failures=2), 100.0,
                   RendezvousConfig("j", 2, 4, max_restarts=3))
        assert d.action is Action.CLOSE_ROUND
        assert d.failures == (100.0,)

    def test_budget_spent_fails_the_job_with_the_reason(self):
        d = decide(self.failing(5, (90.0, 95.0, 99.0)), 100.0,
                   RendezvousConfig("j", 2, 4, max_restarts=3))
        assert d.action is Action.FAIL_JOB
        assert "restart budget spent: 4 failures within 3600 s (max restarts 3)" in d.reason

    def test_failures_outside_the_window_are_forgotten(self):
        d = decide(self.failing(5, (10.0, 20.0, 99.0)), 100.0,
                   RendezvousConfig("j", 2, 4, max_restarts=2, restart_window_s=30.0))
        assert d.action is Action.CLOSE_ROUND
        assert d.failures == (99.0, 100.0)

    def test_membership_changes_and_operator_restarts_do_not_count(self):
        r = Round(**{**round_of(5, "a", "b", "c").__dict__, "failures": (99.0,)})
        obs = Observed(r, nodes("a", "b"), {},
                       restart_requests=(RestartRequest("elasticctl", 5, "operator"),),
                       started=dict.fromkeys("abc", 5))
        d = decide(obs, 100.0, RendezvousConfig("j", 2, 4, max_restarts=1))
        assert d.action is Action.CLOSE_ROUND
        assert d.failures == (99.0,)

    def test_a_finished_job_decides_nothing(self):
        r = Round(**{**round_of(5, "a").__dict__, "outcome": "succeeded"})
        d = decide(Observed(r, nodes("b", "c"), {"b": 0.0, "c": 0.0}), 100.0, cfg())
        assert d.action is Action.WAIT and "job succeeded in round 5" in d.reason


class TestExitBarrier:
    """The job succeeds when every member's workers exited 0, never before."""

    def test_one_node_done_is_not_success_and_wakes_at_the_barrier_deadline(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b"), started=dict.fromkeys("ab", 4),
                       done={"a": (4, 100.0)})
        d = decide(obs, 105.0, RendezvousConfig("j", 2, 2, exit_barrier_timeout_s=30.0))
        assert d.action is Action.WAIT
        assert "1 member finished (exit barrier)" in d.reason
        assert d.wake_at == pytest.approx(130.0)

    def test_every_member_done_succeeds(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b"),
                       done={"a": (4, 100.0), "b": (4, 104.0)})
        d = decide(obs, 105.0, cfg())
        assert d.action is Action.SUCCEED_JOB
        assert d.reason == "round 4: the workers of all 2 members exited 0"

    def test_done_in_an_older_round_does_not_count(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b"), started=dict.fromkeys("ab", 4),
                       done={"a": (3, 100.0), "b": (4, 104.0)})
        assert decide(obs, 105.0, cfg()).action is Action.WAIT

    def test_stragglers_past_the_timeout_fail_the_job_by_name(self):
        obs = Observed(round_of(4, "a", "b", "c"), nodes("a", "b", "c"),
                       started=dict.fromkeys("abc", 4), done={"a": (4, 100.0)})
        config = RendezvousConfig("j", 2, 4, exit_barrier_timeout_s=30.0)
        assert decide(obs, 129.9, config).action is Action.WAIT
        d = decide(obs, 130.0, config)
        assert d.action is Action.FAIL_JOB
        assert "exit barrier timed out: a finished, but b, c still had running workers" in d.reason

    def test_joiners_wait_while_members_finish_but_a_failure_still_restarts(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b", "c"), {"c": 0.0},
                       started=dict.fromkeys("ab", 4), done={"a": (4, 100.0)})
        assert decide(obs, 101.0, cfg()).action is Action.WAIT
        failed = dataclasses.replace(obs, restart_requests=(
            RestartRequest("b", 4, "worker exited with 1", failure=True),))
        assert decide(failed, 101.0, cfg()).action is Action.CLOSE_ROUND


class TestSuspectsAndStartDeadline:
    """An unreachable agent whose lease still lives, or a member that never
    starts, is left out of the next round; suspicion alone starts none."""

    def test_a_suspect_is_left_out_of_a_round_formed_for_another_reason(self):
        obs = Observed(round_of(4, "a", "b", "c"), nodes("a", "b", "c"),
                       started=dict.fromkeys("abc", 4), suspects={"c": 100.0},
                       restart_requests=(RestartRequest("a", 4, "worker died", failure=True),))
        d = decide(obs, 101.0, cfg())  # lease TTL 5: suspicion lasts 10 s
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b")
        assert "left out c (agent does not answer)" in d.reason

    def test_suspicion_alone_does_not_start_a_round(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b"), started=dict.fromkeys("ab", 4),
                       suspects={"b": 100.0})
        d = decide(obs, 101.0, cfg())
        assert d.action is Action.WAIT
        assert d.wake_at == pytest.approx(110.0)

    def test_a_suspect_still_holds_its_place_against_a_joiner(self):
        # max 2, full: a joiner waits as a standby. Suspecting b must not free
        # b's place for c (the lease, not the suspicion, says who is gone).
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b", "c"),
                       {"a": 0.0, "b": 0.0, "c": 50.0}, started=dict.fromkeys("ab", 4),
                       suspects={"b": 100.0})
        d = decide(obs, 101.0, cfg(max_nodes=2))
        assert d.action is Action.WAIT
        assert "1 standby" in d.reason

    def test_too_few_without_the_suspect_waits_until_the_suspicion_ends(self):
        obs = Observed(round_of(4, "a", "b"), nodes("a", "b"), started=dict.fromkeys("ab", 4),
                       suspects={"b": 100.0},
                       restart_requests=(RestartRequest("a", 4, "peer lost", failure=True),))
        d = decide(obs, 101.0, cfg())
        assert d.action is Action.WAIT and "waiting for 1 more (min 2)" in d.reason
        assert d.wake_at == pytest.approx(110.0)
        assert decide(obs, 110.0, cfg()).members == ("a", "b")

    def test_a_member_that_never_started_is_dropped_after_the_start_timeout(self):
        r = dataclasses.replace(round_of(4, "a", "b", "c"), created_at=100.0)
        obs = Observed(r, nodes("a", "b", "c"), started={"a": 4, "b": 4, "c": 3})
        config = RendezvousConfig("j", 2, 4, start_timeout_s=30.0)
        early = decide(obs, 129.0, config)
        assert early.action is Action.WAIT and early.wake_at == pytest.approx(130.0)
        d = decide(obs, 130.0, config)
        assert d.action is Action.CLOSE_ROUND
        assert d.members == ("a", "b")
        assert "c did not start workers within 30 s" in d.reason
        assert d.suspects == ("c",)


def test_a_member_registered_again_since_the_round_gets_a_new_round():
    # Its agent was restarted (or lost its lease and came back): the member set
    # looks the same, but its workers of the round are gone.
    obs = Observed(round_of(4, "a", "b"), nodes("a", "b"), started=dict.fromkeys("ab", 4),
                   registered_since_round=frozenset({"b"}))
    d = decide(obs, 10.0, cfg())
    assert d.action is Action.CLOSE_ROUND
    assert d.members == ("a", "b")
    assert "registered again: b" in d.reason


def test_a_member_back_after_an_etcd_outage_with_its_workers_running_keeps_the_round():
    # Its lease ran out while etcd could not be reached; its workers trained on.
    from elastic.rendezvous.view import LeaderView
    from elastic.keyspace import JobKeys

    keys = JobKeys("j")
    view = LeaderView(keys, lambda exc, rev: None)
    back = NodeInfo(node_id="b", host="h", running_round=4)
    restarted = NodeInfo(node_id="a", host="h", running_round=0)
    view.apply_node(keys.node("b"), back.to_json(), 50, 0.0)
    view.apply_node(keys.node("a"), restarted.to_json(), 51, 0.0)
    observed = view.observed(round_of(4, "a", "b"), round_revision=40)
    assert observed.registered_since_round == frozenset({"a"})


def test_a_round_written_again_is_the_round_it_continues():
    # Garbage replaced round 4; the leader wrote it again as round 6. What the
    # members reported or asked about round 4 counts for round 6.
    again = round_of(4, "a", "b").continued(6, "again", "a", 100.0)
    config = RendezvousConfig("j", 2, 4, start_timeout_s=30.0)
    standing = Observed(again, nodes("a", "b"), started=dict.fromkeys("ab", 4))
    d = decide(standing, 200.0, config)  # long after the start timeout: both started
    assert d.action is Action.WAIT and d.reason == "round 6 stands with 2 members"
    asked = dataclasses.replace(standing, restart_requests=(
        RestartRequest("a", 4, "worker died", failure=True),))
    d = decide(asked, 200.0, config)
    assert d.action is Action.CLOSE_ROUND and "restart requested by a" in d.reason
    finished = dataclasses.replace(standing, done={"a": (4, 150.0), "b": (6, 160.0)})
    assert decide(finished, 200.0, config).action is Action.SUCCEED_JOB


# -- The leader's own waits: monotonic now, passed in -------------------------

TTL = 3.0


class TestFenceLostMembers:
    def test_stopped_workers_let_the_round_form_at_once(self):
        v = fence_lost_members(("b:1",), True, None, 100.0, TTL)
        assert v.proceed and v.since is None and not v.overdue
        assert v.reason == "the workers of lost members at b:1 stopped"

    def test_running_workers_hold_the_round_and_the_wait_starts_now(self):
        v = fence_lost_members(("b:1", "c:1"), False, None, 100.0, TTL)
        assert not v.proceed and v.since == 100.0
        assert v.reason == "waiting for the workers of lost members at b:1, c:1 to stop"

    def test_the_wait_keeps_its_start_until_three_ttls_have_passed(self):
        v = fence_lost_members(("b:1",), False, 100.0, 100.0 + 3 * TTL, TTL)
        assert not v.proceed and v.since == 100.0

    def test_after_three_ttls_the_leader_goes_on_and_says_why(self):
        v = fence_lost_members(("b:1",), False, 100.0, 100.0 + 3 * TTL + 0.5, TTL)
        assert v.proceed and v.overdue and v.since is None
        assert v.reason == ("lost members at b:1 still report running workers after 10 s; "
                            "forming the round anyway")
        assert FENCE_PATIENCE_TTLS == 3

    def test_workers_that_stop_late_close_the_wait(self):
        v = fence_lost_members(("b:1",), True, 100.0, 105.0, TTL)
        assert v.proceed and not v.overdue and v.since is None


class TestTakeoverFailed:
    def test_the_first_failure_starts_the_clock_and_retries(self):
        v = takeover_failed(None, 50.0, TTL)
        assert not v.resign and v.failing_since == 50.0 and v.campaign_after is None
        assert v.reason == "could not take over as leader for 0 s; retrying"

    def test_failures_within_a_ttl_keep_trying(self):
        v = takeover_failed(50.0, 50.0 + TTL, TTL)
        assert not v.resign and v.failing_since == 50.0

    def test_failing_longer_than_a_ttl_resigns_and_waits_a_ttl_to_campaign(self):
        v = takeover_failed(50.0, 53.5, TTL)
        assert v.resign and v.failing_since is None
        assert v.campaign_after == pytest.approx(56.5)
        assert v.reason == "could not take over as leader for 4 s; stepping down"


class TestRevokeFrozen:
    """The freeze rule: a member of round 7 (a, b, c) reported frozen by its ring peer."""

    CONFIG = RendezvousConfig(job_id="j", min_nodes=1, max_nodes=3, lease_ttl_s=5.0,
                              freeze_timeout_s=1.0)
    ROUND = round_of(7, "a", "b", "c")

    def verdict(self, report=FrozenReport(round=7, by="a", silent_s=1.1), *, about="b",
                decider="c", answered=None, unconfirmed_s=0.3, current=ROUND, others=2,
                config=CONFIG):
        return revoke_frozen(about, report, current, decider=decider, decider_answered=answered,
                             lease_unconfirmed_s=unconfirmed_s, others=others, config=config)

    def test_the_leader_checks_a_member_another_member_reported_before_revoking(self):
        v = self.verdict()
        assert v.check and not v.revoke
        v = self.verdict(answered=False)
        assert v.revoke and not v.check
        assert v.reason == ("revoking the lease of b: its agent answered no probe for 1.1 s "
                            "(reported by a, confirmed by c)")

    def test_a_member_that_answers_the_leader_is_slow_not_frozen(self):
        v = self.verdict(answered=True)
        assert not v.revoke and not v.check
        assert "its agent answered c, so it is alive" in v.reason

    def test_a_reporter_that_decides_needs_no_second_check(self):
        # The leader is the reporter, or the frozen member leads and its
        # reporter decides: its own failed probes are the decider's check.
        v = self.verdict(decider="a")
        assert v.revoke
        assert v.reason.endswith("(reported and confirmed by a)")

    def test_a_silence_shorter_than_the_freeze_timeout_revokes_nothing(self):
        v = self.verdict(FrozenReport(round=7, by="a", silent_s=0.9), answered=False)
        assert not v.revoke
        assert "silent for 0.9 s, under the freeze timeout (1 s)" in v.reason

    def test_a_freeze_timeout_of_zero_leaves_the_lease_alone_as_the_authority(self):
        off = dataclasses.replace(self.CONFIG, freeze_timeout_s=0.0)
        v = self.verdict(FrozenReport(round=7, by="a", silent_s=60.0), answered=False,
                         config=off)
        assert not v.revoke and not v.check
        assert "the freeze timeout is 0" in v.reason

    def test_only_a_report_about_the_running_round_counts(self):
        assert not self.verdict(FrozenReport(round=6, by="a", silent_s=2.0),
                                answered=False).revoke
        ended = dataclasses.replace(self.ROUND, outcome=Outcome.SUCCEEDED)
        assert not self.verdict(answered=False, current=ended).revoke
        assert not self.verdict(answered=False, current=None).revoke
        # A round written again over garbage (Round.continues) is the round it continues.
        again = dataclasses.replace(self.ROUND, number=8, continues=7)
        assert self.verdict(answered=False, current=again).revoke

    def test_only_members_are_revoked_and_only_members_report(self):
        v = self.verdict(about="x", answered=False)
        assert not v.revoke and "are not both members of round 7" in v.reason
        assert not self.verdict(FrozenReport(round=7, by="x", silent_s=2.0),
                                answered=False).revoke

    def test_a_node_never_revokes_its_own_lease(self):
        v = self.verdict(about="c", decider="c", answered=False)
        assert not v.revoke and "never revokes its own lease" in v.reason

    def test_a_decider_whose_own_lease_is_unconfirmed_may_be_the_one_cut_off(self):
        v = self.verdict(answered=False, unconfirmed_s=2.6)
        assert not v.revoke and not v.check
        assert "c may be the one cut off" in v.reason

    def test_a_node_the_others_cannot_go_on_without_keeps_its_lease(self):
        # nnodes 3:3: without b no round can form; revoking it would only turn
        # a freeze shorter than the lease into a restart.
        fixed = dataclasses.replace(self.CONFIG, min_nodes=3)
        v = self.verdict(answered=False, config=fixed)
        assert not v.revoke and not v.check
        assert "the others cannot go on without it (2 of at least 3 nodes)" in v.reason
        assert self.verdict(answered=False, config=fixed, others=3).revoke  # a standby

    def test_a_report_already_confirmed_is_not_revoked_again(self):
        v = self.verdict(FrozenReport(round=7, by="a", silent_s=1.1, confirmed_by="c"),
                         answered=False)
        assert not v.revoke and "c revoked it already" in v.reason


class TestFreezeTimeoutSetting:
    def test_the_default_is_a_second_or_half_a_short_lease_ttl(self):
        assert default_freeze_timeout_s(5.0) == 1.0
        assert default_freeze_timeout_s(1.5) == 0.75
        assert default_freeze_timeout_s(1.0) == 0.5

    @pytest.mark.parametrize("timeout", [-1.0, 0.2, 5.0, 6.0])
    def test_a_timeout_not_from_half_a_second_to_below_the_lease_ttl_is_refused(self, timeout):
        with pytest.raises(ConfigError, match=r"freeze timeout .* must be 0 \(off: the lease "
                                              r"alone decides\) or from 0.5 s to below the "
                                              r"lease TTL \(5 s\)"):
            RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1, lease_ttl_s=5.0,
                             freeze_timeout_s=timeout)

    def test_zero_turns_the_fast_path_off(self):
        assert RendezvousConfig(job_id="j", min_nodes=1, max_nodes=1,
                                freeze_timeout_s=0.0).freeze_timeout_s == 0.0
