"""A worker's root cause, in torchelastic's error-file format.

Each worker gets ``TORCHELASTIC_ERROR_FILE``: a path of its own where the
exception that ended it is written as JSON, ``{"message": {"message": "Type:
text", "extraInfo": {"py_callstack": traceback, "timestamp": seconds}}}``.
torch's ``@record`` writes it; for scripts without ``@record`` the worker
bootstrap writes it (:func:`write`) when the script raises, so every script
gets one. The agent reads it (:func:`read_root_cause`) when a worker exits
non-zero and names the cause in the failure it reports.

No torch here: the agent imports this module.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass

from elastic.records import printable_text

ENV_VAR = "TORCHELASTIC_ERROR_FILE"
# Enough of the message for a status line; the whole traceback stays in the file.
MAX_CAUSE_CHARS = 300
_MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class RootCause:
    """``message`` is ``Type: text`` (one line, at most MAX_CAUSE_CHARS);
    ``traceback`` the Python call stack ("" when the file has none)."""

    message: str
    traceback: str = ""


def write(path: str, exc: BaseException) -> bool:
    """Write ``exc`` to ``path`` unless a file is already there (torch's
    ``@record`` wrote it, with the same exception). Returns whether it wrote.
    Never raises: a failure to explain a failure must not hide it."""
    record = {"message": {"message": f"{type(exc).__name__}: {exc}",
                          "extraInfo": {"py_callstack": "".join(traceback.format_exception(exc)),
                                        "timestamp": str(int(time.time()))}}}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except (OSError, TypeError, ValueError):
        return False
    return True


def read_root_cause(path: str) -> RootCause | None:
    """The cause recorded at ``path``, or None when there is no readable
    record (no file: the worker died of a signal or exited without an
    exception). A file that is not torch's format gives its first line."""
    try:
        # Never through a link: the file is in the agent's private log directory.
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
            raw = f.read(_MAX_FILE_BYTES)
    except OSError:
        return None
    text = raw.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        data = None
    message, stack = text, ""
    if isinstance(data, dict):
        inner = data.get("message", "")
        if isinstance(inner, dict):
            message = str(inner.get("message", ""))
            extra = inner.get("extraInfo")
            stack = str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
        else:
            message = str(inner)
    line = " ".join(printable_text(message).split())
    if not line:
        return None
    if len(line) > MAX_CAUSE_CHARS:
        line = line[:MAX_CAUSE_CHARS - 3] + "..."
    return RootCause(line, stack)
