"""The agent's private files on its node: the node directory, the workers' socket, rank logs.

Layout (``--state-dir``, see :func:`agent.config.default_state_dir`)::

    <state-dir>/                     checked: a directory of this user, not a link
        <job>/<node>/                0700, created by the agent
            agent.sock               the workers' Unix socket (0600)
            logs/round-<N>/          0700: rank-<R>.log (0600), rank-<R>.error.json

Why: the socket takes heartbeats and checkpoint commits, so any process that
can connect to it can fake a hung worker's liveness or commit a checkpoint in
the job's name; rank logs hold whatever the training script prints. Only the
agent's user (the agent and the workers it spawns) may reach them.

How, against another local user who can write somewhere on the way:

* the state directory itself is created (with its missing parents) when
  absent, and refused with a ConfigError when it is a symbolic link, not a
  directory, owned by another user (root's is accepted: root can do anything
  anyway), or writable by its group or by others (sticky or not: another
  user could plant ``<job>`` or ``round-N`` there and make the agent fail at
  each start; a Kubernetes emptyDir, 0777, is such a directory: give a
  subdirectory of it, which the agent creates 0700);
* every directory below it is created with mode 0700 through its parent's
  file descriptor and opened with ``O_NOFOLLOW | O_DIRECTORY``, so no
  symbolic link planted on the way is ever followed; one owned by another
  user is refused, and one of ours with looser permissions is tightened;
* rank logs are opened with ``O_NOFOLLOW`` (mode 0600).

A Unix socket's path has at most 107 bytes (``sun_path``). When
``<node dir>/agent.sock`` is longer, the socket goes to a private directory
of this user under ``$XDG_RUNTIME_DIR`` (``elasticd/``) or else the temp
directory (``elasticd-<uid>/``), with the same checks (such a directory in
the shared ``/tmp`` that another user created first is refused, never used),
named by a hash of job and node; the log says so. Before the agent binds a
socket there, :func:`prepare_socket_path` removes a stale one of this user
that no process serves (a dead agent's), and refuses anything else.

An explicit ``--log-dir`` is the operator's choice: its missing directories
are created with mode 0700, and it may be a link (to a larger disk), but the
directory itself must be this user's (or root's) and writable by nobody else,
as the state directory; the round directories and logs below it are made as
above.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import Mapping

from elastic.errors import ConfigError

log = logging.getLogger(__name__)

SOCKET_NAME = "agent.sock"
LOGS_NAME = "logs"
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PrivateDirError(ConfigError):
    """A directory the agent keeps private is not (a link, another user's, not a
    directory); the message names it and says what to change."""


@dataclass(frozen=True)
class NodeFiles:
    """Where this node's private files are: all paths absolute."""

    node_dir: str
    log_dir: str
    socket_path: str


def prepare(state_dir: str, log_dir: str, job_id: str, node_id: str,
            environ: Mapping[str, str] | None = None) -> NodeFiles:
    """Create (or check) the node's private directory ``state_dir`` (which is
    ``<state-dir>/<job_id>/<node_id>``, as :class:`agent.config.AgentConfig`
    holds it) and the log directory, and choose the worker socket's path.

    Raises ConfigError (PrivateDirError) naming the path when a directory is
    a symbolic link, not a directory, or another user's, or cannot be created;
    and when no socket path fits in 107 bytes.
    """
    environ = os.environ if environ is None else environ
    node_dir = os.path.abspath(state_dir)
    base = os.path.dirname(os.path.dirname(node_dir))
    if os.path.join(base, job_id, node_id) != node_dir:
        raise ConfigError(f"the state directory {node_dir} is not <state-dir>/{job_id}/{node_id}")
    default_logs = os.path.join(node_dir, LOGS_NAME)
    fd = open_checked_base(base)
    try:
        for name, parent in ((job_id, base), (node_id, os.path.join(base, job_id))):
            fd = _replace(fd, private_subdir_fd(fd, name, parent))
        if os.path.abspath(log_dir) == default_logs:
            os.close(private_subdir_fd(fd, LOGS_NAME, node_dir))
    finally:
        os.close(fd)
    if os.path.abspath(log_dir) != default_logs:
        ensure_dir(log_dir, "--log-dir")
        check_log_dir(log_dir)
    return NodeFiles(node_dir=node_dir, log_dir=os.path.abspath(log_dir),
                     socket_path=socket_path(node_dir, job_id, node_id, environ))


