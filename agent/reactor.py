"""The agent's decisions: ``react(view, event, now, settings) -> (view, commands)``.

Pure, like :func:`elastic.rendezvous.decisions.decide`: no I/O, no clock
reads, no threads. The agent's loop (:mod:`agent.daemon`) turns what happens
into typed events, calls :func:`react`, and applies the commands in order;
tests and the fault simulator (``tests/sim``) drive it with explicit times.

The view's ``state`` is the agent's one state. Each state it moves through on
the way is a :class:`Transition` command, in order: the loop has
:class:`agent.lifecycle.Lifecycle` check that they lead from the state before
to the state after along its table, and publish each as it is applied.

The rules:

* A committed round that includes this node replaces the round its workers
  run in: stop them (if any), start workers with the new ranks, report
  "started" to the leader. A round that continues the one the workers run
  in (the same round written again after a malformed record replaced it,
  ``Round.continues``) replaces it and changes nothing else; one that
  continues workers this node does not run starts none. A round without
  this node makes it a standby (or, if its drain was requested, makes it
  leave). A round with an outcome ends the agent: SUCCEEDED or FAILED,
  stopping any workers left.
* A worker that exits non-zero, a hung worker, or a ring peer that reports its
  workers unhealthy (NOT_SERVING) for longer than a lease TTL fails the
  round: stop this node's workers first, then ask for a restart (counted
  against the budget). A stop never waits on etcd.
* How long a stop gives workers between SIGTERM and SIGKILL
  (:class:`StopGrace`): the drain's grace (``--stop-grace``, time for a final
  checkpoint) when this node drains, is signalled, or the job ends with
  success, and for a round that only adds members (a scale-up); the failure's
  (``--failure-stop-grace``, short) after a failure here or anywhere in the
  round (a new round that lost a member or counts a failure, any other
  restart, the job failing): survivors blocked in a collective whose peer is
  gone never run their SIGTERM handler, so waiting longer only delays the
  restart. None at all when this node is cut off from etcd.
* When every worker of this node exited 0 the node is DONE: it reports that
  to the leader and waits (the exit barrier) for the job's outcome; its
  workers are not stopped and nothing is declared until every member is done.
* A ring peer whose agent does not answer (UNREACHABLE) is reported to the
  leader as a suspect, once per round: an early signal, the lease decides.
* With ``--freeze-timeout`` above 0 (``Settings.freeze_timeout_s``), a ring
  peer whose agent answered none of this agent's probes for that long
  (:class:`PeerSilent`, measured by :mod:`agent.probe`) is reported to the
  leader as frozen, once per round: the leader checks it too and revokes its
  lease (:func:`elastic.rendezvous.decisions.revoke_frozen`), so the round
  re-forms without waiting a lease TTL.
* Partition rule: when this node's lease has not been confirmed for half a
  TTL while its workers run, it asks the round's peers and standbys whether
  they reach etcd. If any does, this node is the one cut off: it kills its
  workers before its lease can expire at etcd (fail-stop, no zombie group),
  and asks for a new round (not a failure) for when it is back. Only if
  every peer asked answered and none reaches etcd is etcd itself down: no
  round can form anywhere, and training goes on. A peer that does not answer
  might have etcd, so the node then stops its workers as if cut off. A leader about to
  leave out members whose lease expired tells them it reaches etcd, which
  stops them too (the fence of :class:`elastic.rendezvous.leader.Leader`, its
  rule :func:`elastic.rendezvous.decisions.fence_lost_members`).
* A node never included in a round within the join timeout gives up.
* With ``--gpu-check warn`` or ``enforce`` (``Settings.gpu_check``), a round
  that includes this node first has its GPUs checked (:class:`CheckGpus`,
  answered with :class:`GpuChecked`, judged by
  :func:`agent.gpu_health.decide`): the node stays STARTING, asking again
  when the check says WAIT, then starts its workers (PASS, or WARN with a
  note), or leaves the job (LEAVE): it announces a drain (its peers' failures
  are the leave's doing, not failures), leaves the rendezvous and ends FAILED
  with exit code 6 (:data:`elastic.errors.EXIT_NODE_UNFIT`).
* Every stop of the workers carries its typed cause (:class:`StopCause`): why
  they stopped, whether that is a restart, and how long the fault went
  undetected; metrics count restarts by it, never by a reason's text.

The loop's other threads answer from the view through pure rules too
(:func:`heartbeat_reply`, :func:`store_health`, :func:`reports_for_new_lease`).
"""

from __future__ import annotations

import dataclasses
import math
import enum
import signal
from dataclasses import dataclass
from typing import Union

from agent.gpu_health import GpuAction, GpuDecision
from agent.hang_attribution import HangKind
from agent.health import PeerHealth
from agent.lifecycle import AgentState
from elastic.errors import EXIT_NODE_UNFIT, ElasticError, RendezvousTimeoutError
from elastic.rendezvous.api import Outcome, ReportKind, Round
from elastic.store.api import KEEPALIVE_TTL_FRACTION

S = AgentState
# A node cut off from etcd stops its workers once its lease has gone this
# fraction of its TTL unconfirmed: late enough that an etcd leader election or
# a reconnect to another member (seconds) restarts nothing, early enough that
# the workers are gone before etcd can expire the lease.
STOP_AT_TTL_FRACTION = 0.7
# etcd is in doubt once a keep-alive is this many intervals late: no hang is
# judged then (a rank may wait on a commit that the outage blocks, and no round
# could form without etcd anyway), and that time never counts toward one.
STORE_DOUBT_KEEPALIVES = 1.5
# The longest a hang verdict waits for its attribution (the collection itself
# is bounded at about 2 s: agent.hang_report) before it fails the round alone.
ATTRIBUTION_WAIT_S = 5.0


