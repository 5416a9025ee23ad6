"""What a checkpoint holds, and how it is taken from and put back into live objects.

Tensor state (models and optimizers) goes through DCP's state-dict helpers,
so every key is a fully qualified parameter name whatever wraps the model
(DDP, FSDP2's ``fully_shard``, a pipeline stage that kept only its layers):

- ``model.<fqn>``: parameters and buffers (DTensor shards under FSDP2);
- ``optim.state.<fqn>.<name>`` and ``optim.param_groups.<fqn>.<option>``: the
  optimizer, flattened per parameter (``flatten_optimizer_state_dict``) so a
  checkpoint saved with S pipeline stages loads with S' stages: each rank
  saves and loads exactly the FQNs its chunks own.

Everything else is this rank's own state, serialized with ``torch.save`` into
``rank-<r>.pt`` and read back with ``torch.load(weights_only=True)`` and an
allow-list (:mod:`elastic.checkpoint.trust`): RNG states (torch CPU; every
CUDA device's when CUDA is in use; python ``random``; numpy's global
generator when numpy is importable; their words as bytes), LR scheduler
states, the step, the caller's data position and extras. On restore at the
same world size each rank gets its own file back, which makes the resumed run bitwise identical to an uninterrupted one. At
another world size every rank reads rank 0's file for the schedulers, data
position and extras (the usual case: they are the same on every rank) and
seeds its RNGs from a value derived from (rank 0's saved torch seed, step,
new rank): reproducible for a given resume, different on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import random
import struct
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from elastic._compat import torch_checkpoint as compat
from elastic.checkpoint import timing, trust
from elastic.errors import CheckpointError

try:  # numpy is optional here (torch's object collectives need it, see checkpointer.py)
    import numpy
except ImportError:  # pragma: no cover - depends on the environment
    numpy = None

LOCAL_FORMAT = 1
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One model chunk and the optimizers of its parameters."""

    model: nn.Module
    optimizers: tuple[torch.optim.Optimizer, ...]


def make_chunks(model: nn.Module | Sequence[nn.Module],
                optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
                ) -> list[Chunk]:
    """Pair model chunks with optimizers: one model takes every optimizer;
    several chunks (pipeline stages) take one optimizer each, in order.

    Raises TypeError/ValueError for anything else.
    """
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise TypeError(f"model must be an nn.Module or a non-empty list of them, got {model!r}")
    if optimizer is None:
        optimizers: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]
    if not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a list of them, "
                        f"got {optimizer!r}")
    if len(models) == 1:
        return [Chunk(models[0], tuple(optimizers))]
    if optimizers and len(optimizers) != len(models):
        raise ValueError(f"{len(models)} model chunks need one optimizer each, "
                         f"got {len(optimizers)}")
    return [Chunk(m, (optimizers[i],) if optimizers else ()) for i, m in enumerate(models)]


@dataclasses.dataclass
class TensorState:
    """``{"model": {...}, "optim": {...}}`` plus which keys each chunk owns."""

    state_dict: dict[str, dict[str, Any]]
    keys: list[tuple[list[str], list[str]]]  # per chunk: (model keys, optimizer keys)


@timing.timed("collect")
def collect(chunks: Sequence[Chunk]) -> TensorState:
    """The live, FQN-keyed state of every chunk (tensors are the live ones, not copies).

    An optimizer without state yet gets it initialized by DCP's helper (a
    step with zero gradients and a zero learning rate), so there are slots
    to save or to load into. Raises CheckpointError when two chunks claim the
    same FQN.
    """
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for index, chunk in enumerate(chunks):
        msd = get_model_state_dict(chunk.model, options=_OPTIONS)
        osd = (get_optimizer_state_dict(chunk.model, chunk.optimizers, options=_OPTIONS)
               if chunk.optimizers else {})
        clash = sorted((msd.keys() & model_sd.keys()) | (osd.keys() & optim_sd.keys()))
        if clash:
            raise CheckpointError(f"model chunk {index} shares keys with an earlier chunk, "
                                  f"e.g. {clash[:3]}; chunks must own disjoint parameters")
        model_sd.update(msd)
        optim_sd.update(osd)
        keys.append((list(msd), list(osd)))
    return TensorState({"model": model_sd, "optim": optim_sd}, keys)


