"""BatchSamplerShard and SeedableRandomSampler: the worked examples of docs/sharding.md and properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from shardplug import BatchSamplerShard, SeedableRandomSampler, prepare_data_loader
from shardplug.core.sharding.arithmetic import ArithmeticShard, EpochOrder, walk_shard
from shardplug.core.sharding.layout import ShardLayout


def shards(n, b, num_processes, split=False, even=True, drop_last=False):
    return [
        list(BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, drop_last), num_processes, i, split, even))
        for i in range(num_processes)
    ]


# docs/sharding.md table: (n, b, split, even, drop_last) -> expected per-process batches (N = 2).
SEQ = lambda start, stop, b: [list(range(k, min(k + b, stop))) for k in range(start, stop, b)]  # noqa: E731


@pytest.mark.parametrize(
    "n,b,split,even,drop_last,p0,p1",
    [
        (
            24,
            3,
            False,
            True,
            False,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [21, 22, 23]],
        ),
        (
            21,
            3,
            False,
            True,
            False,
            [[0, 1, 2], [6, 7, 8], [12, 13, 14], [18, 19, 20]],
            [[3, 4, 5], [9, 10, 11], [15, 16, 17], [0, 1, 2]],
        ),
        (2, 3, False, True, False, [[0, 1, 0]], [[1, 0, 1]]),
        (8, 4, True, True, False, [[0, 1], [4, 5]], [[2, 3], [6, 7]]),
        (2, 4, True, True, False, [[0, 1]], [[0, 1]]),
    ],
)
def test_spec_table_full_rows(n, b, split, even, drop_last, p0, p1):
    assert shards(n, b, 2, split, even, drop_last) == [p0, p1]


@pytest.mark.parametrize(
    "n,b,split,even,drop_last,last0,last1,len0,len1",
    [
        (22, 3, False, True, False, [18, 19, 20], [21, 0, 1], 4, 4),
        (20, 3, False, True, False, [18, 19, 0], [1, 2, 3], 4, 4),
        (22, 3, False, False, False, [18, 19, 20], [21], 4, 4),
        (21, 3, False, False, False, [18, 19, 20], [15, 16, 17], 4, 3),
        (21, 3, False, True, True, [12, 13, 14], [15, 16, 17], 3, 3),
        (22, 4, True, True, False, [20, 21], [0, 1], 6, 6),
        (21, 4, True, True, False, [20, 0], [1, 2], 6, 6),
        (21, 4, True, False, False, [20], [18, 19], 6, 5),
    ],
)
def test_spec_table_endings(n, b, split, even, drop_last, last0, last1, len0, len1):
    p0, p1 = shards(n, b, 2, split, even, drop_last)
    assert (p0[-1], p1[-1], len(p0), len(p1)) == (last0, last1, len0, len1)


def test_spec_three_processes():
    assert shards(10, 3, 3) == [[[0, 1, 2], [9, 0, 1]], [[3, 4, 5], [2, 3, 4]], [[6, 7, 8], [5, 6, 7]]]


VARIABLE = [[0, 1], [2, 3, 4], [5], [6, 7, 8, 9], [10]]


def test_spec_variable_size_even():
    assert [list(BatchSamplerShard(VARIABLE, 2, i)) for i in range(2)] == [
        [[0, 1], [5], [10]],
        [[2, 3, 4], [6, 7, 8, 9], [0, 1]],
    ]


def test_spec_variable_size_uneven():
    assert [list(BatchSamplerShard(VARIABLE, 2, i, even_batches=False)) for i in range(2)] == [
        [[0, 1], [5], [10]],
        [[2, 3, 4], [6, 7, 8, 9]],
    ]


def test_padding_never_mutates_the_users_lists():
    cached = [[0, 1, 2], [3, 4, 5], [6, 7]]
    snapshot = [list(b) for b in cached]

    class Cached:
        batch_size, drop_last = 3, False

        def __iter__(self):
            return iter(cached)

        def __len__(self):
            return len(cached)

    for split in (False,):
        for i in range(2):
            list(BatchSamplerShard(Cached(), 2, i, split_batches=split))
    assert cached == snapshot


def test_batches_longer_than_declared_batch_size_are_an_error():
    class Liar:
        batch_size, drop_last = 2, False

        def __iter__(self):
            return iter([[0, 1, 2]])

    with pytest.raises(ValueError, match=r"batch of 3 indices.*batch_size=2"):
        list(BatchSamplerShard(Liar(), 2, 0))


def test_short_batches_mid_stream_are_delivered_not_lost():
    class Short:  # declares 4, yields 3-item batches (a known reference failure: samples lost, counts differ)
        batch_size, drop_last = 4, False

        def __iter__(self):
            return iter([[k, k + 1, k + 2] for k in range(0, 18, 3)])

    got = [list(BatchSamplerShard(Short(), 2, i)) for i in range(2)]
    assert len(got[0]) == len(got[1]) == 3
    seen = sorted(x for shard in got for batch in shard for x in batch)
    # every sample once; the short final batch is completed with the epoch's first index (padding)
    assert seen == sorted(list(range(18)) + [0])


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_num_processes(bad):
    with pytest.raises(ValueError, match="num_processes"):
        BatchSamplerShard(BatchSampler(range(4), 2, False), bad, 0)


def test_bad_process_index():
    with pytest.raises(ValueError, match=r"process_index=2 .*\[0, 2\)"):
        BatchSamplerShard(BatchSampler(range(4), 2, False), 2, 2)


def test_split_needs_divisible_batch_size():
    with pytest.raises(ValueError, match=r"batch_size=3 and num_processes=2"):
        BatchSamplerShard(BatchSampler(range(4), 3, False), 2, 0, split_batches=True)
    with pytest.raises(ValueError, match="batch_size=None"):
        BatchSamplerShard(VARIABLE, 2, 0, split_batches=True)


def test_shard_exposes_sampler_and_forwards_set_epoch():
    sampler = SeedableRandomSampler(range(10), data_seed=1)
    shard = BatchSamplerShard(BatchSampler(sampler, 2, False), 2, 0)
    assert shard.sampler is sampler
    shard.set_epoch(3)
    assert sampler.epoch == 3


class EvenRandomSampler(RandomSampler):
    """A user's RandomSampler subclass: the even indices only; it records the epochs it is given."""

    def __init__(self, data, **kwargs):
        super().__init__(data, **kwargs)
        self.epochs = []

    def __iter__(self):
        return (i for i in super().__iter__() if i % 2 == 0)

    def __len__(self):
        return (len(self.data_source) + 1) // 2

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_random_sampler_of_the_users_own_is_sharded_as_it_is(workers):
    """Only torch's own RandomSampler is replaced by shardplug's shuffle: a subclass keeps its order
    and its set_epoch, and so does a plain RandomSampler given a set_epoch (Lightning's tests do that).
    Across processes (2 here, with data_seed; agreed from process 0 in tests/sharding/test_multiprocess.py)
    its indices are shared out, each once."""
    sampler = EvenRandomSampler(range(10))
    user = DataLoader(range(10), batch_size=2, sampler=sampler, num_workers=workers)
    loaders = [prepare_data_loader(user, num_processes=2, process_index=i, data_seed=3) for i in range(2)]
    for epoch in range(2):
        per_rank = [[batch.tolist() for batch in loader] for loader in loaders]
        order = [i for step in zip(*per_rank) for batch in step for i in batch]  # the global batches in turn
        assert sorted(order[:5]) == [0, 2, 4, 6, 8], f"epoch {epoch}: each index the subclass yields, once"
        assert order[5:] == order[:3], "then padding from the epoch's start (both ranks drew one order)"
    assert sampler.epochs == [1, 1] and sampler.generator is None  # each later pass's epoch (0: as built); untouched
    given = RandomSampler(range(10))
    calls: list[int] = []
    given.set_epoch = calls.append  # any set_epoch makes a RandomSampler the user's
    loader = prepare_data_loader(DataLoader(range(10), batch_size=2, sampler=given), num_processes=1)
    loader.set_epoch(4)
    assert calls == [4]  # only the epoch set: preparing adds no call (it stands at epoch 0 as built)
    assert not isinstance(loader.batch_sampler.sampler, SeedableRandomSampler)
    plain = prepare_data_loader(DataLoader(range(10), batch_size=2, shuffle=True), num_processes=1)
    assert isinstance(plain.batch_sampler.sampler, SeedableRandomSampler)  # torch's own: replaced, as before
    with pytest.raises(ValueError, match="EvenRandomSampler, a RandomSampler subclass of your own"):
        prepare_data_loader(DataLoader(range(10), sampler=sampler), shuffle_algorithm="bijective")
    with pytest.raises(ValueError, match="use_seedable_sampler=True only replaces torch's own RandomSampler"):
        seeded = EvenRandomSampler(range(10), generator=torch.Generator().manual_seed(1))
        prepare_data_loader(DataLoader(range(10), sampler=seeded), data_seed=3)


