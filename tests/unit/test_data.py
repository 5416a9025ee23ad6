"""ElasticSampler and SyntheticDataset: ranks are simulated by one sampler per (rank, world)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from elastic.data import ElasticSampler, SyntheticDataset
from elastic.errors import ConfigError


def ranks(world, num_samples=50, global_batch=12, **kwargs):
    return [ElasticSampler(num_samples, global_batch, rank=r, world_size=world, **kwargs)
            for r in range(world)]


def take(samplers, steps=None):
    """Per step, the list of every rank's micro-batches: ``[step][rank][micro] -> indices``.

    Takes ``steps`` steps from each rank (the rest of the epoch when None).
    """
    per_rank = [list(itertools.islice(iter(s), steps)) for s in samplers]
    assert len({len(r) for r in per_rank}) == 1, "ranks disagree on the number of steps"
    return [list(step) for step in zip(*per_rank)]


def flat(step):
    """All indices of one step, over every rank and micro-batch."""
    return [i for rank_batches in step for micro in rank_batches for i in micro]


def reference_global_batches(num_samples, global_batch, **kwargs):
    """The global batches of an uninterrupted single-rank run of one epoch, as sets."""
    (sampler,) = ranks(1, num_samples, global_batch, **kwargs)
    return [set(flat(step)) for step in take([sampler])]


def resumed(samplers, world, **kwargs):
    """New samplers at ``world`` resuming from rank 0's state, through JSON like a checkpoint."""
    state = json.loads(json.dumps(samplers[0].state_dict()))
    assert all(s.state_dict() == samplers[0].state_dict() for s in samplers)
    fresh = ranks(world, **kwargs)
    for s in fresh:
        s.load_state_dict(state)
    return fresh


class TestCoverage:
    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_every_sample_once_per_epoch_minus_the_dropped_tail(self, world):
        samplers = ranks(world, num_samples=50, global_batch=12)
        steps = take(samplers)
        seen = [i for step in steps for i in flat(step)]
        assert len(steps) == samplers[0].steps_per_epoch == 4
        assert len(seen) == len(set(seen)) == 48
        order = torch.randperm(50, generator=torch.Generator().manual_seed(0)).tolist()
        assert set(seen) == set(order[:48])  # drop_last: the 2 last of the order are skipped

    @pytest.mark.parametrize("world", [1, 2, 3, 4])
    def test_the_ranks_of_a_step_make_up_the_same_global_batch(self, world):
        steps = take(ranks(world, num_samples=50, global_batch=12, micro_batch_size=1))
        assert [set(flat(step)) for step in steps] == reference_global_batches(50, 12)
        for step in steps:
            for rank_batches in step:
                assert len(rank_batches) == 12 // world
                assert all(len(micro) == 1 for micro in rank_batches)

    def test_default_micro_batch_means_no_accumulation_at_the_starting_world(self):
        sampler = ElasticSampler(48, 12, rank=1, world_size=3)
        assert (sampler.micro_batch_size, sampler.accumulation_steps) == (4, 1)
        assert [len(micro) for micro in next(iter(sampler))] == [4]

    def test_rank_r_takes_the_r_th_contiguous_share(self):
        samplers = ranks(2, num_samples=16, global_batch=8, shuffle=False, micro_batch_size=2)
        step = take(samplers, 1)[0]
        assert step == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


