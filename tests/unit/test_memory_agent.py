"""The memory tier's agent side without an agent: what to send, what to free, the
receiver's checks, the reaper's limits, the root check, the status line."""

from __future__ import annotations

import os
import threading

import pytest

from agent import config as agent_config
from agent import memory_reaper, memory_tier
from agent.memory_receiver import MAX_CHUNK_BYTES, RESERVE_BYTES, ReplicaReceiver
from agent.memory_rules import (
    Acked,
    SlotSeen,
    lag_steps,
    memory_need,
    slots_to_free,
    to_send,
)
from agent.status_record import MemoryTierRow, StatusRecord
from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.layout import OWN, SlotKey
from elastic.errors import ConfigError, FencedError, InvalidRequestError
from elastic.rendezvous.api import Member, Round
from elastic.v1 import agent_pb2
from tests.unit.test_roster_buckets import bucket_view


def own(round_, rank, slot, step=None, nbytes=0):
    return SlotSeen(OWN, SlotKey(round_, rank, slot), step, nbytes)


def replica(source, round_, rank, slot, step=None, nbytes=0):
    return SlotSeen(source, SlotKey(round_, rank, slot), step, nbytes)


# ------------------------------------------------------------------ what to send

def test_sends_the_newest_complete_snapshot_of_each_rank_skipping_older_ones():
    slots = [own(3, 0, 0, step=10), own(3, 0, 1, step=11), own(3, 1, 0, step=11),
             own(3, 1, 1)]  # rank 1's slot 1 is being written: not complete
    assert to_send(slots, {}) == [own(3, 0, 1, step=11), own(3, 1, 0, step=11)]


def test_sends_nothing_the_buddy_acknowledged_and_a_new_round_again():
    slots = [own(3, 0, 1, step=11), own(4, 1, 0, step=0)]
    acked = {0: Acked(3, 11), 1: Acked(3, 12)}
    assert to_send(slots, acked) == [own(4, 1, 0, step=0)]  # round 4 is newer than step 12


def test_lag_counts_the_steps_the_slowest_rank_trails_in_the_newest_round():
    slots = [own(3, 0, 0, step=20), own(3, 1, 0, step=20)]
    assert lag_steps(slots, {0: Acked(3, 20), 1: Acked(3, 17)}) == 3
    assert lag_steps(slots, {0: Acked(3, 20), 1: Acked(3, 20)}) == 0
    assert lag_steps(slots, {0: Acked(2, 99)}) == 21  # nothing of round 3 acknowledged
    assert lag_steps([], {}) == 0


def test_need_is_twice_the_own_snapshot_plus_twice_the_replica():
    slots = [own(1, 0, 0, 5, 100), own(1, 0, 1, 6, 120), own(1, 1, 0, 6, 100),
             replica("b", 1, 2, 0, 6, 300), replica("b", 1, 3, 1, 6, 300)]
    assert memory_need(slots) == 2 * (120 + 100) + 2 * (300 + 300)


# ------------------------------------------------------------------ what to free

def test_nothing_is_freed_before_every_worker_staged_a_complete_snapshot():
    slots = [own(1, 0, 0, step=9), own(1, 1, 0, step=9), own(2, 0, 0, step=0),
             replica("b", 1, 2, 0, step=9)]
    # Round 1 is complete (nproc 2) and is the newest complete: nothing is older.
    assert slots_to_free(slots, nproc=2) == []
    assert slots_to_free([own(2, 0, 0, step=0)], nproc=2) == []


def test_once_a_round_is_complete_older_rounds_go_own_and_replicas_complete_or_not():
    old = [own(1, 0, 0, step=9), own(1, 1, 1), replica("b", 1, 2, 0, step=9)]
    new = [own(2, 0, 0, step=0), own(2, 1, 0, step=0), replica("b", 2, 2, 0, step=0)]
    assert sorted(slots_to_free(old + new, nproc=2), key=repr) == \
        sorted(old, key=repr)


def test_replicas_go_by_their_round_even_from_a_node_that_left_the_ring():
    # c was this node's source in round 1 and is gone from round 2: its round-1
    # replicas are what round 2 restored from, kept until this node's workers
    # staged round 2, then freed with every other round-1 slot.
    kept = [own(2, 0, 0, step=0), replica("c", 1, 4, 0, step=9), replica("b", 2, 2, 0, step=0)]
    assert slots_to_free(kept, nproc=2) == []
    slots = kept + [own(2, 1, 0, step=0)]
    assert slots_to_free(slots, nproc=2) == [replica("c", 1, 4, 0, step=9)]


