"""Streams resumed, skipped and padded in the combinations that went wrong: natively sharded streams
with workers or a StatefulDataLoader, streams that split themselves across workers (read by every
process), and padding marked wherever a mode pads.  The oracle is ``_combinations.py``'s."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _combinations import Case, Resume, build, check, run_after, run_before, verify, write_wds
from _dist import run_gloo

pytest.importorskip("datasets")
pytest.importorskip("_hf_datasets")  # without datasets' pause of 5 s after each shuffled pass
pytest.importorskip("webdataset")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def wds_uneven(tmp_path_factory) -> str:
    """Four webdataset shards of 7, 5, 6 and 6 samples (ids 0..23)."""
    folder = tmp_path_factory.mktemp("wds_uneven")
    write_wds(str(folder), (7, 5, 6, 6))
    return str(folder)


@pytest.fixture(scope="module")
def wds_five(tmp_path_factory) -> str:
    """Five webdataset shards of 5, 4, 5, 4 and 5 samples (ids 0..22)."""
    folder = tmp_path_factory.mktemp("wds_five")
    write_wds(str(folder), (5, 4, 5, 4, 5))
    return str(folder)


# -- natively sharded streams on real gloo groups (their step counts are agreed) -----------------------------------

NATIVE = [
    (Case(data="hf", shards=4, stateful=True), Resume(2, 2, "half")),  # item 1
    (Case(data="hf", shards=4, stateful=True), Resume(2, 2, "one", resume_twice=True)),
    (Case(data="hf", shards=4, stateful=True, workers=2), Resume(2, 2, "half")),  # item 6
    (Case(data="hf", shards=4, stateful=True, workers=2, even_batches=False), Resume(2, 2, "all_but_one")),
    (Case(data="hf", shards=4, workers=2), Resume(2, 2, "half")),  # item 2: len() unknown, never wrong
    (Case(data="hf", shards=4, workers=2), Resume(2, 2, "half", skip=True)),
    (Case(data="sharded", workers=2, stateful=True), Resume(2, 2, "one", resume_twice=True)),
]


def _native_runs(rank, world, cases):
    """Each case stopped and continued on the same 2 gloo processes (one spawn for all of them); a
    case that raises gives its error (a collective it left behind would fail the cases after it)."""
    results = []
    for case, resume in cases:
        try:
            results.append(run_after(case, resume, run_before(case, resume)))
        except Exception as exc:  # noqa: BLE001 (handed to that case's test)
            results.append(f"{type(exc).__name__}: {exc}")
    return results


@pytest.fixture(scope="module")
def native_runs():
    return run_gloo(_native_runs, NATIVE, world_size=2, timeout=300)[0]


@pytest.mark.parametrize("index", range(len(NATIVE)), ids=lambda i: f"{NATIVE[i][0].data}-{NATIVE[i][1].point}-{i}")
def test_a_natively_sharded_stream_resumes_exactly_on_gloo(native_runs, index):
    """HF sharded natively (and a stream of our own), stateful or not, with workers: the resumed pass
    continues where the first stopped (it yielded nothing, or restarted the epoch), len() is exact or unknown."""
    case, resume = NATIVE[index]
    result = native_runs[index]
    assert not isinstance(result, str), result
    verify(case, resume, result)


@pytest.mark.parametrize(
    "case",
    [
        Case(data="sharded", workers=2),
        Case(data="sharded", workers=2, drop_last=True),
        Case(data="sharded", workers=2, even_batches=False),
    ],
    ids=str,
)
def test_a_natively_sharded_stream_with_workers_has_the_len_it_yields(case):
    """Item 2: shardplug splits the shards across the workers, so it counts each worker's batches."""
    check(case, Resume(2, 2, "half"))
    loaders = [build(case, 2, rank) for rank in range(2)]
    lengths = [len(loader) for loader in loaders]
    assert lengths == [sum(1 for _ in loader) for loader in loaders]


def test_a_natively_sharded_stream_that_splits_itself_across_workers_has_no_len():
    """Its parts split themselves: how many batches each worker makes is not known without reading."""
    loader = build(Case(data="hf", shards=4, workers=2), 2, 0)
    with pytest.raises(TypeError, match="natively sharded"):
        len(loader)


def test_a_natively_sharded_stream_refuses_another_number_of_processes_naming_the_fix():
    case = Case(data="sharded", stateful=True)
    loader = build(case, 2, 0)
    next(iter(loader))
    with pytest.raises(ValueError, match="sharded natively.*num_processes=2"):
        build(case, 3, 0).load_state_dict(loader.state_dict())


# -- a stream that splits itself across workers, read by every process ----------------------------------------------


@pytest.mark.parametrize(
    "resume",
    [
        Resume(2, 2, "half"),
        Resume(2, 2, "one", resume_twice=True),
        Resume(2, 2, "all_but_one"),
        Resume(2, 2, "mid_next"),
    ],
    ids=str,
)
def test_a_stateful_loader_resumes_a_stream_split_by_its_workers_exactly(resume):
    """Item 3: each worker's place is its number of batches, read and dropped again on resume."""
    check(Case(data="worker_split", workers=2, stateful=True), resume)