class TestResume:
    def test_same_world_resumes_on_exactly_the_same_batches(self):
        kwargs = dict(num_samples=100, global_batch=8, micro_batch_size=2)
        uninterrupted = take(ranks(2, **kwargs))
        first = ranks(2, **kwargs)
        before = take(first, 5)
        after = take(resumed(first, 2, **kwargs))
        assert before + after == uninterrupted

    @pytest.mark.parametrize("old_world,new_world", [(4, 2), (4, 3), (2, 4)])
    def test_other_world_covers_the_rest_once_with_the_same_global_batches(self, old_world,
                                                                         new_world):
        kwargs = dict(num_samples=200, global_batch=24, micro_batch_size=2)
        reference = reference_global_batches(200, 24)
        first = ranks(old_world, **kwargs)
        before = take(first, 3)
        second = resumed(first, new_world, **kwargs)
        assert second[0].accumulation_steps == 24 // (new_world * 2)
        after = take(second)
        assert [set(flat(step)) for step in before + after] == reference
        for step in after:
            assert len(step) == new_world
            for rank_batches in step:
                assert len(rank_batches) == 24 // (new_world * 2)
                assert all(len(micro) == 2 for micro in rank_batches)
        seen = [i for step in before + after for i in flat(step)]
        assert len(seen) == len(set(seen)) == 8 * 24

    def test_default_micro_batch_comes_from_the_new_constructor(self):
        first = ranks(2, num_samples=200, global_batch=24)  # micro 12
        before = take(first, 2)
        second = resumed(first, 4, num_samples=200, global_batch=24)  # micro 6
        assert (second[0].micro_batch_size, second[0].accumulation_steps) == (6, 1)
        after = take(second)
        assert [set(flat(s)) for s in before + after] == reference_global_batches(200, 24)

    def test_set_world_keeps_the_micro_batch_and_changes_accumulation(self):
        samplers = ranks(4, num_samples=200, global_batch=24, micro_batch_size=2)
        before = take(samplers, 2)
        samplers = samplers[:3]
        for r, s in enumerate(samplers):
            s.set_world(r, 3)
        assert (samplers[0].micro_batch_size, samplers[0].accumulation_steps) == (2, 4)
        after = take(samplers)
        assert [set(flat(s)) for s in before + after] == reference_global_batches(200, 24)

    def test_state_after_the_last_step_resumes_at_the_next_epoch(self):
        kwargs = dict(num_samples=50, global_batch=12)
        (sampler,) = ranks(1, **kwargs)
        take([sampler], 4)  # the whole epoch, but the loop was left before it rolled over
        assert (sampler.epoch, sampler.consumed, sampler.steps_remaining_in_epoch) == (0, 48, 0)
        (fresh,) = resumed([sampler], 1, **kwargs)
        (uninterrupted,) = ranks(1, **kwargs)
        list(uninterrupted)
        assert list(fresh) == list(uninterrupted)
        assert fresh.epoch == uninterrupted.epoch == 2


class TestEpochs:
    def test_a_for_loop_is_the_rest_of_the_epoch_then_the_epoch_advances(self):
        (sampler,) = ranks(1, num_samples=50, global_batch=12)
        assert sampler.steps_remaining_in_epoch == 4
        first = list(sampler)
        assert (sampler.epoch, sampler.consumed, sampler.steps_remaining_in_epoch) == (1, 0, 4)
        second = list(sampler)
        assert sampler.epoch == 2
        assert len(first) == len(second) == 4
        assert first != second  # reshuffled: the order is fixed by (seed, epoch)

    def test_a_broken_loop_keeps_its_position(self):
        (whole,) = ranks(1, num_samples=50, global_batch=12)
        (split,) = ranks(1, num_samples=50, global_batch=12)
        steps = []
        for batches in split:
            steps.append(batches)
            if len(steps) == 2:
                break
        assert (split.epoch, split.consumed) == (0, 24)
        steps += list(split)
        assert steps == list(whole)

    def test_position_counts_a_step_when_it_is_yielded(self):
        (sampler,) = ranks(1, num_samples=50, global_batch=12)
        iterator = iter(sampler)
        assert sampler.consumed == 0
        next(iterator)
        assert sampler.consumed == 12 and sampler.state_dict()["consumed"] == 12


class TestDeterminism:
    def test_same_seed_same_order_on_every_instance(self):
        a = take(ranks(3, num_samples=60, global_batch=12, seed=7))
        b = take(ranks(3, num_samples=60, global_batch=12, seed=7))
        c = take(ranks(3, num_samples=60, global_batch=12, seed=8))
        assert a == b
        assert a != c

    def test_order_is_randperm_of_seed_plus_epoch(self):
        (sampler,) = ranks(1, num_samples=20, global_batch=20, seed=5)
        list(sampler)
        (batch,) = next(iter(sampler))  # epoch 1
        expected = torch.randperm(20, generator=torch.Generator().manual_seed(6)).tolist()
        assert batch == expected

    def test_no_shuffle_is_index_order_every_epoch(self):
        (sampler,) = ranks(1, num_samples=10, global_batch=4, shuffle=False)
        assert [b for (b,) in sampler] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert [b for (b,) in sampler] == [[0, 1, 2, 3], [4, 5, 6, 7]]


