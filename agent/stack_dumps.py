"""This node's workers' stacks, read at a hang verdict (the I/O beside the pure parts).

:class:`StackCollector` asks each worker of the round to dump its Python
stacks (:mod:`elastic.worker.stacks`: a signal, answered from a C handler),
waits at most ``timeout_s`` for all of them together, and summarises each
dump (:func:`agent.stack_text.summarize`) with the step and progress age the
agent knows of it, as :class:`agent.hang_attribution.RankStack`. The dumps stay
where the workers wrote them, beside their rank logs
(:func:`agent.worker_output.stacks_file`).

A worker is signalled only when its stacks file starts with the header that
names its pid: the worker installed the handler, and the file is its own
(not a warm worker's of another round). Without the handler the signal's
default action would end it.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass

import elastic
from agent.hang_attribution import RankStack
from agent.health import WorkerHealth
from agent.stack_text import MAX_DUMP_BYTES, MAX_FLIGHT_RECORD_BYTES, in_flight, summarize
from agent.worker_output import stacks_file
from elastic.worker.stacks import DUMP_SIGNAL, HEADER, flight_record_path, flight_request_path

# A dump is complete once its file stopped growing for this long.
SETTLE_S = 0.05
# A dump this recent answers again: the verdict here and a peer's request for
# the same hang come within moments, and a worker dumps once for both.
REUSE_S = 3.0
_POLL_S = 0.01
# This project's own frames (the worker runtime, the bootstrap) are not the user's.
OWN_ROOTS = (os.path.dirname(os.path.abspath(elastic.__file__)) + os.sep,)


@dataclass(frozen=True)
class LocalWorker:
    """A worker of this node to ask: its global rank and pid."""

    rank: int
    pid: int


@dataclass
class _Pending:
    worker: LocalWorker
    path: str
    offset: int
    size: int
    changed_at: float


def _open_own(path: str):
    """``path`` opened for reading, never through a link and only a regular
    file; None when it cannot be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        return None
    return f


def _size_if_ready(path: str, pid: int) -> int | None:
    """The size of ``path`` when it is the stacks file of ``pid`` (its header
    names it), else None."""
    f = _open_own(path)
    if f is None:
        return None
    with f:
        first = f.readline(128).decode("ascii", "replace").strip()
        if first != f"{HEADER}{pid}":
            return None
        return os.fstat(f.fileno()).st_size


def _read_from(path: str, offset: int) -> str:
    f = _open_own(path)
    if f is None:
        return ""
    with f:
        f.seek(offset)
        return f.read(MAX_DUMP_BYTES).decode("utf-8", "replace")


def _version(path: str) -> tuple[int, int]:
    """Which file is at ``path`` now ((0, 0): none): the worker replaces it whole."""
    try:
        st = os.stat(path)
    except OSError:
        return 0, 0
    return st.st_ino, st.st_mtime_ns


