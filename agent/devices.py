"""How many workers ``--nproc-per-node gpu|cpu|auto`` means on this host, without torch.

torchrun asks torch (``torch.cuda.device_count()``); the agent never imports
torch (it must start fast and survive its workers), so it counts the GPUs the
way CUDA will see them from two cheap sources:

1. the physical GPUs: the lines ``GPU <n>: ...`` of ``nvidia-smi -L`` (NVML,
   the source torch itself consults first; inside a container it lists only
   the GPUs given to the container), or, without nvidia-smi, the entries of
   ``/proc/driver/nvidia/gpus/`` (one directory per GPU the driver manages);
2. ``CUDA_VISIBLE_DEVICES``, read as CUDA reads it: unset, every physical GPU;
   a comma-separated list of ordinals, each read like ``strtoul`` (``1gpu`` is
   1), ending at the first entry that is not a non-negative number or names a
   GPU past the last physical one; ``GPU-``/``MIG-`` UUIDs, the leading
   entries with that prefix; a repeated entry, or an empty value, hides
   every GPU.

No GPU, no driver: 0 GPUs. Each source is asked once per call, with a
deadline (a wedged driver must not hang the agent's start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from elastic.errors import ConfigError
from elastic.records import cap_text

NPROC_WORDS = ("gpu", "cpu", "auto")
# torch's other accelerator words: elasticd has no way to count those devices without torch.
_UNCOUNTABLE = ("xpu", "mps", "hpu", "npu", "mtia")
_NVIDIA_SMI_TIMEOUT_S = 10.0
_PROC_GPUS = "/proc/driver/nvidia/gpus"


def parse_nproc_per_node(name: str, raw: Any) -> int | str:
    """``--nproc-per-node``: a count above 0, or one of ``gpu``, ``cpu``,
    ``auto`` (resolved at start by :func:`resolve_nproc`). Raises ConfigError
    naming the option for anything else, with the count to give instead of an
    accelerator elasticd cannot count."""
    text = str(raw).strip().lower() if isinstance(raw, (str, int)) else None
    shown = cap_text(repr(raw), 80)
    if text in NPROC_WORDS:
        return text
    if text in _UNCOUNTABLE:
        raise ConfigError(f"--{name} {shown}: elasticd counts only CUDA GPUs and CPUs; give the "
                          f"number of {text} devices, e.g. --{name} 8")
    digits = None if text is None else text.removeprefix("-")
    if digits is None or not (digits.isascii() and digits.isdigit()) or len(digits) > 9:
        raise ConfigError(f"--{name} {shown}: expected a int (at most 9 digits) or one of "
                          f"{', '.join(NPROC_WORDS)}")
    if text.startswith("-") or int(digits) == 0:
        raise ConfigError(f"--{name} {shown}: must be greater than 0")
    return int(digits)


def visible_cuda_devices(physical: int, cuda_visible_devices: str | None) -> int:
    """How many of ``physical`` GPUs a CUDA process sees under this value of
    ``CUDA_VISIBLE_DEVICES`` (None: unset). See the module docstring."""
    if cuda_visible_devices is None:
        return physical
    entries = [e.strip() for e in cuda_visible_devices.split(",")]
    if entries[0].startswith(("GPU-", "MIG-")):
        prefix = entries[0][:4]
        seen: list[str] = []
        for entry in entries:
            if not entry.startswith(prefix):
                break
            if entry in seen:
                return 0
            seen.append(entry)
        return min(len(seen), physical)
    ordinals: list[int] = []
    for entry in entries:
        digits = entry[:len(entry) - len(entry.lstrip("0123456789"))]
        if not digits or int(digits) >= physical:
            break
        if int(digits) in ordinals:
            return 0
        ordinals.append(int(digits))
    return len(ordinals)


def _nvidia_smi_gpus() -> int | None:
    """GPUs listed by ``nvidia-smi -L``; None when it is missing or fails."""
    program = shutil.which("nvidia-smi")
    if program is None:
        return None
    try:
        out = subprocess.run([program, "-L"], capture_output=True, text=True,
                             timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _proc_gpus() -> int:
    try:
        return len(os.listdir(_PROC_GPUS))
    except OSError:
        return 0


def physical_gpus() -> int:
    """This host's NVIDIA GPUs: ``nvidia-smi -L``, else ``/proc/driver/nvidia/gpus``."""
    counted = _nvidia_smi_gpus()
    return counted if counted is not None else _proc_gpus()