def test_seedable_sampler_is_a_pure_function_of_seed_and_epoch():
    a, b = SeedableRandomSampler(range(50), data_seed=5), SeedableRandomSampler(range(50), data_seed=5)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    b.set_epoch(3)
    assert list(a) != list(b)
    assert isinstance(a, RandomSampler)


def test_random_sampler_fast_path_matches_plain_random_sampler_over_epochs():
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    plain = BatchSampler(RandomSampler(range(23), generator=g1), 4, False)
    shard = BatchSamplerShard(BatchSampler(RandomSampler(range(23), generator=g2), 4, False), 1, 0)
    for _ in range(3):  # later epochs too: the generator is advanced exactly as RandomSampler does
        assert list(shard) == list(plain)


def test_skip_next_is_one_shot_and_by_indices():
    shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(20)), 2, False), 2, 1)
    full = list(shard)
    shard.skip_next(3)
    assert len(shard) == len(full) - 3
    assert list(shard) == full[3:]
    assert list(shard) == full


# -- properties ---------------------------------------------------------------------------------------
layouts = st.tuples(
    st.integers(0, 60),  # n
    st.integers(1, 7),  # b
    st.integers(1, 4),  # N
    st.booleans(),  # split
    st.booleans(),  # even
    st.booleans(),  # drop_last
)


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_arithmetic_and_walk_agree_and_len_is_exact(params):
    n, b, num, split, even, drop_last = params
    if split:
        b = b * num
    for i in range(num):
        layout = ShardLayout(num, i, split, even, drop_last)
        walked = list(walk_shard(BatchSampler(SequentialSampler(range(n)), b, drop_last), b, layout))
        plan = ArithmeticShard(EpochOrder(n), b, drop_last, layout)
        assert list(plan.rows()) == walked
        assert len(plan) == len(walked)
        shard = BatchSamplerShard(BatchSampler(SequentialSampler(range(n)), b, drop_last), num, i, split, even)
        assert len(shard) == len(list(shard)) == len(walked)
        for start in (1, len(walked) // 2):
            assert list(plan.rows(start)) == walked[start:]


def _check_union(per_process, n, b, num, split, even, drop_last):
    counts = [len(p) for p in per_process]
    if even or drop_last:
        assert len(set(counts)) == 1
    if drop_last:
        assert all(len(batch) == (b // num if split else b) for p in per_process for batch in p)
    # Reading round-robin gives the dataset in order, then only padding.
    flat = []
    for k in range(max(counts, default=0)):
        for p in per_process:
            if k < len(p):
                flat.extend(p[k])
    real = flat[:n]
    if not drop_last:
        assert real == list(range(n))
        if not even:
            assert flat == list(range(n))
        else:  # padding is the epoch's order, cycled from its start
            assert flat[n:] == [k % n for k in range(len(flat) - n)]
    else:
        assert flat == list(range(len(flat)))


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_union_of_shards_is_the_dataset(params):
    n, b, num, split, even, drop_last = params
    if split:
        b = b * num
    per_process = shards(n, b, num, split, even, drop_last)
    _check_union(per_process, n, b, num, split, even, drop_last)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=0, max_size=15),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
)
def test_variable_size_batches(sizes, num, even, drop_last):
    batches, k = [], 0
    for size in sizes:
        batches.append(list(range(k, k + size)))
        k += size

    class Variable:
        batch_size = None

        def __init__(self):
            self.drop_last = drop_last

        def __iter__(self):
            return iter(batches)

        def __len__(self):
            return len(batches)

    per_process = [list(BatchSamplerShard(Variable(), num, i, even_batches=even)) for i in range(num)]
    counts = [len(p) for p in per_process]
    for i, p in enumerate(per_process):
        assert len(BatchSamplerShard(Variable(), num, i, even_batches=even)) == len(p)
    if even or drop_last:
        assert len(set(counts)) == 1
    seen = [x for p in per_process for batch in p for x in batch]
    if drop_last:
        assert sorted(seen) == list(range(len(seen)))
    else:
        assert set(seen) == set(range(k))
        if not even:
            assert sorted(seen) == list(range(k))