@timing.timed("apply")
def apply(chunks: Sequence[Chunk], state: TensorState) -> None:
    """Load a state filled in by ``dcp.load`` back into the chunks (strict keys)."""
    for chunk, (model_keys, optim_keys) in zip(chunks, state.keys):
        set_model_state_dict(chunk.model, {k: state.state_dict["model"][k] for k in model_keys},
                             options=_OPTIONS)
        if chunk.optimizers:
            set_optimizer_state_dict(chunk.model, chunk.optimizers,
                                     {k: state.state_dict["optim"][k] for k in optim_keys},
                                     options=_OPTIONS)


def local_nbytes(state_dict: Any) -> int:
    """Bytes of tensor data this rank holds in a state dict (its shards only)."""
    if isinstance(state_dict, DTensor):
        return state_dict.to_local().nbytes
    if isinstance(state_dict, torch.Tensor):
        return state_dict.nbytes
    if isinstance(state_dict, dict):
        return sum(local_nbytes(v) for v in state_dict.values())
    if isinstance(state_dict, (list, tuple)):
        return sum(local_nbytes(v) for v in state_dict)
    return 0


# --- rank-local state ------------------------------------------------------------------------


def capture_local(*, step: int, rank: int, world_size: int, schedulers: Sequence[Any],
                  data_state: Any, extras: Any, compact: bool = False) -> bytes:
    """This rank's non-tensor state, serialized now (so later mutation by the
    training loop cannot leak into a save still being written; serializing
    before returning is what makes copies of the values needless).

    ``compact=True`` is the memory tier's per-step form, which
    :func:`load_local` and :func:`restore_rng` read the same way: torch's
    older, unzipped format, and the RNG states' tensors as their bytes, so
    that a record of plain values is pickled by the C pickler
    (:func:`compat.save_unzipped`): 85 us a call on the goodput bench's model,
    against 145 through ``torch.save`` unzipped and 170 zipped (most of the
    rest is reading the RNGs: numpy's alone is 30 us). Disk saves keep the zip
    format and the tensors, the form other tools expect of a file that
    outlives the job."""
    cuda_rng = cuda_rngs = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_rng = torch.cuda.get_rng_state()  # the current device's, for older readers
        cuda_rngs = torch.cuda.get_rng_state_all()  # reads generators, makes no context
    cpu_rng = torch.get_rng_state()
    if compact:
        cpu_rng = _state_bytes(cpu_rng)
        if cuda_rngs is not None:
            cuda_rng, cuda_rngs = _state_bytes(cuda_rng), [_state_bytes(r) for r in cuda_rngs]
    record = {
        "format": LOCAL_FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "seed_base": torch.initial_seed(),
        "rng": {
            "torch": cpu_rng,
            "cuda": cuda_rng,
            "cuda_all": cuda_rngs,
            "python": _python_state(),
            "numpy": _numpy_state() if numpy is not None else None,
        },
        "schedulers": [s.state_dict() for s in schedulers],
        "data_state": data_state,
        "extras": extras,
    }
    if compact:
        return compat.save_unzipped(record)
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def load_local(data: bytes, policy: trust.LoadPolicy = trust.DEFAULT_POLICY,
               what: str = "a rank's state file") -> dict[str, Any]:
    """Parse a ``rank-<r>.pt`` file's bytes (``what`` names it in errors).

    ``torch.load(weights_only=True)`` with the policy's allow-list
    (:func:`elastic.checkpoint.trust.load_torch_file`): RNG states, the usual
    LR schedulers' states and plain data positions and extras need nothing
    more. Raises CheckpointError naming a type outside the allow-list, or for a
    record that is not a rank's state.
    """
    record = trust.load_torch_file(data, policy, what, map_location="cpu")
    if not isinstance(record, dict) or record.get("format") != LOCAL_FORMAT:
        raise CheckpointError("unknown rank state format")
    return record


