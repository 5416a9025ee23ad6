"""Checkpoint benchmark: our Checkpointer against plain torch.distributed.checkpoint (DCP).

Setup (one run, both sides on the same model, the same ranks, the same disk): an MLP
(``--depth`` Linear layers of a width chosen so that parameters + Adam state come to at
least ``--size-mb`` MiB, 224 by default: ~75 MiB of parameters, twice that of Adam
moments), sharded with FSDP2 ``fully_shard`` (every Linear and the root) over a CPU
device mesh of 2 ranks: two processes spawned by this script (torch.multiprocessing,
gloo, one torch thread each on this 2-core machine), so each rank holds half of every
parameter and of its Adam state: its *shard*. Both sides save the same state dict
layout (DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``flatten_optimizer_state_dict``, under the keys ``model`` and ``optim``) with DCP's
``FileSystemWriter`` defaults (one file per rank, fsynced). Checkpoints go to a fresh
directory under /tmp (free space is checked first; the directory is removed at the end).

What is measured:

1. **Training time blocked per save.** Ours: ``ckpt.save(step)`` (async: it returns once
   the shard is staged to CPU memory); the reference: a synchronous ``dcp.save(sd,
   checkpoint_id=...)`` including building ``sd`` (what a training loop pays). One
   warm-up save each, then ``--saves`` (5) of each, interleaved, a training step before
   every save. Per save the slowest rank counts (the next collective waits for it);
   the row is the median. Target: ours <= 10% of the reference. Also: the time from
   ``save()`` returning to ``ckpt.wait()`` returning (the write, verification and
   commit in the background, nothing else running), and breakdowns from the phases
   the checkpoint code reports to a recorder (``elastic.checkpoint.timing``, installed
   in this script's own processes only):
   collect (DCP state-dict helpers) / stage (copy to CPU) in the blocked part;
   prepare / write (dcp.save, whose stream computes the CRC-32s of files and items as
   it writes: "of which CRC-32" is the time in ``layout.crc32``; nothing is read back)
   / verify (manifests, sizes, items against files: no file read) / commit (rename,
   commit log, marker, retention) in the background. The rest of the background time
   is collectives (waiting for the other rank).

2. **Restore with resharding.** Saved by 2 ranks; restored by 2 ranks (no reshard) and
   by 1 rank (a new process, FSDP2 over a 1-rank mesh: resharding). Ours:
   ``ckpt.restore()`` (reads the commit log, verifies manifests and sizes, each rank a
   share of the files, then dcp.load through a reader that checks the CRC-32 of each
   item it reads as it reads it, and puts the state back); the reference: build the
   state dict, ``dcp.load(sd, checkpoint_id=...)``, ``set_model_state_dict`` /
   ``set_optimizer_state_dict``. Median of ``--restores`` (5) of each, interleaved,
   slowest rank. Each restore first shifts every tensor (so the load must write it
   back). Targets: ours <= 1.1x the reference at the same world size, <= 1.2x when
   resharding. Rows for ``Checkpointer(verify_checksums=False)`` (sizes only) are for
   information: they show what the CRC-32 checks cost ("of which CRC-32": the time in
   ``layout.crc32`` during the load). The header names the CRC-32 implementation
   (zlib, or zlib-ng when installed: the same values, several times faster). Each
   restore's CPU seconds (this process's, largest rank) are shown for information:
   on a shared machine they move far less with others' load than wall time. Every
   restore is checked against a fingerprint of the saved
   state (float64 sums of every shard, all-reduced). By default the files are in the
   page cache (they were just written, as on a node that restarts its workers); with
   ``--cold`` there are extra rows after ``posix_fadvise(DONTNEED)`` on every file (as
   cold as it gets without root; on a VM the host may still cache).

3. **Peak extra memory per rank during an async save**, relative to the rank's shard
   size (bytes of its local parameter and optimizer tensors): a thread samples VmRSS
   (/proc/self/statm) every ``--sample-ms`` (2) ms during ``save()`` + ``wait()``; extra =
   max(RSS during) - RSS just before. First save (the stager allocates its CPU copy and
   keeps it for the next saves) and a steady-state save (the copy exists already).
   Before each of these saves the script calls glibc's ``malloc_trim(0)``, so that "RSS
   before" is live memory: without it, buffers freed by the training steps stay resident
   and the staging copy lands in them unseen. Target: <= 1.1x the shard. "after" says
   what stays: RSS after wait() minus before, and the same after another gc +
   malloc_trim. The reference's synchronous save is measured the same way for
   information. VmHWM is reported as a cross-check where it rose (a lifetime peak, so it
   only says something when the save set a new one).

4. **--memory** (instead of 1-3): the memory tier's snapshot cost per step, then one
   step held by both tiers (a memory snapshot and a disk commit of the same state) and
   restores of it, memory and disk interleaved, each a ``restore()`` of a Checkpointer
   in the same process (no process start on either side; the model perturbed before
   each): at the saved world size (2 ranks, the slowest counts) and resharded to 1
   rank. Each side's time covers its whole ``restore()``: the memory side's choice (the
   slots listed and gathered, the commit log read: it would fall back to disk), the
   slots opened (and the resharded load planned), the state collected, the bytes read
   into place (one ``preadv`` copy from /dev/shm, spread over the rank's share of the
   CPUs), the non-tensor state unpickled through the allow-list, the state applied and
   one gather of the outcomes; the disk side's choice, structure checks and dcp.load
   with CRC-32s (files in the page cache, and with ``--cold`` evicted: each evicted row
   says how much of the files ``mincore`` still found cached, 0 when the eviction
   worked). Both sides copy every byte of the state once; the phases line shows how
   much of the memory side that copy is ("reading slot files"), and "the copy alone"
   times that copy by itself, both ranks at once, next to a plain memcpy of as many
   bytes and a ``preadv`` of the rank's DCP file from the page cache: the floor under
   the memory restore, as a fraction of the disk restore. The header names the memory
   directory's mount: a tmpfs with 4 KiB pages (``/dev/shm``) is read at about half
   the speed of a memcpy; ``--memory-dir`` puts the tier on another one (e.g. a tmpfs
   mounted with ``huge=within_size``: 2 MiB pages, read at memcpy speed).

How to run (under a minute at the default size on an idle 2-core machine, up to ~4 when
it is busy; the numbers are wall-clock, so run nothing heavy meanwhile: the header shows
the load average before and after)::

    .venv/bin/python bench/checkpoint.py
    .venv/bin/python bench/checkpoint.py --size-mb 512 --saves 7 --json /tmp/ckpt.json
    .venv/bin/python bench/checkpoint.py --cold       # also restore from evicted files
    .venv/bin/python bench/checkpoint.py --restore-only --restores 9   # section 2 only
    .venv/bin/python bench/checkpoint.py --memory --size-mb 12 --restores 9 --cold
        # only: the memory tier's snapshot cost, and restores from it vs from disk at the
        # saved world size (target <= 0.2x) and resharded 2 -> 1 (target <= 0.5x), with
        # the memory restore's phases and the first restore of the process
    .venv/bin/python bench/checkpoint.py --memory --memory-dir /mnt/huge-tmpfs
        # the same with the memory tier on a tmpfs mounted huge=within_size (needs root:
        # mount -t tmpfs -o size=2g,huge=within_size,mode=700 tmpfs /mnt/huge-tmpfs)

How to read it: every "ratio" is ours / reference (lower is better), next to its target
and MET / MISSED, judged on the medians. The ratio of the fastest runs (in parentheses)
is a check against noise from other processes: if the two disagree, the machine was
busy. Breakdown lines say where our time goes; times are seconds (median over saves or
restores; for breakdowns, the mean over ranks), sizes MiB. "for scale" puts the blocked
time next to one training step of this model. Every restore is checked: the last line
says whether all restored states equal the saved ones.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
import zlib
from collections import defaultdict
from typing import Any, Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 2**20
TARGET_BLOCKED = 0.10
TARGET_RESTORE = 1.1          # at the saved world size
TARGET_RESTORE_RESHARD = 1.2  # at another one
TARGET_MEMORY = 1.1
TARGET_MEMORY_RESHARD = 0.5   # --memory: restore from the memory tier / from disk, resharding
TARGET_MEMORY_RESTORE = 0.2   # --memory: the same, at the saved world size
TARGET_MEMORY_STAGING = 0.01  # --memory: snapshot cost per step / step time, at the chosen k
MEMORY_STEP = 10_000          # --memory: the step both tiers hold (after the staging steps)


@dataclasses.dataclass
class Config:
    scratch: str
    width: int
    depth: int
    batch: int
    saves: int
    restores: int
    threads: int
    sample_ms: float
    cold: bool
    restore_only: bool
    verbose: bool
    memory_base: str = ""  # --memory: where the memory tier's directory is made ("": /dev/shm)


# ---------------------------------------------------------------- helpers (in the ranks)


class Probe:
    """A recorder of the checkpoint code's phases (``elastic.checkpoint.timing``):
    wall-time totals keyed by call path ("persist.write.dcp_save.crc"), per
    thread, so that a CRC inside the write and one inside the verify stay apart."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._local = threading.local()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        key = ".".join([*stack, name])
        stack.append(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            stack.pop()
            with self._lock:
                self.totals[key] += time.perf_counter() - started

    def take(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.totals)
            self.totals.clear()
        return out


def instrument(probe: Probe) -> None:
    """Make ``probe`` hear the checkpoint code's phases (this process only; the
    reference's calls are timed by hand)."""
    from elastic.checkpoint import timing

    timing.install(probe)


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * _PAGE


def hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Max VmRSS seen by a thread sampling every ``interval_s`` while running."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open("/proc/self/statm", "rb") as f:
            while True:
                f.seek(0)
                rss = int(f.read().split()[1]) * _PAGE
                self.samples += 1
                if rss > self.peak:
                    self.peak = rss
                if self._stop.wait(self.interval_s):
                    return

    def __enter__(self) -> "RssSampler":
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``), so that RSS
    counts live memory: otherwise buffers freed by training steps stay resident and a
    save that reuses them looks free."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_memory(action: Callable[[], Any], interval_s: float) -> dict[str, Any]:
    import gc

    gc.collect()
    trim_heap()
    before, hwm_before = rss_bytes(), hwm_bytes()
    started = time.perf_counter()
    with RssSampler(interval_s) as sampler:
        action()
    seconds = time.perf_counter() - started
    after, hwm_after = rss_bytes(), hwm_bytes()
    gc.collect()
    trim_heap()
    live = rss_bytes()
    return {"rss_before": before, "rss_peak": sampler.peak, "rss_after": after,
            "extra_peak": sampler.peak - before, "retained": after - before,
            "live_after": live - before,
            "hwm_rose_by": max(0, hwm_after - hwm_before),
            "hwm_extra": (hwm_after - before) if hwm_after > hwm_before else None,
            "samples": sampler.samples, "seconds": seconds}