def socket_path(node_dir: str, job_id: str, node_id: str,
                environ: Mapping[str, str]) -> str:
    """``<node_dir>/agent.sock`` when it fits in a Unix socket address, else a
    socket in this user's private runtime directory (see the module
    docstring), which this creates. Raises ConfigError when none fits."""
    path = os.path.join(node_dir, SOCKET_NAME)
    if _fits(path):
        return path
    digest = hashlib.sha1(f"{job_id}/{node_id}".encode()).hexdigest()[:16]
    tried = [path]
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    bases = ([(runtime, "elasticd")] if os.path.isabs(runtime) else []) + [
        (tempfile.gettempdir(), f"elasticd-{os.geteuid()}")]
    for base, name in bases:
        fallback = os.path.join(base, name, f"{digest}.sock")
        tried.append(fallback)
        if not _fits(fallback):
            continue
        try:
            fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("Cannot use %s for the worker socket: %s.", base, exc.strerror)
            continue
        try:
            os.close(private_subdir_fd(fd, name, base))
        finally:
            os.close(fd)
        log.info("The worker socket %s would be longer than the %d bytes of a Unix socket "
                 "address; it is %s instead (a private directory of this user).", path,
                 MAX_SOCKET_PATH_BYTES, fallback)
        return fallback
    raise ConfigError(f"no path for the worker socket fits in the {MAX_SOCKET_PATH_BYTES} "
                      f"bytes of a Unix socket address (tried {', '.join(tried)}): use a "
                      "shorter --state-dir")


def _fits(path: str) -> bool:
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH_BYTES


def open_checked_base(path: str) -> int:
    """An O_DIRECTORY fd of the state directory ``path``, created (0700, with
    its missing parents) when absent. Raises PrivateDirError when it is a
    symbolic link, not a directory, or owned by another user."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link in the way: named below
    except OSError as exc:
        raise PrivateDirError(f"cannot create the state directory {path} (--state-dir): "
                              f"{exc.strerror}") from exc
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise _refusal(path, "the state directory (--state-dir)", exc) from exc
    try:
        # root's is trusted too (root can do anything anyway): a directory an
        # administrator made is root's.
        _check_owner(fd, path, "the state directory (--state-dir)", allow_root=True)
        _check_not_shared(fd, path, "the state directory", "--state-dir")
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_subdir_fd(parent_fd: int, name: str, parent: str) -> int:
    """Create ``name`` under the directory open as ``parent_fd`` (whose path is
    ``parent``, for messages) with mode 0700 unless it exists, and return an
    O_DIRECTORY fd of it, never through a symbolic link. Raises PrivateDirError
    when it is a link, not a directory, or another user's; tightens one of
    ours to 0700."""
    path = os.path.join(parent, name)
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"cannot create the private directory {path}: "
                              f"{exc.strerror}") from exc
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise _refusal(path, "the private directory", exc) from exc
    try:
        mode = _check_owner(fd, path, "the private directory")
        if mode & 0o077:
            log.warning("Tightening the permissions of %s from %o to 700: only this user "
                        "may reach the workers' socket and logs.", path, mode)
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_subdir(parent: str, name: str) -> str:
    """:func:`private_subdir_fd` by path (``parent`` is opened as it is: it is
    the agent's own, or the operator's ``--log-dir``); returns the new path."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise PrivateDirError(f"cannot open the directory {parent}: {exc.strerror}") from exc
    try:
        os.close(private_subdir_fd(fd, name, parent))
    finally:
        os.close(fd)
    return os.path.join(parent, name)


