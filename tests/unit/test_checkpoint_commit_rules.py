"""The Checkpointer's rules that a mutation run showed only integration tests (or none)
guarding: a committed checkpoint is never moved aside by a save of its step, and a
restore checks the CRC-32s of what it reads. One process, no process group, the
commit log beside the checkpoints."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")

from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402
from elastic.checkpoint.commit import FileCommitLog  # noqa: E402
from elastic.errors import CheckpointWriteError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def with_model(root, seed: int = 0) -> tuple[Checkpointer, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return Checkpointer(str(root), model=model,
                        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), keep=5), model


def checkpointer(root, seed: int = 0) -> Checkpointer:
    return with_model(root, seed)[0]


def weights(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def identity(directory: str) -> tuple:
    """What moving a directory aside (and committing again) would change."""
    with open(os.path.join(directory, layout.MARKER_FILE), "rb") as f:
        return os.stat(directory).st_ino, f.read()


@pytest.mark.parametrize("log_lost", [False, True], ids=["log-at-5", "log-lost"])
def test_saving_an_older_committed_step_again_leaves_it_and_the_log_alone(tmp_path, log_lost):
    # Mutant killed: _make_way without its refusal of a marked directory older than
    # the latest entry (or with the comparison turned), which moves a loadable
    # checkpoint aside and takes the commit log back to the older step.
    ckpt = checkpointer(tmp_path)
    ckpt.save(3, async_=False)
    ckpt.save(5, async_=False)
    older = str(tmp_path / layout.step_dir_name(3))
    before = identity(older)
    if log_lost:  # no entry: every marked directory may be what restore loads
        os.unlink(FileCommitLog(str(tmp_path)).path)
    with pytest.raises(CheckpointWriteError, match="already committed"):
        ckpt.save(3, async_=False)
    ckpt.close()
    assert identity(older) == before
    latest = FileCommitLog(str(tmp_path)).latest()
    assert (latest is None) if log_lost else (latest.step == 5)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []


def test_saving_the_latest_step_again_is_refused(tmp_path):
    ckpt = checkpointer(tmp_path)
    ckpt.save(3, async_=False)
    before = identity(str(tmp_path / layout.step_dir_name(3)))
    with pytest.raises(CheckpointWriteError, match="already the latest"):
        ckpt.save(3, async_=False)
    ckpt.close()
    assert identity(str(tmp_path / layout.step_dir_name(3))) == before


def test_a_step_of_an_abandoned_line_newer_than_the_latest_is_replaced(tmp_path):
    # The rule's other side: a marked directory newer than the latest entry is never
    # restored (the log went back), so a save of its step may move it aside.
    ckpt = checkpointer(tmp_path)
    ckpt.save(3, async_=False)
    ckpt.save(5, async_=False)
    log = FileCommitLog(str(tmp_path))
    entry = layout.read_marker(str(tmp_path / layout.step_dir_name(3)))
    os.unlink(log.path)
    log.commit(entry)  # the log is back at step 3
    ckpt.save(5, async_=False)
    ckpt.close()
    assert log.latest().step == 5


def test_restore_checks_the_crc32_of_what_it_reads(tmp_path, caplog):
    # Mutant killed: the restore's reader built with checksums=False (sizes only),
    # which loads a checkpoint whose tensor bytes were changed in place.
    saver, saved_model = with_model(tmp_path, seed=1)
    saver.save(1, async_=False)
    expected = weights(saved_model)
    with torch.no_grad():
        for parameter in saved_model.parameters():
            parameter.add_(1.0)
    saver.save(2, async_=False)
    saver.close()
    newest = str(tmp_path / layout.step_dir_name(2))
    manifests, _ = layout.read_manifests(newest)
    name, digest = next((n, d) for m in manifests for n, d in m.files.items() if d.items)
    item = max(digest.items, key=lambda i: i.length)  # the weight's bytes
    with open(os.path.join(newest, name), "r+b") as f:  # same size, one byte changed
        f.seek(item.offset + item.length - 9)
        byte = f.read(1)
        f.seek(item.offset + item.length - 9)
        f.write(bytes([byte[0] ^ 0x01]))
    restorer, restored_model = with_model(tmp_path, seed=2)
    with caplog.at_level(logging.WARNING):
        assert restorer.restore() == 2  # step 1, not the changed step 2
    restorer.close()
    assert all(torch.equal(weights(restored_model)[k], v) for k, v in expected.items())
    assert "corrupt: CRC-32" in caplog.text and name in caplog.text