# ------------------------------------------------------------------ events

@dataclass(frozen=True)
class Joined:
    """The agent registered with the rendezvous (or joined it without a
    registration, ``reason`` says why): its first transition, INIT -> JOINING."""

    reason: str


@dataclass(frozen=True)
class GaveUp:
    """The agent cannot go on (an error its loop raised): it ends FAILED."""

    reason: str


@dataclass(frozen=True)
class RoundCommitted:
    """A round was committed. ``drain_requested``: a drain of this node is
    pending (read by the loop only when the round leaves this node out).
    ``registered_after``: the round committed when this agent registered
    (rounds up to it were formed without this registration), None while it
    is not registered."""

    round: Round
    drain_requested: bool = False
    registered_after: int | None = 0


@dataclass(frozen=True)
class WorkerExited:
    round: int
    local_rank: int
    rank: int
    pid: int
    exit_code: int
    signal: int | None = None
    stopped: bool = False  # the exit follows a stop the agent asked for
    cause: str = ""  # the exception that ended it ("Type: text"), from its error file
    log_path: str = ""  # the rank's log of this round


@dataclass(frozen=True)
class PeerHealthChanged:
    """The ring peer ``node_id``'s agent now reports ``health``."""

    node_id: str
    health: PeerHealth


@dataclass(frozen=True)
class PeerSilent:
    """The ring peer ``node_id``'s agent has answered none of this agent's
    probes for ``silent_s`` seconds (:mod:`agent.probe`: this agent's own
    pauses never count)."""

    node_id: str
    silent_s: float


@dataclass(frozen=True)
class LeaseState:
    """The answer to :class:`CheckPeersStore`: how long this node's lease has
    gone unconfirmed, how long ago etcd last confirmed the lease of each peer
    that answered (``(addr, age_s)``, -1 for never), and how many answered."""

    unconfirmed_s: float
    peer_ages: tuple[tuple[str, float], ...]
    peers_asked: int
    peers_answered: int = -1  # -1: as many as were asked


@dataclass(frozen=True)
class DrainRequested:
    reason: str


@dataclass(frozen=True)
class Signalled:
    signum: int


@dataclass(frozen=True)
class Tick:
    """Time passed. Carries what the loop measured: hang verdicts of this
    node's workers, how long the lease has gone unconfirmed, whether every
    worker made a step, why the node is not registered (if it is not), and
    the standbys the leader last published."""

    hung: tuple[str, ...] = ()
    lease_unconfirmed_s: float = 0.0
    workers_stepped: bool = False
    registration_problem: str = ""
    standby_addrs: tuple[str, ...] = ()  # whom, besides the members, to ask about etcd
    # When the hung workers last showed life (monotonic): for the time-to-detect
    # metric only; the verdicts above decide.
    hung_since: float | None = None
    # The earliest a worker not hung now could be judged hung (health.next_hang_verdict_at).
    next_hang_at: float | None = None


@dataclass(frozen=True)
class HangAttributed:
    """The answer to :class:`AttributeHang`: ``reason`` is the verdict with the
    attribution of every member's stacks (the verdict alone if none came)."""

    round: int
    reason: str
    kind: HangKind = HangKind.NO_STACKS  # which attribution rule wrote it


@dataclass(frozen=True)
class GpuChecked:
    """The answer to :class:`CheckGpus` for ``round``."""

    round: int
    decision: GpuDecision


Event = Union[Joined, GaveUp, RoundCommitted, WorkerExited, PeerHealthChanged, PeerSilent,
              LeaseState, DrainRequested, Signalled, Tick, GpuChecked, HangAttributed]


# ---------------------------------------------------------------- commands

@dataclass(frozen=True)
class Transition:
    to: AgentState
    reason: str
    round: int


@dataclass(frozen=True)
class StartWorkers:
    round: Round
    restart_count: int


class StopGrace(enum.Enum):
    """How long stopped workers get between SIGTERM and SIGKILL."""

    DRAIN = "drain"  # --stop-grace: a planned stop, time for a final checkpoint
    FAILURE = "failure"  # --failure-stop-grace: a failure; survivors may be stuck in a collective
    NONE = "none"  # SIGKILL at once: the lease may expire before any grace ends


class StopCause(enum.Enum):
    """Why this node's workers are stopped. The value of a restart's cause is
    the ``reason`` label of ``elasticd_restarts`` (:mod:`agent.metrics`)."""

    WORKER_EXIT = "worker_exit"  # a worker of this node exited non-zero or was killed
    WORKER_HANG = "worker_hang"  # a worker of this node made no progress (or went silent)
    PEER_UNHEALTHY = "peer_unhealthy"  # the ring peer was NOT_SERVING for a lease TTL
    STORE_CUT_OFF = "store_cut_off"  # this node was cut off from etcd (the partition rule)
    NODE_LEFT = "node_left"  # a new round without some members (lease lost, drained)
    PEER_FAILURE = "peer_failure"  # a new round, same members, a failure counted elsewhere
    NODE_JOINED = "node_joined"  # a new round with more members (scale up)
    REQUESTED = "requested"  # a new round, same members, no failure (an operator, a node back)
    JOB_ENDED = "job_ended"  # the job succeeded or failed: not a restart
    LEAVING = "leaving"  # this node leaves the job (drain, signal): not a restart

    @property
    def restart(self) -> bool:
        """Whether the workers stop for a new round (the job goes on with this node)."""
        return self not in (StopCause.JOB_ENDED, StopCause.LEAVING)


