"""The latest committed round as one node knows it, and waiting for the next.

The follower applies what the ``round`` key's watch and re-reads deliver; the
leader applies its own commits at once. Both go through :meth:`CommittedRound.apply`,
which keeps the version the leader fences on from ever going back.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Sequence

from elastic.clock import Clock
from elastic.errors import MalformedRecordError
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Round

ReportBad = Callable[[MalformedRecordError, int], None]


@functools.lru_cache(maxsize=4)
def _parse_round(key: str, value: bytes, version: int) -> Round:
    """``Round.from_json``, once per record in a process: nodes that share one
    (tests, the simulator, bench/rendezvous.py's 128 per process) get the same
    bytes, and a 1,024-member round takes ~7 ms to check. Rounds are immutable;
    a malformed record raises each time (exceptions are not cached)."""
    return Round.from_json(key, value, version)


class CommittedRound:
    """The latest valid committed round, the round key's version and the
    store revision it was written at. Thread-safe: any thread may read and
    wait; the node's loop applies."""

    def __init__(self, clock: Clock, node_id: str, log: JobLogger, report_bad: ReportBad,
                 on_committed: Sequence[Callable[[Round], None]] = ()):
        """``on_committed``: called in order with each valid new round."""
        self._clock = clock
        self._node_id = node_id
        self._log = log
        self._report_bad = report_bad
        self._on_committed = tuple(on_committed)
        self._cond = threading.Condition()
        self._round: Round | None = None
        self._version = 0  # of the round key as last seen (0: absent)
        self._revision = 0  # the store revision that round was written at

    @property
    def latest(self) -> Round | None:
        with self._cond:
            return self._round

    @property
    def version(self) -> int:
        """The round key's version as last applied: the next commit's fence."""
        return self._version

    @property
    def revision(self) -> int:
        return self._revision

    def apply(self, key: str, value: bytes | None, version: int, revision: int) -> None:
        """Apply the round key as written at ``revision`` (``value`` None:
        deleted). A valid new round is logged and passed to ``on_committed`` once."""
        parsed = None
        if value is not None:
            try:
                parsed = _parse_round(key, value, version)
            except MalformedRecordError as exc:
                self._report_bad(exc, version)
        with self._cond:
            if revision < self._revision:
                # Written before what this node applied already (a watch event
                # delivered after a commit or a re-read): applying it would set
                # the version back and fence every later commit on a stale one.
                return
            if parsed is not None and self._round is not None:
                if parsed.number == self._round.number:
                    return  # our own commit, applied already, now echoed by the watch
                if parsed.number < self._round.number:
                    return  # a re-read racing a newer watch event: keep the newer
            self._version = version if value is not None else 0
            self._revision = revision
            if parsed is not None or value is None:
                self._round = parsed
            # Else garbage replaced the round: the last valid one stays, its
            # workers run on, and the leader writes it again on top
            # (see Leader.lead).
            self._cond.notify_all()
        if parsed is not None:
            me = parsed.member(self._node_id)
            self._log.info("round %d committed (%s); %s", parsed.number, parsed.reason,
                           f"node rank {me.node_rank} of {len(parsed.members)}" if me
                           else "standby")
            for listener in self._on_committed:
                listener(parsed)

    def wait(self, predicate: Callable[[Round | None], bool], timeout_s: float,
             stopping: threading.Event) -> Round | None:
        """Block until ``predicate`` holds for the latest round, ``timeout_s``
        passes or ``stopping`` is set; return the latest round either way."""
        deadline = self._clock.monotonic() + timeout_s
        with self._cond:
            while not predicate(self._round):
                left = deadline - self._clock.monotonic()
                if left <= 0 or stopping.is_set():
                    break
                self._cond.wait(min(left, 0.5))
            return self._round
