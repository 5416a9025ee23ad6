"""The warm pool's pure rules, driven with explicit events and times: no
processes, no threads, no sleeping. Each test: a state, an event, the actions."""

from __future__ import annotations

import logging

from hypothesis import given
from hypothesis import strategies as st

from agent.warm_policy import (
    WARM_FAILURE_LIMIT,
    Closed,
    DiscardWarm,
    FillAsked,
    ForkFailed,
    ForkWarm,
    Log,
    Refill,
    RetireTemplate,
    RoundStarted,
    SpawnWarm,
    StartTemplate,
    TemplateDied,
    TemplateFoundUnsafe,
    TemplateReadied,
    TemplateStarted,
    TemplateStartFailed,
    TemplateView,
    WarmPolicy,
    WarmWorkerDied,
    WarmWorkerReady,
    common_startup_env,
    startup_differences,
)

BASE = {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}


def policy(nproc=2, warm_sets=1, prestart=True) -> WarmPolicy:
    return WarmPolicy(nproc=nproc, warm_sets=warm_sets, prestart=prestart)


def ready_template(pid=50, env=BASE) -> TemplateView:
    return TemplateView(pid, dict(env), ready=True)


def kinds(actions):
    return [type(a).__name__ for a in actions]


def messages(actions):
    return [a.message % a.args for a in actions if isinstance(a, Log)]


def fail(p: WarmPolicy, times: int, now: float = 0.0):
    actions = []
    for pid in range(times):
        actions = p.on(WarmWorkerDied(100 + pid, -9, last_output="boom"), now)
    return actions


# ------------------------------------------------------------------ filling

def test_the_first_fill_starts_a_template_and_spawns_nothing_to_import_beside_it():
    p = policy(nproc=2, warm_sets=2)
    assert p.on(FillAsked(0, BASE, None), 0.0) == [StartTemplate(BASE)]
    assert p.on(TemplateStarted(50), 0.0) == []
    assert p.on(FillAsked(0, BASE, TemplateView(50, BASE)), 1.0) == []
    # Rounds change nothing: the pool still waits for the template.
    p.on(RoundStarted(({}, {})), 2.0)
    assert p.on(FillAsked(0, BASE, TemplateView(50, BASE)), 3.0) == []
    assert p.on(FillAsked(0, BASE, ready_template()), 4.0) == [ForkWarm(50, 4)]


def test_a_ready_template_forks_what_is_missing():
    p = policy(nproc=4)
    assert p.on(FillAsked(1, BASE, ready_template()), 0.0) == [ForkWarm(50, 3)]
    assert p.on(FillAsked(4, BASE, ready_template()), 0.0) == []


def test_a_template_with_other_startup_variables_or_dead_is_retired_and_replaced():
    p = policy()
    p.on(RoundStarted(({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "1"})), 0.0)
    learned = {**BASE, "OMP_NUM_THREADS": "1"}
    assert p.on(FillAsked(0, BASE, ready_template()), 0.0) == [RetireTemplate(50),
                                                                StartTemplate(learned)]
    dead = TemplateView(51, learned, ready=True, dead=True)
    assert p.on(FillAsked(0, BASE, dead), 0.0) == [RetireTemplate(51), StartTemplate(learned)]
    # Variables that are not read at startup do not retire it.
    assert p.on(FillAsked(0, {**BASE, "RANK": "3"}, ready_template(env=learned)), 0.0) == \
        [ForkWarm(50, 2)]


def test_a_template_that_cannot_start_leaves_the_fill_to_spawning():
    p = policy()
    p.on(RoundStarted(({},)), 0.0)
    p.on(FillAsked(0, BASE, None), 0.0)
    actions = p.on(TemplateStartFailed("no python"), 0.0)
    assert actions[1:] == [SpawnWarm(2, BASE)]
    assert messages(actions) == ["could not start a template for warm workers: no python"]