class TestConfigErrors:
    @pytest.mark.parametrize("global_batch,world,micro,words", [
        (12, 5, None, ["global batch 12", "5 ranks", "multiple of 5"]),
        (12, 2, 4, ["global batch 12", "2 ranks", "micro-batches of 4", "share of 6"]),
        (12, 5, 3, ["global batch 12", "5 ranks", "micro-batches of 3", "5 x 3 = 15"]),
    ])
    def test_indivisible_sizes_are_named(self, global_batch, world, micro, words):
        with pytest.raises(ConfigError) as info:
            ElasticSampler(100, global_batch, micro_batch_size=micro, rank=0, world_size=world)
        for word in words:
            assert word in str(info.value)

    def test_set_world_that_does_not_divide_leaves_the_sampler_unchanged(self):
        sampler = ElasticSampler(100, 12, micro_batch_size=3, rank=0, world_size=4)
        with pytest.raises(ConfigError, match="12 cannot be split over 3 ranks in micro-batches"):
            sampler.set_world(0, 3)
        with pytest.raises(ConfigError, match="rank 2 is out of range for world size 2"):
            sampler.set_world(2, 2)
        assert (sampler.world_size, sampler.accumulation_steps) == (4, 1)

    def test_a_global_batch_larger_than_the_dataset_is_refused(self):
        with pytest.raises(ConfigError, match="larger than the dataset of 10"):
            ElasticSampler(10, 12, rank=0, world_size=1)

    @pytest.mark.parametrize("kwargs", [
        dict(num_samples=0), dict(global_batch_size=0), dict(micro_batch_size=-1),
        dict(seed=-1), dict(rank=-1), dict(world_size=0), dict(global_batch_size=True),
    ])
    def test_bad_arguments(self, kwargs):
        args = dict(num_samples=100, global_batch_size=12, rank=0, world_size=1) | kwargs
        with pytest.raises(ConfigError):
            ElasticSampler(args.pop("num_samples"), args.pop("global_batch_size"), **args)


class TestStateDict:
    def test_is_json_serialisable(self):
        sampler = ElasticSampler(100, 12, micro_batch_size=2, rank=1, world_size=2, seed=3)
        next(iter(sampler))
        state = sampler.state_dict()
        assert json.loads(json.dumps(state)) == state
        assert {k: state[k] for k in ("epoch", "consumed", "seed", "num_samples",
                                      "global_batch_size", "micro_batch_size", "world_size")} == {
            "epoch": 0, "consumed": 12, "seed": 3, "num_samples": 100, "global_batch_size": 12,
            "micro_batch_size": 2, "world_size": 2}

    @pytest.mark.parametrize("change,words", [
        (dict(num_samples=99), ["num_samples 99 (saved) != 100"]),
        (dict(global_batch_size=24), ["global_batch_size 24 (saved) != 12"]),
        (dict(seed=1), ["seed 1 (saved) != 0"]),
        (dict(shuffle=False), ["shuffle False (saved) != True"]),
        (dict(consumed=13), ["consumed 13 is not a whole number of global batches of 12"]),
        (dict(consumed=-12), ["consumed must be an integer >= 0"]),
        (dict(epoch="1"), ["epoch must be an integer"]),
        (dict(world_size=True), ["world_size must be an integer"]),
        (dict(version=2), ["version 2 is not supported"]),
    ])
    def test_a_bad_state_is_refused_and_changes_nothing(self, change, words):
        sampler = ElasticSampler(100, 12, rank=0, world_size=2)
        state = sampler.state_dict() | {"epoch": 3, "consumed": 24} | change
        with pytest.raises(ConfigError) as info:
            sampler.load_state_dict(state)
        for word in words:
            assert word in str(info.value)
        assert (sampler.epoch, sampler.consumed) == (0, 0)

    def test_missing_keys_and_non_dicts_are_refused(self):
        sampler = ElasticSampler(100, 12, rank=0, world_size=1)
        state = sampler.state_dict()
        del state["consumed"], state["epoch"]
        with pytest.raises(ConfigError, match="lacks epoch, consumed"):
            sampler.load_state_dict(state)
        with pytest.raises(ConfigError, match="must be a dict"):
            sampler.load_state_dict([1, 2])

    def test_the_saved_micro_batch_and_world_are_informational_with_a_constant_batch(self):
        old = ElasticSampler(100, 12, rank=0, world_size=2)  # micro 6
        new = ElasticSampler(100, 12, micro_batch_size=4, rank=0, world_size=1)
        new.load_state_dict(old.state_dict())
        assert (new.world_size, new.micro_batch_size, new.accumulation_steps) == (1, 4, 3)

    def test_an_adopted_micro_batch_that_outgrows_the_dataset_is_refused(self):
        old = ElasticSampler(100, 40, rank=0, world_size=2, keep_global_batch=False)  # micro 20
        new = ElasticSampler(100, 24, rank=0, world_size=6, keep_global_batch=False)  # micro 4
        with pytest.raises(ConfigError, match="global batch of 120 samples is larger"):
            new.load_state_dict(old.state_dict())
        assert (new.micro_batch_size, new.global_batch_size) == (4, 24)


