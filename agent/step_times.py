"""A node's step times per rank: kept from its workers' heartbeats, published for the leader.

Each heartbeat of a worker carries the mean wall time of its steps since the
previous one and, where it is measured, the mean time its training thread was
busy in them (:class:`elastic.worker.step_timer.StepTimer`).
:class:`StepTimes` keeps the last :data:`SAMPLES` of each per rank of the
running round, and a rank's windowed time of each measure is their median:
one slow beat (a garbage collection, a data-loader hiccup) moves it little.

The node writes them, as a :class:`StepTimeRecord`, under
``step-times/<node>`` with its lease, for the leader's straggler rule
(:mod:`agent.stragglers`): at most once per period and only when the round,
the ranks or a rank's time of either measure (by more than :data:`CHANGE`)
changed (:class:`PublishRule`). A job in steady state then writes almost
nothing, whatever its size; the leader reads the prefix once per period.
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
# A rank's time that moved by less than this fraction of its wall time is not written again.
CHANGE = 0.05
# The largest step time a record may hold (seconds): a day.
MAX_STEP_S = 86_400.0
_MAX_RANK = 2**31 - 1


@dataclass(frozen=True)
class StepTimeRecord:
    """A node's windowed times (seconds per step) per global rank in
    ``round``: wall (``step_s``) and, for the ranks that measure it, busy
    (``busy_s``)."""

    round: int
    step_s: dict[int, float] = field(default_factory=dict)
    busy_s: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps({"round": self.round, "step_s": _rounded(self.step_s),
                           "busy_s": _rounded(self.busy_s)}).encode()

    @classmethod
    def from_json(cls, key: str, raw: bytes) -> "StepTimeRecord":
        """The record at ``key``; MalformedRecordError naming the field when it
        is not an object, its round not a count, or ``step_s`` or ``busy_s``
        (absent in an older agent's record: none) not an object of at most
        MAX_NPROC ranks to finite times in 0..MAX_STEP_S."""
        obj = load_object(key, raw)
        number = int_field(key, obj, "round", 0)
        return cls(number, _times(key, obj, "step_s", typed_field(key, obj, "step_s", dict)),
                   _times(key, obj, "busy_s", typed_field(key, obj, "busy_s", dict, {})))


def _rounded(times: dict[int, float]) -> dict[str, float]:
    return {str(r): round(s, 6) for r, s in sorted(times.items())}


def _times(key: str, obj: dict, name: str, times: dict) -> dict[int, float]:
    """Field ``name`` of the record at ``key`` read as rank -> seconds."""
    if len(times) > MAX_NPROC:
        raise MalformedRecordError(key, f"field {name!r} holds {len(times)} ranks")
    read = {}
    for rank, seconds in times.items():
        if not (rank.isdigit() and int(rank) <= _MAX_RANK):
            raise MalformedRecordError(key, f"field {name!r} has the rank {rank[:20]!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not math.isfinite(seconds) or not 0 < seconds <= MAX_STEP_S:
            raise MalformedRecordError(
                key, f"field {name!r} gives rank {rank} {str(seconds)[:20]!r}, expected "
                     f"seconds in (0, {MAX_STEP_S:g}]")
        read[int(rank)] = float(seconds)
    return read


class StepTimes:
    """The recent step times of this node's ranks in the running round (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round = -1
        self._wall: dict[int, deque[float]] = {}
        self._busy: dict[int, deque[float]] = {}

    def observe(self, round_number: int, rank: int, step_time_s: float,
                step_busy_s: float = 0.0) -> None:
        """A heartbeat of ``rank`` in ``round_number`` carried ``step_time_s``
        (0: none timed, the beat is ignored) and ``step_busy_s`` (0: not
        measured; the rank's busy samples are dropped, and it needs
        :data:`MIN_SAMPLES` again). A new round forgets the old one's times: its ranks are
        numbered afresh."""
        if step_time_s <= 0:
            return
        with self._lock:
            if round_number != self._round:
                if round_number < self._round:
                    return
                self._round, self._wall, self._busy = round_number, {}, {}
            self._wall.setdefault(rank, deque(maxlen=SAMPLES)).append(step_time_s)
            if step_busy_s > 0:
                self._busy.setdefault(rank, deque(maxlen=SAMPLES)).append(step_busy_s)
            else:  # not measured any more (CUDA came into use): its old samples are not now
                self._busy.pop(rank, None)

    def record(self) -> StepTimeRecord:
        """The windowed times of each rank with enough samples of the measure."""
        with self._lock:
            return StepTimeRecord(max(self._round, 0), _medians(self._wall),
                                  _medians(self._busy))


def _medians(samples: dict[int, deque[float]]) -> dict[int, float]:
    return {rank: statistics.median(s) for rank, s in samples.items() if len(s) >= MIN_SAMPLES}


class PublishRule:
    """Whether a node's record is worth writing (pure; times: monotonic s)."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._written: StepTimeRecord | None = None
        self._written_at = -math.inf

    def due(self, record: StepTimeRecord, now: float) -> bool:
        """The period passed since the last write and ``record`` says
        something new: another round, other ranks, a wall time that moved by
        more than :data:`CHANGE` of itself, or a busy time by more than that
        share of the rank's wall time (the busy time of a rank that mostly
        waits is small and noisy, and only its share of a step is judged). A
        record without times is never due."""
        if not record.step_s or now - self._written_at < self.period_s:
            return False
        last = self._written
        return last is None or last.round != record.round \
            or _moved(last.step_s, record.step_s, last.step_s) \
            or _moved(last.busy_s, record.busy_s, last.step_s)

    def written(self, record: StepTimeRecord, now: float) -> None:
        self._written, self._written_at = record, now

    def forget(self) -> None:
        """Write the next record whatever it says (the lease, and the key with
        it, may be new)."""
        self._written = None


def _moved(last: dict[int, float], now: dict[int, float], wall: dict[int, float]) -> bool:
    """Other ranks, or a time that moved by more than :data:`CHANGE` of the
    rank's ``wall`` time (as last written)."""
    return last.keys() != now.keys() or any(abs(s - last[r]) > CHANGE * wall.get(r, s)
                                            for r, s in now.items())