def setup_rank(rank: int, world: int, cfg: Config, tag: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if cfg.verbose else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    from elastic import worker_env

    for name in (worker_env.AGENT_SOCKET, worker_env.ROUND, worker_env.CHECKPOINT_DIR):
        os.environ.pop(name, None)  # FileCommitLog beside the checkpoints, round 0
    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", init_method=f"file://{cfg.scratch}/store-{tag}",
                            rank=rank, world_size=world)


def build(cfg: Config, world: int):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt


def train_step(model, opt, cfg: Config) -> None:
    import torch

    x = torch.randn(cfg.batch, cfg.width)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


_OPTIONS = None


def options():
    global _OPTIONS
    if _OPTIONS is None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    return _OPTIONS


def plain_state_dict(model, opt) -> dict[str, Any]:
    """The reference's state dict: the same keys and layout as ours."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict)

    return {"model": get_model_state_dict(model, options=options()),
            "optim": get_optimizer_state_dict(model, opt, options=options())}


def shard_bytes(model, opt) -> int:
    """Bytes of this rank's local parameter and optimizer tensors."""
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for group in plain_state_dict(model, opt).values():
        for value in group.values():
            if isinstance(value, DTensor):
                total += value.to_local().nbytes
            elif isinstance(value, torch.Tensor):
                total += value.nbytes
    return total


def fingerprint(model, opt) -> list[float]:
    """(sum, sum of squares, weighted sum) in float64 over every sharded tensor of the
    model and optimizer, all-reduced: equal at any world size for the same state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    acc = torch.zeros(3, dtype=torch.float64)
    for group in plain_state_dict(model, opt).values():
        for key in sorted(group):
            value = group[key]
            if not isinstance(value, DTensor):
                continue  # Adam's step counters are replicated, not sharded
            local = value.to_local().double()
            acc[0] += local.sum()
            acc[1] += local.pow(2).sum()
            acc[2] += local.sum() * (1 + zlib.crc32(key.encode()) % 97)  # not hash(): salted
    dist.all_reduce(acc)
    return acc.tolist()


def perturb(model, opt) -> None:
    """Change every sharded tensor in place, so that a restore has to write it back."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for group in plain_state_dict(model, opt).values():
            for value in group.values():
                if isinstance(value, DTensor):
                    value.to_local().add_(0.5)


def same_fingerprint(a: list[float], b: list[float]) -> bool:
    return all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(a, b))


def evict(directory: str) -> int:
    """Drop a checkpoint directory's files from the page cache (clean pages only);
    returns the bytes of them still in it afterwards (``mincore``; 0 when evicted,
    -1 when it cannot be told)."""
    resident = 0
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            found = resident_bytes(fd)
            resident = -1 if found < 0 or resident < 0 else resident + found
        finally:
            os.close(fd)
    return resident


