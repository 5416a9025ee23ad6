"""The job report: a job's history turned into its timeline (pure, no I/O).

:func:`build_report` takes what etcd holds about a job (its events, the
current round record, the latest checkpoint commit, the agents' status
records) and the report's "now", and returns a :class:`JobReport`:

* **Rounds**, one band per ``round`` event: members, world size, when the
  last member's workers ran, when the first member stopped them, and how the
  round ended (:class:`RoundEnd`): a fault, a planned change, the job's end.
* **Faults**, at most one per round: the failure that ended it. A node-level
  cause (a lease revoked as frozen, a member lost, an agent registered again,
  a member that never started) wins over the workers that failed because of
  it; else the first failure a member saw itself (its ``RUNNING ->
  STOPPING`` reason: for a hang, the attribution naming rank, node and
  place); else the restart request the next round names. Its lost time runs
  from its start (its detection less the undetected part its verdict states,
  e.g. ``made no progress for 5.1 s``) to the moment every member of the
  next round ran its workers again, or, where the history does not say, the
  next round's forming, the job's end or "now" (:class:`Recovery` says which).
* **Checkpoints**: each commit and failed save (disk), and each node's newest
  memory-tier snapshot (from its status record; its time is unknown).
* **Stragglers**: every ``straggler`` event, with the rank and node it names.
* **Goodput** over the report's span, from the timeline alone: productive,
  repeated (after a failed round's last commit), lost to faults, other.
* **History**: whether events may be missing (a writer's ring is full, the
  job's history is at the pruning bound, rounds are absent, events were
  unreadable), and from when the report can be trusted whole.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from agent import report_reading as read
from agent.report_model import (
    TIER_DISK,
    TIER_MEMORY,
    Checkpoint,
    Fault,
    FaultKind,
    Goodput,
    History,
    JobReport,
    Recovery,
    RoundBand,
    RoundEnd,
    Straggler,
)
from agent.status_record import StatusRecord
from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.etcd_log import EVENT_KIND as CHECKPOINT_KIND
from elastic.events import (
    EVENTS_PER_WRITER,
    KIND_FROZEN,
    KIND_OUTCOME,
    KIND_ROUND,
    KIND_STRAGGLER,
    MAX_EVENTS,
    Event,
)
from elastic.rendezvous.api import Round

# Goodput.source: computed by elasticctl report from the events, not the agents' metric.
GOODPUT_SOURCE = "timeline"

# Node-level causes, strongest first: the members' workers fail because of them.
_NODE_CAUSES = (FaultKind.NODE_FROZEN, FaultKind.NODE_LOST, FaultKind.AGENT_RESTARTED,
                FaultKind.NO_START)
Interval = tuple[float, float]


@dataclass
class _RoundLog:
    """What the events say about one round number."""

    formed: Event | None = None
    running: dict[str, float] = field(default_factory=dict)  # node -> its workers ran
    stops: list[tuple[Event, read.Transition]] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    world_size: int | None = None


def build_report(job_id: str, events: Iterable[Event], now: float, *,
                 current: Round | None = None, latest: CommitEntry | None = None,
                 statuses: Sequence[StatusRecord] = (),
                 unreadable: Sequence[str] = ()) -> JobReport:
    """The timeline of ``job_id`` as of ``now`` (wall seconds).

    ``events``: its history, in any order; ``current``: its round record;
    ``latest``: its latest checkpoint commit; ``statuses``: its agents'
    status records; ``unreadable``: the keys of the records (events among
    them) that could not be parsed: the history is then incomplete. Never
    raises on odd histories: what the events do not say is left None,
    UNKNOWN or OTHER.
    """
    history = sorted(events, key=lambda e: (e.time, e.node_id))
    logs = _round_logs(history)
    outcome = next((e for e in reversed(history) if e.kind == KIND_OUTCOME), None)
    frozen = [e for e in history if e.kind == KIND_FROZEN]
    checkpoints = _checkpoints(history, latest, statuses)
    commits = sorted(c.time for c in checkpoints if c.ok and c.tier == TIER_DISK
                     and c.time is not None)
    rounds, faults = _timeline(logs, outcome, frozen, commits, current, now)
    record = _history(history, logs, current, unreadable)
    end = outcome.time if outcome else now
    return JobReport(
        job_id=job_id, made_at=now,
        state=(read.outcome(outcome.message) or "ended") if outcome else
        ("running" if rounds else "not started"),
        history=record, rounds=tuple(rounds), faults=tuple(faults),
        checkpoints=tuple(checkpoints),
        stragglers=tuple(Straggler(e.time, e.round, e.node_id, read.named_rank(e.message),
                                   read.named_node(e.message), e.message)
                         for e in history if e.kind == KIND_STRAGGLER),
        goodput=_goodput(rounds, faults, record.complete_from, end))


def _round_logs(history: list[Event]) -> dict[int, _RoundLog]:
    logs: dict[int, _RoundLog] = defaultdict(_RoundLog)
    for e in history:
        log = logs[e.round]
        if e.kind == KIND_ROUND and log.formed is None:
            log.formed = e
        t = read.transition(e)
        if t is None:
            continue
        if t.after == "RUNNING":
            log.running.setdefault(e.node_id, e.time)
        elif t.after == "STOPPING":
            log.stops.append((e, t))
        elif t.after == "DONE":
            log.done.append(e.time)
        log.world_size = log.world_size or read.world_size(t.reason)
    return logs


def _timeline(logs: dict[int, _RoundLog], outcome: Event | None, frozen: list[Event],
              commits: list[float], current: Round | None,
              now: float) -> tuple[list[RoundBand], list[Fault]]:
    """The round bands in order, and the fault that ended each (where one did)."""
    formed = sorted((n, log) for n, log in logs.items() if log.formed is not None)
    bands: list[RoundBand] = []
    faults: list[Fault] = []
    for i, (number, log) in enumerate(formed):
        following = formed[i + 1][1].formed if i + 1 < len(formed) else None
        ends = following or outcome
        members = read.round_members(log.formed.message)
        running_at = _running_at(log, members)
        if read.continues(log.formed.message) and bands and bands[-1].running_at is not None:
            running_at, members = log.formed.time, bands[-1].members
        world = log.world_size or (current.world_size if current and current.number == number
                                   else None)
        stopped_at = min((e.time for e, _ in log.stops), default=max(log.done, default=None))
        end, why = _end(log, following, outcome)
        band = RoundBand(number=number, formed_at=log.formed.time, members=members,
                         world_size=world, running_at=running_at, stopped_at=stopped_at,
                         ended_at=ends.time if ends else None, end=end, end_reason=why)
        bands.append(band)
        fault = _fault(band, log, ends, frozen)
        if fault is not None:
            faults.append(_recovered(fault, band, formed[i + 1:], outcome, commits, now))
    return bands, faults


def _running_at(log: _RoundLog, members: tuple[str, ...]) -> float | None:
    """When the last member's workers ran (the last seen, where some are not in the history)."""
    times = [t for node, t in log.running.items() if not members or node in members]
    return max(times, default=None)


