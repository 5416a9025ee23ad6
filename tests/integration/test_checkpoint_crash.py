"""A crash at every failpoint of a save (before the shards, mid-write, before and after
the commit log, mid-prune): a fresh group restores the checkpoint the commit rule
names (the previous one, or the new one once the log has it), bitwise, and saves on
over whatever the crash left. With the file log, and the log phases with etcd's.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.checkpointing import (LogUnderTest, Worker, commit_log,  # noqa: F401
                                             emit, launch, run, seed_all, task_check_restore)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def task_crash(w: Worker, root, failpoint, async_save, keep, log, task_id):
    """Commit step 1, report it, then crash while saving step 2."""
    model, opt, sched = w.ddp()
    seed_all(w.rank)
    ckpt = w.checkpointer(root, model, opt, sched, log=log, keep=keep)
    assert ckpt.restore() == 0
    w.train(model, opt, sched, steps=2)
    ckpt.save(1, data_state={"step": 1}, async_=False)
    digests = {"digest_step1": w.ddp_digest(model, opt, sched)}
    emit(task_id, digests)
    w.train(model, opt, sched)
    digests["digest_step2"] = w.ddp_digest(model, opt, sched)
    emit(task_id, digests)
    os.environ["ELASTIC_FAILPOINT"] = failpoint
    ckpt.save(2, data_state={"step": 2}, async_=async_save)
    w.train(model, opt, sched)
    ckpt.wait()
    return {"survived": True}


# (failpoint, async save, keep, which checkpoint restore must load afterwards)
PHASES_BEFORE_THE_LOG = [
    ("ckpt.before_shards", True, 3, "previous"),  # before the temporary directory exists
    ("ckpt.write", False, 3, "previous"),  # it exists, no file written into it yet
    ("ckpt.mid_write", False, 3, "previous"),
    ("ckpt.after_shards_before_commit", True, 3, "previous"),
]
PHASES_OF_THE_LOG = [
    ("ckpt.after_rename_before_commit_log", False, 3, "previous"),
    # the log is the authority: its entry wins although the marker is missing
    ("ckpt.after_commit_log_before_marker", True, 3, "new"),
    # keep=1: committing step 2 prunes step 1, and the crash hits between its
    # rename to .trash-* and its deletion
    ("ckpt.mid_prune", False, 1, "new"),
]


@pytest.mark.parametrize("name, async_save, keep, winner",
                         [*PHASES_BEFORE_THE_LOG, *PHASES_OF_THE_LOG])
def test_crash_at_failpoint_with_the_file_log(tmp_path, name, async_save, keep, winner):
    check_crash_at_failpoint(tmp_path, name, async_save, keep, winner, LogUnderTest("file"))


@pytest.mark.parametrize("name, async_save, keep, winner", PHASES_OF_THE_LOG)
@pytest.mark.parametrize("commit_log", ["etcd"], indirect=True)
def test_crash_at_failpoint_with_the_etcd_log(tmp_path, name, async_save, keep, winner,
                                             commit_log):
    check_crash_at_failpoint(tmp_path, name, async_save, keep, winner, commit_log)


def check_crash_at_failpoint(tmp_path, name, async_save, keep, winner, commit_log):
    """Commit step 1, crash while saving step 2, restore in a fresh group, save again."""
    root = str(tmp_path / "ckpt")
    commit_log.start_round(1)
    crashed = launch(tmp_path, 2, [{"id": "crash", "task": task_crash, "root": root,
                                    "failpoint": name, "async_save": async_save, "keep": keep,
                                    "log": commit_log.spec}],
                     crash_expected=True, round_number=1)
    # the failpoint itself ended the run, not some other error
    assert crashed[0].returncode == 1, crashed[0].stderr[-3000:]
    assert f"elastic failpoint {name}: exit" in crashed[0].stderr
    assert all(r.returncode != 0 for r in crashed)

    restored = run(tmp_path, 2, {"task": task_check_restore, "root": root, "keep": keep,
                                 "log": commit_log.spec}, round_number=1)

    expected_start = 2 if winner == "previous" else 3
    expected_dirs = list(range(1, expected_start + 1))[-keep:]
    for before, after in zip(crashed, restored):
        saved = before.results["crash"]
        assert after["start"] == expected_start, after
        assert after["digest"] == saved["digest_step1" if winner == "previous" else
                                        "digest_step2"], f"the {winner} checkpoint is not intact"
        assert after["data_state"] == {"step": expected_start - 1}
        # training goes on and saves the next step over whatever the crash left; every
        # checkpoint kept is committed and marked (a marker the crash left out, too)
        assert after["latest_after_save"] == expected_start
        assert after["dirs_after_save"] == {f"step-{s:012d}": True for s in expected_dirs}
        assert after["hidden_after_save"] == []
        assert all(after["verify_after_save"].values()), after["verify_after_save"]
