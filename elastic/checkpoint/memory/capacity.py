"""Memory you can plan: what the memory tier needs per node, checked against what is free.

Per node the tier holds, for each local rank, two slots (the snapshot being
written and the last complete one) of the rank's state, and the same again for
the buddy node's replicas: ``need = 2 * 2 * state bytes * local ranks``
(:func:`node_need`; the ranks' state is taken as this rank's, the usual case
of even shards). It lives on the memory directory's file system (a tmpfs:
host memory) and counts against the job's cgroup, so both must have room:
:func:`check` is the rule and its message, :func:`filesystem_free` and
:func:`cgroup_free` read the two figures (None: no limit known).

The page size of that tmpfs sets how fast a restore copies a slot
(:func:`huge_pages`): ``/dev/shm`` is mounted with 4 KiB pages, and the kernel
reads such a file at about half the speed of a memory copy (its work per page
outweighs the copy); a tmpfs mounted with ``huge=within_size`` holds a slot's
``data.bin`` in 2 MiB pages, read at memory-copy speed. Only the mount chooses:
a process without privileges cannot change it.
"""

from __future__ import annotations

import os

from elastic.checkpoint.memory.layout import SLOTS_PER_RANK
from elastic.errors import ConfigError

# Own snapshots and the buddy's replicas.
COPIES = 2
CGROUP_ROOT = "/sys/fs/cgroup"
MOUNTINFO = "/proc/self/mountinfo"
# The tmpfs ``huge=`` options under which a file written at its final size (a
# slot's data.bin is made so) gets 2 MiB pages without asking (madvise).
_HUGE_OPTIONS = ("huge=always", "huge=within_size")


def node_need(state_bytes: int, local_ranks: int) -> int:
    """Bytes the tier needs on one node for ``local_ranks`` ranks of ``state_bytes`` each."""
    return SLOTS_PER_RANK * COPIES * state_bytes * max(1, local_ranks)


def check(need: int, held: int, filesystem: int | None, cgroup: int | None,
          memory_dir: str) -> None:
    """Raise ConfigError, saying what is needed, what is free and what to do,
    when ``need`` bytes do not fit in the memory directory's free space or the
    cgroup's free memory (None: unknown, not checked). ``held``: the bytes the
    tier's own files already take there (they are counted as free: they are
    rewritten in place)."""
    short = []
    if filesystem is not None and need > filesystem + held:
        short.append(f"{_gib(filesystem + held)} free on the file system of {memory_dir}")
    if cgroup is not None and need > cgroup + held:
        short.append(f"{_gib(cgroup + held)} free under this job's cgroup memory limit")
    if short:
        raise ConfigError(
            f"the memory tier needs {_gib(need)} of host memory on this node (2 slots x "
            f"(own snapshot + the buddy node's replica) x each local rank's state) but has only "
            f"{' and '.join(short)}; make room (a larger /dev/shm, e.g. docker --shm-size or a "
            f"Kubernetes emptyDir with medium Memory, or a higher memory limit), shard the state "
            f"over more nodes, or turn the memory tier off (no --memory-tier, no memory_dir=)")


def filesystem_free(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s file system."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def mount_of(path: str, mountinfo: str = MOUNTINFO) -> tuple[str, str] | None:
    """``(file system type, its options)`` of the mount ``path`` lies on (the
    longest mount point above it in ``mountinfo``), or None when it cannot be told."""
    path = os.path.realpath(path)
    found: tuple[str, str, str] | None = None
    for line in (_read(mountinfo) or "").splitlines():
        fields = line.split()
        try:
            point = fields[4].replace("\\040", " ")
            separator = fields.index("-")
            kind, options = fields[separator + 1], fields[separator + 3]
        except (IndexError, ValueError):
            continue
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found[0])):
            found = (point, kind, options)
    return None if found is None else found[1:]


def huge_pages(path: str, mountinfo: str = MOUNTINFO) -> bool | None:
    """Whether slot files under ``path`` get 2 MiB pages: True on a tmpfs mounted
    ``huge=always`` or ``huge=within_size``, False on another tmpfs (4 KiB pages),
    None when ``path`` is not on a tmpfs or its mount cannot be told."""
    mount = mount_of(path, mountinfo)
    if mount is None or mount[0] != "tmpfs":
        return None
    return any(option in mount[1].split(",") for option in _HUGE_OPTIONS)


def cgroup_free(root: str = CGROUP_ROOT) -> int | None:
    """This process's cgroup memory limit minus its usage (v2, else v1); None without a limit."""
    own = _own_cgroup_v2()
    for v2 in ([os.path.join(root, own.lstrip("/"))] if own else []) + [root]:
        limit = _read(os.path.join(v2, "memory.max"))
        if limit is not None:
            return _free(limit, _read(os.path.join(v2, "memory.current")))
    v1 = os.path.join(root, "memory")
    return _free(_read(os.path.join(v1, "memory.limit_in_bytes")),
                 _read(os.path.join(v1, "memory.usage_in_bytes")))


def _free(limit: str | None, used: str | None) -> int | None:
    """``limit - used`` from the files' text; None for "max" or an unbounded v1
    limit (a page-rounded 2**63 - 1)."""
    if limit is None or limit == "max" or not limit.isdigit() or int(limit) >= 2**62:
        return None
    usage = int(used) if used is not None and used.isdigit() else 0
    return max(0, int(limit) - usage)


def _own_cgroup_v2() -> str | None:
    text = _read("/proc/self/cgroup")
    for line in (text or "").splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