def _end(log: _RoundLog, following: Event | None, outcome: Event | None) -> tuple[RoundEnd, str]:
    """How a round ended, and the words that say why."""
    seen = _first_hand(log)
    if following is not None:
        why = read.round_reason(following.message)
        if read.continues(following.message):
            return RoundEnd.CONTINUED, why
        found = read.triggers(why)
        if seen or any(t.kind is not None for t in found):
            return RoundEnd.FAULT, why
        if found and found[0].by is not None:
            return RoundEnd.REQUESTED, why
        return (RoundEnd.MEMBERSHIP if found else RoundEnd.UNKNOWN), why
    if outcome is not None:
        said = outcome.message
        return (RoundEnd.SUCCEEDED if read.outcome(said) == "succeeded" else RoundEnd.FAILED), said
    if seen:
        return RoundEnd.FAULT, seen[0][1].reason
    return RoundEnd.CURRENT, ""


def _first_hand(log: _RoundLog) -> list[tuple[Event, read.Transition]]:
    return [(e, t) for e, t in log.stops if read.is_first_hand(t)]


@dataclass(frozen=True)
class _Cause:
    """Who and what broke a round, and when it was seen (None: when the round ended)."""

    kind: FaultKind
    text: str
    node: str | None
    rank: int | None
    by: str
    at: float | None


