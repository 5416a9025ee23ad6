"""The fault simulator in the suite: thousands of seeded schedules, each checked
against the invariants in :mod:`tests.sim.cluster`; and proof that the
simulator is deterministic and that its oracles catch planted bugs.

``SIM_SEEDS`` sets how many schedules the big test runs (default 10,000),
``SIM_PROFILE_SEEDS`` how many of each other profile (default 300: the
``budget`` and ``partition`` profiles see what the mixed schedules almost
never do); ``make sim SEEDS=N`` runs more outside pytest.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from agent import reactor
from elastic.rendezvous import decisions
from elastic.rendezvous.api import Outcome
from elastic.rendezvous.decisions import Action, Decision
from tests.marks import CPU_BOUND
from tests.sim import cluster
from tests.sim.faults import Fault
from tests.sim.runner import REPLAY, replay_command, run_many
from tests.sim.world import FakeMesh

SEEDS = int(os.environ.get("SIM_SEEDS", "10000"))
PROFILE_SEEDS = int(os.environ.get("SIM_PROFILE_SEEDS", "300"))
JOBS = max(1, min(2, os.cpu_count() or 1))


def _every_schedule_passes(seeds: int, profile: str = "mixed"):
    """Run ``seeds`` schedules of ``profile``; their summary, once none failed."""
    started = time.monotonic()
    summary = run_many(range(seeds), jobs=JOBS, profile=profile)
    print("\n" + summary.describe(time.monotonic() - started))
    assert summary.runs == seeds
    assert not summary.failures, summary.describe(time.monotonic() - started)
    return summary


@CPU_BOUND
@pytest.mark.timeout(600)
def test_every_schedule_keeps_every_invariant():
    summary = _every_schedule_passes(SEEDS)
    # The schedules reach both ends: most jobs succeed, some spend their budget.
    assert summary.outcomes[Outcome.SUCCEEDED] > SEEDS // 2


@CPU_BOUND
@pytest.mark.timeout(300)
def test_more_failures_than_the_budget_fail_the_job_and_every_agent_exits():
    # The job-failure path: restart budgets of 1 to 3, one to three failures more.
    summary = _every_schedule_passes(PROFILE_SEEDS, "budget")
    # Some failures strike while a round forms (no worker to crash): those jobs succeed.
    assert summary.outcomes[Outcome.FAILED] > PROFILE_SEEDS * 2 // 3
    spent = [cluster.run(seed, profile="budget") for seed in range(5)]
    assert any("restart budget spent" in r.reason for r in spent), [r.reason for r in spent]


@CPU_BOUND
@pytest.mark.timeout(300)
def test_partitions_without_the_leaders_fence_never_leave_a_zombie_group():
    _every_schedule_passes(PROFILE_SEEDS, "partition")


def test_a_seed_replays_exactly():
    first, second = cluster.run(42), cluster.run(42)
    assert dataclasses.asdict(first) == dataclasses.asdict(second)
    assert first.rounds >= 1 and first.outcome


def test_the_replay_command_names_the_seed_and_the_profile():
    assert REPLAY.format(seed=7) == "python -m tests.sim --seed 7 -v"
    assert replay_command(7) == "python -m tests.sim --seed 7 -v"
    assert replay_command(7, "budget") == "python -m tests.sim --seed 7 -v --profile budget"


def test_an_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="no simulator profile 'chaos'"):
        cluster.run(1, profile="chaos")


# -- Planted bugs: the oracles must see them -----------------------------------

PLANTED_SEEDS = range(200)


def _violations(seeds, profile: str = "mixed") -> list[str]:
    return [v for seed in seeds for v in cluster.run(seed, profile=profile).violations]


def test_a_cut_off_node_that_keeps_training_is_caught(monkeypatch):
    # No fail-stop: a node cut off from etcd never stops its workers, and a
    # leader does not wait for the workers of the members it leaves out.
    real = reactor.react

    def no_fail_stop(view, event, now, settings):
        if isinstance(event, reactor.LeaseState):
            return view, []
        return real(view, event, now, settings)

    monkeypatch.setattr(reactor, "react", no_fail_stop)
    monkeypatch.setattr(FakeMesh, "fence", lambda self, addrs, asker: True)
    found = _violations(PLANTED_SEEDS)
    assert any("train at the same time" in v for v in found), found[:5]


def test_success_declared_before_every_member_finished_is_caught(monkeypatch):
    # No exit barrier: the first node whose workers all exited 0 ends the job.
    real = decisions.decide

    def eager(observed, now, config):
        current = observed.current
        if current is not None and not current.outcome and any(
                number == current.number for number, _ in observed.done.values()):
            return Decision(Action.SUCCEED_JOB, "one node finished")
        return real(observed, now, config)

    monkeypatch.setattr(decisions, "decide", eager)
    found = _violations(PLANTED_SEEDS)
    assert any("declared succeeded" in v for v in found), found[:5]


def test_an_unfenced_checkpoint_commit_is_caught(monkeypatch):
    # A commit that ignores the round: a zombie's older step can win.
    from elastic.checkpoint import etcd_log

    monkeypatch.setattr(etcd_log, "fenced_txn",
                        lambda store, keys, number, ops, also=(): store.txn([], ops))
    found = _violations(PLANTED_SEEDS)
    assert any("was committed while the job was in round" in v for v in found), found[:5]


def test_a_cut_off_node_stopping_after_its_lease_expired_is_caught_without_the_fence(
        monkeypatch):
    # The partition rule's stop at 1.5 TTL instead of 0.7: the mixed schedules
    # caught it on 4 of 10,000 seeds (the leader's fence hides it).
    monkeypatch.setattr(reactor, "STOP_AT_TTL_FRACTION", 1.5)
    found = _violations(range(60), profile="partition")
    assert any("train at the same time" in v for v in found), found[:5]


def test_a_budget_never_spent_is_caught(monkeypatch):
    real = decisions.decide

    def no_budget(observed, now, config):
        return real(observed, now, dataclasses.replace(config, max_restarts=10**6))

    monkeypatch.setattr(decisions, "decide", no_budget)
    found = _violations(range(20), profile="budget")
    assert any("over the budget" in v for v in found), found[:5]


def test_a_budget_spent_one_failure_early_is_caught(monkeypatch):
    real = decisions.decide

    def eager(observed, now, config):
        return real(observed, now, dataclasses.replace(config,
                                                       max_restarts=config.max_restarts - 1))

    monkeypatch.setattr(decisions, "decide", eager)
    found = _violations(range(20), profile="budget")
    assert any("failed for its budget" in v for v in found), found[:5]


def test_garbage_over_the_round_key_restarts_no_worker():
    # Each write is answered by the same round written again (Round.continues):
    # the workers of the first round train on to the end and commit checkpoints.
    sim = cluster.Cluster(3)
    sim.schedule = [Fault(at, "garbage_round", "*") for at in (4.0, 4.1, 7.0)]
    result = sim.run()
    assert result.ok and result.outcome == Outcome.SUCCEEDED, result.violations
    assert {w.round for w, _ in sim.workers.exits} == {1}
    assert len(sim.continuations - {sim.final.number}) == 3 and result.steps_committed > 0
