"""DataLoaderShard and prepare_data_loader in one process (simulated ranks); skipping and resuming:
tests/loader/test_loader_resume.py."""

from __future__ import annotations

import sys

import pytest
import torch
from _datasets import NO_LEN, Counting, Files, PlainShards, Stream, Unsized, rows
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

import shardplug
from shardplug import DataLoaderShard, IterableDatasetShard, prepare_data_loader, skip_first_batches


# -- streams read by every process (docs/streams.md) -------------------------------------------------
def test_iterable_shard_spec_examples():
    split = lambda i: list(IterableDatasetShard(range(8), 4, num_processes=2, process_index=i, split_batches=True))  # noqa: E731
    whole = lambda i: list(IterableDatasetShard(range(8), 4, num_processes=2, process_index=i))  # noqa: E731
    assert [whole(0), whole(1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [split(0), split(1)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    shards = [IterableDatasetShard(range(11), 2, num_processes=2, process_index=i) for i in range(2)]
    assert [list(s) for s in shards] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 0]]
    assert [len(s) for s in shards] == [6, 6]
    dropped = [IterableDatasetShard(range(11), 2, drop_last=True, num_processes=2, process_index=i) for i in range(2)]
    assert [list(s) for s in dropped] == [[0, 1, 4, 5], [2, 3, 6, 7]] and [len(s) for s in dropped] == [4, 4]


@pytest.mark.parametrize(
    "n,b,split,drop",
    [(n, b, s, d) for n in (0, 1, 7, 16) for b in (2, 4) for s in (False, True) for d in (False, True)],
)
def test_iterable_shard_len_equals_yield(n, b, split, drop):
    for i in range(2):
        shard = IterableDatasetShard(range(n), b, drop, 2, i, split)
        assert len(shard) == len(list(shard))


def test_iterable_shard_split_needs_divisible_batch():
    with pytest.raises(ValueError, match="batch_size=3 and num_processes=2"):
        IterableDatasetShard(range(8), 3, num_processes=2, split_batches=True)


def test_iterable_generator_reseeded_with_its_own_seed_plus_epoch():
    class Shuffled(IterableDataset):
        def __init__(self, seed):
            self.generator = torch.Generator().manual_seed(seed)

        def __iter__(self):
            return iter(torch.randperm(8, generator=self.generator).tolist())

    a, b = IterableDatasetShard(Shuffled(42)), IterableDatasetShard(Shuffled(1234))
    assert list(a) != list(b), "the user's seed must matter"
    assert list(a) == list(a), "no set_epoch yet: epoch 0 every time, no crash"
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert list(a) == list(torch.randperm(8, generator=torch.Generator().manual_seed(43)).tolist())


# -- loader behaviour --------------------------------------------------------------------------------
def test_end_of_dataloader_and_epoch_advance():
    data = Counting(7)
    loader = prepare_data_loader(
        DataLoader(data, batch_size=2, shuffle=True), num_processes=2, process_index=0, data_seed=0
    )
    flags = []
    for _batch in loader:
        flags.append(loader.end_of_dataloader)
    assert flags == [False, True]
    first = rows(loader)
    assert loader.epoch == 1
    assert rows(loader) != first and loader.epoch == 2
    assert data.epochs[-1] == 2, "set_epoch reaches the dataset"
    loader.set_epoch(1)
    assert rows(loader) == first, "epoch 1's order is a function of the seed and the epoch"


def test_epoch_advances_only_after_a_complete_pass():
    loader = prepare_data_loader(DataLoader(range(8), batch_size=2, shuffle=True), data_seed=3)
    for _ in loader:
        break
    for _ in loader:
        break
    assert loader.epoch == 0, "two broken passes are both epoch 0"


class _EpochSampler(SequentialSampler):
    """A sampler that says which epoch it stands at (as torch's DistributedSampler does) and records its calls."""

    def __init__(self, data, epoch=0):
        super().__init__(data)
        self.epoch, self.calls = epoch, []

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.calls.append(epoch)


@pytest.mark.parametrize("as_batch_sampler", [False, True])
def test_preparing_calls_no_set_epoch_unless_a_sampler_stands_at_another_epoch(as_batch_sampler):
    """A loop calls set_epoch once per epoch (Lightning: 0 before the first, 1 before the second); preparing a
    loader adds no call of its own, nor does the next pass after a whole one where the framework sets the
    samplers' epoch itself, so a sampler that records them sees exactly those. A sampler that stands at another
    epoch (it says so in ``epoch``) is put at the loader's epoch 0 once, at prepare time."""
    calls: list[int] = []
    sampler = torch.utils.data.RandomSampler(range(12))
    sampler.set_epoch = calls.append  # any set_epoch: the user's own shuffle (as in Lightning's own test)

    def user_loader(index_sampler):
        if as_batch_sampler:
            return DataLoader(range(12), batch_sampler=BatchSampler(index_sampler, 2, True))
        return DataLoader(range(12), batch_size=2, sampler=index_sampler)

    loaders = [prepare_data_loader(user_loader(sampler), num_processes=2, process_index=i, data_seed=3) for i in (0, 1)]
    assert calls == [], "preparing told the sampler nothing"
    mine, framework = loaders
    for epoch in range(2):  # a loop of the user's own: the loader's set_epoch reaches the sampler
        mine.set_epoch(epoch)
        assert len(list(mine)) == 3
    assert calls == [0, 1], "one call per epoch"
    calls.clear()
    framework.epochs_set_by_framework = True  # as shardplug's Lightning strategy says of Lightning's loops
    for epoch in range(2):  # Lightning's loops: set_epoch on the loader's sampler, then a whole pass
        framework.batch_sampler.sampler.set_epoch(epoch)
        assert len(list(framework)) == 3
    assert calls == [0, 1] and framework.epoch == 1, "one call per epoch: the framework's, none after a whole pass"
    fresh = _EpochSampler(range(12))
    prepare_data_loader(user_loader(fresh), num_processes=2, process_index=1)
    assert fresh.calls == [] and fresh.epoch == 0
    ahead = _EpochSampler(range(12), epoch=3)  # stands at epoch 3: the prepared loader's epoch 0 reaches it
    prepared = prepare_data_loader(user_loader(ahead), num_processes=2, process_index=1)
    assert ahead.calls == [0] and ahead.epoch == 0 and prepared.epoch == 0
    data = Counting(12)  # a dataset with set_epoch but no epoch to read: left as it is
    DataLoaderShard(data, batch_size=2)
    assert data.epochs == []


def test_set_epoch_reaches_sampler_batch_sampler_and_dataset():
    class EpochBatchSampler(BatchSampler):
        epochs: list

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    data = Counting(8)
    sampler = shardplug.SeedableRandomSampler(data, data_seed=1)
    batch_sampler = EpochBatchSampler(sampler, 2, False)
    batch_sampler.epochs = []
    loader = DataLoaderShard(data, batch_sampler=batch_sampler)
    loader.set_epoch(5)
    assert batch_sampler.epochs[-1] == 5 and data.epochs[-1] == 5 and loader.epoch == 5


def test_device_placement_and_nested_batches():
    class Nested(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.tensor(i), "t": (torch.tensor(i), [torch.tensor(-i)]), "s": "k"}

    loader = prepare_data_loader(
        DataLoader(Nested(), batch_size=2), put_on_device=True, device="cpu", non_blocking=True
    )
    batch = next(iter(loader))
    assert batch["x"].device.type == "cpu" and batch["s"] == ["k", "k"] and isinstance(batch["t"], list)
    assert loader.device == torch.device("cpu") and loader.non_blocking


def test_totals_and_remainder():
    loader = prepare_data_loader(DataLoader(range(21), batch_size=3), num_processes=2, process_index=1)
    assert (loader.total_batch_size, loader.total_dataset_length, loader.remainder) == (6, 21, 3)
    split = prepare_data_loader(
        DataLoader(range(21), batch_size=4), num_processes=2, process_index=1, split_batches=True
    )
    assert (split.total_batch_size, split.remainder) == (4, 1)
    stream = prepare_data_loader(DataLoader(Stream(10), batch_size=2), num_processes=2, process_index=0)
    assert (stream.total_batch_size, stream.total_dataset_length, stream.remainder) == (4, 10, 2)


def test_len_is_exact_for_split_uneven():
    for i, expected in ((0, 6), (1, 5)):
        loader = prepare_data_loader(
            DataLoader(range(21), batch_size=4),
            num_processes=2,
            process_index=i,
            split_batches=True,
            even_batches=False,
        )
        assert len(loader) == len(rows(loader)) == expected


@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_a_stream_without_len_on_one_process_says_what_to_do(workers):
    loader = prepare_data_loader(DataLoader(Unsized(5), batch_size=2, num_workers=workers))
    with pytest.raises(TypeError, match=NO_LEN) as unknown:  # a TypeError still: what len() callers expect
        len(loader)
    assert "or iterate without len()" in str(unknown.value)
    assert rows(loader) == rows(DataLoader(Unsized(5), batch_size=2, num_workers=workers)), "it iterates as ever"
    with pytest.raises(TypeError, match=NO_LEN):
        len(shardplug.skip_first_batches(loader, 1))


def test_iterable_batch_size_none():
    loader = prepare_data_loader(DataLoader(Stream(5), batch_size=None), num_processes=2, process_index=1)
    assert [int(x) for x in loader] == [1, 3, 0]


def test_sampler_that_is_a_batch_sampler():
    batch_sampler = BatchSampler(SequentialSampler(range(10)), 3, False)
    data = list(range(100, 110))

    class Batched(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, indices):
            return torch.tensor([data[i] for i in indices])

    loaders = [
        prepare_data_loader(
            DataLoader(Batched(), sampler=batch_sampler, batch_size=None), num_processes=2, process_index=i
        )
        for i in range(2)
    ]
    assert [rows(l) for l in loaders] == [[[100, 101, 102], [106, 107, 108]], [[103, 104, 105], [109, 100, 101]]]
    assert [len(l) for l in loaders] == [2, 2]


def test_batch_size_and_drop_last_read_as_torch_says():
    """A loader built with a batch_sampler reports batch_size None and drop_last False in torch; the
    prepared one too (its batches still follow the batch sampler's size and drop_last). A loader built
    with batch_size reports the batch size of this process."""
    for drop_last in (False, True):
        user = DataLoader(range(10), batch_sampler=BatchSampler(SequentialSampler(range(10)), 3, drop_last))
        prepared = [prepare_data_loader(user, num_processes=2, process_index=i) for i in range(2)]
        assert (
            [(p.batch_size, p.drop_last) for p in prepared]
            == [(user.batch_size, user.drop_last)] * 2
            == [(None, False)] * 2
        )
        # drop_last: the step that process 1 cannot fill ([6, 7, 8] alone) is dropped; else the last one is padded
        expected = [[[0, 1, 2]], [[3, 4, 5]]] if drop_last else [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
        assert [rows(p) for p in prepared] == expected
    sized = DataLoader(range(10), batch_size=4, drop_last=True)
    assert prepare_data_loader(sized, num_processes=2, process_index=0).batch_size == 4
    split = prepare_data_loader(sized, num_processes=2, process_index=0, split_batches=True)
    assert (split.batch_size, split.drop_last) == (2, True)


# -- keeping what the user gave ----------------------------------------------------------------------
class MyLoader(DataLoader):
    kind = "mine"

    def __init__(self, dataset, note, **kwargs):
        super().__init__(dataset, **kwargs)
        self.note = note

    def __iter__(self):
        for batch in super().__iter__():
            yield batch * 10


def _init(worker_id):  # module level: picklable
    pass


def test_subclass_and_settings_survive_prepare_and_skip():
    gen = torch.Generator().manual_seed(0)
    original = MyLoader(
        range(12),
        "hello",
        batch_size=2,
        num_workers=1,
        worker_init_fn=_init,
        pin_memory=False,
        persistent_workers=True,
        prefetch_factor=3,
        timeout=5,
        generator=gen,
        collate_fn=lambda b: torch.tensor(b),
    )
    for loader in (prepare_data_loader(original, num_processes=2, process_index=0), skip_first_batches(original, 1)):
        assert isinstance(loader, MyLoader) and isinstance(loader, DataLoaderShard)
        assert loader.kind == "mine" and loader.note == "hello"
        assert (loader.num_workers, loader.worker_init_fn, loader.prefetch_factor, loader.timeout) == (1, _init, 3, 5)
        assert loader.persistent_workers and loader.generator is gen and loader.collate_fn is original.collate_fn
    assert rows(prepare_data_loader(original, num_processes=2, process_index=0)) == [[0, 10], [40, 50], [80, 90]]


def test_rng_types_list_is_never_mutated():
    types = ["torch", "generator"]
    prepare_data_loader(DataLoader(range(4), batch_size=2, shuffle=True), rng_types=types)
    prepare_data_loader(DataLoader(range(4), batch_size=2), rng_types=types)
    assert types == ["torch", "generator"]


# -- bad input --------------------------------------------------------------------------------------
def test_errors_name_argument_value_and_fix():
    dl = DataLoader(range(10), batch_size=3)
    with pytest.raises(ValueError, match="num_processes=0"):
        prepare_data_loader(dl, num_processes=0, process_index=0)
    with pytest.raises(ValueError, match="process_index=3"):
        prepare_data_loader(dl, num_processes=2, process_index=3)
    with pytest.raises(ValueError, match=r"batch_size=3 and num_processes=2.*batch_size=4"):
        prepare_data_loader(dl, num_processes=2, process_index=0, split_batches=True)
    with pytest.raises(ValueError, match="batch size"):
        prepare_data_loader(
            DataLoader(range(10), batch_size=None), num_processes=2, process_index=0, split_batches=True
        )
    with pytest.raises(ValueError, match="put_on_device=True"):
        prepare_data_loader(dl, dispatch_batches=True)
    with pytest.raises(ValueError, match="'gpu'"):
        prepare_data_loader(dl, rng_types=["torch", "gpu"])
    with pytest.raises(ValueError, match=r"DistributedSampler has rank=0.*num_replicas=2, rank=1"):
        prepare_data_loader(
            DataLoader(range(10), sampler=DistributedSampler(range(10), num_replicas=2, rank=0)),
            num_processes=2,
            process_index=1,
        )


def test_stateful_without_torchdata_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)
    with pytest.raises(ImportError, match="pip install"):
        prepare_data_loader(DataLoader(range(4)), use_stateful_dataloader=True)


def test_environment_topology(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    loader = prepare_data_loader(DataLoader(range(9), batch_size=1))
    assert rows(loader) == [[2], [5], [8]]
    topo = shardplug.ProcessTopology.current()
    assert (topo.num_processes, topo.process_index) == (3, 2)


@pytest.mark.parametrize("workers", [0, 2])
def test_datasets_that_shard_themselves_are_read_once(workers):
    loaders = [
        prepare_data_loader(
            DataLoader(Files(range(4)), batch_size=5, num_workers=workers), num_processes=2, process_index=i
        )
        for i in range(2)
    ]
    assert all(isinstance(l.dataset, Files) and l.dataset.n_shards == 2 for l in loaders)
    got = [rows(l) for l in loaders]
    assert len(got[0]) == len(got[1])
    if workers:  # each part splits itself across the workers: their batch counts are not known without reading
        with pytest.raises(TypeError):
            len(loaders[0])
    else:
        assert len(got[0]) == len(loaders[0])
    assert sorted(x for shard in got for batch in shard for x in batch) == sorted(Files(range(4)))


def test_unequal_self_shards_are_sharded_natively_and_padded_to_equal_counts():
    loader = prepare_data_loader(DataLoader(Files(range(3)), batch_size=2), num_processes=2, process_index=0)
    assert isinstance(loader.dataset, IterableDatasetShard)  # 3 shards cannot split over 2 processes: read by all
    uneven = Files(range(4))
    uneven.shard = lambda num_shards, index: Files(range(4)[index::num_shards], size=5 + index)
    loaders = [
        prepare_data_loader(DataLoader(uneven, batch_size=2), num_processes=2, process_index=i) for i in range(2)
    ]
    assert all(isinstance(l.dataset, Files) for l in loaders), "sharded natively, also with even_batches=True"
    for l in loaders:
        l.track_padding()
    seen = [[(b.tolist(), l.batch_real_count) for b in l] for l in loaders]
    assert [len(s) for s in seen] == [len(l) for l in loaders] == [6, 6], "equal counts from the parts' lengths"
    assert seen[0][-1] == (seen[0][0][0], 0), "the shorter part pads with its first batch, marked as padding"
    real = sorted(x for s in seen for batch, count in s for x in batch[:count])
    assert real == sorted(list(uneven.shard(2, 0)) + list(uneven.shard(2, 1))), "every element once, padding apart"
    uneven_false = [
        prepare_data_loader(DataLoader(uneven, batch_size=2), num_processes=2, process_index=i, even_batches=False)
        for i in range(2)
    ]
    assert [len(rows(l)) for l in uneven_false] == [len(l) for l in uneven_false] == [5, 6], "no padding"
    dropped = [
        prepare_data_loader(DataLoader(uneven, batch_size=2, drop_last=True), num_processes=2, process_index=i)
        for i in range(2)
    ]
    assert [len(rows(l)) for l in dropped] == [len(l) for l in dropped] == [5, 5], "stop where the shorter part ends"


def test_a_natively_sharded_stream_refuses_to_resize():
    loader = prepare_data_loader(DataLoader(Files(range(4)), batch_size=5), num_processes=2, process_index=0)
    next(iter(loader))
    position = loader.state_dict()
    assert (position["unit"], position["num_processes"]) == ("batches", 2)
    resized = prepare_data_loader(DataLoader(Files(range(4)), batch_size=5), num_processes=4, process_index=0)
    with pytest.raises(ValueError, match="cannot move from 2 to 4 processes"):
        resized.load_state_dict(position)  # refused on loading, before anything changes


def test_a_stream_that_splits_itself_by_worker_and_whose_shards_do_not_divide_warns_that_every_process_reads_it(caplog):
    with caplog.at_level("WARNING", logger="shardplug.core.planner"):
        prepare_data_loader(DataLoader(Files(range(3)), batch_size=2), num_processes=2, process_index=0)
    assert any(
        "n_shards=3" in r.getMessage() and "every process reads the whole stream" in r.getMessage()
        for r in caplog.records
    )


class _Undeclared(PlainShards):
    splits_by_worker = None  # says nothing: does its __iter__ read only its worker's part?


def test_a_stream_that_shards_itself_with_workers_must_say_whether_it_splits_by_worker():
    with pytest.raises(ValueError, match="declare splits_by_worker = True .* or splits_by_worker = False"):
        prepare_data_loader(
            DataLoader(_Undeclared(range(4)), batch_size=2, num_workers=2), num_processes=2, process_index=0
        )
    prepare_data_loader(DataLoader(_Undeclared(range(4)), batch_size=2), num_processes=2, process_index=0)  # no workers


class _SplitsQuietly(torch.utils.data.IterableDataset):
    """Reads only its worker's elements, as torch's documentation shows, and declares nothing."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter(range(0 if info is None else info.id, 16, 1 if info is None else info.num_workers))


class _SplitsAndSaysSo(_SplitsQuietly):
    splits_by_worker = True


def test_a_stream_that_asks_for_its_worker_must_say_whether_it_splits_by_worker():
    with pytest.raises(ValueError, match="get_worker_info.*declare splits_by_worker = True"):
        prepare_data_loader(DataLoader(_SplitsQuietly(), batch_size=2, num_workers=2), num_processes=2, process_index=0)
    got = []
    for i in range(2):
        loader = prepare_data_loader(
            DataLoader(_SplitsAndSaysSo(), batch_size=2, num_workers=2), num_processes=2, process_index=i
        )
        got += [x for batch in loader for x in batch.tolist()]
    assert sorted(got) == list(range(16)), "declared: each worker's part shared by process, every element once"


def test_shards_that_do_not_divide_are_read_once_and_balanced_by_rows():
    """3 shards of 5 over 2 processes: one shard each by itself, the third's rows shared."""
    loaders = [
        prepare_data_loader(DataLoader(PlainShards(range(3)), batch_size=2), num_processes=2, process_index=i)
        for i in range(2)
    ]
    for loader in loaders:
        loader.track_padding()
    seen = [[(b.tolist(), l.batch_real_count) for b in l] for l in loaders]
    real = [[x for batch, count in part for x in batch[:count]] for part in seen]
    assert real == [[0, 1, 2, 3, 4, 200, 202, 204], [100, 101, 102, 103, 104, 201, 203]]
    assert [len(part) for part in seen] == [len(l) for l in loaders] == [4, 4], "equal counts from the parts' lengths"
    assert [batch for batch, _ in seen[1]] == [[100, 101], [102, 103], [104, 201], [203]]


def test_a_dropped_prepared_loader_is_freed_without_the_garbage_collector():
    """No reference cycle through its pass or its position keeper: a loader dropped (with a
    StatefulDataLoader's iterator and workers it holds) is freed at once, not at a later collection
    that could run inside a freshly forked worker."""
    import gc
    import weakref

    loader = prepare_data_loader(DataLoader(list(range(10)), batch_size=2), num_processes=1, process_index=0)
    for _ in loader:
        pass
    loader.state_dict()
    dropped = weakref.ref(loader)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del loader
        assert dropped() is None, "freed by its reference count alone"
    finally:
        if enabled:
            gc.enable()


class _OwnIterator(DataLoader):
    """A DataLoader that is its own iterator (as Ray Train's ``prepare_data_loader`` wraps a loader: ``_dataloader``
    the DataLoader it reads, ``device`` where it moves each batch)."""

    def __init__(self, inner: DataLoader | None, device: str = "cpu") -> None:
        self.__dict__.update(getattr(inner, "__dict__", {}))
        self._dataloader, self.device, self.reading = inner, torch.device(device), None

    def __iter__(self):
        self.reading = iter(self._dataloader)
        return self

    def __next__(self):
        return next(self.reading)


def test_a_loader_that_is_its_own_iterator_is_prepared_by_the_loader_it_wraps_or_refused():
    """Its ``__iter__`` returns itself, so shardplug's pass cannot read through it (it recursed until Python's
    limit): the DataLoader it wraps is prepared (a DistributedSampler of the job's adopted: torch's batches);
    one that moves batches off the CPU needs put_on_device=True, one that wraps no DataLoader is refused."""
    sampler = DistributedSampler(range(10), 2, 1, shuffle=True, seed=3)
    wrapped = _OwnIterator(DataLoader(range(10), batch_size=2, sampler=sampler))
    prepared = prepare_data_loader(wrapped, num_processes=2, process_index=1)
    assert [b.tolist() for b in prepared] == [b.tolist() for b in wrapped] and len(prepared) == 3
    with pytest.raises(ValueError, match="moves each batch to cuda.*pass put_on_device=True"):
        prepare_data_loader(_OwnIterator(DataLoader(range(4)), "cuda"), num_processes=1, process_index=0)
    with pytest.raises(TypeError, match="_OwnIterator, a DataLoader that is its own iterator"):
        prepare_data_loader(_OwnIterator(None), num_processes=1, process_index=0)
