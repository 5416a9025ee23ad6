#!/usr/bin/env python3
"""Generate the Python gRPC code of the agent's services from ``protos/``.

Usage (from anywhere; paths are relative to the repository root)::

    python tools/gen_protos.py           # regenerate elastic/v1/*_pb2*.py*  (``make protos``)
    python tools/gen_protos.py --check   # exit 1 and list stale files, change nothing

Every ``.proto`` under ``protos/`` is compiled with ``grpc_tools.protoc`` and
``-Iprotos``, so ``protos/elastic/v1/agent.proto`` becomes the modules
``elastic/v1/agent_pb2.py``, ``agent_pb2_grpc.py`` and ``agent_pb2.pyi`` in
the repository root. Generated files that no ``.proto`` produces any more are
deleted (or, with ``--check``, reported). Hand-written files such as
``elastic/v1/__init__.py`` are never touched.

The output depends on the installed ``grpcio-tools`` (it stamps its protoc
and gRPC versions into the files), so regenerate and check with the version
the project pins.

Exit codes: 0 up to date / regenerated, 1 stale (``--check``), 2 protoc failed.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
# The suffixes protoc writes for one proto: --python_out, --pyi_out, --grpc_python_out.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

EXIT_FRESH = 0
EXIT_STALE = 1
EXIT_PROTOC_FAILED = 2


def find_protos(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Every ``.proto`` under ``proto_dir``, relative to it, sorted."""
    return sorted(p.relative_to(proto_dir) for p in proto_dir.rglob("*.proto"))


def expected_outputs(protos: list[Path]) -> list[Path]:
    """The generated files (relative to the root) that ``protos`` produce."""
    return sorted(
        proto.with_name(proto.stem + suffix) for proto in protos for suffix in GENERATED_SUFFIXES
    )


def generate(out_dir: Path, protos: list[Path]) -> None:
    """Run protoc on ``protos`` and write the generated files under ``out_dir``.

    Raises ``RuntimeError`` with protoc's output when it fails.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # A subprocess keeps protoc's global state and its messages out of this process.
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / proto) for proto in protos),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"protoc failed with exit code {result.returncode}:\n{result.stdout}{result.stderr}"
        )


def _tool_versions() -> str:
    try:
        from grpc_tools import grpc_version  # noqa: PLC0415 (only needed in messages)

        return f"grpcio-tools {grpc_version.VERSION}"
    except ImportError:
        return "grpcio-tools (version unknown)"


def _orphans(root: Path, protos: list[Path]) -> list[Path]:
    """Generated-looking files in the output packages that no proto produces."""
    expected = set(expected_outputs(protos))
    found = set()
    for package in {proto.parent for proto in protos}:
        directory = root / package
        if not directory.is_dir():
            continue
        for path in directory.iterdir():
            if path.is_file() and path.name.endswith(GENERATED_SUFFIXES):
                found.add(path.relative_to(root))
    return sorted(found - expected)


def stale_files(root: Path, generated: Path, protos: list[Path]) -> list[tuple[Path, str]]:
    """Files under ``root`` that differ from those freshly generated in ``generated``.

    Returns (path relative to the root, why) pairs: "differs", "missing" or
    "no longer generated".
    """
    stale: list[tuple[Path, str]] = []
    for rel in expected_outputs(protos):
        target = root / rel
        if not target.is_file():
            stale.append((rel, "missing"))
        elif not filecmp.cmp(generated / rel, target, shallow=False):
            stale.append((rel, "differs"))
    stale.extend((rel, "no longer generated") for rel in _orphans(root, protos))
    return stale


def main(argv: list[str] | None = None) -> int:
    """Regenerate (default) or check (``--check``) the generated code; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true",
        help="generate into a temporary directory and exit 1 listing files that are stale",
    )
    args = parser.parse_args(argv)

    protos = find_protos()
    if not protos:
        print(f"gen_protos: no .proto files under {PROTO_DIR}", file=sys.stderr)
        return EXIT_PROTOC_FAILED

    with tempfile.TemporaryDirectory(prefix="gen_protos-") as tmp:
        generated = Path(tmp)
        try:
            generate(generated, protos)
        except RuntimeError as exc:
            print(f"gen_protos: {exc}", file=sys.stderr)
            return EXIT_PROTOC_FAILED
        stale = stale_files(ROOT, generated, protos)

        if args.check:
            if not stale:
                return EXIT_FRESH
            print(
                f"gen_protos: generated protobuf code is stale (compared with {_tool_versions()});"
                " run `make protos`:",
                file=sys.stderr,
            )
            for rel, why in stale:
                print(f"  {rel} ({why})", file=sys.stderr)
            return EXIT_STALE

        # Only rewrite what changed, so untouched files keep their mtimes.
        for rel, why in stale:
            target = ROOT / rel
            if why == "no longer generated":
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(generated / rel, target)
            print(f"gen_protos: {rel}: {'removed' if why == 'no longer generated' else 'written'}")
    return EXIT_FRESH


if __name__ == "__main__":
    sys.exit(main())