def resident_bytes(fd: int) -> int:
    """Bytes of the open file ``fd`` in the page cache (a mapping that touches no
    page, and ``mincore``), or -1 when it cannot be told."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    if address in (None, ctypes.c_void_p(-1).value):
        return -1
    try:
        pages = (size + _PAGE - 1) // _PAGE
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            return -1
        return sum(byte & 1 for byte in vector) * _PAGE
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))


def write_result(cfg: Config, name: str, data: dict) -> None:
    with open(os.path.join(cfg.scratch, f"{name}.json"), "w") as f:
        json.dump(data, f)


# ---------------------------------------------------------------- the ranks' work


def _restore_rounds(cfg: Config, rank: int, model, opt, ours, ours_nv, ref_dir: str,
                    ours_dir: str, probe: Probe, expect_ours, expect_ref) -> dict[str, Any]:
    """Interleaved restores: ours, plain dcp.load, ours without checksums; warm and
    (with --cold) after evicting the files. Each is checked against the saved state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict, set_optimizer_state_dict)

    def run_ours(ckpt):
        probe.take()
        started = time.perf_counter()
        step = ckpt.restore()
        seconds = time.perf_counter() - started
        return seconds, probe.take(), step

    def run_ref():
        t0 = time.perf_counter()
        sd = plain_state_dict(model, opt)
        t1 = time.perf_counter()
        dcp.load(sd, checkpoint_id=ref_dir)
        t2 = time.perf_counter()
        set_model_state_dict(model, sd["model"], options=options())
        set_optimizer_state_dict(model, opt, sd["optim"], options=options())
        t3 = time.perf_counter()
        return t3 - t0, {"collect": t1 - t0, "dcp_load": t2 - t1, "apply": t3 - t2}, None

    kinds = {"ours": (lambda: run_ours(ours), ours_dir, expect_ours),
             "plain": (run_ref, ref_dir, expect_ref),
             "ours_nocrc": (lambda: run_ours(ours_nv), ours_dir, expect_ours)}
    out: dict[str, Any] = {}
    for cache in (["warm", "cold"] if cfg.cold else ["warm"]):
        rows: dict[str, list] = {k: [] for k in kinds}
        for i in range(cfg.restores):
            order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
            for kind in order:
                action, directory, expect = kinds[kind]
                perturb(model, opt)  # move the state away from the saved one
                if cache == "cold" and rank == 0:
                    evict(directory)
                dist.barrier()
                cpu = time.process_time()
                seconds, parts, step = action()
                cpu = time.process_time() - cpu  # this process's CPU: others' load barely moves it
                ok = same_fingerprint(fingerprint(model, opt), expect)
                rows[kind].append({"seconds": seconds, "cpu_s": cpu, "parts": parts,
                                   "step": step, "verified_state": ok})
        out[cache] = rows
    return out


def rank_world2(rank: int, world: int, cfg: Config) -> None:
    """Saves at world size 2 (ours and plain), memory, then restores at world size 2."""
    import gc

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint import Checkpointer

    setup_rank(rank, world, cfg, "w2")
    model, opt = build(cfg, world)
    train_step(model, opt, cfg)  # Adam state exists from here on
    probe = Probe()
    ours_root = os.path.join(cfg.scratch, "ours")
    ref_root = os.path.join(cfg.scratch, "plain")
    os.makedirs(ref_root, exist_ok=True)
    ckpt = Checkpointer(ours_root, model=model, optimizer=opt, keep=3)
    instrument(probe)
    shard = shard_bytes(model, opt)
    result: dict[str, Any] = {"rank": rank, "shard_bytes": shard, "ours": [], "plain": []}
    step = 0
    last_ref: list[str] = []

    def ours_save(memory: bool) -> dict[str, Any]:
        nonlocal step
        step += 1
        dist.barrier()
        t = time.perf_counter()
        train_step(model, opt, cfg)
        train_s = time.perf_counter() - t
        expect = fingerprint(model, opt)
        gc.collect()
        dist.barrier()
        probe.take()
        times: dict[str, float] = {}

        def action() -> None:
            t0 = time.perf_counter()
            ckpt.save(step)
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            times.update(blocked=t1 - t0, commit=t2 - t1)

        mem = measure_memory(action, cfg.sample_ms / 1000) if memory else (action() or None)
        return {"step": step, **times, "parts": probe.take(), "memory": mem,
                "fingerprint": expect, "train_s": train_s}

    def ref_save(memory: bool) -> dict[str, Any]:
        nonlocal step
        step += 1
        train_step(model, opt, cfg)
        expect = fingerprint(model, opt)
        gc.collect()
        directory = os.path.join(ref_root, f"step-{step:012d}")
        dist.barrier()
        times: dict[str, float] = {}

        def action() -> None:
            t0 = time.perf_counter()
            sd = plain_state_dict(model, opt)
            t1 = time.perf_counter()
            dcp.save(sd, checkpoint_id=directory)
            t2 = time.perf_counter()
            del sd
            times.update(blocked=t2 - t0, collect=t1 - t0, dcp_save=t2 - t1)

        mem = measure_memory(action, cfg.sample_ms / 1000) if memory else (action() or None)
        dist.barrier()
        if rank == 0:  # keep only the newest reference checkpoint (outside the timing)
            for old in last_ref:
                shutil.rmtree(old, ignore_errors=True)
        last_ref[:] = [directory]
        return {"step": step, **times, "memory": mem, "fingerprint": expect,
                "dir": directory}

    if cfg.restore_only:  # one save of each, untimed, to restore from
        result["plain"].append(ref_save(memory=False))
        result["ours_steady"] = ours_save(memory=False)
    else:
        # First saves (warm-up), with the RSS sampler: ours allocates its staging copy here.
        result["ours_first"] = ours_save(memory=True)
        result["plain_first"] = ref_save(memory=True)
        for _ in range(cfg.saves):
            result["ours"].append(ours_save(memory=False))
            result["plain"].append(ref_save(memory=False))
        result["ours_steady"] = ours_save(memory=True)
    expect_ours = result["ours_steady"]["fingerprint"]
    expect_ref = result["plain"][-1]["fingerprint"]
    ours_dir = os.path.join(ours_root, f"step-{result['ours_steady']['step']:012d}")
    ref_dir = result["plain"][-1]["dir"]
    ckpt_nv = Checkpointer(ours_root, model=model, optimizer=opt, keep=3,
                           verify_checksums=False)
    result["restore"] = _restore_rounds(cfg, rank, model, opt, ckpt, ckpt_nv, ref_dir,
                                        ours_dir, probe, expect_ours, expect_ref)
    result.update(expect_ours=expect_ours, expect_ref=expect_ref, ours_dir=ours_dir,
                  ref_dir=ref_dir)
    ckpt.close()
    ckpt_nv.close()
    dist.barrier()
    dist.destroy_process_group()
    write_result(cfg, f"w2-rank{rank}", result)


def rank_world1(rank: int, world: int, cfg: Config) -> None:
    """Restores of the world-size-2 checkpoints with one rank (resharding)."""
    import torch.distributed as dist

    from elastic.checkpoint import Checkpointer

    with open(os.path.join(cfg.scratch, "w2-rank0.json")) as f:
        saved = json.load(f)
    setup_rank(rank, world, cfg, "w1")
    model, opt = build(cfg, world)
    train_step(model, opt, cfg)
    probe = Probe()
    ours_root = os.path.join(cfg.scratch, "ours")
    ckpt = Checkpointer(ours_root, model=model, optimizer=opt, keep=3)
    ckpt_nv = Checkpointer(ours_root, model=model, optimizer=opt, keep=3,
                           verify_checksums=False)
    instrument(probe)
    result = {"rank": rank, "shard_bytes": shard_bytes(model, opt)}
    result["restore"] = _restore_rounds(cfg, rank, model, opt, ckpt, ckpt_nv,
                                        saved["ref_dir"], saved["ours_dir"], probe,
                                        saved["expect_ours"], saved["expect_ref"])
    ckpt.close()
    ckpt_nv.close()
    dist.destroy_process_group()
    write_result(cfg, f"w1-rank{rank}", result)


