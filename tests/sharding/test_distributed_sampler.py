"""A user's torch ``DistributedSampler`` adopted, in one process: the epoch rules and the refusals (they happen where
the loader is prepared and iterated, without collectives). In real process groups of 2 and 3 processes (the batches
of native DDP, the padding marked, resume and resize): ``tests/sharding/test_multiprocess.py``."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from _distributed_sampler import SEED, N, loader
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from shardplug import prepare_data_loader


# -- in one process ---------------------------------------------------------------------------------
def _prepared(shuffle: bool = True, processes: int = 2, index: int = 0, **options: Any):
    sampler, user = loader(processes, index, shuffle, False, 4)
    return sampler, prepare_data_loader(user, num_processes=processes, process_index=index, **options)


def test_set_epoch_on_the_sampler_or_on_the_loader_moves_both():
    sampler, loader = _prepared()
    sampler.set_epoch(4)
    assert loader.epoch == 4 and loader.state_dict()["epoch"] == 4, "before any pass: the sampler's epoch"
    first = [b.tolist() for b in loader]
    assert loader.epoch == 4 and loader.state_dict()["epoch"] == 5  # a whole pass: the next epoch's start
    loader.set_epoch(2)
    assert sampler.epoch == 2
    assert [b.tolist() for b in loader] == _reference(2)
    assert first == _reference(4)


def _reference(epoch: int, processes: int = 2, index: int = 0) -> list[list[int]]:
    sampler = DistributedSampler(range(N), processes, index, shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return [b.tolist() for b in DataLoader(range(N), batch_size=4, sampler=sampler)]


def test_without_set_epoch_every_pass_is_the_same_epoch_as_under_ddp():
    _, loader = _prepared()
    passes = [[b.tolist() for b in loader] for _ in range(2)]
    assert passes == [_reference(0), _reference(0)] and loader.epoch == 0


def test_a_sampler_set_before_preparing_keeps_its_epoch():
    sampler, user = loader(2, 1, True, False, 4)
    sampler.set_epoch(3)
    prepared = prepare_data_loader(user, num_processes=2, process_index=1)
    assert prepared.epoch == 3 and sampler.epoch == 3
    assert [b.tolist() for b in prepared] == _reference(3, index=1)


def test_a_position_of_another_seed_is_refused():
    sampler, loader = _prepared()
    batches = iter(loader)
    next(batches)
    position = loader.state_dict()
    other = DistributedSampler(range(N), 2, 0, seed=SEED + 1)
    moved = prepare_data_loader(DataLoader(range(N), batch_size=4, sampler=other), num_processes=2, process_index=0)
    with pytest.raises(ValueError, match="seed=7.*seed=8"):
        moved.load_state_dict(position)


class _OwnOrder(DistributedSampler):
    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))


@pytest.mark.parametrize(
    "build, options, match",
    [
        (
            lambda s: DataLoader(range(N), batch_size=4, sampler=_OwnOrder(range(N), 2, 0)),
            {},
            "_OwnOrder.*__iter__ of its own",
        ),
        (
            lambda s: DataLoader(range(N), batch_size=4, sampler=s),
            {"split_batches": True},
            "split_batches=True.*split_batches=False",
        ),
        (lambda s: DataLoader(range(N), batch_size=4, sampler=s), {"data_seed": 3}, "data_seed=3.*data_seed=None"),
        (
            lambda s: DataLoader(range(N), batch_size=4, sampler=s),
            {"shuffle_algorithm": "bijective"},
            "shuffle_algorithm='bijective' would change the order",
        ),
        (
            lambda s: DataLoader(range(N), batch_size=None, sampler=s),
            {},
            "batch_size=None.*give the DataLoader a batch_size",
        ),
        (
            lambda s: DataLoader(range(N), batch_sampler=_Batches(BatchSampler(s, 4, False))),
            {},
            "through _Batches",
        ),
        (
            lambda s: DataLoader(range(N), batch_size=4, sampler=s),
            {"dispatch_batches": True, "put_on_device": True},
            "dispatch_batches=True.*dispatch_batches=False",
        ),
    ],
    ids=["subclass", "split_batches", "data_seed", "bijective", "no_batch_size", "own_batch_sampler", "dispatch"],
)
def test_what_would_change_its_order_is_refused_with_the_fix(build, options, match):
    sampler = DistributedSampler(range(N), 2, 0, seed=SEED)
    with pytest.raises(ValueError, match=match):
        prepare_data_loader(build(sampler), num_processes=2, process_index=0, **options)


class _Batches:
    def __init__(self, inner):
        self.inner, self.sampler, self.batch_size, self.drop_last = inner, inner.sampler, 4, False

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


def _batches(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_every_layout_gets_the_batches_of_torchs_sampler():
    """Any length (also empty, or shorter than the processes), processes, batch size, shuffle and drop_last: each
    process's batches are torch's own DataLoader's with that DistributedSampler, and len() says how many."""
    for n, processes, size, shuffle, sampler_drop, loader_drop in itertools.product(
        (0, 1, 5, 13), (1, 2, 3), (1, 3), (False, True), (False, True), (False, True)
    ):
        for index in range(processes):
            options = {"shuffle": shuffle, "seed": SEED, "drop_last": sampler_drop}
            sampler = DistributedSampler(range(n), processes, index, **options)
            adopted = prepare_data_loader(
                DataLoader(range(n), batch_size=size, sampler=sampler, drop_last=loader_drop),
                num_processes=processes,
                process_index=index,
            )
            reference = DistributedSampler(range(n), processes, index, **options)
            native = DataLoader(range(n), batch_size=size, sampler=reference, drop_last=loader_drop)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                reference.set_epoch(epoch)
                assert (len(adopted), _batches(adopted)) == (len(native), _batches(native)), (n, processes, index)


