#!/usr/bin/env python3
"""Generate the Python gRPC code of ``protos/``: the agent's services and etcd's API.

Usage (from anywhere; paths are relative to the repository root)::

    python tools/gen_protos.py --install  # make the generator's venv (``make setup``)
    python tools/gen_protos.py            # regenerate the *_pb2*.py* files (``make protos``)
    python tools/gen_protos.py --check    # exit 1 and list stale files, change nothing

Every ``.proto`` under ``protos/`` is compiled with ``grpc_tools.protoc`` and
``-Iprotos``, so ``protos/elastic/v1/agent.proto`` becomes the modules
``elastic/v1/agent_pb2.py``, ``agent_pb2_grpc.py`` and ``agent_pb2.pyi`` in the
repository root, and ``protos/elastic/store/etcdpb/rpc.proto`` the modules of
``elastic/store/etcdpb``. Generated files that no ``.proto`` produces any more
are deleted (or, with ``--check``, reported). Hand-written files such as the
packages' ``__init__.py`` are never touched.

The generator is the ``grpcio-tools`` pinned in ``tools/protoc-requirements.txt``
(the oldest runtimes the generated code loads on follow from it; that file says
which), and it runs from a virtual environment of its own, ``protoc/`` inside
the environment running this script (``--generator-venv`` names another):
grpcio-tools caps protobuf below its own major version, so installed beside the
project it would hold the project's protobuf back. ``--install`` creates it.

Exit codes: 0 up to date / regenerated / installed, 1 stale (``--check``),
2 the generator is missing, is not the pinned version, or failed.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATOR_REQUIREMENTS = ROOT / "tools" / "protoc-requirements.txt"
GENERATOR_PACKAGE = "grpcio-tools"
# The suffixes protoc writes for one proto: --python_out, --pyi_out, --grpc_python_out.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

EXIT_FRESH = 0
EXIT_STALE = 1
EXIT_GENERATOR_FAILED = 2

_PIN = re.compile(rf"^\s*{re.escape(GENERATOR_PACKAGE)}\s*==\s*([0-9][^\s;#]*)", re.MULTILINE)
_LIBPROTOC = re.compile(r"libprotoc (\d+)\.(\d+)(?:\.(\d+))?")


class GeneratorError(RuntimeError):
    """The generator is missing, is not the pinned version, or failed; the message says what to do."""


def default_generator_venv() -> Path:
    """``protoc/`` inside the running environment: ``.venv/protoc`` under ``make``."""
    return Path(sys.prefix) / "protoc"


def generator_python(venv: Path) -> Path:
    """The interpreter of the generator's virtual environment ``venv``."""
    return venv / "bin" / "python"


def pinned_generator(requirements: Path = GENERATOR_REQUIREMENTS) -> str:
    """The grpcio-tools version ``requirements`` pins with ``==``.

    Raises ``GeneratorError`` when the file does not pin exactly one.
    """
    pins = _PIN.findall(requirements.read_text())
    if len(pins) != 1:
        raise GeneratorError(
            f"{requirements} must pin {GENERATOR_PACKAGE} exactly once with '==' (found {len(pins)})"
        )
    return pins[0]


