"""Resumable, world-size-elastic data state: which samples each rank trains on, and where it is.

:class:`ElasticSampler` hands every rank its share of each training step as a
list of micro-batches of sample indices. Its position is a pair (epoch,
samples consumed in the epoch) that fits in a small JSON-able dict, saved with
the checkpoint (``Checkpointer.save(step, data_state=sampler.state_dict())``)
and restored at the same or another world size without repeating or skipping a
sample (the training loop is in :class:`ElasticSampler`'s docstring).

:class:`SyntheticDataset` is a tiny deterministic dataset (sample ``i`` is
generated from a seed derived from ``i``) for examples and tests.

torch is imported only where it is used, so importing this module is cheap.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator, Mapping, Sequence

from elastic.errors import ConfigError

log = logging.getLogger(__name__)

STATE_VERSION = 1
_STATE_INT_KEYS = ("epoch", "consumed", "seed", "num_samples", "global_batch_size",
                   "micro_batch_size", "world_size")


class ElasticSampler:
    """Deterministic, resumable sample indices for data-parallel training at any world size.

    **Order.** Epoch ``e`` visits ``range(num_samples)`` in the order of
    ``torch.randperm(num_samples)`` drawn from a CPU ``torch.Generator``
    seeded with ``seed + e`` (or in index order with ``shuffle=False``): the
    same on every rank, every run and every world size.

    **Steps.** Each training step consumes the next ``global_batch_size``
    samples of the epoch's order (the *global batch*). Rank ``r`` of ``W``
    takes the ``r``-th contiguous share of ``global_batch_size / W`` samples
    and processes it as :attr:`accumulation_steps` micro-batches of
    :attr:`micro_batch_size` (gradient accumulation). *drop_last*: the last
    ``num_samples % global_batch_size`` samples of the order, too few for a
    full global batch, are skipped in that epoch, so every step consumes
    exactly one global batch (a different tail is dropped each epoch when
    shuffling).

    **World size.** With ``keep_global_batch=True`` (the default) the global
    batch is constant: ``micro_batch_size`` (by default ``global_batch_size //
    world_size`` at construction, i.e. no accumulation at the starting world
    size) stays when the world size changes, and the accumulation steps
    become ``global_batch_size / (world_size * micro_batch_size)``; a state
    saved at another world size resumes on the very same global batches. Pass
    ``micro_batch_size`` explicitly to bound per-rank memory across restarts,
    choosing one that divides the per-rank share at every world size you may
    run at (e.g. global 48, micro 2 works at 1, 2, 3, 4, 6, 8, 12 ranks).
    With ``keep_global_batch=False`` each rank always processes one
    micro-batch per step (accumulation 1) and the global batch is
    ``world_size * micro_batch_size``: it grows and shrinks with the world.
    The per-rank batch is then the invariant: a state saved with another
    micro batch size is refused when ``micro_batch_size`` was given, and
    adopted when it was left to its default.

    **Position.** :attr:`consumed` counts the samples of the current epoch
    handed out so far. A step counts as consumed as soon as its batches are
    yielded, so :meth:`state_dict` taken after the step's optimizer update
    (before asking for the next batch) resumes exactly at the next step; a
    state taken before the yielded step was trained would skip it. Iterating
    yields the remaining steps of the current epoch, then moves to the next
    epoch (:attr:`epoch` + 1, :attr:`consumed` 0) and stops; a ``for`` loop
    over the sampler is one (rest of an) epoch. Breaking out of the loop
    keeps the position; the next ``for`` loop continues from it. Use one
    iterator at a time.

    A training loop with gradient accumulation and checkpoints (``ckpt`` an
    :class:`elastic.checkpoint.Checkpointer`, ``ds`` a :class:`SyntheticDataset`)::

        sampler = ElasticSampler(len(ds), global_batch_size=64, micro_batch_size=8)
        step = ckpt.restore()                      # 0 on a fresh start
        if ckpt.data_state is not None:
            sampler.load_state_dict(ckpt.data_state)  # saved at any world size
        while step < total_steps:
            for micro_batches in sampler:          # the rest of the epoch, then stops
                for indices in micro_batches:      # under DDP: no_sync() for all but the last
                    x, y = ds.batch(indices)
                    (loss_fn(model(x), y) / sampler.accumulation_steps).backward()
                opt.step(); opt.zero_grad()
                ckpt.save(step, data_state=sampler.state_dict())  # resumes at step + 1
                step += 1
                if step == total_steps:
                    break

    ``rank`` and ``world_size`` default to ``torch.distributed``'s when it is
    initialized, else to the ``RANK`` and ``WORLD_SIZE`` environment
    variables, else to 0 and 1; explicit arguments win.

    Raises :class:`ConfigError` for sizes that do not fit together (the
    message names them and what to choose instead).
    """

    def __init__(self, num_samples: int, global_batch_size: int, *,
                 micro_batch_size: int | None = None, seed: int = 0, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 keep_global_batch: bool = True):
        self._num_samples = _positive_int("num_samples", num_samples)
        global_batch_size = _positive_int("global_batch_size", global_batch_size)
        if micro_batch_size is not None:
            micro_batch_size = _positive_int("micro_batch_size", micro_batch_size)
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self._seed = seed
        self._shuffle = bool(shuffle)
        self._keep_global_batch = bool(keep_global_batch)
        self._micro_explicit = micro_batch_size is not None
        rank, world_size = _resolve_world(rank, world_size)

        if micro_batch_size is None:
            if global_batch_size % world_size:
                raise ConfigError(_indivisible(global_batch_size, world_size, None))
            micro_batch_size = global_batch_size // world_size
        elif not self._keep_global_batch and global_batch_size != world_size * micro_batch_size:
            raise ConfigError(
                f"with keep_global_batch=False every rank processes one micro-batch per step, "
                f"so the global batch is world_size x micro_batch_size = {world_size} x "
                f"{micro_batch_size} = {world_size * micro_batch_size}, not {global_batch_size}: "
                f"pass global_batch_size={world_size * micro_batch_size} or leave "
                f"micro_batch_size out")
        # With keep_global_batch=False the global batch follows the world; store the constant one.
        self._global = global_batch_size if self._keep_global_batch else None
        self._micro = micro_batch_size
        self._rank, self._world, self._accumulation = self._fit(rank, world_size, self._micro)
        self._epoch = 0
        self._consumed = 0
        self._perm_epoch: int | None = None
        self._perm: Any = None  # a 1-D int64 tensor, the cached order of _perm_epoch

    # --- read-only view -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The current epoch, from 0; advances when an iteration exhausts the epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch handed out so far (all ranks together)."""
        return self._consumed

    @property
    def num_samples(self) -> int:
        return self._num_samples

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks: constant, or ``world_size * micro_batch_size``
        with ``keep_global_batch=False``."""
        return self._global_now()

    @property
    def micro_batch_size(self) -> int:
        return self._micro

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per step (1 with ``keep_global_batch=False``)."""
        return self._accumulation

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches in an epoch (the incomplete tail is dropped)."""
        return self._num_samples // self._global_now()

    @property
    def steps_remaining_in_epoch(self) -> int:
        """Steps left in the current epoch from the current position at the current world."""
        return (self._num_samples - self._consumed) // self._global_now()

    # --- changing the world and the position --------------------------------------------------

    def set_world(self, rank: int, world_size: int) -> None:
        """Continue at ``world_size`` ranks as ``rank``, from the current position.

        The micro batch size stays; the accumulation steps (or, with
        ``keep_global_batch=False``, the global batch) change. Raises
        :class:`ConfigError`, leaving the sampler unchanged, when the sizes do
        not divide.
        """
        rank = _nonneg_int("rank", rank)
        world_size = _positive_int("world_size", world_size)
        self._rank, self._world, self._accumulation = self._fit(rank, world_size, self._micro)

    def state_dict(self) -> dict[str, Any]:
        """The position and the sizes it refers to, as plain JSON-able values."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_samples": self._num_samples,
            "global_batch_size": self._global_now(),
            "micro_batch_size": self._micro,
            "world_size": self._world,
            "keep_global_batch": self._keep_global_batch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position, at this sampler's current rank and world size.

        The saved world size may differ: the rest of the epoch is split over
        the current ranks, so no sample is repeated or skipped. Raises
        :class:`ConfigError`, leaving the sampler unchanged, when the state is
        malformed or was saved for another dataset size, seed, shuffle
        setting or (with ``keep_global_batch=True``) global batch size, or
        (with ``keep_global_batch=False``) an explicitly different micro batch size.
        """
        saved = _checked_state(state)
        mismatches = [
            f"{name} {saved[name]} (saved) != {mine} (this sampler)"
            for name, mine in (("num_samples", self._num_samples), ("seed", self._seed),
                               ("shuffle", self._shuffle))
            if name in saved and saved[name] != mine]
        micro = self._micro
        if self._keep_global_batch:
            if saved["global_batch_size"] != self._global:
                mismatches.append(f"global_batch_size {saved['global_batch_size']} (saved) != "
                                  f"{self._global} (this sampler; keep_global_batch=True keeps "
                                  f"it constant)")
            elif saved["consumed"] % self._global:
                mismatches.append(f"consumed {saved['consumed']} is not a whole number of "
                                  f"global batches of {self._global}")
        elif saved["micro_batch_size"] != micro:
            if self._micro_explicit:
                mismatches.append(
                    f"micro_batch_size {saved['micro_batch_size']} (saved) != {micro} (this "
                    f"sampler; keep_global_batch=False keeps the per-rank batch constant: pass "
                    f"micro_batch_size={saved['micro_batch_size']} and global_batch_size="
                    f"world_size*{saved['micro_batch_size']})")
            micro = saved["micro_batch_size"]
        if saved["consumed"] > self._num_samples:
            mismatches.append(f"consumed {saved['consumed']} > num_samples {self._num_samples}")
        if mismatches:
            raise ConfigError("cannot resume the data position from this state: "
                              + "; ".join(mismatches))
        rank, world, accumulation = self._fit(self._rank, self._world, micro)
        if saved["world_size"] != world or micro != self._micro:
            log.info("Rank %d resumes the data position of epoch %d at %d consumed samples, "
                     "saved at world size %d with micro-batches of %d, at world size %d with "
                     "micro-batches of %d and %d accumulation steps.", rank, saved["epoch"],
                     saved["consumed"], saved["world_size"], saved["micro_batch_size"], world,
                     micro, accumulation)
        self._micro, self._accumulation = micro, accumulation
        self._epoch, self._consumed = saved["epoch"], saved["consumed"]

    # --- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[list[int]]]:
        """Yield this rank's micro-batches for each remaining step of the current epoch.

        Each step is counted as consumed when it is yielded. A position left
        at the very end of an epoch (e.g. restored from a state saved after
        its last step) starts the next epoch first.
        """
        self._roll_over_if_exhausted()
        while self.steps_remaining_in_epoch > 0:
            batches = self._local_batches(self._consumed)
            self._consumed += self._global_now()
            yield batches
        self._roll_over_if_exhausted()

    def __repr__(self) -> str:
        return (f"ElasticSampler(num_samples={self._num_samples}, global_batch_size="
                f"{self._global_now()}, micro_batch_size={self._micro}, accumulation_steps="
                f"{self._accumulation}, rank={self._rank}, world_size={self._world}, "
                f"epoch={self._epoch}, consumed={self._consumed})")

    # --- internals ----------------------------------------------------------------------------

    def _global_now(self) -> int:
        return self._global if self._global is not None else self._world * self._micro

    def _fit(self, rank: int, world: int, micro: int) -> tuple[int, int, int]:
        """(rank, world, accumulation steps) for these sizes, or ConfigError."""
        if rank >= world:
            raise ConfigError(f"rank {rank} is out of range for world size {world}")
        if self._global is None:  # keep_global_batch=False: one micro-batch per rank
            global_batch = world * micro
            accumulation = 1
        else:
            global_batch = self._global
            if global_batch % (world * micro):
                raise ConfigError(_indivisible(global_batch, world, micro))
            accumulation = global_batch // (world * micro)
        if global_batch > self._num_samples:
            raise ConfigError(
                f"the global batch of {global_batch} samples is larger than the dataset of "
                f"{self._num_samples}: an epoch would have no full step (the incomplete last "
                f"global batch of every epoch is dropped); choose a smaller batch")
        return rank, world, accumulation

    def _roll_over_if_exhausted(self) -> None:
        if self.steps_remaining_in_epoch == 0:
            self._epoch += 1
            self._consumed = 0

    def _order(self) -> Any:
        if self._perm_epoch != self._epoch:
            import torch

            if self._shuffle:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(self._seed + self._epoch)
                self._perm = torch.randperm(self._num_samples, generator=generator)
            else:
                self._perm = torch.arange(self._num_samples)
            self._perm_epoch = self._epoch
        return self._perm

    def _local_batches(self, start: int) -> list[list[int]]:
        share = self._global_now() // self._world
        first = start + self._rank * share
        local = self._order()[first:first + share].tolist()
        micro = self._micro
        return [local[i:i + micro] for i in range(0, share, micro)]


class SyntheticDataset:
    """A deterministic regression dataset: sample ``i`` is always the same pair of tensors.

    ``x_i`` (shape ``(input_dim,)``) is drawn from a CPU generator seeded
    with ``(i + seed * 0x9E3779B9) mod 2**32`` (just ``i`` for seed 0; torch's
    CPU generator keeps 32 bits of a seed); ``y_i = x_i @ w + 0.1 * noise_i``
    (shape ``(output_dim,)``) with the noise drawn from the same per-sample
    generator and ``w`` from the stream of index -1, so a model can learn it
    and any sample can be regenerated from its index alone.
    """

    def __init__(self, num_samples: int, input_dim: int = 8, output_dim: int = 1, *,
                 seed: int = 0):
        self.num_samples = _positive_int("num_samples", num_samples)
        self.input_dim = _positive_int("input_dim", input_dim)
        self.output_dim = _positive_int("output_dim", output_dim)
        self.seed = _nonneg_int("seed", seed)
        self._weight: Any = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        import torch

        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples")
        if self._weight is None:
            generator = torch.Generator(device="cpu").manual_seed(self._stream(-1))
            self._weight = torch.randn(self.input_dim, self.output_dim, generator=generator)
        generator = torch.Generator(device="cpu").manual_seed(self._stream(int(index)))
        x = torch.randn(self.input_dim, generator=generator)
        y = x @ self._weight + 0.1 * torch.randn(self.output_dim, generator=generator)
        return x, y

    def _stream(self, index: int) -> int:
        return (index + self.seed * 0x9E3779B9) % 2**32

    def batch(self, indices: Sequence[int]) -> tuple[Any, Any]:
        """The samples at ``indices`` stacked: ``x`` of shape ``(len, input_dim)``, ``y``
        of shape ``(len, output_dim)``. Raises ValueError for no indices."""
        import torch

        if len(indices) == 0:
            raise ValueError("batch() needs at least one index")
        xs, ys = zip(*(self[i] for i in indices))
        return torch.stack(xs), torch.stack(ys)


# --- helpers ----------------------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _nonneg_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Explicit arguments, else torch.distributed's when initialized, else RANK/WORLD_SIZE,
    else 0/1."""
    if rank is None or world_size is None:
        default_rank, default_world = _default_world()
        rank = default_rank if rank is None else rank
        world_size = default_world if world_size is None else world_size
    return _nonneg_int("rank", rank), _positive_int("world_size", world_size)