@dataclass(frozen=True)
class StopWorkers:
    """Stop this node's workers. ``detect_s``: how long the fault behind a
    restart went undetected here (None: not known on this node)."""

    reason: str
    grace: StopGrace
    cause: StopCause
    detect_s: float | None = None

    @property
    def fast(self) -> bool:
        return self.grace is StopGrace.NONE

    def grace_s(self, stop_grace_s: float, failure_stop_grace_s: float) -> float:
        """Seconds between SIGTERM and SIGKILL, from ``--stop-grace`` and
        ``--failure-stop-grace``: a failure never waits longer than a drain."""
        if self.grace is StopGrace.NONE:
            return 0.0
        if self.grace is StopGrace.FAILURE:
            return min(failure_stop_grace_s, stop_grace_s)
        return stop_grace_s


@dataclass(frozen=True)
class RequestRestart:
    """An intent: retried by the loop until etcd takes it, dropped once stale."""

    round: int
    reason: str
    failure: bool


@dataclass(frozen=True)
class Report:
    """An intent, like RequestRestart: a report to the leader about ``round``
    (``silent_s``: how long ``about`` was silent, for a FROZEN report)."""

    kind: ReportKind
    round: int
    about: str | None = None
    silent_s: float = 0.0


@dataclass(frozen=True)
class WatchPeer:
    """Follow the health of ``node_id``'s agent at ``addr`` (None: watch nobody)."""

    node_id: str | None
    addr: str = ""


@dataclass(frozen=True)
class CheckPeersStore:
    """Ask these agents whether they reach etcd; answered with a LeaseState."""

    addrs: tuple[str, ...]


@dataclass(frozen=True)
class AnnounceDrain:
    """Record this node's drain in etcd before its workers stop: its peers'
    workers then fail on the missing peer, and the leader must count that as
    the drain's doing, not as failures against the restart budget."""

    reason: str


@dataclass(frozen=True)
class Leave:
    """Leave the rendezvous for good (drain): the leader sees this node go."""

    reason: str


@dataclass(frozen=True)
class CheckGpus:
    """Read this node's GPUs before the workers of ``round`` start, and judge
    them as of ``since`` (monotonic: when this node's part of the round
    began, right after the last round's workers were stopped); answered with
    a :class:`GpuChecked`."""

    round: int
    since: float


@dataclass(frozen=True)
class AttributeHang:
    """Before stopping anything, read every member's stacks for ``round`` and
    answer with a :class:`HangAttributed` (:mod:`agent.hang_report`)."""

    round: int
    verdict: str


@dataclass(frozen=True)
class Note:
    """Something the operator should read in the log; changes nothing."""

    message: str


@dataclass(frozen=True)
class Fail:
    """The agent cannot go on: the loop raises ``error``."""

    error: ElasticError


Command = Union[Transition, StartWorkers, StopWorkers, RequestRestart, Report, WatchPeer,
                CheckPeersStore, AnnounceDrain, Leave, CheckGpus, Note, Fail]


# -------------------------------------------------------------------- state

@dataclass(frozen=True)
class Settings:
    node_id: str
    nproc: int
    lease_ttl_s: float
    join_timeout_s: float
    job_id: str = ""
    drain_exit_code: int = 0  # the exit code after a SIGTERM drain
    gpu_check: str = "off"  # --gpu-check: off, warn or enforce (agent.gpu_health)
    freeze_timeout_s: float = 0.0  # --freeze-timeout: 0, the lease alone decides


@dataclass(frozen=True)
class AgentView:
    """What the agent knows; replaced, never mutated. Times are monotonic.

    ``state`` is the agent's state: where each reaction leaves it. STOPPING
    and DRAINING are passed through within one reaction (its Transition
    commands), never left in. An agent starts in INIT (:class:`Joined` moves
    it on); a view built without a state, as the rules' tests build it, has
    joined."""

    state: AgentState = S.JOINING
    round: Round | None = None  # the round this node's workers belong to
    started_at: float = 0.0  # when this node's workers of ``round`` were started
    rounds_started: int = 0
    exited_ok: frozenset[int] = frozenset()  # local ranks of ``round`` that exited 0
    peer_unhealthy: tuple[str, float] | None = None  # (ring peer, NOT_SERVING since)
    suspected: frozenset[str] = frozenset()  # peers reported unreachable in ``round``
    frozen_reported: frozenset[str] = frozenset()  # peers reported frozen in ``round``
    waiting_since: float = 0.0  # when the node began waiting for its first round
    peers_asked_at: float | None = None  # last CheckPeersStore, while unconfirmed
    store_down_noted: bool = False
    # Why the peers' answers say this node is cut off from etcd, while it is
    # too early to stop (see STOP_AT_TTL_FRACTION); "" when they do not.
    cut_off: str = ""
    cut_off_since: float | None = None  # when this node counts as cut off from (monotonic)
    store_doubt_since: float | None = None  # etcd in doubt since (STORE_DOUBT_KEEPALIVES)
    store_doubt_ended_at: float = -math.inf  # when it last ended: hangs count from there
    # A hang verdict waiting for its attribution: (asked at, how long the fault
    # went undetected), None when none waits.
    hang_pending: tuple[float, float | None] | None = None
    last_failure: str = ""
    outcome_reason: str = ""
    exit_code: int | None = None  # set by a signal: the drain's code, or 128 + its number
    gpu_recheck_at: float | None = None  # STARTING: when to read the GPUs again (WAIT)
    gpu_wait_noted: bool = False  # the wait for the GPUs was logged in this round

    @property
    def round_number(self) -> int:
        return self.round.number if self.round else 0

    @property
    def running_round(self) -> int:
        """The round whose workers run here (0: none). Not while STARTING:
        the GPU check comes before the workers."""
        return self.round_number if self.state in (S.RUNNING, S.DONE) else 0


