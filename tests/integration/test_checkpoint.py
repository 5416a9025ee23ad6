"""Checkpoints with real processes over gloo: bitwise resume, resharding (FSDP2 and
pipeline stages), async saves, crashes at every failpoint, corrupt shards, a full
disk and a fenced commit.

This file is also the worker: ``python test_checkpoint.py TASKS_JSON`` runs a list
of tasks as one rank (RANK, WORLD_SIZE and the store file come from the
environment) and prints one JSON line per finished task, so a test still sees
what a worker did before an injected crash. Launches are the expensive part
(``import torch`` on 2 cores), so each launch runs several tasks.

ENOSPC is tested twice: on a real, tiny tmpfs (``mount -t tmpfs``, which needs
root; when the mount is refused that test is skipped with the reason, never
silently) and by the ``ckpt.write=oserror:ENOSPC`` failpoint on one rank only,
which runs everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
THIS_FILE = os.path.abspath(__file__)
LAUNCH_TIMEOUT_S = 60.0


# =====================================================================================
# The test side: launching groups of worker processes
# =====================================================================================


class Rank:
    """What one worker process did: exit code, the JSON lines it printed, its stderr."""

    def __init__(self, rank: int, returncode: int, results: list, stderr: str):
        self.rank = rank
        self.returncode = returncode
        self.results = results
        self.stderr = stderr

    def __repr__(self) -> str:
        return f"Rank({self.rank}, rc={self.returncode}, results={self.results})"


def launch(workdir, world_size: int, tasks: list[dict], *, env: dict | None = None,
           expect_ok: bool = True) -> list[Rank]:
    """Run ``tasks`` in ``world_size`` fresh worker processes joined over gloo."""
    workdir = str(workdir)
    tag = uuid.uuid4().hex[:8]
    store = os.path.join(workdir, f"store-{tag}")
    procs = []
    for rank in range(world_size):
        child_env = dict(os.environ, PYTHONPATH=REPO, RANK=str(rank), WORLD_SIZE=str(world_size),
                         CKPT_TEST_STORE=store, ELASTIC_ROUND="0", OMP_NUM_THREADS="1")
        child_env.pop("ELASTIC_FAILPOINT", None)
        child_env.update(env or {})
        out = open(os.path.join(workdir, f"{tag}-{rank}.out"), "w+")
        err = open(os.path.join(workdir, f"{tag}-{rank}.err"), "w+")
        proc = subprocess.Popen([sys.executable, THIS_FILE, json.dumps(tasks)], cwd=REPO,
                                env=child_env, stdout=out, stderr=err)
        procs.append((proc, out, err))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    ranks = []
    for rank, (proc, out, err) in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        results = [json.loads(line) for line in out.read().splitlines() if line.startswith("{")]
        ranks.append(Rank(rank, proc.returncode, results, err.read()))
        out.close()
        err.close()
    if expect_ok:
        for r in ranks:
            assert r.returncode == 0, f"rank {r.rank} failed (rc {r.returncode}):\n{r.stderr[-4000:]}"
    return ranks


def committed_latest(root) -> dict | None:
    path = os.path.join(str(root), "latest")
    return json.load(open(path)) if os.path.exists(path) else None


def hidden_entries(root) -> list[str]:
    return sorted(n for n in os.listdir(str(root)) if n.startswith("."))


# =====================================================================================
# Tests
# =====================================================================================


def test_ddp_resume_is_bitwise_identical(tmp_path):
    root = tmp_path / "ckpt"
    reference = launch(tmp_path, 2, [{"task": "ddp", "root": str(root), "save_at": 2}])
    resumed = launch(tmp_path, 2, [{"task": "ddp", "root": str(root), "save_at": None}])
    for ref, res in zip(reference, resumed):
        ref, res = ref.results[0], res.results[0]
        assert ref["start"] == 0 and res["start"] == 3
        assert res["digest"] == ref["digest"], "weights/optimizer/scheduler differ after resume"
        assert res["torch_rand"] == ref["torch_rand"] and res["py_rand"] == ref["py_rand"]
        assert res["restored_data_state"] == {"rank": ref["rank"], "samples": 24}
        assert res["restored_extras"] == {"note": "hello", "rank": ref["rank"]}
    # each rank got its own RNG back, not rank 0's
    assert reference[0].results[0]["torch_rand"] != reference[1].results[0]["torch_rand"]
    assert committed_latest(root)["step"] == 2


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    """FSDP2 and pipeline checkpoints saved at one world size and loaded at others."""
    work = tmp_path_factory.mktemp("reshard")
    fsdp, pp2, pp1 = (str(work / name) for name in ("fsdp", "pp-2-ranks", "pp-1-rank"))
    saved2 = launch(work, 2, [{"task": "fsdp", "root": fsdp, "save": True},
                              {"task": "pipeline", "root": pp2, "chunks_per_rank": 1, "save": True}])
    one = launch(work, 1, [{"task": "fsdp", "root": fsdp, "save": False},
                           {"task": "pipeline", "root": pp2, "chunks_per_rank": 2, "save": False},
                           {"task": "pipeline", "root": pp1, "chunks_per_rank": 2, "save": True}])
    three = launch(work, 3, [{"task": "fsdp", "root": fsdp, "save": False}])
    two = launch(work, 2, [{"task": "pipeline", "root": pp1, "chunks_per_rank": 1, "save": False}])
    return {"saved2": saved2, "one": one, "three": three, "two": two}


def test_fsdp2_reshards_from_2_to_1_and_3_ranks(reshard):
    saved = reshard["saved2"][0].results[0]
    assert saved["start"] == 0
    for name in ("one", "three"):
        for rank in reshard[name]:
            loaded = rank.results[0]
            assert loaded["start"] == 2
            assert loaded["full"] == saved["full"], f"world size {len(reshard[name])} differs"


def _union(ranks, index):
    merged = {}
    for rank in ranks:
        merged.update(rank.results[index]["owned"])
    return merged


def test_pipeline_2_stages_load_into_1_rank(reshard):
    saved = _union(reshard["saved2"], 1)
    assert any(k.startswith("model.head.") for k in saved) and any(k.startswith("optim.state.") for k in saved)
    assert reshard["one"][0].results[1]["start"] == 5
    assert _union(reshard["one"], 1) == saved


def test_pipeline_1_rank_loads_into_2_stages(reshard):
    saved = _union(reshard["one"], 2)
    assert [r.results[0]["start"] for r in reshard["two"]] == [5, 5]
    owned = [set(r.results[0]["owned"]) for r in reshard["two"]]
    assert owned[0] and owned[1] and not owned[0] & owned[1], "stages must own disjoint FQNs"
    assert _union(reshard["two"], 0) == saved


def test_async_save_blocks_only_for_staging_and_one_in_flight(tmp_path):
    ranks = launch(tmp_path, 2, [{"task": "async", "root": str(tmp_path / "ckpt")}])
    for rank in ranks:
        r = rank.results[0]
        # Loose: the call returns long before the background write ends.
        assert r["call_s"] < r["total_s"] / 2, r
        # With every write slowed by 1 s, save() still returns at once ...
        assert r["slow_call_s"] < 0.8, r
        # ... the next save waits for it, and finds it committed ...
        assert r["second_call_s"] >= 0.9, r
        assert r["latest_after_second_call"] == 1
        # ... and the staged copy was a real copy: mutating the live tensors after
        # save() returned did not leak into the checkpoint being written.
        assert r["step1_on_disk"] == r["before_mutation"] != r["after_mutation"]
        assert r["step2_on_disk"] == r["after_mutation"]


FAILPOINTS = [  # (failpoint, async save)
    ("ckpt.before_shards", True),
    ("ckpt.mid_write", False),
    ("ckpt.after_shards_before_commit", True),
    ("ckpt.after_rename_before_commit_log", False),
]
CORRUPTIONS = ["truncate", "bitflip"]


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """Crash a save at each failpoint; corrupt the latest checkpoint; then restore all."""
    work = tmp_path_factory.mktemp("crash")
    crashed = {}
    for name, async_ in FAILPOINTS:
        root = str(work / name)
        crashed[name] = launch(work, 2, [{"task": "crash", "root": root, "failpoint": name,
                                          "async": async_}], expect_ok=False)
        crashed[name] = (root, crashed[name])
    corrupt_roots = {kind: str(work / kind) for kind in CORRUPTIONS}
    two = launch(work, 2, [{"task": "two_saves", "root": root} for root in corrupt_roots.values()])
    damaged = {}
    for kind, root in corrupt_roots.items():
        damaged[kind] = _damage(os.path.join(root, "step-000000000002"), kind)
    roots = [root for root, _ in crashed.values()] + list(corrupt_roots.values())
    restored = launch(work, 2, [{"task": "check_restore", "root": root} for root in roots])
    results = {}
    for index, (name, (root, ranks)) in enumerate(crashed.items()):
        results[name] = {"root": root, "crashed": ranks,
                         "restored": [r.results[index] for r in restored]}
    for offset, kind in enumerate(CORRUPTIONS):
        index = len(crashed) + offset
        results[kind] = {"root": corrupt_roots[kind], "damaged": damaged[kind],
                         "saved": [r.results[offset] for r in two],
                         "restored": [r.results[index] for r in restored],
                         "stderr": restored[0].stderr}
    return results


def _damage(directory: str, kind: str) -> str:
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


@pytest.mark.parametrize("name", [name for name, _ in FAILPOINTS])
def test_crash_at_failpoint_restores_previous_checkpoint(crashes, name):
    case = crashes[name]
    crashed = case["crashed"]
    # the failpoint itself ended the run (not some other error)
    assert crashed[0].returncode == 1 and f"elastic failpoint {name}: exit" in crashed[0].stderr
    assert all(r.results[0]["saved_step"] == 1 for r in crashed)
    for rank, restored in zip(crashed, case["restored"]):
        assert restored["start"] == 2, restored
        assert restored["digest"] == rank.results[0]["digest"], "the previous checkpoint is not complete"
        assert restored["data_state"] == {"step": 1}
        # training goes on: the same step saves again, over whatever the crash left
        assert restored["latest_after_save"] == 2
        assert restored["hidden_after_save"] == []
        assert restored["step1_verifies"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_damaged_latest_falls_back_to_previous(crashes, kind):
    case = crashes[kind]
    for saved, restored in zip(case["saved"], case["restored"]):
        assert restored["start"] == 2, restored
        assert restored["digest"] == saved["digest_step1"]
        assert restored["latest_after_save"] == 2  # the damaged latest was replaced
        assert restored["step1_verifies"]
    assert case["damaged"] in case["stderr"], "the warning must name the damaged file"
    word = "truncated" if kind == "truncate" else "corrupt: CRC-32"
    assert any(case["damaged"] in line and word in line and "WARNING" in line
               for line in case["stderr"].splitlines())


def _mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a tmpfs; None on success, else why not."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        return "no mount command"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"mount exited {proc.returncode}")


def _check_enospc(ranks, root):
    for rank in ranks:
        r = rank.results[0]
        assert r["errno"] == 28, r
        assert "No space left on device" in r["error"] and ".tmp-step-2-round-0" in r["error"], r
        assert r["latest_after_failure"] == 1 and r["step1_verifies_after_failure"]
        assert r["hidden_after_failure"] == []
        assert r["latest_after_retry"] == 3  # training went on and saved again
    assert committed_latest(root)["step"] == 3


def test_enospc_on_a_full_tmpfs(tmp_path):
    mount_point = str(tmp_path / "tiny-disk")
    why_not = _mount_tmpfs(mount_point, "2m")
    if why_not is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why_not}); "
                    f"test_enospc_injected_on_one_rank covers ENOSPC by failpoint")
    try:
        root = os.path.join(mount_point, "ckpt")
        ranks = launch(tmp_path, 2, [{"task": "enospc", "root": root, "fill": mount_point}])
        _check_enospc(ranks, root)
    finally:
        subprocess.run(["umount", "-l", mount_point], check=False)


def test_enospc_injected_on_one_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = launch(tmp_path, 2, [{"task": "enospc", "root": root, "fill": None}])
    _check_enospc(ranks, root)
    assert "on rank 1" in ranks[0].results[0]["error"]


def test_fenced_commit_leaves_latest_in_place(tmp_path):
    root = str(tmp_path / "ckpt")
    ranks = launch(tmp_path, 2, [{"task": "fenced", "root": root}])
    for rank in ranks:
        r = rank.results[0]
        assert "refused" in r["fenced_error"]
        assert r["latest_after_fence"] == {"step": 1, "round": 3}
        assert r["zombie_dir_marked"] is False
        assert r["restored_start"] == 2 and r["restored_digest"] == r["digest_step1"]
        assert r["latest_after_resave"] == {"step": 2, "round": 3}


# =====================================================================================
# The worker side
# =====================================================================================


def _fingerprint(obj) -> str:
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


class Worker:
    """One rank: builds models, trains a little, saves and restores."""

    def __init__(self):
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"file://{os.environ['CKPT_TEST_STORE']}",
                                rank=self.rank, world_size=self.world_size)

    # --- models -------------------------------------------------------------------------

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
        import torch

        for _ in range(steps):
            x = torch.randn(8, in_features) * (1.0 + random.random())
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()

    def checkpointer(self, root, model, opt=None, sched=None, **kwargs):
        from elastic.checkpoint import Checkpointer

        return Checkpointer(root, model=model, optimizer=opt, scheduler=sched, **kwargs)

    def ddp_digest(self, model, opt, sched=None) -> str:
        return _fingerprint([model.module.state_dict(), opt.state_dict(),
                             sched.state_dict() if sched is not None else None])

    # --- tasks --------------------------------------------------------------------------

    def task_ddp(self, root, save_at):
        """Train steps 0..5; the reference run saves (async) after step ``save_at`` and
        trains on while it is written; the resumed run starts from a different init
        and different RNG seeds and must end bitwise identical."""
        import torch

        fresh = save_at is not None
        torch.manual_seed((100 if fresh else 900) + self.rank)
        random.seed((7 if fresh else 77) + self.rank)
        model, opt, sched = self.ddp(init_seed=0 if fresh else 12345)
        ckpt = self.checkpointer(root, model, opt, sched)
        start = ckpt.restore()
        for step in range(start, 6):
            self.train(model, opt, sched)
            if step == save_at:
                ckpt.save(step, data_state={"rank": self.rank, "samples": 8 * (step + 1)},
                          extras={"note": "hello", "rank": self.rank})
        ckpt.close()
        return {"rank": self.rank, "start": start, "digest": self.ddp_digest(model, opt, sched),
                "torch_rand": torch.rand(3).tolist(), "py_rand": random.random(),
                "restored_data_state": ckpt.data_state, "restored_extras": ckpt.extras}

    def task_fsdp(self, root, save):
        import torch
        from torch import nn
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0 if save else 4242)
        model = nn.Sequential(nn.Linear(8, 18), nn.ReLU(), nn.Linear(18, 7))  # 7 rows: uneven over 2 and 3
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        ckpt = self.checkpointer(root, model, opt)
        start = ckpt.restore()
        if save:
            torch.manual_seed(1 + self.rank)
            self.train(model, opt, steps=2, in_features=8)
            ckpt.save(1, async_=True)
            ckpt.wait()
        ckpt.close()
        full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        state = {**{f"model.{k}": v for k, v in get_model_state_dict(model, options=full).items()},
                 **{f"optim.{k}": v for k, v in
                    get_optimizer_state_dict(model, opt, options=full).items()}}
        return {"start": start, "full": {k: _fingerprint(v) for k, v in state.items()}}

    def task_pipeline(self, root, chunks_per_rank, save):
        """Stages are copies of one model that keep only their layers, so FQNs are
        global; rank r owns stages r*c .. r*c+c-1 out of world_size*c stages."""
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
            owned.update({f"model.{k}": _fingerprint(v) for k, v in chunk.state_dict().items()})
            owned.update({f"optim.{k}": _fingerprint(v) for k, v in
                          get_optimizer_state_dict(chunk, opt, options=flat).items()})
        return {"start": start, "owned": owned}

    def task_async(self, root):
        import torch
        from elastic.checkpoint import FileCommitLog

        model, opt, sched = self.ddp(width=1024, depth=4)  # ~3.2 M params, ~38 MB with Adam
        self.train(model, opt, sched, steps=1)
        ckpt = self.checkpointer(root, model, opt, sched, keep=2)
        started = time.monotonic()
        ckpt.save(0)
        call_s = time.monotonic() - started
        ckpt.wait()
        total_s = time.monotonic() - started

        os.environ["ELASTIC_FAILPOINT"] = "ckpt.write=sleep:1.0"
        before = self.ddp_digest(model, opt)
        started = time.monotonic()
        ckpt.save(1)
        slow_call_s = time.monotonic() - started
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        after = self.ddp_digest(model, opt)
        started = time.monotonic()
        ckpt.save(2)
        second_call_s = time.monotonic() - started
        latest_after_second_call = FileCommitLog(root).latest().step
        ckpt.wait()
        del os.environ["ELASTIC_FAILPOINT"]
        ckpt.close()
        return {"call_s": call_s, "total_s": total_s, "slow_call_s": slow_call_s,
                "second_call_s": second_call_s,
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

    def task_crash(self, root, failpoint, async_=None, **kwargs):
        async_ = kwargs.get("async", async_)
        torch_seed(self.rank)
        model, opt, sched = self.ddp()
        ckpt = self.checkpointer(root, model, opt, sched)
        assert ckpt.restore() == 0
        self.train(model, opt, sched, steps=2)
        ckpt.save(1, data_state={"step": 1}, async_=False)
        emit({"saved_step": 1, "digest": self.ddp_digest(model, opt, sched)})
        self.train(model, opt, sched)
        os.environ["ELASTIC_FAILPOINT"] = failpoint
        ckpt.save(2, data_state={"step": 2}, async_=async_)
        self.train(model, opt, sched)
        ckpt.wait()
        return {"survived": True}

    def task_two_saves(self, root):
        torch_seed(self.rank)
        model, opt, sched = self.ddp()
        ckpt = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched, steps=2)
        ckpt.save(1, data_state={"step": 1}, async_=False)
        digest = self.ddp_digest(model, opt, sched)
        self.train(model, opt, sched)
        ckpt.save(2, data_state={"step": 2}, async_=False)
        ckpt.close()
        return {"digest_step1": digest}

    def task_check_restore(self, root):
        from elastic.checkpoint import layout

        torch_seed(1000 + self.rank)
        model, opt, sched = self.ddp(init_seed=31337)
        ckpt = self.checkpointer(root, model, opt, sched)
        start = ckpt.restore()
        digest = self.ddp_digest(model, opt, sched)
        data_state = ckpt.data_state
        self.train(model, opt, sched)
        ckpt.save(start, data_state={"step": start}, async_=False)
        ckpt.close()
        return {"start": start, "digest": digest, "data_state": data_state,
                "latest_after_save": committed_latest(root)["step"],
                "hidden_after_save": hidden_entries(root),
                "step1_verifies": layout.verify(os.path.join(root, layout.step_dir_name(1))) == []}

    def task_enospc(self, root, fill):
        import torch.distributed as dist
        from elastic.checkpoint import layout
        from elastic.errors import CheckpointWriteError

        torch_seed(self.rank)
        model, opt, sched = self.ddp()
        ckpt = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched)
        ckpt.save(1, async_=False)
        ballast = None
        if fill is not None:
            if self.rank == 0:
                ballast = os.path.join(fill, "ballast")
                _fill_disk(ballast, leave_bytes=8192)
        else:
            os.environ["ELASTIC_FAILPOINT"] = "ckpt.write@1=oserror:ENOSPC"
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
                  "latest_after_failure": committed_latest(root)["step"],
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
        result["latest_after_retry"] = committed_latest(root)["step"]
        return result

    def task_fenced(self, root):
        from elastic.checkpoint import layout
        from elastic.errors import FencedError

        torch_seed(self.rank)
        model, opt, sched = self.ddp()
        os.environ["ELASTIC_ROUND"] = "3"
        current = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched)
        current.save(1, async_=False)
        digest = self.ddp_digest(model, opt, sched)
        current.close()

        os.environ["ELASTIC_ROUND"] = "2"  # a zombie of an older round
        zombie = self.checkpointer(root, model, opt, sched)
        self.train(model, opt, sched)
        fenced_error = None
        try:
            zombie.save(2)
            zombie.wait()
        except FencedError as exc:
            fenced_error = str(exc)
        zombie.close()
        latest = committed_latest(root)
        zombie_dir = os.path.join(root, layout.step_dir_name(2))
        marked = layout.read_marker(zombie_dir) is not None if os.path.isdir(zombie_dir) else None

        os.environ["ELASTIC_ROUND"] = "3"
        model2, opt2, sched2 = self.ddp(init_seed=5)
        again = self.checkpointer(root, model2, opt2, sched2)
        start = again.restore()
        restored = self.ddp_digest(model2, opt2, sched2)
        again.save(2, async_=False)
        again.close()
        final = committed_latest(root)
        return {"fenced_error": fenced_error,
                "latest_after_fence": {"step": latest["step"], "round": latest["round"]},
                "zombie_dir_marked": marked, "restored_start": start,
                "restored_digest": restored, "digest_step1": digest,
                "latest_after_resave": {"step": final["step"], "round": final["round"]}}


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)


def _fill_disk(path: str, leave_bytes: int) -> None:
    """Fill the file system holding ``path``, then give back about ``leave_bytes``."""
    chunk = b"\0" * 65536
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(max(0, size - leave_bytes))


def emit(result: dict) -> None:
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def _worker_main(tasks: list[dict]) -> None:
    import logging
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    worker = Worker()
    for task in tasks:
        args = dict(task)
        name = args.pop("task")
        emit(getattr(worker, f"task_{name}")(**args))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
