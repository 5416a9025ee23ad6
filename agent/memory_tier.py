"""The node's memory-tier directory: checked, created, scanned, freed.

With ``--memory-tier`` the agent owns ``<root>/elastic-<uid>/<job>/<node>/``
(:func:`prepare`; ``--memory-root``, ``/dev/shm`` by default), with ``own/``
and ``replicas/`` in it as :mod:`elastic.checkpoint.memory.layout` describes,
every directory mode 0700. Its workers find it in ``ELASTIC_MEMORY_DIR``.

It is freed on every way out: the agent removes it when it exits (the job's
end included), a reaper process (:mod:`agent.memory_reaper`) removes it when
the agent dies without doing so (SIGKILL, a crash), and an agent that starts
with the same node id removes what an earlier one left. The directory holds
an owner token, which the reaper checks, so a reaper that outlives its agent
never removes the directory of the agent that replaced it.

Slots are freed the one safe way (:func:`remove_slot`): manifest first (the
slot stops being complete), then renamed out of the slot names, then removed.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import stat

from agent.memory_reaper import OWNER_FILE, Reaper, owned_by, remove_job_dir, start_reaper
from agent.memory_rules import SlotSeen
from elastic.checkpoint.memory import capacity, layout
from elastic.errors import ConfigError

# File systems whose files live in memory: what the memory tier is for.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
DEFAULT_ROOT = "/dev/shm"
_MOUNTS = "/proc/self/mounts"


@dataclasses.dataclass(frozen=True)
class MemoryDir:
    """The node's memory directory (``path``) under its user's ``base``
    (``<root>/elastic-<uid>``), with the token that says this agent owns it."""

    root: str
    base: str
    path: str
    token: str


def filesystem_type(path: str, mounts_file: str = _MOUNTS) -> str:
    """The type of the file system ``path`` lies on (the longest mount point
    that contains it), "" when it cannot be told."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open(mounts_file, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                # /proc/mounts escapes spaces in mount points as \040.
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return ""
    return kind


def check_root(root: str, mounts_file: str = _MOUNTS) -> None:
    """Raises ConfigError naming ``--memory-root`` when ``root`` is not a
    directory this user can write, or lies on a file system that is not in
    memory (tmpfs, ramfs): snapshots on a disk would cost what the tier saves."""
    if not os.path.isdir(root):
        raise ConfigError(f"--memory-root {root}: no such directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"--memory-root {root}: not writable by this user (uid {os.getuid()})")
    kind = filesystem_type(root, mounts_file)
    if kind not in MEMORY_FILESYSTEMS:
        raise ConfigError(f"--memory-root {root}: {_a(kind)} file system, not "
                          "tmpfs or ramfs: the memory tier keeps snapshots in host memory "
                          "(default /dev/shm)")


def user_base(root: str) -> str:
    """``<root>/elastic-<uid>``: the only directory the agent and its reaper
    ever remove anything from."""
    return os.path.join(os.path.abspath(root), f"elastic-{os.getuid()}")


def _private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check that it is a directory of this user
    that nobody else can enter: in a world-writable root (/dev/shm) another
    user could have made it first, or made it a link. Raises ConfigError."""
    try:
        os.mkdir(path, layout.DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the memory tier's directory {path}: "
                          f"{exc.strerror or exc}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path} is not a directory private to this user (uid "
                          f"{os.getuid()}, mode 0700): remove it, or choose another "
                          "--memory-root")


def prepare(root: str, job_id: str, node_id: str) -> MemoryDir:
    """Check ``root`` (:func:`check_root`), remove what an earlier agent of this
    node left, and create the node's directory with ``own/``, ``replicas/``
    and a new owner token. Raises ConfigError."""
    check_root(root)
    base = user_base(root)
    _private_dir(base)
    path = os.path.join(base, job_id, node_id)
    for attempt in range(3):
        # Another node of the job on this host may remove the job's directory,
        # empty, between our two mkdirs (free()): make it again.
        _private_dir(os.path.dirname(path))
        if os.path.lexists(path):
            remove_tree(path, base)
        try:
            _private_dir(path)
            break
        except ConfigError:
            if attempt == 2 or os.path.isdir(os.path.dirname(path)):
                raise
    for part in (layout.OWN, layout.REPLICAS):
        _private_dir(os.path.join(path, part))
    token = secrets.token_hex(16)
    fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                 layout.FILE_MODE)
    with open(fd, "w") as f:
        f.write(token)
    return MemoryDir(root=os.path.abspath(root), base=base, path=path, token=token)


def watch_over(memory: MemoryDir) -> Reaper:
    """Start the reaper that frees ``memory`` when this process dies."""
    return start_reaper(memory.path, memory.base, memory.token)


def remove_tree(path: str, base: str) -> None:
    """Remove ``path``, which must lie inside ``base``; ValueError otherwise."""
    real_base = os.path.realpath(base)
    if os.path.commonpath([os.path.realpath(os.path.dirname(path)), real_base]) != real_base \
            or os.path.realpath(path) == real_base:
        raise ValueError(f"refusing to remove {path}: not inside {base}")
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def free(memory: MemoryDir) -> None:
    """Remove the node's directory, if this agent still owns it, and the job's
    directory once no node's is left in it."""
    if owned_by(memory.path, memory.token):
        remove_tree(memory.path, memory.base)
    remove_job_dir(memory.path)


def remove_slot(slot_dir: str) -> None:
    """Free one slot: its manifest first, so it is never complete while half
    removed, then the rest under a name no slot has."""
    try:
        os.unlink(os.path.join(slot_dir, layout.MANIFEST))
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        os.unlink(slot_dir)
        return
    parent, name = os.path.split(slot_dir)
    doomed = os.path.join(parent, f".{name}.freed-{os.getpid()}")
    try:
        os.rename(slot_dir, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def slot_path(memory_dir: str, s: SlotSeen) -> str:
    """Where the slot ``s`` lies in ``memory_dir``."""
    holder_dir = (layout.own_dir(memory_dir) if s.holder == layout.OWN
                  else layout.replica_dir(memory_dir, s.holder))
    return os.path.join(holder_dir, s.key.name)


def scan(memory_dir: str) -> list[SlotSeen]:
    """Every slot directory in the node's memory directory, own and replicas,
    complete or not (a name that is no slot's is left alone)."""
    found = []
    holders = [(layout.OWN, layout.own_dir(memory_dir))]
    replicas = os.path.join(memory_dir, layout.REPLICAS)
    for source in layout.names_in(replicas):
        try:
            holders.append((source, layout.replica_dir(memory_dir, source)))
        except ConfigError:
            continue  # not a node id: nothing the receiver wrote
    for holder, directory in holders:
        for name in layout.names_in(directory):
            key = layout.parse_slot_name(name)
            if key is None:
                continue
            info = layout.read_slot(os.path.join(directory, name), holder)
            found.append(SlotSeen(holder, key, info.manifest.step, info.manifest.nbytes)
                          if info is not None else SlotSeen(holder, key))
    return found


def free_bytes(path: str) -> int:
    """Bytes this user may still write on the file system of ``path`` (0 when
    it cannot be read): :func:`elastic.checkpoint.memory.capacity.filesystem_free`."""
    return capacity.filesystem_free(path) or 0


def _a(kind: str) -> str:
    """``an ext4``, ``a btrfs``, ``an unknown``: the file system's type for a sentence."""
    kind = kind or "unknown"
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
