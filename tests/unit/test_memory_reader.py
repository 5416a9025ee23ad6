"""Restoring from the memory tier through DCP (elastic.checkpoint.memory.reader): slots
written the way a worker writes them, loaded with real ``dcp.load`` calls into state
dicts of another shape (whole from shards, shards from whole, replicated values once),
bitwise equal; the errors for a missing holder and a refused type; which old ranks a
load reads. One process, no process group (the multi-process FSDP2 cases are in
tests/integration/test_memory_reader_reshard.py)."""

from __future__ import annotations

import dataclasses
import io
import mmap
import os

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata  # noqa: E402

from elastic._compat import torch_checkpoint as compat  # noqa: E402
from elastic.checkpoint import dcp_io, trust  # noqa: E402
from elastic.checkpoint.memory import layout  # noqa: E402
from elastic.checkpoint.memory.reader import (  # noqa: E402
    MemoryStorageReader,
    PlannedLoad,
    SlotData,
    choose_holders,
    load_objects,
    needed_ranks,
    put_objects,
    snapshot_metadata,
)
from elastic.checkpoint.memory.slotfile import SlotFile  # noqa: E402
from elastic.errors import CheckpointError  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable")]  # 2.6

# Where data.bin places each tensor: the writer's alignment, so views need no copy.
ALIGN = 64


