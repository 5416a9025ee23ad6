"""LeaderView: watch events of ``nodes/`` and ``requests/`` in, the pure
:class:`~elastic.rendezvous.decisions.Observed` out. No store: events are applied
by hand with explicit revisions and leader clock readings."""

from __future__ import annotations

from elastic.keyspace import JobKeys
from elastic.rendezvous.api import (
    DrainRequest,
    FrozenReport,
    Member,
    NodeInfo,
    Report,
    RestartRequest,
    Round,
)
from elastic.rendezvous.view import LeaderView

KEYS = JobKeys("j")


def round_of(number, *ids):
    return Round(number=number,
                 members=tuple(Member(i, r, "h", 1) for r, i in enumerate(ids)),
                 master_addr="h", master_port=1, reason="", leader=ids[0], created_at=0.0)


def leader_view():
    bad = []
    view = LeaderView(KEYS, lambda exc, rev: bad.append((exc.key, rev)))
    return view, bad


def register(view, node_id, revision, now=0.0, running_round=0):
    view.apply_node(KEYS.node(node_id),
                    NodeInfo(node_id=node_id, host="h", running_round=running_round).to_json(),
                    revision, now)


def report(view, key, about, round_, revision, now=0.0):
    view.apply_request(key, Report(round=round_, by="x").to_json(), revision, now)


class TestFrozenReports:
    def frozen(self, view, about, revision, **fields):
        record = FrozenReport(**{"round": 4, "by": "a", "silent_s": 1.2, **fields})
        view.apply_request(KEYS.frozen_report(about), record.to_json(), revision, 0.0)
        return record

    def test_a_report_about_the_current_registration_is_seen(self):
        view, bad = leader_view()
        register(view, "b", 10)
        record = self.frozen(view, "b", 20)
        assert view.frozen_reports() == {"b": record} and bad == []

    def test_a_report_about_a_previous_agent_with_that_id_is_not(self):
        view, _ = leader_view()
        register(view, "b", 10)
        self.frozen(view, "b", 20)
        view.apply_node(KEYS.node("b"), None, 0, 1.0)
        register(view, "b", 30)
        assert view.frozen_reports() == {}

    def test_a_confirmed_report_about_the_round_marks_the_node_revoked(self):
        view, _ = leader_view()
        register(view, "b", 10)
        self.frozen(view, "b", 20, confirmed_by="a")
        view.apply_node(KEYS.node("b"), None, 0, 1.0)  # its lease revoked
        assert view.revoked_as_frozen(round_of(4, "a", "b")) == {"b"}
        assert view.revoked_as_frozen(round_of(5, "a", "b")) == frozenset()

    @staticmethod
    def revoked_at_100_and_back(back_at):
        """A view in which a revoked b's lease as frozen at 100 (revision 20) and
        b registered again at ``back_at`` (revision 30)."""
        view, _ = leader_view()
        register(view, "b", 10)
        view.apply_request(KEYS.frozen_report("b"), FrozenReport(
            round=4, by="a", silent_s=1.2, confirmed_by="a").to_json(), 20, 100.0)
        view.apply_node(KEYS.node("b"), None, 0, 100.5)
        register(view, "b", 30, now=back_at)
        return view

    def test_a_revoked_node_stays_a_suspect_when_it_registers_again(self):
        # It thawed: the same agent, back with a new lease; kept out as a
        # suspect, or a node cut off from its peers only is revoked at every round.
        view = self.revoked_at_100_and_back(101.0)
        assert view.observed(round_of(5, "a")).suspects == {"b": 100.0}

    def test_an_old_revocation_does_not_hide_a_new_suspicion(self):
        # b came back, and died again at 500: the unreachable report of 500
        # keeps it out, not the revocation of 100.
        view = self.revoked_at_100_and_back(110.0)
        report(view, KEYS.suspect_report("b"), "b", 6, revision=40, now=500.0)
        assert view.observed(round_of(6, "a", "b")).suspects == {"b": 500.0}

    def test_garbage_at_a_report_key_is_reported_and_replaces_the_report(self):
        view, bad = leader_view()
        register(view, "b", 10)
        self.frozen(view, "b", 20)
        for raw in (b'{"round": 4, "by": "a", "silent_s": -1}', b'{"round": 4, "by": "a"}',
                    b'{"round": 4, "by": "a", "silent_s": 1, "confirmed_by": "a/b"}', b"x"):
            view.apply_request(KEYS.frozen_report("b"), raw, 21, 0.0)
            assert view.frozen_reports() == {}
        view.apply_request(KEYS.frozen_reports + "../b", b"{}", 22, 0.0)
        assert [rev for _, rev in bad] == [21, 21, 21, 21, 22]