class _Position:
    """The data position the memory tier snapshots with the state (a stand-in sampler)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.step = saved["step"]


def memory_dir(cfg: Config) -> str:
    """The memory tier's directory: under ``--memory-dir``, else on /dev/shm (the
    agent's default) when there is one."""
    base = cfg.memory_base or ("/dev/shm" if os.path.isdir("/dev/shm") else cfg.scratch)
    return os.path.join(base, os.path.basename(cfg.scratch) + "-memory")


def rank_memory_world2(rank: int, world: int, cfg: Config) -> None:
    """--memory: training steps with a snapshot after each (the staging cost), then one
    snapshot into the memory tier and one disk save of the same step, and restores of
    it at the same world size, from disk and from memory, interleaved."""
    import torch.distributed as dist

    from elastic.checkpoint import Checkpointer
    from elastic.worker import runtime

    setup_rank(rank, world, cfg, "mem-w2")
    model, opt = build(cfg, world)
    train_step(model, opt, cfg)
    root = os.path.join(cfg.scratch, "ours")
    ckpt = Checkpointer(root, model=model, optimizer=opt,
                        data=_Position(), memory_dir=memory_dir(cfg), memory_every=1)
    train_s, snapshot_s = [], []
    for step in range(4 * cfg.saves + 1):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(model, opt, cfg)
        t1 = time.perf_counter()
        runtime.step(step)  # the memory tier snapshots at elastic.step
        train_s.append(t1 - t0)
        snapshot_s.append(time.perf_counter() - t1)
    runtime.step(MEMORY_STEP)
    ckpt.save(MEMORY_STEP, async_=False)
    saved = fingerprint(model, opt)
    disk = Checkpointer(root, model=model, optimizer=opt)
    kinds = {"disk": disk, "memory": ckpt, **({"disk_cold": disk} if cfg.cold else {})}
    rows = _interleaved_restores(cfg, kinds, model, opt, root, saved, before=dist.barrier)
    floors = _copy_floors(cfg, rank, root, dist.barrier)
    disk.close()
    ckpt.close()
    dist.destroy_process_group()
    # The first snapshot maps the slot's memory: left out of the staging cost.
    write_result(cfg, f"mem-w2-rank{rank}", {"fingerprint": saved, "same_world": rows,
                                             "train_s": train_s[1:],
                                             "snapshot_s": snapshot_s[1:], "floors": floors})


def _copy_floors(cfg: Config, rank: int, root: str, barrier: Callable[[], Any]
                 ) -> dict[str, list[float]]:
    """What copying this rank's saved bytes alone costs, every rank at once (as in a
    restore), ``cfg.restores`` times each: a plain memcpy of as many bytes between two
    buffers of this process, one ``preadv`` of its memory slot's ``data.bin`` (the
    memory restore's copy) and one of its DCP file in the page cache (the bytes the
    disk restore reads), each into a buffer already touched."""
    import ctypes

    import torch

    from elastic.checkpoint.memory import layout as memory_layout

    slot = next(s for s in memory_layout.list_slots(memory_dir(cfg))
                if s.key.rank == rank and s.manifest.step == MEMORY_STEP)
    sources = {"memory file": os.path.join(slot.path, memory_layout.DATA),
               "disk file": os.path.join(root, f"step-{MEMORY_STEP:012d}", f"__{rank}_0.distcp")}
    size = slot.manifest.files[memory_layout.DATA]
    source = torch.ones(size, dtype=torch.uint8)
    target = torch.zeros(size, dtype=torch.uint8)
    view = memoryview((ctypes.c_char * size).from_address(target.data_ptr())).cast("B")
    fds = {name: os.open(path, os.O_RDONLY) for name, path in sources.items()}
    actions = {"memcpy": lambda: target.copy_(source),
               **{name: (lambda fd=fd: os.preadv(fd, [view[:os.fstat(fd).st_size]], 0))
                  for name, fd in fds.items()}}
    out: dict[str, list[float]] = {key: [] for name in actions for key in (name, f"{name} cpu")}
    try:
        for _ in range(cfg.restores):
            for name, action in actions.items():
                barrier()
                cpu = time.thread_time()  # user + system time of this thread: the copy's
                started = time.perf_counter()
                action()
                out[name].append(time.perf_counter() - started)
                out[f"{name} cpu"].append(time.thread_time() - cpu)
    finally:
        for fd in fds.values():
            os.close(fd)
    out["bytes"] = [float(size)]
    return out


def _interleaved_restores(cfg: Config, kinds: dict, model, opt, root: str, expect,
                          before=lambda: None) -> dict[str, list]:
    """``cfg.restores`` restores of MEMORY_STEP by each checkpointer of ``kinds``, in
    alternating order, the model perturbed before each (and the files evicted for
    ``disk_cold``); each timed, its phases recorded (``elastic.checkpoint.timing``)
    and checked against the fingerprint ``expect``."""
    probe = Probe()
    instrument(probe)
    rows: dict[str, list] = {kind: [] for kind in kinds}
    for i in range(cfg.restores):
        for kind in (list(kinds) if i % 2 == 0 else list(reversed(kinds))):
            perturb(model, opt)
            resident = evict(os.path.join(root, f"step-{MEMORY_STEP:012d}")) \
                if kind == "disk_cold" else None
            before()
            probe.take()
            cpu = time.process_time()
            started = time.perf_counter()
            kinds[kind].restore()
            seconds = time.perf_counter() - started
            cpu = time.process_time() - cpu  # all threads': others' load barely moves it
            rows[kind].append({"seconds": seconds, "cpu_s": cpu, "path": kinds[kind].restored_path,
                               "parts": probe.take(), "resident_after_evict": resident,
                               "verified_state": same_fingerprint(fingerprint(model, opt),
                                                                  expect)})
    return rows


_MEMORY_PARTS = [("memory_choose", "choose"), ("memory_bring", "bring"),
                 ("memory_bring.collect", "of which collect"), ("memory_load", "load"),
                 ("memory_load.collect", "of which collect"),
                 ("memory_load.read", "of which reading slot files"),
                 ("memory_load.apply", "apply"), ("memory_agree", "agree")]


_DISK_PARTS = [("choose", "choose"), ("load", "load"), ("load.verify", "of which verify sizes"),
               ("load.collect", "collect"), ("load.dcp_load", "dcp.load"),
               ("load.dcp_load.crc", "of which CRC-32"), ("load.apply", "apply")]


def _print_disk_parts(rows_by_rank: list[list[dict]]) -> None:
    """Where the disk restore's time goes (warm page cache), as for the memory side."""
    print(f"    disk restore phases: {fmt_parts(parts_mean(rows_by_rank), _DISK_PARTS)}")