class TestVariableGlobalBatch:
    def test_global_batch_follows_the_world_and_the_rest_is_covered_once(self):
        first = ranks(4, num_samples=100, global_batch=12, keep_global_batch=False)
        before = take(first, 3)  # 36 samples at 4 x 3
        second = resumed(first, 2, num_samples=100, global_batch=12, keep_global_batch=False)
        s = second[0]
        assert (s.micro_batch_size, s.accumulation_steps, s.global_batch_size) == (3, 1, 6)
        after = take(second)
        assert len(after) == (100 - 36) // 6 == s.steps_per_epoch - 6
        seen = [i for step in before + after for i in flat(step)]
        order = torch.randperm(100, generator=torch.Generator().manual_seed(0)).tolist()
        assert seen == order[:36 + 6 * len(after)]  # in order, each once, tail dropped

    def test_an_explicit_other_micro_batch_is_refused(self):
        old = ElasticSampler(100, 12, rank=0, world_size=4, keep_global_batch=False)
        new = ElasticSampler(100, 8, micro_batch_size=4, rank=0, world_size=2,
                             keep_global_batch=False)
        with pytest.raises(ConfigError, match="micro_batch_size 3 \\(saved\\) != 4"):
            new.load_state_dict(old.state_dict())

    def test_global_batch_must_match_world_times_micro(self):
        with pytest.raises(ConfigError, match="pass global_batch_size=8"):
            ElasticSampler(100, 12, micro_batch_size=4, rank=0, world_size=2,
                           keep_global_batch=False)


class TestDefaultWorld:
    def test_from_the_environment(self, monkeypatch):
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "3")
        sampler = ElasticSampler(100, 12)
        assert (sampler.rank, sampler.world_size, sampler.micro_batch_size) == (1, 3, 4)
        explicit = ElasticSampler(100, 12, rank=0, world_size=2)
        assert (explicit.rank, explicit.world_size) == (0, 2)

    def test_single_process_without_environment(self, monkeypatch):
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        sampler = ElasticSampler(100, 12)
        assert (sampler.rank, sampler.world_size) == (0, 1)

    def test_a_bad_environment_variable_is_named(self, monkeypatch):
        monkeypatch.setenv("WORLD_SIZE", "two")
        with pytest.raises(ConfigError, match="WORLD_SIZE must be an integer"):
            ElasticSampler(100, 12)


class TestSyntheticDataset:
    def test_samples_are_reproducible_and_batches_stack(self):
        a, b = SyntheticDataset(10, input_dim=4, output_dim=2), SyntheticDataset(10, 4, 2)
        assert len(a) == 10
        for i in range(10):
            assert all(torch.equal(u, v) for u, v in zip(a[i], b[i]))
        assert not torch.equal(a[0][0], a[1][0])
        x, y = a.batch([3, 1, 3])
        assert x.shape == (3, 4) and y.shape == (3, 2)
        assert torch.equal(x[0], a[3][0]) and torch.equal(y[1], a[1][1])

    def test_seed_changes_the_data_and_out_of_range_is_an_index_error(self):
        assert not torch.equal(SyntheticDataset(5, seed=1)[0][0], SyntheticDataset(5)[0][0])
        with pytest.raises(IndexError):
            SyntheticDataset(5)[5]
        with pytest.raises(ValueError):
            SyntheticDataset(5).batch([])