def test_a_freed_slot_is_never_complete_while_half_removed(tmp_path):
    slot = tmp_path / SlotKey(1, 0, 0).name
    write_slot(str(slot), "job", "a", 1, 0, 5, b"x" * 10)
    assert layout.read_slot(str(slot)) is not None
    memory_tier.remove_slot(str(slot))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ the receiver

def write_slot(slot_dir, job, node, round_, rank, step, data):
    layout.begin_write(slot_dir)
    with open(os.path.join(slot_dir, layout.DATA), "wb") as f:
        f.write(data)
    manifest = layout.Manifest(job_id=job, node_id=node, round=round_, step=step, rank=rank,
                               world_size=4, files={layout.DATA: len(data)})
    layout.finish_write(slot_dir, manifest)
    return manifest


def a_round(*nodes):
    return Round(number=3, members=tuple(Member(n, i, "127.0.0.1", 2) for i, n in
                                         enumerate(nodes)),
                 master_addr="127.0.0.1", master_port=1, reason="", leader=nodes[0],
                 created_at=0.0)


@pytest.fixture
def receiver(tmp_path):
    return ReplicaReceiver(str(tmp_path), "job", "b", lambda: a_round("a", "b"),
                           lambda: RESERVE_BYTES + (100 << 20), threading.Lock())


def request(**fields):
    base = dict(job_id="job", source="a", round=3, slot=SlotKey(3, 0, 1).name)
    return agent_pb2.AgentReplicateRequest(**{**base, **fields})


def send(receiver, manifest_bytes, files, slot=SlotKey(3, 0, 1).name, total=None):
    total = total or sum(len(d) for d in files.values()) + len(manifest_bytes)
    receiver.receive(request(slot=slot, begin=True, total_bytes=total))
    for name, data in files.items():
        receiver.receive(request(slot=slot, file=name, offset=0, data=data))
    receiver.receive(request(slot=slot, file=layout.MANIFEST, offset=0, data=manifest_bytes))
    receiver.receive(request(slot=slot, finish=True))


def test_a_received_slot_is_complete_and_identical(receiver, tmp_path):
    manifest = layout.Manifest(job_id="job", node_id="a", round=3, step=7, rank=0,
                               world_size=4, files={layout.DATA: 5})
    send(receiver, manifest.to_json(), {layout.DATA: b"hello"})
    info = layout.read_slot(str(tmp_path / "replicas" / "a" / SlotKey(3, 0, 1).name), "a")
    assert info is not None and info.manifest == manifest
    assert sorted(os.listdir(info.path)) == [layout.DATA, layout.MANIFEST]


def test_a_smaller_snapshot_replaces_a_larger_one_in_the_same_slot(receiver, tmp_path):
    for step, data in ((7, b"a longer snapshot"), (9, b"short")):
        manifest = layout.Manifest(job_id="job", node_id="a", round=3, step=step, rank=0,
                                   world_size=4, files={layout.DATA: len(data)})
        send(receiver, manifest.to_json(), {layout.DATA: data})
    info = layout.read_slot(str(tmp_path / "replicas" / "a" / SlotKey(3, 0, 1).name), "a")
    assert info is not None and info.manifest.step == 9
    assert open(os.path.join(info.path, layout.DATA), "rb").read() == b"short"


def test_a_slot_whose_finish_never_came_is_not_complete(receiver, tmp_path):
    slot = tmp_path / "replicas" / "a" / SlotKey(3, 0, 1).name
    write_slot(str(slot), "job", "a", 3, 0, 6, b"old!!")
    receiver.receive(request(begin=True, total_bytes=100))
    receiver.receive(request(file=layout.DATA, offset=0, data=b"new"))
    assert layout.read_slot(str(slot), "a") is None


@pytest.mark.parametrize("manifest, why", [
    (b"{not json", "malformed manifest"),
    (layout.Manifest(job_id="other", node_id="a", round=3, step=1, rank=0, world_size=4,
                     files={layout.DATA: 5}).to_json(), "of job other"),
    (layout.Manifest(job_id="job", node_id="a", round=3, step=1, rank=2, world_size=4,
                     files={layout.DATA: 5}).to_json(), "rank 2"),
    (layout.Manifest(job_id="job", node_id="a", round=3, step=1, rank=0, world_size=4,
                     files={layout.DATA: 9}).to_json(), "has 5 bytes, its manifest says 9"),
])
def test_a_manifest_that_does_not_vouch_for_the_slot_is_refused(receiver, tmp_path, manifest,
                                                                why):
    with pytest.raises(InvalidRequestError, match=why):
        send(receiver, manifest, {layout.DATA: b"hello"}, total=1000)
    assert layout.list_slots(str(tmp_path)) == []


