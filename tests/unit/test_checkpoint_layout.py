"""Checkpoint layout, manifests, verification, the restore rule, retention, the file
commit log and failpoints: no torch, no processes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import subprocess
import sys
import time
import zlib

import pytest

from elastic import failpoints
from elastic.checkpoint import layout
from elastic.checkpoint.api import CommitEntry
from elastic.checkpoint.commit import FileCommitLog
from elastic.errors import CheckpointError, FencedError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def entry(step: int, round_: int = 0, world_size: int = 2) -> CommitEntry:
    return CommitEntry(step=step, round=round_, world_size=world_size,
                       path=layout.step_dir_name(step), time=1000.0 + step)


def make_checkpoint(root, step: int, world_size: int = 2, *, marked: bool = True,
                    files_per_rank: int = 2) -> str:
    """A directory shaped like a real checkpoint: fake shard files, real manifests."""
    directory = os.path.join(str(root), layout.step_dir_name(step))
    os.makedirs(directory)
    for rank in range(world_size):
        names = [f"__{rank}_{i}.distcp" for i in range(files_per_rank)]
        names.append(layout.rank_state_name(rank))
        if rank == 0:
            names.append(layout.METADATA_FILE)
        for index, name in enumerate(names):
            with open(os.path.join(directory, name), "wb") as f:
                f.write(bytes([rank, step % 256, index]) * (100 + 37 * index))
        layout.write_manifest(directory, layout.Manifest(
            rank=rank, world_size=world_size, step=step, round=0,
            files={n: layout.file_digest(os.path.join(directory, n)) for n in names}))
    if marked:
        layout.write_marker(directory, entry(step, world_size=world_size))
    return directory


# --- names --------------------------------------------------------------------------------------


def test_names_round_trip_and_sort_by_step():
    assert layout.step_dir_name(42) == "step-000000000042"
    assert layout.parse_step_dir("step-000000000042") == 42
    assert layout.parse_step_dir("step-42") is None
    assert layout.parse_step_dir(".tmp-step-42-round-1") is None
    assert layout.tmp_dir_name(42, 3) == ".tmp-step-42-round-3"
    assert layout.parse_tmp_dir(".tmp-step-42-round-3") == (42, 3)
    assert layout.parse_tmp_dir("step-000000000042") is None
    names = [layout.step_dir_name(s) for s in (100, 9, 1000)]
    assert sorted(names) == [layout.step_dir_name(s) for s in (9, 100, 1000)]


def test_commit_entry_round_trip_and_rejects_garbage():
    e = entry(7, round_=3)
    assert CommitEntry.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    for bad in ({}, [], {"step": "7", "round": 0, "world_size": 1, "path": "x", "time": 0},
                dict(e.to_dict(), path="../elsewhere"), dict(e.to_dict(), step=-1)):
        with pytest.raises(CheckpointError):
            CommitEntry.from_dict(bad)


# --- verification -------------------------------------------------------------------------------


def test_complete_checkpoint_verifies(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    assert layout.verify(directory) == []
    assert layout.verify(directory, checksums=False) == []


def test_digest_is_size_and_crc32(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"123456789")
    assert layout.file_digest(str(path)) == layout.FileDigest(size=9, crc32="cbf43926")


def test_truncated_shard_is_named(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    shard = os.path.join(directory, "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(10)
    problems = layout.verify(directory, checksums=False)
    assert [p.path for p in problems] == [shard]
    assert "truncated" in str(problems[0]) and shard in str(problems[0])


def test_bit_flip_is_caught_by_checksum_only(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    shard = os.path.join(directory, "__0_1.distcp")
    with open(shard, "r+b") as f:
        f.seek(50)
        byte = f.read(1)[0]
        f.seek(50)
        f.write(bytes([byte ^ 0x10]))
    assert layout.verify(directory, checksums=False) == []
    problems = layout.verify(directory)
    assert [p.path for p in problems] == [shard]
    assert "CRC-32" in problems[0].reason


# --- item CRC-32s -----------------------------------------------------------------------------


def itemize(directory: str, rank: int, name: str, cuts: list[int]) -> list[layout.ItemDigest]:
    """Give ``name`` in ``rank``'s manifest items split at ``cuts`` (as a save does)."""
    with open(os.path.join(directory, name), "rb") as f:
        data = f.read()
    bounds = [0, *cuts, len(data)]
    items = [layout.ItemDigest(a, b - a, f"{zlib.crc32(data[a:b]):08x}")
             for a, b in zip(bounds, bounds[1:])]
    path = os.path.join(directory, layout.manifest_name(rank))
    manifest = layout.Manifest.from_json(open(path, "rb").read())
    files = dict(manifest.files)
    files[name] = layout.FileDigest(len(data), f"{zlib.crc32(data):08x}", tuple(items))
    layout.write_manifest(directory, dataclasses.replace(manifest, files=files))
    return items