def _print_memory_parts(rows_by_rank: list[list[dict]]) -> None:
    """Where a memory restore's time goes: per phase, the median over restores
    of the mean over ranks; the threads each rank reads its slot files with (its
    share of this machine's CPUs); and the first restore of the process (a
    restarted worker restores once: its caches are cold)."""
    from elastic.checkpoint.memory.slotfile import copy_threads

    parts = parts_mean(rows_by_rank)
    print(f"    memory restore phases: {fmt_parts(parts, _MEMORY_PARTS)}; slot files read by "
          f"{copy_threads(len(rows_by_rank))} thread(s) per rank; first restore "
          f"{max(rows[0]['seconds'] for rows in rows_by_rank):.4f} s")


def rank_memory_world1(rank: int, world: int, cfg: Config) -> None:
    """--memory: restores of that step by one rank (resharding), from disk and from
    memory, interleaved, each checked against the saved state."""
    import torch.distributed as dist

    from elastic import worker_env
    from elastic.checkpoint import Checkpointer

    with open(os.path.join(cfg.scratch, "mem-w2-rank0.json")) as f:
        expect = json.load(f)["fingerprint"]
    setup_rank(rank, world, cfg, "mem-w1")
    os.environ[worker_env.ROUND] = "1"  # a new round: the old slots are another round's
    model, opt = build(cfg, world)
    root = os.path.join(cfg.scratch, "ours")
    disk = Checkpointer(root, model=model, optimizer=opt)
    kinds = {"disk": disk, "memory": Checkpointer(root, model=model, optimizer=opt,
                                                   data=_Position(), memory_dir=memory_dir(cfg),
                                                   memory_every=1)}
    if cfg.cold:
        kinds["disk_cold"] = disk
    rows = _interleaved_restores(cfg, kinds, model, opt, root, expect)
    for ckpt in set(kinds.values()):
        ckpt.close()
    dist.destroy_process_group()
    write_result(cfg, "mem-w1-rank0", rows)


def run_memory(cfg: Config) -> dict[str, Any]:
    """--memory: resharded restore (2 -> 1 ranks) from the memory tier vs from disk."""
    import torch.multiprocessing as mp

    from elastic.checkpoint.memory import capacity

    base = os.path.dirname(memory_dir(cfg))
    kind, options = capacity.mount_of(base) or ("unknown", "")
    pages = {True: "2 MiB pages", False: "4 KiB pages", None: "not a tmpfs"}
    print(f"memory tier in {memory_dir(cfg)}: {kind} ({options}): "
          f"{pages[capacity.huge_pages(base)]}")
    try:
        mp.spawn(_entry, args=("rank_memory_world2", 2, cfg), nprocs=2, join=True)
        mp.spawn(_entry, args=("rank_memory_world1", 1, cfg), nprocs=1, join=True)
    finally:
        shutil.rmtree(memory_dir(cfg), ignore_errors=True)
    w2 = [json.load(open(os.path.join(cfg.scratch, f"mem-w2-rank{r}.json"))) for r in range(2)]
    same_world = _report_memory_same_world(cfg, w2)
    with open(os.path.join(cfg.scratch, "mem-w1-rank0.json")) as f:
        rows = json.load(f)
    seconds = {kind: [r["seconds"] for r in kind_rows] for kind, kind_rows in rows.items()}
    memory = seconds["memory"]
    print(f"Resharded restore 2 -> 1 ranks (median of {cfg.restores}; fastest in brackets):")
    for kind, label in (("disk", "from disk"), ("disk_cold", "from disk, files evicted"),
                        ("memory", "from memory")):
        if kind in seconds:
            print(f"  {label:<25} {med(seconds[kind]):.4f} s ({min(seconds[kind]):.4f})   "
                  f"{rows[kind][0]['path']}{_still_cached(rows[kind])}")
    ratios = {}
    for kind in ("disk", "disk_cold"):
        if kind in seconds:
            ratio = ratios[kind] = med(memory) / med(seconds[kind])
            print(f"  memory / {kind:<9} {ratio:.2f} ({min(memory) / min(seconds[kind]):.2f}), "
                  f"target <= {TARGET_MEMORY_RESHARD}: {verdict(ratio, TARGET_MEMORY_RESHARD)}")
    _print_cpu({kind: [kind_rows] for kind, kind_rows in rows.items()})
    _print_disk_parts([rows["disk"]])
    _print_memory_parts([rows["memory"]])
    verified = all(r["verified_state"] for kind_rows in rows.values() for r in kind_rows)
    verified = verified and same_world["restored_state_verified"]
    _report_verified(verified)
    return {"memory_reshard": rows, "ratios": ratios, "target": TARGET_MEMORY_RESHARD,
            **same_world, "restored_state_verified": verified}


def _print_cpu(rows_by_kind: dict[str, list[list[dict]]]) -> dict[str, float]:
    """Each kind's CPU seconds per restore (its process's, all threads; median over
    restores of the largest rank), and memory's against disk's: less moved by
    others' load than wall time, so a check on the ratios of a busy machine."""
    cpu = {kind: med([max(rows[i]["cpu_s"] for rows in by_rank)
                      for i in range(len(by_rank[0]))])
           for kind, by_rank in rows_by_kind.items()}
    print("  CPU seconds per restore (median, largest rank): " + ", ".join(
        f"{kind} {seconds:.4f}" for kind, seconds in cpu.items())
        + f"; memory / disk {cpu['memory'] / cpu['disk']:.2f} (information)")
    return cpu


def _still_cached(rows: list[dict]) -> str:
    """For evicted rows: the most bytes of the checkpoint's files still in the page
    cache after an eviction (mincore), so that "evicted" is seen to be true."""
    found = [row["resident_after_evict"] for row in rows
             if row.get("resident_after_evict") is not None]
    if not found:
        return ""
    if min(found) < 0:
        return "  (what eviction left cached cannot be told)"
    return f"  ({max(found) / MiB:.1f} MiB still cached after eviction)"


