"""The memory tier's slot protocol: a slot is complete exactly when its manifest
vouches for its files, and a copier can tell when the writer started over."""

import os

import pytest

from elastic.checkpoint.memory import layout
from elastic.checkpoint.memory.layout import Manifest, SlotKey, TensorItem


def manifest(step=7, round_=3, rank=1, data_bytes=16) -> Manifest:
    item = TensorItem("model.w", "float32", (2, 2), (0, 0), (2, 2), 0, 16)
    return Manifest(job_id="job", node_id="a", round=round_, step=step, rank=rank, world_size=4,
                    files={layout.DATA: data_bytes}, tensors=(item,), objects=("optim.lr",))


def write_slot(memory_dir, key: SlotKey, m: Manifest, payload=b"x" * 16) -> str:
    slot = os.path.join(layout.own_dir(memory_dir), key.name)
    layout.begin_write(slot)
    with open(os.path.join(slot, layout.DATA), "wb") as f:
        f.write(payload)
    layout.finish_write(slot, m)
    return slot


def test_a_written_slot_is_found_with_its_manifest(tmp_path):
    write_slot(str(tmp_path), SlotKey(3, 1, 0), manifest())
    [found] = layout.list_slots(str(tmp_path))
    assert found.key == SlotKey(3, 1, 0) and found.holder == layout.OWN
    assert found.manifest == manifest()


def test_a_slot_being_rewritten_is_not_complete(tmp_path):
    slot = write_slot(str(tmp_path), SlotKey(3, 1, 0), manifest())
    layout.begin_write(slot)  # the writer starts over: the files are about to change
    assert layout.list_slots(str(tmp_path)) == []


def test_a_file_of_the_wrong_size_makes_the_slot_unusable(tmp_path):
    write_slot(str(tmp_path), SlotKey(3, 1, 0), manifest(), payload=b"x" * 15)
    assert layout.list_slots(str(tmp_path)) == []


def test_a_manifest_that_disagrees_with_its_slot_name_is_refused(tmp_path):
    write_slot(str(tmp_path), SlotKey(4, 1, 0), manifest(round_=3))
    assert layout.list_slots(str(tmp_path)) == []


def test_a_copier_sees_that_the_writer_started_over(tmp_path):
    slot = write_slot(str(tmp_path), SlotKey(3, 1, 0), manifest(step=7))
    info = layout.read_slot(slot)
    assert layout.still_same(info)
    layout.begin_write(slot)
    assert not layout.still_same(info)
    layout.finish_write(slot, manifest(step=9))
    assert not layout.still_same(info)  # complete again, but not what was copied


def test_a_template_renders_each_snapshots_manifest_as_the_manifest_would():
    import json

    head = Manifest(job_id="job-1.x", node_id="a", round=3, step=0, rank=1, world_size=4,
                    files={layout.LOCAL: 0, layout.DATA: 0, layout.OBJECTS: 0},
                    tensors=manifest().tensors, objects=("optim.lr", "optim.\u00e9ps"))
    template = layout.ManifestTemplate(head)
    for step, sizes, written_at in [(0, (16, 3, 5), 0.0), (2**40, (16, 0, 1 << 33), 1.7e9 + 0.1)]:
        files = dict(zip((layout.DATA, layout.OBJECTS, layout.LOCAL), sizes))
        whole = Manifest(**{**head.__dict__, "step": step, "files": files,
                            "written_at": written_at})
        record = {"format": layout.FORMAT, "job_id": whole.job_id, "node_id": "a", "round": 3,
                  "step": step, "rank": 1, "world_size": 4, "files": dict(sorted(files.items())),
                  "tensors": [t.to_record() for t in whole.tensors],
                  "objects": list(whole.objects), "written_at": written_at}
        rendered = template.render(step, files, written_at)
        assert rendered == json.dumps(record, separators=(",", ":")).encode() == whole.to_json()
        assert Manifest.from_json(rendered) == whole
    with pytest.raises(ValueError):
        template.render(1, {layout.DATA: 16}, 0.0)


def test_replicas_are_listed_with_their_source(tmp_path):
    slot = os.path.join(layout.replica_dir(str(tmp_path), "b"), SlotKey(3, 2, 1).name)
    layout.begin_write(slot)
    with open(os.path.join(slot, layout.DATA), "wb") as f:
        f.write(b"y" * 16)
    layout.finish_write(slot, manifest(rank=2))
    [found] = layout.list_slots(str(tmp_path))
    assert found.holder == "b" and found.manifest.rank == 2


@pytest.mark.parametrize("damage, message", [
    (lambda r: r.update(format=2), "format"),
    (lambda r: r.update(rank=4), "rank"),
    (lambda r: r.update(files={"../x": 1}), "plain name"),
    (lambda r: r["tensors"][0].update(offset=8), "outside"),
    (lambda r: r["tensors"][0].update(offsets=[1, 1]), "outside the tensor"),
    (lambda r: r.update(node_id="../etc"), "node id"),
])
def test_a_malformed_manifest_is_refused_naming_the_fault(damage, message):
    import json
    record = json.loads(manifest().to_json())
    damage(record)
    with pytest.raises(ValueError, match=message):
        Manifest.from_json(json.dumps(record).encode())


def test_slot_names_round_trip_and_other_names_are_ignored():
    key = SlotKey(12, 345, 1)
    assert layout.parse_slot_name(key.name) == key
    assert layout.parse_slot_name("round-1.rank-2.slot-0") is None
    assert layout.parse_slot_name(key.name + ".tmp") is None


def test_a_listing_without_tensor_items_reads_them_for_the_slot_used_while_unchanged(tmp_path):
    slot = write_slot(str(tmp_path), SlotKey(3, 1, 0), manifest(step=7))
    [listed] = layout.list_slots(str(tmp_path), tensors=False)
    assert listed.manifest.tensors == () and listed.manifest.step == 7
    assert layout.with_tensors(listed).manifest == manifest(step=7)
    layout.begin_write(slot)
    layout.finish_write(slot, manifest(step=9))
    assert layout.with_tensors(listed) is None  # not the manifest that was listed


def test_damaged_tensor_items_are_found_when_the_slot_is_read_in_full(tmp_path):
    bad = manifest()
    bad = Manifest(**{**bad.__dict__, "tensors": (TensorItem("model.w", "float32", (2, 2),
                                                             (0, 0), (2, 2), 8, 16),)})
    write_slot(str(tmp_path), SlotKey(3, 1, 0), bad)  # its bytes lie outside data.bin
    [listed] = layout.list_slots(str(tmp_path), tensors=False)
    assert layout.list_slots(str(tmp_path)) == []
    assert layout.with_tensors(listed) is None
