"""The agent's private files (agent.localfiles): the node directory, the socket, rank logs.

Another local user may have planted a link or a directory of their own on
the way: nothing is followed, nothing of theirs is used, and each refusal is a
clear ConfigError naming the path.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import socket
import tempfile

import pytest

from agent import localfiles
from elastic.errors import ConfigError

OTHER_UID = 4242
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def _mode(path) -> int:
    return os.lstat(path).st_mode & 0o777


def test_the_node_directory_socket_and_logs_are_private(tmp_path):
    state = tmp_path / "state"
    node_dir = state / "job" / "n1"
    files = localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    assert files.socket_path == str(node_dir / "agent.sock")
    assert files.log_dir == str(node_dir / "logs")
    for directory in (state / "job", node_dir, node_dir / "logs"):
        assert _mode(directory) == 0o700
    # Again, over what exists: the same answer, nothing loosened.
    assert localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {}) == files


def test_a_loose_directory_of_ours_is_tightened(tmp_path):
    node_dir = tmp_path / "state" / "job" / "n1"
    node_dir.mkdir(parents=True)
    os.chmod(node_dir, 0o777)
    localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    assert _mode(node_dir) == 0o700


def test_a_state_directory_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "state").symlink_to(tmp_path / "real")
    node_dir = tmp_path / "state" / "job" / "n1"
    with pytest.raises(ConfigError, match="is a symbolic link"):
        localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    assert not (tmp_path / "real" / "job").exists()


@pytest.mark.parametrize("planted", ["job", "job/n1", "job/n1/logs"])
def test_a_link_planted_below_the_state_directory_is_never_followed(tmp_path, planted):
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = state / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    node_dir = state / "job" / "n1"
    with pytest.raises(ConfigError, match=f"{link} is a symbolic link"):
        localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    assert os.listdir(elsewhere) == []


def test_a_file_in_the_way_is_not_a_directory(tmp_path):
    (tmp_path / "state" / "job").mkdir(parents=True)
    (tmp_path / "state" / "job" / "n1").write_text("")
    node_dir = tmp_path / "state" / "job" / "n1"
    with pytest.raises(ConfigError, match="is not a directory"):
        localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})


@as_root
@pytest.mark.parametrize("whose", ["state", "state/job", "state/job/n1"])
def test_a_directory_of_another_user_is_refused(tmp_path, whose, monkeypatch):
    node_dir = tmp_path / "state" / "job" / "n1"
    node_dir.mkdir(parents=True)
    os.chown(tmp_path / whose, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
        localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    # Not even root's own, for an agent of another user.
    monkeypatch.setattr(localfiles.os, "geteuid", lambda: OTHER_UID + 1)
    with pytest.raises(ConfigError, match="belongs to uid"):
        localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})


@as_root
def test_a_state_directory_of_root_is_accepted_for_another_user(tmp_path, monkeypatch):
    # A directory an administrator made for an agent that runs as uid 10001
    # (a Kubernetes emptyDir is 0777: job.yaml gives a subdirectory of it).
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    monkeypatch.setattr(localfiles.os, "geteuid", lambda: OTHER_UID)
    real_mkdir = os.mkdir

    def mkdir_as_other(name, mode=0o777, *, dir_fd=None):
        real_mkdir(name, mode, dir_fd=dir_fd)
        os.chown(name, OTHER_UID, OTHER_UID, dir_fd=dir_fd, follow_symlinks=False)

    monkeypatch.setattr(localfiles.os, "mkdir", mkdir_as_other)
    node_dir = state / "job" / "n1"
    files = localfiles.prepare(str(node_dir), str(node_dir / "logs"), "job", "n1", {})
    assert os.stat(node_dir).st_uid == OTHER_UID and _mode(node_dir) == 0o700
    assert files.socket_path == str(node_dir / "agent.sock")


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o2775, 0o757])
@pytest.mark.parametrize("which", ["state", "logs"])
def test_a_directory_others_may_write_in_is_refused_naming_the_option(tmp_path, mode, which):
    # Another user could plant <job> or round-N there and fail the agent at each start.
    node_dir = tmp_path / "state" / "job" / "n1"
    logs = tmp_path / "logs"
    (tmp_path / which).mkdir()
    os.chmod(tmp_path / which, mode)
    option = "--state-dir" if which == "state" else "--log-dir"
    with pytest.raises(ConfigError, match=f"{tmp_path / which} \\({option}\\) is writable by "
                                          f".*choose another {option}"):
        localfiles.prepare(str(node_dir), str(logs), "job", "n1", {})


@as_root
def test_a_log_dir_of_another_user_is_refused_naming_the_option(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    os.chown(logs, OTHER_UID, OTHER_UID)
    node_dir = tmp_path / "state" / "job" / "n1"
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}.*another --log-dir"):
        localfiles.prepare(str(node_dir), str(logs), "job", "n1", {})


def test_an_explicit_log_dir_may_be_a_link_to_a_private_directory(tmp_path):
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "logs").symlink_to(tmp_path / "disk")
    node_dir = tmp_path / "state" / "job" / "n1"
    files = localfiles.prepare(str(node_dir), str(tmp_path / "logs"), "job", "n1", {})
    assert files.log_dir == str(tmp_path / "logs")


def test_an_explicit_log_dir_is_created_private(tmp_path):
    node_dir = tmp_path / "state" / "job" / "n1"
    logs = tmp_path / "my" / "logs"
    files = localfiles.prepare(str(node_dir), str(logs), "job", "n1", {})
    assert files.log_dir == str(logs) and _mode(logs) == 0o700


def test_a_rank_log_is_never_opened_through_a_link(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (tmp_path / "rank-0.log").symlink_to(target)
    with pytest.raises(OSError):
        localfiles.open_log(str(tmp_path / "rank-0.log"))
    assert target.read_text() == "precious\n"
    with localfiles.open_log(str(tmp_path / "rank-1.log")) as f:
        f.write("ok\n")
    assert _mode(tmp_path / "rank-1.log") == 0o600


def test_a_round_directory_planted_as_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "round-3").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        localfiles.private_subdir(str(tmp_path), "round-3")
    assert _mode(localfiles.private_subdir(str(tmp_path), "round-4")) == 0o700


# --- the socket's path: 107 bytes at most ---------------------------------------------------------

@pytest.fixture
def short_tmp():
    """A fresh directory with a short path, standing in for the temp dir: the fallback
    socket must fit in 107 bytes, and pytest's tmp_path may be long (xdist adds to it)."""
    path = tempfile.mkdtemp(prefix="lf-", dir="/tmp")
    try:
        yield pathlib.Path(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _long_state(tmp_path) -> str:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    return str(deep / "job" / "n1")


def test_a_socket_path_too_long_falls_back_to_the_runtime_directory(tmp_path, caplog):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    node_dir = _long_state(tmp_path)
    caplog.set_level(logging.INFO, logger="agent.localfiles")
    files = localfiles.prepare(node_dir, os.path.join(node_dir, "logs"), "job", "n1",
                               {"XDG_RUNTIME_DIR": str(runtime)})
    assert os.path.dirname(files.socket_path) == str(runtime / "elasticd")
    assert len(os.fsencode(files.socket_path)) <= 107 and _mode(runtime / "elasticd") == 0o700
    assert "would be longer than the 107 bytes" in caplog.text
    # Another job or node: another socket.
    other = localfiles.socket_path(node_dir, "job", "n2", {"XDG_RUNTIME_DIR": str(runtime)})
    assert other != files.socket_path


def test_without_a_runtime_directory_the_fallback_is_private_in_the_temp_dir(tmp_path,
                                                                              short_tmp,
                                                                              monkeypatch):
    monkeypatch.setattr(localfiles.tempfile, "gettempdir", lambda: str(short_tmp))
    path = localfiles.socket_path(_long_state(tmp_path), "job", "n1", {})
    assert os.path.dirname(path) == str(short_tmp / f"elasticd-{os.geteuid()}")
    assert _mode(os.path.dirname(path)) == 0o700


@as_root
def test_a_fallback_directory_another_user_created_first_is_refused(tmp_path, short_tmp,
                                                                   monkeypatch):
    monkeypatch.setattr(localfiles.tempfile, "gettempdir", lambda: str(short_tmp))
    squatted = short_tmp / f"elasticd-{os.geteuid()}"
    squatted.mkdir()
    os.chown(squatted, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
        localfiles.socket_path(_long_state(tmp_path), "job", "n1", {})


def test_a_fallback_directory_planted_as_a_link_is_refused(tmp_path, short_tmp, monkeypatch):
    monkeypatch.setattr(localfiles.tempfile, "gettempdir", lambda: str(short_tmp))
    (tmp_path / "elsewhere").mkdir()
    (short_tmp / f"elasticd-{os.geteuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        localfiles.socket_path(_long_state(tmp_path), "job", "n1", {})


def test_no_path_that_fits_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(localfiles.tempfile, "gettempdir", lambda: str(tmp_path / ("t" * 120)))
    with pytest.raises(ConfigError, match="use a shorter --state-dir"):
        localfiles.socket_path(_long_state(tmp_path), "job", "n1", {})


# --- what may already be at the socket's path ----------------------------------------------------

def test_a_file_at_the_socket_path_is_refused_not_removed(tmp_path):
    path = tmp_path / "agent.sock"
    path.write_text("keep me")
    with pytest.raises(ConfigError, match="not a socket"):
        localfiles.prepare_socket_path(str(path))
    assert path.read_text() == "keep me"


def test_a_stale_socket_of_ours_is_removed(tmp_path):
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # bound, never listening: what a dead agent leaves
    localfiles.prepare_socket_path(path)
    assert not os.path.lexists(path)


def test_a_live_socket_is_refused(tmp_path):
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen(1)
        with pytest.raises(ConfigError, match="in use by another process"):
            localfiles.prepare_socket_path(path)


@as_root
def test_a_stale_socket_of_another_user_is_refused(tmp_path):
    path = str(tmp_path / "agent.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
    os.lchown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match=f"another user \\(uid {OTHER_UID}\\)"):
        localfiles.prepare_socket_path(path)
    assert os.path.lexists(path)
