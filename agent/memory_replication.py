"""The memory tier's loop: watch ``own/``, replicate to the buddy, free old slots, report.

:class:`Replicator` runs on a thread of its own beside the agent's loop. Each
pass (:meth:`Replicator.run_once`) it

1. looks at ``own/`` (one directory listing and one ``lstat`` of each
   manifest; a manifest is read again only when its file changed): at once
   when a worker says it completed a snapshot (:meth:`Replicator.heard`, a
   :class:`SnapshotsTaken` from its heartbeat), and otherwise every
   :data:`POLL_RUNNING_S` while this node's workers run (the safety net, for
   a worker that does not say it), else every :data:`POLL_IDLE_S`;
2. frees what :func:`agent.memory_rules.slots_to_free` says, every
   :data:`FULL_SCAN_S` (replicas included);
3. sends what :func:`agent.memory_rules.to_send` says to the buddy (the
   round's placement of this node, :mod:`elastic.rendezvous.placement`) with
   a :class:`~agent.memory_client.ReplicaClient`: per rank the newest
   complete snapshot not yet acknowledged, so a buddy that falls behind gets
   the newest, never the backlog; after a failed send it waits
   :data:`RETRY_S` before the next;
4. keeps what ``elasticctl status`` and the metrics show
   (:meth:`Replicator.status`): bytes held, newest step, the step the buddy
   acknowledged, the lag, the bytes per second of the recent sends.

The clock is injected; waiting goes through ``wait`` (an Event's), so tests
drive :meth:`run_once` by hand.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from typing import Callable

from agent import memory_rules, memory_tier
from agent.memory_client import ReplicaClient
from agent.memory_rules import Acked, SlotSeen
from agent.status_record import MemoryTierRow, human_bytes
from elastic.checkpoint.memory import layout
from elastic.clock import SYSTEM_CLOCK, Clock
from elastic.errors import ElasticError
from elastic.joblog import JobLogger
from elastic.rendezvous.api import Round
from elastic.rendezvous.placement import Peer

log = logging.getLogger(__name__)

# A planned stop waits for the workers' next snapshot at most this many of
# their recent snapshot intervals (steps slow down when a joining node starts
# beside them), and never longer than the cap.
NEXT_SNAPSHOT_INTERVALS = 3.0
NEXT_SNAPSHOT_CAP_S = 2.0
POLL_RUNNING_S = 0.25
POLL_IDLE_S = 0.5
FULL_SCAN_S = 1.0
RETRY_S = 1.0
# The replication rate is measured over this many recent sends.
RATE_WINDOW = 16


@dataclasses.dataclass(frozen=True)
class SnapshotsTaken:
    """A worker's heartbeat: the memory snapshots its process completed so far."""

    local_rank: int
    pid: int
    count: int


class SnapshotPace:
    """Each local worker's snapshot count, as its heartbeats tell it, and the
    time between its recent snapshots; any thread.

    A planned stop (a scale-up, a drain) loses no step when it lands just
    after a snapshot: :meth:`wait_for_next` blocks until every worker
    completed one more snapshot than it had when called. Snapshots fall on the
    same steps on every rank of the job, so every node that waits so stops
    its workers after the same snapshot; a node that hears of the stop late,
    when its workers wait in a collective for workers already stopped, waits
    no longer than a few intervals."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK):
        self._clock = clock
        self._moved = threading.Condition()
        self._counts: dict[int, tuple[int, int]] = {}  # local rank -> (pid, count)
        self._heard_at: dict[int, float] = {}
        self._interval: dict[int, float] = {}  # local rank -> seconds per snapshot

    def heard(self, taken: SnapshotsTaken) -> bool:
        """A heartbeat's count; whether it moved."""
        now = self._clock.monotonic()
        with self._moved:
            before = self._counts.get(taken.local_rank)
            if before == (taken.pid, taken.count):
                return False
            if before is not None and before[0] == taken.pid and taken.count > before[1]:
                self._interval[taken.local_rank] = \
                    (now - self._heard_at[taken.local_rank]) / (taken.count - before[1])
            elif before is not None:
                self._interval.pop(taken.local_rank, None)  # another process: a new pace
            self._counts[taken.local_rank] = (taken.pid, taken.count)
            self._heard_at[taken.local_rank] = now
            self._moved.notify_all()
            return True

    def wait_for_next(self) -> bool:
        """Block until every worker heard from completed another snapshot, at
        most :data:`NEXT_SNAPSHOT_INTERVALS` of the slowest one's interval
        (:data:`NEXT_SNAPSHOT_CAP_S` at most). Returns at once, False, when a
        worker's pace is not known yet (fewer than two snapshots heard);
        else whether they all did."""
        with self._moved:
            before = dict(self._counts)
            paces = [self._interval.get(rank) for rank in before]
            if not before or None in paces:
                return False
            wait_s = min(NEXT_SNAPSHOT_CAP_S, NEXT_SNAPSHOT_INTERVALS * max(paces))
            return self._moved.wait_for(lambda: all(
                self._counts[rank] != seen for rank, seen in before.items()), wait_s)


