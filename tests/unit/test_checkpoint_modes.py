"""What a save creates is private to the job's user whatever the umask (0700/0600), or
has the group mode the operator chose. One process, real files, no process group."""

from __future__ import annotations

import os
import stat

import pytest

torch = pytest.importorskip("torch")

from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.checkpointer import Checkpointer  # noqa: E402
from elastic.checkpoint.commit import FileCommitLog  # noqa: E402
from elastic.errors import ConfigError  # noqa: E402
from elastic.worker_env import CHECKPOINT_MODE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def open_umask():
    """The most permissive umask: nothing the save creates may rely on it."""
    previous = os.umask(0)
    yield
    os.umask(previous)


def modes(root: str) -> dict[str, tuple[bool, int]]:
    """Every path under ``root`` (and the root itself, "."): (a directory?, permission bits)."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in [".", *dirs, *files] if directory == root else [*dirs, *files]:
            path = os.path.normpath(os.path.join(directory, name))
            info = os.lstat(path)
            found[os.path.relpath(path, root)] = (stat.S_ISDIR(info.st_mode),
                                                  stat.S_IMODE(info.st_mode))
    return found


def save_twice(root: str, **kwargs) -> None:
    """Two committed checkpoints and a retained third: directories, DCP's files,
    rank state, manifest, marker, the commit log's file, renames and pruning."""
    model = torch.nn.Linear(3, 2)
    ckpt = Checkpointer(root, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        keep=2, **kwargs)
    for step in (1, 2, 3):
        ckpt.save(step, data_state={"step": step}, async_=step != 2)
    ckpt.close()


def check(found: dict[str, tuple[bool, int]], dir_mode: int, file_mode: int) -> None:
    assert "latest" in found and "step-000000000003/.metadata" in found
    assert any(name.endswith(".distcp") for name in found)
    wrong = {name: oct(mode) for name, (is_dir, mode) in found.items()
             if mode != (dir_mode if is_dir else file_mode)}
    assert wrong == {}


def test_a_save_under_an_open_umask_creates_only_private_paths(tmp_path, open_umask,
                                                               monkeypatch):
    monkeypatch.delenv(CHECKPOINT_MODE, raising=False)
    root = str(tmp_path / "ckpt")
    save_twice(root)
    found = modes(root)
    check(found, 0o700, 0o600)
    assert not any(mode & 0o077 for _, mode in found.values())


def test_the_operator_chooses_a_group_mode(tmp_path, open_umask, monkeypatch):
    monkeypatch.delenv(CHECKPOINT_MODE, raising=False)
    root = str(tmp_path / "ckpt")
    save_twice(root, mode=0o750)
    check(modes(root), 0o750, 0o640)


def test_the_mode_from_the_environment_and_the_argument_over_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CHECKPOINT_MODE, "750")
    model = torch.nn.Linear(3, 2)
    assert Checkpointer(str(tmp_path / "a"), model=model).mode == 0o750
    assert Checkpointer(str(tmp_path / "b"), model=model, mode=0o700).mode == 0o700
    monkeypatch.setenv(CHECKPOINT_MODE, "rwx")
    with pytest.raises(ConfigError, match=CHECKPOINT_MODE):
        Checkpointer(str(tmp_path / "c"), model=model)


@pytest.mark.parametrize("mode", [0o777, 0o702, 0o600, 0o1700, 0o4750, "700"])
def test_a_mode_others_could_write_or_the_owner_could_not_use_is_refused(mode):
    with pytest.raises(ConfigError, match="checkpoint mode"):
        layout.check_mode(mode)


def test_a_file_keeps_its_mode_when_rewritten_and_the_commit_log_is_private(tmp_path,
                                                                          open_umask):
    path = str(tmp_path / "f")
    with open(path, "wb"):
        pass
    os.chmod(path, 0o666)
    layout.write_durably(path, b"data")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    from elastic.checkpoint.api import CommitEntry

    FileCommitLog(str(tmp_path), 0o640).commit(
        CommitEntry(step=1, round=0, world_size=1, path="step-000000000001", time=0.0))
    assert stat.S_IMODE(os.stat(tmp_path / "latest").st_mode) == 0o640


def test_a_root_that_every_user_can_write_is_warned_about_once(tmp_path, caplog):
    import logging

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)  # like /tmp: others can still create a step directory
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.root"):
        Checkpointer(str(root), model=torch.nn.Linear(3, 2))
    warned = [r.getMessage() for r in caplog.records if "writable by every user" in r.getMessage()]
    assert len(warned) == 1 and str(root) in warned[0] and "1777" in warned[0]
    caplog.clear()
    os.chmod(root, 0o700)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.root"):
        Checkpointer(str(root), model=torch.nn.Linear(3, 2))
    assert caplog.records == []
    assert layout.root_exposure(str(tmp_path / "missing")) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_root_that_belongs_to_another_user_is_named(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    assert layout.root_exposure(str(root)) is None  # our own, 0755
    os.chown(root, 65534, 65534)  # nobody's: nobody may now plant a checkpoint in it
    assert layout.root_exposure(str(root)) == "belongs to another user (uid 65534)"
