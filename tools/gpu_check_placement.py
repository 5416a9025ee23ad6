"""Issue 23's worker-side placement checks on a real CUDA device (one GPU is enough).

Run on the GPU machine from the repository root, with its own torch::

    PYTHONPATH=.:$GPU_SITE python3 tools/gpu_check_placement.py

Each check runs in a fresh interpreter, bounded in time, and prints one JSON line;
the exit status is 1 when any failed.

1. ``fork-guard``: the default preload (``elastic.worker.bootstrap.DEFAULT_PRELOAD``)
   imported as the template imports it, then ``torch.cuda.is_available()``; the
   template's probe fork (``template._probe_fork``, which asks torch in the child
   through ``elastic._compat.torch_cuda``) and a forked child that uses CUDA. With
   the template's environment (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) the fork stays
   usable (NVML leaves a thread, which the template's thread check still refuses);
   without it torch poisons fork and the probe must say so.
2. ``device-binding``: ``elastic.init("cpu:gloo,cuda:nccl")`` in a world of one binds
   cuda:LOCAL_RANK (``device_id`` too) and collectives run on CUDA and CPU tensors;
   a LOCAL_RANK with no GPU is a ConfigError.
3. ``pipeline``: ``examples/pipeline.py`` (one stage, torchrun) puts its stage on the GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORK_GUARD = """
import json, os, sys, time
from elastic.worker import bootstrap, template
if sys.argv[1] == "nvml":  # the environment the agent starts a template with
    os.environ.update(template.TEMPLATE_ENV)
started = time.monotonic()
bootstrap._preload(bootstrap.DEFAULT_PRELOAD)
preload_s = time.monotonic() - started
after_preload = template._probe_fork()
import torch
available = torch.cuda.is_available()
after_available = template._probe_fork()
initialized = torch.cuda.is_initialized()
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # a fork takes the assignment's env
pid = os.fork()
if pid == 0:
    try:
        ok = float(torch.ones(4, device="cuda").sum()) == 4.0
        os._exit(0 if ok else 2)
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"child: {exc!r}"[:300] + "\\n")
        os._exit(3)
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"mode": sys.argv[1], "torch": torch.__version__,
                  "preload_s": round(preload_s, 2), "poisoned_after_preload": after_preload,
                  "is_available": available, "poisoned_after_is_available": after_available,
                  "is_initialized": initialized, "forked_child_cuda_exit": child,
                  "reason": template.unsafe_reason(fork_poisoned=after_available)}))
"""

DEVICE_BINDING = """
import json, os
import torch, torch.distributed as dist
import elastic
from elastic.errors import ConfigError
from elastic.worker import runtime
out = {"gpus": torch.cuda.device_count()}
elastic.init(backend="cpu:gloo,cuda:nccl", timeout_s=60)
out["current_device"] = torch.cuda.current_device()
out["elastic_device"] = str(elastic.device())
out["bound_device_id"] = str(dist.distributed_c10d._get_default_group().bound_device_id)
g = torch.ones(3, device=elastic.device()); dist.all_reduce(g)
c = torch.ones(3); dist.all_reduce(c)
out["all_reduce"] = [g.device.type, float(g.sum()), c.device.type, float(c.sum())]
dist.destroy_process_group()
try:
    runtime.join_process_group("nccl", 5.0, torch.cuda.device_count(), torch.cuda,
                               dist.init_process_group)
    out["past_the_gpus"] = "no error"
except ConfigError as exc:
    out["past_the_gpus"] = str(exc)
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, argv: list[str], env: dict[str, str] | None = None,
         timeout_s: float = 120) -> dict:
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("{", "pipeline:", "done:"))]
    result: dict = {"check": name, "rc": done.returncode}
    try:
        result.update(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        result["stdout"] = lines
    if done.returncode != 0 or not lines:
        result["stderr"] = done.stderr[-1500:]
    return result


def main() -> int:
    results = []
    for mode in ("nvml", "driver"):
        r = _run(f"fork-guard/{mode}", [sys.executable, "-c", FORK_GUARD, mode])
        if mode == "nvml":
            # NVML's initialisation leaves a thread of its own ("cuda0000..." on torch
            # 2.11, H200): the template then falls back to spawning for that thread,
            # as it must; what matters here is that the fork is not poisoned.
            r["ok"] = r.get("poisoned_after_is_available") is False \
                and r.get("forked_child_cuda_exit") == 0
        else:
            r["ok"] = r.get("poisoned_after_is_available") is True \
                and r.get("forked_child_cuda_exit") != 0 and bool(r.get("reason"))
        results.append(r)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    r = _run("device-binding", [sys.executable, "-c", DEVICE_BINDING], env)
    r["ok"] = r.get("current_device") == 0 and r.get("elastic_device") == "cuda:0" \
        and r.get("bound_device_id") == "cuda:0" and "has no GPU of its own" in str(
            r.get("past_the_gpus"))
    results.append(r)
    r = _run("pipeline", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "1", "examples/pipeline.py", "--steps", "4",
                          "--ckpt-every", "0", "--depth", "4"])
    r["ok"] = r.get("rc") == 0 and any("stages on cuda" in s for s in r.get("stdout", []))
    results.append(r)
    for r in results:
        print(json.dumps(r), flush=True)
    print(textwrap.dedent(f"""
        placement checks: {sum(r['ok'] for r in results)} of {len(results)} passed"""))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