Result = tuple[AgentView, list[Command]]


def ring_peer(r: Round, node_id: str) -> tuple[str, str] | None:
    """The next member after ``node_id`` in ``r`` (its id and agent address):
    each node watches one peer, so health checks cost O(1) per node. None
    when there is none, or it gave no address."""
    placed = r.placement(node_id)
    peer = placed.ring_next if placed else None
    return (peer.node_id, peer.addr) if peer and peer.addr else None


def react(view: AgentView, event: Event, now: float, settings: Settings) -> Result:
    """The agent's reaction to ``event`` at monotonic time ``now``."""
    if view.state.final:
        return view, []
    if isinstance(event, Joined):
        if view.state is not S.INIT:
            return view, []
        return dataclasses.replace(view, state=S.JOINING), [Transition(S.JOINING, event.reason, 0)]
    if isinstance(event, GaveUp):
        return (dataclasses.replace(view, state=S.FAILED, outcome_reason=event.reason),
                [Transition(S.FAILED, event.reason, view.round_number)])
    if isinstance(event, RoundCommitted):
        return _on_round(view, event, now, settings)
    if isinstance(event, WorkerExited):
        return _on_exit(view, event, now, settings)
    if isinstance(event, PeerHealthChanged):
        return _on_peer(view, event, now)
    if isinstance(event, PeerSilent):
        return _on_silent(view, event, settings)
    if isinstance(event, LeaseState):
        return _on_lease(view, event, now, settings)
    if isinstance(event, DrainRequested):
        return _drain(view, event.reason)
    if isinstance(event, Signalled):
        # systemctl stop, a pod's termination, Ctrl-C: leave the job as a drain
        # does (the others re-form without this node), then exit with the
        # drain's code for SIGTERM (a clean stop) and the shell's for others.
        name = signal.Signals(event.signum).name
        code = settings.drain_exit_code if event.signum == signal.SIGTERM else 128 + event.signum
        view, commands = _drain(view, f"received {name}")
        return dataclasses.replace(view, exit_code=code), commands
    if isinstance(event, Tick):
        return _on_tick(view, event, now, settings)
    if isinstance(event, HangAttributed):
        return _on_attributed(view, event)
    if isinstance(event, GpuChecked):
        return _on_gpus(view, event, settings)
    raise TypeError(f"not an agent event: {event!r}")


def _stop(view: AgentView, reason: str, grace: StopGrace, cause: StopCause,
          detect_s: float | None = None) -> Result:
    """Stop this node's workers and wait for the next round. The ring peer
    stays watched until the next round: when the peer's death broke this
    node's workers, its silence is what gets the job going again (see
    _on_silent)."""
    number = view.round_number
    return (dataclasses.replace(view, state=S.JOINING, peer_unhealthy=None),
            [Transition(S.STOPPING, reason, number),
             StopWorkers(reason, grace, cause, detect_s),
             Transition(S.JOINING, "workers stopped", number)])


def _replacement_cause(old: Round, new: Round) -> StopCause:
    """Why ``new`` replaces the round ``old`` this node's workers run in, from
    its members and failures (never its reason's text): someone left, else a
    failure counted elsewhere, else someone joined, else it was requested.
    A change of members this node cannot tell (a large job's, see
    Round.membership_change) counts as someone leaving: the failure's grace,
    as survivors may be stuck in a collective."""
    left, joined = new.membership_change(old) or (True, False)
    if left:
        return StopCause.NODE_LEFT
    if set(new.failures) - set(old.failures):
        return StopCause.PEER_FAILURE
    if joined:
        return StopCause.NODE_JOINED
    return StopCause.REQUESTED


def _replacement_grace(cause: StopCause) -> StopGrace:
    """The drain's grace only for a planned scale-up (every member kept, some
    added, no new failure): a script that saves a checkpoint on SIGTERM gets
    its time. Anything else (a member lost, drained, restarted or left out; a
    restart after a failure or asked by an operator) may leave survivors stuck
    in a collective: the failure's grace."""
    return StopGrace.DRAIN if cause is StopCause.NODE_JOINED else StopGrace.FAILURE


def _on_round(view: AgentView, event: RoundCommitted, now: float, settings: Settings) -> Result:
    r = event.round
    if r.outcome:
        commands: list[Command] = []
        if view.state in (S.RUNNING, S.STARTING, S.DONE):
            grace = StopGrace.DRAIN if r.outcome is Outcome.SUCCEEDED else StopGrace.FAILURE
            commands += [Transition(S.STOPPING, f"job {r.outcome}", r.number), WatchPeer(None),
                         StopWorkers(f"job {r.outcome}", grace, StopCause.JOB_ENDED)]
        final = S.SUCCEEDED if r.outcome is Outcome.SUCCEEDED else S.FAILED
        commands.append(Transition(final, f"job {r.outcome}: {r.reason}", r.number))
        return dataclasses.replace(view, state=final, outcome_reason=r.reason), commands
    if view.round is not None and r.number <= view.round.number:
        return view, []
    if r.continues:
        return _on_continuing_round(view, r, settings)
    commands: list[Command] = []
    me = r.member(settings.node_id)
    if me is not None and view.state not in (S.RUNNING, S.STARTING, S.DONE) and (
            event.registered_after is None or r.number <= event.registered_after):
        # A round not formed for this agent's registration (none yet, or it came
        # later): it was formed for an earlier registration of this id (an agent
        # that died, or this one before it lost its lease), whose workers are gone.
        # Starting them again would join a group formed without this agent; the
        # leader forms a new round once it registers.
        return view, []
    if view.state in (S.RUNNING, S.STARTING, S.DONE):
        cause = _replacement_cause(view.round, r)
        view, commands = _stop(view, f"round {r.number} replaces round {view.round_number}: "
                                     f"{r.reason}", _replacement_grace(cause),
                               StopCause.LEAVING if me is None and event.drain_requested
                               else cause)
    if view.round is not None:
        commands.append(WatchPeer(None))  # the old round's peer; a new one once workers start
    if me is None:
        if event.drain_requested:
            view, more = _drain(view, "drain requested")
            return view, commands + more
        if view.state is not S.STANDBY:
            commands.append(Transition(S.STANDBY, f"round {r.number} is full without this node",
                                       r.number))
            view = dataclasses.replace(view, state=S.STANDBY)
        return view, commands
    view = dataclasses.replace(view, state=S.STARTING, round=r, started_at=now,
                               rounds_started=view.rounds_started + 1, exited_ok=frozenset(),
                               peer_unhealthy=None, suspected=frozenset(),
                               frozen_reported=frozenset(),
                               peers_asked_at=None, store_down_noted=False,
                               gpu_recheck_at=None, gpu_wait_noted=False, hang_pending=None)
    starting = f"node rank {me.node_rank} of {len(r.members)}, world size {r.world_size}"
    if settings.gpu_check != "off":
        return view, commands + [Transition(S.STARTING, f"{starting}; checking the GPUs first",
                                            r.number), CheckGpus(r.number, now)]
    view, start = _start_workers(view, settings)
    return view, commands + [Transition(S.STARTING, starting, r.number)] + start