def installed_generator(python: Path) -> str | None:
    """The grpcio-tools version installed for ``python``; None when ``python`` or it is missing."""
    if not python.is_file():
        return None
    result = subprocess.run(
        [str(python), "-c",
         f"import importlib.metadata as m; print(m.version({GENERATOR_PACKAGE!r}))"],
        capture_output=True, text=True, check=False,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def require_generator(venv: Path, requirements: Path = GENERATOR_REQUIREMENTS) -> Path:
    """The interpreter of ``venv`` once it is checked to hold the pinned grpcio-tools.

    Raises ``GeneratorError`` saying how to install it when it does not.
    """
    pinned = pinned_generator(requirements)
    python = generator_python(venv)
    found = installed_generator(python)
    if found is None:
        raise GeneratorError(
            f"no {GENERATOR_PACKAGE} in {venv}; run `make setup`"
            f" (or `python tools/gen_protos.py --install`)"
        )
    if found != pinned:
        raise GeneratorError(
            f"{venv} has {GENERATOR_PACKAGE} {found}, {requirements.name} pins {pinned};"
            " run `make setup` (or `python tools/gen_protos.py --install`)"
        )
    return python


def install_generator(venv: Path, requirements: Path = GENERATOR_REQUIREMENTS) -> bool:
    """Create ``venv`` holding the pinned grpcio-tools unless it already does.

    Returns True when something was installed. Raises ``GeneratorError`` with
    pip's output when the installation fails.
    """
    python = generator_python(venv)
    if installed_generator(python) == pinned_generator(requirements):
        return False
    steps = []
    if not python.is_file():
        steps.append([sys.executable, "-m", "venv", str(venv)])
    steps.append([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  "-r", str(requirements)])
    for cmd in steps:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise GeneratorError(
                f"{' '.join(cmd)} failed with exit code {result.returncode}:\n"
                f"{result.stdout}{result.stderr}"
            )
    require_generator(venv, requirements)
    return True


def protoc_release(python: Path) -> tuple[int, int]:
    """(minor, patch) of the protoc run by ``python``, the numbering protobuf's runtimes share.

    ``libprotoc 3.21.6`` is (21, 6), the protoc of protobuf-python 4.21.6;
    ``libprotoc 26.1`` is (26, 1), that of 5.26.1. Raises ``GeneratorError``
    when protoc does not run or prints no version.
    """
    result = subprocess.run([str(python), "-m", "grpc_tools.protoc", "--version"],
                            capture_output=True, text=True, check=False)
    match = _LIBPROTOC.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise GeneratorError(f"protoc --version printed {result.stdout!r}{result.stderr!r}")
    major, minor, patch = (int(part) if part else 0 for part in match.groups())
    # Up to release 21 protoc was numbered 3.x.y; from 22 on it is x.y.
    return (minor, patch) if major == 3 else (major, minor)


def find_protos(proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Every ``.proto`` under ``proto_dir``, relative to it, sorted."""
    return sorted(p.relative_to(proto_dir) for p in proto_dir.rglob("*.proto"))


def expected_outputs(protos: list[Path]) -> list[Path]:
    """The generated files (relative to the root) that ``protos`` produce."""
    return sorted(
        proto.with_name(proto.stem + suffix) for proto in protos for suffix in GENERATED_SUFFIXES
    )


def generate(out_dir: Path, protos: list[Path], python: Path) -> None:
    """Run the protoc of interpreter ``python`` on ``protos``, writing under ``out_dir``.

    Raises ``GeneratorError`` with protoc's output when it fails.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    # A subprocess keeps protoc's global state and its messages out of this process.
    cmd = [
        str(python), "-m", "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(PROTO_DIR / proto) for proto in protos),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise GeneratorError(
            f"protoc failed with exit code {result.returncode}:\n{result.stdout}{result.stderr}"
        )


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


def _write(stale: list[tuple[Path, str]], generated: Path) -> None:
    # Only rewrite what changed, so untouched files keep their mtimes.
    for rel, why in stale:
        target = ROOT / rel
        if why == "no longer generated":
            target.unlink()
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(generated / rel, target)
        print(f"gen_protos: {rel}: {'removed' if why == 'no longer generated' else 'written'}")


def main(argv: list[str] | None = None) -> int:
    """Regenerate (default), check (``--check``) or install the generator; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check", action="store_true",
        help="generate into a temporary directory and exit 1 listing files that are stale",
    )
    mode.add_argument(
        "--install", action="store_true",
        help=f"create the generator's virtual environment from {GENERATOR_REQUIREMENTS.name}",
    )
    parser.add_argument(
        "--generator-venv", type=Path, default=default_generator_venv(),
        help="the generator's virtual environment (default: %(default)s)",
    )
    args = parser.parse_args(argv)

    try:
        if args.install:
            if install_generator(args.generator_venv):
                print(f"gen_protos: installed {GENERATOR_PACKAGE} "
                      f"{pinned_generator()} in {args.generator_venv}")
            return EXIT_FRESH
        python = require_generator(args.generator_venv)
    except GeneratorError as exc:
        print(f"gen_protos: {exc}", file=sys.stderr)
        return EXIT_GENERATOR_FAILED

    protos = find_protos()
    if not protos:
        print(f"gen_protos: no .proto files under {PROTO_DIR}", file=sys.stderr)
        return EXIT_GENERATOR_FAILED

    with tempfile.TemporaryDirectory(prefix="gen_protos-") as tmp:
        generated = Path(tmp)
        try:
            generate(generated, protos, python)
        except GeneratorError as exc:
            print(f"gen_protos: {exc}", file=sys.stderr)
            return EXIT_GENERATOR_FAILED
        stale = stale_files(ROOT, generated, protos)

        if not args.check:
            _write(stale, generated)
            return EXIT_FRESH
        if not stale:
            return EXIT_FRESH
        print(
            f"gen_protos: generated protobuf code is stale (compared with {GENERATOR_PACKAGE}"
            f" {pinned_generator()}); run `make protos`:",
            file=sys.stderr,
        )
        for rel, why in stale:
            print(f"  {rel} ({why})", file=sys.stderr)
        return EXIT_STALE


if __name__ == "__main__":
    sys.exit(main())
