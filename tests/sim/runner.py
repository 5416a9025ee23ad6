"""Run many seeds over a pool of processes and summarise them."""

from __future__ import annotations

import collections
import functools
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable

from tests.sim.cluster import run

REPLAY = "python -m tests.sim --seed {seed} -v"


def replay_command(seed: int, profile: str = "mixed") -> str:
    """The command that replays ``seed`` of ``profile`` with every agent's log."""
    command = REPLAY.format(seed=seed)
    return command if profile == "mixed" else f"{command} --profile {profile}"


def _chunk(seeds: list[int], profile: str = "mixed") -> list[tuple[int, bool, str, str]]:
    out = []
    for seed in seeds:
        r = run(seed, profile=profile)
        out.append((seed, r.ok, r.outcome, "; ".join(r.violations)))
    return out


@dataclass
class Summary:
    runs: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[tuple[int, str]] = field(default_factory=list)
    profile: str = "mixed"

    def describe(self, seconds: float) -> str:
        of = "" if self.profile == "mixed" else f" of profile {self.profile}"
        lines = [f"{self.runs} schedules{of} in {seconds:.1f} s: "
                 + ", ".join(f"{k or 'no outcome'} {v}" for k, v in sorted(self.outcomes.items()))
                 + f"; {len(self.failures)} failed"]
        for seed, why in self.failures[:20]:
            lines.append(f"seed {seed}: {why[:300]}\n  replay: {replay_command(seed, self.profile)}")
        return "\n".join(lines)


def run_many(seeds: Iterable[int], *, jobs: int = 2, chunk: int = 50,
             profile: str = "mixed") -> Summary:
    seeds = list(seeds)
    chunks = [seeds[i:i + chunk] for i in range(0, len(seeds), chunk)]
    summary = Summary(profile=profile)
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for results in pool.map(functools.partial(_chunk, profile=profile), chunks):
            for seed, ok, outcome, why in results:
                summary.runs += 1
                summary.outcomes[outcome] += 1
                if not ok:
                    summary.failures.append((seed, why))
    return summary
