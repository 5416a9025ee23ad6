"""Checkpoints with real processes over gloo: bitwise resume, resharding (FSDP2 and
pipeline stages), async saves, crashes at every failpoint, damaged shards, a full
disk, a fenced commit and a zombie saver that must leave committed checkpoints alone.

Where a scenario involves the commit log, it runs twice: with the file beside the
checkpoints (``FileCommitLog``) and with the job's fenced etcd record
(``EtcdCommitLog`` on the session's real etcd server, what the agent keeps).

Workers are real processes forked from a multiprocessing *forkserver* that has
imported torch, DCP and this module once: each launch then costs a fork and a
gloo rendezvous instead of seconds of ``import torch`` per rank on 2 cores. Each
forked worker is a fresh process (nothing of earlier launches is in it). A worker
runs a list of tasks and writes one JSON line per finished task to its stdout
file, so a test still sees what a worker did before an injected crash.

ENOSPC is tested twice: on a real, tiny tmpfs (``mount -t tmpfs``, which needs
root; when the mount is refused that test is skipped with the reason, never
silently) and by the ``ckpt.write@1=oserror:ENOSPC`` failpoint on one rank only,
which works everywhere.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import traceback
import uuid

import pytest

from elastic.checkpoint.api import CommitEntry, CommitLog

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_TORCH = tuple(int(part) for part in
               importlib.metadata.version("torch").split("+")[0].split(".")[:2])
# torch 2.6's own FSDP2 all-gather calls Stream.record_event, which its CPU stream
# lacks; on CUDA it runs (tools/gpu_check.py reshards FSDP2 from a GPU).
fsdp2_on_cpu = pytest.mark.skipif(_TORCH < (2, 7), reason="torch 2.6's FSDP2 cannot run on "
                                  "the CPU ('Stream' object has no attribute 'record_event')")

LAUNCH_TIMEOUT_S = 60.0


# =====================================================================================
# The test side: launching groups of worker processes
# =====================================================================================


def _process_entry(rank: int, world_size: int, store: str, tasks: list[dict], out_path: str,
                   err_path: str, round_number: int) -> None:
    """The forked worker's first code: its own stdout/stderr files and environment."""
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    for name in ("ELASTIC_FAILPOINT", "ELASTIC_AGENT_SOCKET", "ELASTIC_CHECKPOINT_DIR"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), CKPT_TEST_STORE=store,
                      ELASTIC_ROUND=str(round_number))
    import torch

    torch.set_num_threads(1)  # 2 cores, several ranks
    worker_main(tasks)


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed.checkpoint",
                                         "torch.distributed.fsdp",
                                         "elastic.checkpoint.checkpointer", __name__])
    return _CONTEXT


class Rank:
    """What one worker process did: exit code, results by task id, stderr."""

    def __init__(self, rank: int, returncode: int, results: dict, stderr: str):
        self.rank = rank
        self.returncode = returncode
        self.results = results
        self.stderr = stderr

    def __repr__(self) -> str:
        return f"Rank({self.rank}, rc={self.returncode}, tasks={sorted(self.results)})"


def launch(workdir, world_size: int, tasks: list[dict], *, crash_expected: bool = False,
           round_number: int = 0) -> list[Rank]:
    """Run ``tasks`` in ``world_size`` fresh worker processes joined over gloo, as
    workers of round ``round_number`` (``ELASTIC_ROUND``)."""
    ctx = _context()
    tag = uuid.uuid4().hex[:8]
    store = os.path.join(str(workdir), f"store-{tag}")
    paths = [(os.path.join(str(workdir), f"{tag}-{rank}.out"),
              os.path.join(str(workdir), f"{tag}-{rank}.err")) for rank in range(world_size)]
    procs = [ctx.Process(target=_process_entry,
                         args=(rank, world_size, store, tasks, *paths[rank], round_number))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.1, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    ranks = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, paths)):
        with open(out) as f:
            lines = [json.loads(line) for line in f.read().splitlines() if line.startswith("{")]
        with open(err) as f:
            stderr = f.read()
        ranks.append(Rank(rank, proc.exitcode, {x["id"]: x["result"] for x in lines}, stderr))
    if not crash_expected:
        for r in ranks:
            assert r.returncode == 0, \
                f"rank {r.rank} failed (rc {r.returncode}):\n{r.stderr[-6000:]}"
    return ranks


def run(workdir, world_size: int, task: dict, **kwargs) -> list[dict]:
    """One task in a fresh group: its per-rank results."""
    task = dict(task, id="task")
    return [r.results["task"] for r in launch(workdir, world_size, [task], **kwargs)]


