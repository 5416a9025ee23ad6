"""The job report as text: ``elasticctl report``'s default, read at 100 columns.

A header line (the job's state and counts), the history's completeness, then
one table per part: rounds, faults (each with its cause, wrapped, on the
lines below it), checkpoints, stragglers, and the goodput summary. Times are
the local time of day; the header carries the date.
"""

from __future__ import annotations

import textwrap
import time

from agent.report_model import TIER_DISK, Fault, JobReport, RoundBand
from agent.status import column_widths, table

WIDTH = 100
_CAUSE_INDENT = "    "
_END_CHARS = 24  # the least of a round's end reason shown in its table


def seconds(s: float | None) -> str:
    """A duration as people read it: ``0.03 s``, ``12.5 s``, ``4 min 10 s``, ``2 h 05 min``."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s:.2f} s"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def date_time(t: float) -> str:
    """The date and local time of day, for a report's header."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def optional(value: int | None) -> str:
    return "-" if value is None else str(value)


def ending(r: RoundBand) -> str:
    """How a round ended, and why where the history says."""
    return r.end.value + (f": {r.end_reason}" if r.end_reason else "")


def until(f: Fault) -> str:
    """The moment a fault's lost time runs to, in words (``workers running``)."""
    return f.recovery.value.replace("_", " ")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def render(report: JobReport) -> str:
    """The whole report as text, every line at most :data:`WIDTH` columns
    except a table row whose cells cannot be shortened (ids, times)."""
    made = date_time(report.made_at)
    parts = [f"job {report.job_id}: {report.state}; {plural(len(report.rounds), 'round')}, "
             f"{plural(len(report.faults), 'fault')}, "
             f"{plural(sum(c.ok for c in report.checkpoints), 'checkpoint')}, "
             f"{plural(len(report.stragglers), 'straggler')}; at {made}",
             _history(report)]
    if report.rounds:
        parts.append("ROUNDS\n" + _rounds(report.rounds, report.made_at))
    if report.faults:
        parts.append("FAULTS\n" + _faults(report.faults))
    if report.checkpoints:
        parts.append("CHECKPOINTS\n" + table(
            ["TIME", "STEP", "TIER", "ROUND", "NODE", "RESULT"],
            [[clock(c.time), str(c.step), c.tier, str(c.round), c.node or "-",
              "committed" if c.ok and c.tier == TIER_DISK else "held" if c.ok else
              _short(c.message, 60)] for c in report.checkpoints]))
    if report.stragglers:
        parts.append("STRAGGLERS\n" + table(
            ["TIME", "ROUND", "RANK", "NODE", "MESSAGE"],
            [[clock(s.time), str(s.round), optional(s.rank), s.node or "-", _short(s.message, 60)]
             for s in report.stragglers]))
    parts.append(_goodput(report))
    return "\n\n".join(parts)


def _history(report: JobReport) -> str:
    h = report.history
    if not h.events:
        return "history: no events (no agent of this job has written any: is the job id right?)"
    if h.complete:
        return f"history: {plural(h.events, 'event')}, complete"
    lines = [f"history: {plural(h.events, 'event')}, INCOMPLETE; whole from "
             f"{clock(h.complete_from)} (goodput counts from there):"]
    lines += [textwrap.fill(g, WIDTH, initial_indent="  - ", subsequent_indent="    ")
              for g in h.gaps]
    return "\n".join(lines)


def _rounds(rounds: tuple[RoundBand, ...], now: float) -> str:
    """The rounds' table; each END cut to what is left of :data:`WIDTH` (at
    least :data:`_END_CHARS`). A round still running ran until ``now``."""
    headers = ["ROUND", "FORMED", "MEMBERS", "WORLD", "RAN AT", "RAN FOR"]
    rows = []
    for r in rounds:
        ran_for = None
        if r.running_at is not None:
            ran_for = (r.stopped_at or r.ended_at or now) - r.running_at
        rows.append([str(r.number), clock(r.formed_at), _short(",".join(r.members) or "?", 24),
                     optional(r.world_size), clock(r.running_at), seconds(ran_for)])
    room = max(_END_CHARS, WIDTH - 2 - sum(w + 2 for w in column_widths(headers, rows)))
    for row, r in zip(rows, rounds):
        row.append(_short(ending(r), room))
    return table(headers + ["END"], rows)


def _faults(faults: tuple[Fault, ...]) -> str:
    headers = ["TIME", "ROUND", "KIND", "RANK", "NODE", "LOST", "UNTIL", "REPEATED", "BY"]
    rows = [[clock(f.time), str(f.round), f.kind.value, optional(f.rank), f.node or "-",
             seconds(f.lost_s), until(f), seconds(f.rework_s), f.reported_by or "-"]
            for f in faults]
    lines = table(headers, rows).split("\n")
    out = [lines[0]]
    for line, f in zip(lines[1:], faults):
        out.append(line)
        out.append(textwrap.fill(f"cause: {f.cause}", WIDTH, initial_indent=_CAUSE_INDENT,
                                 subsequent_indent=_CAUSE_INDENT + "  "))
    return "\n".join(out)


def _goodput(report: JobReport) -> str:
    g = report.goodput
    head = f"GOODPUT (from this {g.source}, not the agents' goodput metric)"
    if g.ratio is None:
        return f"{head}\nno span to measure yet"
    by = ", ".join(f"{kind} {seconds(s)}" for kind, s in g.lost_by_kind.items())
    line = (f"over {seconds(g.span_s)} ({clock(g.start)} to {clock(g.end)}): productive "
            f"{seconds(g.productive_s)} ({g.ratio:.1%}), repeated {seconds(g.rework_s)}, lost "
            f"to faults {seconds(g.lost_s)}{f' ({by})' if by else ''}, other (starting, "
            f"waiting, reconfiguring) {seconds(g.other_s)}")
    return head + "\n" + textwrap.fill(line, WIDTH)
