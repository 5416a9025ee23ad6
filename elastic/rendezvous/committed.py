"""The latest committed round as one node knows it, and waiting for the next.

The follower applies what the ``round`` key's watch and re-reads deliver
(:meth:`CommittedRound.apply`); the leader applies its own commits at once
(:meth:`CommittedRound.committed`). Both keep the version the leader fences
on from ever going back. A head whose roster this node cannot rebuild from
what it holds (:func:`~elastic.rendezvous.round_record.resolve`) waits, as
:attr:`CommittedRound.awaiting`, until the follower reads the head with its
roster, or with this node's bucket of it when the head names buckets. A round
is taken once this node's own line in its roster checks out; whoever uses its
members whole asks :meth:`CommittedRound.checked` first, which reads the
roster whole when this node holds one bucket of it, and refuses a roster
that fails.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from elastic.clock import Clock
from elastic.errors import MalformedRecordError, StoreError
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Round
from elastic.rendezvous.buckets import BucketRoster
from elastic.rendezvous.round_record import RoundHead, parse_head, resolve

ReportBad = Callable[[MalformedRecordError, int], None]
# Reads the job's current round whole from etcd (None: no round); raises the
# store's errors and MalformedRecordError.
ReadWhole = Callable[[], Round | None]


class CommittedRound:
    """The latest valid committed round, the round key's version and the
    store revision it was written at. Thread-safe: any thread may read and
    wait; the node's loop applies."""

    def __init__(self, clock: Clock, node_id: str, log: JobLogger, report_bad: ReportBad,
                 on_committed: Sequence[Callable[[Round], None]] = (),
                 read_whole: ReadWhole | None = None):
        """``on_committed``: called in order with each valid new round;
        ``read_whole``: how :meth:`checked` reads a roster this node holds
        one bucket of (None: it never holds one)."""
        self._read_whole = read_whole
        self._clock = clock
        self._node_id = node_id
        self._log = log
        self._report_bad = report_bad
        self._on_committed = tuple(on_committed)
        self._cond = threading.Condition()
        self._round: Round | None = None
        self._version = 0  # of the round key as last seen (0: absent)
        self._revision = 0  # the store revision that round was written at
        self._roster = ""  # the digest of that round's roster
        self._awaiting = 0  # a head's revision whose roster is still to be read
        self._awaiting_head: RoundHead | None = None  # that head
        self._checked: tuple[Round | None, str] = (None, "")  # the last round checked whole

    @property
    def latest(self) -> Round | None:
        with self._cond:
            return self._round

    @property
    def running(self) -> bool:
        """Whether the latest round is one whose workers run (it has no outcome)."""
        with self._cond:
            return self._round is not None and not self._round.outcome

    @property
    def version(self) -> int:
        """The round key's version as last applied: the next commit's fence."""
        return self._version

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def roster(self) -> str:
        """The digest of the latest round's roster ("" while there is none)."""
        return self._roster

    @property
    def awaiting(self) -> bool:
        """Whether a head arrived whose roster this node does not hold: the
        follower reads head and roster, or head and bucket (it is then
        applied or refused)."""
        return self._awaiting > self._revision

    @property
    def awaiting_head(self) -> RoundHead | None:
        """The head :attr:`awaiting` waits to resolve (None: none)."""
        return self._awaiting_head if self.awaiting else None

    def apply(self, key: str, value: bytes | None, version: int, revision: int,
              stored: dict[str, bytes] | None = None,
              bucket: dict[str, bytes | None] | None = None) -> None:
        """Apply the round key as written at ``revision`` (``value`` None:
        deleted); ``stored``: the rosters read with it, ``bucket``: or what
        was read at this node's bucket of a roster (see
        :func:`~elastic.rendezvous.round_record.resolve`), when it was read. A
        valid new round is logged and passed to ``on_committed`` once."""
        head = None
        if value is not None:
            try:
                head = parse_head(key, value, version)
            except MalformedRecordError as exc:
                self._report_bad(exc, version)
        with self._cond:
            if revision < self._revision:
                # Written before what this node applied already (a watch event
                # delivered after a commit or a re-read): applying it would set
                # the version back and fence every later commit on a stale one.
                return
            if head is not None and self._round is not None and head.number <= self._round.number:
                return  # our own commit echoed by the watch, or a re-read racing a newer event
            known, known_roster = self._round, self._roster
        parsed = None
        if head is not None:
            try:
                parsed = resolve(head, known, known_roster, stored, bucket, self._node_id)
            except MalformedRecordError as exc:
                self._report_bad(exc, version)
            else:
                if parsed is None:
                    # No roster to rebuild it from: read it.
                    self._awaiting, self._awaiting_head = revision, head
                    return
        self._set(parsed, head.roster if parsed is not None else "", value is None, version,
                  revision)

    def checked(self) -> Round | None:
        """The latest round with every member built and checked (a roster read
        from etcd is taken once this node's own line checks out, and builds
        the others when first used whole). One that fails is refused as a
        malformed record is: reported, and the last round that passed is the
        latest again at the same version (its workers run on; a leader writes
        it again on top, see Leader.lead). Raises the store's errors when
        it reads the roster whole."""
        current = self.latest
        if current is None:
            return None
        try:
            current = self._whole(current)
            current.check_members()
        except MalformedRecordError as exc:
            self._report_bad(exc, self._version)
            with self._cond:
                if self._round is current:
                    self._round, self._roster = self._checked
                    self._cond.notify_all()
                return self._round
        with self._cond:
            if self._round is current:
                self._checked = (current, self._roster)
        return current

    def _whole(self, current: Round) -> Round:
        """``current``, its roster read whole if this node holds one bucket of
        it (taking its place). Raises the store's errors (StoreError too when
        a newer round replaced it meanwhile: the watch brings that one, and
        the caller asks again), and MalformedRecordError when the read finds
        no round or an older one."""
        if not isinstance(current.members, BucketRoster) or self._read_whole is None:
            return current
        read = self._read_whole()
        if read is None or read.number < current.number:
            raise MalformedRecordError(current.members.key, f"round {current.number} is no "
                                       "longer in etcd to be read whole")
        if read.number > current.number:
            raise StoreError(f"round {current.number} was replaced by round {read.number} "
                             "while it was read whole; read again")
        with self._cond:
            if self._round is current:
                self._round = read
        return read

    def committed(self, record: Round, roster: str, revision: int) -> None:
        """Apply this node's own commit of ``record`` (whose roster is
        ``roster``) at ``revision``."""
        self._set(record, roster, False, record.number, revision)

    def _set(self, parsed: Round | None, roster: str, deleted: bool, version: int,
             revision: int) -> None:
        with self._cond:
            if revision < self._revision:
                return
            self._version = 0 if deleted else version
            self._revision = revision
            if parsed is not None or deleted:
                self._round = parsed
                self._roster = roster
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
