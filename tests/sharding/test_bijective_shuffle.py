"""The bijective shuffle (docs/sharding.md, "Shuffling"): a bijection for every n, statistical quality, and the same
orders on every process and number of processes (the plan properties run over it too)."""

from __future__ import annotations

import math

import pytest
import torch
from _datasets import rows
from torch.utils.data import BatchSampler, DataLoader

from shardplug import BatchSamplerShard, ShardplugConfig, prepare_data_loader
from shardplug.core.shuffle.seedable import BijectiveRandomSampler, KeyedPermutation


def _order(n, seed, epoch=0):
    return KeyedPermutation(n, seed, epoch)(torch.arange(n, dtype=torch.int64))


def _chi_square_critical(df: int, z: float = 3.72) -> float:
    """The chi-square value exceeded with probability ~1e-4 (Wilson-Hilferty; z = normal quantile)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: torch.Tensor) -> float:
    expected = counts.sum().item() / counts.numel()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_a_bijection_of_every_n_from_0_to_3000():
    for n in range(0, 3001):
        assert torch.equal(_order(n, seed=n).sort().values, torch.arange(n)), f"not a permutation of range({n})"


@pytest.mark.parametrize("n", [2**40 + 17, 10**9, 2**62])
def test_large_n_by_sampling_distinct_and_in_range(n):
    perm = KeyedPermutation(n, seed=7, epoch=3)
    positions = torch.cat(
        [torch.arange(50_000), torch.randint(0, n, (50_000,), generator=torch.Generator().manual_seed(1))]
    )
    positions = positions.unique()
    values = perm(positions)
    assert int(values.min()) >= 0 and int(values.max()) < n, "every value inside [0, n)"
    assert values.unique().numel() == positions.numel(), "distinct positions give distinct values"
    assert torch.equal(perm(positions[:100]), values[:100]), "a position's value does not depend on what else is asked"


@pytest.mark.parametrize("n", [10, 16, 37])
def test_each_position_is_uniform_over_seeds(n):
    """Chi-square per position over 3000 seeds: position k's value is uniform on [0, n)."""
    seeds = 3000
    counts = torch.zeros(n, n, dtype=torch.int64)  # counts[position, value]
    for seed in range(seeds):
        counts[torch.arange(n), _order(n, seed)] += 1
    critical = _chi_square_critical(n - 1)
    worst = max(_chi_square(counts[k]) for k in range(n))
    assert worst < critical, f"a position's value is not uniform: chi-square {worst:.1f} >= {critical:.1f}"


def test_neighbouring_positions_are_independent_over_seeds():
    """Chi-square over the ordered pairs (perm[0], perm[1]) and (perm[3], perm[4]): uniform on the n(n-1) pairs."""
    n, seeds = 8, 12_000
    for first in (0, 3):
        counts = torch.zeros(n, n, dtype=torch.int64)
        for seed in range(seeds):
            order = _order(n, seed)
            counts[order[first], order[first + 1]] += 1
        off_diagonal = counts[~torch.eye(n, dtype=torch.bool)]
        assert int(counts.diagonal().sum()) == 0
        critical = _chi_square_critical(n * (n - 1) - 1)
        assert _chi_square(off_diagonal) < critical, "neighbouring positions are correlated"


def _correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return float((x * y).sum() / (x.norm() * y.norm()))


@pytest.mark.parametrize("seed", [0, 1, 2**63])
def test_no_correlation_between_neighbours_or_with_the_position(seed):
    n = 200_000
    order = _order(n, seed)
    bound = 5 / math.sqrt(n)  # about 5 standard deviations of the correlation of independent values
    assert abs(_correlation(order[:-1], order[1:])) < bound, "value at k+1 follows the value at k"
    assert abs(_correlation(torch.arange(n), order)) < bound, "values follow positions"
    gaps = (order[1:] - order[:-1]).abs()
    assert gaps.unique().numel() > n // 4, "neighbours are a few fixed strides apart"