@pytest.mark.parametrize("fields, why", [
    (dict(source="../b"), "not a node id"),
    (dict(source="b"), "to itself"),
    (dict(job_id="other"), "job 'other'"),
    (dict(slot="../../own/x"), "not a slot name"),
    (dict(slot="round-0000000003.rank-000000.slot-2"), "not a slot name"),
])
def test_path_tricks_and_strangers_are_refused(receiver, tmp_path, fields, why):
    with pytest.raises(InvalidRequestError, match=why):
        receiver.receive(request(begin=True, total_bytes=10, **fields))
    assert not os.path.exists(tmp_path / "replicas")


@pytest.mark.parametrize("name", ["../data.bin", ".hidden", "a/b", "", "x" * 65])
def test_a_file_name_that_is_not_a_plain_name_in_the_slot_is_refused(receiver, name):
    receiver.receive(request(begin=True, total_bytes=10))
    with pytest.raises(InvalidRequestError, match="not a plain name"):
        receiver.receive(request(file=name, offset=0, data=b"x"))


def test_a_sender_outside_the_round_is_fenced(tmp_path):
    receiver = ReplicaReceiver(str(tmp_path), "job", "b", lambda: a_round("b", "c"),
                               lambda: 1 << 40, threading.Lock())
    with pytest.raises(FencedError, match="not a member of round 3"):
        receiver.receive(request(begin=True, total_bytes=10))


def test_a_large_jobs_node_takes_replicas_from_its_source_and_members_of_its_bucket(tmp_path):
    ids = [f"n{i:03d}" for i in range(300)]
    mine = bucket_view(a_round(*ids), "n150")
    receiver = ReplicaReceiver(str(tmp_path), "job", "n150", lambda: mine,
                               lambda: 1 << 40, threading.Lock())
    held = {m.node_id for m in mine.held_members()}
    assert mine.placement("n150").source.node_id == "n149" and "n149" not in held
    receiver.receive(request(source="n149", begin=True, total_bytes=10))
    receiver.receive(request(source=min(held - {"n150"}), begin=True, total_bytes=10))
    # Another member, neither: fenced until it sends to its own buddy.
    stranger = next(n for n in ids if n not in held and n != "n149")
    with pytest.raises(FencedError, match="not a member of round 3"):
        receiver.receive(request(source=stranger, begin=True, total_bytes=10))


def test_sizes_beyond_the_free_space_or_the_announced_total_are_refused(receiver):
    with pytest.raises(InvalidRequestError, match="free beyond its reserve"):
        receiver.receive(request(begin=True, total_bytes=(100 << 20) + 1))
    receiver.receive(request(begin=True, total_bytes=10))
    with pytest.raises(InvalidRequestError, match="exceed"):
        receiver.receive(request(file=layout.DATA, offset=8, data=b"xyz"))
    with pytest.raises(InvalidRequestError, match="exceed"):
        receiver.receive(request(file=layout.DATA, offset=-1, data=b"x"))
    with pytest.raises(InvalidRequestError, match="exceed"):
        receiver.receive(request(file=layout.DATA, offset=0, data=b"x" * (MAX_CHUNK_BYTES + 1)))


def test_a_chunk_without_its_begin_is_refused(receiver):
    with pytest.raises(InvalidRequestError, match="without its begin"):
        receiver.receive(request(file=layout.DATA, offset=0, data=b"x"))
    with pytest.raises(InvalidRequestError, match="without its begin"):
        receiver.receive(request(finish=True))


# ------------------------------------------------------------------ the directory and its reaper

def test_the_node_directory_is_private_and_replaces_what_a_crashed_agent_left(tmp_path):
    memory = memory_tier.prepare("/dev/shm", f"job-{os.getpid()}", "node-a")
    try:
        with open(os.path.join(memory.path, OWN, "left"), "w") as f:
            f.write("x")
        again = memory_tier.prepare("/dev/shm", f"job-{os.getpid()}", "node-a")
        assert os.listdir(os.path.join(again.path, OWN)) == []
        assert os.stat(again.path).st_mode & 0o777 == 0o700
        assert not memory_reaper.owned_by(again.path, memory.token)  # the old reaper's: not
        memory_tier.free(again)
        assert not os.path.exists(os.path.dirname(again.path))  # the job's, left empty
    finally:
        if os.path.exists(os.path.dirname(memory.path)):
            memory_tier.remove_tree(os.path.dirname(memory.path), memory.base)