def _report_memory_same_world(cfg: Config, w2: list[dict]) -> dict[str, Any]:
    """The staging cost per step and the restore at the saved world size (2 ranks),
    memory vs disk; the slowest rank counts."""
    from elastic.checkpoint.memory.cadence import choose_every

    snapshot = [max(r["snapshot_s"][i] for r in w2) for i in range(len(w2[0]["snapshot_s"]))]
    train = [max(r["train_s"][i] for r in w2) for i in range(len(w2[0]["train_s"]))]
    every = choose_every(med(snapshot), med(train))
    per_step = med(snapshot) / (every * med(train))
    print(f"Memory snapshot per step (median of {len(snapshot)}, slowest rank): "
          f"{1000 * med(snapshot):.2f} ms, a training step {1000 * med(train):.1f} ms "
          f"({med(snapshot) / med(train):.1%} when taken every step)")
    print(f"  memory_every=auto picks k={every}: {per_step:.2%} of the step time, target "
          f"<= {TARGET_MEMORY_STAGING:.0%}: {verdict(per_step, TARGET_MEMORY_STAGING)}")
    rows = {kind: [max(r["same_world"][kind][i]["seconds"] for r in w2)
                   for i in range(cfg.restores)] for kind in w2[0]["same_world"]}
    print(f"Restore at the saved world size, 2 ranks (median of {cfg.restores}; fastest in "
          f"brackets):")
    for kind, label in (("disk", "from disk"), ("disk_cold", "from disk, files evicted"),
                        ("memory", "from memory")):
        if kind in rows:
            print(f"  {label:<25} {med(rows[kind]):.4f} s ({min(rows[kind]):.4f})   "
                  f"{w2[0]['same_world'][kind][0]['path']}"
                  f"{_still_cached([row for r in w2 for row in r['same_world'][kind]])}")
    ratio = med(rows["memory"]) / med(rows["disk"])
    for kind in ("disk", "disk_cold"):
        if kind in rows:
            ratio_of = med(rows["memory"]) / med(rows[kind])
            print(f"  memory / {kind:<9} {ratio_of:.2f} "
                  f"({min(rows['memory']) / min(rows[kind]):.2f}), target <= "
                  f"{TARGET_MEMORY_RESTORE}: {verdict(ratio_of, TARGET_MEMORY_RESTORE)}")
    _print_disk_parts([r["same_world"]["disk"] for r in w2])
    _print_memory_parts([r["same_world"]["memory"] for r in w2])
    cpu = _print_cpu({kind: [r["same_world"][kind] for r in w2] for kind in rows})
    floors = {name: med([max(r["floors"][name][i] for r in w2) for i in range(cfg.restores)])
              for name in w2[0]["floors"] if name != "bytes"}
    size = max(r["floors"]["bytes"][0] for r in w2)
    disk_s = med(rows["disk"])
    print(f"    the copy alone, {len(w2)} ranks at once, {size / MiB:.1f} MiB each (median, "
          f"slowest rank; GB/s a rank; x the disk restore; its CPU seconds): " + ", ".join(
              f"{label} {floors[name]:.4f} s ({size / floors[name] / 1e9:.1f}; "
              f"{floors[name] / disk_s:.2f}x; CPU {floors[name + ' cpu']:.4f} s)"
              for name, label in (("memcpy", "memcpy"), ("memory file", "preadv of the slot file"),
                                  ("disk file", "preadv of the DCP file in the page cache"))))
    verified = all(row["verified_state"] for r in w2 for kind in r["same_world"].values()
                   for row in kind)
    return {"memory_same_world": rows, "same_world_ratio": ratio, "copy_floors": floors,
            "same_world_cpu_s": cpu,
            "same_world_target": TARGET_MEMORY_RESTORE, "snapshot_s": snapshot,
            "train_s": train, "memory_every": every, "staging_per_step": per_step,
            "restored_state_verified": verified}


def _entry(rank: int, fn_name: str, world: int, cfg: Config) -> None:
    globals()[fn_name](rank, world, cfg)


# ---------------------------------------------------------------- the report


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def verdict(ratio: float, target: float) -> str:
    return "MET" if ratio <= target else "MISSED"


def parts_mean(rows_by_rank: list[list[dict]], key: str = "parts") -> dict[str, float]:
    """Per call path: median over repetitions of the mean over ranks."""
    keys = sorted({k for rows in rows_by_rank for row in rows for k in row[key]})
    out = {}
    for k in keys:
        per_rep = [statistics.mean(rows[i][key].get(k, 0.0) for rows in rows_by_rank)
                   for i in range(len(rows_by_rank[0]))]
        out[k] = med(per_rep)
    return out


def slowest(rows_by_rank: list[list[dict]], field: str) -> list[float]:
    return [max(rows[i][field] for rows in rows_by_rank) for i in range(len(rows_by_rank[0]))]


def fmt_parts(parts: dict[str, float], names: list[tuple[str, str]]) -> str:
    return ", ".join(f"{label} {parts.get(key, 0.0):.3f}" for key, label in names)


def _report_restore(cfg: Config, w2: list[dict], w1: list[dict]) -> dict[str, Any]:
    """Section 2 of the report: the restore rows."""
    p = print
    p()
    p(f"2. Restore (median of {cfg.restores}, slowest rank, seconds); saved by 2 ranks")
    restore_out = []
    all_ok = True
    for label, ranks, target in (("2 -> 2 (no reshard)", w2, TARGET_RESTORE),
                                 ("2 -> 1 (reshard)", w1, TARGET_RESTORE_RESHARD)):
        for cache in ranks[0]["restore"]:
            rows = {k: [r["restore"][cache][k] for r in ranks] for k in ranks[0]["restore"][cache]}
            t = {k: med(slowest(v, "seconds")) for k, v in rows.items()}
            tmin = {k: min(slowest(v, "seconds")) for k, v in rows.items()}
            ok = all(row["verified_state"] for v in rows.values() for rr in v for row in rr)
            all_ok &= ok
            r_ours = t["ours"] / t["plain"]
            r_nv = t["ours_nocrc"] / t["plain"]
            pa = parts_mean(rows["ours"])
            pn = parts_mean(rows["ours_nocrc"])
            pr = parts_mean(rows["plain"])
            p(f"   world {label}, page cache {cache}:"
              f"{'' if ok else '  !! restored state differs from the saved one !!'}")
            m_ours, m_nv = tmin["ours"] / tmin["plain"], tmin["ours_nocrc"] / tmin["plain"]
            p(f"     {'':44s} median  ratio  (fastest  ratio)")
            p(f"     {'plain dcp.load (+ state dict helpers)':44s} {t['plain']:6.3f}         "
              f"({tmin['plain']:6.3f})")
            p(f"     {'ours ckpt.restore() (sizes + CRC-32)':44s} {t['ours']:6.3f}  {r_ours:5.2f}  "
              f"({tmin['ours']:6.3f}  {m_ours:5.2f})   target <= {target}  "
              f"{verdict(r_ours, target)}")
            p(f"     {'ours verify_checksums=False (information)':44s} {t['ours_nocrc']:6.3f}  "
              f"{r_nv:5.2f}  ({tmin['ours_nocrc']:6.3f}  {m_nv:5.2f})")
            cpu = {k: med(slowest(v, "cpu_s")) for k, v in rows.items()}
            p(f"     CPU seconds (median, largest rank): plain {cpu['plain']:.3f}, ours "
              f"{cpu['ours']:.3f} ({cpu['ours'] / cpu['plain']:.2f}), no-CRC "
              f"{cpu['ours_nocrc']:.3f} ({cpu['ours_nocrc'] / cpu['plain']:.2f}); "
              f"information: less moved by others' load than wall time")
            p(f"     breakdown ours:  choose {pa.get('choose', 0):.3f}, load "
              f"{pa.get('load', 0):.3f} (verify sizes {pa.get('load.verify', 0):.3f}, collect "
              f"{pa.get('load.collect', 0):.3f}, dcp.load {pa.get('load.dcp_load', 0):.3f} "
              f"of which CRC-32 {pa.get('load.dcp_load.crc', 0):.3f}, apply "
              f"{pa.get('load.apply', 0):.3f})")
            p(f"     breakdown no-CRC: choose {pn.get('choose', 0):.3f}, load "
              f"{pn.get('load', 0):.3f} (dcp.load {pn.get('load.dcp_load', 0):.3f})")
            p(f"     breakdown plain: collect {pr.get('collect', 0):.3f}, dcp.load "
              f"{pr.get('dcp_load', 0):.3f}, apply {pr.get('apply', 0):.3f}")
            crc_s = pa.get("load.dcp_load.crc", 0.0)
            share = crc_s / max(pa.get("choose", 0.0) + pa.get("load", 0.0), 1e-9)
            if r_ours > target and r_nv <= target:
                p(f"     -> the CRC-32 checks make the difference: computing CRC-32s is "
                  f"{share:.0%} of ours; without them the row meets the target")
            else:
                p(f"     -> computing CRC-32s is {share:.0%} of ours")
            restore_out.append({"case": label, "cache": cache, "plain_s": t["plain"],
                                "ours_s": t["ours"], "ours_nocrc_s": t["ours_nocrc"],
                                "ratio": r_ours, "ratio_nocrc": r_nv, "target": target,
                                "fastest_s": tmin, "ratio_of_minima": m_ours, "cpu_s": cpu,
                                "ratio_nocrc_of_minima": m_nv,
                                "met": r_ours <= target, "state_verified": ok,
                                "ours_parts": pa, "ours_nocrc_parts": pn, "plain_parts": pr,
                                "runs": rows})
    return {"restore": restore_out, "restored_state_verified": all_ok}