def _ask_flight_record(stacks_path: str) -> tuple[str, tuple[int, int]] | None:
    """Ask the worker for its flight record (``serve_flight_recorder`` of
    :mod:`elastic.worker.stacks`): (where it will be, the file there now);
    None when nobody serves it."""
    out = flight_record_path(stacks_path)
    before = _version(out)
    try:
        fd = os.open(flight_request_path(stacks_path),
                     os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # ENXIO: no reader; ENOENT: no recorder
        return None
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        os.write(fd, b"?")
    except OSError:
        return None
    finally:
        os.close(fd)
    return out, before


def _wait_flight_record(asked: tuple[str, tuple[int, int]] | None,
                        deadline: float) -> bytes | None:
    """The flight record written after it was asked for, by ``deadline``; else None."""
    if asked is None:
        return None
    out, before = asked
    while True:
        if _version(out) not in (before, (0, 0)):
            f = _open_own(out)
            if f is not None:
                with f:
                    return f.read(MAX_FLIGHT_RECORD_BYTES + 1)
        if time.monotonic() >= deadline:
            return None
        time.sleep(_POLL_S)


class StackCollector:
    """Reads the stacks of this node's workers (``node_id``, rank logs under ``log_dir``)."""

    def __init__(self, log_dir: str, node_id: str, library_roots: tuple[str, ...] = OWN_ROOTS):
        self._log_dir = log_dir
        self._node_id = node_id
        self._library_roots = library_roots
        self._lock = threading.Lock()  # one collection at a time (the loop, gRPC threads)
        # (round, pid): (when, (dump, flight record))
        self._recent: dict[tuple[int, int], tuple[float, tuple[str, bytes | None]]] = {}

    def path(self, round_number: int, rank: int) -> str:
        """Where ``rank`` of ``round_number`` dumps its stacks."""
        return stacks_file(self._log_dir, round_number, rank)

    def collect(self, round_number: int, workers: list[LocalWorker],
                health: list[WorkerHealth], now: float, timeout_s: float) -> list[RankStack]:
        """One :class:`RankStack` per worker of ``workers``; ``health`` (the
        agent's records, any order) gives each its step and progress age as
        of ``now`` (monotonic). Waits at most ``timeout_s``; never raises."""
        with self._lock:
            texts = self._dumps(round_number, workers, timeout_s)
        by_rank = {h.rank: h for h in health}
        stacks = []
        for w in workers:
            h = by_rank.get(w.rank)
            step = h.step if h is not None else -1
            age = now - h.last_progress_at if h is not None and h.last_progress_at else -1.0
            text, record = texts.get(w.rank, ("", None))
            summary = summarize(text, self._library_roots) if text else None
            flying = in_flight(record) if record else None
            collective = (summary.collective if summary else "") or (
                flying.collective if flying else "")
            stacks.append(RankStack(
                rank=w.rank, node_id=self._node_id, dumped=bool(summary and summary.place),
                place=summary.place if summary else "", collective=collective, step=step,
                progress_age_s=round(age, 3), entered_ns=flying.entered_ns if flying else 0))
        return stacks

    def _dumps(self, round_number: int, workers: list[LocalWorker],
               timeout_s: float) -> dict[int, tuple[str, bytes | None]]:
        """Each worker's dump and flight record by rank: recent ones again,
        else new ones."""
        started = time.monotonic()
        self._recent = {k: v for k, v in self._recent.items() if started - v[0] < REUSE_S}
        texts = {w.rank: self._recent[(round_number, w.pid)][1] for w in workers
                 if (round_number, w.pid) in self._recent}
        pending = {w.rank: p for w in workers
                   if w.rank not in texts and (p := self._ask(round_number, w)) is not None}
        records = {rank: _ask_flight_record(p.path) for rank, p in pending.items()}
        deadline = time.monotonic() + timeout_s
        dumps = self._wait(pending, timeout_s)
        fresh = {rank: (text, _wait_flight_record(records.get(rank), deadline))
                 for rank, text in dumps.items()}
        for w in workers:
            if w.rank in fresh:
                self._recent[(round_number, w.pid)] = (started, fresh[w.rank])
        return {**texts, **fresh}

    def _ask(self, round_number: int, w: LocalWorker) -> _Pending | None:
        path = self.path(round_number, w.rank)
        size = _size_if_ready(path, w.pid)
        if size is None or DUMP_SIGNAL is None:
            return None
        try:
            os.kill(w.pid, DUMP_SIGNAL)
        except OSError:
            return None
        return _Pending(w, path, size, size, time.monotonic())

    def _wait(self, pending: dict[int, _Pending], timeout_s: float) -> dict[int, str]:
        """The dumps that came within ``timeout_s``, by rank."""
        deadline = time.monotonic() + timeout_s
        done: dict[int, str] = {}
        while pending and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            now = time.monotonic()
            for rank, p in list(pending.items()):
                try:
                    size = os.stat(p.path).st_size
                except OSError:
                    del pending[rank]
                    continue
                if size != p.size:
                    p.size, p.changed_at = size, now
                elif size > p.offset and now - p.changed_at >= SETTLE_S:
                    done[rank] = _read_from(p.path, p.offset)
                    del pending[rank]
        return done