def test_a_failed_fork_spawns_the_rest():
    p = policy(nproc=3)
    p.on(FillAsked(0, BASE, ready_template()), 0.0)
    actions = p.on(ForkFailed(50, "template pid 50 did not fork within 10 s", 2), 0.0)
    assert actions[1:] == [SpawnWarm(2, BASE)]
    assert messages(actions) == ["template pid 50 could not fork a warm worker (template pid "
                                 "50 did not fork within 10 s); spawning it instead."]


def test_nothing_is_filled_without_prestart_after_giving_up_or_after_close():
    assert policy(prestart=False).on(FillAsked(0, BASE, None), 0.0) == []
    given_up = policy()
    fail(given_up, WARM_FAILURE_LIMIT)
    assert given_up.on(FillAsked(0, BASE, None), 0.0) == []
    closed = policy()
    closed.on(Closed(), 0.0)
    assert closed.on(FillAsked(0, BASE, None), 0.0) == []


# ------------------------------------------------------------------ forking found unsafe

def test_an_unsafe_template_turns_forking_off_for_good_and_says_so_once():
    p = policy()
    actions = p.on(TemplateFoundUnsafe(50, "a thread is running"), 0.0)
    assert kinds(actions) == ["Log", "RetireTemplate", "Refill"]
    assert actions[1] == RetireTemplate(50)
    assert "is unsafe here (a thread is running)" in messages(actions)[0]
    assert p.on(TemplateFoundUnsafe(51, "again"), 0.0) == [RetireTemplate(51), Refill()]
    # From then on warm workers are spawned, even once rounds run.
    p.on(RoundStarted(({},)), 0.0)
    assert p.on(FillAsked(0, BASE, ready_template()), 0.0) == [SpawnWarm(2, BASE)]
    assert p.warm_enabled


# ------------------------------------------------------------------ failures

def test_warm_deaths_in_a_row_give_the_pool_up():
    p = policy()
    first = fail(p, WARM_FAILURE_LIMIT - 1)
    assert kinds(first) == ["Log", "Refill"]
    assert messages(first) == ["warm worker pid 101 died with status -9 before it got a round "
                               "(its last output: boom); starting another."]
    assert p.warm_enabled
    verdict = p.on(WarmWorkerDied(7, 1), 0.0)
    assert kinds(verdict) == ["Log", "DiscardWarm", "RetireTemplate", "Log"]
    assert verdict[1:3] == [DiscardWarm(), RetireTemplate()]
    assert messages(verdict) == [
        "warm worker pid 7 died with status 1 before it got a round (its last output: none).",
        f"{WARM_FAILURE_LIMIT} warm workers (or templates) in a row died before they got a "
        "round; workers start cold from now on."]
    assert not p.warm_enabled


def test_a_ready_warm_worker_or_template_resets_the_count():
    p = policy()
    fail(p, WARM_FAILURE_LIMIT - 1)
    p.on(WarmWorkerReady(9, 1), 0.0)
    fail(p, WARM_FAILURE_LIMIT - 1)
    p.on(TemplateReadied(50, started_at=0.0), 0.0)
    fail(p, WARM_FAILURE_LIMIT - 1)
    assert p.warm_enabled and p.state.failures == WARM_FAILURE_LIMIT - 1


def test_template_deaths_count_once_and_their_forks_do_not():
    p = policy()
    actions = p.on(TemplateDied(50, -9, was_ready=False, forks=2, last_output="x"), 0.0)
    assert actions[1:] == [Refill()]
    assert messages(actions) == ["template pid 50 died with status -9 before it was ready (its "
                                 "last output: x); 2 workers it forked died with it."]
    assert p.on(WarmWorkerDied(60, -9, collateral=True), 0.0) == [Refill()]
    assert p.on(WarmWorkerDied(61, -9, collateral=True), 0.0) == [Refill()]
    assert p.state.failures == 1
    p.on(TemplateDied(52, -9, was_ready=True), 0.0)
    assert "DiscardWarm" in kinds(p.on(TemplateDied(53, -9, was_ready=True), 0.0))


