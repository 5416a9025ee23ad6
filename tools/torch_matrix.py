#!/usr/bin/env python3
"""Run ``make test-torch`` for several torch versions, one after the other, and print
README.md's "Torch versions" table rows.

Usage::

    python3 tools/torch_matrix.py 2.6.0 2.13.0 2.15.0
    python3 tools/torch_matrix.py --wheels /work/torch-wheels 2.11.0   # dir/<version>/ if it exists

Each version's whole output goes to ``<log-dir>/torch-<version>.log`` (default
``.venv/``); a row says whether the run passed, pytest's counts, how long the tests
took, the date and the command. Building a venv the first time is not counted in the
time (pytest's own duration is).

Exit codes: 0 every version passed, 1 at least one failed.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pytest's last line: "271 passed, 1 warning in 108.15s (0:01:48)", "3 failed, 2 passed in 9.1s"
SUMMARY = re.compile(r"^=*\s*(?P<counts>(\d+ \w+(, )?)+) in (?P<seconds>[\d.]+)s", re.MULTILINE)


def _installed_torch(version: str) -> str:
    """The venv's torch with its local label (``2.11.0+cu130``), or "-" where it has none."""
    python = ROOT / ".venv" / f"torch-{version}" / "bin" / "python"
    try:
        done = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return "-"
    return done.stdout.strip() if done.returncode == 0 else "-"


def run(version: str, wheels: Path | None, log_dir: Path) -> tuple[bool, str]:
    """Run the matrix for one version; returns (passed, its table row)."""
    command = ["make", "test-torch", f"TORCH={version}"]
    if wheels is not None and (wheels / version).is_dir():
        command.append(f"TORCH_WHEELS={wheels / version}")
    log = log_dir / f"torch-{version}.log"
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    summaries = list(SUMMARY.finditer(log.read_text(errors="replace")))
    if summaries:
        counts = summaries[-1].group("counts")
        took = f"{float(summaries[-1].group('seconds')) / 60:.1f} min"
    else:
        counts, took = "no pytest summary (see the log)", "-"
    passed = done.returncode == 0
    build = _installed_torch(version)
    shown = " ".join(c for c in command if not c.startswith("TORCH_WHEELS="))
    row = (f"| {version} | {build} | {'pass' if passed else 'FAIL'} | {counts} | {took} "
           f"| {datetime.date.today().isoformat()} | `{shown}` |")
    return passed, row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="+", metavar="X.Y.Z")
    parser.add_argument("--wheels", type=Path, help="a directory of <version>/ wheel directories")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".venv")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print("| torch | build | result | tests | time | date | command |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = 0
    for version in args.versions:
        passed, row = run(version, args.wheels, args.log_dir)
        failed += not passed
        print(row, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
