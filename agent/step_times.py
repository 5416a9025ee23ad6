"""A node's step times per rank: kept from its workers' heartbeats, published for the leader.

Each heartbeat of a worker carries the mean time of its steps since the
previous one (:class:`elastic.worker.step_timer.StepTimer`). :class:`StepTimes`
keeps the last :data:`SAMPLES` of them per rank of the running round, and a
rank's windowed step time is their median: one slow beat (a garbage
collection, a data-loader hiccup) moves it little.

The node writes them, as a :class:`StepTimeRecord`, under
``step-times/<node>`` with its lease, for the leader's straggler rule
(:mod:`agent.stragglers`): at most once per period and only when the round,
the ranks or a rank's time (by more than :data:`CHANGE`) changed
(:class:`PublishRule`). A job in steady state then writes almost nothing,
whatever its size; the leader reads the prefix once per period.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

from elastic.errors import MalformedRecordError
from elastic.records import MAX_NPROC, int_field, load_object, typed_field

# Heartbeats kept per rank (one every 2 s at most: about the last 20 s).
SAMPLES = 10
# A rank needs this many before it has a windowed time.
MIN_SAMPLES = 3
# A rank's time that moved by less than this fraction is not written again.
CHANGE = 0.05
# The largest step time a record may hold (seconds): a day.
MAX_STEP_S = 86_400.0
_MAX_RANK = 2**31 - 1


@dataclass(frozen=True)
class StepTimeRecord:
    """A node's windowed step time (seconds) per global rank in ``round``."""

    round: int
    step_s: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"round": self.round,
                           "step_s": {str(r): round(s, 6) for r, s in
                                      sorted(self.step_s.items())}}).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "StepTimeRecord":
        """The record at ``key``; MalformedRecordError naming the field when it
        is not an object, its round not a count, or ``step_s`` not an object of
        at most MAX_NPROC ranks to finite times in 0..MAX_STEP_S."""
        obj = load_object(key, raw)
        number = int_field(key, obj, "round", 0)
        times = typed_field(key, obj, "step_s", dict)
        if len(times) > MAX_NPROC:
            raise MalformedRecordError(key, f"field 'step_s' holds {len(times)} ranks")
        step_s = {}
        for rank, seconds in times.items():
            if not (rank.isdigit() and int(rank) <= _MAX_RANK):
                raise MalformedRecordError(key, f"field 'step_s' has the rank {rank[:20]!r}")
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                    or not math.isfinite(seconds) or not 0 < seconds <= MAX_STEP_S:
                raise MalformedRecordError(
                    key, f"field 'step_s' gives rank {rank} {str(seconds)[:20]!r}, expected "
                         f"seconds in (0, {MAX_STEP_S:g}]")
            step_s[int(rank)] = float(seconds)
        return cls(number, step_s)


class StepTimes:
    """The recent step times of this node's ranks in the running round (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round = -1
        self._samples: dict[int, deque[float]] = {}

    def observe(self, round_number: int, rank: int, step_time_s: float) -> None:
        """A heartbeat of ``rank`` in ``round_number`` carried ``step_time_s``
        (0: none timed, ignored). A new round forgets the old one's times:
        its ranks are numbered afresh."""
        if step_time_s <= 0:
            return
        with self._lock:
            if round_number != self._round:
                if round_number < self._round:
                    return
                self._round, self._samples = round_number, {}
            self._samples.setdefault(rank, deque(maxlen=SAMPLES)).append(step_time_s)

    def record(self) -> StepTimeRecord:
        """The windowed time of each rank with enough samples."""
        with self._lock:
            return StepTimeRecord(max(self._round, 0), {
                rank: statistics.median(s) for rank, s in self._samples.items()
                if len(s) >= MIN_SAMPLES})


class PublishRule:
    """Whether a node's record is worth writing (pure; times: monotonic s)."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._written: StepTimeRecord | None = None
        self._written_at = -math.inf

    def due(self, record: StepTimeRecord, now: float) -> bool:
        """The period passed since the last write and ``record`` says
        something new: another round, other ranks, or a time that moved by
        more than :data:`CHANGE`. A record without times is never due."""
        if not record.step_s or now - self._written_at < self.period_s:
            return False
        last = self._written
        if last is None or last.round != record.round or last.step_s.keys() != record.step_s.keys():
            return True
        return any(abs(s - last.step_s[r]) > CHANGE * last.step_s[r]
                   for r, s in record.step_s.items())

    def written(self, record: StepTimeRecord, now: float) -> None:
        self._written, self._written_at = record, now

    def forget(self) -> None:
        """Write the next record whatever it says (the lease, and the key with
        it, may be new)."""
        self._written = None
