"""Dispatch and resume: a StatefulDataLoader behind a dispatcher, a shuffle drawn from a
generator, ``remainder`` after a resize, and ``skip_first_batches`` on a dispatching loader of
several processes (the copy and the original share one protocol state)."""

from __future__ import annotations

import pickle

import pytest
import torch
from _combinations import Case, Resume, build, check, check_distributed
from _datasets import Records
from _dist import run_gloo
from torch.utils.data import DataLoader, Dataset

import shardplug


def _stateful_dispatcher() -> shardplug.DataLoaderDispatcher:
    return shardplug.prepare_data_loader(
        DataLoader(range(16), batch_size=4),
        num_processes=1,
        process_index=0,
        put_on_device=True,
        dispatch_batches=True,
        use_stateful_dataloader=True,
    )


def _rows(batches) -> list[list[int]]:
    return [[int(v) for v in batch] for batch in batches]


def _resumed(state: dict) -> shardplug.DataLoaderDispatcher:
    loader = _stateful_dispatcher()
    loader.load_state_dict(state)
    return loader


# -- 1. dispatch with use_stateful_dataloader=True ------------------------------------------------
def test_stateful_dispatch_resumes_after_the_last_batch_handed_out():
    loader = _stateful_dispatcher()
    it = iter(loader)
    next(it), next(it)
    resumed = _resumed(loader.state_dict())
    assert len(resumed) == 2
    assert _rows(resumed) == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_stateful_dispatch_resumed_twice_loses_no_batch():
    loader = _stateful_dispatcher()
    it = iter(loader)
    next(it)
    once = _resumed(loader.state_dict())
    it = iter(once)
    assert _rows([next(it)]) == [[4, 5, 6, 7]]
    twice = _resumed(once.state_dict())
    assert len(twice) == 2
    assert _rows(twice) == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_stateful_dispatch_resumes_after_a_skipped_pass():
    skipped = shardplug.skip_first_batches(_stateful_dispatcher(), 1)
    it = iter(skipped)
    assert _rows([next(it)]) == [[4, 5, 6, 7]]
    resumed = _resumed(skipped.state_dict())
    assert len(resumed) == 2
    assert _rows(resumed) == [[8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize(
    "resume",
    [
        Resume(1, 1, "one"),
        Resume(1, 1, "half", resume_twice=True),
        Resume(1, 1, "all_but_one"),
        Resume(1, 1, "mid_next"),
    ],
    ids=lambda r: f"{r.point}{'-twice' if r.resume_twice else ''}",
)
def test_stateful_dispatch_one_process_every_sample_once(resume):
    check(Case(dispatch=True, stateful=True, shuffle="shuffle"), resume)


def test_stateful_dispatch_two_processes_resumed_twice_every_sample_once():
    check_distributed(Case(dispatch=True, stateful=True), Resume(2, 2, "half", resume_twice=True))


# -- 2. dispatch with a shuffle drawn from a generator --------------------------------------------
def _generator_dispatcher() -> shardplug.DataLoaderDispatcher:
    loader = DataLoader(range(12), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    return shardplug.prepare_data_loader(
        loader, num_processes=1, process_index=0, put_on_device=True, dispatch_batches=True
    )


def test_dispatch_generator_shuffle_position_after_an_epoch_is_the_next_epochs_order():
    first = _generator_dispatcher()
    _rows(first)
    position = first.state_dict()
    assert position["generator_state"] is not None
    expected = _rows(first)  # the uninterrupted run's epoch 1
    resumed = _generator_dispatcher()
    resumed.load_state_dict(position)
    assert _rows(resumed) == expected


@pytest.mark.parametrize("point", ["ended", "mid_next"])
def test_dispatch_generator_shuffle_one_process_every_sample_once_and_next_epoch_as_uninterrupted(point):
    check(Case(dispatch=True, shuffle="generator"), Resume(1, 1, point))


def test_dispatch_generator_shuffle_two_processes_resume_in_the_next_epoch():
    check_distributed(Case(dispatch=True, shuffle="generator"), Resume(2, 2, "mid_next"))


# -- 3. remainder describes the last step of the pass that runs -----------------------------------
def test_remainder_after_a_resize_is_the_resumed_pass_last_step_real_samples():
    case = Case(n=22)  # 8 global batches of 3 (the last holds 1)
    before = [build(case, 2, i) for i in range(2)]
    iterators = [iter(loader) for loader in before]
    for it in iterators:
        next(it)  # one step: 2 global batches, 6 samples
    position = before[0].state_dict()
    after = [build(case, 3, i) for i in range(3)]
    for loader in after:
        loader.load_state_dict(position)
    assert [loader.remainder for loader in after] == [7] * 3  # 16 samples left in steps of 9 (22 % 9 would be 4)
    assert [len(loader) for loader in after] == [2] * 3
    iterators = [iter(loader) for loader in after]
    last_real = 0
    for step in range(2):
        for loader, it in zip(after, iterators):
            next(it)
            if step == 1:
                assert loader.end_of_dataloader and loader.remainder == 7
                last_real += loader.batch_real_count
    for it in iterators:
        assert next(it, None) is None
    assert last_real == 7
    assert [loader.remainder for loader in after] == [22 % 9] * 3  # the next pass is a whole epoch


def test_dispatch_resize_two_to_three_processes_every_sample_once():
    check_distributed(Case(dispatch=True), Resume(2, 3, "half"))


# -- 4. skip_first_batches on a dispatcher of several processes -----------------------------------
class Rows(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _ids(batches) -> list[list[int]]:
    return [[int(v) for v in batch.flatten().tolist()] for batch in batches]


def _skip_scenarios(rank: int, world: int) -> dict:
    loader = shardplug.prepare_data_loader(DataLoader(Rows(), batch_size=2), put_on_device=True, dispatch_batches=True)
    out: dict = {}
    skipped = shardplug.skip_first_batches(loader, 1)
    out["len"] = len(skipped)
    out["skipped"] = _ids(skipped)
    out["original"] = _ids(loader)  # Accelerate's pattern: the skipped copy for one pass, the original after
    early = []
    for batch in shardplug.skip_first_batches(loader, 2):
        early.append(_ids([batch])[0])
        if rank == 0:
            break  # process 0 leaves the copy's pass: every process stops after the same step
    out["early"] = early
    out["after_early"] = _ids(loader)
    copy = pickle.loads(pickle.dumps(loader))
    with pytest.raises(RuntimeError, match="is a copy"):
        next(iter(copy))
    return out


def test_skip_first_batches_on_a_dispatcher_of_two_processes_shares_the_protocol_with_the_original():
    results = run_gloo(_skip_scenarios, world_size=2)
    whole = [[[4 * t + 2 * r, 4 * t + 2 * r + 1] for t in range(4)] for r in range(2)]
    for rank, out in enumerate(results):
        assert out["len"] == 3
        assert out["skipped"] == whole[rank][1:]
        assert out["original"] == whole[rank]
        assert out["early"] == whole[rank][2:3]
        assert out["after_early"] == whole[rank]


def _record_ids(batch):
    return batch["x"][:, 0].tolist()


def _dispatch_resume(rank: int, world: int) -> dict:
    """For each (split_batches, drop_last): dispatch for 2 steps, save the position, and finish the
    epoch from it in a new loader; record len() before and after."""
    out: dict = {}
    for split in (False, True):
        for drop_last in (False, True):

            def make():
                return shardplug.prepare_data_loader(
                    DataLoader(Records(23), batch_size=6 if split else 2, shuffle=True, drop_last=drop_last),  # noqa: B023 (called within this iteration)
                    put_on_device=True,
                    dispatch_batches=True,
                    split_batches=split,  # noqa: B023 (called within this iteration)
                    data_seed=3,
                )

            loader = make()
            first = []
            for step, batch in enumerate(loader):
                first.append(_record_ids(batch))
                if step == 1:
                    break
            position = loader.state_dict()
            resumed = make()
            resumed.load_state_dict(position)
            length_after_load = len(resumed)
            rest = [_record_ids(b) for b in resumed]
            reference = make()
            out[split, drop_last] = {
                "first": first,
                "position": position,
                "rest": rest,
                "full": [_record_ids(b) for b in reference],
                "len": len(reference),
                "len_after_load": length_after_load,
            }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_resume_continues_the_uninterrupted_run(world):
    results = run_gloo(_dispatch_resume, world_size=world, timeout=120)
    for res in results:
        for (split, _drop_last), got in res.items():
            per_step = 1 if split else world
            assert got["position"]["consumed"] == 2 * per_step, (
                "a dispatched step consumes N global batches (1 when splitting)"
            )
            assert got["first"] + got["rest"] == got["full"]
            assert got["len"] == len(got["full"]), "len() equals the steps dispatched"
            assert got["len_after_load"] == len(got["rest"]), "len() after load_state_dict equals the resumed pass"
        assert all(r[key]["full"] != [] for r in results for key in r)
