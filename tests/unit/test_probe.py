"""Probing a peer agent: the pure silence measure with explicit times, and the
probe thread with a scripted check."""

from __future__ import annotations

import threading
import time

from agent.probe import (
    PROBE_DEADLINE_S,
    PROBE_INTERVAL_S,
    PeerProbe,
    Silence,
    observe,
)

D = PROBE_DEADLINE_S
I = PROBE_INTERVAL_S


def probes(outcomes, start=100.0, silence=Silence()):
    """Run probes back to back from ``start``: each (answered, took_s), the next
    starting one interval after the one before (or when it ended, if later)."""
    t = start
    for answered, took in outcomes:
        silence = observe(silence, t, t + took, answered)
        t = max(t + I, t + took)
    return silence


def test_a_peer_that_answers_is_not_silent():
    s = probes([(True, 0.01)] * 5)
    assert s.since is None and s.proven_s == 0.0


def test_silence_counts_from_the_peers_last_answer_once_two_probes_failed():
    # The last answer ends at 100.01; the probes at 100.25, 100.5 and 100.75 time out.
    s = probes([(True, 0.01), (False, D)])
    assert s.proven_s == 0.0  # one failed probe proves nothing
    s = probes([(True, 0.01), (False, D), (False, D)])
    assert s.since == 100.01
    assert abs(s.proven_s - (100.75 - 100.01)) < 1e-9
    s = probes([(True, 0.01), (False, D), (False, D), (False, D)])
    assert abs(s.proven_s - (101.0 - 100.01)) < 1e-9


def test_without_an_answer_seen_silence_counts_from_the_first_failed_probe():
    s = probes([(False, 0.001)] * 3)  # refused at once: a dead agent
    assert s.since == 100.0 and abs(s.proven_s - 0.501) < 1e-9


def test_an_answer_ends_the_silence():
    s = probes([(True, 0.01), (False, D), (False, D), (True, 0.02)])
    assert s.since is None and s.proven_s == 0.0


def test_a_short_freeze_of_the_peer_stays_under_a_second():
    # Frozen for 0.4 s right after answering: the probe in flight fails, the
    # next is answered as soon as it thaws.
    s = probes([(True, 0.01), (False, D), (True, 0.15)])
    assert s.proven_s == 0.0


def test_a_probe_far_longer_than_its_deadline_means_this_agent_was_paused():
    # This node itself was frozen for 3 s with a probe in flight: that proves
    # nothing about the peer, nor does the answer from before the pause.
    s = probes([(True, 0.01), (False, 3.0), (False, D), (False, D)])
    assert s.since == 100.0 + I + 3.0  # the first failed probe after the pause
    assert abs(s.proven_s - 2 * D) < 1e-9


def test_a_probe_started_far_later_than_due_means_this_agent_was_paused():
    s = probes([(True, 0.01), (False, D)])
    s = observe(s, s.until + 3.0, s.until + 3.0 + D, False)  # paused between probes
    assert s.since is None and s.failed == 0
    assert s.answered_at is None  # the answer before the pause no longer counts


def test_the_probe_thread_reports_a_silent_peer_and_stops_at_once():
    silences: list[float] = []
    reported = threading.Event()

    def on_silent(silent_s):
        silences.append(silent_s)
        reported.set()

    probe = PeerProbe("peer:1", lambda addr: False, on_silent).start()
    try:
        assert reported.wait(5.0), "a peer that never answers must be reported"
    finally:
        began = time.monotonic()
        probe.stop()
        stopped_in = time.monotonic() - began
    count = len(silences)
    time.sleep(2 * I)
    assert len(silences) == count, "no report after stop()"
    assert silences[0] >= I and stopped_in < 0.1


def test_the_probe_thread_never_reports_a_peer_that_answers():
    silences: list[float] = []
    checked = threading.Event()

    def check(addr):
        checked.set()
        return True

    probe = PeerProbe("peer:1", check, silences.append).start()
    assert checked.wait(5.0)
    time.sleep(3 * I)
    probe.stop()
    assert silences == []
