"""The reaper: frees the node's memory-tier directory when its agent dies.

The agent starts it (:func:`start_reaper`) as a process of its own, running
this file with ``python -I -S`` (the standard library only: it starts in tens
of milliseconds and imports nothing of the agent's), with the read end of a
pipe as its stdin. Only the agent holds the write end (close-on-exec, so its
workers do not inherit it). When the agent exits in any way, SIGKILL
included, the kernel closes that end; the reaper reads end-of-file, removes
the directory, and exits. On a normal exit the agent frees the directory
itself and then closes the pipe (:meth:`Reaper.close`), so the reaper finds
nothing to do and is waited for.

What it holds: its stdin and /dev/null; none of the agent's other files or
sockets (``close_fds``), and a session of its own (a Ctrl-C at the agent's
terminal does not stop it before its agent). What it removes: the one
directory it was given, only when it lies inside ``<root>/elastic-<uid>/``
(``base``) and still holds the owner token it was given (a directory that a
later agent of the same node id made is not its to remove); then the job's
directory above it, once that is empty, as the agent's own exit does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

OWNER_FILE = ".owner"


def owned_by(path: str, token: str) -> bool:
    """Whether the directory ``path`` holds the owner token ``token``."""
    try:
        fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, encoding="ascii", errors="replace") as f:
            return f.read(128) == token
    except OSError:
        return False


def inside(path: str, base: str) -> bool:
    """Whether ``path`` lies strictly inside ``base`` (links resolved)."""
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    return real != real_base and os.path.commonpath([real, real_base]) == real_base


def reap(path: str, base: str, token: str) -> bool:
    """Remove ``path`` if it lies inside ``base`` and holds ``token``; whether it did."""
    if not inside(path, base) or os.path.islink(path) or not owned_by(path, token):
        return False
    # Renamed first: a half-removed directory never sits at the node's path.
    doomed = f"{path}.reaped-{os.getpid()}"
    try:
        os.rename(path, doomed)
    except OSError:
        return False
    shutil.rmtree(doomed, ignore_errors=True)
    if inside(os.path.dirname(path), base):
        remove_job_dir(path)
    return True


def remove_job_dir(node_dir: str) -> None:
    """Remove the job's directory above ``node_dir`` once no node's is left in it."""
    try:
        os.rmdir(os.path.dirname(node_dir))
    except OSError:
        pass


class Reaper:
    """The reaper process and the agent's end of its pipe."""

    def __init__(self, process: subprocess.Popen, pipe_fd: int):
        self.process = process
        self._pipe_fd = pipe_fd

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the pipe (the reaper then reaps and exits) and wait for it,
        killing it after ``timeout_s``. Idempotent."""
        if self._pipe_fd >= 0:
            os.close(self._pipe_fd)
            self._pipe_fd = -1
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_reaper(path: str, base: str, token: str) -> Reaper:
    """Start the reaper of ``path`` (see the module docstring). Raises
    ValueError when ``path`` does not lie inside ``base``, OSError when the
    process cannot start."""
    if not inside(path, base):
        raise ValueError(f"refusing to watch {path}: not inside {base}")
    read_fd, write_fd = os.pipe()  # both close-on-exec; Popen makes read_fd its stdin
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), path, base, token],
            stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, start_new_session=True, cwd="/")
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return Reaper(process, write_fd)


def main(argv: list[str]) -> int:
    """``memory_reaper.py PATH BASE TOKEN``: wait for end-of-file on stdin, then reap."""
    if len(argv) != 3:
        return 2
    path, base, token = argv
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    reap(path, base, token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
