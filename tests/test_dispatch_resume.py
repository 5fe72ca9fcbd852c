"""Dispatch and resume: a StatefulDataLoader behind a dispatcher, a shuffle drawn from a
generator, ``remainder`` after a resize, and ``skip_first_batches`` on a dispatching loader of
several processes (the copy and the original share one protocol state)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import shardplug
from _combinations import Case, Resume, build, check, check_distributed
from _dist import run_gloo


def _stateful_dispatcher() -> shardplug.DataLoaderDispatcher:
    return shardplug.prepare_data_loader(
        DataLoader(range(16), batch_size=4), num_processes=1, process_index=0, put_on_device=True,
        dispatch_batches=True, use_stateful_dataloader=True,
    )


def _rows(batches) -> list[list[int]]:
    return [[int(v) for v in batch] for batch in batches]


def _resumed(state: dict) -> shardplug.DataLoaderDispatcher:
    loader = _stateful_dispatcher()
    loader.load_state_dict(state)
    return loader


# -- 2. dispatch with a shuffle drawn from a generator --------------------------------------------
def _generator_dispatcher() -> shardplug.DataLoaderDispatcher:
    loader = DataLoader(range(12), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5))
    return shardplug.prepare_data_loader(loader, num_processes=1, process_index=0, put_on_device=True,
                                         dispatch_batches=True)


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
