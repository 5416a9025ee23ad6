"""The lifecycle table: the reactor's transitions are checked against it, then
published and kept in order; illegal ones refused, final states final."""

from __future__ import annotations

import pytest

from agent.lifecycle import AgentState, IllegalTransition, Lifecycle, check_path
from tests.fakes.clock import FakeClock

S = AgentState


class TestLifecycle:
    def test_transitions_are_published_and_kept(self):
        seen = []
        lc = Lifecycle("j", "n", publish=seen.append, clock=FakeClock())
        lc.publish(S.JOINING, "registered")
        lc.publish(S.STARTING, "rank 0", 1)
        lc.publish(S.RUNNING, "2 workers", 1)
        assert [(t.before, t.after) for t in seen] == [(S.INIT, S.JOINING), (S.JOINING, S.STARTING),
                                                       (S.STARTING, S.RUNNING)]
        assert seen[-1].reason == "2 workers" and seen[-1].round == 1
        assert lc.published is S.RUNNING and lc.history == seen

    def test_illegal_transition_is_refused(self):
        lc = Lifecycle("j", "n")
        with pytest.raises(IllegalTransition, match="INIT -> RUNNING"):
            lc.publish(S.RUNNING, "skipping ahead")
        assert lc.published is S.INIT

    def test_final_states_have_no_way_out(self):
        lc = Lifecycle("j", "n")
        lc.publish(S.FAILED, "bad")
        for s in AgentState:
            with pytest.raises(IllegalTransition):
                lc.publish(s, "again")


class TestCheckPath:
    def test_a_reaction_s_transitions_lead_from_its_state_before_to_its_state_after(self):
        check_path(S.RUNNING, [S.STOPPING, S.JOINING, S.STARTING, S.RUNNING], S.RUNNING)
        check_path(S.JOINING, [], S.JOINING)

    def test_a_step_the_table_does_not_allow_is_refused(self):
        with pytest.raises(IllegalTransition, match="RUNNING -> JOINING"):
            check_path(S.RUNNING, [S.JOINING], S.JOINING)

    def test_transitions_that_end_elsewhere_than_the_state_are_refused(self):
        with pytest.raises(IllegalTransition, match="end in JOINING, the state in RUNNING"):
            check_path(S.RUNNING, [S.STOPPING, S.JOINING], S.RUNNING)
        with pytest.raises(IllegalTransition, match="end in RUNNING, the state in DONE"):
            check_path(S.RUNNING, [], S.DONE)
