"""A BatchSamplerShard built directly over a standard batch sampler takes the arithmetic path, and
yields exactly what walking the batch sampler yields (issue item 5; speed: benchmarks/run.py P9)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from shardplug import BatchSamplerShard
from shardplug.core.sharding.arithmetic import walk_shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.shuffle.seedable import advance_past_randperm


def _sampler(kind: str, n: int, seed: int):
    if kind == "sequential":
        return SequentialSampler(range(n))
    if kind == "generator":
        return RandomSampler(range(n), generator=torch.Generator().manual_seed(seed))
    return RandomSampler(range(n))  # draws its seed from the global RNG, as the walked one does


layouts = st.tuples(
    st.integers(0, 60),  # dataset length
    st.integers(1, 9),  # batch size
    st.integers(1, 4),  # processes
    st.booleans(),  # split_batches
    st.booleans(),  # even_batches
    st.booleans(),  # drop_last
)


@settings(max_examples=300, deadline=None)
@given(
    layout=layouts,
    kind=st.sampled_from(["sequential", "generator", "global"]),
    rank=st.integers(0, 3),
    start=st.integers(0, 12),
    seed=st.integers(0, 2**31),
)
def test_arithmetic_shard_equals_the_walked_one(layout, kind, rank, start, seed):
    n, batch_size, processes, split, even, drop_last = layout
    if split:
        batch_size *= processes
    rank %= processes
    if kind != "sequential":
        n = max(n, 1)  # RandomSampler refuses an empty dataset
    ours_sampler, walked_sampler = _sampler(kind, n, seed), _sampler(kind, n, seed)
    shard = BatchSamplerShard(BatchSampler(ours_sampler, batch_size, drop_last), processes, rank, split, even)
    assert shard.plan.arithmetic(), "a standard batch sampler takes the arithmetic path"
    shard_layout = ShardLayout.for_batches(batch_size, processes, rank, split, even, drop_last)
    for epoch in range(2):  # the second epoch shows the generators were left alike
        skip = start if epoch == 0 else 0
        shard.start_at_global(skip)
        torch.manual_seed(seed + epoch)
        try:
            ours = list(shard)
        except ValueError as exc:  # nothing to pad from: the walked path refuses alike
            ours = exc
        global_after_ours = torch.get_rng_state()
        torch.manual_seed(seed + epoch)
        try:
            walked = list(
                walk_shard(BatchSampler(walked_sampler, batch_size, drop_last), batch_size, shard_layout, skip)
            )
        except ValueError as exc:
            walked = exc
        if isinstance(walked, Exception):
            assert isinstance(ours, Exception) or ours == [], (ours, walked)
            return
        assert ours == walked
        assert torch.equal(global_after_ours, torch.get_rng_state()), "the global RNG drawn alike"
        if kind == "generator":
            assert torch.equal(ours_sampler.generator.get_state(), walked_sampler.generator.get_state())


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 5000), seed=st.integers(0, 2**31))
def test_advancing_a_generator_past_a_randperm_equals_drawing_it(n, seed):
    drawn, advanced = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    torch.randperm(n, generator=drawn)
    advance_past_randperm(advanced, n)
    assert torch.equal(drawn.get_state(), advanced.get_state())


def test_a_global_rng_shuffle_draws_as_much_of_the_global_rng_as_the_sampler():
    ours = BatchSamplerShard(BatchSampler(RandomSampler(range(50)), 4, False), 2, 1)
    torch.manual_seed(3)
    list(ours)
    after_ours = torch.get_rng_state()
    torch.manual_seed(3)
    list(BatchSampler(RandomSampler(range(50)), 4, False))
    assert torch.equal(after_ours, torch.get_rng_state())


def test_the_benchmark_figure_runs_at_a_tiny_size():
    import importlib.util
    import os
    import sys

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "run.py"
    )
    spec = importlib.util.spec_from_file_location("_bench_run", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["_bench_run"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    rows = bench.p2_direct_shards(2_000, 1)
    assert [("generator" in row.figure, row.figure.startswith("P2 ")) for row in rows] == [(False, True), (True, True)]
    assert all(row.ours > 0 and row.baseline > 0 for row in rows), "a ratio against a randperm of the same run"