def _on_continuing_round(view: AgentView, r: Round, settings: Settings) -> Result:
    """Round ``r`` is round ``r.continues`` written again (a malformed record
    replaced): the workers of that round run on in it."""
    if view.state in (S.RUNNING, S.DONE) and view.round.continued_by(r):
        return dataclasses.replace(view, round=r), [Note(
            f"round {r.number} continues round {view.round.workers_round} ({r.reason}); "
            "its workers run on")]
    # Its workers are the ones of round r.continues, which this node does
    # not run (any more): never start workers that no group waits for.
    # The leader forms a new round for what this node requested or reported;
    # a member that never saw that round has neither, and its group waits
    # for workers that will not come: it asks for the round.
    ran = view.round.workers_round if view.round else 0
    if view.state is S.JOINING and ran < r.continues and r.member(settings.node_id):
        return view, [RequestRestart(r.number, f"round {r.number} continues round "
                                     f"{r.continues}, whose workers this node never "
                                     "started", failure=False)]
    return view, []


def _start_workers(view: AgentView, settings: Settings) -> Result:
    """Start the workers of ``view.round`` (this node is a member) and run."""
    r = view.round
    me = r.member(settings.node_id)
    peer = ring_peer(r, settings.node_id)
    return dataclasses.replace(view, state=S.RUNNING, gpu_recheck_at=None), [
        StartWorkers(r, view.rounds_started - 1),
        Report(ReportKind.STARTED, r.number),
        WatchPeer(*peer) if peer else WatchPeer(None),
        Transition(S.RUNNING, f"{me.nproc} workers started", r.number),
    ]


def _on_gpus(view: AgentView, event: GpuChecked, settings: Settings) -> Result:
    if view.state is not S.STARTING or event.round != view.round_number:
        return view, []  # the answer for a round this node no longer starts
    d = event.decision
    if d.action is GpuAction.WAIT:
        note = [] if view.gpu_wait_noted else [Note(f"GPU check: {d.reason}")]
        recheck_at = d.wake_at if d.wake_at is not None else view.started_at
        return dataclasses.replace(view, gpu_recheck_at=recheck_at, gpu_wait_noted=True), note
    if d.action is GpuAction.LEAVE:
        return _leave_unfit(view, d.reason, settings)
    view, commands = _start_workers(view, settings)
    if d.action is GpuAction.WARN:
        commands.insert(0, Note(f"GPU check failed (--gpu-check warn, starting the workers "
                                f"anyway): {d.reason}"))
    return view, commands


def _leave_unfit(view: AgentView, reason: str, settings: Settings) -> Result:
    """This node's GPUs are not fit for the round: leave the job, as a drain
    does (so the others re-form at once and count no failure), and end
    FAILED with EXIT_NODE_UNFIT."""
    number = view.round_number
    why = f"GPU check failed: {reason}"
    view = dataclasses.replace(view, state=S.FAILED, last_failure=why, gpu_recheck_at=None,
                               outcome_reason=f"node {settings.node_id} left the job: {why}",
                               exit_code=EXIT_NODE_UNFIT)
    return view, [Transition(S.DRAINING, why, number), AnnounceDrain(why), WatchPeer(None),
                  Leave(why), Transition(S.FAILED, "left the job: this node is not fit for "
                                                   f"round {number}", number)]


def _fail_round(view: AgentView, reason: str, cause: StopCause,
                detect_s: float | None) -> Result:
    """A local failure: ask for a new round (counted against the budget), then
    stop this node's workers at once. The request comes first so that the
    leader forms the round, and the other members stop their workers, while
    this node stops its own (the loop sends it at once, briefly: it never holds
    the stop up for long); it is retried until it lands."""
    number = view.round_number
    view, commands = _stop(dataclasses.replace(view, last_failure=reason), reason,
                           StopGrace.FAILURE, cause, detect_s)
    return view, [Note(f"{reason}; requesting a restart"),
                  RequestRestart(number, reason, failure=True)] + commands


