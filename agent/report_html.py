"""The job report as one self-contained HTML page with an SVG timeline.

``elasticctl report --html FILE`` writes it: no script, no external resource
(a Content-Security-Policy forbids both, so a page opened from a shared
folder fetches nothing and runs nothing), every text from the job escaped
(event messages are anyone's writing). The timeline has one lane per part:

* rounds as bands (``class="round"``), coloured by how they ended, from the
  round's forming to its end; the part where its workers ran is drawn solid;
* faults as marks (``class="fault"``) at their detection, with a bar for the
  time they lost, their kind, rank, node and cause in a tooltip (``<title>``);
* checkpoints as ticks (``class="checkpoint"``), failed saves in red;
* stragglers as dots (``class="straggler"``);

then a goodput bar and the rounds' and faults' tables. Each mark carries its
time in ``data-time`` (wall seconds), and the plot area is ``#plot``.
"""

from __future__ import annotations

import html

from agent.report_model import Fault, JobReport, RoundBand, RoundEnd
from agent.report_text import clock, date_time, ending, optional, plural, seconds, until

CSP = "default-src 'none'; style-src 'unsafe-inline'"
WIDTH, LEFT, RIGHT = 1000, 110, 30
LANE_H, TOP, AXIS_H = 34, 10, 26
LANES = ("rounds", "faults", "checkpoints", "stragglers")
COLOURS = {RoundEnd.FAULT: "#e4a0a0", RoundEnd.FAILED: "#d06060", RoundEnd.SUCCEEDED: "#8cc68c",
           RoundEnd.CURRENT: "#8fb8e0", RoundEnd.MEMBERSHIP: "#c6b3e0",
           RoundEnd.REQUESTED: "#e0d090", RoundEnd.CONTINUED: "#b0c8e8",
           RoundEnd.UNKNOWN: "#cccccc"}
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left;
  vertical-align: top; border-bottom: 1px solid #ddd; } td.cause { max-width: 60em; }
.gaps { color: #a04000; } svg text { font: 11px sans-serif; fill: #333; }
"""


def esc(text: object) -> str:
    """``text`` safe in HTML text and in a quoted attribute."""
    return html.escape(str(text), quote=True)


class _Scale:
    """Wall time to x in the plot."""

    def __init__(self, start: float, end: float):
        self.start, self.span = start, max(end - start, 1e-9)

    def x(self, t: float) -> float:
        return LEFT + (t - self.start) / self.span * (WIDTH - LEFT - RIGHT)


def _bounds(report: JobReport) -> tuple[float, float]:
    """The time the timeline shows: from the first thing drawn to the report's end."""
    times = [t for r in report.rounds for t in (r.formed_at, r.ended_at) if t is not None]
    times += [t for f in report.faults for t in (f.time - f.undetected_s, f.recovered_at)]
    times += [c.time for c in report.checkpoints if c.time is not None]
    times += [s.time for s in report.stragglers]
    g = report.goodput
    times += [t for t in (g.start, g.end) if t is not None]
    if not times:
        return report.made_at - 1.0, report.made_at
    return min(times), max(times)


def _lane_y(lane: str) -> float:
    return TOP + LANES.index(lane) * LANE_H


def _round(r: RoundBand, s: _Scale, end: float) -> str:
    y, x0 = _lane_y("rounds") + 4, s.x(r.formed_at)
    x1 = s.x(r.ended_at if r.ended_at is not None else end)
    tip = (f"round {r.number}: {', '.join(r.members) or '?'}; world size "
           f"{r.world_size if r.world_size is not None else '?'}; {ending(r)}")
    out = [f'<g class="round" data-round="{r.number}" data-time="{r.formed_at:.3f}">'
           f"<title>{esc(tip)}</title>"
           f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 1.0):.2f}" height="{LANE_H - 8}" '
           f'fill="{COLOURS[r.end]}" fill-opacity="0.45" stroke="#666" stroke-width="0.5"/>']
    if r.running_at is not None:
        stop = r.stopped_at or r.ended_at or end
        xr = s.x(r.running_at)
        out.append(f'<rect class="ran" x="{xr:.2f}" y="{y + 6}" '
                   f'width="{max(s.x(stop) - xr, 1.0):.2f}" height="{LANE_H - 20}" '
                   f'fill="{COLOURS[r.end]}"/>')
    if x1 - x0 > 24:
        out.append(f'<text x="{x0 + 3:.2f}" y="{y + LANE_H - 12}">r{r.number}</text>')
    return "".join(out) + "</g>"


def _fault(f: Fault, s: _Scale) -> str:
    y = _lane_y("faults") + LANE_H / 2
    x, began = s.x(f.time), s.x(f.time - f.undetected_s)
    who = ", ".join(part for part in (f"rank {f.rank}" if f.rank is not None else "",
                                      f"node {f.node}" if f.node else "") if part)
    tip = (f"{f.kind.value}{f' ({who})' if who else ''} in round {f.round} at {clock(f.time)}: "
           f"{f.cause}; lost {seconds(f.lost_s)} until {until(f)}")
    return (f'<g class="fault" data-time="{f.time:.3f}" data-kind="{esc(f.kind.value)}">'
            f"<title>{esc(tip)}</title>"
            f'<rect class="lost" x="{began:.2f}" y="{y - 3}" '
            f'width="{max(s.x(f.recovered_at) - began, 1.0):.2f}" height="6" fill="#d04040" '
            f'fill-opacity="0.35"/>'
            f'<path class="mark" d="M {x:.2f} {y - 9} l 7 9 l -7 9 l -7 -9 z" fill="#c00000"/>'
            "</g>")


