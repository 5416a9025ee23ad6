"""torch's CUDA fork guard: whether a process forked now could still use CUDA.

torch refuses CUDA ("Cannot re-initialize CUDA in forked subprocess") in a
process forked after its parent asked the CUDA driver anything. What marks
the parent is not ``torch.cuda.is_initialized()``: ``torch._C._cuda_getDeviceCount``
registers, on its first call, a ``pthread_atfork`` child handler (its
``poison_fork()``) that sets the child's "bad fork" flag, and
``torch.cuda.is_available()`` calls it unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``
(then it counts GPUs through NVML, which does not touch the driver; it still
falls back on the driver if NVML fails), as does ``device_count()`` when NVML
fails. ``is_initialized()`` stays False through all of that. Nothing public
in the parent tells; the child does: :func:`in_bad_fork`, called right after
a probe ``fork()``, is torch's own answer.

Internals used, and where they were read:

* ``torch._C._cuda_isInBadFork``: present in every CUDA build of torch
  2.6.0, 2.8.0, 2.11.0 and 2.14.1 (the PyPI wheels' ``torch/cuda/__init__.py``:
  ``_is_in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)``;
  ``poison_fork()`` in ``torch/csrc/cuda/Module.cpp``), absent from CPU builds
  (2.13.0+cpu, tested here), which have no CUDA to poison.
* ``PYTORCH_NVML_BASED_CUDA_CHECK``: documented in ``is_available()``'s
  note (same versions); public, listed here because its effect is the point.

Fallback: a CUDA build of torch without ``_cuda_isInBadFork`` gives ``None``
("cannot tell"); the caller then has only the public
``torch.cuda.is_initialized()``, which misses a bare ``is_available()``.
"""

from __future__ import annotations

import types

# Set in a process's environment before torch is asked about CUDA, it makes
# torch.cuda.is_available() count GPUs through NVML instead of the driver.
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def cuda_build(torch_module: types.ModuleType | None) -> bool:
    """Whether ``torch_module`` (``sys.modules.get("torch")``) is a CUDA build of torch."""
    c = getattr(torch_module, "_C", None)
    return c is not None and hasattr(c, "_cuda_getDeviceCount")


def in_bad_fork(torch_module: types.ModuleType | None) -> bool | None:
    """In a process just forked: True when torch refuses CUDA here because the
    parent had asked the CUDA driver (see the module docstring); False when it
    does not, or when torch is not imported or has no CUDA; None when this CUDA
    build of torch has no way to say. Never raises."""
    if not cuda_build(torch_module):
        return False
    probe = getattr(torch_module._C, "_cuda_isInBadFork", None)
    if probe is None:
        return None
    try:
        return bool(probe())
    except Exception:  # noqa: BLE001 - a guard that cannot answer must not kill the caller
        return None
