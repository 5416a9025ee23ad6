"""Probing a peer agent: the pure silence account with explicit times, and the
probe thread with a scripted peer."""

from __future__ import annotations

import threading
import time

from agent.probe import PROBE_INTERVAL_S, PeerProbe, Silence

I = PROBE_INTERVAL_S


def probing(start, sends, answers=()):
    """The silence after probes sent at ``start + k * I`` for k < ``sends``,
    with answers arriving at the times in ``answers``."""
    events = sorted([(start + k * I, "sent") for k in range(sends)]
                    + [(t, "answer") for t in answers])
    s = Silence(start)
    for t, what in events:
        s = s.sent(t) if what == "sent" else s.answered(t)
    return s


def test_a_peer_that_answers_every_probe_is_never_silent():
    s = probing(100.0, 8, answers=[100.0 + k * I + 0.01 for k in range(8)])
    assert s.silent_s(100.0 + 8 * I) == 0.0


def test_silence_counts_from_the_last_answer_once_two_probes_went_unanswered():
    s = probing(100.0, 2, answers=[100.01])  # answered the first probe only
    assert s.silent_s(100.3) == 0.0  # one probe unanswered proves nothing
    s = probing(100.0, 3, answers=[100.01])
    assert abs(s.silent_s(100.5) - 0.49) < 1e-9
    s = probing(100.0, 6, answers=[100.01])
    assert abs(s.silent_s(101.25) - 1.24) < 1e-9


def test_a_late_answer_still_proves_the_peer_alive():
    # A slow network: every answer comes 0.6 s after its probe.
    s = probing(100.0, 12, answers=[100.6 + k * I for k in range(10)])
    assert s.silent_s(100.0 + 11 * I) == 0.0


def test_a_short_freeze_of_the_peer_ends_with_its_next_answer():
    # Frozen for 0.4 s after answering at 100.01: the probes sent meanwhile
    # are answered as it thaws.
    s = probing(100.0, 3, answers=[100.01, 100.41, 100.41])
    assert s.silent_s(100.5) == 0.0


def test_a_probe_sent_far_later_than_due_means_this_agent_was_paused():
    # This node itself was frozen for 3 s: no answer could arrive meanwhile.
    s = probing(100.0, 3, answers=[100.01])
    s = s.sent(100.5 + 3.0)
    assert s.since == 103.5 and s.unanswered == 1
    assert s.silent_s(103.6) == 0.0
    s = s.sent(103.75).sent(104.0)
    assert abs(s.silent_s(104.0) - 0.5) < 1e-9


class ScriptedPeer:
    """Answers each probe after ``delay_s`` unless frozen."""

    def __init__(self, delay_s=0.0):
        self.delay_s = delay_s
        self.frozen = False
        self.sent = 0

    def send(self, on_answer):
        self.sent += 1
        if not self.frozen:
            threading.Timer(self.delay_s, on_answer).start()


def test_the_probe_thread_reports_a_frozen_peer_and_stops_at_once():
    peer = ScriptedPeer()
    silences: list[float] = []
    reported = threading.Event()

    def on_silent(silent_s):
        silences.append(silent_s)
        reported.set()

    probe = PeerProbe("peer:1", peer.send, on_silent).start()
    try:
        time.sleep(3 * I)
        assert silences == []  # it answers
        peer.frozen = True
        frozen_at = time.monotonic()
        assert reported.wait(5.0), "a peer that stopped answering must be reported"
        assert time.monotonic() - frozen_at < 1.0  # two unanswered probes, not a lease TTL
    finally:
        began = time.monotonic()
        probe.stop()
        stopped_in = time.monotonic() - began
    count = len(silences)
    time.sleep(2 * I)
    assert len(silences) == count, "no report after stop()"
    assert stopped_in < 0.1


def test_a_slow_peer_is_never_silent_for_longer_than_its_answers_are_late():
    peer = ScriptedPeer(delay_s=0.6)  # each answer 0.6 s late: slower than the interval
    silences: list[float] = []
    probe = PeerProbe("peer:1", peer.send, silences.append).start()
    time.sleep(12 * I)
    probe.stop()
    assert peer.sent >= 8
    assert max(silences, default=0.0) <= 0.6 + 2 * I, silences  # far below a freeze timeout
