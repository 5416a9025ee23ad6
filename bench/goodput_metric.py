"""The agents' own goodput metric in the goodput bench: scraped while the job runs,
merged into the job's figure, and compared with the bench's own (bench/goodput.py).

Each agent accounts the job's time as its node sees it (``elasticd_goodput_seconds``,
:mod:`agent.goodput`): while its node is frozen, dead or a standby, it sees none of
the job's progress, and a node killed takes its counters with it. So the bench
scrapes every agent alive once a second (:class:`Scraper`, and once more just before
it kills a node), and :func:`merge` adds up, interval by interval, the increments of
one *observer*: an agent that answered at both ends of the interval (the same
process), kept for as long as its node is in the job (RUNNING at either end),
otherwise another that is; an observer that misses a few scrapes (a loaded machine,
a freeze) covers the gap when it answers again. This is what a dashboard's "the node
that saw the most" does, without its blind spots. Its error: where the observer
changes, the two agents' counters trail the truth by different amounts (each at most
one heartbeat interval, 2 s here), once per change.

The comparison (:func:`compare`) is relative: the metric's goodput (productive
seconds over the span the scrapes cover) within ``tolerance`` (2 %) of the bench's
(kept step time over the wall time, from the workers' progress file). The counters
trail the truth by up to one heartbeat interval at each end of the window (and by a
restart's tail while it waits for the next round's first step: agent.goodput): over
the default 600 s that is at most 0.7 % either way, over a 90 s smoke run up to 4 %.
The 2 % check is meant for full runs; a smoke run shows that the comparison works.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from agent.goodput import Kind
from agent.lifecycle import AgentState

SCRAPE_EVERY_S = 1.0
SCRAPE_TIMEOUT_S = 0.5  # a frozen agent does not answer: it is skipped
TOLERANCE = 0.02
KINDS = tuple(k.value for k in Kind)
LOST = (Kind.REPEATED.value, Kind.RECOVERY.value)


@dataclass(frozen=True)
class AgentSample:
    """One agent's answer: whether its node runs the job's workers, and its
    goodput seconds by (kind, cause)."""

    running: bool
    seconds: dict[tuple[str, str], float]


def parse(text: str) -> AgentSample:
    """An agent's /metrics text as an :class:`AgentSample`."""
    seconds: dict[tuple[str, str], float] = {}
    running = False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "elasticd_goodput_seconds_total":
                seconds[(s.labels["kind"], s.labels["cause"])] = s.value
            elif s.name == "elasticd_agent_state" \
                    and s.labels.get("state") == AgentState.RUNNING.value:
                running = s.value == 1
    return AgentSample(running, seconds)