def ensure_dir(path: str, what: str) -> None:
    """Create the directory ``path`` and its missing parents with mode 0700;
    raises PrivateDirError naming ``what`` when it cannot be, or is not a
    directory."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise PrivateDirError(f"cannot create {path} ({what}): "
                              f"{exc.strerror or exc}") from exc


def check_log_dir(path: str) -> None:
    """Refuse an explicit ``--log-dir`` (links followed) that another user owns
    or may write in: they could plant a ``round-N`` there and make the agent
    fail at each start. Raises PrivateDirError naming --log-dir."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise PrivateDirError(f"cannot open the log directory {path} (--log-dir): "
                              f"{exc.strerror}") from exc
    try:
        _check_owner(fd, path, "the log directory (--log-dir)", allow_root=True,
                     option="--log-dir")
        _check_not_shared(fd, path, "the log directory", "--log-dir")
    finally:
        os.close(fd)


def _check_not_shared(fd: int, path: str, what: str, option: str) -> None:
    """PrivateDirError when the directory open as ``fd`` is writable by its
    group or by others."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002))
                           if mode & bit)
        raise PrivateDirError(
            f"{what} {path} ({option}) is writable by {who} (mode {mode:o}): another user "
            f"could plant files there that make the agent fail; choose another {option} (a "
            f"new directory is created 0700), or make it private (chmod go-w {path})")


def open_log(path: str):
    """Open a rank's log for appending (created 0600), never through a symbolic link."""
    return open(path, "a", encoding="utf-8", errors="replace", opener=_no_follow_0600)


def _no_follow_0600(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _check_owner(fd: int, path: str, what: str, allow_root: bool = False,
                 option: str = "--state-dir") -> int:
    """The permission bits of the directory open as ``fd``; PrivateDirError
    when it is not this user's (nor root's, with ``allow_root``), naming
    ``option`` as the one to change."""
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() and not (allow_root and info.st_uid == 0):
        raise PrivateDirError(f"{what} {path} belongs to uid {info.st_uid}, not to this user "
                              f"(uid {os.geteuid()}): refusing to keep the workers' socket "
                              f"and logs there; remove it or choose another {option}")
    return stat.S_IMODE(info.st_mode)


def _refusal(path: str, what: str, exc: OSError) -> PrivateDirError:
    # O_NOFOLLOW | O_DIRECTORY on a link: ELOOP, or ENOTDIR on Linux.
    if exc.errno == errno.ELOOP or os.path.islink(path):
        return PrivateDirError(f"{what} {path} is a symbolic link: refusing to follow it "
                               "(give the real directory)")
    if exc.errno == errno.ENOTDIR:
        return PrivateDirError(f"{what} {path} is not a directory")
    return PrivateDirError(f"cannot open {what} {path}: {exc.strerror}")


def _replace(old_fd: int, new_fd: int) -> int:
    os.close(old_fd)
    return new_fd


def prepare_socket_path(path: str, kind: int = socket.SOCK_STREAM) -> None:
    """Make ``path`` bindable: create its directory, remove a stale socket left by a dead agent.

    Raises ConfigError when the path is too long for a Unix socket, is not a
    socket, is another user's, or another live process is serving on it.
    ``kind``: the socket type (a stream socket cannot probe a datagram one).
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"worker socket path {path!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes, "
            "the limit of a Unix socket address"
        )
    # 0o700: nobody else may reach the socket in the window before it is chmod-ed.
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(
            f"worker socket path {path!r} exists and is not a socket; refusing to remove it"
        )
    if info.st_uid != os.geteuid():
        raise ConfigError(f"worker socket path {path!r} is a socket of another user (uid "
                          f"{info.st_uid}); refusing to use or remove it")
    with socket.socket(socket.AF_UNIX, kind) as probe:
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ConfigError(f"cannot probe worker socket {path!r}: {exc}") from exc
        else:
            raise ConfigError(
                f"worker socket {path!r} is in use by another process (another agent on this node?)"
            )
    log.info("Removing the stale worker socket %s left by an earlier agent.", path)
    try:
        os.unlink(path)
    except OSError as exc:
        raise ConfigError(f"cannot remove the stale worker socket {path!r}: "
                          f"{exc.strerror}") from exc