def _on_exit(view: AgentView, e: WorkerExited, now: float, settings: Settings) -> Result:
    if view.round is None or e.round != view.round.workers_round or e.stopped \
            or view.state is not S.RUNNING:
        # A worker of a round given up, one we stopped, or one that died on
        # its own while this round was being stopped anyway.
        return view, []
    if e.exit_code != 0:
        how = f"was killed by signal {e.signal}" if e.signal else f"exited with {e.exit_code}"
        cause = f": {e.cause}" if e.cause else ""
        log = f" (log: {e.log_path})" if e.log_path else ""
        # The supervisor reaps a worker as it exits: detected at once.
        return _fail_round(view, f"worker rank {e.rank} (pid {e.pid}) {how}{cause}{log}",
                           StopCause.WORKER_EXIT, 0.0)
    exited = view.exited_ok | {e.local_rank}
    view = dataclasses.replace(view, exited_ok=exited)
    if len(exited) < settings.nproc:
        return view, []
    view = dataclasses.replace(view, state=S.DONE, peer_unhealthy=None)
    return view, [
        Transition(S.DONE, f"all {settings.nproc} workers exited 0; waiting for the other "
                           "members (exit barrier)", view.round_number),
        WatchPeer(None),
        Report(ReportKind.DONE, view.round_number),
    ]


def _on_peer(view: AgentView, event: PeerHealthChanged, now: float) -> Result:
    if view.state is not S.RUNNING or view.round is None:
        return view, []
    if event.health is PeerHealth.NOT_SERVING:
        # Agents are briefly NOT_SERVING at every round change while their
        # workers restart: only a peer that stays so for a lease TTL is unhealthy.
        return dataclasses.replace(view, peer_unhealthy=view.peer_unhealthy
                                   or (event.node_id, now)), []
    view = dataclasses.replace(view, peer_unhealthy=None)
    if event.health is PeerHealth.UNREACHABLE and event.node_id not in view.suspected:
        view = dataclasses.replace(view, suspected=view.suspected | {event.node_id})
        return view, [Note(f"the agent of peer {event.node_id} does not answer; reporting it "
                           "to the leader (its lease still decides)"),
                      Report(ReportKind.SUSPECT, view.round_number, about=event.node_id)]
    return view, []


def _on_silent(view: AgentView, event: PeerSilent, settings: Settings) -> Result:
    """Report the ring peer of the round this node runs, or ran until its
    workers stopped and no round followed yet (JOINING), once it was silent
    for the freeze timeout. The stopped case matters as much as the running
    one: a dead peer breaks this node's collectives at once, and when that
    peer led the job, nobody else would form the next round before its lease
    expired."""
    timeout = settings.freeze_timeout_s
    if view.state not in (S.RUNNING, S.JOINING) or view.round is None or timeout <= 0 \
            or event.silent_s < timeout or event.node_id in view.frozen_reported:
        return view, []
    peer = ring_peer(view.round, settings.node_id)
    if peer is None or peer[0] != event.node_id:
        return view, []  # a probe of the peer of a round this node no longer runs
    view = dataclasses.replace(view, frozen_reported=view.frozen_reported | {event.node_id})
    return view, [Note(f"the agent of peer {event.node_id} answered no probe for "
                       f"{event.silent_s:.1f} s (freeze timeout {timeout:g} s); reporting it "
                       "to the leader as frozen"),
                  Report(ReportKind.FROZEN, view.round_number, about=event.node_id,
                         silent_s=event.silent_s)]


def _peers_to_ask(r: Round, node_id: str, standby_addrs: tuple[str, ...]) -> tuple[str, ...]:
    """The members this node holds (all of a small job's; its bucket's, a
    sample, of a large one's), then the standbys."""
    return tuple(m.addr for m in r.held_members() if m.node_id != node_id and m.addr) \
        + standby_addrs


def store_in_doubt(view: AgentView, lease_unconfirmed_s: float, settings: Settings) -> bool:
    """Whether etcd is in doubt here: noted down for everyone, or this node's
    lease a keep-alive late (:data:`STORE_DOUBT_KEEPALIVES`)."""
    late_s = STORE_DOUBT_KEEPALIVES * KEEPALIVE_TTL_FRACTION * settings.lease_ttl_s
    return view.store_down_noted or lease_unconfirmed_s > late_s


def hangs_count_from(view: AgentView, now: float) -> float:
    """The time (monotonic) before which nothing counts toward a hang verdict
    (:func:`agent.health.hung_workers`' ``not_before``): ``now`` while etcd is in
    doubt, else the end of the last doubt."""
    return now if view.store_doubt_since is not None else view.store_doubt_ended_at


def _track_store_doubt(view: AgentView, doubt: bool, now: float) -> AgentView:
    if doubt and view.store_doubt_since is None:
        return dataclasses.replace(view, store_doubt_since=now)
    if not doubt and view.store_doubt_since is not None:
        return dataclasses.replace(view, store_doubt_since=None, store_doubt_ended_at=now)
    return view


