"""The checkpoint process group and the object collectives run over it.

The object collectives take one round when every payload fits in a frame (the
usual case: a candidate list, a few problems, a failure) and a second only
when one does not; torch's ``all_gather_object`` / ``broadcast_object_list``
always take two (the sizes, then the payloads).
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import pickle
import warnings
from typing import Any

import torch
import torch.distributed as dist

from elastic.checkpoint.failures import describe_failure
from elastic.errors import CheckpointError

FRAME_BYTES = 8192  # one collective's frame: the payload's length, then the payload if it fits
_HEADER = 8  # the payload's length, little-endian


def _frame(data: bytes) -> torch.Tensor:
    """A frame carrying ``data``'s length, and ``data`` itself when it fits."""
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[:_HEADER] = torch.frombuffer(bytearray(len(data).to_bytes(_HEADER, "little")),
                                       dtype=torch.uint8)
    if 0 < len(data) <= FRAME_BYTES - _HEADER:
        frame[_HEADER:_HEADER + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return frame


def _length(frame: torch.Tensor) -> int:
    return int.from_bytes(frame[:_HEADER].numpy().tobytes(), "little")


class CheckpointGroup:
    """The checkpoint process group (``pg``, None for a single rank) and this rank's
    place in it, with object collectives over CPU frames.

    Always a gloo group of the checkpointer's own, also when the caller gives
    one: the collectives run from the background thread while the training
    thread runs its own, and two threads' collectives on one group pair up
    wrongly (on NCCL they also need a device).
    """

    def __init__(self, pg: Any, rank: int, size: int):
        self.pg = pg
        self.rank = rank
        self.size = size

    @classmethod
    def create(cls, process_group: Any, timeout_s: float) -> "CheckpointGroup":
        """A new gloo group over ``process_group``'s ranks (or the world's), each
        collective bounded by ``timeout_s``; a single rank without an initialized
        process group. Every member must call it, in the same order relative to
        other ``new_group`` calls. Raises CheckpointError without numpy (torch's
        object collectives, which DCP uses, need it)."""
        if not (dist.is_available() and dist.is_initialized()):
            # DCP warns at every call that it runs in a single process; that is the intent here.
            warnings.filterwarnings("ignore", category=UserWarning,
                                    message="torch.distributed is disabled, unavailable or uninit")
            return cls(None, 0, 1)
        if importlib.util.find_spec("numpy") is None:
            # torch's object collectives, which DCP uses, call tensor.numpy() on receipt.
            raise CheckpointError("distributed checkpoints need numpy: torch's object "
                                  "collectives, which DCP uses, fail without it")
        timeout = datetime.timedelta(seconds=timeout_s)
        if process_group is None:
            pg = dist.new_group(backend="gloo", timeout=timeout)
        else:
            # Only the group's members call this (each rank may be in another subgroup).
            pg = dist.new_group(ranks=dist.get_process_group_ranks(process_group),
                                backend="gloo", timeout=timeout,
                                use_local_synchronization=True)
        return cls(pg, dist.get_rank(pg), dist.get_world_size(pg))

    @property
    def news_level(self) -> int:
        """Routine news at INFO from rank 0 only: one line per event, not one per rank."""
        return logging.INFO if self.rank == 0 else logging.DEBUG

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order. Raises CheckpointError when the
        group fails (a peer died, or the collective timed out) while ``what``."""
        if self.pg is None:
            return [obj]
        data = pickle.dumps(obj)
        try:
            frames = [torch.empty(FRAME_BYTES, dtype=torch.uint8) for _ in range(self.size)]
            dist.all_gather(frames, _frame(data), group=self.pg)
            lengths = [_length(frame) for frame in frames]
            if max(lengths) <= FRAME_BYTES - _HEADER:
                payloads = [frame[_HEADER:_HEADER + n] for frame, n in zip(frames, lengths)]
            else:  # a second round, every rank taking it: all saw the same lengths
                padded = torch.zeros(max(lengths), dtype=torch.uint8)
                padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                payloads = [torch.empty(max(lengths), dtype=torch.uint8)
                            for _ in range(self.size)]
                dist.all_gather(payloads, padded, group=self.pg)
                payloads = [payload[:n] for payload, n in zip(payloads, lengths)]
        except RuntimeError as exc:
            raise self._lost(what, exc) from exc
        return [pickle.loads(payload.numpy().tobytes()) for payload in payloads]

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank (the others' is ignored). Raises
        CheckpointError when the group fails while ``what``."""
        if self.pg is None:
            return obj
        data = pickle.dumps(obj) if self.rank == 0 else b""
        try:
            frame = _frame(data)
            dist.broadcast(frame, group=self.pg, group_src=0)
            length = _length(frame)
            if length <= FRAME_BYTES - _HEADER:
                payload = frame[_HEADER:_HEADER + length]
            else:
                payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                           else torch.empty(length, dtype=torch.uint8))
                dist.broadcast(payload, group=self.pg, group_src=0)
        except RuntimeError as exc:
            raise self._lost(what, exc) from exc
        return pickle.loads(payload.numpy().tobytes())

    def _lost(self, what: str, exc: BaseException) -> CheckpointError:
        return CheckpointError(f"rank {self.rank}: the checkpoint group failed while {what} "
                               f"(a peer probably died): {describe_failure(exc)}")
