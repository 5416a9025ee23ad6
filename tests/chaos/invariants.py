"""What must hold after a chaos campaign, checked from the workers' own logs and from etcd.

Each check is a pure function of what the campaign recorded and returns a
:class:`Check`: a name, whether it held, and the details (the first few
violations, or a one-line summary). None of them sleeps or reads a clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from elastic.checkpoint import layout
from tests.chaos.cluster import RoundSpan, StepLine
from tests.chaos.faults import FaultRecord

ROUND_OVERLAP_TOLERANCE_S = 0.5  # clock granularity of a step line vs. a stop in flight


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def job_finished(agents: list[tuple[str, int | None, bool]]) -> Check:
    """Every agent the faults did not kill exited 0. ``agents``: (label, exit code, killed)."""
    bad = [f"{label} exited {code}" for label, code, killed in agents
           if not killed and code != 0]
    finals = sum(1 for _, _, killed in agents if not killed)
    return Check("job finished (every agent exits 0)", not bad,
                 "; ".join(bad) if bad else f"{finals} agents exited 0")


def weights_equal(result: dict | None, reference: dict | None, lines: list[StepLine],
                  reference_lines: list[StepLine]) -> Check:
    """The campaign's final parameters hash like the fault-free run's; when they do
    not, the detail names the first (step, rank) whose loss differed, and its round."""
    name = "final weights equal a fault-free run's"
    if result is None or reference is None:
        return Check(name, False, f"missing result: campaign {result}, reference {reference}")
    same = (result["sha256"], result["step"]) == (reference["sha256"], reference["step"])
    detail = (f"sha256 {result['sha256'][:16]}.. step {result['step']} world "
              f"{result['world']} vs {reference['sha256'][:16]}.. step "
              f"{reference['step']} world {reference['world']}")
    diverged = first_divergence(lines, reference_lines)
    if diverged:
        detail += f"; {diverged}"
    return Check(name, same and not diverged, detail)


def first_divergence(lines: list[StepLine], reference_lines: list[StepLine]) -> str:
    """The first (step, rank) at which a round of the campaign logged another loss
    than the fault-free run ("" when none did)."""
    ref = {(ln.step, ln.rank): ln.loss for ln in reference_lines}
    for ln in sorted(lines, key=lambda ln: (ln.step, ln.rank, ln.round)):
        want = ref.get((ln.step, ln.rank))
        if want is not None and want != ln.loss:
            return (f"first divergence at step {ln.step} rank {ln.rank} in round {ln.round} "
                    f"(node {ln.node}): loss {float.fromhex(ln.loss)!r} vs "
                    f"{float.fromhex(want)!r}")
    return ""


def rounds_disjoint(rounds: dict[int, RoundSpan],
                    tolerance_s: float = ROUND_OVERLAP_TOLERANCE_S) -> Check:
    """No round trains while another does: every step of round a comes before the
    first step of any later round b (within ``tolerance_s``)."""
    spans = [rounds[n] for n in sorted(rounds)]
    bad = []
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            overlap = a.last_t - b.first_t
            if overlap > tolerance_s:
                bad.append(f"round {a.number} stepped {overlap:.2f} s into round {b.number} "
                           f"(round {a.number} last step {a.last_step}, round {b.number} "
                           f"first step {b.first_step})")
    return Check("no two rounds train at once", not bad,
                 "; ".join(bad[:5]) if bad else f"{len(spans)} rounds, none overlapping")


def steps_continuous(lines: list[StepLine], rounds: dict[int, RoundSpan]) -> Check:
    """Each round starts at most where the previous ones got to (a resume from a
    committed checkpoint), and within a round every rank steps without gaps."""
    bad = []
    per_proc: dict[tuple[int, int], list[int]] = {}
    for ln in lines:
        per_proc.setdefault((ln.round, ln.rank), []).append(ln.step)
    for (rnd, rank), steps in sorted(per_proc.items()):
        steps.sort()
        gaps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
        if gaps:
            bad.append(f"round {rnd} rank {rank} skipped from step {gaps[0][0]} to {gaps[0][1]}")
    reached = -1
    for n in sorted(rounds):
        span = rounds[n]
        if span.first_step > reached + 1:
            bad.append(f"round {n} started at step {span.first_step}, but no earlier round got "
                       f"past step {reached}")
        reached = max(reached, span.last_step)
    return Check("steps continue from a committed checkpoint", not bad,
                 "; ".join(bad[:5]) if bad else "no gaps")


def completed_by_every_rank(span: RoundSpan) -> int:
    """The last step every rank of the round logged (so completed and, with the
    memory tier, staged); the step before its first when some rank logged none."""
    if span.world <= 0 or any(r not in span.ranks for r in range(span.world)):
        return span.first_step - 1
    return min(span.ranks[r][2] for r in range(span.world))


def memory_resume_bounded(rounds: dict[int, RoundSpan], faults: list[FaultRecord],
                          every: int) -> Check:
    """With the memory tier snapshotting every ``every`` steps, each round resumes
    at most ``every`` steps behind where every rank of the round before it got:
    ``completed_by_every_rank(previous) + 1 - first step <= every``. A worker's
    death keeps its node's snapshots, one node's death leaves its snapshots on
    its buddy; only a node lost with its buddy (not among the campaign's
    faults) may fall back further, to disk. The detail names the fault before
    each violation and the largest lag seen."""
    spans = [rounds[n] for n in sorted(rounds)]
    bad = []
    worst = 0
    for before, after in zip(spans, spans[1:]):
        behind = completed_by_every_rank(before) + 1 - after.first_step
        worst = max(worst, behind)
        if behind > every:
            cause = [f for f in faults if f.t_start <= after.first_t]
            why = f" after {cause[-1].kind} ({cause[-1].target})" if cause else ""
            bad.append(f"round {after.number} resumed at step {after.first_step}, {behind} "
                       f"steps behind step {completed_by_every_rank(before)} that every rank "
                       f"of round {before.number} completed{why}")
    return Check(f"each restart resumes at most {every} step(s) behind (memory tier)", not bad,
                 "; ".join(bad[:5]) if bad else
                 f"{max(0, len(spans) - 1)} restarts, at most {worst} step(s) behind")


def checkpoint_monotonic(seen: list[tuple[float, int, int]], errors: int) -> Check:
    """checkpoint/latest, polled through the run: its step and round never go back."""
    bad = []
    for (t0, s0, r0), (t1, s1, r1) in zip(seen, seen[1:]):
        if s1 < s0 or r1 < r0:
            bad.append(f"went from step {s0} round {r0} to step {s1} round {r1}")
    detail = ("; ".join(bad[:5]) if bad else
              f"{len(seen)} values, step {seen[0][1] if seen else '-'} -> "
              f"{seen[-1][1] if seen else '-'} ({errors} failed reads)")
    return Check("committed checkpoint never goes back", bool(seen) and not bad, detail)


def no_orphans(leftover: dict[int, str]) -> Check:
    """``leftover``: pid -> command line of tagged processes alive after the agents exited."""
    return Check("no orphan process", not leftover,
                 "; ".join(f"pid {p}: {c[:80]}" for p, c in sorted(leftover.items())[:5])
                 or "none")


def faults_visible(faults: list[FaultRecord], events: list[dict],
                   rounds: dict[int, RoundSpan]) -> Check:
    """Every fault that promises a restart is followed by a round change (an event of
    kind ``round``, or a state change to STOPPING or FAILED) in elasticctl's history,
    and every fault that promises an event (``FaultRecord.event``: a kind and a text
    in its message, e.g. a failed checkpoint save with ENOSPC) is followed by one."""
    bad = []
    for f in faults:
        after = [e for e in events if e["time"] >= f.t_start - 0.05]
        if f.expect_restart is True and not any(
                e["kind"] == "round" or (e["kind"] == "state" and (
                    "-> STOPPING" in e["message"] or "-> FAILED" in e["message"]))
                for e in after):
            bad.append(f"{f.kind} at {f.t_start:.1f} ({f.target}): no round change or "
                       f"failure event after it")
        if f.event is not None and not any(
                e["kind"] == f.event[0] and f.event[1] in e["message"] for e in after):
            bad.append(f"{f.kind} at {f.t_start:.1f} ({f.target}): no {f.event[0]} event "
                       f"with {f.event[1]!r} after it")
    shown = sum(f.expect_restart is True or f.event is not None for f in faults)
    return Check("every fault shows in elasticctl events", not bad,
                 "; ".join(bad[:5]) if bad else f"{shown} faults followed by events")


def no_restart_where_promised(faults: list[FaultRecord], events: list[dict],
                              recovered_at: dict[int, float]) -> Check:
    """Faults that promise no restart (etcd: a member, the leader, quorum; a full
    checkpoint disk) must not restart training."""
    bad = []
    for i, f in enumerate(faults):
        if f.expect_restart is not False:
            continue
        end = recovered_at.get(i, f.t_end)
        rounds = [e for e in events if e["kind"] == "round" and f.t_start <= e["time"] <= end]
        if rounds:
            bad.append(f"{f.kind} ({f.target}) at {f.t_start:.1f}: {rounds[0]['message'][:160]}")
    checked = sum(f.expect_restart is False for f in faults)
    return Check("etcd and disk faults restart nothing", not bad,
                 "; ".join(bad[:5]) if bad else f"{checked} such faults, no new round")


def interrupted_saves_discarded(faults: list[FaultRecord], seen: list[tuple[float, int, int]],
                                temporaries: list[str] | None) -> Check:
    """A save that a crash cut short (``FaultRecord.interrupted_save``) never became
    the committed checkpoint (``seen``: checkpoint/latest's values), and its
    temporary directory is gone by the end (``temporaries``: the ``.tmp-*`` names
    under the checkpoint root then; None when it could not be listed)."""
    bad = []
    cut = [f for f in faults if f.interrupted_save is not None]
    for f in cut:
        step, round_ = f.interrupted_save
        if any((s, r) == (step, round_) for _, s, r in seen):
            bad.append(f"{f.kind}: the interrupted save of step {step} in round {round_} "
                       f"was committed")
        name = layout.tmp_dir_name(step, round_)
        if temporaries is None or name in temporaries:
            bad.append(f"{f.kind}: {name} " + ("could not be checked" if temporaries is None
                                                else "is still there at the end"))
    return Check("interrupted saves never commit and are cleaned up", not bad,
                 "; ".join(bad[:5]) if bad else f"{len(cut)} interrupted saves, none committed, "
                                                f"none left")


def recovery_times(faults: list[FaultRecord], rounds: dict[int, RoundSpan]
                   ) -> dict[str, list[float]]:
    """Per kind: seconds from each fault to the first step of the next round (a round
    above the one training at the fault whose first step came after it, and before
    the next fault)."""
    out: dict[str, list[float]] = {}
    for i, f in enumerate(faults):
        until = faults[i + 1].t_start if i + 1 < len(faults) else float("inf")
        firsts = [s.first_t for n, s in rounds.items()
                  if n > f.round_before and f.t_start <= s.first_t < until]
        if firsts:
            out.setdefault(f.kind, []).append(min(firsts) - f.t_start)
    return out


def summarize_times(times: list[float]) -> str:
    if not times:
        return "no new round"
    return f"median {statistics.median(times):5.1f} s, worst {max(times):5.1f} s (n={len(times)})"
