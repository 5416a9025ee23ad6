"""The GPU check (``make gpu-check``): what only a CUDA device shows, in one short run.

Runs on a machine with at least one NVIDIA GPU and torch built for it, with this
repository on ``PYTHONPATH`` (the Makefile target installs what the machine lacks
from ``.whl``, see ``make gpu-wheels``). Each check is bounded in time; one that
fails is reported and the next one runs. Prints one line per check and a
Markdown section for ``docs/gpu.md``; with ``--out DIR`` also writes
``gpu-check.json`` and ``gpu-check.md`` there. Exit status 1 when any check failed.

1. ``environment``: GPU, driver, torch, CUDA; NVML's health reading as
   ``elasticd --gpu-check enforce`` judges it (``agent.nvml.read_gpu_health``).
2. ``async-save-restore``: a model on the GPU, trained on a CUDA stream of its own,
   four async saves in a row, then restored into a fresh model that trains on:
   the result equals the uninterrupted run bitwise, CUDA RNG included (dropout
   and ``randn`` on the device). Figures: time ``save()`` blocks (the previous
   save's wait timed apart), restore; and the same state saved by plain
   ``dcp.save`` and ``dcp.async_save`` (the time it blocks) for the ratio.
3. ``fsdp2-reshard``: FSDP2 on the GPU (world 1, NCCL) saves; two CPU ranks (gloo)
   restore it resharded and save again; the GPU world 1 restores that. Full
   model and optimizer state compared bitwise at each hop.
4. ``sigkill-first-step``: ``examples/ddp.py`` on the GPU, its worker SIGKILLed at
   its first step, under ``elasticd --standalone`` and under ``torchrun
   --standalone``: seconds from the kill to the replacement's first step, and
   until NVML no longer lists the dead worker; the GPU's memory back at its
   baseline once the job is stopped.
5. ``placement``: ``tools/gpu_check_placement.py``: the template's fork guard with
   and without its NVML setting, ``elastic.init("cpu:gloo,cuda:nccl")`` binding
   the rank's GPU, ``examples/pipeline.py`` on the GPU.
6. ``hang``: a worker stuck in a CUDA kernel (``torch.cuda._sleep``) holding 4 GiB,
   under ``elasticd --hang-timeout 3``: seconds until the agent notices, until
   the memory is free again, and until the restarted worker's first step.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_WORKER = os.path.join(REPO, "tools", "gpu_check_hang.py")
DDP_EXAMPLE = os.path.join(REPO, "examples", "ddp.py")


# --- helpers ------------------------------------------------------------------------------------


def _nvml_processes() -> dict[int, int]:
    """pid -> bytes of GPU memory, over every GPU (NVML's compute processes)."""
    import pynvml

    pynvml.nvmlInit()
    found: dict[int, int] = {}
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            found[int(proc.pid)] = int(proc.usedGpuMemory or 0)
    return found


def _gpu_used_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    return sum(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
               for i in range(pynvml.nvmlDeviceGetCount()))


def _wait(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s:g} s")


def _records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _digest(state: dict) -> str:
    import torch

    sha = hashlib.sha256()
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            sha.update(key.encode())
            sha.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            sha.update(key.encode())
            sha.update(_digest(value).encode())
        else:
            sha.update(f"{key}={value!r}".encode())
    return sha.hexdigest()[:16]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@contextlib.contextmanager
def _launched(argv: list[str], log: str, env: dict[str, str]):
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# --- 1. environment -------------------------------------------------------------------------------


def check_environment(scratch: str) -> dict:
    import torch

    from agent.nvml import read_gpu_health

    health = read_gpu_health(wait_s=2.0)
    props = torch.cuda.get_device_properties(0)
    figures = {"gpu": props.name, "gpus": torch.cuda.device_count(),
               "memory_gib": round(props.total_memory / 2**30, 1),
               "driver": health.get("driver"), "torch": torch.__version__,
               "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
               "python": sys.version.split()[0],
               "nvml_read_s": round(health.get("read_s", 0.0), 4),
               "health_verdict": health["verdict"]["action"],
               "health_reason": health["verdict"]["reason"]}
    ok = health["nvml"] == "available" and health["verdict"]["action"] == "pass"
    return {"ok": ok, "figures": figures, "health": health}


# --- 2. async save and restore on the GPU ---------------------------------------------------------


def _gpu_model(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(8192, 2048), nn.LayerNorm(2048)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, optimizer, steps, stream, after_step=None):
    import torch

    for step in steps:
        with torch.cuda.stream(stream):
            x = torch.randn(256, 2048, device="cuda")
            loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step(step)


def check_async_save_restore(scratch: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from elastic.checkpoint import Checkpointer

    torch.use_deterministic_algorithms(True)
    root = os.path.join(scratch, "async")
    stream = torch.cuda.Stream()
    model, optimizer = _gpu_model(0)
    checkpointer = Checkpointer(root, model=model, optimizer=optimizer)
    blocked: list[float] = []
    waited: list[float] = []
    save_at = {3, 5, 7, 9}

    def save(step):
        if step in save_at:
            started = time.perf_counter()
            checkpointer.wait()  # the previous save, still writing: timed apart
            waited.append(time.perf_counter() - started)
            started = time.perf_counter()
            checkpointer.save(step, async_=True)  # on the training stream (see staging.py)
            blocked.append(time.perf_counter() - started)

    started = time.perf_counter()
    _train(model, optimizer, range(12), stream, save)
    checkpointer.wait()
    train_and_save_s = time.perf_counter() - started
    torch.cuda.synchronize()
    expected = {"model": _digest(model.state_dict()),
                "rand": torch.rand(8, device="cuda").tolist()}
    checkpointer.close()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3

    fresh, fresh_optimizer = _gpu_model(1)
    restorer = Checkpointer(root, model=fresh, optimizer=fresh_optimizer)
    started = time.perf_counter()
    start = restorer.restore()
    torch.cuda.synchronize()
    restore_s = time.perf_counter() - started
    _train(fresh, fresh_optimizer, range(start, 12), stream)
    torch.cuda.synchronize()
    got = {"model": _digest(fresh.state_dict()), "rand": torch.rand(8, device="cuda").tolist()}
    restorer.close()

    in_place = _tensors_read_into_the_device(root, fresh, fresh_optimizer)

    # The reference, plain DCP on the same state: blocking time of a sync and an async save.
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    plain_root = os.path.join(scratch, "plain")
    started = time.perf_counter()
    dcp.save(state, checkpoint_id=os.path.join(plain_root, "sync"))
    plain_sync_s = time.perf_counter() - started
    started = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=os.path.join(plain_root, "async"))
    plain_async_blocked_s = time.perf_counter() - started
    future.result()
    torch.use_deterministic_algorithms(False)
    ok = start == 10 and got == expected and in_place["on_device"] == in_place["tensors"]
    return {"ok": ok, "figures": {
        "restore_tensors_read_straight_into_gpu": f"{in_place['on_device']} of "
                                                  f"{in_place['tensors']}",
        "state_gib": round(nbytes / 2**30, 2), "saves": len(blocked), "resumed_at": start,
        "bitwise_equal_with_cuda_rng": got == expected,
        "save_blocked_s_median": round(sorted(blocked)[len(blocked) // 2], 4),
        "waited_for_previous_save_s_median": round(sorted(waited)[len(waited) // 2], 3),
        "train_12_steps_with_4_saves_s": round(train_and_save_s, 2),
        "restore_s": round(restore_s, 3),
        "plain_dcp_save_s": round(plain_sync_s, 3),
        "plain_dcp_async_save_blocked_s": round(plain_async_blocked_s, 4)}}


def _tensors_read_into_the_device(root: str, model, optimizer) -> dict:
    """The latest checkpoint under ``root`` loaded again through the verifying reader
    into the model's CUDA tensors: how many went straight from the file into device
    memory (through pinned memory) rather than through ``torch.load``."""
    import torch.distributed.checkpoint as dcp

    from elastic._compat import torch_checkpoint as compat
    from elastic.checkpoint import layout, state
    from elastic.checkpoint.dcp_io import LoadPlanner, VerifyingReader

    name = layout.restore_candidates(layout.list_checkpoints(root), None)[0]
    manifests, _ = layout.read_manifests(os.path.join(root, name))
    files = {n: digest for m in manifests for n, digest in m.files.items()}
    reader = VerifyingReader(os.path.join(root, name), files)
    tensors = state.collect(state.make_chunks(model, optimizer))
    dcp.load(tensors.state_dict, storage_reader=reader, planner=LoadPlanner(),
             **compat.single_process(True))
    count = sum(1 for group in tensors.state_dict.values() for value in group.values()
                if hasattr(value, "is_cuda") and value.is_cuda)
    return {"tensors": count, "on_device": reader.tensors_on_device}


# --- 3. FSDP2: GPU world 1 -> CPU world 2 -> GPU world 1 --------------------------------------------


def _fsdp_rank(rank: int, world: int, device: str, root: str, store: str, out: str,
               steps_before_save: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic.checkpoint import Checkpointer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).to(device)
    mesh = init_device_mesh(device, (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    checkpointer = Checkpointer(root, model=model, optimizer=optimizer)
    start = checkpointer.restore()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True,
                            flatten_optimizer_state_dict=True)

    def digest() -> dict:
        return {"model": _digest(get_model_state_dict(model, options=full)),
                "optim": _digest(get_optimizer_state_dict(model, optimizer, options=full))}

    restored = digest()
    step = start
    for step in range(start, start + steps_before_save):
        torch.manual_seed(100 + step)
        x = torch.randn(16, 512, device=device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpointer.save(step, async_=True)
    checkpointer.close()
    saved = digest()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"start": start, "restored": restored, "saved": saved,
                       "step": step}, f)
    dist.destroy_process_group()


def _run_world(world: int, device: str, root: str, scratch: str, name: str) -> dict:
    import torch.multiprocessing as mp

    store = os.path.join(scratch, f"{name}.store")
    out = os.path.join(scratch, f"{name}.json")
    context = mp.get_context("spawn")
    procs = [context.Process(target=_fsdp_rank, args=(r, world, device, root, store, out, 2))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        if proc.exitcode != 0:
            raise RuntimeError(f"{name}: a rank exited with {proc.exitcode}")
    with open(out) as f:
        return json.load(f)


def check_fsdp2_reshard(scratch: str) -> dict:
    root = os.path.join(scratch, "fsdp")
    started = time.perf_counter()
    first = _run_world(1, "cuda", root, scratch, "gpu1")
    second = _run_world(2, "cpu", root, scratch, "cpu2")
    third = _run_world(1, "cuda", root, scratch, "gpu1-again")
    hops = {"gpu1_to_cpu2_equal": second["restored"] == first["saved"],
            "cpu2_to_gpu1_equal": third["restored"] == second["saved"],
            "resumed_steps": [first["start"], second["start"], third["start"]]}
    ok = (hops["gpu1_to_cpu2_equal"] and hops["cpu2_to_gpu1_equal"]
          and hops["resumed_steps"] == [0, first["step"] + 1, second["step"] + 1])
    hops["seconds"] = round(time.perf_counter() - started, 1)
    return {"ok": ok, "figures": hops}


# --- 4. SIGKILL at the first step, elasticd and torchrun --------------------------------------------


def _kill_at_first_step(argv: list[str], env: dict, scratch: str, name: str,
                        progress: str) -> dict:
    baseline = _gpu_used_bytes()
    log = os.path.join(scratch, f"{name}.log")
    with _launched(argv, log, env) as proc:
        try:
            first = _wait(lambda: _records(progress), 120, f"{name}: first step")[0]
            victim = first["pid"]
            listed = victim in _nvml_processes()  # else NVML sees other pids (a container)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()
            gone = _wait(lambda: victim not in _nvml_processes(), 30,
                         f"{name}: the dead worker's GPU memory freed")
            freed_s = time.time() - killed_at
            replacement = _wait(lambda: [r for r in _records(progress) if r["pid"] != victim],
                                60, f"{name}: the replacement's first step")[0]
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; log tail:\n{_tail(log)}") from None
        assert gone
        recovery_s = replacement["t"] - killed_at
    after = _wait(lambda: _gpu_used_bytes() <= baseline + 64 * 2**20 or None, 30,
                  f"{name}: the GPU's memory back at its baseline") and _gpu_used_bytes()
    return {"recovery_s": round(recovery_s, 3), "nvml_listed_the_worker": listed,
            "memory_freed_after_kill_s": round(freed_s, 3),
            "memory_back_mib": round((after - baseline) / 2**20, 1), "exit": proc.returncode}


def check_sigkill_first_step(scratch: str) -> dict:
    figures: dict[str, Any] = {}
    for name in ("elasticd", "torchrun"):
        progress = os.path.join(scratch, f"{name}.progress")
        ckpt = os.path.join(scratch, f"{name}-ckpt")
        script = [DDP_EXAMPLE, "--steps", "100000", "--step-time", "0.05",
                  "--progress-file", progress, "--checkpoint-dir", ckpt]
        if name == "elasticd":
            argv = [sys.executable, "-m", "agent.daemon", "--standalone", "--job-id", "gpucheck",
                    "--nnodes", "1", "--nproc-per-node", "1", "--advertise-addr", "127.0.0.1",
                    "--listen", "127.0.0.1:0", "--log-dir", os.path.join(scratch, "elasticd-logs"),
                    *script]
            env = _env()
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "1", "--max-restarts", "3", *script]
            env = _env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        figures[name] = _kill_at_first_step(argv, env, scratch, name, progress)
    figures["ratio_elasticd_to_torchrun"] = round(
        figures["elasticd"]["recovery_s"] / figures["torchrun"]["recovery_s"], 3)
    ok = all(figures[n]["memory_back_mib"] <= 64 for n in ("elasticd", "torchrun"))
    return {"ok": ok, "figures": figures}


# --- 5. a stuck kernel ----------------------------------------------------------------------------


def check_hang(scratch: str) -> dict:
    progress = os.path.join(scratch, "hang.progress")
    baseline = _gpu_used_bytes()
    argv = [sys.executable, "-m", "agent.daemon", "--standalone", "--job-id", "gpuhang",
            "--nnodes", "1", "--nproc-per-node", "1", "--advertise-addr", "127.0.0.1",
            "--listen", "127.0.0.1:0", "--hang-timeout", "3", "--stop-grace", "2",
            "--log-dir", os.path.join(scratch, "hang-logs"), HANG_WORKER, progress,
            os.path.join(scratch, "hang.marker")]
    log = os.path.join(scratch, "hang.log")
    with _launched(argv, log, _env()) as proc:
        try:
            stuck = _wait(lambda: [r for r in _records(progress) if r.get("event") == "stuck"],
                          120, "the worker's stuck kernel")[0]
            victim = stuck["pid"]
            gone = _wait(lambda: victim not in _nvml_processes(), 60,
                         "the stuck worker's GPU memory freed")
            freed_at = time.time()
            resumed = _wait(lambda: [r for r in _records(progress)
                                     if r.get("event") == "step" and r["pid"] != victim],
                            60, "the restarted worker's first step")[0]
            proc.wait(60)
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            raise TimeoutError(f"{exc}; log tail:\n{_tail(log)}") from None
    assert gone
    after = _gpu_used_bytes()
    with open(log, errors="replace") as f:
        detected = [line for line in f if "made no progress" in line]
    figures = {"stuck_to_memory_freed_s": round(freed_at - stuck["t"], 2),
               "stuck_to_restarted_first_step_s": round(resumed["t"] - stuck["t"], 2),
               "held_gib": stuck["held_gib"], "agent_exit": proc.returncode,
               "memory_back_mib": round((after - baseline) / 2**20, 1),
               "agent_said": detected[0].strip()[:200] if detected else None}
    ok = proc.returncode == 0 and figures["memory_back_mib"] <= 64
    return {"ok": ok, "figures": figures}


def check_placement(scratch: str) -> dict:
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "gpu_check_placement.py")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    checks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    figures = {c["check"]: "pass" if c.get("ok") else {k: v for k, v in c.items()
                                                       if k not in ("check", "ok")}
               for c in checks}
    return {"ok": done.returncode == 0 and bool(checks) and all(c.get("ok") for c in checks),
            "figures": figures or {"stderr": done.stderr[-1500:]}}


# --- the run --------------------------------------------------------------------------------------


CHECKS: dict[str, Callable[[str], dict]] = {
    "environment": check_environment,
    "async-save-restore": check_async_save_restore,
    "fsdp2-reshard": check_fsdp2_reshard,
    "sigkill-first-step": check_sigkill_first_step,
    "placement": check_placement,
    "hang": check_hang,
}


def _markdown(results: dict, started: str, seconds: float) -> str:
    env = results.get("environment", {}).get("figures", {})
    lines = [f"### {started}: {env.get('gpu', '?')}, driver {env.get('driver', '?')}, "
             f"torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}, NCCL "
             f"{env.get('nccl', '?')}), Python {env.get('python', '?')}", "",
             f"`make gpu-check`: {seconds:.0f} s.", "", "| check | result | figures |",
             "| --- | --- | --- |"]
    for name, result in results.items():
        verdict = "pass" if result.get("ok") else "**FAIL**"
        detail = json.dumps(result.get("figures") or result.get("error", ""))
        lines.append(f"| {name} | {verdict} | `{detail}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", choices=list(CHECKS),
                    help="run only these checks (repeatable)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write the report here too")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible to torch; this check needs one GPU.",
              file=sys.stderr)
        return 2
    scratch = tempfile.mkdtemp(prefix="elastic-gpu-check-")
    started_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    started = time.monotonic()
    results: dict[str, dict] = {}
    for name, check in CHECKS.items():
        if args.only and name not in args.only:
            continue
        began = time.monotonic()
        try:
            results[name] = check(scratch)
        except Exception as exc:  # noqa: BLE001 - reported, and the next check runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()}
        results[name]["seconds"] = round(time.monotonic() - began, 1)
        verdict = "ok" if results[name]["ok"] else "FAILED"
        print(f"{name}: {verdict} in {results[name]['seconds']} s: "
              f"{json.dumps(results[name].get('figures') or results[name].get('error'))}",
              flush=True)
        if not results[name]["ok"] and "traceback" in results[name]:
            print(results[name]["traceback"], file=sys.stderr, flush=True)
    report = _markdown(results, started_at, time.monotonic() - started)
    print(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "gpu-check.md"), "w") as f:
            f.write(report)
        for log in ("elasticd.log", "torchrun.log", "hang.log"):
            if os.path.exists(os.path.join(scratch, log)):
                shutil.copy(os.path.join(scratch, log), os.path.join(args.out, log))
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
