"""The layering rules hold for the whole tree (tools/layers.py): no module reads another
module's private names, no import circle (``TYPE_CHECKING`` imports included), and the
library (``elastic``) never imports the agent. Planted trees show that each check sees
what it guards."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("layers", ROOT / "tools" / "layers.py")
layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers)


def test_no_module_reads_another_modules_private_names():
    assert layers.private_reaches() == []


def test_no_import_circle():
    assert layers.import_circles(layers.import_graph()) == []


def test_the_library_never_imports_the_agent():
    assert layers.upward_imports(layers.import_graph()) == []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_planted_reaches_are_found_and_own_privates_are_not(tmp_path):
    root = _tree(tmp_path, {
        "elastic/__init__.py": "",
        "elastic/a.py": """
            class Box:
                def __init__(self):
                    self._inside = 1

                def same(self, other):
                    return other._inside == self._inside
            def _helper():
                return 2
            """,
        "tests/test_a.py": """
            from elastic.a import _helper
            from elastic import a

            def test_it():
                box = a.Box()
                return box._inside, a._helper(), box._replace
            """,
    })
    assert sorted(layers.private_reaches(root)) == [
        "tests/test_a.py:2: imports elastic.a._helper",
        "tests/test_a.py:7: reads ._helper of a",
        "tests/test_a.py:7: reads ._inside of box",
    ]


def test_planted_circle_and_upward_import_are_found(tmp_path):
    root = _tree(tmp_path, {
        "elastic/__init__.py": "",
        "elastic/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from elastic import y\n",
        "elastic/y.py": "from elastic.x import thing\nimport agent.daemon\n",
        "agent/__init__.py": "",
        "agent/daemon.py": "from . import reactor\n",
        "agent/reactor.py": "from agent import daemon\n",
    })
    graph = layers.import_graph(root)
    assert sorted(layers.import_circles(graph)) == [["agent.daemon", "agent.reactor"],
                                                     ["elastic.x", "elastic.y"]]
    assert layers.upward_imports(graph) == ["elastic.y imports agent.daemon"]
