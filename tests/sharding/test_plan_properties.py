"""One contract for every plan, from one oracle (hypothesis).

For each kind of sharding shardplug decides itself -- a standard batch sampler (index
arithmetic), a user's batch sampler (walked), a stream every process reads (stream positions) --
and every option (split_batches, even_batches, drop_last, shuffle), over N processes:

* ``len()`` equals what is yielded: before, during and after a resume;
* the union of the shards minus the marked padding is exactly the epoch (``drop_last``: what
  the oracle says survives, each sample at most once);
* ``even_batches=True`` (or ``drop_last``) gives every process the same number of batches;
* a position taken at any point, identical on every process, loads into fresh loaders on N or M
  processes, which yield exactly the rest of the epoch;

with either shuffle (``randperm`` or the bijective one).

Streams run on 2 or more processes: on one process shardplug passes a stream's batches through.
A stream that shards itself (its batches are this process's part) keeps the same contract with
the same number of processes, and refuses another one.

Ranks are simulated in one process (explicit num_processes / process_index).
"""

from __future__ import annotations

import pytest
from _datasets import Files, Stream, rows
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from shardplug import BijectiveRandomSampler, SeedableRandomSampler, prepare_data_loader

KINDS = ("arithmetic", "walked", "stream")


class WalkedBatchSampler(BatchSampler):
    """A user's batch sampler: shardplug cannot compute it, so it walks it."""


def make_loader(kind, n, b, world, rank, split, even, drop_last, shuffle, algorithm="randperm"):
    bijective = shuffle and algorithm == "bijective"
    if kind == "arithmetic":
        user = DataLoader(range(n), batch_size=b, shuffle=shuffle, drop_last=drop_last)
    elif kind == "walked":
        shuffled = BijectiveRandomSampler if bijective else SeedableRandomSampler
        sampler = shuffled(range(n), data_seed=5) if shuffle else SequentialSampler(range(n))
        user = DataLoader(range(n), batch_sampler=WalkedBatchSampler(sampler, b, drop_last))
    else:
        user = DataLoader(Stream(n), batch_size=b, drop_last=drop_last)
    loader = prepare_data_loader(
        user,
        num_processes=world,
        process_index=rank,
        split_batches=split,
        even_batches=even,
        data_seed=5,
        shuffle_algorithm="bijective" if bijective and kind == "arithmetic" else "randperm",
    )
    loader.track_padding()
    return loader


def oracle_real_count(n, b, world, split, drop_last):
    """How many samples of an ``n``-sample epoch are consumed as real samples (the contract).

    Every sample once, unless ``drop_last``: then only whole steps survive, a step being one global
    batch of ``b`` when splitting, ``world`` batches of ``b`` otherwise."""
    if not drop_last:
        return n
    step = b if split else b * world
    return n // step * step


def take(loader, batches=None):
    """(real samples, number of batches) of up to ``batches`` batches of the loader's next pass."""
    real, count = [], 0
    for batch in loader:
        indices, kept = loader.batch_indices, loader.batch_real_count
        assert batch.tolist()[: len(indices)] == indices, "batch_indices describe the batch handed out"
        real += indices[:kept]
        count += 1
        if batches is not None and count == batches:
            break
    return real, count


def check_epoch(real, n, b, world, split, drop_last):
    expected = oracle_real_count(n, b, world, split, drop_last)
    assert len(real) == expected, f"{len(real)} real samples consumed, the contract says {expected}"
    assert len(set(real)) == len(real), "a sample was consumed twice"
    assert set(real) <= set(range(n))


options = st.tuples(
    st.sampled_from(KINDS),
    st.integers(0, 40),  # n
    st.integers(1, 4),  # b (times 12 when splitting, so that every world size divides it)
    st.integers(1, 4),  # N
    st.integers(1, 4),  # M, the world size after the resume
    st.booleans(),  # split
    st.booleans(),  # even
    st.booleans(),  # drop_last
    st.booleans(),  # shuffle
    st.sampled_from(["randperm", "bijective"]),  # the shuffle's algorithm
    st.floats(0, 1),  # where to save the position, as a fraction of the epoch
)


