#!/usr/bin/env python3
"""Print pip constraints pinning every dependency in pyproject.toml to its lower bound.

Usage (``make test-oldest`` runs it)::

    python tools/floor_constraints.py --skip torch > constraints.txt
    pip install -c constraints.txt -e '.[embedded,dev]'

The floors come from ``[project] dependencies`` and every group of
``[project.optional-dependencies]``: ``grpcio>=1.49.1,<2`` becomes
``grpcio==1.49.1``, and an exact pin stays as it is. A requirement without a
lower bound is an error, since its oldest allowed version could not be tested.
``--skip`` leaves packages out: torch's floor would be a CUDA build from the
network, so ``make test-oldest`` installs the pinned CPU build first.

Exit codes: 0 printed, 2 a requirement has no usable lower bound.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
# The operators whose version is the oldest one a requirement admits.
_LOWER_BOUND_OPERATORS = frozenset({">=", "==", "~="})

EXIT_OK = 0
EXIT_NO_FLOOR = 2


class NoFloorError(ValueError):
    """A requirement admits no single oldest version (no ``>=``, ``==`` or ``~=``)."""


def requirements(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """Every requirement of the project and of all its optional groups, in file order."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        lines.extend(group)
    return [Requirement(line) for line in lines]


def floor(requirement: Requirement) -> Version:
    """The oldest version ``requirement`` admits.

    Raises ``NoFloorError`` when it has no lower bound, or when that bound is
    excluded by the requirement's own other clauses.
    """
    bounds = [Version(spec.version) for spec in requirement.specifier
              if spec.operator in _LOWER_BOUND_OPERATORS]
    if not bounds:
        raise NoFloorError(
            f"{requirement} has no lower bound: add '>=' with the oldest version it works with"
        )
    oldest = max(bounds)
    if not requirement.specifier.contains(oldest, prereleases=True):
        raise NoFloorError(f"{requirement}: its lower bound {oldest} is excluded by its other clauses")
    return oldest


def floors(pyproject: Path = PYPROJECT, skip: frozenset[str] = frozenset()) -> dict[str, Version]:
    """Package name (canonical) -> the oldest version pyproject allows, less ``skip``.

    A package required in several places gets the highest of its floors.
    Raises ``NoFloorError`` as :func:`floor` does.
    """
    skipped = {canonicalize_name(name) for name in skip}
    result: dict[str, Version] = {}
    for requirement in requirements(pyproject):
        name = canonicalize_name(requirement.name)
        if name in skipped:
            continue
        oldest = floor(requirement)
        result[name] = max(oldest, result.get(name, oldest))
    return result


def main(argv: list[str] | None = None) -> int:
    """Print the constraints; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", action="append", default=[], metavar="PACKAGE",
                        help="leave PACKAGE out (repeatable)")
    args = parser.parse_args(argv)
    try:
        pins = floors(skip=frozenset(args.skip))
    except NoFloorError as exc:
        print(f"floor_constraints: {exc}", file=sys.stderr)
        return EXIT_NO_FLOOR
    print(f"# The lower bounds of {PYPROJECT.name}, made by tools/floor_constraints.py.")
    for name, version in sorted(pins.items()):
        print(f"{name}=={version}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