class LogUnderTest:
    """The commit log a scenario's workers use, seen from the test.

    ``spec`` goes into a task's ``log`` argument (None: the file log, the
    checkpointer's default without an agent). :meth:`start_round` makes the
    job's round ``number`` in etcd (the version of the ``round`` key, which
    fences commits); the file log has no rounds of its own to set up.
    """

    def __init__(self, kind: str, store=None, endpoint: str | None = None,
                 job_id: str | None = None):
        self.kind = kind
        self.store = store
        self.spec = None if kind == "file" else {"endpoint": endpoint, "job_id": job_id}

    def start_round(self, number: int) -> None:
        if self.store is None:
            return
        from elastic.keyspace import JobKeys

        key = JobKeys(self.spec["job_id"]).round
        while (kv := self.store.get(key)) is None or kv.version < number:
            self.store.put(key, b'{"round": "started by the test"}')


@pytest.fixture
def commit_log(request, job_id) -> LogUnderTest:
    """``file`` or ``etcd`` (parametrize indirectly); etcd starts only when asked for."""
    if request.param == "file":
        return LogUnderTest("file")
    return LogUnderTest("etcd", request.getfixturevalue("etcd_store"),
                        request.getfixturevalue("etcd_endpoint"), job_id)


BOTH_LOGS = pytest.mark.parametrize("commit_log", ["file", "etcd"], indirect=True)


def mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a tmpfs at ``path``; None on success, else why not."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        return "no mount command"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    return proc.stderr.strip() or f"mount exited {proc.returncode}"


