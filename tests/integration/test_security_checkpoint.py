"""Attacks on a checkpoint, as someone who can write the checkpoint storage would make
them, against a real worker process that restores it (issue 24, items 1 and 9).

Each case edits the newest committed checkpoint so that one of its pickles calls
``os.system`` when unpickled, and recomputes the manifest's size and CRC-32 (a
CRC is no defence against a person). A fresh Python process then restores it as
a training script does (``Checkpointer(...).restore()``): the command must not
run, and the restore must fail with one CheckpointError that names the function
and says how to allow a type (it never falls back to an older checkpoint in
silence: that would hide the attack). The control case runs the same poisoned
checkpoint with ``ELASTIC_CHECKPOINT_TRUST=1``: the command runs, which shows
the attack is real and the refusal is what stops it.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from elastic import worker_env  # noqa: E402
from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEWEST = layout.step_dir_name(2)

# The worker: what a training script does at start, then one line saying how it went.
WORKER = textwrap.dedent("""
    import sys, torch
    from elastic.checkpoint import Checkpointer
    from elastic.errors import CheckpointError
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ckpt = Checkpointer(sys.argv[1], model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        step = ckpt.restore()
    except CheckpointError as exc:
        print("REFUSED", exc)
        sys.exit(3)
    print("RESTORED", step)
""")


# Two ranks over gloo: save steps 1 and 2; the attacker (here rank 0's process, between
# two barriers) poisons rank 1's state; then both restore and print how it went.
GROUP_WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from elastic.checkpoint import Checkpointer
    from elastic.errors import CheckpointError
    from tests.integration.test_security_checkpoint import NEWEST, poison_rank_state
    root, command, rank, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def checkpointer():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        return Checkpointer(root, model=model, timeout_s=60,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

    saver = checkpointer()
    saver.save(1, data_state={"rank": rank}, async_=False)
    saver.save(2, data_state={"rank": rank}, async_=False)
    saver.close()
    dist.barrier()
    if rank == 0:
        poison_rank_state(f"{root}/{NEWEST}", command, rank=1)
    dist.barrier()
    try:
        step = checkpointer().restore()
    except CheckpointError as exc:
        print("REFUSED", exc, flush=True)
        # Without the group's destructors: the peer's exit races gloo's threads in
        # them (std::terminate, SIGABRT), which is not what the test is about.
        os._exit(3)
    print("RESTORED", step)
""")


class RunsCommand:
    """Unpickling it runs a shell command as the worker."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture
def root(tmp_path, monkeypatch):
    """Two committed checkpoints (steps 1 and 2) of the worker's model."""
    monkeypatch.delenv(worker_env.CHECKPOINT_TRUST, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt.save(1, data_state={"consumed": 8}, async_=False)
    ckpt.save(2, data_state={"consumed": 16}, async_=False)
    ckpt.close()
    return str(tmp_path / "ckpt")


def replace_file(directory: str, name: str, data: bytes) -> None:
    """Write ``data`` as the checkpoint's file ``name`` and make the manifest that
    lists it agree (size and CRC-32), as an attacker would."""
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    manifests, problems = layout.read_manifests(directory)
    assert not problems
    owner = next(m for m in manifests if name in m.files)
    files = dict(owner.files, **{name: layout.bytes_digest(data)})
    layout.write_manifest(directory, dataclasses.replace(owner, files=files))


def poison_rank_state(directory: str, command: str, rank: int = 0) -> None:
    name = layout.rank_state_name(rank)
    record = torch.load(os.path.join(directory, name), weights_only=False)
    record["extras"] = RunsCommand(command)
    buffer = io.BytesIO()
    torch.save(record, buffer)
    replace_file(directory, name, buffer.getvalue())


def poison_metadata(directory: str, command: str) -> None:
    with open(os.path.join(directory, layout.METADATA_FILE), "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta = RunsCommand(command)
    replace_file(directory, layout.METADATA_FILE, pickle.dumps(metadata))


def restore_in_a_worker(root: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PYTHONPATH=REPO, **env)
    for name in (worker_env.AGENT_SOCKET, worker_env.CHECKPOINT_DIR, "ELASTIC_FAILPOINT"):
        environ.pop(name, None)
    environ.setdefault(worker_env.CHECKPOINT_TRUST, "0")
    return subprocess.run([sys.executable, "-c", WORKER, root], env=environ, cwd=REPO,
                          capture_output=True, text=True, timeout=90)


@pytest.mark.parametrize("poison", [poison_rank_state, poison_metadata],
                         ids=["rank-00000.pt", ".metadata"])
def test_a_poisoned_checkpoint_runs_no_command_in_the_worker(root, tmp_path, poison):
    marker = tmp_path / "pwned"
    poison(os.path.join(root, NEWEST), f"touch {marker}")
    result = restore_in_a_worker(root)
    assert not marker.exists(), "the checkpoint ran a command in the worker"
    assert result.returncode == 3, result.stdout + result.stderr
    line = result.stdout.strip()
    assert line.startswith("REFUSED") and NEWEST in line and "AssertionError" not in line
    assert f"{os.system.__module__}.system" in line
    assert "safe_globals" in line and "ELASTIC_CHECKPOINT_TRUST=1" in line


@pytest.mark.parametrize("poison", [poison_rank_state, poison_metadata],
                         ids=["rank-00000.pt", ".metadata"])
def test_the_same_poison_runs_when_the_checkpoint_is_trusted(root, tmp_path, poison):
    # The control: the attack is real, and only the allow-list stops it.
    marker = tmp_path / "pwned"
    poison(os.path.join(root, NEWEST), f"touch {marker}")
    result = restore_in_a_worker(root, ELASTIC_CHECKPOINT_TRUST="1")
    assert marker.exists(), result.stdout + result.stderr
    if poison is poison_rank_state:  # the worker goes on as if nothing happened
        assert result.stdout.strip() == "RESTORED 3"


def run_group(root: str, command: str, tmp_path) -> list[subprocess.CompletedProcess]:
    """Both ranks of a 2-rank job (GROUP_WORKER), each a fresh process, over gloo."""
    store = str(tmp_path / "store")
    environ = dict(os.environ, PYTHONPATH=REPO, ELASTIC_CHECKPOINT_TRUST="0",
                   OMP_NUM_THREADS="1")
    for name in (worker_env.AGENT_SOCKET, worker_env.CHECKPOINT_DIR, "ELASTIC_FAILPOINT"):
        environ.pop(name, None)
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_WORKER, root, command, str(rank),
                               store], env=environ, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError(f"rank {rank} did not end (a hang)") from None
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def test_one_ranks_poisoned_state_fails_the_restore_on_every_rank(tmp_path):
    # Rank 1's file alone is poisoned: rank 0 reads only its own, and must still end
    # with the same outcome (no hang, no rank training on from step 2 alone).
    marker = tmp_path / "pwned"
    results = run_group(str(tmp_path / "ckpt"), f"touch {marker}", tmp_path)
    assert not marker.exists(), "the checkpoint ran a command in the worker"
    told = "\n".join(f"rank {rank} (rc {r.returncode}): {r.stdout}{r.stderr[-2000:]}"
                     for rank, r in enumerate(results))
    # Our line, among what gloo itself prints on stdout on some torch versions.
    lines = [[line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")]
             for r in results]
    for result, (line, *rest) in zip(results, lines):
        assert result.returncode == 3 and line.startswith("REFUSED") and not rest, told
        assert "rank-00001.pt needs " in line and f"{os.system.__module__}.system" in line, told
    assert lines[0][0].startswith("REFUSED rank 0: rank 1: "), told