def _node_causes(band: RoundBand, ends: Event | None, frozen: list[Event]) -> list[_Cause]:
    """The node-level causes of ``band``'s end, the strongest first."""
    found = [_Cause(FaultKind.NODE_FROZEN, e.message, node, None, e.node_id, e.time)
             for e in frozen if (node := read.revoked_node(e.message)) in band.members
             and band.formed_at <= e.time <= (band.ended_at or math.inf)]
    found += [_Cause(t.kind, t.cause, t.node, None, ends.node_id if ends else "", None)
              for t in read.triggers(band.end_reason) if t.kind in _NODE_CAUSES]
    return sorted(found, key=lambda c: _NODE_CAUSES.index(c.kind))


def _cause(band: RoundBand, log: _RoundLog, ends: Event | None,
           frozen: list[Event]) -> _Cause | None:
    """What ended ``band``: a node-level cause (with that node's own reason,
    if it gave one), else the first failure a member saw itself, else the
    failure a restart request names; None when nothing says."""
    seen = _first_hand(log)
    nodes = _node_causes(band, ends, frozen)
    if nodes:
        c = nodes[0]
        own = next((t.reason for e, t in seen if e.node_id == c.node), None)
        return dataclasses.replace(c, text=f"{c.text} ({c.node}: {own})") if own else c
    if seen:
        e, t = seen[0]
        return _Cause(read.fault_kind(t.reason) or FaultKind.OTHER, t.reason,
                      read.named_node(t.reason) or e.node_id, read.named_rank(t.reason),
                      e.node_id, e.time)
    asked = [t for t in read.triggers(band.end_reason) if t.kind is not None]
    if asked:
        t = asked[0]
        return _Cause(t.kind, t.cause, t.node, read.named_rank(t.cause),
                      t.by or (ends.node_id if ends else ""), None)
    return None  # a job that failed without a failure (an exit barrier timed out)


def _fault(band: RoundBand, log: _RoundLog, ends: Event | None,
           frozen: list[Event]) -> Fault | None:
    """The fault that ended ``band`` (recovery still to be worked out), if one did."""
    c = _cause(band, log, ends, frozen) if band.end in (RoundEnd.FAULT, RoundEnd.FAILED) \
        else None
    if c is None:
        return None
    seen_at = min(x for x in (c.at, band.stopped_at, band.ended_at, math.inf) if x is not None)
    return Fault(time=seen_at, round=band.number, kind=c.kind, cause=c.text, rank=c.rank,
                 node=c.node, reported_by=c.by, undetected_s=read.undetected_s(c.text),
                 recovered_at=seen_at, recovery=Recovery.NOT_YET, lost_s=0.0, rework_s=0.0)


def _recovered(fault: Fault, band: RoundBand, later: list[tuple[int, _RoundLog]],
               outcome: Event | None, commits: list[float], now: float) -> Fault:
    """``fault`` with its recovery, lost time and repeated work filled in."""
    if later:
        log = later[0][1]
        running_at = _running_at(log, read.round_members(log.formed.message))
        recovery, at = ((Recovery.WORKERS_RUNNING, running_at) if running_at is not None
                        else (Recovery.ROUND_FORMED, log.formed.time))
    elif outcome is not None:
        recovery, at = Recovery.JOB_ENDED, outcome.time
    else:
        recovery, at = Recovery.NOT_YET, now
    began = fault.time - fault.undetected_s
    rework = 0.0
    if band.running_at is not None and began > band.running_at:
        last = max((c for c in commits if band.running_at <= c <= began), default=None)
        rework = began - (band.running_at if last is None else last)
    return dataclasses.replace(fault, recovered_at=at, recovery=recovery,
                               lost_s=max(0.0, at - began), rework_s=rework)


