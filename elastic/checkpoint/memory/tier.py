"""The memory tier's writing side in a worker: a snapshot at the steps the cadence picks.

:class:`SnapshotTier` is called at every ``elastic.step(n)`` (a listener the
Checkpointer registers on the worker runtime). When the cadence says so it
takes the state (the same state dict as a disk save, collected once and
reused while the live tensors stay the same: :mod:`.live`), checks
at the first snapshot that the node has room (:mod:`.capacity`, a
ConfigError before anything is written), and writes it (:mod:`.writer`).
No collective per step: the ranks agree once, on k, after calibration.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Sequence

from elastic.checkpoint import state
from elastic.checkpoint.memory import capacity
from elastic.checkpoint.memory.cadence import Cadence
from elastic.checkpoint.memory.live import LiveState
from elastic.checkpoint.memory.writer import Identity, SnapshotWriter

log = logging.getLogger(__name__)

# What the memory directory's pages mean for a restore (capacity.huge_pages).
_PAGES = {True: " (a tmpfs with 2 MiB pages)",
          False: " (a tmpfs with 4 KiB pages: a restore reads it at about half the speed of "
                 "one mounted with huge=within_size)",
          None: ""}


class SnapshotTier:
    """Snapshots ``chunks``, ``schedulers`` and ``data`` (its ``state_dict()``)
    into ``memory_dir`` as ``identity``'s rank, at the steps ``cadence`` picks.
    ``local_ranks``: this node's ranks (for the capacity check); ``extras``
    returns what each snapshot carries as extras; ``news_level``: the log level
    of routine news (INFO on rank 0); ``on_written`` is called after each
    snapshot completed (the worker runtime tells the agent, which replicates it)."""

    def __init__(self, memory_dir: str, identity: Identity, *, chunks: Sequence[state.Chunk],
                 schedulers: Sequence[Any], data: Any, cadence: Cadence, local_ranks: int,
                 extras: Callable[[], Any], news_level: int,
                 on_written: Callable[[], None] = lambda: None):
        self.memory_dir = memory_dir
        self._writer = SnapshotWriter(memory_dir, identity)
        self._live = LiveState(chunks)
        self._schedulers = schedulers
        self._data = data
        self.cadence = cadence
        self._local_ranks = local_ranks
        self._extras = extras
        self._news = news_level
        self._on_written = on_written
        self._checked = False
        self.costs: list[float] = []  # seconds per snapshot taken
        self.failures = 0  # snapshots whose write failed

    @property
    def identity(self) -> Identity:
        return self._writer.identity

    def on_step(self, step: int) -> None:
        """Step ``step`` ended: snapshot it if it is due. Raises ConfigError when
        the node cannot hold the tier (first snapshot). A write that fails later
        (the memory directory full or gone) is a warning and training goes on:
        the previous snapshot stays complete in the other slot, the disk tier
        is untouched, and the next due step tries again."""
        now = time.monotonic()
        calibrating = self.cadence.calibrating
        cost = 0.0
        if self.cadence.due(step):
            try:
                cost = self.snapshot(step)
            except OSError as exc:
                self._write_failed(step, exc)
        self.cadence.record(now, cost)
        if calibrating and not self.cadence.calibrating:
            log.log(self._news, "Rank %d: memory snapshots every %d step(s) from step %d "
                    "(a snapshot costs %.2f ms).", self.identity.rank, self.cadence.every,
                    step, 1000 * (sorted(self.costs)[len(self.costs) // 2]))

    def snapshot(self, step: int) -> float:
        """Write the state as of ``step`` now; returns the seconds it took."""
        started = time.monotonic()
        plan = self._live.plan()
        ident = self.identity
        local = state.capture_local(step=step, rank=ident.rank, world_size=ident.world_size,
                                    schedulers=self._schedulers,
                                    data_state=self._data.state_dict(), extras=self._extras(),
                                    compact=True)
        if not self._checked:
            self._check_room(plan.data_bytes + len(local))
        self._writer.write(step, plan, local)
        self._on_written()
        cost = time.monotonic() - started
        self.costs.append(cost)
        return cost

    def _write_failed(self, step: int, exc: OSError) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning("Rank %d could not write its memory snapshot of step %d in round %d "
                        "(%s; %d failed so far); training goes on, and a restore uses the last "
                        "complete snapshot or the disk tier.", self.identity.rank, step,
                        self.identity.round, exc, self.failures)

    def _check_room(self, state_bytes: int) -> None:
        need = capacity.node_need(state_bytes, self._local_ranks)
        os.makedirs(self.memory_dir, mode=0o700, exist_ok=True)
        capacity.check(need, self._writer.held_bytes(),
                       capacity.filesystem_free(self.memory_dir), capacity.cgroup_free(),
                       self.memory_dir)
        self._checked = True
        log.log(self._news, "Rank %d: the memory tier takes %.1f MiB per rank and %.1f MiB on "
                "this node (own and buddy's, double-buffered) in %s%s.", self.identity.rank,
                state_bytes / 2**20, need / 2**20, self.memory_dir,
                _PAGES[capacity.huge_pages(self.memory_dir)])

    def close(self) -> None:
        self._writer.close()