def report(cfg: Config, w2: list[dict], w1: list[dict], meta: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"meta": meta}
    p = print
    p()
    p(f"Checkpoint benchmark: ours (elastic.checkpoint.Checkpointer) vs plain "
      f"torch.distributed.checkpoint")
    p(f"  model: MLP {cfg.depth} x Linear({cfg.width}, {cfg.width}) + Adam = "
      f"{meta['state_mib']:.1f} MiB of parameters + optimizer state "
      f"({meta['param_mib']:.1f} MiB parameters)")
    p(f"  sharding: FSDP2 fully_shard on CPU, 2 ranks (gloo, {cfg.threads} torch thread each)"
      f"; shard per rank: " + ", ".join(f"rank {r['rank']} {r['shard_bytes'] / MiB:.1f} MiB"
                                       for r in w2))
    p(f"  torch {meta['torch']}, python {meta['python']}, {meta['cpus']} CPUs, CRC-32 by "
      f"{meta['crc32']}; "
      f"checkpoints in {cfg.scratch}; "
      f"{0 if cfg.restore_only else cfg.saves} timed saves, {cfg.restores} restores each")
    p(f"  load average (1 min) before {meta['loadavg_before'][0]:.1f}, after "
      f"{meta['loadavg_after'][0]:.1f}, run took {meta['wall_s']:.0f} s")

    if cfg.restore_only:
        out.update(_report_restore(cfg, w2, w1))
        _report_verified(out["restored_state_verified"])
        return out

    # 1. blocked time
    ours = [r["ours"] for r in w2]
    plain = [r["plain"] for r in w2]
    ours_blocked = med(slowest(ours, "blocked"))
    ref_blocked = med(slowest(plain, "blocked"))
    commit = med(slowest(ours, "commit"))
    ratio = ours_blocked / ref_blocked
    op = parts_mean(ours)
    rp = {k: med([statistics.mean(rows[i][k] for rows in plain) for i in range(cfg.saves)])
          for k in ("collect", "dcp_save")}
    first_blocked = max(r["ours_first"]["blocked"] for r in w2)
    p()
    p(f"1. Training time blocked per save (median of {cfg.saves}, slowest rank, seconds)")
    p(f"   {'ours ckpt.save(step) (async, returns after staging)':58s} {ours_blocked:7.3f}")
    p(f"   {'plain dcp.save(sd, checkpoint_id=...) (sync)':58s} {ref_blocked:7.3f}")
    p(f"   {'ratio ours / plain':58s} {ratio:7.3f}   target <= {TARGET_BLOCKED:.2f}  "
      f"{verdict(ratio, TARGET_BLOCKED)}")
    min_ratio = min(slowest(ours, "blocked")) / min(slowest(plain, "blocked"))
    p(f"   {'(ratio of the fastest saves, a check against noise)':58s} {min_ratio:7.3f}")
    p(f"   {'ours: save() return -> committed (ckpt.wait())':58s} {commit:7.3f}   "
      f"(background; save start -> committed {ours_blocked + commit:.3f})")
    p(f"   {'ours: first save blocked (allocates the staging copy)':58s} {first_blocked:7.3f}")
    other_blocked = med([statistics.mean(
        rows[i]["blocked"] - rows[i]["parts"].get("collect", 0) - rows[i]["parts"].get("stage", 0)
        for rows in ours) for i in range(cfg.saves)])
    p(f"   breakdown ours blocked:     collect {op.get('collect', 0):.3f}, stage (copy to CPU) "
      f"{op.get('stage', 0):.3f}, other {other_blocked:.3f}")
    shard = statistics.mean(r["shard_bytes"] for r in w2)
    stage_s = op.get("stage", 0.0)
    budget = TARGET_BLOCKED * ref_blocked - op.get("collect", 0.0) - other_blocked
    stage_rate = shard / stage_s / 1e9 if stage_s > 0 else float("nan")
    needed = shard / budget / 1e9 if budget > 0 else float("inf")
    p(f"   staging copies the shard at {stage_rate:.2f} GB/s per rank; the target needs "
      f">= {needed:.2f} GB/s (shard / (10% of plain - collect - other))")
    persist = op.get("persist", 0.0)
    known = sum(op.get(f"persist.{k}", 0.0) for k in ("prepare", "write", "verify", "commit"))
    p(f"   breakdown ours background:  " + fmt_parts(op, [
        ("persist.prepare", "prepare"), ("persist.write.dcp_save", "write: dcp.save"),
        ("persist.write.dcp_save.crc", "of which CRC-32"),
        ("persist.verify", "verify (no read)"), ("persist.commit", "commit")])
      + f", collectives/other {max(0.0, persist - known):.3f} (persist {persist:.3f})")
    p(f"   breakdown plain:            collect {rp['collect']:.3f}, dcp.save {rp['dcp_save']:.3f}")
    train = med(slowest(ours, "train_s"))
    p(f"   for scale: one training step (batch {cfg.batch}, forward + backward + Adam) takes "
      f"{train:.3f}; ours blocks for {ours_blocked / train:.0%} of one, plain for "
      f"{ref_blocked / train:.0%}")
    out["blocked"] = {"ours_s": ours_blocked, "plain_s": ref_blocked, "ratio": ratio,
                      "ratio_of_minima": min_ratio,
                      "target": TARGET_BLOCKED, "met": ratio <= TARGET_BLOCKED,
                      "ours_commit_after_return_s": commit, "train_step_s": train, "ours_first_blocked_s": first_blocked,
                      "ours_parts": op, "plain_parts": rp, "stage_gb_per_s": stage_rate,
                      "stage_gb_per_s_needed": needed,
                      "ours_runs": [[{k: v for k, v in row.items() if k != "fingerprint"}
                                     for row in rows] for rows in ours],
                      "plain_runs": [[{k: v for k, v in row.items() if k != "fingerprint"}
                                      for row in rows] for rows in plain]}

    out.update(_report_restore(cfg, w2, w1))

    # 3. memory
    p()
    p(f"3. Peak extra RSS per rank during an async save (save + wait), MiB; "
      f"sampled every {cfg.sample_ms:g} ms")
    mem_out = []
    for r in w2:
        shard = r["shard_bytes"]
        first, steady, ref = (r["ours_first"]["memory"], r["ours_steady"]["memory"],
                              r["plain_first"]["memory"])
        rf, rs = first["extra_peak"] / shard, steady["extra_peak"] / shard
        p(f"   rank {r['rank']}: shard {shard / MiB:.1f} MiB")
        for name, m, ratio_ in (("ours, first save", first, rf),
                                ("ours, steady-state save", steady, rs)):
            hwm = (f"; VmHWM rose, peak-before {m['hwm_extra'] / MiB:.1f}"
                   if m["hwm_extra"] is not None else "")
            p(f"     {name:28s} peak extra {m['extra_peak'] / MiB:7.1f}  = {ratio_:4.2f} x shard"
              f"  target <= {TARGET_MEMORY}  {verdict(ratio_, TARGET_MEMORY)}   "
              f"(after: {m['retained'] / MiB:.1f} retained, {m['live_after'] / MiB:.1f} once "
              f"trimmed{hwm}; {m['samples']} samples)")
        p(f"     {'plain dcp.save (information)':28s} peak extra {ref['extra_peak'] / MiB:7.1f}  = "
          f"{ref['extra_peak'] / shard:4.2f} x shard   (after: {ref['retained'] / MiB:.1f} retained, "
          f"{ref['live_after'] / MiB:.1f} once trimmed)")
        p(f"     resident before first save {first['rss_before'] / MiB:.1f}, before steady save "
          f"{steady['rss_before'] / MiB:.1f} (the staging copy stays between saves)")
        mem_out.append({"rank": r["rank"], "shard_bytes": shard, "first": first,
                        "steady": steady, "plain": ref, "ratio_first": rf, "ratio_steady": rs,
                        "target": TARGET_MEMORY,
                        "met_first": rf <= TARGET_MEMORY, "met_steady": rs <= TARGET_MEMORY})
    out["memory"] = mem_out
    _report_verified(out["restored_state_verified"])
    return out