def _axis(s: _Scale, start: float, end: float) -> str:
    y = _lane_y("stragglers") + LANE_H + 4
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" stroke="#444"/>']
    for i in range(6):
        t = start + (end - start) * i / 5
        x = s.x(t)
        anchor = "end" if i == 5 else "middle"
        out.append(f'<line x1="{x:.2f}" y1="{y}" x2="{x:.2f}" y2="{y + 4}" stroke="#444"/>'
                   f'<text x="{x:.2f}" y="{y + 16}" text-anchor="{anchor}">{clock(t)}</text>')
    return "".join(out)


def timeline_svg(report: JobReport) -> str:
    """The SVG timeline of ``report``."""
    start, end = _bounds(report)
    s = _Scale(start, end)
    height = _lane_y("stragglers") + LANE_H + AXIS_H + 4
    plot_h = len(LANES) * LANE_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline" width="{WIDTH}" '
           f'height="{height}" viewBox="0 0 {WIDTH} {height}" role="img">',
           f"<title>{esc(f'timeline of job {report.job_id}')}</title>",
           f'<rect id="plot" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" '
           f'height="{plot_h}" fill="#fafafa" stroke="#bbb"/>']
    for lane in LANES:
        out.append(f'<text x="{LEFT - 8}" y="{_lane_y(lane) + LANE_H / 2 + 4}" '
                   f'text-anchor="end">{lane}</text>')
    out += [_round(r, s, end) for r in report.rounds]
    out += [_fault(f, s) for f in report.faults]
    y = _lane_y("checkpoints")
    for c in report.checkpoints:
        if c.time is None:
            continue
        x = s.x(c.time)
        out.append(f'<g class="checkpoint" data-time="{c.time:.3f}" data-step="{c.step}">'
                   f"<title>{esc(f'{c.tier} step {c.step} at {clock(c.time)}: {c.message}')}"
                   f'</title><line x1="{x:.2f}" y1="{y + 6}" x2="{x:.2f}" y2="{y + LANE_H - 6}" '
                   f'stroke="{"#2060c0" if c.ok else "#c00000"}" stroke-width="2"/></g>')
    y = _lane_y("stragglers") + LANE_H / 2
    for st in report.stragglers:
        out.append(f'<g class="straggler" data-time="{st.time:.3f}"><title>'
                   f"{esc(f'straggler at {clock(st.time)}: {st.message}')}</title>"
                   f'<circle cx="{s.x(st.time):.2f}" cy="{y}" r="5" fill="#e08000"/></g>')
    out.append(_axis(s, start, end))
    out.append("</svg>")
    return "\n".join(out)


def _goodput_bar(report: JobReport) -> str:
    g = report.goodput
    if not g.span_s:
        return "<p>Goodput: no span to measure yet.</p>"
    parts = [("productive", g.productive_s, "#4a9a4a"), ("repeated", g.rework_s, "#e0b040"),
             ("lost to faults", g.lost_s, "#d04040"), ("other", g.other_s, "#bbbbbb")]
    x, rects, width = 0.0, [], 600.0
    for name, value, colour in parts:
        w = value / g.span_s * width
        rects.append(f'<rect class="goodput-{name.split()[0]}" x="{x:.2f}" y="0" '
                     f'width="{w:.2f}" height="18" fill="{colour}"><title>{esc(name)} '
                     f"{esc(seconds(value))}</title></rect>")
        x += w
    legend = ", ".join(f"{name} {seconds(value)}" for name, value, _ in parts)
    return (f'<svg id="goodput" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
            f'height="18">{"".join(rects)}</svg>'
            f"<p>Goodput {g.ratio:.1%} over {esc(seconds(g.span_s))}: {esc(legend)} "
            f"(from this {esc(g.source)}, not the agents' goodput metric).</p>")


def _table(headers: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(
        f'<td class="{"cause" if h in ("CAUSE", "END") else ""}">{esc(c)}</td>'
        for h, c in zip(headers, row)) + "</tr>" for row in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def render(report: JobReport) -> str:
    """The whole page, one string."""
    made = date_time(report.made_at)
    counts = f"{plural(len(report.rounds), 'round')}, {plural(len(report.faults), 'fault')}"
    h = report.history
    gaps = "" if h.complete else (
        f'<div class="gaps"><p>The history is incomplete; whole from {esc(clock(h.complete_from))}'
        "</p><ul>" + "".join(f"<li>{esc(g)}</li>" for g in h.gaps) + "</ul></div>")
    rounds = _table(["ROUND", "FORMED", "MEMBERS", "WORLD", "RAN AT", "END"], [
        [str(r.number), clock(r.formed_at), ", ".join(r.members), str(r.world_size or "?"),
         clock(r.running_at), ending(r)]
        for r in report.rounds], "rounds")
    faults = _table(["TIME", "ROUND", "KIND", "RANK", "NODE", "LOST", "UNTIL", "REPEATED",
                     "CAUSE"], [
        [clock(f.time), str(f.round), f.kind.value, optional(f.rank), f.node or "-",
         seconds(f.lost_s), until(f), seconds(f.rework_s), f.cause]
        for f in report.faults], "faults")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
        f"<title>{esc(f'job {report.job_id}: report')}</title><style>{_STYLE}</style></head>",
        f"<body><h1>{esc(f'Job {report.job_id}: {report.state}')}</h1>",
        f"<p>{esc(counts)}; report of {made}</p>{gaps}",
        timeline_svg(report),
        f"<h2>Goodput</h2>{_goodput_bar(report)}",
        f"<h2>Faults</h2>{faults if report.faults else '<p>None.</p>'}",
        f"<h2>Rounds</h2>{rounds if report.rounds else '<p>No round formed.</p>'}",
        "</body></html>", ""])
