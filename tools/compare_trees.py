"""Run one benchmark from two checkouts, interleaved, and print their figures side by side.

A redesign that promises "behaviour unchanged" must also show no regression, and on a
shared, noisy machine only a side-by-side run says that: this tool runs the same bench
command from the tree before the change (``--base``) and from this tree, alternating
which goes first, ``--rounds`` times each, with ``PYTHONPATH`` set to the tree so that
its own ``elastic`` and ``agent`` packages are imported (by the bench and by every
process it starts). Each run writes the bench's ``--json FILE``; the numbers in those
files are flattened to dotted keys (``summary.crash.steady ddp.elasticd.stats.median``)
and, for the keys that match ``--keys`` (a regular expression), the median over the
rounds of each tree is printed with the ratio this/base.

    python3 tools/compare_trees.py --base /tmp/base --keys 'median_s|requests_per_node' \\
        -- bench/rendezvous.py --sizes 256,1024 --repeat 1

Make the base tree with ``git archive REV | tar -x -C DIR`` (it uses this tree's venv).
Exits 1 when a run fails (its output is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def flatten(value, prefix: str = "") -> dict[str, float]:
    """The numbers in a JSON value by dotted path (list items by index); bools skipped."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix] = float(value)
        return out
    for key, child in items:
        out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return out


def run_bench(tree: Path, command: list[str], python: str) -> dict[str, float]:
    """Run ``command`` (a bench script and its arguments) from ``tree``; its figures.

    Raises RuntimeError with the run's output when it exits non-zero."""
    with tempfile.TemporaryDirectory(prefix="compare-trees-") as scratch:
        out_json = os.path.join(scratch, "result.json")
        env = dict(os.environ, PYTHONPATH=str(tree))
        proc = subprocess.run([python, *command, "--json", out_json], cwd=tree, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
        with open(out_json) as f:
            return flatten(json.load(f))


def compare(runs: dict[str, list[dict[str, float]]], pattern: re.Pattern) -> list[str]:
    """Lines of ``key  base-median  this-median  ratio`` for the keys both trees report."""
    keys = sorted({k for r in runs["base"] + runs["this"] for k in r if pattern.search(k)})
    lines = [f"{'figure':70s} {'base':>10s} {'this':>10s} {'this/base':>9s}"]
    for key in keys:
        base = [r[key] for r in runs["base"] if key in r]
        this = [r[key] for r in runs["this"] if key in r]
        if not base or not this:
            continue
        b, t = statistics.median(base), statistics.median(this)
        ratio = f"{t / b:9.3f}" if b else "        -"
        lines.append(f"{key[-70:]:70s} {b:10.4g} {t:10.4g} {ratio}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="the checkout before the change")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (2)")
    ap.add_argument("--keys", default=".", help="regular expression over the flattened keys")
    ap.add_argument("--python", default=sys.executable, help="interpreter for both trees")
    ap.add_argument("--json", default=None, help="also write every run's figures here")
    ap.add_argument("command", nargs="+", help="the bench script and its arguments (after --)")
    args = ap.parse_args(argv)
    if not (args.base / "elastic").is_dir():
        ap.error(f"--base {args.base}: no elastic/ package there (make it with git archive)")
    pattern = re.compile(args.keys)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    trees = {"base": args.base.resolve(), "this": HERE}
    for i in range(args.rounds):
        order = ("base", "this") if i % 2 == 0 else ("this", "base")
        for name in order:
            print(f"round {i + 1}/{args.rounds}: {name} ({trees[name]})", file=sys.stderr,
                  flush=True)
            try:
                runs[name].append(run_bench(trees[name], args.command, args.python))
            except RuntimeError as exc:
                print(exc, file=sys.stderr)
                return 1
    print("\n".join(compare(runs, pattern)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
