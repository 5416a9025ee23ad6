"""Check the layering rules a redesign must keep: no private reach, no import circle,
no lower layer importing a higher one.

**Private reaches.** A name that starts with one underscore is private to the module that defines it. Two
kinds of reach are found, by reading each file's syntax tree (nothing is imported):

* ``from elastic.x import _name`` or ``x._name`` where ``x`` is one of our modules;
* ``obj._attr`` where ``obj`` is not ``self``/``cls`` and no code in this same file
  defines ``_attr`` (a ``def _attr``, a ``self._attr = ...`` or a class attribute):
  an object of another module's class, read from outside.

Third-party internals (``sys._getframe``, torch's ``_C``) are another matter with
their own home (``elastic/_compat``); reads on names imported from outside our
packages are not listed, nor are the ``namedtuple`` methods (``_replace``, ``_asdict``).

**Import circles.** Every ``import`` of one of our modules by another, those under
``if TYPE_CHECKING:`` and inside functions included, is an edge; a strongly connected
group of more than one module is a circle.

**Layers.** ``elastic`` (the library workers import, and the layers below the agent)
never imports ``agent``.

    python3 tools/layers.py            # exit 1 and a line per finding, if any
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("elastic", "agent", "tests", "bench", "examples", "tools")
SCANNED = ("elastic", "agent", "tests", "bench", "examples", "tools")
SKIP_DIRS = ("elastic/v1", "elastic/store/etcdpb", "elastic/_compat")
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Third-party internals read on objects whose type the syntax tree cannot tell:
# torch's tensor version counter, argparse's action tables, torchrun's agent method a
# test wraps to record its calls.
THIRD_PARTY_ATTRS = {"_version", "_actions", "_option_string_actions", "_start_workers"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_here(tree: ast.AST) -> set[str]:
    """Private names this file defines: functions, classes, attributes set on any
    object, class-level and module-level assignments, dataclass fields."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _is_private(n)}


def _foreign_names(tree: ast.AST) -> set[str]:
    """Names bound by importing something outside our packages."""
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in OURS:
                    foreign.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in OURS:
                foreign.update(alias.asname or alias.name for alias in node.names)
    return foreign


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def reaches(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: what`` for each private read across modules in one file."""
    tree = ast.parse(path.read_text(), str(path))
    here = _defined_here(tree)
    foreign = _foreign_names(tree)
    rel = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in OURS:
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{rel}:{node.lineno}: imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = _root_name(node.value)
            if root in ("self", "cls") and isinstance(node.value, ast.Name):
                continue
            if node.attr in here or node.attr in NAMEDTUPLE_API | THIRD_PARTY_ATTRS \
                    or root in foreign:
                continue
            if isinstance(node.value, ast.Call) and _root_name(node.value) == "super":
                continue
            found.append(f"{rel}:{node.lineno}: reads .{node.attr} of "
                         f"{ast.unparse(node.value)[:60]}")
    return found


def _our_files(root: Path):
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if any(rel.startswith(d + "/") for d in SKIP_DIRS) or "/.venv" in rel:
                continue
            yield path


def private_reaches(root: Path = ROOT) -> list[str]:
    """Every reach in our packages, tests, benches, examples and tools."""
    return [line for path in _our_files(root) for line in reaches(path, root)]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Our module -> our modules it imports (a package import counts as its __init__)."""
    modules = {_module_name(p, root): p for p in _our_files(root)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted.

    A module importing its own package's ``__init__`` (``from . import x``) is not
    counted as a circle through that package."""
    edges = {m: {t for t in ts if not _is_ancestor(t, m)} for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return circles


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``elastic.x imports agent.y`` for each import of the agent by the library."""
    return [f"{m} imports {t}" for m, ts in sorted(graph.items()) if m.split(".")[0] == "elastic"
            for t in sorted(ts) if t.split(".")[0] == "agent"]


def main() -> int:
    graph = import_graph()
    found = private_reaches()
    found += ["import circle: " + " <-> ".join(c) for c in import_circles(graph)]
    found += upward_imports(graph)
    for line in found:
        print(line)
    print(f"{len(found)} findings", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