def _on_tick(view: AgentView, tick: Tick, now: float, settings: Settings) -> Result:
    doubt = store_in_doubt(view, tick.lease_unconfirmed_s, settings)
    view = _track_store_doubt(view, doubt, now)
    if view.state is S.RUNNING:
        if view.hang_pending is not None:
            asked_at, detect_s = view.hang_pending
            if now - asked_at > ATTRIBUTION_WAIT_S:  # the answer is lost: fail without it
                return _fail_hung(view, "; ".join(tick.hung) or "a worker hung", detect_s)
        elif tick.hung and not doubt:
            detect_s = None if tick.hung_since is None else now - tick.hung_since
            return (dataclasses.replace(view, hang_pending=(now, detect_s)),
                    [AttributeHang(view.round_number, "; ".join(tick.hung))])
        if view.peer_unhealthy is not None:
            peer, since = view.peer_unhealthy
            if now - since > settings.lease_ttl_s:
                return _fail_round(view, f"peer {peer} has reported its workers unhealthy "
                                         f"(NOT_SERVING) for over {settings.lease_ttl_s:g} s",
                                   StopCause.PEER_UNHEALTHY, now - since)
    if view.state is S.RUNNING and view.cut_off_since is not None:
        # Not since the lease was last confirmed, if that is later (it came back).
        cut_off_s = min(now - view.cut_off_since, tick.lease_unconfirmed_s)
        if cut_off_s >= STOP_AT_TTL_FRACTION * settings.lease_ttl_s:
            return _stop_cut_off(view, cut_off_s, tick.lease_unconfirmed_s)
    commands: list[Command] = []
    if view.state is S.RUNNING and tick.lease_unconfirmed_s > settings.lease_ttl_s / 2:
        # Ask again every quarter TTL while the lease stays unconfirmed.
        if view.peers_asked_at is None or now - view.peers_asked_at >= settings.lease_ttl_s / 4:
            view = dataclasses.replace(view, peers_asked_at=now)
            commands.append(CheckPeersStore(_peers_to_ask(view.round, settings.node_id,
                                                          tick.standby_addrs)))
    elif tick.lease_unconfirmed_s <= settings.lease_ttl_s / 2 and (
            view.peers_asked_at is not None or view.store_down_noted or view.cut_off):
        view = dataclasses.replace(view, peers_asked_at=None, store_down_noted=False,
                                   cut_off="", cut_off_since=None)
    if view.state is S.STARTING and view.gpu_recheck_at is not None \
            and now >= view.gpu_recheck_at:
        view = dataclasses.replace(view, gpu_recheck_at=None)
        commands.append(CheckGpus(view.round_number, view.started_at))
    if view.state is S.JOINING and view.rounds_started == 0 \
            and now - view.waiting_since > settings.join_timeout_s:
        why = f" ({tick.registration_problem})" if tick.registration_problem else ""
        commands.append(Fail(RendezvousTimeoutError(
            f"job {settings.job_id}: node {settings.node_id} was not included in a round "
            f"within {settings.join_timeout_s:.0f} s{why}")))
    return view, commands


def _on_attributed(view: AgentView, event: HangAttributed) -> Result:
    if view.state is not S.RUNNING or view.hang_pending is None \
            or event.round != view.round_number:
        return view, []  # stopped meanwhile, for another reason
    return _fail_hung(view, event.reason, view.hang_pending[1])


def _fail_hung(view: AgentView, reason: str, detect_s: float | None) -> Result:
    return _fail_round(dataclasses.replace(view, hang_pending=None), reason,
                       StopCause.WORKER_HANG, detect_s)


def next_tick_at(view: AgentView, tick: Tick, now: float, settings: Settings) -> float:
    """When the passing of time alone may next change what a :class:`Tick`
    decides, given what ``tick`` measured at ``now`` (monotonic). ``now``
    itself: keep looking at every pass (a round starting, the lease in doubt,
    a cut-off in progress). Every deadline is the earliest one: what arrives
    meanwhile (a keep-alive answer, a heartbeat, a step) only moves it later,
    and anything else that matters arrives as an event and wakes the loop."""
    if view.state is not S.RUNNING or view.cut_off_since is not None \
            or view.peers_asked_at is not None or view.store_down_noted or view.cut_off:
        return now
    half_ttl = settings.lease_ttl_s / 2
    if tick.lease_unconfirmed_s > half_ttl:
        return now
    deadline = now + half_ttl - tick.lease_unconfirmed_s  # then _on_tick asks the peers
    if view.peer_unhealthy is not None:
        deadline = min(deadline, view.peer_unhealthy[1] + settings.lease_ttl_s)
    if tick.next_hang_at is not None:
        deadline = min(deadline, tick.next_hang_at)
    if view.hang_pending is not None:
        deadline = min(deadline, view.hang_pending[0] + ATTRIBUTION_WAIT_S)
    return deadline


def _on_lease(view: AgentView, event: LeaseState, now: float, settings: Settings) -> Result:
    if view.state is not S.RUNNING or event.unconfirmed_s <= settings.lease_ttl_s / 2:
        return view, []
    asked = event.peers_asked
    answered = asked if event.peers_answered < 0 else event.peers_answered
    with_store = peers_with_store(event, settings.lease_ttl_s)
    # etcd is down for everyone only if every peer asked answered without it;
    # a peer that cannot be asked might have etcd and form a round.
    if with_store or answered < asked or asked == 0:
        why = (f"{len(with_store)} of {asked} peers still reach it"
               if with_store else
               "there is no peer to ask" if asked == 0 else
               f"only {answered} of {asked} peers answered, so an outage of etcd cannot be "
               "told from this node being cut off")
        since = view.cut_off_since
        if since is None:
            since = now - event.unconfirmed_s
            if view.store_down_noted and with_store:
                # etcd was down for everyone and a peer is back first: that proves
                # etcd is back, not that this node is cut off. A new etcd leader
                # renews every lease for a TTL, so count from the peer's return.
                since = now - min(age for addr, age in event.peer_ages if addr in with_store)
        view = dataclasses.replace(view, cut_off=why, cut_off_since=since)
        if now - since < STOP_AT_TTL_FRACTION * settings.lease_ttl_s:
            return view, []  # maybe a reconnect to another member: the tick decides
        return _stop_cut_off(view, now - since, event.unconfirmed_s)
    if view.store_down_noted:
        return view, []
    keepalive_s = KEEPALIVE_TTL_FRACTION * settings.lease_ttl_s
    if any(0 <= age < keepalive_s for _, age in event.peer_ages):
        # Confirmed within one keep-alive interval: that peer may reach etcd
        # (its next keep-alive will tell) or have landed its last one just
        # before an outage. Calling etcd down now would later count a peer
        # that never lost etcd as etcd's return, and stop the workers late.
        # Ask again (each quarter TTL) until it has missed one or proves fresh.
        return view, []
    return dataclasses.replace(view, store_down_noted=True), [Note(
        f"etcd unconfirmed for {event.unconfirmed_s:.1f} s and all {asked} peers asked answered "
        "without it: etcd itself is down, no round can form; training goes on")]


