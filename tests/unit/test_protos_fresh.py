"""The committed generated protobuf code is what protos/ generates now (`make protos`)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gen_protos.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gen_protos", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        "generated protobuf code under elastic/v1/ is stale; run `make protos`\n"
        + result.stdout + result.stderr
    )


def test_check_detects_edited_missing_and_orphaned_files(tmp_path):
    gen = _load_script()
    protos = gen.find_protos()
    assert Path("elastic/v1/agent.proto") in protos

    fresh = tmp_path / "fresh"
    gen.generate(fresh, protos)
    assert gen.stale_files(fresh, fresh, protos) == []

    tree = tmp_path / "tree"
    shutil.copytree(fresh, tree)
    pb2 = tree / "elastic/v1/agent_pb2.py"
    pb2.write_text(pb2.read_text() + "# edited by hand\n")
    (tree / "elastic/v1/agent_pb2.pyi").unlink()
    (tree / "elastic/v1/old_pb2_grpc.py").write_text("")

    assert sorted(gen.stale_files(tree, fresh, protos)) == [
        (Path("elastic/v1/agent_pb2.py"), "differs"),
        (Path("elastic/v1/agent_pb2.pyi"), "missing"),
        (Path("elastic/v1/old_pb2_grpc.py"), "no longer generated"),
    ]


def test_generated_modules_import():
    from elastic.v1 import agent_pb2, agent_pb2_grpc

    assert agent_pb2.DESCRIPTOR.package == "elastic.v1"
    assert hasattr(agent_pb2_grpc, "add_WorkerChannelServicer_to_server")