# The RNGs' word arrays (625 and 624 32-bit words) are saved as bytes, one pickle
# opcode each: torch.load(weights_only=True), whose unpickler is written in Python,
# took 2 ms more per restore for them as lists of ints than as bytes.
def _words(values: Any) -> bytes:
    return struct.pack(f"<{len(values)}I", *values)


def _unwords(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)


def _state_bytes(rng_state: torch.Tensor) -> bytes:
    """A torch generator's state (a CPU byte tensor) as bytes (:func:`_state_tensor`)."""
    return rng_state.numpy().tobytes()


def _state_tensor(saved: torch.Tensor | bytes) -> torch.Tensor:
    """What ``torch.set_rng_state`` takes, from a saved state: a tensor (disk
    saves) or its bytes (the memory tier's compact form)."""
    if isinstance(saved, bytes):
        return torch.frombuffer(bytearray(saved), dtype=torch.uint8)
    return saved


def _python_state() -> tuple:
    """``random.getstate()`` with its words as bytes (:func:`_restore_python`)."""
    version, words, gauss_next = random.getstate()
    return (version, _words(words), gauss_next)


def _numpy_state() -> tuple:
    """numpy's global RNG state with its key as bytes, not an array, so that
    reading it back needs none of numpy's types (:mod:`elastic.checkpoint.trust`)."""
    kind, keys, position, has_gauss, cached = numpy.random.get_state(legacy=True)
    return (kind, keys.astype("<u4", copy=False).tobytes(), int(position), int(has_gauss),
            float(cached))


def _restore_python(saved: tuple) -> None:
    version, words, gauss_next = saved
    random.setstate((version, _unwords(words) if isinstance(words, bytes) else words,
                     gauss_next))


def _restore_numpy(saved: tuple) -> None:
    kind, keys, *rest = saved  # keys: bytes, or the array of files written before
    keys = numpy.array(_unwords(keys), dtype=numpy.uint32) if isinstance(keys, bytes) else keys
    numpy.random.set_state((kind, keys, *rest))


def restore_rng(rng: dict[str, Any]) -> None:
    """Put back exactly the saved RNG states (same world size, same rank)."""
    torch.set_rng_state(_state_tensor(rng["torch"]))
    if torch.cuda.is_available():
        every = rng.get("cuda_all")
        if every is not None and len(every) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_state_tensor(saved) for saved in every])
        elif rng.get("cuda") is not None:
            torch.cuda.set_rng_state(_state_tensor(rng["cuda"]))
    _restore_python(rng["python"])
    if numpy is not None and rng.get("numpy") is not None:
        _restore_numpy(rng["numpy"])


def derived_seed(seed_base: int, step: int, rank: int) -> int:
    """A 63-bit seed for ``rank`` when resuming ``step`` at another world size."""
    digest = hashlib.sha256(f"elastic-rng/{seed_base}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_rng(seed: int) -> None:
    """Seed every generator from one seed (torch seeds all CUDA devices lazily)."""
    torch.manual_seed(seed)
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


def restore_schedulers(schedulers: Sequence[Any], states: Sequence[dict]) -> None:
    """Load scheduler ``i`` from ``states[i]``; with fewer saved states than
    schedulers (another pipeline layout), the extra ones take the first state.
    """
    if schedulers and not states:
        raise CheckpointError(f"the checkpoint holds no LR scheduler state for {len(schedulers)} "
                              f"scheduler(s)")
    for index, scheduler in enumerate(schedulers):
        scheduler.load_state_dict(states[index] if index < len(states) else states[0])