def damage(directory: str, kind: str) -> str:
    """Truncate rank 1's shard or flip one bit in rank 0's; the damaged file's path."""
    path = os.path.join(directory, "__1_0.distcp" if kind == "truncate" else "__0_0.distcp")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if kind == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(size // 2)
            byte = f.read(1)[0]
            f.seek(size // 2)
            f.write(bytes([byte ^ 0x04]))
    return path


# =====================================================================================
# Tests
# =====================================================================================


def test_ddp_resume_is_bitwise_identical(tmp_path):
    root = str(tmp_path / "ckpt")
    reference = run(tmp_path, 2, {"task": "ddp", "root": root, "save_at": 2})
    resumed = run(tmp_path, 2, {"task": "ddp", "root": root, "save_at": None})
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        assert ref["start"] == 0 and res["start"] == 3
        assert res["digest"] == ref["digest"], "weights/optimizer/scheduler differ after resume"
        assert res["torch_rand"] == ref["torch_rand"] and res["py_rand"] == ref["py_rand"]
        assert res["restored_data_state"] == {"rank": rank, "samples": 24}
        assert res["restored_extras"] == {"note": "hello", "rank": rank}
    # each rank got its own RNG back, not rank 0's
    assert reference[0]["torch_rand"] != reference[1]["torch_rand"]


@fsdp2_on_cpu
def test_fsdp2_reshards_from_2_to_1_and_3_ranks(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": "fsdp", "root": root, "save": True})
    assert saved[0]["start"] == 0 and saved[0]["full"] == saved[1]["full"]
    loaded = (run(tmp_path, 1, {"task": "fsdp", "root": root, "save": False})
              + run(tmp_path, 3, {"task": "fsdp", "root": root, "save": False}))
    assert len(loaded) == 4
    for rank in loaded:
        assert rank["start"] == 2
        assert rank["full"] == saved[0]["full"]


@fsdp2_on_cpu
def test_fsdp_restore_with_resharding_checks_the_items_it_reads(tmp_path):
    """Saved by 2 ranks, loaded by 1: the one rank reads rank 1's items too, and a byte
    flipped inside one of them (the file's size unchanged) is caught as it is read."""
    from elastic.checkpoint import layout

    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": "fsdp", "root": root, "save": True, "saves": 2})
    directory = os.path.join(root, "step-000000000002")
    manifests, problems = layout.read_manifests(directory)
    assert problems == []
    shard = os.path.join(directory, "__1_0.distcp")
    item = max(manifests[1].files["__1_0.distcp"].items, key=lambda i: i.length)
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.seek(item.offset + item.length // 2)
        byte = f.read(1)[0]
        f.seek(item.offset + item.length // 2)
        f.write(bytes([byte ^ 0x08]))
    assert os.path.getsize(shard) == size

    ranks = launch(tmp_path, 1, [{"id": "load", "task": "fsdp", "root": root, "save": False}])
    loaded = ranks[0].results["load"]
    assert loaded["start"] == 2, "the damaged step 2 was loaded"
    assert loaded["full"] == saved[0]["full_at"]["1"]
    warnings = [line for line in ranks[0].stderr.splitlines()
                if line.startswith("WARNING") and shard in line]
    assert warnings and "corrupt: CRC-32" in warnings[0], ranks[0].stderr[-3000:]
    assert f"bytes {item.offset}..{item.offset + item.length} (one item)" in warnings[0]


def union(ranks: list[dict]) -> dict:
    merged = {}
    for rank in ranks:
        assert not merged.keys() & rank["owned"].keys(), "stages must own disjoint FQNs"
        merged.update(rank["owned"])
    return merged


def test_pipeline_2_stages_load_into_1_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = union(run(tmp_path, 2, {"task": "pipeline", "root": root, "chunks_per_rank": 1,
                                    "save": True}))
    assert any(k.startswith("model.head.") for k in saved)
    assert any(k.startswith("optim.state.layers.") for k in saved)
    loaded = run(tmp_path, 1, {"task": "pipeline", "root": root, "chunks_per_rank": 2,
                               "save": False})
    assert loaded[0]["start"] == 5
    assert union(loaded) == saved


def test_pipeline_1_rank_loads_into_2_stages(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = union(run(tmp_path, 1, {"task": "pipeline", "root": root, "chunks_per_rank": 2,
                                    "save": True}))
    loaded = run(tmp_path, 2, {"task": "pipeline", "root": root, "chunks_per_rank": 1,
                               "save": False})
    assert [r["start"] for r in loaded] == [5, 5]
    assert all(r["owned"] for r in loaded)
    assert union(loaded) == saved


def test_async_save_blocks_only_for_staging_and_one_in_flight(tmp_path):
    for r in run(tmp_path, 2, {"task": "async", "root": str(tmp_path / "ckpt")}):
        # with the commit of step 1 held back, save(1) still returned ...
        assert r["latest_after_first_call"] == 0, r
        # ... the next save first waited for it, which was then committed (and step 2's
        # commit, held back in turn, had not happened yet) ...
        assert r["latest_after_second_call"] == 1, r
        # ... and the staged copy was a real copy: mutating the live tensors after
        # save() returned did not leak into the checkpoint being written
        assert r["step1_on_disk"] == r["before_mutation"] != r["after_mutation"]
        assert r["step2_on_disk"] == r["after_mutation"]
        # the agent hears of each save with an estimate, and of its end with 0
        assert len(r["announced_first"]) == 2 and r["announced_first"][0] > 0
        assert r["announced_first"][1] == 0 and r["announced"][-1] == 0
        # keep=2: step 0 was pruned after step 2 was committed
        assert r["dirs"] == ["step-000000000001", "step-000000000002"]


def test_inplace_change_during_background_copy_fails_the_save(tmp_path):
    root = str(tmp_path / "ckpt")
    for r in run(tmp_path, 2, {"task": "inplace_guard", "root": root}):
        # forward passes and optimizer steps during the copy: committed, and what was
        # written is the state as of save(), BatchNorm buffers included
        assert r["latest_after_good"] == 1
        assert r["step1_on_disk"] == r["before"]
        # a parameter changed in place by the script: the save fails loudly, naming why
        assert r["error"] is not None and "modified in place" in r["error"], r
        assert "optimizer.step()" in r["error"], r
        assert r["latest_after_bad"] == 1 and r["hidden_after_bad"] == []
        assert r["latest_after_retry"] == 3


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
    crashed = launch(tmp_path, 2, [{"id": "crash", "task": "crash", "root": root,
                                    "failpoint": name, "async_save": async_save, "keep": keep,
                                    "log": commit_log.spec}],
                     crash_expected=True, round_number=1)
    # the failpoint itself ended the run, not some other error
    assert crashed[0].returncode == 1, crashed[0].stderr[-3000:]
    assert f"elastic failpoint {name}: exit" in crashed[0].stderr
    assert all(r.returncode != 0 for r in crashed)

    restored = run(tmp_path, 2, {"task": "check_restore", "root": root, "keep": keep,
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


@pytest.mark.parametrize("kind", ["truncate", "bitflip"])
def test_damaged_latest_falls_back_to_previous(tmp_path, kind):
    root = str(tmp_path / "ckpt")
    saved = run(tmp_path, 2, {"task": "two_saves", "root": root})
    path = damage(os.path.join(root, "step-000000000002"), kind)
    ranks = launch(tmp_path, 2, [{"id": "check", "task": "check_restore", "root": root}])
    for before, after in zip(saved, (r.results["check"] for r in ranks)):
        assert after["start"] == 2, after
        assert after["digest"] == before["digest"]
        assert after["latest_after_save"] == 2  # the damaged latest was replaced
        assert after["verify_after_save"] == {"step-000000000001": True,
                                              "step-000000000002": True}
    word = "truncated" if kind == "truncate" else "corrupt: CRC-32"
    warnings = [line for line in ranks[0].stderr.splitlines()
                if line.startswith("WARNING") and path in line]
    assert warnings and word in warnings[0], "the warning must name the damaged file and why"


def check_enospc(ranks: list[dict], failing_rank: int | None) -> None:
    for r in ranks:
        assert r["errno"] == 28, r
        assert "No space left on device" in r["error"] and ".tmp-step-2-round-0" in r["error"], r
        if failing_rank is not None:
            assert f"on rank {failing_rank}" in r["error"], r
        assert r["latest_after_failure"] == 1 and r["step1_verifies_after_failure"]
        assert r["hidden_after_failure"] == []
        assert r["latest_after_retry"] == 3  # training went on and saved again


@pytest.mark.skipif(_TORCH < (2, 7), reason="on torch 2.6 the test's own ballast file cannot "
                    "be created on the tmpfs (ENOSPC with 1.9 MB free, not understood); "
                    "test_enospc_injected_on_one_rank covers ENOSPC there")
def test_enospc_on_a_full_tmpfs(tmp_path):
    disk = str(tmp_path / "tiny-disk")
    why_not = mount_tmpfs(disk, "2m")
    if why_not is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why_not}); "
                    f"test_enospc_injected_on_one_rank covers ENOSPC by failpoint")
    try:
        ranks = run(tmp_path, 2, {"task": "enospc", "root": os.path.join(disk, "ckpt"),
                                  "fill": disk})
    finally:
        subprocess.run(["umount", "-l", disk], check=False)
    check_enospc(ranks, failing_rank=None)


def test_enospc_injected_on_one_rank(tmp_path):
    ranks = run(tmp_path, 2, {"task": "enospc", "root": str(tmp_path / "ckpt"), "fill": None})
    check_enospc(ranks, failing_rank=1)


@BOTH_LOGS
def test_fenced_commit_leaves_latest_in_place(tmp_path, commit_log):
    commit_log.start_round(3)
    for r in run(tmp_path, 2, {"task": "fenced", "root": str(tmp_path / "ckpt"),
                               "log": commit_log.spec}):
        assert "refused" in r["fenced_error"] and "round 2" in r["fenced_error"], r
        assert r["latest_after_fence"] == {"step": 1, "round": 3}
        assert r["zombie_dir_exists"] and r["zombie_dir_marked"] is False
        assert r["restored_start"] == 2 and r["restored_digest"] == r["digest_step1"]
        assert r["latest_after_resave"] == {"step": 2, "round": 3}


@BOTH_LOGS
def test_a_zombie_never_replaces_a_directory_of_the_current_round(tmp_path, commit_log):
    commit_log.start_round(3)
    for r in run(tmp_path, 2, {"task": "zombie", "root": str(tmp_path / "ckpt"),
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


# =====================================================================================
# The worker side: tasks that one rank runs
# =====================================================================================


def fingerprint(obj) -> str:
    """A digest of tensors and plain values, independent of memory layout."""
    import torch

    h = hashlib.sha256()

    def feed(value):
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            h.update(b"{")
            for key in sorted(value, key=str):
                h.update(str(key).encode() + b":")
                feed(value[key])
            h.update(b"}")
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for item in value:
                feed(item)
            h.update(b"]")
        else:
            h.update(repr(value).encode())

    feed(obj)
    return h.hexdigest()[:24]


class GatedCommitLog(CommitLog):
    """A commit log whose commit of a step waits until the test opens that step's gate,
    so "save() returned before its commit" is an observation, not a timing."""

    GATE_TIMEOUT_S = 30.0

    def __init__(self, inner: CommitLog):
        self.inner = inner
        self._opened: set[int] = set()
        self._cond = threading.Condition()

    def open(self, step: int) -> None:
        with self._cond:
            self._opened.add(step)
            self._cond.notify_all()

    def commit(self, entry: CommitEntry) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: entry.step in self._opened,
                                       timeout=self.GATE_TIMEOUT_S):
                raise AssertionError(f"the test never opened the commit of step {entry.step}")
        self.inner.commit(entry)

    def latest(self) -> CommitEntry | None:
        return self.inner.latest()


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


def hidden_entries(root) -> list[str]:
    return sorted(n for n in os.listdir(str(root)) if n.startswith("."))


def step_dirs(root) -> dict[str, bool]:
    """Every checkpoint directory under ``root``, and whether it carries a COMMITTED marker."""
    from elastic.checkpoint import layout

    return {d.name: d.marked for d in layout.list_checkpoints(str(root))}


def tree_state(directory: str) -> dict:
    """A directory's identity and every file's bytes (digested): equal means untouched."""
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = hashlib.sha256(f.read()).hexdigest()
    return {"inode": os.stat(directory).st_ino, "files": files}


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)


class Worker:
    """One rank: builds models, trains a little, saves and restores."""

    def __init__(self):
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self._stores: dict[str, object] = {}
        dist.init_process_group("gloo", init_method=f"file://{os.environ['CKPT_TEST_STORE']}",
                                rank=self.rank, world_size=self.world_size)

    # --- models and training ------------------------------------------------------------

    def ddp(self, init_seed: int = 0, width: int = 32, depth: int = 1):
        import torch
        from torch import nn

        torch.manual_seed(init_seed)
        layers = [nn.Linear(16, width), nn.Tanh(), nn.Dropout(0.2)]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers, nn.Linear(width, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    @staticmethod
    def train(model, opt, sched=None, steps: int = 1, in_features: int = 16):
        """Steps that consume torch's and python's RNGs (data, dropout, noise scale)."""
        import torch

        for _ in range(steps):
            x = torch.randn(8, in_features) * (1.0 + random.random())
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()

    def checkpointer(self, root, model, opt=None, sched=None, log=None, **kwargs):
        """A Checkpointer committing to the log that ``log`` (a task's spec) names."""
        from elastic.checkpoint import Checkpointer

        kwargs.setdefault("commit_log", self.commit_log(root, log))
        return Checkpointer(root, model=model, optimizer=opt, scheduler=sched, **kwargs)

    def commit_log(self, root, log) -> CommitLog:
        """The file log in ``root`` (``log`` None), else the job's log in etcd."""
        from elastic.checkpoint import EtcdCommitLog, FileCommitLog
        from elastic.clock import SYSTEM_CLOCK
        from elastic.keyspace import JobKeys
        from elastic.store.etcd import EtcdStore

        if log is None:
            return FileCommitLog(root)
        if log["endpoint"] not in self._stores:
            self._stores[log["endpoint"]] = EtcdStore(log["endpoint"])
        return EtcdCommitLog(self._stores[log["endpoint"]], JobKeys(log["job_id"]),
                             SYSTEM_CLOCK, writer=f"rank-{self.rank}")

    def latest(self, root, log) -> dict | None:
        entry = self.commit_log(root, log).latest()
        return entry.to_dict() if entry is not None else None

    def close(self) -> None:
        for store in self._stores.values():
            store.close()

    @staticmethod
    def ddp_digest(model, opt, sched=None) -> str:
        return fingerprint([model.module.state_dict(), opt.state_dict(),
                            sched.state_dict() if sched is not None else None])

    # --- tasks --------------------------------------------------------------------------

    def task_ddp(self, root, save_at):
        """Train steps 0..5. The reference run saves (async) after step ``save_at`` and
        trains on while it is written; the resumed run (``save_at`` None) starts from
        another init and other RNG seeds, restores, and must end bitwise identical."""
        import torch

        fresh = save_at is not None
        model, opt, sched = self.ddp(init_seed=0 if fresh else 12345)
        seed_all((100 if fresh else 900) + self.rank)
        ckpt = self.checkpointer(root, model, opt, sched)
        start = ckpt.restore()
        for step in range(start, 6):
            self.train(model, opt, sched)
            if step == save_at:
                ckpt.save(step, data_state={"rank": self.rank, "samples": 8 * (step + 1)},
                          extras={"note": "hello", "rank": self.rank})
        ckpt.close()
        return {"start": start, "digest": self.ddp_digest(model, opt, sched),
                "torch_rand": torch.rand(3).tolist(), "py_rand": random.random(),
                "restored_data_state": ckpt.data_state, "restored_extras": ckpt.extras}

    def task_fsdp(self, root, save, saves: int = 1):
        """Restore, then (``save``) train and save ``saves`` steps, 1 to ``saves``; the
        full state as a fingerprint per key, after each save (``full_at``) and at the end."""
        import torch
        from torch import nn
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0 if save else 4242)
        # 7 output rows: shards of uneven size at world sizes 2 and 3
        model = nn.Sequential(nn.Linear(8, 18), nn.ReLU(), nn.Linear(18, 7))
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        ckpt = self.checkpointer(root, model, opt)
        start = ckpt.restore()
        full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)

        def fingerprints() -> dict:
            state = {**{f"model.{k}": v
                        for k, v in get_model_state_dict(model, options=full).items()},
                     **{f"optim.{k}": v for k, v in
                        get_optimizer_state_dict(model, opt, options=full).items()}}
            return {k: fingerprint(v) for k, v in state.items()}

        full_at = {}
        for step in range(1, saves + 1) if save else ():
            torch.manual_seed(step + self.rank)
            self.train(model, opt, steps=2, in_features=8)
            ckpt.save(step, async_=True)
            full_at[step] = fingerprints()
        ckpt.close()
        return {"start": start, "full": fingerprints(), "full_at": full_at}

    def task_pipeline(self, root, chunks_per_rank, save):
        """Stages are copies of one model that keep only their layers, so FQNs are
        global; rank r owns stages r*c .. r*c+c-1 of world_size*c stages, each with its
        own optimizer and scheduler."""
        import torch
        from torch import nn
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_optimizer_state_dict)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})
                self.head = nn.Linear(8, 3)

            def forward(self, x):
                for layer in self.layers.values():
                    x = torch.tanh(layer(x))
                return self.head(x) if self.head is not None else x

        stages = self.world_size * chunks_per_rank
        chunks, opts, scheds = [], [], []
        for stage in range(self.rank * chunks_per_rank, (self.rank + 1) * chunks_per_rank):
            torch.manual_seed(3 if save else 333)
            chunk = Net()
            for i in range(4):
                if i * stages // 4 != stage:
                    del chunk.layers[str(i)]
            if stage != stages - 1:
                chunk.head = None
            chunks.append(chunk)
            opts.append(torch.optim.AdamW(chunk.parameters(), lr=0.02))
            scheds.append(torch.optim.lr_scheduler.StepLR(opts[-1], step_size=1, gamma=0.9))
        ckpt = self.checkpointer(root, chunks, opts, scheds)
        start = ckpt.restore()
        if save:
            torch.manual_seed(5 + self.rank)
            for chunk, opt, sched in zip(chunks, opts, scheds):
                self.train(chunk, opt, sched, steps=2, in_features=8)
            ckpt.save(4, async_=False)
        ckpt.close()
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        owned = {}
        for chunk, opt in zip(chunks, opts):
            owned.update({f"model.{k}": fingerprint(v) for k, v in chunk.state_dict().items()})
            owned.update({f"optim.{k}": fingerprint(v) for k, v in
                          get_optimizer_state_dict(chunk, opt, options=flat).items()})
        return {"start": start, "owned": owned}

    def task_async(self, root):
        """Commits are held back by a gate that this task opens, so whether save()
        waited for a commit is seen in the log, never inferred from a duration."""
        import torch
        import torch.distributed as dist

        model, opt, sched = self.ddp(width=1024, depth=4)  # ~3.2 M params, ~38 MB with Adam
        self.train(model, opt, sched, steps=1)
        announced = []
        gate = GatedCommitLog(self.commit_log(root, None))
        ckpt = self.checkpointer(root, model, opt, sched, keep=2, on_saving=announced.append,
                                 commit_log=gate)
        gate.open(0)
        ckpt.save(0)
        ckpt.wait()
        announced_first = list(announced)

        before = self.ddp_digest(model, opt)
        ckpt.save(1)  # its commit cannot happen until the gate of step 1 opens
        latest_after_first_call = gate.latest().step
        dist.barrier()  # only rank 0 commits: every rank has looked before its gate opens
        # an optimizer step (the only in-place change allowed while the copy to CPU may
        # still run: it waits for the copy), while step 1 is being written
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
        after = self.ddp_digest(model, opt)
        # save(2) must first wait for step 1, whose gate opens a little later
        threading.Timer(0.3, gate.open, args=(1,)).start()
        ckpt.save(2)
        latest_after_second_call = gate.latest().step
        dist.barrier()
        gate.open(2)
        ckpt.wait()
        ckpt.close()
        return {"announced_first": announced_first, "announced": announced,
                "dirs": sorted(n for n in os.listdir(root) if n.startswith("step-")),
                "latest_after_first_call": latest_after_first_call,
                "latest_after_second_call": latest_after_second_call,
                "before_mutation": before, "after_mutation": after,
                "step1_on_disk": self._digest_on_disk(root, 1),
                "step2_on_disk": self._digest_on_disk(root, 2)}

    def _digest_on_disk(self, root, step):
        """Load one checkpoint directory's model and optimizer into a fresh model."""
        import torch.distributed.checkpoint as dcp
        from elastic.checkpoint import layout, state

        model, opt, _ = self.ddp(init_seed=99, width=1024, depth=4)
        chunks = state.make_chunks(model, opt)
        tensors = state.collect(chunks)
        dcp.load(tensors.state_dict, checkpoint_id=os.path.join(root, layout.step_dir_name(step)))
        state.apply(chunks, tensors)
        return self.ddp_digest(model, opt)

    def task_crash(self, root, failpoint, async_save, keep, log, task_id):
        """Commit step 1, report it, then crash while saving step 2."""
        model, opt, sched = self.ddp()
        seed_all(self.rank)
        ckpt = self.checkpointer(root, model, opt, sched, log=log, keep=keep)
        assert ckpt.restore() == 0
        self.train(model, opt, sched, steps=2)
        ckpt.save(1, data_state={"step": 1}, async_=False)
        digests = {"digest_step1": self.ddp_digest(model, opt, sched)}
        emit(task_id, digests)
        self.train(model, opt, sched)
        digests["digest_step2"] = self.ddp_digest(model, opt, sched)
        emit(task_id, digests)
        os.environ["ELASTIC_FAILPOINT"] = failpoint
        ckpt.save(2, data_state={"step": 2}, async_=async_save)
        self.train(model, opt, sched)
        ckpt.wait()
        return {"survived": True}

    def task_inplace_guard(self, root):
        """Async saves whose background copy is slowed by 0.5 s: forward passes (which
        change BatchNorm buffers) and optimizer steps during the copy are fine; an
        in-place change of a parameter by anything but the optimizer fails the save."""
        import torch
        from torch import nn
        from elastic.checkpoint import CheckpointError, FileCommitLog

        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        ckpt = self.checkpointer(root, model, opt)
        self.train(model, opt)
        ckpt.save(0, async_=False)
        os.environ["ELASTIC_FAILPOINT"] = "ckpt.stage=sleep:0.5"
        try:
            self.train(model, opt)
            before = self._replicated_digest(model.module, opt)
            ckpt.save(1)
            self.train(model, opt, steps=2)  # forward changes buffers; step() waits
            ckpt.wait()
            latest_after_good = FileCommitLog(root).latest().step
            on_disk = self._digest_on_disk_of(root, 1, model, opt)
            # the change below must land while the copy is still held back: a window
            # far longer than any stall of this thread on a loaded machine
            os.environ["ELASTIC_FAILPOINT"] = "ckpt.stage=sleep:3.0"
            ckpt.save(2)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.999)  # e.g. weight decay by hand: not allowed before the step
            error = None
            try:
                ckpt.wait()
            except CheckpointError as exc:
                error = str(exc)
        finally:
            del os.environ["ELASTIC_FAILPOINT"]
        latest_after_bad = FileCommitLog(root).latest().step
        hidden = hidden_entries(root)
        self.train(model, opt)
        ckpt.save(3)
        ckpt.close()
        return {"latest_after_good": latest_after_good,
                "before": before, "step1_on_disk": on_disk, "error": error,
                "latest_after_bad": latest_after_bad, "hidden_after_bad": hidden,
                "latest_after_retry": FileCommitLog(root).latest().step}

    def _digest_on_disk_of(self, root, step, model, opt):
        """Digest of a checkpoint loaded into a copy of ``model`` and ``opt``."""
        import copy

        import torch
        import torch.distributed.checkpoint as dcp
        from elastic.checkpoint import layout, state

        twin = copy.deepcopy(model.module)
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
        twin_opt.load_state_dict(opt.state_dict())
        chunks = state.make_chunks(twin, twin_opt)
        tensors = state.collect(chunks)
        dcp.load(tensors.state_dict, checkpoint_id=os.path.join(root, layout.step_dir_name(step)))
        state.apply(chunks, tensors)
        return self._replicated_digest(twin, twin_opt)

    @staticmethod
    def _replicated_digest(module, opt) -> str:
        """Digest without BatchNorm's running statistics: each DDP rank has its own
        (from its own batches), and DCP writes one rank's copy of replicated tensors.
        ``num_batches_tracked`` stays: equal on all ranks, and changed by forward."""
        return fingerprint([{k: v for k, v in module.state_dict().items()
                             if ".running_" not in k}, opt.state_dict()])

    def task_two_saves(self, root):
        model, opt, sched = self.ddp()
        seed_all(self.rank)
        ckpt = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched, steps=2)
        ckpt.save(1, data_state={"step": 1}, async_=False)
        digest = self.ddp_digest(model, opt, sched)
        self.train(model, opt, sched)
        ckpt.save(2, data_state={"step": 2}, async_=False)
        ckpt.close()
        return {"digest": digest}

    def task_check_restore(self, root, keep=3, log=None):
        """Restore in a fresh process, then go on training and save the next step."""
        from elastic.checkpoint import layout

        model, opt, sched = self.ddp(init_seed=31337)
        seed_all(1000 + self.rank)
        ckpt = self.checkpointer(root, model, opt, sched, log=log, keep=keep)
        start = ckpt.restore()
        digest = self.ddp_digest(model, opt, sched)
        data_state = ckpt.data_state
        self.train(model, opt, sched)
        ckpt.save(start, data_state={"step": start}, async_=False)
        ckpt.close()
        dirs = step_dirs(root)
        return {"start": start, "digest": digest, "data_state": data_state,
                "latest_after_save": self.latest(root, log)["step"],
                "dirs_after_save": dirs, "hidden_after_save": hidden_entries(root),
                "verify_after_save": {name: layout.verify(os.path.join(root, name)) == []
                                      for name in dirs}}

    def task_enospc(self, root, fill):
        """Commit step 1; fill the disk (``fill``: the tmpfs mount) or inject ENOSPC on
        rank 1; fail step 2; check; free the space; train on and commit step 3."""
        import torch.distributed as dist
        from elastic.checkpoint import layout
        from elastic.errors import CheckpointWriteError

        model, opt, sched = self.ddp()
        seed_all(self.rank)
        ckpt = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched)
        ckpt.save(1, async_=False)
        ballast = None
        if fill is None:
            os.environ["ELASTIC_FAILPOINT"] = "ckpt.write@1=oserror:ENOSPC"
        elif self.rank == 0:
            ballast = os.path.join(fill, "ballast")
            fill_disk(ballast, leave_bytes=8192)
        dist.barrier()
        self.train(model, opt, sched)
        error, code = None, None
        try:
            ckpt.save(2)
            self.train(model, opt, sched)  # training goes on while the save fails
            ckpt.wait()
        except CheckpointWriteError as exc:
            error, code = str(exc), exc.errno
        dist.barrier()
        result = {"error": error, "errno": code,
                  "latest_after_failure": self.latest(root, None)["step"],
                  "step1_verifies_after_failure":
                      layout.verify(os.path.join(root, layout.step_dir_name(1))) == [],
                  "hidden_after_failure": hidden_entries(root)}
        if ballast is not None:
            os.unlink(ballast)
        os.environ.pop("ELASTIC_FAILPOINT", None)
        dist.barrier()
        self.train(model, opt, sched)
        ckpt.save(3, async_=False)
        ckpt.close()
        result["latest_after_retry"] = self.latest(root, None)["step"]
        return result

    def task_fenced(self, root, log):
        """Round 3 commits step 1; a zombie of round 2 tries step 2 and is fenced off;
        round 3 restores step 1 and commits step 2 over the zombie's directory."""
        from elastic.checkpoint import layout
        from elastic.errors import FencedError

        model, opt, sched = self.ddp()
        seed_all(self.rank)
        os.environ["ELASTIC_ROUND"] = "3"
        current = self.checkpointer(root, model, opt, sched, log=log)
        self.train(model, opt, sched)
        current.save(1, async_=False)
        digest = self.ddp_digest(model, opt, sched)
        current.close()

        os.environ["ELASTIC_ROUND"] = "2"
        zombie = self.checkpointer(root, model, opt, sched, log=log)
        self.train(model, opt, sched)
        fenced_error = None
        try:
            zombie.save(2)
            zombie.wait()
        except FencedError as exc:
            fenced_error = str(exc)
        zombie.close()
        latest = self.latest(root, log)
        zombie_dir = os.path.join(root, layout.step_dir_name(2))
        marked = layout.read_marker(zombie_dir) is not None if os.path.isdir(zombie_dir) else None

        os.environ["ELASTIC_ROUND"] = "3"
        model2, opt2, sched2 = self.ddp(init_seed=5)
        again = self.checkpointer(root, model2, opt2, sched2, log=log)
        start = again.restore()
        restored = self.ddp_digest(model2, opt2, sched2)
        again.save(2, async_=False)
        again.close()
        final = self.latest(root, log)
        return {"fenced_error": fenced_error,
                "latest_after_fence": {"step": latest["step"], "round": latest["round"]},
                "zombie_dir_exists": os.path.isdir(zombie_dir), "zombie_dir_marked": marked,
                "restored_start": start, "restored_digest": restored, "digest_step1": digest,
                "latest_after_resave": {"step": final["step"], "round": final["round"]}}

    def task_zombie(self, root, log):
        """Round 3 commits steps 1 and 2; a zombie of round 2 saves step 2 over the latest;
        round 3 commits step 3 and the zombie saves step 2 again, over a committed one;
        round 3 renames step 4 into place but its commit's outcome is unknown, and the
        zombie saves step 4. Each zombie save must leave the directory as it was."""
        from elastic.checkpoint import layout

        model, opt, sched = self.ddp()
        seed_all(self.rank)
        os.environ["ELASTIC_ROUND"] = "3"
        current_log = UnknownOutcomeLog(self.commit_log(root, log))
        current = self.checkpointer(root, model, opt, sched, commit_log=current_log)
        for step in (1, 2):
            self.train(model, opt, sched)
            current.save(step, async_=False)
        os.environ["ELASTIC_ROUND"] = "2"
        zombie = self.checkpointer(root, model, opt, sched, log=log)

        def attempt(step: int) -> dict:
            directory = os.path.join(root, layout.step_dir_name(step))
            result = {"before": tree_state(directory), "latest_before": self.latest(root, log),
                      "error": None, "message": None}
            try:
                zombie.save(step, async_=False)
            except Exception as exc:  # noqa: BLE001 - which error is what the test checks
                result.update(error=type(exc).__name__, message=str(exc))
            result.update(after=tree_state(directory), latest_after=self.latest(root, log))
            return result

        results = {"latest": attempt(2)}
        self.train(model, opt, sched)
        current.save(3, async_=False)
        digest3 = self.ddp_digest(model, opt, sched)
        results["committed"] = attempt(2)
        self.train(model, opt, sched)
        current_log.armed = True
        try:
            current.save(4, async_=False)
        except Exception:  # noqa: BLE001 - the injected failure; its directory stays
            pass
        results["uncommitted"] = attempt(4)
        zombie.close()
        current.close()

        os.environ["ELASTIC_ROUND"] = "3"
        model2, opt2, sched2 = self.ddp(init_seed=5)
        again = self.checkpointer(root, model2, opt2, sched2, log=log)
        results["restored_start"] = again.restore()
        results["restored_digest"] = self.ddp_digest(model2, opt2, sched2)
        results["digest_step3"] = digest3
        again.close()
        return results


def fill_disk(path: str, leave_bytes: int) -> None:
    """Fill the file system holding ``path``, then give back about ``leave_bytes``."""
    chunk = b"\0" * 65536
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    with open(path, "r+b") as f:
        f.truncate(max(0, os.path.getsize(path) - leave_bytes))


def emit(task_id: str, result: dict) -> None:
    sys.stdout.write(json.dumps({"id": task_id, "result": result}) + "\n")
    sys.stdout.flush()


def worker_main(tasks: list[dict]) -> None:
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    worker = Worker()
    for task in tasks:
        args = dict(task)
        task_id, name = args.pop("id"), args.pop("task")
        if name == "crash":
            args["task_id"] = task_id
        try:
            result = getattr(worker, f"task_{name}")(**args)
        except BaseException:
            # A failed task can leave the ranks out of step; the launch ends here.
            sys.stderr.write(f"task {task_id} failed on rank {worker.rank}:\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(3)
        emit(task_id, result)
    worker.close()
    dist.destroy_process_group()