def fetch(url: str) -> AgentSample | None:
    """The agent at ``url``'s sample; None when it does not answer in time."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:
            return parse(resp.read().decode())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class Scraper:
    """Scrapes the agents now alive (``watch``/``forget``) every
    :data:`SCRAPE_EVERY_S` from a thread of its own; ``rounds`` lists
    ``(epoch time, {agent name: sample})``, one per pass."""

    def __init__(self) -> None:
        self.rounds: list[tuple[float, dict[str, AgentSample]]] = []
        self._agents: dict[int, tuple[str, str]] = {}  # node -> (agent name, url)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="goodput-scraper", daemon=True)
        self._thread.start()

    def watch(self, node: int, name: str, url: str) -> None:
        with self._lock:
            self._agents[node] = (name, url)

    def forget(self, node: int) -> None:
        with self._lock:
            self._agents.pop(node, None)

    def scrape_now(self) -> None:
        """One pass at once (before a node is killed: its counters' last word)."""
        with self._lock:
            agents = list(self._agents.values())
        t = time.time()
        got = {name: s for name, url in agents if (s := fetch(url)) is not None}
        with self._lock:
            self.rounds.append((t, got))

    def _run(self) -> None:
        while not self._stop.wait(SCRAPE_EVERY_S):
            self.scrape_now()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _observer(current: str | None, candidates: list[str],
              running: Callable[[str], bool]) -> str:
    """Whose increments count: the current observer while its node runs the
    job; else another whose node does; else the current one, or any."""
    in_job = [a for a in candidates if running(a)]
    if current in in_job:
        return current
    if in_job:
        return in_job[0]
    return current if current in candidates else candidates[0]


def merge(rounds: list[tuple[float, dict[str, AgentSample]]], t_start: float,
          t_end: float) -> dict:
    """The job's goodput seconds in [t_start, t_end], from the scrape ``rounds``.

    The time is counted up to the last round an observer answered in; the next
    interval is the increments of an agent that answered then and now (an
    observer that misses scrapes, loaded or frozen, covers the gap when it
    answers again). When every agent that answered then never answers again
    (they died or were replaced), the gap up to now is unobserved and counting
    starts again from now."""
    window = sorted((r for r in rounds if t_start <= r[0] <= t_end), key=lambda r: r[0])
    totals: dict[tuple[str, str], float] = {}
    observer, changes, unobserved = None, 0, 0.0
    last: dict[str, tuple[float, AgentSample]] = {}  # each agent's latest answer
    last_answer = {a: t for t, got in window for a in got}  # each agent's very last
    counted_until: float | None = None
    trace: list[list] = []  # per interval counted: [time, observer, seconds by kind...]
    for t, got in window:
        before = dict(last)
        last.update((a, (t, sample)) for a, sample in got.items())
        if counted_until is None:
            counted_until = t
            continue
        both = sorted(a for a in got if a in before and before[a][0] == counted_until)
        if not both:
            if not any(last_answer[a] > counted_until for a, (seen, _) in before.items()
                       if seen == counted_until):
                # Every agent that answered then is gone for good: nobody saw this gap.
                unobserved += t - counted_until
                counted_until, observer = t, None
            continue
        chosen = _observer(observer, both, lambda a: before[a][1].running or got[a].running)
        changes += observer is not None and chosen != observer
        observer = chosen
        old = before[chosen][1].seconds
        step = {k: 0.0 for k in KINDS}
        for key, value in got[chosen].seconds.items():
            delta = max(0.0, value - old.get(key, 0.0))
            totals[key] = totals.get(key, 0.0) + delta
            step[key[0]] = step.get(key[0], 0.0) + delta
        trace.append([round(t, 3), chosen, *(round(step[k], 3) for k in KINDS)])
        counted_until = t
    span = window[-1][0] - window[0][0] if len(window) > 1 else 0.0
    by_kind = {k: sum(v for (kind, _), v in totals.items() if kind == k) for k in KINDS}
    lost: dict[str, float] = {}
    for (kind, cause), v in totals.items():
        if kind in LOST and v > 0:
            lost[cause] = lost.get(cause, 0.0) + v
    productive = by_kind[Kind.PRODUCTIVE.value]
    return {"span_s": round(span, 1), "goodput": round(productive / span, 4)
            if span > 0 else None, **{f"{k}_s": round(v, 1) for k, v in by_kind.items()},
            "lost_by_cause": {c: round(v, 1) for c, v in sorted(lost.items())},
            "observer_changes": changes, "unobserved_s": round(unobserved, 1),
            "scrapes": len(window), "trace": trace}


def compare(metric_goodput: float | None, bench_goodput: float | None,
            tolerance: float = TOLERANCE) -> dict:
    """The metric's goodput next to the bench's: the difference and whether it
    is within ``tolerance`` of the bench's, relatively."""
    if metric_goodput is None or not bench_goodput:
        return {"difference": None, "relative": None, "met": False}
    diff = metric_goodput - bench_goodput
    return {"difference": round(diff, 4), "relative": round(diff / bench_goodput, 4),
            "met": abs(diff) <= tolerance * bench_goodput}
