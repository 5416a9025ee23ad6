"""The harness of the checkpoint integration tests: groups of real worker processes over gloo.

Workers are real processes forked from a multiprocessing *forkserver* that has
imported torch, DCP and this module once: each launch then costs a fork and a
gloo rendezvous instead of seconds of ``import torch`` per rank on 2 cores. Each
forked worker is a fresh process (nothing of earlier launches is in it). A worker
runs a list of tasks and writes one JSON line per finished task to its stdout
file, so a test still sees what a worker did before an injected crash.

A task is a function ``task_x(w: Worker, **args)`` written beside the test that
runs it (the scenario and its fault next to the assertions); it runs on every
rank and returns what the test asserts on. :class:`Worker` holds what every
scenario needs: the process group, small models, training steps, a
Checkpointer over the commit log the task names.

Where a scenario involves the commit log, it runs twice: with the file beside the
checkpoints (``FileCommitLog``) and with the job's fenced etcd record
(``EtcdCommitLog`` on the session's real etcd server, what the agent keeps):
:data:`BOTH_LOGS` and the ``commit_log`` fixture.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import multiprocessing
import os
import random
import sys
import time
import traceback
import uuid

import pytest

from elastic import worker_env
from elastic.checkpoint.api import CommitLog

TORCH_VERSION = tuple(int(part) for part in
               importlib.metadata.version("torch").split("+")[0].split(".")[:2])
# torch 2.6's own FSDP2 all-gather calls Stream.record_event, which its CPU stream
# lacks; on CUDA it runs (tools/gpu_check.py reshards FSDP2 from a GPU).
fsdp2_on_cpu = pytest.mark.skipif(TORCH_VERSION < (2, 7), reason="torch 2.6's FSDP2 cannot run on "
                                  "the CPU ('Stream' object has no attribute 'record_event')")

LAUNCH_TIMEOUT_S = 60.0


def _process_entry(rank: int, world_size: int, store: str, tasks: list[dict], out_path: str,
                   err_path: str, round_number: int) -> None:
    """The forked worker's first code: its own stdout/stderr files and environment."""
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    for name in ("ELASTIC_FAILPOINT", worker_env.AGENT_SOCKET, worker_env.CHECKPOINT_DIR):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), CKPT_TEST_STORE=store,
                      **{worker_env.ROUND: str(round_number)})
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


def hidden_entries(root) -> list[str]:
    return sorted(n for n in os.listdir(str(root)) if n.startswith("."))


def step_dirs(root) -> dict[str, bool]:
    """Every checkpoint directory under ``root``, and whether it carries a COMMITTED marker."""
    from elastic.checkpoint import layout

    return {d.name: d.marked for d in layout.list_checkpoints(str(root))}


def seed_all(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    random.seed(seed)


class Worker:
    """One rank: its process group, small models, training steps, Checkpointers and the
    commit logs a task names. Tasks (the scenarios) take it as their first argument."""

    def __init__(self):
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self._stores: dict[str, object] = {}
        dist.init_process_group("gloo", init_method=f"file://{os.environ['CKPT_TEST_STORE']}",
                                rank=self.rank, world_size=self.world_size)

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


def task_check_restore(w: Worker, root, keep=3, log=None):
    """Restore in a fresh process, then go on training and save the next step."""
    from elastic.checkpoint import layout

    model, opt, sched = w.ddp(init_seed=31337)
    seed_all(1000 + w.rank)
    ckpt = w.checkpointer(root, model, opt, sched, log=log, keep=keep)
    start = ckpt.restore()
    digest = w.ddp_digest(model, opt, sched)
    data_state = ckpt.data_state
    w.train(model, opt, sched)
    ckpt.save(start, data_state={"step": start}, async_=False)
    ckpt.close()
    dirs = step_dirs(root)
    return {"start": start, "digest": digest, "data_state": data_state,
            "latest_after_save": w.latest(root, log)["step"],
            "dirs_after_save": dirs, "hidden_after_save": hidden_entries(root),
            "verify_after_save": {name: layout.verify(os.path.join(root, name)) == []
                                  for name in dirs}}


def emit(task_id: str, result: dict) -> None:
    sys.stdout.write(json.dumps({"id": task_id, "result": result}) + "\n")
    sys.stdout.flush()


def worker_main(tasks: list[dict]) -> None:
    """Run each task (``task``: its function, ``id``: its name in the results; the
    rest its arguments, and ``task_id`` for a task that emits as it goes)."""
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    worker = Worker()
    for spec in tasks:
        args = dict(spec)
        task_id, task = args.pop("id"), args.pop("task")
        if "task_id" in inspect.signature(task).parameters:
            args["task_id"] = task_id
        try:
            result = task(worker, **args)
        except BaseException:
            # A failed task can leave the ranks out of step; the launch ends here.
            sys.stderr.write(f"task {task_id} failed on rank {worker.rank}:\n"
                             f"{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(3)
        emit(task_id, result)
    worker.close()
    dist.destroy_process_group()