@dataclasses.dataclass
class Shard:
    """One rank's part of a tensor: ``local`` at ``offsets`` in a ``global_shape`` tensor."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def row_shards(whole: torch.Tensor, world_size: int) -> list[Shard]:
    """``whole`` cut by rows as FSDP2 cuts it (torch.chunk: the last shard may be short)."""
    rows = -(-whole.size(0) // world_size)
    return [Shard(whole[r * rows:(r + 1) * rows].clone(),
                  (min(r * rows, whole.size(0)),) + (0,) * (whole.dim() - 1), tuple(whole.shape))
            for r in range(world_size)]


def _chunk(value) -> Shard:
    """A state-dict value's chunk: a DTensor's local shard, a plain tensor whole."""
    if isinstance(value, Shard):
        return value
    if hasattr(value, "to_local"):
        (meta,) = value.__create_chunk_list__()
        return Shard(value.to_local(), tuple(meta.offsets), tuple(value.shape))
    return Shard(value, (0,) * value.dim(), tuple(value.shape))


def write_slot(rank: int, world_size: int, flat: dict, *, step: int = 7) -> SlotData:
    """One rank's slot as the worker writes it: tensors (plain, DTensor, or a Shard)
    into data.bin, every other value into objects.pt, and a manifest that went
    through its JSON (so it is one the layout accepts)."""
    data = bytearray()
    items, objects = [], {}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor) and not isinstance(value, Shard):
            objects[key] = value
            continue
        chunk = _chunk(value)
        raw = chunk.local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        data += bytes(-len(data) % ALIGN)
        items.append(layout.TensorItem(
            key, str(chunk.local.dtype).removeprefix("torch."), chunk.global_shape,
            chunk.offsets, tuple(chunk.local.shape), len(data), len(raw)))
        data += raw
    objects_bytes = b""
    if objects:
        stream = io.BytesIO()
        torch.save(objects, stream)
        objects_bytes = stream.getvalue()
    manifest = layout.Manifest(
        job_id="job", node_id="node-a", round=3, step=step, rank=rank, world_size=world_size,
        files={layout.DATA: len(data), layout.OBJECTS: len(objects_bytes)},
        tensors=tuple(items), objects=tuple(objects))
    return SlotData(layout.Manifest.from_json(manifest.to_json()), bytes(data), objects_bytes)


def load(state_dict: dict, sources: dict, planner=None) -> None:
    dcp.load(state_dict, storage_reader=MemoryStorageReader(sources), planner=planner,
             **compat.single_process(True))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def absent(slot: SlotData) -> SlotData:
    return dataclasses.replace(slot, data=None, objects=b"")


class RowsOf(torch.Tensor):
    """A whole-sized destination that asks DCP for rows ``[start, stop)`` only, through
    DCP's chunk protocol (``__create_chunk_list__``/``__get_tensor_shard__``, as DTensor
    speaks it): what a shard at another world size asks for, in one process."""

    def __create_chunk_list__(self):
        start, stop = self.rows
        return [ChunkStorageMetadata(offsets=torch.Size([start] + [0] * (self.dim() - 1)),
                                     sizes=torch.Size([stop - start, *self.shape[1:]]))]

    def __get_tensor_shard__(self, index):
        start, stop = self.rows
        return self.as_subclass(torch.Tensor)[start:stop]


def rows_of(whole: torch.Tensor, start: int, stop: int) -> RowsOf:
    destination = whole.as_subclass(RowsOf)
    destination.rows = (start, stop)
    return destination


class PartOf(torch.Tensor):
    """Like :class:`RowsOf`, for any box: ``offsets`` and ``sizes`` in every dimension."""

    def __create_chunk_list__(self):
        return [ChunkStorageMetadata(offsets=torch.Size(self.box[0]),
                                     sizes=torch.Size(self.box[1]))]

    def __get_tensor_shard__(self, index):
        part = self.as_subclass(torch.Tensor)
        for dim, (offset, size) in enumerate(zip(*self.box)):
            part = part.narrow(dim, offset, size)
        return part


def part_of(whole: torch.Tensor, offsets: tuple, sizes: tuple) -> PartOf:
    destination = whole.as_subclass(PartOf)
    destination.box = (offsets, sizes)
    return destination


def on_file(slot: SlotData, path) -> SlotData:
    """``slot`` with its data.bin written to ``path`` and read from there."""
    path.write_bytes(slot.data)
    return dataclasses.replace(slot, data=SlotFile(str(path), len(slot.data)))


class Planted:
    """A type outside the allow-list: unpickling it would run its ``__setstate__``."""

    runs = 0

    def __setstate__(self, state):
        Planted.runs += 1
        self.__dict__.update(state)


def inner_error(excinfo) -> BaseException:
    """What a rank raised inside ``dcp.load`` (DCP wraps every rank's failure)."""
    exc = excinfo.value
    if isinstance(exc, CheckpointException):
        (failure, *_), = exc.failures.values()
        return failure
    return exc


# --- loads into another shape ---------------------------------------------------------------


def test_a_row_sharded_tensor_of_two_ranks_loads_whole_in_one_process():
    torch.manual_seed(0)
    weight = torch.randn(7, 5)
    shards = row_shards(weight, 2)  # rows 0-3 and 4-6
    sources = {r: write_slot(r, 2, {"model.w": shards[r]}) for r in range(2)}
    target = {"model": {"w": torch.zeros(7, 5)}}
    load(target, sources)
    assert same_bits(target["model"]["w"], weight)


def test_a_whole_tensor_loads_as_two_shards_each_narrowed_from_it():
    torch.manual_seed(1)
    weight = torch.randn(9, 4, dtype=torch.float64)
    sources = {0: write_slot(0, 1, {"model.w": weight})}
    for start, stop in ((0, 5), (5, 9)):
        place = torch.zeros(9, 4, dtype=torch.float64)
        load({"model": {"w": rows_of(place, start, stop)}}, sources)
        assert same_bits(place[start:stop], weight[start:stop])
        assert not place[:start].any() and not place[stop:].any()  # only its rows were read


def test_a_shard_spanning_two_old_shards_reads_a_part_of_each():
    torch.manual_seed(2)
    weight = torch.randn(7, 3).to(torch.bfloat16)
    shards = row_shards(weight, 2)  # rows 0-3 and 4-6
    sources = {r: write_slot(r, 2, {"model.w": shards[r]}) for r in range(2)}
    place = torch.zeros(7, 3, dtype=torch.bfloat16)
    load({"model": {"w": rows_of(place, 2, 6)}}, sources)
    assert same_bits(place[2:6], weight[2:6])
    assert not place[:2].any() and not place[6:].any()


def test_replicated_tensors_appear_once_and_load_from_either_rank():
    torch.manual_seed(3)
    bias, step = torch.randn(6), torch.tensor(12.0)
    flat = {"model.b": bias, "optim.state.b.step": step}
    sources = {r: write_slot(r, 2, flat) for r in range(2)}
    metadata = MemoryStorageReader(sources).read_metadata()
    assert len(metadata.state_dict_metadata["model.b"].chunks) == 1
    assert metadata.state_dict_metadata["optim.state.b.step"].size == torch.Size([])
    for present in (0, 1):
        alone = {r: s if r == present else absent(s) for r, s in sources.items()}
        target = {"model": {"b": torch.zeros(6)}, "optim": {"state.b.step": torch.tensor(0.0)}}
        load(target, alone)
        assert same_bits(target["model"]["b"], bias)
        assert same_bits(target["optim"]["state.b.step"], step)


@pytest.mark.parametrize("planner", [None, "restricted"])
def test_optimizer_values_come_back_from_objects_pt(planner):
    """Flattened optimizer keys: tensors from data.bin, python values (a float, an
    int, a tuple, a bool) from objects.pt; through DCP's default planner and through
    the checkpoint's restricted one (elastic.checkpoint.dcp_io.LoadPlanner)."""
    torch.manual_seed(4)
    exp_avg = torch.randn(4, 2)
    betas = (0.9, 0.95)  # one object under two keys, as a parameter group's options are
    values = {"optim.param_groups.w.lr": 0.025, "optim.param_groups.w.betas": betas,
              "optim.param_groups.b.betas": betas, "optim.param_groups.w.amsgrad": False,
              "optim.data_step": 41}
    shards = row_shards(exp_avg, 2)
    sources = {r: write_slot(r, 2, {"optim.state.w.exp_avg": shards[r], **values})
               for r in range(2)}
    target = {"optim": {"state.w.exp_avg": torch.zeros(4, 2), "param_groups.w.lr": 1.0,
                        "param_groups.w.betas": (0.0, 0.0), "param_groups.b.betas": (0.0, 0.0),
                        "param_groups.w.amsgrad": True,
                        "data_step": 0}}
    load(target, sources, planner=dcp_io.LoadPlanner() if planner else None)
    assert same_bits(target["optim"]["state.w.exp_avg"], exp_avg)
    assert {f"optim.{k}": v for k, v in target["optim"].items() if k != "state.w.exp_avg"} \
        == values


def test_data_may_be_an_mmap_or_a_mapped_tensor_read_only_and_unaligned(tmp_path):
    """The buffers a worker maps: a read-only mmap of data.bin and a tensor from
    torch.from_file; and a data.bin whose tensors do not sit at multiples of their
    element size (every item shifted by one byte) still loads bitwise."""
    torch.manual_seed(5)
    weight = torch.randn(5, 3)
    slot = write_slot(0, 1, {"model.w": weight})
    path = tmp_path / layout.DATA
    path.write_bytes(slot.data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        mapped_tensor = torch.from_file(str(path), shared=False, size=len(slot.data),
                                        dtype=torch.uint8)
        for data in (mapped, mapped_tensor):
            target = {"model": {"w": torch.zeros(5, 3)}}
            load(target, {0: dataclasses.replace(slot, data=data)})
            assert same_bits(target["model"]["w"], weight)
    (item,) = slot.manifest.tensors
    shifted_manifest = dataclasses.replace(
        slot.manifest, files={layout.DATA: len(slot.data) + 1},
        tensors=(dataclasses.replace(item, offset=item.offset + 1),))
    shifted = SlotData(shifted_manifest, b"\0" + slot.data)
    target = {"model": {"w": torch.zeros(5, 3)}}
    load(target, {0: shifted})
    assert same_bits(target["model"]["w"], weight)


@pytest.mark.parametrize("offsets, sizes, read_calls", [
    ((2, 0, 0), (4, 3, 2), 2),  # rows: one range of each old shard's file, read into place
    ((0, 1, 0), (6, 2, 2), 0),  # columns: apart in the file, copied from its mapping
    ((3, 2, 1), (1, 1, 1), 1),  # one element
    ((0, 0, 0), (6, 3, 2), 2),  # whole
])
def test_slot_files_load_like_their_bytes_whatever_part_is_asked(tmp_path, monkeypatch,
                                                                 offsets, sizes, read_calls):
    torch.manual_seed(6)
    weight = torch.randn(6, 3, 2)
    slots = {r: write_slot(r, 2, {"model.w": shard, "optim.lr": 0.5})
             for r, shard in enumerate(row_shards(weight, 2))}
    files = {r: on_file(slot, tmp_path / f"data-{r}.bin") for r, slot in slots.items()}
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *args: calls.append(1) or real_preadv(*args))
    loaded = []
    for sources in (slots, files):
        place = torch.zeros(6, 3, 2)
        target = {"model": {"w": part_of(place, offsets, sizes)}, "optim": {"lr": 1.0}}
        load(target, sources)
        loaded.append(place)
        assert target["optim"]["lr"] == 0.5
    box = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
    assert same_bits(loaded[1], loaded[0]) and same_bits(loaded[1][box], weight[box])
    assert len(calls) == read_calls


def test_a_planned_load_reads_every_old_ranks_file_with_the_threads_it_is_given(
        tmp_path, preadv_meeting):
    """A 16 MiB weight saved as 2 row shards, loaded whole by 2 threads: the two
    files' bytes arrive bitwise, and two reads run at once (the first two meet at
    a barrier that one thread alone would never pass)."""
    import threading

    torch.manual_seed(8)
    weight = torch.randn(1024, 4096)
    slots = {r: on_file(write_slot(r, 2, {"model.w": shard}), tmp_path / f"data-{r}.bin")
             for r, shard in enumerate(row_shards(weight, 2))}
    calls = preadv_meeting(2)
    place = torch.zeros(1024, 4096)
    planned = PlannedLoad({"model": {"w": place}}, {r: s.manifest for r, s in slots.items()},
                          dcp_io.LoadPlanner())
    planned.run(slots, threads=2)
    assert same_bits(place, weight)
    assert len(set(calls[:2])) == 2 and threading.get_ident() not in calls


def test_a_planned_load_names_its_ranks_then_loads_by_that_plan_and_hands_back_objects(tmp_path):
    """The plan that says which old ranks to fetch is the one the load reads by:
    the absent ranks stay absent; the objects come back for the caller to set."""
    torch.manual_seed(7)
    weight = torch.randn(8, 2)
    slots = {r: on_file(write_slot(r, 4, {"model.w": shard, "optim.param_groups.w.lr": 0.1}),
                        tmp_path / f"data-{r}.bin")
             for r, shard in enumerate(row_shards(weight, 4))}
    place = torch.zeros(8, 2)
    target = {"model": {"w": rows_of(place, 4, 8)}, "optim": {"param_groups.w.lr": 1.0}}
    planned = PlannedLoad(target, {r: s.manifest for r, s in slots.items()},
                          dcp_io.LoadPlanner())
    assert planned.ranks(prefer={0}) == {0, 2, 3}  # rows 4-7: old ranks 2 and 3; lr: rank 0
    sources = {r: s if r in {0, 2, 3} else absent(s) for r, s in slots.items()}
    objects = planned.run(sources)
    assert objects == {"optim.param_groups.w.lr": 0.1}
    assert target["optim"]["param_groups.w.lr"] == 1.0  # left to the caller
    put_objects(target, objects)
    assert target["optim"]["param_groups.w.lr"] == 0.1
    assert same_bits(place[4:], weight[4:]) and not place[:4].any()


# --- errors -----------------------------------------------------------------------------------


def test_a_chunk_whose_holders_are_all_absent_names_its_key_and_their_ranks():
    weight = torch.arange(14.0).reshape(7, 2)
    shards = row_shards(weight, 2)
    sources = {0: write_slot(0, 2, {"model.w": shards[0]}),
               1: absent(write_slot(1, 2, {"model.w": shards[1]}))}
    with pytest.raises((CheckpointException, CheckpointError)) as excinfo:
        load({"model": {"w": torch.zeros(7, 2)}}, sources)
    error = inner_error(excinfo)
    assert isinstance(error, CheckpointError)
    assert "'model.w'" in str(error) and "(4, 0)" in str(error)
    assert "old rank(s) 1," in str(error)


def test_an_object_outside_the_allow_list_is_refused_by_name_and_never_built():
    planted = Planted()
    planted.payload = "anything"
    slot = write_slot(0, 1, {"optim.param_groups.w.extra": planted})
    Planted.runs = 0
    with pytest.raises((CheckpointException, CheckpointError)) as excinfo:
        load({"optim": {"param_groups.w.extra": None}}, {0: slot})
    error = inner_error(excinfo)
    assert isinstance(error, CheckpointError)
    assert f"{__name__}.Planted" in str(error)
    assert Planted.runs == 0
    with pytest.raises(CheckpointError, match="Planted"):
        load_objects(slot.objects)
    allowed = load_objects(slot.objects, trust.LoadPolicy(safe_globals=[Planted]))
    assert allowed["optim.param_groups.w.extra"].payload == "anything"


@pytest.mark.parametrize("value", [0.001, (0.9, 0.999), None, -0.0, b"\x00\xff", {1, 2}])
def test_objects_pt_is_read_without_torch_load_unless_a_tensor_is_in_it(value, monkeypatch):
    plain = compat.save_unzipped({"optim.x": value})  # as the writer writes objects.pt
    with_tensor = compat.save_unzipped({"optim.x": value, "optim.t": torch.ones(2)})
    real, calls = torch.load, []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    loaded = load_objects(plain)
    assert repr(loaded) == repr({"optim.x": value}) and calls == []
    loaded = load_objects(with_tensor)
    assert repr(loaded["optim.x"]) == repr(value) and torch.equal(loaded["optim.t"], torch.ones(2))
    assert [call["weights_only"] for call in calls] == [True]


def test_objects_pt_that_is_not_a_dict_and_data_shorter_than_its_manifest_are_refused():
    stream = io.BytesIO()
    torch.save([0.1, 0.2], stream)
    with pytest.raises(CheckpointError, match="holds a list, not a dict"):
        load_objects(stream.getvalue())
    slot = write_slot(0, 1, {"model.w": torch.ones(4, 4)})
    cut = dataclasses.replace(slot, data=slot.data[:-1])
    with pytest.raises((CheckpointException, CheckpointError)) as excinfo:
        load({"model": {"w": torch.zeros(4, 4)}}, {0: cut})
    assert "has 63 bytes, its manifest lists 64" in str(inner_error(excinfo))


def test_manifests_that_are_not_one_snapshot_are_refused():
    weight = torch.zeros(4, 2)
    shards = row_shards(weight, 2)
    zero, one = (write_slot(r, 2, {"model.w": shards[r]}) for r in range(2))
    later = write_slot(1, 2, {"model.w": shards[1]}, step=8)
    with pytest.raises(CheckpointError, match="rank 1 .* step 8|not one snapshot"):
        snapshot_metadata({0: zero.manifest, 1: later.manifest})
    with pytest.raises(CheckpointError, match=r"lacks the manifests of rank\(s\) 1 of 2"):
        snapshot_metadata({0: zero.manifest})
    other_dtype = write_slot(1, 2, {"model.w": Shard(shards[1].local.double(), (2, 0), (4, 2))})
    with pytest.raises(CheckpointError, match="disagree on tensor 'model.w'"):
        snapshot_metadata({0: zero.manifest, 1: other_dtype.manifest})
    assert snapshot_metadata({0: zero.manifest, 1: one.manifest}).state_dict_metadata


# --- which old ranks a load reads -------------------------------------------------------------


def _snapshot_of_two_ranks():
    """Old world of 2: a weight of 7 rows split 4 + 3, a bias and an lr on both."""
    weight = torch.arange(21.0).reshape(7, 3)
    shards = row_shards(weight, 2)
    return {r: write_slot(r, 2, {"model.w": shards[r], "model.b": torch.ones(3),
                                 "optim.param_groups.w.lr": 0.1}).manifest
            for r in range(2)}


def _state(weight) -> dict:
    return {"model": {"w": weight, "b": torch.zeros(3)}, "optim": {"param_groups.w.lr": 0.0}}


def test_needed_ranks_at_the_same_world_size_is_the_rank_itself():
    manifests = _snapshot_of_two_ranks()
    for rank, (start, stop) in enumerate(((0, 4), (4, 7))):
        state_dict = _state(rows_of(torch.zeros(7, 3), start, stop))
        assert needed_ranks(state_dict, manifests, prefer={rank}) == {rank}
        assert needed_ranks(state_dict, manifests) == {rank}  # the fewest ranks


def test_needed_ranks_when_scaling_down_is_every_old_rank():
    assert needed_ranks(_state(torch.zeros(7, 3)), _snapshot_of_two_ranks(), prefer={0}) == {0, 1}


def test_needed_ranks_when_scaling_up_is_the_old_ranks_under_the_new_shard():
    manifests = _snapshot_of_two_ranks()
    new_shards = {0: (0, 3), 1: (3, 6), 2: (6, 7)}  # 7 rows over 3 ranks
    found = {new: needed_ranks(_state(rows_of(torch.zeros(7, 3), *rows)), manifests)
             for new, rows in new_shards.items()}
    assert found == {0: {0}, 1: {0, 1}, 2: {1}}
    # New rank 2 holds old rank 0's slot locally: the replicated values come from it.
    assert needed_ranks(_state(rows_of(torch.zeros(7, 3), 6, 7)), manifests,
                        prefer={0}) == {0, 1}


def test_needed_ranks_for_a_key_the_snapshot_lacks_is_a_checkpoint_error():
    state_dict = _state(torch.zeros(7, 3))
    state_dict["model"]["extra"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="extra"):
        needed_ranks(state_dict, _snapshot_of_two_ranks())


def test_choose_holders_prefers_the_given_ranks_then_the_fewest():
    assert choose_holders([{0, 1}, {1, 2}, {2}], prefer={0}) == {0, 2}
    assert choose_holders([{0, 1}, {1, 2}, {1}]) == {1}
    assert choose_holders([{3}, {2}, {2, 3}]) == {2, 3}
    assert choose_holders([]) == set()
    with pytest.raises(ValueError):
        choose_holders([set()])


def test_a_reader_keeps_no_view_of_a_mapping_after_a_load(tmp_path):
    """The slot's mapping can be closed (or the slot rewritten) once a load is done,
    while the reader itself lives on for the next load."""
    weight = torch.arange(6.0).reshape(3, 2)
    slot = write_slot(0, 1, {"model.w": weight})
    path = tmp_path / layout.DATA
    path.write_bytes(slot.data)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    reader = MemoryStorageReader({0: dataclasses.replace(slot, data=mapped)})
    target = {"model": {"w": torch.zeros(3, 2)}}
    dcp.load(target, storage_reader=reader, **compat.single_process(True))
    mapped.close()  # BufferError while a view of it is still exported
    assert same_bits(target["model"]["w"], weight) and mapped.closed
