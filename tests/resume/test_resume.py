"""Positions, elastic resume (N -> M processes), padding visibility and the exactly-once audit.

Ranks are simulated in one process (explicit num_processes / process_index); the same code runs on
real process groups in test_faults.py.
"""

from __future__ import annotations

import pytest
import torch
from _datasets import Stream, rows
from _dist import worker_context
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

from shardplug import SampleAudit, drop_padding, prepare_data_loader


class Loads(Dataset):
    """Records every index it loads."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


class OwnBatchSampler(BatchSampler):
    """A user-defined batch sampler: forces the general (walking) path."""


def _loaders(n, b, world, shuffle, split, even, drop_last, own=False, seed=5):
    out = []
    for rank in range(world):
        if own:
            sampler = torch.utils.data.RandomSampler(range(n)) if shuffle else SequentialSampler(range(n))
            dl = DataLoader(Loads(n), batch_sampler=OwnBatchSampler(sampler, b, drop_last))
        else:
            dl = DataLoader(Loads(n), batch_size=b, shuffle=shuffle, drop_last=drop_last)
        loader = prepare_data_loader(
            dl, num_processes=world, process_index=rank, split_batches=split, even_batches=even, data_seed=seed
        )
        loader.enable_audit()
        out.append(loader)
    return out


def _take(loader, k):
    taken = []
    for batch in loader:
        taken.append(batch.tolist())
        if len(taken) == k:
            break
    return taken


def _combined(loaders_before, loaders_after, epoch=0):
    audit = SampleAudit(loaders_before[0].total_dataset_length)
    for loader in [*loaders_before, *loaders_after]:
        audit.load_state_dict(loader.audit.state_dict())
    return audit.report(epoch)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 70),
    b=st.integers(1, 5),
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    shuffle=st.booleans(),
    split=st.booleans(),
    even=st.booleans(),
    drop_last=st.booleans(),
    own=st.booleans(),
    data=st.data(),
)
def test_elastic_resume_consumes_every_sample_exactly_once(
    n, b, before, after, shuffle, split, even, drop_last, own, data
):
    if split:
        b = b * before * after  # divisible by both process counts
    first = _loaders(n, b, before, shuffle, split, even, drop_last, own)
    steps = min(len(loader) for loader in first)  # even_batches=False: ranks may differ by one at the end
    k = data.draw(st.integers(0, max(steps - 1, 0)))
    for loader in first:  # the audit records what each process was handed
        if k:
            _take(loader, k)
    positions = [loader.state_dict() for loader in first]
    assert all(p == positions[0] for p in positions), "the position must be identical on every process"
    second = _loaders(n, b, after, shuffle, split, even, drop_last, own)
    moved_on = set()
    for loader in second:
        loader.load_state_dict(positions[0])
        moved_on.add(loader.epoch > positions[0]["epoch"])
    assert len(moved_on) == 1, "every process resumes in the same epoch"
    if moved_on == {True}:  # the rest of the epoch fills no step of `after` processes: the next epoch, whole
        left = n - k * (b if split else b * before)
        assert drop_last and left < (b if split else b * after), f"{left} samples left behind"
        fresh = _loaders(n, b, after, shuffle, split, even, drop_last, own)
        for loader in fresh:
            loader.set_epoch(1)
        assert [rows(l) for l in second] == [rows(l) for l in fresh]
        return
    for loader in second:
        rows(loader)
    report = _combined(first, second)
    if drop_last:  # the incomplete end is dropped by design, but nothing repeats
        assert not report.duplicated, report
    else:
        assert report.exact, report
    # the next epoch equals a fresh run with `after` processes
    fresh = _loaders(n, b, after, shuffle, split, even, drop_last, own)
    for loader in fresh:
        loader.set_epoch(1)
    assert [rows(l) for l in second] == [rows(l) for l in fresh]


@pytest.mark.parametrize("before,after", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_iterable_elastic_resume(before, after, split):
    def make(world):
        return [
            prepare_data_loader(
                DataLoader(Stream(23), batch_size=6 if split else 2),
                num_processes=world,
                process_index=r,
                split_batches=split,
            )
            for r in range(world)
        ]

    first = make(before)
    got = [_take(loader, 2) for loader in first]
    position = first[0].state_dict()
    assert position["unit"] == "elements" and all(l.state_dict() == position for l in first)
    second = make(after)
    for loader in second:
        loader.load_state_dict(position)
    rest = [rows(loader) for loader in second]
    consumed = sorted(x for shard in got for batch in shard for x in batch)
    remaining = [x for k in range(len(rest[0])) for shard in rest if k < len(shard) for x in shard[k]]
    assert consumed == list(range(position["consumed"]))
    assert remaining[: 23 - position["consumed"]] == list(range(position["consumed"], 23))
    assert all(x < 23 for x in remaining)


def test_resume_never_loads_skipped_batches_also_for_user_batch_samplers():
    (loader,) = _loaders(40, 4, 1, True, False, True, False, own=True)
    _take(loader, 3)
    position = loader.state_dict()
    (resumed,) = _loaders(40, 4, 1, True, False, True, False, own=True)
    resumed.load_state_dict(position)
    dataset = resumed.dataset
    remaining = rows(resumed)
    assert len(dataset.loaded) == sum(len(b) for b in remaining), "a skipped batch was loaded"


def test_padding_is_visible_per_batch():
    loaders = _loaders(10, 3, 2, False, False, True, False)
    seen = []
    for loader in loaders:
        for batch in loader:
            seen.append((loader.batch_indices, loader.batch_real_count, drop_padding(batch, loader).tolist()))
    # process 1's last batch [9, 0, 1] holds one real sample; the padded ones are dropped
    assert ([9, 0, 1], 1, [9]) in seen
    assert sorted(x for _, _, real in seen for x in real) == list(range(10))


def test_audit_reports_missing_and_duplicated_samples():
    audit = SampleAudit(5)
    audit.record(0, [0, 1, 1], 3)
    audit.record(0, [3, 0], 1)
    report = audit.report(0)
    assert (report.seen, report.missing, report.duplicated, report.padding) == (3, [2, 4], [1], 1)
    assert not report.exact


def test_audit_state_round_trips_with_weights_only(tmp_path):
    audit = SampleAudit(4)
    audit.record(2, [0, 1, 2, 3], 4)
    torch.save(audit.state_dict(), tmp_path / "audit.pt")
    loaded = SampleAudit(4)
    loaded.load_state_dict(torch.load(tmp_path / "audit.pt", weights_only=True))
    assert loaded.report(2).exact


def test_stateful_stream_split_by_its_workers_refuses_to_resize():
    from _combinations import WorkerSplitStream

    # map-style data and streams split by shardplug resize with a StatefulDataLoader too
    # (tests/resume/test_combinations.py)
    def make(world, rank):
        dataset = WorkerSplitStream(21)
        loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context=worker_context(2))
        return prepare_data_loader(loader, num_processes=world, process_index=rank, use_stateful_dataloader=True)

    loader = make(2, 0)
    _take(loader, 2)
    state = loader.state_dict()
    resized = make(3, 0)
    with pytest.raises(ValueError, match="its own part of this stream.*cannot move from 2 to 3 processes; resume with"):
        resized.load_state_dict(state)  # refused on loading, before anything changes


def test_unsharded_stream_refuses_to_resize():
    single = prepare_data_loader(DataLoader(Stream(9), batch_size=2), num_processes=1, process_index=0)
    _take(single, 2)
    position = single.state_dict()
    assert position["unit"] == "batches"
    again = prepare_data_loader(DataLoader(Stream(9), batch_size=2), num_processes=1, process_index=0)
    again.load_state_dict(position)
    assert rows(again) == [[4, 5], [6, 7], [8]]
    position["num_processes"] = 2
    with pytest.raises(ValueError, match="cannot move from 2 to 1 processes"):
        again.load_state_dict(position)  # refused on loading, before anything changes


@pytest.mark.parametrize("before,after", [(2, 3), (3, 2)])
def test_iterable_audit_and_padding_across_a_resize(before, after):
    def make(world):
        loaders = [
            prepare_data_loader(DataLoader(Stream(23), batch_size=2), num_processes=world, process_index=r)
            for r in range(world)
        ]
        for loader in loaders:
            loader.enable_audit()
        return loaders

    first = make(before)
    for loader in first:
        _take(loader, 2)
    position = first[0].state_dict()
    second = make(after)
    real_rows = []
    for loader in second:
        loader.load_state_dict(position)
        for batch in loader:
            assert loader.batch_indices[: loader.batch_real_count] == batch.tolist()[: loader.batch_real_count]
            real_rows.extend(drop_padding(batch, loader).tolist())
    report = _combined(first, second)
    assert report.exact, report
    assert sorted(real_rows) == list(range(position["consumed"], 23))


class Countdown(torch.utils.data.IterableDataset):
    """A stream that can reposition itself, and counts the elements it produced."""

    def __init__(self, n: int) -> None:
        self.n, self.next_index, self.produced = n, 0, 0

    def __iter__(self):
        while self.next_index < self.n:
            self.produced += 1
            self.next_index += 1
            yield self.next_index - 1
        self.next_index = 0

    def __len__(self) -> int:
        return self.n

    def state_dict(self):
        return {"next_index": self.next_index}

    def load_state_dict(self, state):
        self.next_index = state["next_index"]


@pytest.mark.parametrize("after", [2, 3])
def test_iterable_with_its_own_state_dict_resumes_without_rereading(after):
    def make(world, dataset, rank):  # every process has its own copy of the stream
        return prepare_data_loader(DataLoader(dataset, batch_size=2), num_processes=world, process_index=rank)

    first = [make(2, Countdown(30), rank) for rank in range(2)]
    taken = [_take(loader, 3) for loader in first]
    position = first[0].state_dict()
    assert position["dataset_state"] == {"next_index": position["consumed"]} == {"next_index": 12}
    assert first[1].state_dict() == position
    datasets = [Countdown(30) for _ in range(after)]
    rest = []
    for rank, dataset in enumerate(datasets):
        loader = make(after, dataset, rank)
        loader.load_state_dict(position)
        rest.append(rows(loader))
        assert dataset.produced == 30 - 12, "the resumed stream re-read what was consumed"
    consumed = sorted(x for shard in taken for batch in shard for x in batch)
    remaining = [x for k in range(len(rest[0])) for shard in rest for x in shard[k]]
    assert consumed == list(range(12)) and remaining[:18] == list(range(12, 30))
