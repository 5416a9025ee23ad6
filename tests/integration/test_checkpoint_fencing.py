"""Fencing by the round: a zombie of an older round is refused the commit (the latest
stays, its directory stays unmarked and is never restored), and never replaces a
directory of the current round: the latest, a committed one, or one whose commit's
outcome is unknown. With the file log and with etcd's.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from elastic import worker_env
from elastic.checkpoint.api import CommitEntry, CommitLog
from tests.integration.checkpointing import (BOTH_LOGS, Worker, commit_log,  # noqa: F401
                                             run, seed_all)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def task_fenced(w: Worker, root, log):
    """Round 3 commits step 1; a zombie of round 2 tries step 2 and is fenced off;
    round 3 restores step 1 and commits step 2 over the zombie's directory."""
    from elastic.checkpoint import layout
    from elastic.errors import FencedError

    model, opt, sched = w.ddp()
    seed_all(w.rank)
    os.environ[worker_env.ROUND] = "3"
    current = w.checkpointer(root, model, opt, sched, log=log)
    w.train(model, opt, sched)
    current.save(1, async_=False)
    digest = w.ddp_digest(model, opt, sched)
    current.close()

    os.environ[worker_env.ROUND] = "2"
    zombie = w.checkpointer(root, model, opt, sched, log=log)
    w.train(model, opt, sched)
    fenced_error = None
    try:
        zombie.save(2)
        zombie.wait()
    except FencedError as exc:
        fenced_error = str(exc)
    zombie.close()
    latest = w.latest(root, log)
    zombie_dir = os.path.join(root, layout.step_dir_name(2))
    marked = layout.read_marker(zombie_dir) is not None if os.path.isdir(zombie_dir) else None

    os.environ[worker_env.ROUND] = "3"
    model2, opt2, sched2 = w.ddp(init_seed=5)
    again = w.checkpointer(root, model2, opt2, sched2, log=log)
    start = again.restore()
    restored = w.ddp_digest(model2, opt2, sched2)
    again.save(2, async_=False)
    again.close()
    final = w.latest(root, log)
    return {"fenced_error": fenced_error,
            "latest_after_fence": {"step": latest["step"], "round": latest["round"]},
            "zombie_dir_exists": os.path.isdir(zombie_dir), "zombie_dir_marked": marked,
            "restored_start": start, "restored_digest": restored, "digest_step1": digest,
            "latest_after_resave": {"step": final["step"], "round": final["round"]}}


@BOTH_LOGS
def test_fenced_commit_leaves_latest_in_place(tmp_path, commit_log):
    commit_log.start_round(3)
    for r in run(tmp_path, 2, {"task": task_fenced, "root": str(tmp_path / "ckpt"),
                               "log": commit_log.spec}):
        assert "refused" in r["fenced_error"] and "round 2" in r["fenced_error"], r
        assert r["latest_after_fence"] == {"step": 1, "round": 3}
        assert r["zombie_dir_exists"] and r["zombie_dir_marked"] is False
        assert r["restored_start"] == 2 and r["restored_digest"] == r["digest_step1"]
        assert r["latest_after_resave"] == {"step": 2, "round": 3}


class UnknownOutcomeLog(CommitLog):
    """While ``armed``, a commit fails as a store timeout does: outcome unknown."""

    def __init__(self, inner: CommitLog):
        self.inner = inner
        self.armed = False

    def commit(self, entry: CommitEntry) -> None:
        if self.armed:
            from elastic.errors import StoreTimeoutError

            raise StoreTimeoutError("injected: the commit timed out; its outcome is unknown")
        self.inner.commit(entry)

    def latest(self) -> CommitEntry | None:
        return self.inner.latest()


def tree_state(directory: str) -> dict:
    """A directory's identity and every file's bytes (digested): equal means untouched."""
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = hashlib.sha256(f.read()).hexdigest()
    return {"inode": os.stat(directory).st_ino, "files": files}


def task_zombie(w: Worker, root, log):
    """Round 3 commits steps 1 and 2; a zombie of round 2 saves step 2 over the latest;
    round 3 commits step 3 and the zombie saves step 2 again, over a committed one;
    round 3 renames step 4 into place but its commit's outcome is unknown, and the
    zombie saves step 4. Each zombie save must leave the directory as it was."""
    from elastic.checkpoint import layout

    model, opt, sched = w.ddp()
    seed_all(w.rank)
    os.environ[worker_env.ROUND] = "3"
    current_log = UnknownOutcomeLog(w.commit_log(root, log))
    current = w.checkpointer(root, model, opt, sched, commit_log=current_log)
    for step in (1, 2):
        w.train(model, opt, sched)
        current.save(step, async_=False)
    os.environ[worker_env.ROUND] = "2"
    zombie = w.checkpointer(root, model, opt, sched, log=log)

    def attempt(step: int) -> dict:
        directory = os.path.join(root, layout.step_dir_name(step))
        result = {"before": tree_state(directory), "latest_before": w.latest(root, log),
                  "error": None, "message": None}
        try:
            zombie.save(step, async_=False)
        except Exception as exc:  # noqa: BLE001 - which error is what the test checks
            result.update(error=type(exc).__name__, message=str(exc))
        result.update(after=tree_state(directory), latest_after=w.latest(root, log))
        return result

    results = {"latest": attempt(2)}
    w.train(model, opt, sched)
    current.save(3, async_=False)
    digest3 = w.ddp_digest(model, opt, sched)
    results["committed"] = attempt(2)
    w.train(model, opt, sched)
    current_log.armed = True
    try:
        current.save(4, async_=False)
    except Exception:  # noqa: BLE001 - the injected failure; its directory stays
        pass
    results["uncommitted"] = attempt(4)
    zombie.close()
    current.close()

    os.environ[worker_env.ROUND] = "3"
    model2, opt2, sched2 = w.ddp(init_seed=5)
    again = w.checkpointer(root, model2, opt2, sched2, log=log)
    results["restored_start"] = again.restore()
    results["restored_digest"] = w.ddp_digest(model2, opt2, sched2)
    results["digest_step3"] = digest3
    again.close()
    return results


@BOTH_LOGS
def test_a_zombie_never_replaces_a_directory_of_the_current_round(tmp_path, commit_log):
    commit_log.start_round(3)
    for r in run(tmp_path, 2, {"task": task_zombie, "root": str(tmp_path / "ckpt"),
                               "log": commit_log.spec}):
        # the latest (step 2), then a committed step that is no longer the latest (step 2
        # again, after step 3), then a directory renamed into place by round 3 whose
        # commit has an unknown outcome (step 4): each time the zombie of round 2 is
        # fenced off before it touches the directory
        for case in ("latest", "committed", "uncommitted"):
            attempt = r[case]
            assert attempt["error"] == "FencedError", (case, attempt)
            assert "newer round 3" in attempt["message"] and "round 2" in attempt["message"]
            assert attempt["after"] == attempt["before"], f"the zombie changed the {case} one"
            assert attempt["latest_after"] == attempt["latest_before"]
        assert r["restored_start"] == 4 and r["restored_digest"] == r["digest_step3"]