@settings(max_examples=250, deadline=None)
@given(options)
# 1 of 2 samples consumed on 1 process, resumed on 2 with drop_last: no step of 2 is left in the epoch
@example(("arithmetic", 2, 1, 1, 2, False, False, True, False, "randperm", 0.5))
def test_every_plan_keeps_the_contract_before_during_and_after_a_resume(params):
    kind, n, b, world, world_after, split, even, drop_last, shuffle, algorithm, where = params
    # A stream on one process is not sharded by shardplug (its batches pass through, unit "batches").
    assume(kind != "stream" or min(world, world_after) > 1)
    assume(n > 0 or not shuffle)  # RandomSampler refuses an empty dataset
    if split:
        b *= 12
    args = dict(n=n, b=b, split=split, even=even, drop_last=drop_last, shuffle=shuffle, algorithm=algorithm)
    # An uninterrupted epoch on N processes.
    fresh = [make_loader(kind, world=world, rank=r, **args) for r in range(world)]
    lengths = [len(loader) for loader in fresh]
    taken = [take(loader) for loader in fresh]
    assert [count for _, count in taken] == lengths, "len() equals what is yielded"
    if world > 1 and (even or drop_last):
        assert len(set(lengths)) == 1, "every process yields as many batches"
    check_epoch([x for real, _ in taken for x in real], n, b, world, split, drop_last)

    # The same epoch, interrupted after k batches of every process and resumed on M processes.
    k = int(min(lengths, default=0) * where)
    first = [make_loader(kind, world=world, rank=r, **args) for r in range(world)]
    before = []
    for loader in first:
        real, count = take(loader, k) if k else ([], 0)
        assert count == k
        before += real
    positions = [loader.state_dict() for loader in first]
    assert all(p == positions[0] for p in positions), "the position is identical on every process"
    next_epoch = positions[0]["epoch"] == 1  # the position was taken as the last batch was handed out
    assert next_epoch == (k > 0 and k == max(lengths))
    after = []
    moved_on = set()
    for rank in range(world_after):
        resumed = make_loader(kind, world=world_after, rank=rank, **args)
        resumed.load_state_dict(positions[0])
        moved_on.add(resumed.epoch > positions[0]["epoch"])
        expected_len = len(resumed)
        real, count = take(resumed)
        assert count == expected_len, "len() after load_state_dict equals what the resumed pass yields"
        assert len(resumed) == len(make_loader(kind, world=world_after, rank=rank, **args)), "the next pass is whole"
        after += real
    assert len(moved_on) == 1, "every process resumes in the same epoch"
    if moved_on == {True}:  # the rest of the epoch fills no step of the new layout: the next epoch, whole
        step = b if split else b * world_after
        assert drop_last and n - len(before) < step, "only samples drop_last drops are left behind"
        assert len(set(before)) == len(before) and set(before) <= set(range(n))
        check_epoch(after, n, b, world_after, split, drop_last)
        return
    if next_epoch:  # the resumed run starts the next epoch, as a fresh run on M processes would
        check_epoch(before, n, b, world, split, drop_last)
        check_epoch(after, n, b, world_after, split, drop_last)
        return
    real = before + after
    if drop_last and world_after != world:  # the rest is cut into whole steps of the new size
        assert len(set(real)) == len(real) and set(real) <= set(range(n))
    else:
        check_epoch(real, n, b, world, split, drop_last)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),  # N
    st.integers(1, 3),  # files per process
    st.integers(1, 6),  # records per file
    st.integers(1, 4),  # b
    st.booleans(),  # drop_last
    st.floats(0, 1),  # where to save the position
)
def test_a_natively_sharded_stream_keeps_the_contract_and_resumes_with_the_same_processes(
    world, files, size, b, drop_last, where
):
    dataset = Files(range(world * files), size)

    def make(num, rank):
        return prepare_data_loader(
            DataLoader(dataset, batch_size=b, drop_last=drop_last), num_processes=num, process_index=rank
        )

    loaders = [make(world, r) for r in range(world)]
    assert all(isinstance(loader.dataset, Files) for loader in loaders) or world == 1, "sharded natively"
    got = [rows(loader) for loader in loaders]
    assert [len(g) for g in got] == [len(loader) for loader in loaders], "len() equals what is yielded"
    assert len({len(g) for g in got}) == 1, "equal shards give equal batch counts"
    flat = [x for g in got for batch in g for x in batch]
    assert len(flat) == len(set(flat)), "each record is read by one process only"
    if not drop_last:
        assert sorted(flat) == sorted(dataset)
    k = int(len(got[0]) * where)
    first = [make(world, r) for r in range(world)]
    for loader in first:
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
    positions = [loader.state_dict() for loader in first]
    for rank, position in enumerate(positions):
        resumed = make(world, rank)
        resumed.load_state_dict(position)
        expected = (
            got[rank][k:] if k < len(got[rank]) else got[rank]
        )  # a position after the last batch is the next epoch
        assert len(resumed) == len(expected)
        assert rows(resumed) == expected
    if world > 1 and positions[0]["consumed"]:  # inside the epoch (an epoch's start loads into any size)
        with pytest.raises(ValueError, match="cannot move"):  # natively, or read by all
            make(world + 1, 0).load_state_dict(positions[0])
