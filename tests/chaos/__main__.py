"""Run a chaos campaign against real elasticd agents in network namespaces.

    python -m tests.chaos --seed 7 --faults 16 [--variant fixed|elastic|memory]
    make chaos SEED=7 FAULTS=16 VARIANT=memory

Needs root for the namespaces and the checkpoint tmpfs (without, it falls
back to loopback and skips the network and disk faults, saying so). Prints a
summary: the faults by kind, the invariants, the recovery time per kind (from
the fault to the first step of the next round); on failure the seed, a
one-line replay command and the kept working directory (agents' logs, step
logs, etcd logs; the checkpoints' tmpfs is unmounted). Exit code 0 when every
invariant held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys

from tests.chaos.campaign import VARIANTS, Report, run_campaign
from tests.chaos.faults import KINDS
from tests.chaos.invariants import summarize_times


def render(report: Report) -> str:
    lines = [f"== chaos campaign: seed {report.seed}, variant {report.variant}, "
             f"{len(report.faults)}/{len(report.planned)} faults injected in "
             f"{report.duration_s:.0f} s", f"topology: {report.topology}"]
    if report.skipped_kinds:
        lines.append(f"skipped (need namespaces or a checkpoint tmpfs, i.e. root): "
                     f"{', '.join(report.skipped_kinds)}")
    by_kind = collections.Counter(f.kind for f in report.faults)
    lines.append("faults by kind:")
    for kind in KINDS:
        if kind in by_kind or kind in report.planned:
            lines.append(f"  {kind:20s} {by_kind.get(kind, 0):2d}   recovery "
                         f"{summarize_times(report.recovery.get(kind, []))}")
    lines.append("invariants:")
    for c in report.checks:
        lines.append(f"  [{'PASS' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    for f in report.faults:
        for p in f.problems:
            lines.append(f"  [FAIL] {f.kind} ({f.target}): {p}")
    for e in report.errors:
        lines.append(f"  [FAIL] {e}")
    if report.ok:
        lines.append("RESULT: PASS")
    else:
        lines.append(f"RESULT: FAIL (seed {report.seed}); replay: {report.replay()}")
        lines.append(f"logs kept in {report.workdir}")
        if report.tails:
            lines.append(report.tails)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=len(KINDS),
                    help=f"faults to inject (default {len(KINDS)}: every kind once)")
    ap.add_argument("--variant", choices=VARIANTS, default="fixed",
                    help="fixed: --nnodes 3 (with the weights oracle); elastic: --nnodes 2:3; "
                         "memory: fixed with --memory-tier (the weights oracle, and each "
                         "restart at most MEMORY_EVERY steps behind)")
    ap.add_argument("--kinds", default=None,
                    help=f"comma-separated subset of: {', '.join(KINDS)}")
    ap.add_argument("--lease-ttl", type=float, default=3.0, help="elasticd --lease-ttl (s)")
    ap.add_argument("--hang-timeout", type=float, default=4.0, help="elasticd --hang-timeout (s)")
    ap.add_argument("--loopback", action="store_true", help="skip namespaces (and net faults)")
    ap.add_argument("--workdir", default=None, help="keep everything here")
    ap.add_argument("--keep", action="store_true", help="keep the working directory on success")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    kinds = args.kinds.split(",") if args.kinds else None
    unknown = [k for k in kinds or [] if k not in KINDS]
    if unknown:
        ap.error(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
    report = run_campaign(args.seed, args.faults, args.variant, kinds=kinds,
                          loopback=args.loopback, workdir=args.workdir, keep=args.keep,
                          lease_ttl_s=args.lease_ttl, hang_timeout_s=args.hang_timeout,
                          say=lambda m: print(m, flush=True))
    print(render(report), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