def _checkpoints(history: list[Event], latest: CommitEntry | None,
                 statuses: Sequence[StatusRecord]) -> list[Checkpoint]:
    found = []
    for e in history:
        said = read.checkpoint(e.message) if e.kind == CHECKPOINT_KIND else None
        if said is not None:
            found.append(Checkpoint(said[0], e.time, TIER_DISK, e.round, e.node_id, said[1],
                                    e.message))
    if latest is not None and not any(c.ok and c.step == latest.step for c in found):
        found.append(Checkpoint(latest.step, latest.time, TIER_DISK, latest.round, "", True,
                                f"latest commit record: step {latest.step} ({latest.path})"))
    for s in statuses:
        tier = s.memory_tier
        if tier is not None and tier.newest_own_step >= 0:
            found.append(Checkpoint(tier.newest_own_step, None, TIER_MEMORY, s.round,
                                    s.node_id, True, f"newest memory snapshot on {s.node_id}"))
    return sorted(found, key=lambda c: (c.time is None, c.time or 0.0, c.step))


def _history(history: list[Event], logs: dict[int, _RoundLog], current: Round | None,
             unreadable: Sequence[str]) -> History:
    """Whether events may be missing, which, and from when the history is whole."""
    gaps: list[str] = []
    whole_from = [history[0].time] if history else []
    per_writer: dict[str, list[Event]] = defaultdict(list)
    for e in history:
        per_writer[e.node_id].append(e)
    for node, written in sorted(per_writer.items()):
        if len(written) >= EVENTS_PER_WRITER:
            gaps.append(f"node {node}'s ring of {EVENTS_PER_WRITER} events is full: its "
                        "older events may have been overwritten")
            whole_from.append(written[0].time)
    if len(history) >= MAX_EVENTS:
        gaps.append(f"the history holds {len(history)} events, at the bound the leader "
                    f"prunes to ({MAX_EVENTS}): older ones may be gone")
    numbers = sorted(n for n, log in logs.items() if log.formed is not None)
    expected = 1
    for n in numbers:
        if n > expected:
            missing = f"round {expected}" if n == expected + 1 else \
                f"rounds {expected} to {n - 1}"
            gaps.append(f"{missing} not in the history")
            whole_from.append(logs[n].formed.time)
        expected = n + 1
    last = current.number - (1 if current.outcome else 0) if current else 0
    if last >= expected:
        gaps.append(f"round {last}, the job's current round, not in the history")
    if unreadable:
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        gaps.append(f"{len(unreadable)} unreadable record(s) skipped: "
                    f"{', '.join(unreadable[:3])}{more}")
    return History(events=len(history), complete=not gaps,
                   complete_from=max(whole_from) if whole_from else None, gaps=tuple(gaps))


def _clip(spans: Iterable[Interval], start: float, end: float) -> list[Interval]:
    return [(max(a, start), min(b, end)) for a, b in spans if min(b, end) > max(a, start)]


def _measure(spans: Iterable[Interval]) -> float:
    """The length of the union of ``spans``."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _goodput(rounds: list[RoundBand], faults: list[Fault], start: float | None,
             end: float) -> Goodput:
    if start is None or end <= start:
        return Goodput(GOODPUT_SOURCE, start, end if start is not None else None, 0.0, 0.0,
                       0.0, 0.0, 0.0, None, {})
    runs = _clip(((r.running_at, r.stopped_at or r.ended_at or end) for r in rounds
                  if r.running_at is not None), start, end)
    lost_spans = {f: _clip([(f.time - f.undetected_s, f.recovered_at)], start, end)
                  for f in faults}
    rework = _measure(s for f in faults
                      for s in _clip([(f.time - f.undetected_s - f.rework_s,
                                       f.time - f.undetected_s)], start, end))
    lost = _measure(s for spans in lost_spans.values() for s in spans)
    # Productive: running, and neither lost (a hang before its detection) nor repeated.
    running = _measure(runs)
    overlap = running + lost - _measure(runs + [s for v in lost_spans.values() for s in v])
    productive = max(0.0, running - overlap - rework)
    by_kind: dict[str, float] = defaultdict(float)
    for f, spans in lost_spans.items():
        by_kind[f.kind.value] += _measure(spans)
    span = end - start
    return Goodput(GOODPUT_SOURCE, start, end, span, productive, rework, lost,
                   max(0.0, span - productive - rework - lost), productive / span,
                   dict(sorted(by_kind.items())))
