"""Python stacks as ``faulthandler`` writes them, read back (pure; input, not trusted).

A dump (:mod:`elastic.worker.stacks`) is a list of thread blocks::

    Thread 0x00007f... (most recent call first):
      File "/usr/lib/python3.11/threading.py", line 320 in wait
      ...

    Current thread 0x00007f... (most recent call first):
      File "train.py", line 88 in next_batch
      File "train.py", line 120 in <module>

CPython lists the newest thread first, so the last block is the main
thread: the one that runs the script. :func:`summarize` says where the main
thread was: its innermost frame of the user's own code (not the standard
library, not an installed package, not this project's worker runtime) and,
when it is inside a ``torch.distributed`` collective, which one (the
innermost frame in ``distributed_c10d.py`` names it: ``all_reduce``,
``barrier``...).

Limits: at most :data:`MAX_DUMP_BYTES` are read, lines longer than
:data:`MAX_LINE_CHARS` are ignored, and names are cut to
:data:`MAX_NAME_CHARS` with control characters dropped.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from elastic.records import cap_text

MAX_DUMP_BYTES = 256 * 1024
MAX_FLIGHT_RECORD_BYTES = 1024 * 1024
MAX_LINE_CHARS = 4096
MAX_NAME_CHARS = 200
# A frame in one of these directories is the libraries', not the user's.
LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3")
# The file whose innermost frame names the collective in flight.
COLLECTIVES_FILE = "torch/distributed/distributed_c10d.py"

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*:$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int  # 0: unknown
    function: str

    def place(self) -> str:
        """``train.py:88 in next_batch``: the file's base name, line and function."""
        return f"{os.path.basename(self.file)}:{self.line} in {self.function}"


@dataclass(frozen=True)
class StackSummary:
    """Where a process's main thread was: ``place`` (its innermost user frame,
    else its innermost frame; "" when the dump had no frame) and the
    ``collective`` it was in ("" when none)."""

    place: str
    collective: str = ""


def parse_threads(text: str) -> list[list[Frame]]:
    """The thread blocks of a dump, each innermost frame first, in the dump's
    order; lines that are neither a thread header nor a frame are skipped."""
    threads: list[list[Frame]] = []
    for line in text[:MAX_DUMP_BYTES].splitlines():
        if len(line) > MAX_LINE_CHARS:
            continue
        if _THREAD.match(line):
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            file, number, function = m.groups()
            threads[-1].append(Frame(_clean(file), int(number) if number.isdigit() else 0,
                                     _clean(function)))
    return threads


def is_library(frame: Frame, library_roots: tuple[str, ...] = ()) -> bool:
    """Whether ``frame`` is in the standard library, an installed package, a
    frozen module or under one of ``library_roots`` (directories, with a
    trailing separator)."""
    return (frame.file.startswith("<") or any(m in frame.file for m in LIBRARY_MARKERS)
            or frame.file.startswith(library_roots))


def summarize(text: str, library_roots: tuple[str, ...] = ()) -> StackSummary:
    """Where the main thread (the dump's last block) was; see the module."""
    threads = [t for t in parse_threads(text) if t]
    if not threads:
        return StackSummary("")
    main = threads[-1]
    collective = next((f.function for f in main if f.file.endswith(COLLECTIVES_FILE)), "")
    user = next((f for f in main if not is_library(f, library_roots)), main[0])
    return StackSummary(user.place(), collective)


@dataclass(frozen=True)
class InFlight:
    """The oldest collective a flight record shows not completed: its name
    (``all_reduce``), and when the rank enqueued it (wall clock, ns; 0 if unknown)."""

    collective: str
    entered_ns: int = 0


def in_flight(record: bytes) -> InFlight | None:
    """The oldest collective in flight in torch's flight-record JSON
    (:mod:`elastic._compat.torch_flight_recorder`); None when none is, or the
    record is not what torch writes (over :data:`MAX_FLIGHT_RECORD_BYTES`,
    not JSON, fields of other types)."""
    if len(record) > MAX_FLIGHT_RECORD_BYTES:
        return None
    try:
        entries = json.loads(record).get("entries", [])
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    active = [e for e in entries if isinstance(e, dict) and e.get("retired") is False
              and e.get("state") != "completed"
              and isinstance(e.get("collective_seq_id"), int)
              and isinstance(e.get("profiling_name"), str)]
    if not active:
        return None
    oldest = min(active, key=lambda e: e["collective_seq_id"])
    created = oldest.get("time_created_ns")
    return InFlight(_clean(oldest["profiling_name"].rpartition(":")[2]),
                    created if isinstance(created, int) and created > 0 else 0)


def _clean(text: str) -> str:
    return cap_text(text, MAX_NAME_CHARS)