def peers_with_store(event: LeaseState, lease_ttl_s: float) -> tuple[str, ...]:
    """The peers whose lease etcd confirmed after this node's stopped being
    confirmed: they reach etcd while this node does not.

    "Confirmed recently" is not enough: when etcd goes down for everyone, a
    peer whose keep-alive happened to land just before the outage looks fresh
    while this node, whose last one landed up to a keep-alive interval
    earlier, already counts as cut off. Only a confirmation less than
    ``unconfirmed_s`` minus one keep-alive interval ago must have come after
    etcd stopped answering this node."""
    newer_than = event.unconfirmed_s - KEEPALIVE_TTL_FRACTION * lease_ttl_s
    return tuple(addr for addr, age in event.peer_ages if 0 <= age < newer_than)


def _stop_cut_off(view: AgentView, cut_off_s: float, unconfirmed_s: float) -> Result:
    """Stop the workers of a node cut off from etcd for ``cut_off_s`` (its
    lease unconfirmed for ``unconfirmed_s``: how long the fault went undetected)."""
    number = view.round_number
    reason = (f"cut off from etcd for {cut_off_s:.1f} s while {view.cut_off}: stopping "
              "the workers before this node's lease can expire")
    view, commands = _stop(dataclasses.replace(view, cut_off="", cut_off_since=None), reason,
                           StopGrace.NONE, StopCause.STORE_CUT_OFF, unconfirmed_s)
    # Not a failure of the job: when this node is back, its peers and it need
    # a new round (unless its lease expired, which makes one anyway).
    return view, commands + [RequestRestart(number, reason, failure=False)]


def _drain(view: AgentView, reason: str) -> Result:
    number = view.round_number
    view = dataclasses.replace(view, state=S.SUCCEEDED, outcome_reason=f"drained: {reason}")
    return view, [Transition(S.DRAINING, reason, number), AnnounceDrain(reason), WatchPeer(None),
                  StopWorkers(reason, StopGrace.DRAIN, StopCause.LEAVING), Leave(reason),
                  Transition(S.SUCCEEDED, "left the job after draining", number)]


# ------------------------------------------ answers to the agent's other threads

def lease_unconfirmed_s(confirmed_at: float | None, now: float) -> float:
    """How long this node's lease has gone unconfirmed at ``now`` (0: never
    confirmed yet, or confirmed since)."""
    return 0.0 if confirmed_at is None else max(0.0, now - confirmed_at)


@dataclass(frozen=True)
class HeartbeatReply:
    """The answer to a worker's heartbeat. ``current``: the worker belongs to
    the round whose workers run here (its heartbeat counts); ``stop``: it
    should stop; ``hold``: it should not start another step yet."""

    current: bool
    stop: bool
    hold: bool


def heartbeat_reply(view: AgentView, worker_round: int, lease_confirmed_at: float | None,
                    now: float, settings: Settings) -> HeartbeatReply:
    """A worker of ``worker_round`` sent a heartbeat at ``now``. A worker of
    another round, or one heard while nothing runs here, is told to stop.
    Workers hold while this node's lease has gone unconfirmed for half a TTL
    and no etcd outage is proven: a node resumed after a freeze longer than
    its lease must not let its workers step before it learns whether a newer
    round has formed meanwhile."""
    current = view.round is not None and worker_round == view.round.workers_round
    hold = (view.state is S.RUNNING and not view.store_down_noted
            and lease_unconfirmed_s(lease_confirmed_at, now) > settings.lease_ttl_s / 2)
    return HeartbeatReply(current, not current or view.state not in (S.RUNNING, S.DONE), hold)


@dataclass(frozen=True)
class StoreHealthReply:
    """The answer to a peer's StoreHealth: whether etcd confirmed this node's
    lease within half a TTL, how long ago (-1: never), whether its workers
    run (or are about to). ``cut_off``: the event to post to the loop when
    the asker proves this node cut off (None: it does not)."""

    reachable: bool
    lease_age_s: float
    running: bool
    cut_off: LeaseState | None = None


def store_health(view: AgentView, registered: bool, lease_confirmed_at: float | None,
                 asker_has_store: bool, asker: str, now: float,
                 settings: Settings) -> StoreHealthReply:
    """The fencing signal: a peer that says it reaches etcd (it confirmed its
    lease just now: it forms rounds) while this node's lease goes unconfirmed
    proves this node the one cut off, and the loop stops the workers."""
    age = -1.0 if lease_confirmed_at is None else max(0.0, now - lease_confirmed_at)
    reachable = registered and 0 <= age <= settings.lease_ttl_s / 2
    running = view.state in (S.STARTING, S.RUNNING)
    cut_off = None
    if asker_has_store and not reachable and running:
        cut_off = LeaseState(age, ((asker or "a peer", 0.0),), 1)
    return StoreHealthReply(reachable, age, running, cut_off)


def reports_for_new_lease(view: AgentView) -> list[Report]:
    """Reports live under this node's lease: when it has a new one (the old
    ran out), the report the leader still waits for is made again: this
    node's DONE, or the leader would wait for it at the exit barrier."""
    return [Report(ReportKind.DONE, view.round_number)] if view.state is S.DONE else []
