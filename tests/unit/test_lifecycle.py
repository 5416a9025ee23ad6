"""The lifecycle table: transitions are published and kept, illegal ones refused,
final states final."""

from __future__ import annotations

import pytest

from agent.lifecycle import AgentState, IllegalTransition, Lifecycle
from tests.fakes.clock import FakeClock


class TestLifecycle:
    def test_transitions_are_published_and_kept(self):
        seen = []
        lc = Lifecycle("j", "n", publish=seen.append, clock=FakeClock())
        lc.to(AgentState.JOINING, "registered")
        lc.to(AgentState.STARTING, "rank 0", 1)
        lc.to(AgentState.RUNNING, "2 workers", 1)
        assert [t.after for t in seen] == [AgentState.JOINING, AgentState.STARTING,
                                           AgentState.RUNNING]
        assert seen[-1].reason == "2 workers" and seen[-1].round == 1

    def test_illegal_transition_is_refused(self):
        lc = Lifecycle("j", "n")
        with pytest.raises(IllegalTransition, match="INIT -> RUNNING"):
            lc.to(AgentState.RUNNING, "skipping ahead")
        assert lc.state is AgentState.INIT

    def test_final_states_have_no_way_out(self):
        lc = Lifecycle("j", "n")
        lc.to(AgentState.FAILED, "bad")
        for s in AgentState:
            with pytest.raises(IllegalTransition):
                lc.to(s, "again")