def edit_items(directory: str, rank: int, name: str, edit) -> None:
    path = os.path.join(directory, layout.manifest_name(rank))
    record = json.loads(open(path).read())
    edit(record["files"][name])
    open(path, "w").write(json.dumps(record))


def test_crc32_combine_matches_zlib():
    rng = random.Random(7)
    for _ in range(200):
        a = rng.randbytes(rng.randrange(0, 3000))
        b = rng.randbytes(rng.choice([0, 1, rng.randrange(0, 70_000)]))
        assert layout.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert layout.crc32(b"123456789") == 0xCBF43926  # whichever implementation is installed


def test_items_round_trip_and_manifests_without_items_stay_valid(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    manifests, problems = layout.read_manifests(directory)
    assert problems == [] and all(d.items is None for m in manifests for d in m.files.values())
    items = itemize(directory, 0, "__0_1.distcp", [10, 100])
    manifests, problems = layout.read_manifests(directory)
    assert problems == [] and manifests[0].files["__0_1.distcp"].items == tuple(items)
    assert layout.combined_crc32(items) == manifests[0].files["__0_1.distcp"].crc32
    assert layout.verify(directory) == []


@pytest.mark.parametrize("edit, reason", [
    (lambda d: d["items"][1].__setitem__(2, "00000000"), "combine to"),
    (lambda d: d["items"][1].__setitem__(0, 11), "where one at byte 10 was expected"),
    (lambda d: d["items"].pop(), "items end at byte 100"),
])
def test_items_that_contradict_their_file_are_named(tmp_path, edit, reason):
    directory = make_checkpoint(tmp_path, 5)
    itemize(directory, 0, "__0_1.distcp", [10, 100])
    edit_items(directory, 0, "__0_1.distcp", edit)
    problems = layout.verify(directory, checksums=False)
    assert [p.path for p in problems] == [os.path.join(directory, "__0_1.distcp")]
    assert reason in problems[0].reason


@pytest.mark.parametrize("items", ["x", [[0, 5]], [[0, -1, "00000000"]], [[0, 5, "zz"]],
                                   [[0.0, 5, "00000000"]]])
def test_malformed_items_make_the_manifest_unreadable(tmp_path, items):
    directory = make_checkpoint(tmp_path, 5)
    edit_items(directory, 0, "__0_1.distcp", lambda d: d.__setitem__("items", items))
    _, problems = layout.read_manifests(directory)
    assert "unreadable manifest" in problems[0].reason, problems


def test_bytes_are_checked_against_a_digest(tmp_path):
    digest = layout.bytes_digest(b"123456789")
    assert digest == layout.FileDigest(size=9, crc32="cbf43926")
    assert layout.check_bytes("f", b"123456789", digest) is None
    assert "truncated" in layout.check_bytes("f", b"12345678", digest).reason
    assert "corrupt: CRC-32" in layout.check_bytes("f", b"123456780", digest).reason
    assert layout.is_shard_file("__0_0.distcp")
    assert not layout.is_shard_file(layout.METADATA_FILE)
    assert not layout.is_shard_file(layout.rank_state_name(3))


def test_missing_metadata_shard_and_manifest(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    os.unlink(os.path.join(directory, layout.METADATA_FILE))
    os.unlink(os.path.join(directory, "__1_1.distcp"))
    reasons = {os.path.basename(p.path): p.reason for p in layout.verify(directory)}
    assert reasons == {layout.METADATA_FILE: "missing", "__1_1.distcp": "missing"}

    os.unlink(os.path.join(directory, layout.manifest_name(1)))
    problems = layout.verify(directory)
    assert any(p.path.endswith(layout.manifest_name(1)) and "missing" in p.reason for p in problems)


def test_metadata_must_be_listed(tmp_path):
    directory = make_checkpoint(tmp_path, 5, world_size=1)
    manifest_path = os.path.join(directory, layout.manifest_name(0))
    record = json.loads(open(manifest_path).read())
    del record["files"][layout.METADATA_FILE]
    open(manifest_path, "w").write(json.dumps(record))
    assert any("not listed" in p.reason for p in layout.verify(directory))


def test_unreadable_or_inconsistent_manifests(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    with open(os.path.join(directory, layout.manifest_name(1)), "w") as f:
        f.write("{not json")
    problems = layout.verify(directory)
    assert any("unreadable manifest" in p.reason for p in problems)

    other = make_checkpoint(tmp_path, 6)
    path = os.path.join(other, layout.manifest_name(1))
    record = json.loads(open(path).read())
    record["world_size"] = 3
    open(path, "w").write(json.dumps(record))
    assert any("world size 3" in p.reason for p in layout.verify(other))


def test_missing_directory_and_no_manifest(tmp_path):
    assert "does not exist" in layout.verify(str(tmp_path / "nope"))[0].reason
    (tmp_path / "empty").mkdir()
    assert "no manifest" in layout.verify(str(tmp_path / "empty"))[0].reason


def test_parts_cover_every_file_exactly_once(tmp_path):
    directory = make_checkpoint(tmp_path, 5, world_size=3, files_per_rank=3)
    for name in os.listdir(directory):
        if name.endswith(".distcp") or name.endswith(".pt") or name == layout.METADATA_FILE:
            with open(os.path.join(directory, name), "ab") as f:
                f.write(b"x")  # every file now has a wrong size
    listed = [n for n in os.listdir(directory) if not n.startswith("manifest") and n != "COMMITTED"]
    for parts in (1, 2, 3, 4):
        found = [p.path for part in range(parts)
                 for p in layout.verify(directory, checksums=False, part=part, parts=parts)]
        assert sorted(os.path.basename(p) for p in found) == sorted(listed)


# --- markers and the restore rule -----------------------------------------------------------------


def test_marker_round_trip_and_damage(tmp_path):
    directory = make_checkpoint(tmp_path, 5)
    assert layout.read_marker(directory) == entry(5)
    with open(os.path.join(directory, layout.MARKER_FILE), "w") as f:
        f.write("{")
    assert layout.read_marker(directory) is None
    assert layout.list_checkpoints(str(tmp_path)) == [
        layout.CheckpointDir(5, layout.step_dir_name(5), marked=False)]


def test_directory_round_is_the_newest_round_that_wrote_into_it(tmp_path):
    directory = make_checkpoint(tmp_path, 5, marked=False)
    assert layout.directory_round(directory) == 0  # the manifests' round
    layout.write_marker(directory, entry(5, round_=4))
    assert layout.directory_round(directory) == 4  # a newer round committed it
    (tmp_path / "empty").mkdir()
    assert layout.directory_round(str(tmp_path / "empty")) is None


def dirs(*specs):
    return [layout.CheckpointDir(step, layout.step_dir_name(step), marked)
            for step, marked in specs]


def test_candidates_latest_first_then_older_marked():
    found = dirs((1, True), (2, False), (3, True), (4, True), (5, True), (6, False))
    names = layout.restore_candidates(found, entry(4))
    assert names == [layout.step_dir_name(s) for s in (4, 3, 1)]


def test_candidates_never_newer_than_latest_even_if_marked():
    # e.g. a commit log that went back to step 2 after a fallback restore
    found = dirs((1, True), (2, True), (3, True))
    assert layout.restore_candidates(found, entry(2)) == [layout.step_dir_name(s) for s in (2, 1)]


def test_candidates_latest_without_marker_and_without_log():
    found = dirs((1, True), (2, False))
    assert layout.restore_candidates(found, entry(2)) == [layout.step_dir_name(s) for s in (2, 1)]
    assert layout.restore_candidates(found, None) == [layout.step_dir_name(1)]
    assert layout.restore_candidates([], None) == []
    # the log names a directory that is gone: still first, so verification reports it
    assert layout.restore_candidates(dirs((1, True)), entry(3))[0] == layout.step_dir_name(3)


# --- retention and stale temporaries --------------------------------------------------------------


def test_retention_keeps_last_k_and_the_latest():
    found = dirs((1, True), (2, True), (3, True), (4, True), (5, True))
    assert layout.retention_victims(found, 3, entry(5)) == [layout.step_dir_name(s) for s in (1, 2)]
    assert layout.retention_victims(found, 1, entry(5)) == [
        layout.step_dir_name(s) for s in (1, 2, 3, 4)]
    # the latest is kept even when newer marked directories exist
    assert layout.step_dir_name(2) not in layout.retention_victims(found, 1, entry(2))


def test_retention_protects_and_handles_unmarked():
    found = dirs((1, True), (2, False), (3, True), (4, True), (5, False), (6, True), (7, False))
    victims = layout.retention_victims(found, 2, entry(6), protect=[layout.step_dir_name(1)])
    # Kept: 4 and 6 (the newest two committed) and 1 (protected, e.g. being loaded). Nothing
    # is older than the oldest kept (1), so only the unmarked directory newer than the
    # latest (7: a crashed or fenced save) goes.
    assert victims == [layout.step_dir_name(7)]
    victims = layout.retention_victims(found, 2, entry(6))
    assert victims == [layout.step_dir_name(s) for s in (1, 2, 3, 7)]
    # an unmarked latest (crash between log and marker) counts as committed and is kept
    found = dirs((1, True), (2, True), (3, False))
    assert layout.retention_victims(found, 1, entry(3)) == [layout.step_dir_name(s) for s in (1, 2)]
    with pytest.raises(ValueError):
        layout.retention_victims(found, 0, entry(3))


def test_retention_does_not_count_unusable_checkpoints():
    # 2 failed verification at restore; the job resumed from 1 and committed 3 and 4
    found = dirs((1, True), (2, True), (3, True), (4, True))
    assert layout.retention_victims(found, 3, entry(4)) == [layout.step_dir_name(1)]
    assert layout.retention_victims(found, 3, entry(4), unusable=[layout.step_dir_name(2)]) == []
    assert layout.retention_victims(found, 2, entry(4), unusable=[layout.step_dir_name(2)]) == [
        layout.step_dir_name(s) for s in (1, 2)]


def test_stale_temporaries():
    names = [".tmp-step-5-round-2", ".tmp-step-10-round-2", ".tmp-step-12-round-2",
             ".tmp-step-20-round-1", ".tmp-step-3-round-3", ".trash-step-000000000001-ab",
             "step-000000000004", "latest"]
    stale = layout.stale_temporaries(names, step=10, round_=2)
    assert stale == sorted([".tmp-step-5-round-2", ".tmp-step-10-round-2", ".tmp-step-20-round-1",
                            ".trash-step-000000000001-ab"])


# --- durable writes and the file commit log ---------------------------------------------------


def test_write_atomically_replaces(tmp_path):
    path = str(tmp_path / "f")
    layout.write_atomically(path, b"one")
    layout.write_atomically(path, b"two")
    assert open(path, "rb").read() == b"two"
    assert os.listdir(tmp_path) == ["f"]


def test_file_commit_log(tmp_path):
    commit_log = FileCommitLog(str(tmp_path))
    assert commit_log.latest() is None
    commit_log.commit(entry(1, round_=2))
    commit_log.commit(entry(2, round_=2))
    assert commit_log.latest() == entry(2, round_=2)
    assert FileCommitLog(str(tmp_path)).latest() == entry(2, round_=2)
    commit_log.commit(entry(1, round_=3))  # a newer round may go back (a fallback restore)
    assert commit_log.latest() == entry(1, round_=3)
    with pytest.raises(FencedError, match="round 2"):
        commit_log.commit(entry(9, round_=2))
    assert commit_log.latest() == entry(1, round_=3)
    assert sorted(os.listdir(tmp_path)) == ["latest"]


def test_file_commit_log_damaged_reads_as_empty(tmp_path, caplog):
    (tmp_path / "latest").write_text("{garbage")
    assert FileCommitLog(str(tmp_path)).latest() is None
    assert "unreadable" in caplog.text


# --- failpoints -----------------------------------------------------------------------------------


def test_failpoint_idle_and_actions(monkeypatch):
    monkeypatch.delenv(failpoints.ENV_VAR, raising=False)
    failpoints.failpoint("ckpt.write")  # nothing armed: nothing happens
    monkeypatch.setenv(failpoints.ENV_VAR, "other, ckpt.write=oserror:ENOSPC")
    with pytest.raises(OSError) as info:
        failpoints.failpoint("ckpt.write")
    assert info.value.errno == errno.ENOSPC
    failpoints.failpoint("ckpt.mid_write")  # not armed

    monkeypatch.setenv(failpoints.ENV_VAR, "ckpt.write@1=oserror:EIO")
    monkeypatch.setenv("RANK", "0")
    failpoints.failpoint("ckpt.write")  # armed for rank 1 only
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(OSError):
        failpoints.failpoint("ckpt.write")

    monkeypatch.setenv(failpoints.ENV_VAR, "ckpt.write=sleep:0.05")
    started = time.monotonic()
    failpoints.failpoint("ckpt.write")
    assert time.monotonic() - started >= 0.05


@pytest.mark.parametrize("spec", ["x=explode", "x=oserror:ENOTANERRNO", "@1", "x@r",
                                  "x=sleep:soon"])
def test_failpoint_rejects_bad_specs(monkeypatch, spec):
    monkeypatch.setenv(failpoints.ENV_VAR, spec)
    with pytest.raises(ValueError):
        failpoints.failpoint("x")


def test_failpoint_exit_crashes_the_process():
    code = "from elastic.failpoints import failpoint; failpoint('a'); failpoint('b'); print('no')"
    env = dict(os.environ, ELASTIC_FAILPOINT="b=exit:7", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 7
    assert proc.stdout == ""
    assert "elastic failpoint b: exit:7" in proc.stderr


def test_control_plane_imports_without_torch():
    code = ("import sys, elastic.checkpoint, elastic.checkpoint.layout, elastic.checkpoint.commit, "
            "elastic.checkpoint.etcd_log; print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_split_by_bytes_balances_and_covers_every_file_once():
    digest = layout.FileDigest
    files = [("a", digest(100, "0")), ("b", digest(90, "0")), ("c", digest(10, "0")),
             ("d", digest(5, "0")), ("e", digest(5, "0"))]
    shares = layout.split_by_bytes(files, 2)
    assert sorted(f for share in shares for f in share) == sorted(files)
    assert [sum(d.size for _, d in share) for share in shares] == [105, 105]
    # the same split whatever the input order (every rank computes it alone)
    assert layout.split_by_bytes(list(reversed(files)), 2) == shares
    assert layout.split_by_bytes(files, 7)[5:] == [[], []]


def test_a_foreign_failure_is_reported_with_its_type():
    # A torch error whose whole message is "<class 'type'>" said nothing.
    pytest.importorskip("torch")
    from elastic.checkpoint.failures import describe_failure

    assert describe_failure(TypeError("<class 'type'>")) == "TypeError: <class 'type'>"
    assert describe_failure(RuntimeError("")) == "RuntimeError"
    assert describe_failure(CheckpointError("2 tensors changed\nmore")) == "2 tensors changed"
