"""The Checkpointer's parts on their own, one process, no process group: what the
async copy leaves for later, how a rank's failure reads and travels, what the
environment says, and rank 0's rule for a directory in the way of a commit."""

from __future__ import annotations

import errno
import logging
import os

import pytest

torch = pytest.importorskip("torch")

from elastic.checkpoint import layout  # noqa: E402
from elastic.checkpoint.api import CommitEntry  # noqa: E402
from elastic.checkpoint.environment import (  # noqa: E402
    SavingNotice,
    mode_from_env,
    root_from_env,
    round_from_env,
)
from elastic.checkpoint.failures import RankFailure, capture  # noqa: E402
from elastic.checkpoint.root import CheckpointRoot  # noqa: E402
from elastic.checkpoint.snapshot import split_state  # noqa: E402
from elastic.errors import (  # noqa: E402
    CheckpointWriteError,
    ConfigError,
    FencedError,
)


# --- snapshot: what the background copy takes ----------------------------------------------------

def test_parameters_and_optimizer_tensors_are_copied_later_the_rest_now():
    model = torch.nn.BatchNorm1d(3)
    weight, running = model.weight, model.running_mean
    state_dict = {"model": {"weight": weight, "running_mean": running},
                  "optim": {"state.weight.exp_avg": torch.zeros(3), "param_groups": [1]},
                  "extra": 7}
    later, now = split_state(state_dict, {weight.data_ptr()})
    assert later == {"model": {"weight": weight},
                     "optim": {"state.weight.exp_avg": state_dict["optim"]["state.weight.exp_avg"]}}
    assert now == {"model": {"running_mean": running}, "optim": {"param_groups": [1]},
                   "extra": 7}


# --- failures: a value that travels, one line that reads -----------------------------------------

def test_a_local_failure_becomes_a_value_naming_the_rank_and_the_errno():
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/ckpt/x")

    failure = capture(1, full)
    assert failure == RankFailure(1, "[Errno 28 ENOSPC] No space left on device (/ckpt/x)",
                                  errno.ENOSPC)
    error = failure.error(4, "/ckpt/.tmp", more=1)
    assert isinstance(error, CheckpointWriteError) and error.errno == errno.ENOSPC
    assert str(error).startswith("saving checkpoint step 4 into /ckpt/.tmp failed on rank 1 "
                                 "(and on 1 more rank(s)): [Errno 28 ENOSPC]")


def test_a_fenced_failure_stays_fenced_and_success_is_none():
    def fenced() -> None:
        raise FencedError("round 2 refused")

    failure = capture(0, fenced)
    assert failure.fenced and isinstance(failure.error(1, "/d"), FencedError)
    assert capture(0, lambda: None) is None


def test_an_os_error_in_the_cause_chain_is_found():
    try:
        try:
            raise OSError(errno.EIO, "I/O error")
        except OSError as exc:
            raise RuntimeError("write failed") from exc
    except RuntimeError as exc:
        failure = RankFailure.of(0, exc)
    assert failure.errno == errno.EIO and "[Errno 5 EIO]" in failure.message


# --- environment ---------------------------------------------------------------------------------

def test_the_environment_is_read_only_where_no_value_is_given(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_CHECKPOINT_DIR", str(tmp_path / "env"))
    assert root_from_env(None) == str(tmp_path / "env")
    assert root_from_env("rel") == os.path.abspath("rel")
    monkeypatch.delenv("ELASTIC_CHECKPOINT_DIR")
    with pytest.raises(ConfigError, match="ELASTIC_CHECKPOINT_DIR"):
        root_from_env(None)
    monkeypatch.setenv("ELASTIC_CHECKPOINT_MODE", "0o750")
    assert mode_from_env() == 0o750
    monkeypatch.setenv("ELASTIC_ROUND", "")
    assert round_from_env() == 0
    monkeypatch.setenv("ELASTIC_ROUND", "x")
    with pytest.raises(ConfigError, match="ELASTIC_ROUND must be an integer"):
        round_from_env()


def test_a_failing_saving_hook_is_a_warning_and_the_end_is_zero(caplog):
    heard = []

    def hook(seconds: float) -> None:
        heard.append(seconds)
        if len(heard) == 1:
            raise RuntimeError("agent gone")

    notice = SavingNotice(hook, rank=3)
    with caplog.at_level(logging.WARNING, logger="elastic.checkpoint.environment"):
        notice.started(100 * 2**20)
        notice.ended()
    assert heard == [SavingNotice.FIXED_S + 1.0, 0.0]
    assert "Rank 3: the on_saving hook failed (agent gone); the save goes on." in caplog.text


# --- root: what a save may move aside ------------------------------------------------------------

def entry(step: int, round_: int) -> CommitEntry:
    return CommitEntry(step=step, round=round_, world_size=1, path=layout.step_dir_name(step),
                       time=1.0)


def in_the_way(tmp_path, step: int, marked_by: CommitEntry | None) -> tuple[CheckpointRoot, str]:
    root = CheckpointRoot(str(tmp_path), layout.DIR_MODE, layout.FILE_MODE, keep=3, round_=2)
    final = root.join(layout.step_dir_name(step))
    layout.make_dir(final)
    if marked_by is not None:
        layout.write_marker(final, marked_by)
    return root, final


def test_a_directory_of_a_newer_round_is_fenced_and_left_alone(tmp_path):
    root, final = in_the_way(tmp_path, 5, marked_by=entry(5, round_=3))
    with pytest.raises(FencedError, match="newer round 3"):
        root.make_way(final, 5, latest=None, tmp="/t")
    assert os.path.isdir(final)


def test_the_latest_and_older_committed_ones_are_never_replaced(tmp_path):
    root, final = in_the_way(tmp_path, 5, marked_by=entry(5, round_=1))
    with pytest.raises(CheckpointWriteError, match="already the latest"):
        root.make_way(final, 5, latest=entry(5, 1), tmp="/t")
    with pytest.raises(CheckpointWriteError, match="restore may load it"):
        root.make_way(final, 5, latest=entry(7, 1), tmp="/t")
    assert os.path.isdir(final)


def test_leftovers_and_unusable_ones_are_moved_aside(tmp_path):
    root, final = in_the_way(tmp_path, 5, marked_by=None)  # a crash after its rename
    root.make_way(final, 5, latest=entry(3, 1), tmp="/t")
    assert not os.path.exists(final) and os.listdir(tmp_path) == []
    root, final = in_the_way(tmp_path, 5, marked_by=entry(5, round_=1))
    root.unusable.add(layout.step_dir_name(5))  # the last restore skipped it
    root.make_way(final, 5, latest=entry(5, 1), tmp="/t")
    assert os.listdir(tmp_path) == []
