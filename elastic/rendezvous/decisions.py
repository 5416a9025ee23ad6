"""Pure decisions of the rendezvous leader: (observed state, now, config) -> Decision.

No I/O and no clock reads here: the leader's loop observes etcd, passes its
wall-clock ``now``, and applies the result. Tests move time by passing another
``now``. (Wall time, not monotonic, because failure times in the round record
are compared across leaders; a clock step can only stretch or shorten one
settle window.)

The rules, in order:

* Nodes being drained are never candidates.
* Before the first round: close when ``max`` nodes are present; or when at
  least ``min`` are and no node has arrived for ``settle_s``. Otherwise wait.
* With a round in place, a new round is needed when a member is gone (lease
  expired), a member is drained, a restart was requested for the current round,
  or nodes are waiting while the round has fewer than ``max`` members
  (scale-up). Otherwise the round stands and extra nodes wait as standbys.
  With ``scale_up_wait_s`` above 0, a joiner starts a scale-up only once a
  checkpoint was committed after it registered, or that long after it was
  first seen (a round formed for another reason takes it at once).
* A new round keeps the survivors in their old order, then adds waiting nodes
  in join order, up to ``max``. If it would include nodes that arrived less
  than ``settle_s`` ago and is not full, it waits for them to settle, so a
  burst of joins becomes one round. Losing a member needs no settling: the
  survivors are known, and waiting would only delay recovery.
* Fewer than ``min`` candidates: wait (the reason says how many are missing).
* A round that answers failures (restart requests marked as failures) counts
  one failure against the budget; when the failures within the window exceed
  ``max_restarts``, the job fails instead. Lost or joining nodes are
  membership changes and never count; nor do failures reported in a round
  that a member drains from (its leaving breaks its peers' collectives).
* A round with an outcome is final: nothing more is decided.
* A round that continues another (``Round.continues``: written again after a
  malformed record replaced it) is that round: reports and restart requests
  about the round it continues count for it.
* A member whose registration is newer than the round (its agent was
  restarted, or lost its lease and came back) needs a new round: its workers
  of the current one are gone.
* Exit barrier: the job succeeds when every member of the current round
  reported that its workers all exited 0. Once one has, joiners no longer
  start a round (failures and losses still do); when the others have not
  finished ``exit_barrier_timeout_s`` after the first, the job fails naming
  the stragglers.
* A node a peer reported unreachable (its agent does not answer although its
  lease lives: the agent died and the lease has not run out yet) is left out
  of any round formed within ``suspect_s`` of the report. The suspicion alone
  never starts a round: the lease stays the authority on who is gone.
* A member that has not reported starting its workers ``start_timeout_s``
  after its round was committed is left out: the round is formed again
  without it (and it stays out for ``suspect_s``, see ``Decision.suspects``).

Rules of the leader's own waits and acts, on its monotonic ``now`` (they
time nothing another machine compares):

* Fence (:func:`fence_lost_members`): before a round leaves out members whose
  lease expired, the leader waits until their agents say their workers
  stopped (an agent that does not answer counts as stopped); after
  ``FENCE_PATIENCE_TTLS`` lease TTLs of asking it forms the round anyway, so
  a member that never stops cannot stall the job. A member whose lease was
  revoked as frozen (below) was proven unanswering: the fence skips it.
* Freeze (:func:`revoke_frozen`): with ``freeze_timeout_s`` above 0, a
  member of the running round whose ring peer reports that its agent answered
  none of its probes for the freeze timeout is frozen (SIGSTOP, a paused VM, a
  dead agent): its lease is revoked, which deletes its registration, so the
  round re-forms now instead of a lease TTL later. Corroborated twice: the
  reporter's window (every probe failed, none of them ever answered late)
  and the decider's own failed check (its probes, when it is the reporter).
  The decider is the leader, or, when the frozen member leads, the reporter;
  never the reported node itself, only while its own lease is confirmed
  (a decider cut off from etcd may be the one that moved), and only when at
  least ``min_nodes`` other nodes could form a round without it (else its
  revocation gains nothing: the others would wait for it anyway, and a node
  that thaws within its lease goes on without a restart). A slow node
  answers some probe within the timeout and keeps its lease; when it thaws
  after a revocation, it finds its lease gone and fail-stops. It then stays
  out of new rounds for ``suspect_s`` as a suspect does (the view counts the
  revocation as a suspicion whatever the registration): a node cut off from
  its peers only would otherwise rejoin and be revoked again at every round.
* Takeover (:func:`takeover_failed`): a leader that cannot load its view keeps
  trying; after a lease TTL of failures it resigns and campaigns again only a
  TTL later, so that a node that can lead wins first.
"""

