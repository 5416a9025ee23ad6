"""Run simulated fault schedules: ``python -m tests.sim --seeds 10000`` or
replay one, with every agent's log: ``python -m tests.sim --seed 1234 -v``;
``--profile budget``, ``--profile partition`` or ``--profile memory`` for the
other profiles."""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.runner import run_many
from tests.sim.cluster import PROFILES, run


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__)
    p.add_argument("--seed", type=int, help="replay this one seed")
    p.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--profile", choices=PROFILES, default="mixed",
                   help="which clusters and fault schedules (default: mixed)")
    p.add_argument("-v", "--verbose", action="store_true", help="print faults and agent logs")
    args = p.parse_args()
    if args.seed is not None:
        import logging
        if args.verbose:
            logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
        result = run(args.seed, verbose=args.verbose, profile=args.profile)
        print(f"seed {args.seed}: {'ok' if result.ok else 'FAILED'}; outcome {result.outcome or '-'}"
              f" ({result.reason}); rounds {result.rounds}; committed step "
              f"{result.steps_committed}")
        for fault in result.schedule:
            print(f"  {fault}")
        if result.memory:
            print(f"  memory tier: {result.memory}; {result.restored_from_memory} restore(s) "
                  "from memory")
        for violation in result.violations:
            print(f"  VIOLATION: {violation}")
        return 0 if result.ok else 1
    started = time.monotonic()
    summary = run_many(range(args.first, args.first + args.seeds), jobs=args.jobs,
                       profile=args.profile)
    print(summary.describe(time.monotonic() - started))
    return 0 if not summary.failures else 1


if __name__ == "__main__":
    sys.exit(main())
