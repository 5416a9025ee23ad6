"""The reason of a hang verdict: every member's stacks, compared into one line (I/O).

When this node judges a worker hung, the agent asks, before it stops
anything, every member of the round for its workers' stacks (the
``CollectStacks`` call; this node's own are read here at the same time), and
:func:`agent.hang_attribution.attribute` turns them into one line that names
the rank to blame and where it was. The whole wait is bounded
(:data:`PEERS_TIMEOUT_S`): a verdict is delayed by at most about that. A
member whose agent does not answer in time is named as such.

The full dumps stay beside each node's rank logs; this node's are named in
its log.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

from agent.hang_attribution import Attribution, HangKind, RankStack, attribute
from agent.health import WorkerHealth
from agent.stack_dumps import LocalWorker, StackCollector
from elastic.clock import Clock
from elastic.errors import ElasticError
from elastic.joblog import JobLogger
from elastic.records import cap_text
from elastic.rendezvous.api import Member, Round

# How long a worker's dump is waited for, on each node.
STACKS_TIMEOUT_S = 1.0
# How long the peers' answers are waited for (their own wait included).
PEERS_TIMEOUT_S = 1.8


class StackPeers(Protocol):
    """What the reporter asks of the peer mesh (:class:`agent.peers.GrpcPeerMesh`)."""

    def collect_stacks(self, addrs: tuple[str, ...], round_number: int,
                       timeout_s: float) -> list[RankStack]: ...


class HangReporter:
    """Reads this node's workers' stacks, and writes the reason of a hang verdict."""

    def __init__(self, collector: StackCollector, peers: StackPeers, node_id: str,
                 workers_of: Callable[[], list[LocalWorker]],
                 health_of: Callable[[], list[WorkerHealth]], clock: Clock, log: JobLogger,
                 read_whole: Callable[[], Round | None] = lambda: None):
        """``workers_of``: this node's live workers now; ``health_of``: the
        agent's health records of them; ``read_whole``: the latest round with
        its members whole (read from etcd: a large job's round holds this
        node's bucket alone)."""
        self._read_whole = read_whole
        self._collector = collector
        self._peers = peers
        self._node_id = node_id
        self._workers_of = workers_of
        self._health_of = health_of
        self._clock = clock
        self._log = log
        # The last stacks read (round, stacks): a peer whose verdict came a
        # moment later finds this node's workers already stopped.
        self._latest: tuple[int, list[RankStack]] = (0, [])

    def local(self, round_number: int) -> list[RankStack]:
        """This node's workers' stacks, summarised; ``round_number`` is the
        round they were started in (``Round.workers_round``). The full dumps
        are named in the log. Once they are stopped, the stacks last read in
        that round. Never raises."""
        workers = self._workers_of()
        if not workers and self._latest[0] == round_number:
            return list(self._latest[1])
        stacks = self._collector.collect(round_number, workers, self._health_of(),
                                         self._clock.monotonic(), STACKS_TIMEOUT_S)
        self._latest = (round_number, stacks)
        # Named by the workers' round: the next one may be committed while they are read.
        round_log = self._log.at_round(round_number)
        for s in stacks:
            where = self._collector.path(round_number, s.rank) if s.dumped else "no dump"
            round_log.info("stack of rank %d at the hang: %s (full stacks: %s)", s.rank,
                           s.where(), where)
        return stacks

    def report(self, round_: Round, verdict: str,
               deliver: Callable[[Attribution], None]) -> None:
        """Hand :meth:`reason` to ``deliver`` from a thread of its own, and
        return at once: the collection takes up to about
        :data:`PEERS_TIMEOUT_S`, during which the agent's loop goes on
        (a node may die meanwhile)."""
        threading.Thread(target=lambda: deliver(self.reason(round_, verdict)),
                         name="hang-attribution", daemon=True).start()

    def reason(self, round_: Round, verdict: str) -> Attribution:
        """``verdict`` (this node's hang verdict) with the attribution of the
        whole round's stacks before it, and the rule's kind. Never raises."""
        members = self._members_of(round_)
        addrs = tuple(m.addr for m in members if m.node_id != self._node_id and m.addr)
        with ThreadPoolExecutor(max_workers=1) as pool:
            remote = pool.submit(self._peers.collect_stacks, addrs, round_.number,
                                 PEERS_TIMEOUT_S)
            ranks = self.local(round_.workers_round)
            try:
                ranks += remote.result()
            except Exception as exc:  # noqa: BLE001 - an attribution never blocks the verdict
                self._log.warning("could not ask the peers for their stacks: %s", exc)
        answered = {r.node_id for r in ranks}
        silent = [m.node_id for m in members if m.node_id not in answered]
        attribution = attribute(ranks)
        line = attribution.reason
        if silent:
            line += f"{'; ' if line else ''}no stacks from node(s) {', '.join(silent)}"
        if not line:
            return Attribution(verdict, attribution.kind)
        return Attribution(cap_text(f"{line} [{verdict}]"), attribution.kind)

    def _members_of(self, round_: Round) -> Sequence[Member]:
        """Every member of ``round_``: read whole once for a large job's
        round; those of this node's bucket when that read fails or finds
        another round. Never raises."""
        if round_.holds_members:
            return round_.members
        try:
            whole = self._read_whole()
            if whole is not None and whole.number == round_.number:
                return whole.members
        except ElasticError as exc:
            self._log.warning("round %d not read whole, stacks asked of this node's bucket "
                              "only: %s", round_.number, exc)
        try:
            return round_.held_members()
        except ElasticError as exc:
            self._log.warning("round %d: no peer asked for stacks: %s", round_.number, exc)
            return ()


class VerdictOnly:
    """A reporter that reads no stacks: the verdict is the reason (agents
    built without rank logs, as the fault simulator builds them)."""

    def local(self, round_number: int) -> list[RankStack]:
        return []

    def report(self, round_: Round, verdict: str,
               deliver: Callable[[Attribution], None]) -> None:
        """The verdict alone, delivered at once (in the caller's thread: the
        simulator stays deterministic)."""
        deliver(Attribution(verdict, HangKind.NO_STACKS))
