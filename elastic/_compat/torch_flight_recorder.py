"""torch's flight recorder: the collectives a process group has in flight, as JSON.

With ``TORCH_FR_BUFFER_SIZE`` (or its older name ``TORCH_NCCL_TRACE_BUFFER_SIZE``)
set above 0 in a worker's environment, torch records each process group's
recent collectives: name (``gloo:all_reduce``, ``nccl:all_reduce``), sequence
number, state, and when it was enqueued (``time_created_ns``, wall clock).
:func:`dump_json` returns the active ones, for the hang reason's "which
collective, and who entered it last".

Internals used, and where they were read:

* ``torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives,
  onlyActive)``: torch 2.13.0+cpu, run here with gloo (the recorder covers
  gloo and NCCL there).
* ``torch._C._distributed_c10d._dump_nccl_trace_json(includeCollectives,
  includeStackTraces, onlyActive)``: the NCCL-only recorder of earlier
  releases (the name torch 2.4 to 2.8 export); read from torch's sources, not
  run here: there is no NCCL on this CPU machine, and no GPU was lent.

Fallback: ``None`` (no collective named from the recorder; the Python stack
still names one when the worker waits inside ``torch.distributed``).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether torch records collectives in a process with ``environ``."""
    for name in BUFFER_ENVS:
        try:
            if int(environ.get(name, "0") or 0) > 0:
                return True
        except ValueError:
            continue
    return False


def dump_json() -> bytes | None:
    """The active collectives of this process's groups as torch's JSON, or
    None (torch not imported, no recorder in this build, or it failed).
    Never raises."""
    torch = sys.modules.get("torch")
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    if c10d is None:
        return None
    try:
        if hasattr(c10d, "_dump_fr_trace_json"):
            return bytes(c10d._dump_fr_trace_json(True, True))
        if hasattr(c10d, "_dump_nccl_trace_json"):
            return bytes(c10d._dump_nccl_trace_json(True, False, True))
    except Exception:  # noqa: BLE001 - a diagnosis must never break the worker
        return None
    return None