@dataclass(frozen=True)
class HostDevices:
    """Where :func:`resolve_nproc` learns the host's devices (tests pass fakes)."""

    physical_gpus: Callable[[], int] = physical_gpus
    cpu_count: Callable[[], int | None] = os.cpu_count


SYSTEM_DEVICES = HostDevices()


def resolve_nproc(spec: int | str, environ: Mapping[str, str],
                  devices: HostDevices = SYSTEM_DEVICES) -> tuple[int, str]:
    """The number of workers ``spec`` (from :func:`parse_nproc_per_node`) means
    here, and why, for a log line: ``gpu`` the GPUs CUDA will see, ``cpu`` the
    CPUs, ``auto`` the GPUs if any, else the CPUs, as torchrun does.

    Raises ConfigError for ``gpu`` on a host where CUDA would see no GPU
    (naming ``CUDA_VISIBLE_DEVICES`` when it hides them).
    """
    if isinstance(spec, int):
        return spec, "given"
    if spec in ("gpu", "auto"):
        physical = devices.physical_gpus()
        visible = visible_cuda_devices(physical, environ.get("CUDA_VISIBLE_DEVICES"))
        if visible > 0:
            return visible, (f"{spec}: {visible} of the {physical} GPUs are visible"
                             if visible != physical else f"{spec}: {physical} GPUs")
        if spec == "gpu":
            hidden = (f" (CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} hides "
                      f"all {physical})" if physical else "")
            raise ConfigError(f"--nproc-per-node gpu: this host has no visible CUDA GPU{hidden}; "
                              "give a number of workers, or cpu")
    cpus = devices.cpu_count() or 1
    return cpus, f"{spec}: {cpus} CPUs" + (", no GPU" if spec == "auto" else "")


def visible_gpus(physical: int, cuda_visible_devices: str | None) -> list[str]:
    """The GPUs a CUDA process sees under this ``CUDA_VISIBLE_DEVICES`` (None:
    unset), as entries that name them in that variable, in CUDA's order
    (:func:`visible_cuda_devices` says which count)."""
    count = visible_cuda_devices(physical, cuda_visible_devices)
    if cuda_visible_devices is None:
        return [str(i) for i in range(count)]
    return [e.strip() for e in cuda_visible_devices.split(",")][:count]


def colocated_node_gpus(node: int, nproc: int, visible: list[str]) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for the ``node``-th (from 0) of several agents
    that share one host (a demo, a benchmark), each running ``nproc`` workers,
    one GPU each: its own ``nproc`` of the ``visible`` GPUs, so that no two
    agents' ranks land on one GPU (NCCL refuses a GPU twice in a group). None
    when the host has no GPU: the workers run on the CPU (gloo), and so they do
    under an empty ``CUDA_VISIBLE_DEVICES``. Raises ConfigError when there are
    GPUs but fewer than node ``node`` needs."""
    if not visible:
        return None
    needed = (node + 1) * nproc
    if needed > len(visible):
        raise ConfigError(
            f"agent {node + 1} of this host needs GPUs {node * nproc}-{needed - 1} "
            f"({nproc} per agent, one per worker), but {len(visible)} are visible "
            f"({', '.join(visible)}): run with at least {needed} GPUs, or on the CPU "
            "with CUDA_VISIBLE_DEVICES=\"\"")
    return ",".join(visible[node * nproc:needed])
