"""Worker output: the pumps that copy it, the rank log files, the console filter.

Every line a worker prints goes to ``sys.stdout`` as ``[rank R]: line``
(``[warm]: `` before it has a round, ``[template]: `` from a template) when
the :class:`agent.console.ConsoleFilter` shows it, and to
``log_dir/round-<N>/rank-<R>.log`` as ``stdout: line`` or ``stderr: line``.
A warm worker's last lines are kept until it gets a round, then written to
its rank's log first.
"""

from __future__ import annotations

import os
import sys
import threading

from agent import localfiles
from agent.console import ConsoleFilter
from agent.spawn import WorkerProcess
from elastic.joblog import JobLogger


def rank_files(log_dir: str, round_number: int, rank: int) -> tuple[str, str]:
    """The log and the error file (``TORCHELASTIC_ERROR_FILE``) of ``rank`` in a round."""
    round_dir = os.path.join(log_dir, f"round-{round_number}")
    return (os.path.join(round_dir, f"rank-{rank}.log"),
            os.path.join(round_dir, f"rank-{rank}.error.json"))


def stacks_file(log_dir: str, round_number: int, rank: int) -> str:
    """Where ``rank`` of a round dumps its Python stacks when the agent asks
    (:mod:`elastic.worker.stacks`), beside its log."""
    return os.path.join(log_dir, f"round-{round_number}", f"rank-{rank}.stacks")


def last_lines(w: WorkerProcess, n: int = 5) -> str:
    """The last ``n`` lines ``w`` printed while it had no log file, joined by `` | ``."""
    with w.lock:
        return " | ".join(text for _, text in list(w.pending)[-n:])


class WorkerOutput:
    """Copies workers' output to the console and to their rank's log file."""

    def __init__(self, console: ConsoleFilter, log: JobLogger):
        self.console = console
        self._log = log
        self._echo_lock = threading.Lock()

    def pump(self, w: WorkerProcess, stream, name: str) -> None:
        """Copy one output stream (``name``: stdout or stderr) of ``w`` until it closes."""
        try:
            for raw in iter(lambda: stream.readline(65536), b""):
                text = raw.decode("utf-8", "replace").rstrip("\n")
                with w.lock:
                    label = w.label
                    shown = self.console.shows(w.local_rank if w.assigned else None, name)
                    if w.log_file is not None:
                        try:
                            w.log_file.write(f"{name}: {text}\n")
                            w.log_file.flush()
                        except (OSError, ValueError):
                            pass
                    elif not w.assigned:
                        w.pending.append((name, text))
                if shown:
                    self._echo(f"[{label}]: {text}\n")
        finally:
            stream.close()
            with w.lock:
                w.open_streams -= 1
                close_log_if_done(w)

    def open_rank_log(self, w: WorkerProcess, log_dir: str) -> None:
        """Open the log of ``w``'s rank and round and write what it printed while warm
        (caller holds ``w.lock`` or owns ``w`` alone). A log that cannot be written is
        logged as a warning; the console still gets the lines."""
        path = rank_files(log_dir, w.round, w.rank)[0]
        try:
            w.log_file = localfiles.open_log(path)
            for stream, text in w.pending:  # what it printed while warm (torch's warnings)
                w.log_file.write(f"{stream}: {text}\n")
            w.log_file.flush()
        except OSError as exc:
            self._log.at_round(w.round).warning("cannot write the log of rank %d to %s: %s",
                                                w.rank, path, exc)
            w.log_file = None
        w.pending.clear()
        close_log_if_done(w)

    def _echo(self, line: str) -> None:
        out = sys.stdout
        if out is None:
            return
        with self._echo_lock:
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):
                pass  # the agent's stdout is closed or full; the log file still has it


def close_log_if_done(w: WorkerProcess) -> None:
    """Close ``w``'s log once both its streams have ended (caller holds ``w.lock``)."""
    if w.open_streams == 0 and w.log_file is not None:
        try:
            w.log_file.close()
        except OSError:
            pass
        w.log_file = None


def close_log(w: WorkerProcess) -> None:
    """Close ``w``'s log now (caller holds ``w.lock``): it is no longer a rank's worker."""
    if w.log_file is not None:
        w.log_file.close()
        w.log_file = None
