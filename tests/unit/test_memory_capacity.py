"""Memory you can plan: the tier's need per node, the check and its message, the readers."""

from __future__ import annotations

import pytest

from elastic.checkpoint.memory import capacity
from elastic.errors import ConfigError

GIB = 2**30


def test_need_is_two_slots_for_own_and_buddy_per_local_rank():
    assert capacity.node_need(state_bytes=GIB, local_ranks=8) == 32 * GIB
    assert capacity.node_need(state_bytes=100, local_ranks=0) == 400  # at least one rank


def test_enough_room_passes():
    capacity.check(need=4 * GIB, held=0, filesystem=5 * GIB, cgroup=None, memory_dir="/dev/shm/x")
    capacity.check(need=4 * GIB, held=GIB, filesystem=3 * GIB, cgroup=3 * GIB,
                   memory_dir="/dev/shm/x")  # what the tier holds already is rewritten in place


def test_a_small_shm_says_what_it_needs_what_is_free_and_what_to_do():
    with pytest.raises(ConfigError) as err:
        capacity.check(need=32 * GIB, held=0, filesystem=8 * GIB, cgroup=None,
                       memory_dir="/dev/shm/job")
    message = str(err.value)
    assert "needs 32.00 GiB" in message
    assert "8.00 GiB free on the file system of /dev/shm/job" in message
    assert "larger /dev/shm" in message and "turn the memory tier off" in message


def test_a_cgroup_limit_counts_too():
    with pytest.raises(ConfigError, match="2.00 GiB free under this job's cgroup"):
        capacity.check(need=4 * GIB, held=0, filesystem=100 * GIB, cgroup=2 * GIB,
                       memory_dir="/dev/shm/job")


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_usage(tmp_path):
    write(tmp_path / "memory.max", "1073741824\n")
    write(tmp_path / "memory.current", "73741824\n")
    assert capacity.cgroup_free(str(tmp_path)) == 1_000_000_000


def test_cgroup_without_limit(tmp_path):
    write(tmp_path / "memory.max", "max\n")
    assert capacity.cgroup_free(str(tmp_path)) is None


def test_cgroup_v1_fallback_and_its_unbounded_limit(tmp_path):
    write(tmp_path / "memory" / "memory.limit_in_bytes", "2000\n")
    write(tmp_path / "memory" / "memory.usage_in_bytes", "500\n")
    assert capacity.cgroup_free(str(tmp_path)) == 1500
    write(tmp_path / "memory" / "memory.limit_in_bytes", str(2**63 - 4096))
    assert capacity.cgroup_free(str(tmp_path)) is None


def test_filesystem_free(tmp_path):
    assert capacity.filesystem_free(str(tmp_path)) > 0
    assert capacity.filesystem_free(str(tmp_path / "missing")) is None


MOUNTS = """\
22 1 253:0 / / rw,relatime - ext4 /dev/vda rw,discard
30 22 0:25 / /fake/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=1024k
31 22 0:26 / /fake/huge rw,relatime - tmpfs tmpfs rw,size=4096k,huge=within_size
32 31 0:27 / /fake/huge/plain rw,relatime - tmpfs tmpfs rw,size=4096k
"""


def test_a_tmpfs_mounted_huge_gives_slot_files_2_mib_pages(tmp_path):
    write(tmp_path / "mountinfo", MOUNTS)
    mountinfo = str(tmp_path / "mountinfo")
    assert capacity.huge_pages("/fake/huge/job/own", mountinfo) is True
    assert capacity.huge_pages("/fake/huge/plain/job", mountinfo) is False  # the deeper mount
    assert capacity.huge_pages("/fake/shm/job", mountinfo) is False
    assert capacity.huge_pages("/fake/tmp/job", mountinfo) is None  # not a tmpfs
    assert capacity.mount_of("/fake/shm", mountinfo) == ("tmpfs", "rw,size=1024k")
    assert capacity.mount_of("/fake/shm", str(tmp_path / "missing")) is None