def _report_verified(all_ok: bool) -> None:
    print()
    print(f"Restored state checked against the saved one in every restore: "
          f"{'yes, all equal' if all_ok else 'NO: some differ (see above)'}")


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=224.0,
                    help="minimum parameters + Adam state in MiB, over both ranks (224)")
    ap.add_argument("--depth", type=int, default=4, help="Linear layers (4)")
    ap.add_argument("--batch", type=int, default=16, help="training batch per rank (16)")
    ap.add_argument("--saves", type=int, default=5, help="timed saves of each kind (5)")
    ap.add_argument("--restores", type=int, default=5, help="restores of each kind (5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (1)")
    ap.add_argument("--sample-ms", type=float, default=2.0, help="RSS sampling period (2)")
    ap.add_argument("--cold", action="store_true",
                    help="also restore after evicting the files from the page cache")
    ap.add_argument("--restore-only", action="store_true",
                    help="only section 2: one untimed save of each kind, then the restores")
    ap.add_argument("--memory", action="store_true",
                    help="only: resharded restore (2 -> 1 ranks) from the memory tier vs from "
                         "disk, the same step, side by side (target <= 0.5x)")
    ap.add_argument("--memory-dir", default="",
                    help="--memory: make the memory tier's directory under this one (default "
                         "/dev/shm), e.g. a tmpfs mounted with huge=within_size")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--keep-dir", action="store_true", help="do not delete the checkpoints")
    ap.add_argument("--verbose", action="store_true", help="the Checkpointer's INFO logs")
    args = ap.parse_args()
    if args.saves < 1 or args.restores < 1 or args.depth < 1:
        ap.error("--saves, --restores and --depth must be at least 1")

    import torch
    import torch.multiprocessing as mp

    # 3 float32 copies (parameter, exp_avg, exp_avg_sq) of depth x (w*w + w) elements.
    per_elem = 3 * 4 * args.depth
    width = math.ceil(math.sqrt(args.size_mb * MiB / per_elem) / 64) * 64
    while per_elem * (width * width + width) < args.size_mb * MiB:
        width += 64
    state_bytes = per_elem * (width * width + width)
    # Ours keeps 3 committed + 1 being written (+ trash); plain keeps 2 at a time.
    need = int(state_bytes * 7 * 1.1) + 512 * MiB
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < need:
        print(f"not enough free space under {tempfile.gettempdir()}: need about "
              f"{need / MiB:.0f} MiB, have {free / MiB:.0f} MiB; pass a smaller --size-mb",
              file=sys.stderr)
        return 2
    scratch = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=tempfile.gettempdir())
    cfg = Config(scratch=scratch, width=width, depth=args.depth, batch=args.batch,
                 saves=args.saves, restores=args.restores, threads=args.threads,
                 sample_ms=args.sample_ms, cold=args.cold, restore_only=args.restore_only,
                 verbose=args.verbose, memory_base=args.memory_dir)
    from elastic.checkpoint import layout

    meta = {"loadavg_before": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version(),
            "crc32": layout.CRC32_IMPLEMENTATION,
            "cpus": os.cpu_count(), "width": width, "depth": args.depth,
            "state_mib": state_bytes / MiB, "param_mib": state_bytes / 3 / MiB,
            "free_disk_mib": free / MiB, "scratch": scratch, "args": vars(args)}
    print(f"state {state_bytes / MiB:.1f} MiB (width {width}, depth {args.depth}); "
          f"free disk {free / 2**30:.1f} GiB; scratch {scratch}; load average "
          f"{_loadavg()}", flush=True)
    started = time.monotonic()
    try:
        if args.memory:
            results = run_memory(cfg)
            meta["loadavg_after"] = os.getloadavg()
            print(f"load average after: {_loadavg()}")
            meta["wall_s"] = time.monotonic() - started
            results["meta"] = meta
            return _finish(args, results)
        print("world size 2: saves (ours, plain), memory, restores ...", flush=True)
        mp.spawn(_entry, args=("rank_world2", 2, cfg), nprocs=2, join=True)
        print(f"  done in {time.monotonic() - started:.0f} s; world size 1: restores ...",
              flush=True)
        mp.spawn(_entry, args=("rank_world1", 1, cfg), nprocs=1, join=True)
        w2 = [json.load(open(os.path.join(scratch, f"w2-rank{r}.json"))) for r in range(2)]
        w1 = [json.load(open(os.path.join(scratch, "w1-rank0.json")))]
        meta["wall_s"] = time.monotonic() - started
        meta["loadavg_after"] = os.getloadavg()
        print(f"  done in {meta['wall_s']:.0f} s", flush=True)
        results = report(cfg, w2, w1, meta)
    finally:
        if not args.keep_dir:
            shutil.rmtree(scratch, ignore_errors=True)
    return _finish(args, results)


def _loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


def _finish(args: argparse.Namespace, results: dict[str, Any]) -> int:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