def test_a_users_directory_others_can_enter_is_refused():
    import tempfile

    root = tempfile.mkdtemp(dir="/dev/shm")
    try:
        os.mkdir(memory_tier.user_base(root), 0o755)
        os.chmod(memory_tier.user_base(root), 0o755)  # whatever the umask
        with pytest.raises(ConfigError, match="not a directory private to this user"):
            memory_tier.prepare(root, "job", "a")
    finally:
        memory_tier.remove_tree(memory_tier.user_base(root), root)
        os.rmdir(root)


def test_the_reaper_removes_only_its_own_directory_inside_the_base(tmp_path):
    base = tmp_path / "elastic-1"
    (base / "job" / "a").mkdir(parents=True)
    (base / "job" / "a" / memory_reaper.OWNER_FILE).write_text("t0ken")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / memory_reaper.OWNER_FILE).write_text("t0ken")
    assert not memory_reaper.reap(str(tmp_path / "outside"), str(base), "t0ken")
    assert not memory_reaper.reap(str(base), str(base), "t0ken")
    assert not memory_reaper.reap(str(base / "job" / "a"), str(base), "other")
    assert (tmp_path / "outside").exists() and (base / "job" / "a").exists()
    (base / "job" / "b").mkdir()  # another node of the job on this host
    (base / "job" / "b" / memory_reaper.OWNER_FILE).write_text("t0k3n")
    assert memory_reaper.reap(str(base / "job" / "a"), str(base), "t0ken")
    assert os.listdir(base / "job") == ["b"], "the job's directory stays while b's is in it"
    assert memory_reaper.reap(str(base / "job" / "b"), str(base), "t0k3n")
    assert os.listdir(base) == [], "the job's directory goes with its last node's"
    with pytest.raises(ValueError, match="not inside"):
        memory_reaper.start_reaper(str(tmp_path / "outside"), str(base), "t0ken")


def test_the_reaper_frees_on_end_of_file_and_keeps_none_of_the_agents_files(tmp_path):
    base = tmp_path / "elastic-1"
    (base / "a").mkdir(parents=True)
    (base / "a" / memory_reaper.OWNER_FILE).write_text("t0ken")
    kept = os.open(str(tmp_path / "agent-file"), os.O_CREAT | os.O_WRONLY)
    os.set_inheritable(kept, True)  # even a file the agent let children inherit
    try:
        reaper = memory_reaper.start_reaper(str(base / "a"), str(base), "t0ken")
        fds = set(os.listdir(f"/proc/{reaper.pid}/fd"))
        assert fds <= {"0", "1", "2", "3"}, fds  # stdin, /dev/null, its own script
        assert (base / "a").exists()
        reaper.close()
        assert reaper.process.returncode == 0 and not (base / "a").exists()
    finally:
        os.close(kept)


def test_a_root_that_is_not_in_memory_is_refused(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\ntmpfs {tmp_path}/shm tmpfs rw 0 0\n")
    (tmp_path / "shm").mkdir()
    with pytest.raises(ConfigError, match="an ext4 file system, not tmpfs or ramfs"):
        memory_tier.check_root(str(tmp_path), str(mounts))
    memory_tier.check_root(str(tmp_path / "shm"), str(mounts))
    with pytest.raises(ConfigError, match="no such directory"):
        memory_tier.check_root(str(tmp_path / "missing"))
    memory_tier.check_root("/dev/shm")


def test_filesystem_type_takes_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n"
                      "none /dev/shm/x\\040y ramfs rw 0 0\n")
    assert memory_tier.filesystem_type("/dev/shm/elastic-1", str(mounts)) == "tmpfs"
    assert memory_tier.filesystem_type("/dev/shm/x y/z", str(mounts)) == "ramfs"
    assert memory_tier.filesystem_type("/var/lib", str(mounts)) == "ext4"


# ------------------------------------------------------------------ options and the status line

