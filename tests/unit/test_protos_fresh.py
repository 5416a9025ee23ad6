"""The committed generated protobuf code is what protos/ generates now (`make protos`),
made by a generator no newer than the protobuf and grpcio floors of pyproject.toml."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gen_protos.py"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load("gen_protos")


def test_generated_code_is_fresh():
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (
        "generated protobuf code is stale; run `make protos`\n" + result.stdout + result.stderr
    )


def test_check_detects_edited_missing_and_orphaned_files(tmp_path):
    protos = gen.find_protos()
    assert Path("elastic/v1/agent.proto") in protos
    assert Path("elastic/store/etcdpb/rpc.proto") in protos

    fresh = tmp_path / "fresh"
    gen.generate(fresh, protos, gen.require_generator(gen.default_generator_venv()))
    assert gen.stale_files(fresh, fresh, protos) == []

    tree = tmp_path / "tree"
    shutil.copytree(fresh, tree)
    pb2 = tree / "elastic/store/etcdpb/rpc_pb2.py"
    pb2.write_text(pb2.read_text() + "# edited by hand\n")
    (tree / "elastic/v1/agent_pb2.pyi").unlink()
    (tree / "elastic/store/etcdpb/lock_pb2_grpc.py").write_text("")

    assert sorted(gen.stale_files(tree, fresh, protos)) == [
        (Path("elastic/store/etcdpb/lock_pb2_grpc.py"), "no longer generated"),
        (Path("elastic/store/etcdpb/rpc_pb2.py"), "differs"),
        (Path("elastic/v1/agent_pb2.pyi"), "missing"),
    ]


def test_a_venv_without_the_pinned_generator_is_refused_with_the_fix(tmp_path):
    empty = tmp_path / "no-venv"

    result = subprocess.run([sys.executable, str(SCRIPT), "--check", "--generator-venv", str(empty)],
                            capture_output=True, text=True, timeout=60)

    assert result.returncode == gen.EXIT_GENERATOR_FAILED
    assert f"no grpcio-tools in {empty}; run `make setup`" in result.stderr


def test_the_pin_must_name_one_exact_version(tmp_path):
    requirements = tmp_path / "protoc-requirements.txt"
    requirements.write_text("# comment\ngrpcio-tools==1.49.1  # why\nsetuptools<82\n")
    assert gen.pinned_generator(requirements) == "1.49.1"

    requirements.write_text("grpcio-tools>=1.49\n")
    with pytest.raises(gen.GeneratorError, match="must pin grpcio-tools exactly once with '=='"):
        gen.pinned_generator(requirements)


def test_generator_is_no_newer_than_the_runtime_floors():
    # New gencode on an old runtime is never supported (protobuf's cross-version
    # guarantee; gRPC's plugin likewise): the pinned generator must not outrun the
    # floors that pyproject promises and `make test-oldest` tests.
    floors = _load("floor_constraints").floors()
    python = gen.require_generator(gen.default_generator_venv())

    protoc = gen.protoc_release(python)
    protobuf_floor = floors["protobuf"]
    assert protoc <= (protobuf_floor.minor, protobuf_floor.micro), (
        f"protoc {protoc} is newer than the protobuf floor {protobuf_floor}"
    )
    plugin = Version(gen.pinned_generator())
    for runtime in ("grpcio", "grpcio-health-checking"):
        assert plugin <= floors[runtime], f"grpcio-tools {plugin} > {runtime} floor {floors[runtime]}"


def test_committed_code_demands_no_newer_runtime_than_the_floors():
    # Newer generators stamp the runtime they need into the code, which then refuses
    # to load on an older one: a stamp above a floor breaks the images the floor admits.
    floors = _load("floor_constraints").floors()
    stamps = {
        "protobuf": re.compile(r"ValidateProtobufRuntimeVersion\(\s*[\w.]+,\s*(\d+),\s*(\d+),\s*(\d+),"),
        "grpcio": re.compile(r"GRPC_GENERATED_VERSION = '([^']+)'"),
    }
    for rel in gen.expected_outputs(gen.find_protos()):
        text = (ROOT / rel).read_text()
        for runtime, stamp in stamps.items():
            for match in stamp.finditer(text):
                needs = Version(".".join(match.groups()))
                assert needs <= floors[runtime], (
                    f"{rel} needs {runtime} {needs} at import, above the floor {floors[runtime]}"
                )


def test_generated_modules_import():
    from elastic.store.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
    from elastic.v1 import agent_pb2, agent_pb2_grpc

    assert agent_pb2.DESCRIPTOR.package == "elastic.v1"
    assert hasattr(agent_pb2_grpc, "add_WorkerChannelServicer_to_server")
    assert rpc_pb2.DESCRIPTOR.package == "etcdserverpb"  # etcd's name: it is on the wire
    assert rpc_pb2.RangeResponse.DESCRIPTOR.fields_by_name["kvs"].message_type is (
        kv_pb2.KeyValue.DESCRIPTOR
    )
    assert hasattr(rpc_pb2_grpc, "KVStub")
