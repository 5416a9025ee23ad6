"""Run many seeds over a pool of processes and summarise them."""

from __future__ import annotations

import collections
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

from tests.sim.cluster import run

REPLAY = "python -m tests.sim --seed {seed} -v"


def _chunk(seeds: list[int]) -> list[tuple[int, bool, str, str]]:
    out = []
    for seed in seeds:
        r = run(seed)
        out.append((seed, r.ok, r.outcome, "; ".join(r.violations)))
    return out


@dataclass
class Summary:
    runs: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)

    def describe(self, seconds: float) -> str:
        lines = [f"{self.runs} schedules in {seconds:.1f} s: "
                 + ", ".join(f"{k or 'no outcome'} {v}" for k, v in sorted(self.outcomes.items()))
                 + f"; {len(self.failures)} failed"]
        for seed, why in self.failures[:20]:
            lines.append(f"seed {seed}: {why[:300]}\n  replay: {REPLAY.format(seed=seed)}")
        return "\n".join(lines)


def run_many(seeds: Iterable[int], *, jobs: int = 2, chunk: int = 50) -> Summary:
    seeds = list(seeds)
    chunks = [seeds[i:i + chunk] for i in range(0, len(seeds), chunk)]
    summary = Summary()
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for results in pool.map(_chunk, chunks):
            for seed, ok, outcome, why in results:
                summary.runs += 1
                summary.outcomes[outcome] += 1
                if not ok:
                    summary.failures.append((seed, why))
    return summary
