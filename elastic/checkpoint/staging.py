"""Our own staging copy: a state dict's tensors copied into CPU buffers kept for the next save.

Why not torch's ``DefaultStager``: it appeared in torch 2.9 (our floor is
older), and its lifecycle changed between releases (2.11 and 2.12 close its
deep-copy table at the end of every ``stage()``, so a second ``stage()`` on
the same stager fails with ``KeyError: <class 'type'>`` and its pinned buffers
are allocated and registered again at every save). This copy uses public API
only, so no torch release can change it under us:

* one CPU buffer per tensor, by its place in the state dict, allocated at the
  first save and reused while the tensor keeps its shape and dtype;
* a buffer for a CUDA tensor is page-locked once (``cudaHostRegister``) so
  that the device-to-host copy runs asynchronously at full speed, and
  unregistered when it is replaced or the stager closes;
* a DTensor's buffer is a CPU DTensor made by ``DTensor.to("cpu")`` (the same
  spec: DCP writes it as the same shard), whose local tensor is refilled at
  every save;
* CUDA copies run on a stream of their own, on the device the stager was
  given (never the thread's default device 0), after an event recorded on the
  caller's stream when the save began (:meth:`Stager.mark`), so a script that
  trains on a stream of its own is never copied mid-update.

Anything that is not a tensor is deep-copied; containers (dict, list, tuple)
are walked.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from elastic.checkpoint import timing

log = logging.getLogger(__name__)

Path = tuple  # a value's place in the state dict: the keys and indices leading to it


class CudaOps(Protocol):
    """What the stager needs of CUDA; :class:`TorchCuda` is the real one, tests
    inject a recording fake. ``device`` is a CUDA device index."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a plain tensor, a DTensor's local one) is in CUDA memory."""

    def bind(self, device: int) -> None:
        """Make ``device`` the calling thread's current device."""

    def mark(self, device: int) -> Any:
        """An event recorded now on the calling thread's current stream of ``device``."""

    def copy_stream(self, device: int) -> Any:
        """A stream of the stager's own on ``device``, made once."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``."""

    def synchronize(self, stream: Any) -> None:
        """Block until everything queued on ``stream`` is done."""

    def use(self, stream: Any) -> Any:
        """A context manager that makes ``stream`` current."""

    def register(self, tensor: torch.Tensor) -> bool:
        """Page-lock a CPU tensor's memory; False when CUDA refuses (it stays pageable)."""

    def unregister(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`register`."""


class TorchCuda:
    """:class:`CudaOps` through torch's public CUDA API."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def bind(self, device: int) -> None:
        torch.cuda.set_device(device)

    def mark(self, device: int) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def copy_stream(self, device: int) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def register(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes == 0:
            return False
        # Flag 1 (cudaHostRegisterPortable): usable from every context, as torch's own
        # staging registers; 0 is success.
        status = torch.cuda.cudart().cudaHostRegister(tensor.untyped_storage().data_ptr(),
                                                      nbytes, 1)
        return int(status) == 0

    def unregister(self, tensor: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(tensor.untyped_storage().data_ptr())


class Stager:
    """Copies state dicts to CPU into buffers it keeps between saves.

    ``device`` is the CUDA device index the caller trains on (None: no CUDA);
    CUDA tensors on any device are copied on that device's copy stream, with
    the thread bound to ``device`` first. Not thread-safe: one save at a time
    (the checkpointer serializes them). :meth:`close` releases the buffers.
    """

    def __init__(self, device: int | None, cuda: CudaOps | None = None):
        self.device = device
        self._cuda = cuda if cuda is not None else (TorchCuda() if device is not None else None)
        self._buffers: dict[Path, torch.Tensor] = {}
        self._pinned: dict[Path, torch.Tensor] = {}  # the registered local tensors
        self.allocations = 0  # buffers made so far (a second save of the same shapes makes none)

    def bind(self) -> None:
        """Make the stager's device the calling thread's current one (a thread's
        default is device 0, where every rank of a node would otherwise make a
        CUDA context). Call it first thing in a thread that saves."""
        if self._cuda is not None and self.device is not None:
            self._cuda.bind(self.device)

    def mark(self) -> Any:
        """Call in the training thread when a save begins: an event that the copy
        of tensors on the device waits for (None without CUDA)."""
        if self._cuda is None or self.device is None:
            return None
        return self._cuda.mark(self.device)

    @timing.timed("stage")
    def stage(self, state_dict: Any, *, after: Any = None, prefix: Path = ()) -> Any:
        """A CPU copy of ``state_dict`` (same structure; tensors in this stager's
        buffers, other values deep-copied), complete when this returns. CUDA
        tensors are copied after ``after`` (an event from :meth:`mark`).
        ``prefix`` keeps the buffers of separately staged parts apart."""
        if self._cuda is None or self.device is None or not self._has_device_tensor(state_dict):
            return self._copy(state_dict, prefix, non_blocking=False)
        stream = self._cuda.copy_stream(self.device)
        with self._cuda.use(stream):
            if after is not None:
                self._cuda.wait(stream, after)
            copied = self._copy(state_dict, prefix, non_blocking=True)
        self._cuda.synchronize(stream)
        return copied

    def close(self) -> None:
        """Unregister and drop every buffer. Idempotent."""
        if self._cuda is not None:
            for tensor in self._pinned.values():
                try:
                    self._cuda.unregister(tensor)
                except Exception as exc:  # noqa: BLE001 - memory goes back with the process
                    log.debug("Could not unregister a staging buffer: %s", exc)
        self._pinned.clear()
        self._buffers.clear()

    def _has_device_tensor(self, value: Any) -> bool:
        assert self._cuda is not None
        if isinstance(value, torch.Tensor):
            return self._cuda.holds(local_tensor(value))
        if isinstance(value, dict):
            return any(self._has_device_tensor(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self._has_device_tensor(v) for v in value)
        return False

    def _copy(self, value: Any, path: Path, non_blocking: bool) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path, non_blocking)
        if isinstance(value, dict):
            return {key: self._copy(item, path + (key,), non_blocking)
                    for key, item in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self._copy(item, path + (index,), non_blocking)
                     for index, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def _copy_tensor(self, tensor: torch.Tensor, path: Path, non_blocking: bool) -> torch.Tensor:
        with torch.no_grad():
            buffer = self._buffer(tensor, path)
            local, target = local_tensor(tensor), local_tensor(buffer)
            # Asynchronous only into page-locked memory: into pageable memory the
            # copy would return before the bytes are there.
            target.copy_(local, non_blocking=non_blocking and path in self._pinned)
        return buffer

    def _buffer(self, tensor: torch.Tensor, path: Path) -> torch.Tensor:
        """This place's buffer, made anew when the tensor's layout changed."""
        buffer = self._buffers.get(path)
        if buffer is not None and _same_layout(buffer, tensor):
            return buffer
        self._release(path)
        local = local_tensor(tensor).detach()
        if isinstance(tensor, DTensor):
            # The same spec over a CPU local tensor, so DCP writes the same shard.
            buffer = tensor.detach().to("cpu", copy=True)  # never the live one itself
            if not local_tensor(buffer).is_contiguous():
                buffer = buffer.contiguous()
        else:
            buffer = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        self.allocations += 1
        if (self._cuda is not None and self._cuda.holds(local)
                and self._cuda.register(local_tensor(buffer))):
            self._pinned[path] = local_tensor(buffer)
        self._buffers[path] = buffer
        return buffer

    def _release(self, path: Path) -> None:
        self._buffers.pop(path, None)
        pinned = self._pinned.pop(path, None)
        if pinned is not None and self._cuda is not None:
            self._cuda.unregister(pinned)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _same_layout(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    if isinstance(buffer, DTensor) != isinstance(tensor, DTensor):
        return False
    if isinstance(tensor, DTensor) and (buffer.placements != tensor.placements
                                        or buffer.device_mesh != tensor.device_mesh
                                        or buffer.shape != tensor.shape):
        return False
    mine, theirs = local_tensor(buffer), local_tensor(tensor)
    return mine.shape == theirs.shape and mine.dtype == theirs.dtype