def _default_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    values = []
    for name, default in (("RANK", 0), ("WORLD_SIZE", 1)):
        raw = os.environ.get(name, "")
        try:
            values.append(int(raw) if raw.strip() else default)
        except ValueError:
            raise ConfigError(f"environment variable {name} must be an integer, "
                              f"got {raw!r}") from None
    return values[0], values[1]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _indivisible(global_batch: int, world: int, micro: int | None) -> str:
    """An actionable message for a global batch that does not split evenly."""
    if micro is None:
        lower = global_batch // world * world
        options = " or ".join(str(g) for g in (lower, lower + world) if g > 0)
        return (f"global batch {global_batch} cannot be split over {world} ranks: choose a "
                f"global batch that is a multiple of {world} ({options}) or a world size that "
                f"divides {global_batch} ({_divisors(global_batch)})")
    unit = world * micro
    lower = global_batch // unit * unit
    options = " or ".join(str(g) for g in (lower, lower + unit) if g > 0)
    message = (f"global batch {global_batch} cannot be split over {world} ranks in "
               f"micro-batches of {micro}: it must be a multiple of {world} x {micro} = {unit}; "
               f"choose a global batch of {options}")
    if global_batch % world == 0:
        share = global_batch // world
        message += (f", or a micro batch size that divides the per-rank share of {share} "
                    f"({_divisors(share)})")
    else:
        message += f", or a world size that divides {global_batch} ({_divisors(global_batch)})"
    return message


def _checked_state(state: Any) -> dict[str, Any]:
    """The saved fields, type-checked; ConfigError naming what is wrong."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"a data state must be a dict, got {type(state).__name__}")
    version = state.get("version", STATE_VERSION)
    if version != STATE_VERSION:
        raise ConfigError(f"data state version {version!r} is not supported (this code reads "
                          f"version {STATE_VERSION})")
    missing = [key for key in _STATE_INT_KEYS if key not in state]
    if missing:
        raise ConfigError(f"the data state lacks {', '.join(missing)}")
    saved: dict[str, Any] = {}
    for key in _STATE_INT_KEYS:
        value = state[key]
        minimum = 0 if key in ("epoch", "consumed", "seed") else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"the data state's {key} must be an integer >= {minimum}, "
                              f"got {value!r}")
        saved[key] = value
    if "shuffle" in state:
        if not isinstance(state["shuffle"], bool):
            raise ConfigError(f"the data state's shuffle must be a bool, got {state['shuffle']!r}")
        saved["shuffle"] = state["shuffle"]
    return saved