def test_memory_options_reach_the_config_from_flags_and_the_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    flags = ["--job-id", "j", "--nnodes", "1", "--advertise-addr", "127.0.0.1"]
    config = agent_config.load([*flags, "--memory-tier", "--rack", "r1",
                                "--memory-min-free", "2G", str(script)], environ={})
    assert (config.memory_tier, config.memory_root, config.rack,
            config.memory_min_free_bytes) == (True, "/dev/shm", "r1", 2 << 30)
    config = agent_config.load([*flags, str(script)],
                               environ={"ELASTIC_MEMORY_TIER": "1",
                                        "ELASTIC_MEMORY_ROOT": "/run/shm"})
    assert config.memory_tier and config.memory_root == "/run/shm"
    with pytest.raises(ConfigError, match="--memory-min-free"):
        agent_config.load([*flags, "--memory-min-free", "lots", str(script)], environ={})
    with pytest.raises(ConfigError, match="invalid rack"):
        agent_config.load([*flags, "--rack", "a b", str(script)], environ={})


def row():
    return MemoryTierRow(own_bytes=4 << 20, own_slots=4, replica_bytes=4 << 20,
                         replica_slots=4, replica_source="c", buddy="b", newest_own_step=41,
                         acked_step=40, lag_steps=1, need_bytes=16 << 20,
                         replication_bytes_per_s=300e6, free_bytes=8 << 30)


def test_the_status_line_says_what_the_tier_holds_and_needs():
    assert row().line("a") == (
        "memory tier a: own 4.0 MiB in 4 slots (newest step 41), replicas 4.0 MiB in 4 slots "
        "of c; buddy b has step 40 (lag 1, 286.1 MiB/s); needs up to 16.0 MiB, 8.0 GiB free")
    assert MemoryTierRow().line("a") == (
        "memory tier a: own 0 B in 0 slots (newest step none), replicas 0 B in 0 slots; buddy "
        "none has step none (lag 0, 0 B/s); needs up to 0 B, 0 B free")


def test_the_row_travels_in_the_status_record_json_and_protobuf():
    record = StatusRecord.of("a", "RUNNING", 3, 0, (), 0, "")
    assert b"memory_tier" not in record.to_json()  # off: the record as before
    on = StatusRecord(**{**record.__dict__, "memory_tier": row()})
    assert StatusRecord.from_json("k/status/a", on.to_json()).memory_tier == row()
    assert StatusRecord.from_pb(on.to_pb("j", 4, "v")).memory_tier == row()
    assert StatusRecord.from_pb(record.to_pb("j", 4, "v")).memory_tier is None


def test_the_metrics_read_the_tier_at_each_scrape():
    from prometheus_client import generate_latest

    from agent.metrics import AgentMetrics

    metrics = AgentMetrics("j", "a")
    current = [MemoryTierRow()]
    metrics.watch_memory_tier(lambda: current[0])
    current[0] = row()
    text = generate_latest(metrics.registry).decode()
    ids = 'job_id="j",node_id="a"'
    assert 'elasticd_memory_tier_bytes{job_id="j",kind="own",node_id="a"} 4.194304e+06' in text
    assert 'elasticd_memory_tier_bytes{job_id="j",kind="replica",node_id="a"} 4.194304e+06' in text
    assert f"elasticd_memory_tier_need_bytes{{{ids}}} 1.6777216e+07" in text
    assert f"elasticd_memory_replication_bytes_per_second{{{ids}}} 3e+08" in text
    assert f"elasticd_memory_replication_lag_steps{{{ids}}} 1.0" in text


def test_a_slot_that_cannot_be_written_is_refused_with_the_reason(receiver, tmp_path):
    receiver.receive(request(begin=True, total_bytes=10))
    slot = tmp_path / "replicas" / "a" / SlotKey(3, 0, 1).name
    memory_tier.remove_slot(str(slot))  # freed meanwhile
    with pytest.raises(InvalidRequestError, match="cannot write slot .*No such file"):
        receiver.receive(request(file=layout.DATA, offset=0, data=b"x"))


def test_the_rack_is_published_only_when_given():
    from elastic.rendezvous.api import NodeInfo

    plain = NodeInfo(node_id="a", host="h", nproc=2, addr="h:1")
    assert b"rack" not in plain.to_json()
    assert b"rack" not in a_round("a", "b").to_json()
    racked = NodeInfo(node_id="a", host="h", nproc=2, addr="h:1", rack="r1")
    assert NodeInfo.from_json("p/nodes/a", racked.to_json()).rack == "r1"
    r = a_round("a", "b")
    r = Round(**{**r.__dict__, "members": tuple(Member(m.node_id, m.node_rank, m.host, m.nproc,
                                                         rack=f"r{m.node_rank}")
                                                  for m in r.members)})
    assert [m.rack for m in Round.from_json("p/round", r.to_json(), 3).members] == ["r0", "r1"]