def test_a_position_of_any_place_resizes_with_every_remaining_sample_once():
    """Saved after any number of batches on 1-3 processes, loaded on 1-3: the job consumed a prefix of the epoch's
    order, and the rest goes out once (the sampler's drop_last: fewer than one sample per process short)."""
    for n, saved_on, loaded_on, sampler_drop in itertools.product((7, 13), (1, 2, 3), (1, 2, 3), (False, True)):
        options = {"seed": SEED, "drop_last": sampler_drop}
        steps = len(prepare_data_loader(DataLoader(range(n), batch_size=2), num_processes=saved_on, process_index=0))
        for stop in range(steps):
            consumed, position = [], None
            for index in range(saved_on):
                sampler = DistributedSampler(range(n), saved_on, index, **options)
                saving = prepare_data_loader(
                    DataLoader(range(n), batch_size=2, sampler=sampler), num_processes=saved_on, process_index=index
                )
                saving.track_padding()
                sampler.set_epoch(1)
                for batch in itertools.islice(saving, stop):
                    consumed += batch.tolist()[: saving.batch_real_count]
                position = saving.state_dict()
            rest = []
            for index in range(loaded_on):
                sampler = DistributedSampler(range(n), loaded_on, index, **options)
                loading = prepare_data_loader(
                    DataLoader(range(n), batch_size=2, sampler=sampler), num_processes=loaded_on, process_index=index
                )
                loading.track_padding()
                loading.load_state_dict(position)
                if loading.epoch == 1:  # else the rest filled no step of the new processes: the next epoch's start
                    rest += [i for batch in loading for i in batch.tolist()[: loading.batch_real_count]]
            order = DistributedSampler(range(n), 1, 0, seed=SEED)
            order.set_epoch(1)
            assert sorted(consumed) == sorted(list(order)[: stop * 2 * saved_on]), "a prefix of the order"
            where = (n, saved_on, loaded_on, sampler_drop, stop)
            assert len(consumed + rest) == len(set(consumed + rest)), where
            # the sampler's drop_last drops fewer samples than one of the saving or the loading processes' steps
            assert len(set(range(n)) - set(consumed + rest)) < (max(saved_on, loaded_on) if sampler_drop else 1), where