from __future__ import annotations

import dataclasses
import enum

from elastic.rendezvous.api import FrozenReport, NodeInfo, RestartRequest, Round
from elastic.rendezvous.config import RendezvousConfig


class Action(enum.Enum):
    """What the leader does next."""

    WAIT = "wait"  # nothing to commit now; look again at ``wake_at`` or on the next change
    CLOSE_ROUND = "close_round"  # commit a new round with ``members``
    FAIL_JOB = "fail_job"  # the restart budget is spent, or the exit barrier timed out
    SUCCEED_JOB = "succeed_job"  # every member's workers exited 0: commit the job's success


@dataclasses.dataclass(frozen=True)
class Decision:
    """The result of a pure decision: an action, its reason for the log, and when
    to look again even if nothing changes (None: only on the next change)."""

    action: Action
    reason: str
    members: tuple[str, ...] = ()
    wake_at: float | None = None
    failures: tuple[float, ...] = ()  # the budget history the new round carries
    # Members that did not start in time: the leader keeps them out for suspect_s.
    suspects: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the leader knows when it decides.

    ``alive`` lists registered nodes in join order (etcd create revision).
    ``first_seen`` maps node ids to the leader's clock reading when it first
    saw them (nodes in the current round need no entry). ``current`` is None
    before the first round, or when the round key holds garbage.
    ``started`` maps node ids to the last round they reported starting
    workers for; ``done`` maps node ids whose workers all exited 0 to (round,
    the leader's clock when it learnt it); ``suspects`` maps node ids whose
    agent a peer found unreachable (this registration of it) to the leader's
    clock when it learnt it. ``registered_since_round`` names the nodes whose
    registration is newer than ``current`` (an agent that lost its lease, or
    was restarted, and came back): they are newcomers to that round.
    ``checkpointed_since`` names the nodes registered before the latest
    checkpoint commit: a checkpoint was committed since they joined.
    """

    current: Round | None
    alive: tuple[NodeInfo, ...]
    first_seen: dict[str, float] = dataclasses.field(default_factory=dict)
    restart_requests: tuple[RestartRequest, ...] = ()
    draining: frozenset[str] = frozenset()
    started: dict[str, int] = dataclasses.field(default_factory=dict)
    done: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    suspects: dict[str, float] = dataclasses.field(default_factory=dict)
    registered_since_round: frozenset[str] = frozenset()
    checkpointed_since: frozenset[str] = frozenset()


# How many lease TTLs a leader waits for the workers of lost members to stop.
FENCE_PATIENCE_TTLS = 3


@dataclasses.dataclass(frozen=True)
class FenceVerdict:
    """Whether the leader may form a round that leaves lost members out.

    ``since``: when the leader began waiting for their workers, to pass back
    on its next try (None: no wait open). ``overdue``: it stopped waiting
    because the wait ran out, not because the workers stopped.
    """

    proceed: bool
    since: float | None
    reason: str
    overdue: bool = False


@dataclasses.dataclass(frozen=True)
class TakeoverVerdict:
    """Whether a leader that failed to load its view resigns now.

    ``failing_since``: when its failures began, to pass back on the next
    failure (None after it resigns). ``campaign_after``: when it may
    campaign again once it resigned (None: it did not resign).
    """

    resign: bool
    failing_since: float | None
    reason: str
    campaign_after: float | None = None


def fence_lost_members(lost_addrs: tuple[str, ...], stopped: bool, since: float | None,
                       now: float, lease_ttl_s: float) -> FenceVerdict:
    """The fence rule (module docstring): ``stopped`` is what the agents at
    ``lost_addrs`` answered at ``now``; ``since`` the last verdict's."""
    addrs = ", ".join(lost_addrs)
    if stopped:
        return FenceVerdict(True, None, f"the workers of lost members at {addrs} stopped")
    since = now if since is None else since
    if now - since > FENCE_PATIENCE_TTLS * lease_ttl_s:
        return FenceVerdict(True, None, f"lost members at {addrs} still report running workers "
                                        f"after {now - since:.0f} s; forming the round anyway",
                            overdue=True)
    return FenceVerdict(False, since, f"waiting for the workers of lost members at {addrs} "
                                      "to stop")


def takeover_failed(since: float | None, now: float, lease_ttl_s: float) -> TakeoverVerdict:
    """The takeover rule (module docstring), applied after a failure at
    ``now``; ``since`` the last verdict's."""
    since = now if since is None else since
    if now - since > lease_ttl_s:
        return TakeoverVerdict(True, None, f"could not take over as leader for "
                                           f"{now - since:.0f} s; stepping down",
                               campaign_after=now + lease_ttl_s)
    return TakeoverVerdict(False, since, f"could not take over as leader for "
                                         f"{now - since:.0f} s; retrying")


@dataclasses.dataclass(frozen=True)
class RevokeVerdict:
    """Whether the decider revokes the lease of a member reported frozen.

    ``check``: not yet; the decider probes the member itself first and asks
    again with the answer (``decider_answered``).
    """

    revoke: bool
    reason: str
    check: bool = False


def revoke_frozen(about: str, report: FrozenReport, current: Round | None, *, decider: str,
                  decider_answered: bool | None, lease_unconfirmed_s: float, others: int,
                  config: RendezvousConfig) -> RevokeVerdict:
    """The freeze rule (module docstring): may ``decider`` revoke the lease of
    ``about``, reported frozen by ``report``? ``decider_answered``: whether
    ``about`` answered the decider's own check (None: not checked yet);
    ``lease_unconfirmed_s``: how long the decider's own lease has gone
    unconfirmed; ``others``: the registered nodes besides ``about`` that
    could form a round."""
    def no(why: str) -> RevokeVerdict:
        return RevokeVerdict(False, f"not revoking the lease of {about}: {why}")

    timeout = config.freeze_timeout_s
    if timeout <= 0:
        return no("the freeze timeout is 0 (the lease alone decides)")
    if report.confirmed_by:
        return no(f"{report.confirmed_by} revoked it already")
    if current is None or current.outcome or report.round not in (current.number,
                                                                  current.workers_round):
        return no(f"the report is about round {report.round}, not the running one")
    if current.member(about) is None or current.member(report.by) is None:
        return no(f"{about} and its reporter {report.by} are not both members of round "
                  f"{current.number}")
    if about == decider:
        return no("a node never revokes its own lease")
    if others < config.min_nodes:
        return no(f"the others cannot go on without it ({others} of at least "
                  f"{config.min_nodes} nodes); its lease still decides")
    if report.silent_s < timeout:
        return no(f"its agent was silent for {report.silent_s:.1f} s, under the freeze "
                  f"timeout ({timeout:g} s)")
    if lease_unconfirmed_s > config.lease_ttl_s / 2:
        return no(f"etcd has not confirmed the lease of {decider} for "
                  f"{lease_unconfirmed_s:.1f} s: {decider} may be the one cut off")
    if report.by == decider:
        confirmed = f"reported and confirmed by {decider}"
    elif decider_answered is None:
        return RevokeVerdict(False, f"{about} reported frozen by {report.by}: checking it",
                             check=True)
    elif decider_answered:
        return no(f"its agent answered {decider}, so it is alive (slow, or cut off from "
                  f"{report.by} only); its lease still decides")
    else:
        confirmed = f"reported by {report.by}, confirmed by {decider}"
    return RevokeVerdict(True, f"revoking the lease of {about}: its agent answered no probe "
                               f"for {report.silent_s:.1f} s ({confirmed})")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _settle(
    members: list[str], observed: Observed, now: float, config: RendezvousConfig
) -> float | None:
    """When the newest not-yet-member among ``members`` will have settled, or
    None if the round may close now."""
    if len(members) >= config.max_nodes:
        return None
    current = set(observed.current.node_ids) if observed.current else set()
    arrivals = [observed.first_seen.get(n, now) for n in members if n not in current]
    if not arrivals:
        return None
    settled_at = max(arrivals) + config.settle_s
    return settled_at if now < settled_at else None


def _close_or_settle(
    members: list[str], why: str, observed: Observed, now: float, config: RendezvousConfig
) -> Decision:
    if len(members) < config.min_nodes:
        missing = config.min_nodes - len(members)
        return Decision(
            Action.WAIT,
            f"{why}, but only {_plural(len(members), 'node')} available: waiting for "
            f"{missing} more (min {config.min_nodes})",
        )
    settled_at = _settle(members, observed, now, config)
    if settled_at is not None:
        return Decision(
            Action.WAIT,
            f"{why}; {_plural(len(members), 'node')} ready (min {config.min_nodes}, "
            f"max {config.max_nodes}), letting new arrivals settle for "
            f"{settled_at - now:.2f} s",
            wake_at=settled_at,
        )
    full = " (max reached)" if len(members) >= config.max_nodes else ""
    return Decision(
        Action.CLOSE_ROUND,
        f"{why}; closing with {_plural(len(members), 'node')}{full}",
        members=tuple(members),
    )


def _scale_up_ready(joiners: list[str], observed: Observed, now: float,
                    config: RendezvousConfig) -> tuple[list[str], float | None]:
    """The joiners that may grow the round now, and when the next of the others
    may anyway (None: none waits). See ``RendezvousConfig.scale_up_wait_s``."""
    if config.scale_up_wait_s <= 0:
        return joiners, None
    ready, waiting_until = [], []
    for node_id in joiners:
        until = observed.first_seen.get(node_id, now) + config.scale_up_wait_s
        if node_id in observed.checkpointed_since or now >= until:
            ready.append(node_id)
        else:
            waiting_until.append(until)
    return ready, min(waiting_until, default=None)


def _earliest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def decide(observed: Observed, now: float, config: RendezvousConfig) -> Decision:
    """Decide whether the leader commits a new round now, and with whom."""
    current = observed.current
    if current is not None and current.outcome:
        return Decision(Action.WAIT, f"job {current.outcome} in round {current.number}")
    suspected = {n: at + config.suspect_s for n, at in observed.suspects.items()
                 if now < at + config.suspect_s}
    unstarted: list[str] = []
    if current is not None and now - current.created_at >= config.start_timeout_s:
        unstarted = [m for m in current.node_ids
                     if observed.started.get(m, 0) < current.workers_round
                     and observed.done.get(m, (0, 0.0))[0] < current.workers_round
                     and m not in observed.registered_since_round]
    left_out = set(suspected) | set(unstarted) | set(observed.draining)
    candidates = [n.node_id for n in observed.alive if n.node_id not in left_out]
    # A suspicion running out may let a node back in: look again then.
    suspicion_ends = min((until for n, until in suspected.items()
                          if n in {a.node_id for a in observed.alive}), default=None)

    if current is None:
        members = candidates[: config.max_nodes]
        standby = len(candidates) - len(members)
        why = "first round: " + _plural(len(candidates), "node") + " registered"
        if standby:
            why += f" ({standby} beyond max wait as standby)"
        decision = _close_or_settle(members, why, observed, now, config)
        if decision.action is Action.WAIT:
            decision = dataclasses.replace(
                decision, wake_at=_earliest(decision.wake_at, suspicion_ends))
        return decision

    # Once, as a set: per candidate (or report) it made a decision O(N^2).
    member_ids = set(current.node_ids)
    done = {m: at for m, (number, at) in observed.done.items()
            if current.workers_round <= number <= current.number and m in member_ids}
    if len(done) == len(current.members):
        return Decision(Action.SUCCEED_JOB,
                        f"round {current.number}: the workers of all "
                        f"{_plural(len(done), 'member')} exited 0")
    barrier_at = min(done.values()) + config.exit_barrier_timeout_s if done else None
    if barrier_at is not None and now >= barrier_at:
        running = [m for m in current.node_ids if m not in done]
        return Decision(
            Action.FAIL_JOB,
            f"round {current.number}: exit barrier timed out: {', '.join(sorted(done))} "
            f"finished, but {', '.join(running)} still had running workers "
            f"{config.exit_barrier_timeout_s:g} s later (--exit-barrier-timeout)",
            failures=current.failures)

    alive = set(candidates)
    survivors = [m for m in current.node_ids if m in alive]
    joiners = [n for n in candidates if n not in member_ids]
    registered = {n.node_id for n in observed.alive}
    gone = [m for m in current.node_ids if m not in registered and m not in observed.draining]
    drained = [m for m in current.node_ids if m in observed.draining]
    restarts = [r for r in observed.restart_requests
                if current.workers_round <= r.round <= current.number]

    # A member registered anew since the round (its agent restarted, or lost
    # its lease): its workers of this round are gone, so the round is too.
    rejoined = [m for m in survivors if m in observed.registered_since_round]
    triggers = []
    if gone:
        triggers.append("lost " + ", ".join(gone))
    if rejoined:
        triggers.append("registered again: " + ", ".join(rejoined))
    if unstarted:
        triggers.append(", ".join(unstarted) + " did not start workers within "
                        f"{config.start_timeout_s:g} s")
    if drained:
        triggers.append("drained " + ", ".join(drained))
    for r in restarts:
        triggers.append(f"restart requested by {r.node_id}: {r.reason}")
    # Suspects still hold their places unless a round forms for another reason.
    room = config.max_nodes - len([m for m in current.node_ids if m in registered])
    growing, scale_up_at = _scale_up_ready(joiners, observed, now, config)
    if growing and room > 0 and not done:
        triggers.append("joined " + ", ".join(growing[:room]))
    room = config.max_nodes - len(survivors)

    if not triggers:
        standby = f", {_plural(len(joiners), 'standby')}" if joiners else ""
        if scale_up_at is not None and room > 0 and not done:
            standby += " (joining at the next checkpoint)"
        barrier = (f", {_plural(len(done), 'member')} finished (exit barrier)"
                   if done else "")
        start_due = (current.created_at + config.start_timeout_s
                     if any(observed.started.get(m, 0) < current.workers_round
                            and m not in done for m in current.node_ids) else None)
        return Decision(
            Action.WAIT,
            f"round {current.number} stands with {_plural(len(survivors), 'member')}"
            f"{standby}{barrier}",
            wake_at=_earliest(barrier_at, start_due, suspicion_ends, scale_up_at),
        )
    unanswering = [m for m in current.node_ids if m in suspected and m in registered]
    if unanswering:
        # Not a trigger: said so that the operator sees why they are left out.
        triggers.append("left out " + ", ".join(unanswering) + " (agent does not answer)")
    why = f"round {current.number}: " + "; ".join(triggers)
    failures = tuple(t for t in current.failures if now - t <= config.restart_window_s)
    # A member that drains (elasticctl drain, SIGTERM) stops its workers, and
    # its peers' workers then fail on it: the drain's doing, not failures.
    if any(r.failure for r in restarts) and not drained:
        failures += (now,)
        if len(failures) > config.max_restarts:
            return Decision(
                Action.FAIL_JOB,
                f"{why}; restart budget spent: {len(failures)} failures within "
                f"{config.restart_window_s:.0f} s (max restarts {config.max_restarts})",
                failures=failures,
            )
    members = survivors + joiners[: max(room, 0)]
    decision = _close_or_settle(members, why, observed, now, config)
    wake_at = decision.wake_at
    if decision.action is Action.WAIT:
        wake_at = _earliest(wake_at, suspicion_ends)
    return dataclasses.replace(decision, failures=failures, suspects=tuple(unstarted),
                               wake_at=wake_at)

