"""Item CRC-32s end to end through the Checkpointer: written during the save (nothing
read back), checked item by item as restore reads, and manifests without items (older
checkpoints) still restored and still checked, whole.

One process, no process group (the Checkpointer's single-rank mode), as in
test_lying_checkpoint.py; resharding across processes is in test_checkpoint_reshard.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib

import pytest

torch = pytest.importorskip("torch")

from elastic import worker_env  # noqa: E402
from elastic.checkpoint import checkpointer as checkpointer_module  # noqa: E402
from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NEWEST = "step-000000000002"
PREVIOUS = "step-000000000001"
SHARD = "__0_0.distcp"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # A weight of 300 KB (torch.load reads its storage in one large read) and a small bias.
    return torch.nn.Linear(256, 300)


def _weights(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two committed checkpoints (steps 1 and 2) and the weights of each."""
    os.environ.pop(worker_env.AGENT_SOCKET, None)  # the file commit log, no agent
    root = str(tmp_path_factory.mktemp("saved") / "ckpt")
    model = _model(0)
    opt = torch.optim.Adam(model.parameters())
    ckpt = Checkpointer(root, model=model, optimizer=opt, keep=3)
    weights = {}
    for step in (1, 2):
        model(torch.ones(2, 256)).sum().backward()
        opt.step()
        ckpt.save(step, async_=False)
        weights[step] = _weights(model)
    ckpt.close()
    return root, weights


@pytest.fixture
def root(saved, tmp_path):
    """A copy of the saved checkpoints to damage."""
    copy = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], copy)
    return copy


def _restore(root: str, **kwargs) -> tuple[int, dict, Checkpointer]:
    model = _model(7)  # other weights: only a restore makes them step 1's or 2's
    ckpt = Checkpointer(root, model=model, optimizer=torch.optim.Adam(model.parameters()),
                        **kwargs)
    try:
        return ckpt.restore(), _weights(model), ckpt
    finally:
        ckpt.close()


def _item(directory: str, fqn: str) -> layout.ItemDigest:
    """The manifest's item that DCP's .metadata locates ``fqn`` in."""
    import torch.distributed.checkpoint as dcp

    manifests, problems = layout.read_manifests(directory)
    assert problems == []
    items = {i.offset: i for i in manifests[0].files[SHARD].items}
    metadata = dcp.FileSystemReader(directory).read_metadata()
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    assert info.relative_path == SHARD and items[info.offset].length == info.length
    return items[info.offset]


def _refusals(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "elastic.checkpoint.restore" and name in r.getMessage()]


def _flip(path: str, offset: int) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    assert os.path.getsize(path) == size


def _flipped_file_falls_back(root: str, path: str, weights: dict, caplog) -> None:
    """A byte flipped in the middle of ``path``, a file of the newest checkpoint:
    restore refuses it, naming the file, and falls back to the previous one."""
    _flip(path, os.path.getsize(path) // 2)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.restore"):
        start, restored, _ = _restore(root)
    assert start == 2 and _equal(restored, weights[1])
    assert any(path in r and "corrupt: CRC-32" in r for r in _refusals(caplog, NEWEST))


def _strip_items(directory: str) -> None:
    """Rewrite the manifest as a save did before items existed."""
    path = os.path.join(directory, layout.manifest_name(0))
    with open(path) as f:
        record = json.load(f)
    for digest in record["files"].values():
        digest.pop("items", None)
    with open(path, "w") as f:
        json.dump(record, f)


def test_the_manifest_crcs_written_during_the_save_are_those_of_the_files(saved):
    root, _ = saved
    for name in (PREVIOUS, NEWEST):
        directory = os.path.join(root, name)
        manifests, problems = layout.read_manifests(directory)
        assert problems == []
        files = manifests[0].files
        assert set(files) == {SHARD, layout.METADATA_FILE, layout.rank_state_name(0)}
        for file_name, digest in files.items():
            with open(os.path.join(directory, file_name), "rb") as f:
                data = f.read()
            assert (digest.size, digest.crc32) == (len(data), f"{zlib.crc32(data):08x}")
            for item in digest.items or ():
                piece = data[item.offset:item.offset + item.length]
                assert item.crc32 == f"{zlib.crc32(piece):08x}"
        assert files[SHARD].items is not None and len(files[SHARD].items) >= 4
        assert layout.verify(directory) == []


def test_a_save_reads_nothing_back(tmp_path, monkeypatch):
    def no_reading(*args, **kwargs):
        raise AssertionError("a save read a checkpoint file back")

    monkeypatch.setattr(checkpointer_module.layout, "file_digest", no_reading)
    monkeypatch.setattr(checkpointer_module.layout, "verify_checksums", no_reading)
    model = _model(0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), model=model)
    ckpt.save(1, async_=False)
    ckpt.save(2)
    ckpt.close()
    monkeypatch.undo()
    assert layout.verify(os.path.join(str(tmp_path / "ckpt"), NEWEST)) == []


@pytest.mark.parametrize("fqn", ["model.weight", "model.bias", "optim.state.weight.exp_avg",
                                 "optim.param_groups.weight.lr"])
def test_a_flipped_byte_inside_an_item_falls_back_to_the_previous_checkpoint(
        saved, root, caplog, fqn):
    _, weights = saved
    directory = os.path.join(root, NEWEST)
    item = _item(directory, fqn)
    path = os.path.join(directory, SHARD)
    _flip(path, item.offset + item.length // 2)
    assert layout.verify(directory, checksums=False) == []  # the sizes are all right

    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.restore"):
        start, restored, ckpt = _restore(root)

    assert start == 2 and ckpt.restored_path == os.path.join(root, PREVIOUS)
    assert _equal(restored, weights[1])
    refusals = _refusals(caplog, NEWEST)
    assert len(refusals) == 1 and path in refusals[0], refusals
    assert "corrupt: CRC-32" in refusals[0]
    assert f"bytes {item.offset}..{item.offset + item.length} (one item)" in refusals[0]
    assert f"falling back to {PREVIOUS}" in refusals[0]


def test_a_flipped_byte_in_the_rank_state_falls_back(saved, root, caplog):
    _, weights = saved
    _flipped_file_falls_back(root, os.path.join(root, NEWEST, layout.rank_state_name(0)),
                             weights, caplog)


def test_checkpoints_whose_manifests_have_no_items_still_restore(saved, root):
    _, weights = saved
    for name in (PREVIOUS, NEWEST):
        _strip_items(os.path.join(root, name))
    start, restored, _ = _restore(root)
    assert start == 3 and _equal(restored, weights[2])


def test_without_items_a_flipped_byte_is_caught_by_the_whole_file_check(saved, root, caplog):
    _, weights = saved
    for name in (PREVIOUS, NEWEST):
        _strip_items(os.path.join(root, name))
    _flipped_file_falls_back(root, os.path.join(root, NEWEST, SHARD), weights, caplog)


def test_sizes_only_restore_checks_no_crc(saved, root):
    # verify_checksums=False: the sizes are checked, the bytes are not.
    _, weights = saved
    directory = os.path.join(root, NEWEST)
    item = _item(directory, "model.weight")
    _flip(os.path.join(directory, SHARD), item.offset + item.length // 2)
    start, restored, ckpt = _restore(root, verify_checksums=False)
    assert start == 3 and ckpt.restored_path == directory
    assert not _equal(restored, weights[2])