def test_deaths_the_pool_asked_for_or_after_close_are_no_failures():
    p = policy()
    assert messages(p.on(WarmWorkerDied(5, -9, discarded=True), 0.0)) == \
        ["discarded warm worker pid 5 is gone."]
    assert p.on(TemplateDied(50, -9, was_ready=True, discarded=True), 0.0) == []
    p.on(Closed(), 0.0)
    assert kinds(p.on(WarmWorkerDied(6, 1), 0.0)) == ["Log"]
    assert p.on(TemplateDied(51, 1, was_ready=True), 0.0) == []
    assert p.state.failures == 0


# ------------------------------------------------------------------ news and learning

def test_readiness_is_logged_once_per_set_and_the_template_with_its_import_time():
    p = policy(nproc=2, warm_sets=2)
    assert p.on(WarmWorkerReady(9, 1), 0.0)[0].level == logging.DEBUG
    ready = p.on(WarmWorkerReady(10, 2), 0.0)
    assert ready[0].level == logging.INFO
    assert messages(ready) == ["warm worker pid 10 is ready (2 of 4 warm)."]
    actions = p.on(TemplateReadied(50, started_at=100.0), now=103.25)
    assert actions[1:] == [Refill()]
    assert messages(actions) == ["template pid 50 is ready to fork warm workers (imported in "
                                 "3.2 s)."]


def test_a_round_teaches_the_startup_variables_all_its_ranks_share():
    p = policy()
    p.on(RoundStarted(({"OMP_NUM_THREADS": "1", "RANK": "0", "TORCH_X": "a"},
                       {"OMP_NUM_THREADS": "1", "RANK": "1", "TORCH_X": "b"})), 0.0)
    assert p.learned_env == {"OMP_NUM_THREADS": "1"}
    p.on(RoundStarted(None), 0.0)  # a start that failed part way teaches nothing
    assert p.learned_env == {"OMP_NUM_THREADS": "1"}
    cold = policy(prestart=False)
    cold.on(RoundStarted(({"OMP_NUM_THREADS": "1"},)), 0.0)
    assert cold.learned_env == {}


def test_startup_differences_name_only_variables_read_at_startup():
    a = {"OMP_NUM_THREADS": "1", "RANK": "0", "LD_PRELOAD": "x"}
    b = {"OMP_NUM_THREADS": "2", "RANK": "1", "PYTHONPATH": "/p"}
    assert startup_differences(a, b) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"]
    assert common_startup_env([]) == {}


EVENTS = st.one_of(
    st.builds(FillAsked, st.integers(0, 4), st.just(BASE),
              st.one_of(st.none(), st.builds(TemplateView, st.integers(1, 3), st.just(BASE),
                                             st.booleans(), st.booleans()))),
    st.builds(TemplateStarted, st.integers(1, 3)),
    st.builds(TemplateStartFailed, st.just("no")),
    st.builds(WarmWorkerReady, st.integers(1, 9), st.integers(0, 4)),
    st.builds(WarmWorkerDied, st.integers(1, 9), st.just(-9), st.booleans(), st.booleans()),
    st.builds(TemplateReadied, st.integers(1, 3), st.floats(0, 10)),
    st.builds(TemplateFoundUnsafe, st.integers(1, 3), st.just("why")),
    st.builds(TemplateDied, st.integers(1, 3), st.just(-9), st.booleans(), st.booleans()),
    st.builds(RoundStarted, st.just(({},))),
)


@given(st.lists(EVENTS, max_size=30))
def test_a_pool_given_up_or_closed_never_starts_a_process(events):
    p, closed = policy(), policy()
    for q in (p, closed):
        q.on(FillAsked(0, BASE, None), 0.0)  # a fill waits for its template
    fail(p, WARM_FAILURE_LIMIT)
    closed.on(Closed(), 0.0)
    for event in events:
        for q in (p, closed):
            started = [a for a in q.on(event, 10.0)
                       if isinstance(a, (StartTemplate, ForkWarm, SpawnWarm))]
            assert started == [], (event, started)