def test_epochs_and_seeds_give_different_orders():
    n = 1000
    base = _order(n, seed=5, epoch=0)
    for other in (_order(n, seed=5, epoch=1), _order(n, seed=6, epoch=0)):
        assert (other == base).float().mean() < 0.02, "two orders agree at more positions than chance"
    assert torch.equal(_order(n, seed=5, epoch=0), base), "the same (seed, epoch) gives the same order"


def test_the_sampler_and_the_shard_compute_the_same_rows():
    n = 1003
    sampler = BijectiveRandomSampler(range(n), data_seed=9)
    sampler.set_epoch(2)
    order = list(sampler)
    assert sorted(order) == list(range(n))
    whole = [order[k : k + 8] for k in range(0, n - 7, 8)]  # drop_last: full batches only
    for rank in range(3):
        sampler_copy = BijectiveRandomSampler(range(n), data_seed=9)
        sampler_copy.set_epoch(2)
        shard = BatchSamplerShard(BatchSampler(sampler_copy, 8, True), num_processes=3, process_index=rank)
        assert list(shard) == whole[rank : len(whole) // 3 * 3 : 3], "computed rows equal the sampler's order"


def test_prepare_data_loader_shuffle_algorithm():
    def shards(world, algorithm="bijective"):
        return [
            prepare_data_loader(
                DataLoader(range(50), batch_size=4, shuffle=True),
                num_processes=world,
                process_index=r,
                data_seed=3,
                shuffle_algorithm=algorithm,
            )
            for r in range(world)
        ]

    two = shards(2)
    assert all(isinstance(l.batch_sampler.sampler, BijectiveRandomSampler) for l in two)
    epoch0 = [rows(l) for l in two]
    epoch1 = [rows(l) for l in two]
    assert epoch0 != epoch1
    for epoch in (epoch0, epoch1):
        real = [x for shard in epoch for batch in shard for x in batch]
        assert set(real) == set(range(50))
    reference = list(BijectiveRandomSampler(range(50), data_seed=3))
    assert epoch0[0][0] == reference[:4] and epoch0[1][0] == reference[4:8], "the order does not depend on N"
    assert [b for b in rows(shards(1)[0])] != [b for b in rows(shards(1, "randperm")[0])]
    with pytest.raises(ValueError, match="shuffle_algorithm='bijective' needs a shuffled DataLoader"):
        prepare_data_loader(DataLoader(range(50), batch_size=4), shuffle_algorithm="bijective")
    with pytest.raises(ValueError, match="shuffle_algorithm='feistel'"):
        prepare_data_loader(DataLoader(range(50), batch_size=4, shuffle=True), shuffle_algorithm="feistel")
    with pytest.raises(ValueError, match="shuffle_algorithm='feistel'"):
        ShardplugConfig(shuffle_algorithm="feistel")


def test_a_bijective_shuffle_resumes_in_constant_time_and_exactly():
    n = 10**9  # never materialised: the first batch after resuming costs O(batch)

    class Indices:
        def __len__(self):
            return n

        def __getitem__(self, i):
            return i

    def make():
        return prepare_data_loader(
            DataLoader(Indices(), batch_size=4, shuffle=True),
            num_processes=1024,
            process_index=7,
            data_seed=1,
            shuffle_algorithm="bijective",
        )

    loader = make()
    first = next(iter(loader)).tolist()
    perm = KeyedPermutation(n, seed=1, epoch=0)
    assert first == perm(torch.arange(7 * 4, 8 * 4)).tolist()
    loader.resume.resume_at(epoch=0, batches_yielded=100_000)
    resumed = next(iter(loader)).tolist()
    start = (100_000 * 1024 + 7) * 4
    assert resumed == perm(torch.arange(start, start + 4)).tolist()


def test_a_position_does_not_cross_shuffle_algorithms():
    def make(algorithm):
        return prepare_data_loader(
            DataLoader(range(40), batch_size=4, shuffle=True),
            num_processes=2,
            process_index=0,
            data_seed=1,
            shuffle_algorithm=algorithm,
        )

    loader = make("randperm")
    next(iter(loader))
    with pytest.raises(
        ValueError, match="sampler='seedable_random' differs from this loader's sampler='bijective_random'"
    ):
        make("bijective").load_state_dict(loader.state_dict())