class TestSuspects:
    def test_a_suspicion_about_the_current_registration_counts_from_when_it_was_learnt(self):
        view, _ = leader_view()
        register(view, "b", 10)
        report(view, KEYS.suspect_report("b"), "b", 4, revision=20, now=100.0)
        assert view.observed(round_of(4, "a", "b")).suspects == {"b": 100.0}

    def test_a_suspicion_about_a_previous_agent_is_dropped_once_the_node_registers_again(self):
        # The report (revision 20) was about the agent registered at revision
        # 10; the node registered anew at 30 is another agent, and answers.
        view, _ = leader_view()
        register(view, "b", 10)
        report(view, KEYS.suspect_report("b"), "b", 4, revision=20, now=100.0)
        view.apply_node(KEYS.node("b"), None, 0, 101.0)
        register(view, "b", 30, now=102.0)
        assert view.observed(round_of(4, "a", "b")).suspects == {}

    def test_the_leaders_own_verdict_is_about_the_registration_it_names(self):
        view, _ = leader_view()
        register(view, "c", 12)
        view.suspect("c", 50.0, revision=13)  # as _lead does: registration + 1
        assert view.observed(None).suspects == {"c": 50.0}
        view.apply_node(KEYS.node("c"), None, 0, 51.0)
        register(view, "c", 40)
        assert view.observed(None).suspects == {}


class TestObserved:
    def test_alive_is_in_registration_order_whatever_the_order_of_the_events(self):
        view, _ = leader_view()
        register(view, "c", 30, now=3.0)
        register(view, "a", 10, now=1.0)
        register(view, "b", 20, now=2.0)
        observed = view.observed(None)
        assert [n.node_id for n in observed.alive] == ["a", "b", "c"]
        assert observed.first_seen == {"a": 1.0, "b": 2.0, "c": 3.0}
        assert observed.current is None

    def test_first_seen_is_kept_across_a_rewrite_of_the_registration_and_dropped_on_delete(self):
        view, _ = leader_view()
        register(view, "a", 10, now=1.0)
        register(view, "a", 10, now=5.0)  # a new master port advertised: same registration
        assert view.observed(None).first_seen == {"a": 1.0}
        view.apply_node(KEYS.node("a"), None, 0, 6.0)
        register(view, "a", 15, now=7.0)
        assert view.observed(None).first_seen == {"a": 7.0}

    def test_a_node_registered_after_the_round_is_a_newcomer_unless_it_runs_that_round(self):
        view, _ = leader_view()
        register(view, "a", 10)  # before the round (written at revision 40)
        register(view, "b", 50, running_round=4)  # back after an outage, workers running
        register(view, "c", 51)  # restarted agent
        register(view, "d", 52, running_round=3)  # runs an older round's workers
        observed = view.observed(round_of(4, "a", "b", "c", "d"), round_revision=40)
        assert observed.registered_since_round == frozenset({"c", "d"})

    def test_a_registration_running_a_round_counts_as_having_started_it(self):
        view, _ = leader_view()
        register(view, "a", 10)
        register(view, "b", 50, running_round=4)
        report(view, KEYS.started_report("a"), "a", 4, revision=45)
        report(view, KEYS.started_report("b"), "b", 5, revision=46)  # a newer report wins
        assert view.observed(round_of(4, "a", "b")).started == {"a": 4, "b": 5}
        register(view, "c", 53, running_round=4)
        assert view.observed(round_of(4, "a", "b", "c")).started == {"a": 4, "b": 5, "c": 4}

    def test_done_reports_carry_when_the_leader_learnt_them(self):
        view, _ = leader_view()
        report(view, KEYS.done_report("a"), "a", 4, revision=60, now=70.0)
        assert view.observed(None).done == {"a": (4, 70.0)}
        view.apply_request(KEYS.done_report("a"), None, 61, 71.0)
        assert view.observed(None).done == {}

    def test_checkpointed_since_names_nodes_registered_before_the_latest_commit(self):
        view, _ = leader_view()
        register(view, "a", 10)
        register(view, "b", 30)
        assert view.observed(None).checkpointed_since == frozenset()
        view.checkpoint_revision = 20
        assert view.observed(None).checkpointed_since == frozenset({"a"})

    def test_restart_and_drain_requests_until_served(self):
        view, _ = leader_view()
        request = RestartRequest("a", 4, "worker died", failure=True)
        key = KEYS.restart_request(4, "a")
        view.apply_request(key, request.to_json(), 70, 0.0)
        view.apply_request(KEYS.drain_request("b"), DrainRequest(by="elasticctl").to_json(),
                           71, 0.0)
        observed = view.observed(None)
        assert observed.restart_requests == (request,)
        assert observed.draining == frozenset({"b"})
        view.apply_request(key, None, 72, 0.0)
        view.apply_request(KEYS.drain_request("b"), None, 73, 0.0)
        observed = view.observed(None)
        assert observed.restart_requests == () and observed.draining == frozenset()

    def test_garbage_is_reported_once_and_counts_for_nothing(self):
        view, bad = leader_view()
        register(view, "a", 10)
        report(view, KEYS.started_report("a"), "a", 4, revision=45)
        view.apply_request(KEYS.started_report("a"), b"garbage", 46, 0.0)
        view.apply_node(KEYS.node("b"), b"{", 47, 0.0)
        observed = view.observed(None)
        assert observed.started == {} and [n.node_id for n in observed.alive] == ["a"]
        assert bad == [(KEYS.started_report("a"), 46), (KEYS.node("b"), 47)]

    def test_the_observed_picture_is_a_copy(self):
        view, _ = leader_view()
        register(view, "a", 10, now=1.0)
        observed = view.observed(None)
        register(view, "b", 20, now=2.0)
        view.draining.add("a")
        assert [n.node_id for n in observed.alive] == ["a"]
        assert observed.first_seen == {"a": 1.0} and observed.draining == frozenset()