def test_a_stateful_state_of_a_stream_split_by_workers_is_refused_with_other_workers():
    saved = build(Case(data="worker_split", workers=2, stateful=True), 2, 0)
    iterator = iter(saved)
    next(iterator), next(iterator)
    state = saved.state_dict()
    del iterator
    with pytest.raises(ValueError, match="saved with num_workers=2.*resume with num_workers=2"):
        build(Case(data="worker_split", workers=3, stateful=True), 2, 0).load_state_dict(state)


def test_a_position_of_a_stream_split_by_workers_resumes_without_a_stateful_loader():
    """Each worker's place is its number of batches: read and dropped again, as with a StatefulDataLoader."""
    check(Case(data="worker_split", workers=2), Resume(2, 2, "half"))


@pytest.mark.parametrize(
    "case",
    [
        Case(data="worker_split", workers=2),
        Case(data="worker_split", workers=2, stateful=True),
        Case(data="worker_split", workers=0),
    ],
    ids=str,
)
def test_skip_first_batches_on_a_stream_split_by_its_workers_is_exact(case):
    """Item 4: the skipped batches are read and dropped (before: the wrong elements were skipped)."""
    check(case, Resume(2, 2, "half", skip=True))


def test_a_stream_split_by_webdataset_workers_marks_its_padding(wds_uneven):
    """Item 5: shards of 7/5/6/6, batch 3, 2 workers, 2 processes: 6 of the 30 slots are padding."""
    case = Case(data="wds", n=24, workers=2, hf_path=wds_uneven)
    slots = real = 0
    for rank in range(2):
        loader = build(case, 2, rank)
        loader.track_padding()
        for batch in loader:
            assert loader.batch_real_count is not None
            slots, real = slots + len(batch), real + loader.batch_real_count
    assert (slots, real) == (30, 24)
    check(case, Resume(2, 2, "half", skip=True))
    check(Case(data="wds", n=24, workers=2, stateful=True, hf_path=wds_uneven), Resume(2, 2, "half"))


@pytest.mark.parametrize("resume", [Resume(3, 2, "half"), Resume(2, 3, "all_but_one"), Resume(3, 3, "half")], ids=str)
def test_a_webdataset_stream_read_by_every_process_resizes_exactly(wds_five, resume):
    """Item 5: five shards, 3 processes to 2 (and back): nothing missing, padding marked."""
    check(Case(data="wds", n=23, hf_path=wds_five), resume)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_hf_stream_with_fewer_shards_than_processes_marks_its_padding(workers):
    """Item 5: 2 shards over 3 processes: read by every process and split by HF across workers."""
    case = Case(data="hf", shards=2, workers=workers)
    loader = build(case, 3, 2)
    loader.track_padding()  # refused before
    reals = [loader.batch_real_count for _ in loader]
    assert None not in reals and sum(reals) < case.batch_size * len(reals), "the last batches are padded, and marked"
    check(case, Resume(3, 3, "half", skip=True))
    if not workers:
        check(case, Resume(3, 3, "half"))


# -- stateful loaders over streams read by every process -------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [Case(data="stream", workers=2, stateful=True), Case(data="stream_unsized", workers=2, stateful=True)],
    ids=str,
)
@pytest.mark.parametrize("resume", [Resume(2, 2, "half"), Resume(2, 2, "one", resume_twice=True)], ids=str)
def test_a_stateful_loader_with_workers_tracks_padding_after_a_resume(case, resume):
    """Item 7: a resumed tracked pass raised IndexError (pop from an empty deque); a second resume
    in one epoch failed inside torchdata (its fast-forward): shardplug's own skip is used."""
    check(case, resume)


class _StateNeedsArguments(torch.utils.data.IterableDataset):
    """A stream with a ``state_dict`` that needs arguments shardplug does not have (as litdata's and
    streaming's do); its ``load_state_dict`` would reposition it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[Any] = []

    def __iter__(self):
        return iter(range(self.n))

    def state_dict(self, num_samples_yielded: int, num_workers: int) -> dict[str, int]:
        return {"yielded": num_samples_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded.append(state)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stream_whose_state_dict_needs_arguments_resumes_by_exact_skip(rank):
    """Read by every process (2, without a process group): its state_dict is never called without its
    arguments (a TypeError before), and the resumed pass reads past what was consumed, exactly."""
    from torch.utils.data import DataLoader

    from shardplug import prepare_data_loader

    def make():
        return prepare_data_loader(
            DataLoader(_StateNeedsArguments(21), batch_size=2), num_processes=2, process_index=rank
        )

    whole = [batch.tolist() for batch in make()]
    first = make()
    head = [batch.tolist() for _, batch in zip(range(2), first)]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [batch.tolist() for batch in resumed] == whole
    assert resumed.dataset.dataset.loaded == [], "its own state is never loaded"
