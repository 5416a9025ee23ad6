"""A committed checkpoint whose own files lie (manifest, links, its directory) is refused.

A checkpoint's manifest is what restore trusts about its shards (names, sizes,
CRC-32s). Each case below edits the newest of two committed checkpoints so
that its manifest (or what it points at) lies, then restores in one process:
restore must skip it naming the problem, load the previous committed one
intact (nothing lost), and when every committed checkpoint lies, refuse with
CheckpointCorruptError rather than start from scratch or load the lie.

One process, no process group (the Checkpointer's single-rank mode): the
verification and the fallback are the same code on every rank.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from elastic import worker_env  # noqa: E402
from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402
from elastic.errors import CheckpointCorruptError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NEWEST = "step-000000000002"
PREVIOUS = "step-000000000001"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _weights(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _manifest(directory: str) -> dict:
    with open(os.path.join(directory, layout.manifest_name(0))) as f:
        return json.load(f)


def _write_manifest(directory: str, record: dict) -> None:
    with open(os.path.join(directory, layout.manifest_name(0)), "w") as f:
        json.dump(record, f)


def _shard(record: dict) -> str:
    return next(name for name in record["files"] if name.endswith(".distcp"))


def wrong_crc(root, directory, outside):
    record = _manifest(directory)
    digest = record["files"][_shard(record)]
    digest["crc32"] = f"{int(digest['crc32'], 16) ^ 1:08x}"  # the size still matches
    _write_manifest(directory, record)
    return "corrupt: CRC-32"


def wrong_size(root, directory, outside):
    record = _manifest(directory)
    record["files"][_shard(record)]["size"] += 1
    _write_manifest(directory, record)
    return "truncated or overwritten"


def missing_shard(root, directory, outside):
    record = _manifest(directory)
    record["files"]["__9_0.distcp"] = {"size": 10, "crc32": "00000000"}
    _write_manifest(directory, record)
    return "__9_0.distcp: missing"


def shard_outside(root, directory, outside):
    record = _manifest(directory)
    shard = _shard(record)
    record["files"][f"../{PREVIOUS}/{shard}"] = record["files"].pop(shard)
    _write_manifest(directory, record)
    return "not a plain name inside the checkpoint"


def shard_is_a_link(root, directory, outside):
    # The same bytes, so size and CRC-32 match: only the link gives it away.
    record = _manifest(directory)
    shard = os.path.join(directory, _shard(record))
    shutil.copy(shard, os.path.join(outside, "copy"))
    os.unlink(shard)
    os.symlink(os.path.join(outside, "copy"), shard)
    return "not a regular file"


def huge_world(root, directory, outside):
    record = _manifest(directory)
    record["world_size"] = layout.MAX_WORLD_SIZE
    _write_manifest(directory, record)
    return "more rank(s)' manifests are missing"


def nested_manifest(root, directory, outside):
    with open(os.path.join(directory, layout.manifest_name(0)), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    return "nested too deeply"


def infinite_rank(root, directory, outside):
    record = _manifest(directory)
    with open(os.path.join(directory, layout.manifest_name(0)), "w") as f:
        f.write(json.dumps(record).replace('"rank": 0', '"rank": Infinity'))
    return "field 'rank'"


def directory_outside(root, directory, outside):
    # The whole checkpoint, intact, but reached through a link out of the root.
    moved = os.path.join(outside, "moved")
    shutil.move(directory, moved)
    os.symlink(moved, directory)
    return "outside the checkpoint root"


LIES = [wrong_crc, wrong_size, missing_shard, shard_outside, shard_is_a_link, huge_world,
        nested_manifest, infinite_rank, directory_outside]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two committed checkpoints (steps 1 and 2) and the weights of each."""
    os.environ.pop(worker_env.AGENT_SOCKET, None)  # the file commit log, no agent
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, model=model, optimizer=opt, keep=3)
    weights = {}
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ckpt.save(step, async_=False)
        weights[step] = _weights(model)
    ckpt.close()
    return root, weights


def _restore(root: str) -> tuple[int, dict, Checkpointer]:
    model = _model(7)  # other weights: only a restore makes them step 1's or 2's
    ckpt = Checkpointer(root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        return ckpt.restore(), _weights(model), ckpt
    finally:
        ckpt.close()


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lie", LIES, ids=[f.__name__ for f in LIES])
def test_a_lying_checkpoint_is_refused_and_the_previous_one_restored(saved, tmp_path, caplog,
                                                                     lie):
    pristine, weights = saved
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root, symlinks=True)
    outside = str(tmp_path / "outside")
    os.mkdir(outside)
    why = lie(root, os.path.join(root, NEWEST), outside)

    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.restore"):
        start, restored, ckpt = _restore(root)

    assert start == 2 and ckpt.restored_path == os.path.join(root, PREVIOUS)
    assert _equal(restored, weights[1]), "the previous committed checkpoint was not intact"
    refusals = [r.getMessage() for r in caplog.records if NEWEST in r.getMessage()]
    assert any(why in r for r in refusals), refusals
    assert all(f"falling back to {PREVIOUS}" in r for r in refusals) and len(refusals) < 12
    # Nothing committed was lost: the previous checkpoint still verifies.
    assert layout.verify(os.path.join(root, PREVIOUS)) == []


def test_when_every_committed_checkpoint_lies_restore_refuses(saved, tmp_path):
    pristine, _ = saved
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root)
    wrong_crc(root, os.path.join(root, NEWEST), None)
    shard_outside(root, os.path.join(root, PREVIOUS), None)
    with pytest.raises(CheckpointCorruptError, match="none of the committed checkpoints"):
        _restore(root)


def test_an_untouched_copy_restores_the_newest(saved, tmp_path):
    pristine, weights = saved
    root = str(tmp_path / "ckpt")
    shutil.copytree(pristine, root)
    start, restored, _ = _restore(root)
    assert start == 3 and _equal(restored, weights[2])
