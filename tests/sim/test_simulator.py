"""The fault simulator in the suite: thousands of seeded schedules, each checked
against the invariants in :mod:`tests.sim.cluster`; and proof that the
simulator is deterministic and that its oracles catch planted bugs.

``SIM_SEEDS`` sets how many schedules the big test runs (default 10,000, in
four parts of consecutive seeds, each a test of its own),
``SIM_PROFILE_SEEDS`` how many of each other profile (default 300: the
``budget``, ``partition`` and ``memory`` profiles see what the mixed
schedules almost never do); ``make sim SEEDS=N`` runs more outside pytest.
Half the seeds of every profile, and all of ``memory``'s, run the memory tier
(:mod:`tests.sim.memory`); its planted bugs are broken ``choose`` rules passed
in, and the schedules that caught its two defects are kept as regression tests.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from agent import reactor
from elastic.checkpoint.memory.choice import MEMORY, Choice, DiskLatest, choose
from elastic.rendezvous import buckets, decisions, round_record
from elastic.rendezvous.api import Outcome
from elastic.rendezvous.decisions import Action, Decision
from tests.marks import STARTS_FIRST
from tests.sim import cluster
from tests.sim.faults import Fault
from tests.sim.runner import REPLAY, replay_command, run_many
from tests.sim.world import FakeMesh

SEEDS = int(os.environ.get("SIM_SEEDS", "10000"))
PROFILE_SEEDS = int(os.environ.get("SIM_PROFILE_SEEDS", "300"))
JOBS = max(1, min(2, os.cpu_count() or 1))


# The SEEDS mixed schedules in PARTS runs of consecutive seeds: a failure names its part,
# and each part's time shows in --durations.
PARTS = 4
SEED_PARTS = [range(SEEDS * i // PARTS, SEEDS * (i + 1) // PARTS) for i in range(PARTS)]


def _every_schedule_passes(seeds: int | range, profile: str = "mixed"):
    """Run the schedules of ``profile`` for ``seeds`` (a count: the first ones);
    their summary, once none failed."""
    seeds = range(seeds) if isinstance(seeds, int) else seeds
    started = time.monotonic()
    summary = run_many(seeds, jobs=JOBS, profile=profile)
    print("\n" + summary.describe(time.monotonic() - started))
    assert summary.runs == len(seeds)
    assert not summary.failures, summary.describe(time.monotonic() - started)
    return summary


def test_the_parts_run_every_seed_once():
    assert [s for part in SEED_PARTS for s in part] == list(range(SEEDS))


@STARTS_FIRST
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seeds", SEED_PARTS, ids=lambda r: f"seeds-{r.start}-{r.stop - 1}")
def test_every_schedule_keeps_every_invariant(seeds):
    summary = _every_schedule_passes(seeds)
    # The schedules reach both ends: most jobs succeed, some spend their budget.
    assert summary.outcomes[Outcome.SUCCEEDED] > len(seeds) // 2


@STARTS_FIRST
@pytest.mark.timeout(300)
def test_more_failures_than_the_budget_fail_the_job_and_every_agent_exits():
    # The job-failure path: restart budgets of 1 to 3, one to three failures more.
    summary = _every_schedule_passes(PROFILE_SEEDS, "budget")
    # Some failures strike while a round forms (no worker to crash): those jobs succeed.
    assert summary.outcomes[Outcome.FAILED] > PROFILE_SEEDS * 2 // 3
    spent = [cluster.run(seed, profile="budget") for seed in range(5)]
    assert any("restart budget spent" in r.reason for r in spent), [r.reason for r in spent]


@STARTS_FIRST
@pytest.mark.timeout(300)
def test_partitions_without_the_leaders_fence_never_leave_a_zombie_group():
    _every_schedule_passes(PROFILE_SEEDS, "partition")


@STARTS_FIRST
@pytest.mark.timeout(300)
def test_the_memory_tier_keeps_its_invariants_through_node_losses():
    _every_schedule_passes(PROFILE_SEEDS, "memory")
    # The schedules restore from memory, and not only from disk.
    runs = [cluster.run(seed, profile="memory") for seed in range(20)]
    assert sum(r.restored_from_memory for r in runs) >= 5, [r.memory for r in runs]


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


def _violations(seeds, profile: str = "mixed", *, until: str | None = None,
                **run) -> list[str]:
    """The violations of the schedules of ``seeds``, in order; with ``until``, up to the
    first schedule that has one saying it (a planted bug caught needs no more seeds)."""
    found: list[str] = []
    for seed in seeds:
        found += cluster.run(seed, profile=profile, **run).violations
        if until is not None and any(until in v for v in found):
            break
    return found


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
    found = _violations(PLANTED_SEEDS, until="train at the same time")
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
    found = _violations(PLANTED_SEEDS, until="declared succeeded")
    assert any("declared succeeded" in v for v in found), found[:5]


def test_an_unfenced_checkpoint_commit_is_caught(monkeypatch):
    # A commit that ignores the round: a zombie's older step can win.
    from elastic.checkpoint import etcd_log

    monkeypatch.setattr(etcd_log, "fenced_txn",
                        lambda store, keys, number, ops, also=(): store.txn([], ops))
    found = _violations(PLANTED_SEEDS, until="was committed while the job was in round")
    assert any("was committed while the job was in round" in v for v in found), found[:5]


def test_a_cut_off_node_stopping_after_its_lease_expired_is_caught_without_the_fence(
        monkeypatch):
    # The partition rule's stop at 1.5 TTL instead of 0.7: the mixed schedules
    # caught it on 4 of 10,000 seeds (the leader's fence hides it).
    monkeypatch.setattr(reactor, "STOP_AT_TTL_FRACTION", 1.5)
    found = _violations(range(60), profile="partition", until="train at the same time")
    assert any("train at the same time" in v for v in found), found[:5]


def test_a_budget_never_spent_is_caught(monkeypatch):
    real = decisions.decide

    def no_budget(observed, now, config):
        return real(observed, now, dataclasses.replace(config, max_restarts=10**6))

    monkeypatch.setattr(decisions, "decide", no_budget)
    found = _violations(range(20), profile="budget", until="over the budget")
    assert any("over the budget" in v for v in found), found[:5]


def test_a_budget_spent_one_failure_early_is_caught(monkeypatch):
    real = decisions.decide

    def eager(observed, now, config):
        return real(observed, now, dataclasses.replace(config,
                                                       max_restarts=config.max_restarts - 1))

    monkeypatch.setattr(decisions, "decide", eager)
    found = _violations(range(20), profile="budget", until="failed for its budget")
    assert any("failed for its budget" in v for v in found), found[:5]


def test_buckets_that_rank_a_node_otherwise_than_its_roster_are_caught(monkeypatch):
    # The leader's buckets give every member the next rank (odd seeds store
    # every roster apart, in buckets).
    real = buckets.split

    def shifted(raw, count):
        n = raw.count(b"\n")
        return [b"".join(b"%d\t%s\n" % ((int(rank) + 1) % n, rest) for rank, rest in
                         (line.split(b"\t", 1) for line in part.split(b"\n")[:-1]))
                for part in real(raw, count)]

    monkeypatch.setattr(buckets, "split", shifted)
    round_record.roster_buckets.cache_clear()
    found = _violations(range(1, 6, 2), until="bucket says")
    round_record.roster_buckets.cache_clear()
    assert any("bucket says" in v for v in found), found[:5]


def test_garbage_over_the_round_key_restarts_no_worker():
    # Each write is answered by the same round written again (Round.continues):
    # the workers of the first round train on to the end and commit checkpoints.
    sim = cluster.Cluster(3)
    sim.schedule = [Fault(at, "garbage_round", "*") for at in (4.0, 4.1, 7.0)]
    result = sim.run()
    assert result.ok and result.outcome == Outcome.SUCCEEDED, result.violations
    assert {w.round for w, _ in sim.workers.exits} == {1}
    assert len(sim.continuations - {sim.final.number}) == 3 and result.steps_committed > 0


# -- The memory tier: planted bugs in the restore's choice, known defects -------

# Seeds of the memory profile (among its first 3000) whose schedules return a
# cut-off node with an older round's snapshots after the job went on without it
# and lost another node: where an older round's slot can complete a newer
# round's set, and where the older round's set is newer in steps than a newer
# round's disk commit. The real rule passes them all.
MIXED_ROUNDS_SEEDS = (593, 938, 958)
NEWER_DISK_ROUND_SEEDS = (310, 903, 970, 1027)
# Schedules that caught two defects, now fixed: a lost node's buddy freed its
# replicas once the new round's ring gave the buddy another source, before the
# new group restored them; and commits of a continued round's workers recorded
# the continuing round's number, so a restore took disk over their newer memory.
LOST_NODE_NEW_RING_SEEDS = (83, 100, 185)
CONTINUED_ROUND_SEED = 1496  # mixed: garbage over the round key, then a restart


def _sets(seen, by_round: bool) -> dict:
    """{(round or -1, step, world size): {old rank: {reader: key}}} of ``seen``."""
    sets: dict = {}
    for s in seen:
        ident = (s.key.round if by_round else -1, s.step, s.world_size)
        sets.setdefault(ident, {}).setdefault(s.key.rank, {})[s.reader] = s.key
    return sets


def _newest_set(sets: dict, disk, *, complete_only: bool) -> Choice:
    """The newest set, as a broken rule would choose it; disk when that is newer."""
    found = [ident for ident, ranks in sets.items()
             if not complete_only or all(r in ranks for r in range(ident[2]))]
    if not found:
        return choose([], disk)
    _, step, world = ident = max(found)
    holders = sets[ident]
    round_ = max(key.round for readers in holders.values() for key in readers.values())
    if disk is not None and (disk.round > round_ or disk.step > step):
        return choose([], disk)
    return Choice(MEMORY, "planted bug", round_, step, world, holders)


def choose_ignoring_rounds(seen, disk):
    # Sets keyed by step alone: an older round's slot completes a newer round's set.
    return _newest_set(_sets(seen, by_round=False), disk, complete_only=True)


def choose_incomplete_sets_too(seen, disk):
    return _newest_set(_sets(seen, by_round=True), disk, complete_only=False)


def choose_over_a_newer_disk_round(seen, disk):
    # Rule 4 without its round: only the disk's step is compared.
    return choose(seen, DiskLatest(disk.step, -1) if disk is not None else None)


def _memory_violations(seeds, choose_rule, profile: str = "memory", *,
                       until: str | None = None) -> list[str]:
    return _violations(seeds, profile, until=until, memory=True, choose=choose_rule)


def test_a_memory_set_missing_a_rank_is_caught():
    found = _memory_violations(range(10), choose_incomplete_sets_too,
                               until="incomplete: no slot of rank(s)")
    assert any("incomplete: no slot of rank(s)" in v for v in found), found[:5]


def test_a_memory_set_of_mixed_rounds_is_caught():
    found = _memory_violations(MIXED_ROUNDS_SEEDS, choose_ignoring_rounds, until="mixing in slot")
    assert any("mixing in slot" in v for v in found), found[:5]


def test_memory_over_a_disk_commit_of_a_newer_round_is_caught():
    found = _memory_violations(NEWER_DISK_ROUND_SEEDS, choose_over_a_newer_disk_round,
                               until="over the newer disk commit")
    assert any("over the newer disk commit" in v for v in found), found[:5]


def test_the_real_rule_passes_where_the_planted_bugs_are_caught():
    assert not _memory_violations(MIXED_ROUNDS_SEEDS + NEWER_DISK_ROUND_SEEDS, choose)


def test_one_lost_node_loses_no_snapshot_when_the_ring_changes():
    # The new round gives the lost node's buddy another source; the lost node's
    # replicas must stay until the new group has restored from them.
    for seed in LOST_NODE_NEW_RING_SEEDS:
        result = cluster.run(seed, profile="memory")
        assert result.ok, (seed, result.violations)


def test_workers_of_a_continued_round_resume_from_their_own_memory():
    # Garbage over the round key: the round that continues the workers' is written,
    # their commits are fenced by its number but recorded with their own round, so
    # a later restore still prefers their newer memory snapshot.
    result = cluster.run(CONTINUED_ROUND_SEED)
    assert result.ok, result.violations