def test_a_loader_that_keeps_its_own_epoch_resumes_its_position_whatever_the_sampler_is_told():
    """Fabric's wrapper sets its own count of passes on the samplers (0 in a resumed run): the loader's epoch
    (the loaded position's) decides, as for every sampler under Fabric."""
    sampler, loader = _prepared()
    sampler.set_epoch(2)
    batches = iter(loader)
    next(batches)
    position = loader.state_dict()
    sampler, resumed = _prepared()
    resumed.keeps_own_epoch = True  # as shardplug's Fabric strategy sets it
    resumed.load_state_dict(position)
    sampler.set_epoch(0)  # Fabric's count of passes, restarted
    assert [b.tolist() for b in resumed] == _reference(2)[1:]


def test_a_sampler_whose_dataset_changed_length_is_refused():
    data = list(range(N))
    sampler = DistributedSampler(data, 2, 0)
    data += [N, N + 1]  # torch's own sampler would now fail its length check, or read past its cut
    with pytest.raises(ValueError, match=f"num_samples=12.*gives each of its 2 processes 13 of a dataset of {N + 2}"):
        prepare_data_loader(DataLoader(data, batch_size=4, sampler=sampler), num_processes=2, process_index=0)


def test_remainder_counts_the_real_samples_of_the_last_global_batch():
    """``loader.remainder`` (the last global batch's real samples, 0 when it is full) where the sampler's padding
    or its drop_last's cut lies inside the last step: counted from torch's batching of the sampler (its ``k``-th
    index, position ``index + k * processes`` of the epoch, is padding past the dataset's length), and after a
    resume on another number of processes from the marked rows."""
    for n, processes, size, sampler_drop, loader_drop in itertools.product(
        (5, 10, 11, 13), (2, 3, 4), (2, 3), (False, True), (False, True)
    ):
        real, adopted = 0, []
        for index in range(processes):
            sampler = DistributedSampler(range(n), processes, index, shuffle=False, drop_last=sampler_drop)
            native = list(BatchSampler(range(len(sampler)), size, loader_drop))  # the k-th of the sampler's indices
            real += sum(1 for k in (native[-1] if native else []) if index + k * processes < n)
            user = DataLoader(range(n), batch_size=size, sampler=sampler, drop_last=loader_drop)
            adopted.append(prepare_data_loader(user, num_processes=processes, process_index=index))
        expected = 0 if real == size * processes else real
        assert [prepared.remainder for prepared in adopted] == [expected] * processes, (n, processes, size)
        if len(adopted[0]) < 2:
            continue  # no step to resume after the first
        position = _saved_after_one_step(adopted)
        for loaded_on in (2, 3):
            resumed = []
            for index in range(loaded_on):
                sampler = DistributedSampler(range(n), loaded_on, index, shuffle=False, drop_last=sampler_drop)
                user = DataLoader(range(n), batch_size=size, sampler=sampler, drop_last=loader_drop)
                resumed.append(prepare_data_loader(user, num_processes=loaded_on, process_index=index))
                resumed[-1].load_state_dict(position)
                resumed[-1].track_padding()
            remainders = {prepared.remainder for prepared in resumed}
            last = [0] * loaded_on
            for index, prepared in enumerate(resumed):
                for _ in prepared:
                    last[index] = prepared.batch_real_count
            full = sum(last) == size * loaded_on
            assert remainders == {0 if full else sum(last)}, (n, processes, size, sampler_drop, loader_drop, loaded_on)


def _saved_after_one_step(loaders: list[Any]) -> dict[str, Any]:
    """The position after the first step of ``loaders`` (one per process)."""
    for prepared in loaders:
        next(iter(prepared))
    return loaders[0].state_dict()
