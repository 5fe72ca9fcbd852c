"""Bad arguments fail at the call, naming the argument, the value and a fix (issue item 4)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, SubsetRandomSampler

from shardplug import BatchSamplerShard, SampleAudit, prepare_data_loader
from shardplug.core.dispatch.dispatcher import DataLoaderDispatcher
from shardplug.core.sharding.read_all import IterableDatasetShard


def test_slice_fn_for_dispatch_must_be_callable_at_prepare():
    with pytest.raises(TypeError, match=r"slice_fn_for_dispatch=5.*callable"):
        prepare_data_loader(
            DataLoader(range(8), batch_size=2),
            slice_fn_for_dispatch=5,
            dispatch_batches=True,
            put_on_device=True,
            device="cpu",
        )


def test_slice_fn_for_dispatch_must_be_callable_on_the_dispatcher():
    with pytest.raises(TypeError, match=r"slice_fn_for_dispatch=5.*callable"):
        DataLoaderDispatcher(range(8), batch_size=2, slice_fn_for_dispatch=5)


def test_rng_types_must_be_a_list_of_names():
    with pytest.raises(TypeError, match=r"rng_types=5 .*\['torch', 'cuda', 'xla', 'generator'\]"):
        prepare_data_loader(DataLoader(range(8), batch_size=2), rng_types=5)


def test_batch_sampler_shard_of_none():
    with pytest.raises(TypeError, match=r"batch_sampler=None .*BatchSampler\("):
        BatchSamplerShard(None)


@pytest.mark.parametrize("sampler", [SequentialSampler(range(10)), RandomSampler(range(10)), range(10)])
def test_batch_sampler_shard_over_single_indices(sampler):
    with pytest.raises(TypeError, match=r"single indices.*BatchSampler\("):
        shard = BatchSamplerShard(sampler, 2, 0)
        list(shard)  # a plain iterable is only found out at its first element


def test_batch_sampler_shard_over_an_unknown_index_sampler_fails_clearly_at_its_first_element():
    class MySampler(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(6))

        def __len__(self):
            return 6

    shard = BatchSamplerShard(MySampler(), 2, 0)
    with pytest.raises(TypeError, match=r"yielded 0.*single index.*BatchSampler\("):
        list(shard)


def test_iterable_dataset_shard_of_none():
    with pytest.raises(TypeError, match=r"dataset=None .*iterable"):
        IterableDatasetShard(None)


def test_data_seed_with_a_generator_shuffle_is_not_ignored():
    loader = DataLoader(range(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"data_seed=5 .*generator.*use_seedable_sampler=True"):
        prepare_data_loader(loader, data_seed=5)
    sampler = SubsetRandomSampler(range(8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"data_seed=5 .*SubsetRandomSampler.*generator"):
        prepare_data_loader(DataLoader(range(8), batch_size=2, sampler=sampler), data_seed=5, use_seedable_sampler=True)


def test_data_seed_with_use_seedable_sampler_still_works():
    loader = DataLoader(range(8), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1))
    prepared = prepare_data_loader(loader, data_seed=5, use_seedable_sampler=True)
    assert sorted(i for b in prepared for i in b.tolist()) == list(range(8))


def _state(**epoch):
    return {"dataset_length": 10, "epochs": {0: {"padding": 0, **epoch}}}


@pytest.mark.parametrize(
    "state, error, pattern",
    [
        (_state(counts=torch.ones(7, dtype=torch.int32)), ValueError, r"counts.*shape \(7,\).*\(10,\)"),
        (_state(counts=-torch.ones(10, dtype=torch.int32)), ValueError, r"counts out of range: counts\[0\]=-1 \(10 of"),
        (_state(counts=torch.full((10,), 2**40)), ValueError, r"counts\[0\]=1099511627776 .*\[0, 2\*\*31\)"),
        (_state(counts=torch.tensor([1] * 9 + [2**31])), ValueError, r"counts\[9\]=2147483648 \(1 of 10 samples"),
        (_state(counts=2**40), TypeError, r"counts=1099511627776, which is not a tensor"),
        (_state(counts=None), TypeError, r"counts=None, which is not a tensor"),
        (_state(counts=torch.full((10,), 0.5)), TypeError, r"counts.*torch.float32.*integer"),
        (
            _state(seen=torch.zeros(1, dtype=torch.uint8), twice=torch.zeros(2, dtype=torch.uint8)),
            ValueError,
            r"seen.*shape \(1,\).*\(2,\)",
        ),
        (
            _state(seen=torch.full((2,), 255, dtype=torch.uint8), twice=torch.zeros(2, dtype=torch.uint8)),
            ValueError,
            r"seen.*beyond.*10",
        ),
        (_state(seen=None, twice=torch.zeros(2, dtype=torch.uint8)), TypeError, r"seen=None, which is not a tensor"),
        (
            _state(seen=torch.tensor([3, 0], dtype=torch.uint8), twice=torch.tensor([6, 0], dtype=torch.uint8)),
            ValueError,
            r"twice bits set for samples its seen bitmap does not have \(byte 0: twice=6, seen=3\)",
        ),
        (
            {"dataset_length": 10, "epochs": {0: {"counts": torch.ones(10, dtype=torch.int32), "padding": -3}}},
            ValueError,
            r"padding=-3: it must be an integer in \[0, 2\*\*63\)",
        ),
        (
            {"dataset_length": 10, "epochs": {0: {"counts": torch.ones(10, dtype=torch.int32), "padding": 2**63}}},
            ValueError,
            r"padding=9223372036854775808: it must be an integer in \[0, 2\*\*63\)",
        ),
        (
            {"dataset_length": 10, "epochs": {0: {"counts": torch.ones(10, dtype=torch.int32), "padding": None}}},
            TypeError,
            r"padding=None",
        ),
        (
            {"dataset_length": 10, "epochs": {-1: {"counts": torch.ones(10, dtype=torch.int32), "padding": 0}}},
            ValueError,
            r"epoch -1",
        ),
        ({"dataset_length": 10, "epochs": None}, TypeError, r"epochs=None"),
    ],
)
def test_a_bad_audit_state_is_refused_and_nothing_is_loaded(state, error, pattern):
    audit = SampleAudit(10)
    audit.record(0, [1, 2], 2)
    with pytest.raises(error, match=pattern):
        audit.load_state_dict(state)
    report = audit.report(0)
    assert (report.seen, report.duplicated_count, report.padding) == (2, 0, 0), "nothing was added"


def test_a_good_audit_state_still_loads():
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[1, 2]] = 1
    counts[3] = 2**31 - 1  # any count above one is "seen twice" (up to 0.1's largest, an int32's)
    audit = SampleAudit(10)
    audit.load_state_dict(_state(counts=counts))
    report = audit.report(0)
    assert (report.seen, report.duplicated) == (3, [3])