class _OwnSlots:
    """The complete own slots, their manifests read again only when their file changes."""

    def __init__(self, memory_dir: str):
        self._dir = layout.own_dir(memory_dir)
        self._seen: dict[str, tuple[tuple[int, int, int, int], layout.SlotInfo]] = {}
        # Each name's manifest path, None for a name that is no slot's: a pass
        # is then one listing and one lstat per slot.
        self._manifests: dict[str, str | None] = {}

    def _manifest_of(self, name: str) -> str | None:
        path = self._manifests.get(name, "")
        if path == "":
            path = (os.path.join(self._dir, name, layout.MANIFEST)
                    if layout.parse_slot_name(name) is not None else None)
            if len(self._manifests) > 4096:  # names come and go: keep the cache bounded
                self._manifests.clear()
            self._manifests[name] = path
        return path

    def look(self) -> tuple[list[layout.SlotInfo], bool]:
        """The complete own slots, and whether any changed since the last look."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            names = []
        found: dict[str, tuple[tuple[int, int, int, int], layout.SlotInfo]] = {}
        changed = False
        for name in names:
            manifest = self._manifest_of(name)
            if manifest is None:
                continue
            try:
                st = os.lstat(manifest)
            except OSError:
                changed = changed or name in self._seen
                continue
            stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            cached = self._seen.get(name)
            if cached is not None and cached[0] == stamp:
                found[name] = cached
                continue
            changed = True
            info = layout.read_slot(os.path.dirname(manifest))
            if info is not None:
                found[name] = (info.stamp, info)
        changed = changed or len(found) != len(self._seen)
        self._seen = found
        return [info for _, info in found.values()], changed


class Replicator:
    """The memory tier's thread for one node (see the module docstring)."""

    def __init__(self, memory: memory_tier.MemoryDir, node_id: str, nproc: int,
                 round_of: Callable[[], Round | None], workers_running: Callable[[], bool],
                 client: ReplicaClient, lock: threading.Lock, logger: JobLogger, *,
                 clock: Clock = SYSTEM_CLOCK):
        self._memory = memory
        self._node_id = node_id
        self._nproc = nproc
        self._round_of = round_of
        self._workers_running = workers_running
        self._client = client
        self._lock = lock
        self._log = logger
        self._clock = clock
        self._own = _OwnSlots(memory.path)
        self._acked: dict[int, Acked] = {}
        self._buddy: str | None = None
        self._sends: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=RATE_WINDOW)
        self._retry_at = 0.0  # when to try a failed send again (0: none failed)
        self._scanned_at = -FULL_SCAN_S
        self._all: list[SlotSeen] = []
        self._problem = ""
        self._row = MemoryTierRow()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.pace = SnapshotPace(clock)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="memory-tier", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread: a send in progress is abandoned at its next chunk."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._client.close()

    def heard(self, taken: SnapshotsTaken) -> None:
        """A worker's snapshot count (any thread): a pass at once when it moved."""
        if self.pace.heard(taken):
            self._wake.set()

    def status(self) -> MemoryTierRow:
        """What the memory tier holds and how replication stands (any thread)."""
        return self._row

    def _run(self) -> None:
        failed = ""
        while not self._stop.is_set():
            self._wake.clear()  # a snapshot heard during the pass makes the next one at once
            try:
                self.run_once()
                failed = ""
            except Exception as exc:  # noqa: BLE001 - say so once, keep trying
                if repr(exc) != failed:
                    self._log.exception("memory tier: a pass failed (said once until it "
                                        "passes again)")
                failed = repr(exc)
            self._wake.wait(POLL_RUNNING_S if self._workers_running() else POLL_IDLE_S)

    def run_once(self) -> None:
        """One pass: look, free, send, report."""
        now = self._clock.monotonic()
        current = self._round_of()
        placed = current.placement(self._node_id) if current else None
        buddy = placed.buddy if placed else None
        source = placed.source.node_id if placed and placed.source else None
        buddy_id = buddy.node_id if buddy else None
        changed = buddy_id != self._buddy
        if changed:
            self._buddy, self._acked = buddy_id, {}
            self._log.info("memory tier: replicating to %s.", buddy_id or "nobody (one member)")
        own, own_changed = self._own.look()
        if now - self._scanned_at >= FULL_SCAN_S:
            self._scanned_at = now
            self._free()
            changed = True
        # Nothing new, nothing to retry: the pass ends with the look (a few stat calls).
        retry = self._retry_at and now >= self._retry_at
        if not (changed or own_changed or retry):
            return
        if buddy is not None and current is not None and now >= self._retry_at:
            self._retry_at = 0.0
            self._send(current, buddy, own)
        self._report(own, source)

    def _free(self) -> None:
        self._all = memory_tier.scan(self._memory.path)
        doomed = memory_rules.slots_to_free(self._all, self._nproc)
        if not doomed:
            return
        with self._lock:
            for s in doomed:
                memory_tier.remove_slot(memory_tier.slot_path(self._memory.path, s))
        self._all = [s for s in self._all if s not in doomed]
        self._log.info("memory tier: freed %d slot(s) of older rounds.",
                       len(doomed))

    def _send(self, current: Round, buddy: Peer, own: list[layout.SlotInfo]) -> None:
        by_key = {info.key: info for info in own}
        seen = [_seen(info) for info in own]
        if not buddy.addr:
            return
        for s in memory_rules.to_send(seen, self._acked):
            info = by_key[s.key]
            started = self._clock.monotonic()
            try:
                sent = self._client.send_slot(buddy.addr, current.number, info, self._stop)
            except (ElasticError, OSError) as exc:
                self._retry_at = self._clock.monotonic() + RETRY_S
                self._note(f"cannot replicate to {buddy.node_id}: {exc}")
                return
            if sent is None:
                # The worker started the slot over (its next snapshot goes instead),
                # or the tier is stopping.
                continue
            self._sends.append((sent, self._clock.monotonic() - started))
            self._acked[s.key.rank] = Acked(s.key.round, s.step or 0)
            self._note("")

    def _note(self, problem: str) -> None:
        """Log a replication problem once, and its end."""
        if problem and problem != self._problem:
            self._log.warning("memory tier: %s (retrying every %.0f s).", problem, RETRY_S)
        elif not problem and self._problem:
            self._log.info("memory tier: replicating to %s again.", self._buddy)
        self._problem = problem

    def _report(self, own: list[layout.SlotInfo], source: str | None) -> None:
        seen = [_seen(info) for info in own]
        replicas = [s for s in self._all if s.holder != layout.OWN and s.complete]
        newest = memory_rules.newest_per_rank(seen)
        acked = [self._acked[r].step for r, s in newest.items()
                 if r in self._acked and self._acked[r].round == s.key.round]
        sent = sum(n for n, _ in self._sends)
        spent = sum(t for _, t in self._sends)
        row = MemoryTierRow(
            own_bytes=sum(s.nbytes for s in seen), own_slots=len(seen),
            replica_bytes=sum(s.nbytes for s in replicas), replica_slots=len(replicas),
            replica_source=source or "", buddy=self._buddy or "",
            newest_own_step=max((s.step or 0 for s in newest.values()), default=-1),
            acked_step=min(acked) if newest and len(acked) == len(newest) else -1,
            lag_steps=memory_rules.lag_steps(seen, self._acked),
            need_bytes=memory_rules.memory_need(seen + replicas),
            replication_bytes_per_s=sent / spent if spent > 0 else 0.0,
            free_bytes=memory_tier.free_bytes(self._memory.path))
        if row.need_bytes > self._row.need_bytes and row.need_bytes > row.free_bytes \
                + row.own_bytes + row.replica_bytes:
            self._log.warning("memory tier: needs up to %s (twice the own snapshot and the "
                              "replica), more than is held and free (%s free).",
                              human_bytes(row.need_bytes), human_bytes(row.free_bytes))
        elif row.need_bytes > 0 and self._row.need_bytes == 0:
            self._log.info("memory tier: needs up to %s; %s free.", human_bytes(row.need_bytes),
                           human_bytes(row.free_bytes))
        self._row = row


def _seen(info: layout.SlotInfo) -> SlotSeen:
    return SlotSeen(info.holder, info.key, info.manifest.step, info.manifest.nbytes)
