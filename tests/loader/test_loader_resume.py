"""Skipping and resuming a prepared loader in one process (simulated ranks): ``skip_first_batches``
never loads what it skips and applies to one pass, a position loaded and then skipped from, a
StatefulDataLoader resumed twice in one epoch, and a mid-epoch resume that equals the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from _datasets import Counting, Stream, rows
from torch.utils.data import DataLoader

from shardplug import DataLoaderShard, prepare_data_loader, skip_first_batches


# -- skipping ---------------------------------------------------------------------------------------
def test_skip_first_batches_never_loads_skipped_batches_and_is_one_shot():
    data = Counting(20)
    loader = prepare_data_loader(DataLoader(data, batch_size=2), num_processes=2, process_index=0)
    full = rows(loader)
    loader.set_epoch(0)
    skipped = skip_first_batches(loader, 3)
    data.loaded.clear()
    assert len(skipped) == len(full) - 3
    assert rows(skipped) == full[3:]
    assert sorted(data.loaded) == sorted(x for b in full[3:] for x in b), "skipped batches were loaded"
    assert skipped.epoch == 0
    assert len(rows(skipped)) == len(full), "the skip applies to one pass only"


def test_skip_more_than_available_is_empty_not_an_error():
    skipped = skip_first_batches(DataLoader(range(8), batch_size=2), 10)
    assert len(skipped) == 0 and rows(skipped) == []


def test_skip_keeps_epoch_counter_and_drop_last():
    loader = prepare_data_loader(DataLoader(range(9), batch_size=2, drop_last=True))
    loader.set_epoch(4)
    skipped = skip_first_batches(loader, 1)
    assert skipped.epoch == 4 and skipped.drop_last is True and len(skipped) == 3


class _Twenty(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(20))


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("kind", ["map", "shuffled", "stream"])
def test_a_skip_after_loading_a_position_skips_from_that_position_once(stateful, kind):
    """load_state_dict(after 3 batches), then skip_first_batches(2): batch 5 comes next, and a
    position saved later resumes there again (a StatefulDataLoader that loads its own state
    went on from it after the skip had already been placed after it: 3 batches lost)."""

    def make():
        data = _Twenty() if kind == "stream" else list(range(20))
        return prepare_data_loader(
            DataLoader(data, batch_size=2, shuffle=kind == "shuffled"), data_seed=7, use_stateful_dataloader=stateful
        )

    whole = rows(make())
    first = make()
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    skipped = skip_first_batches(resumed, 2)
    iterator = iter(skipped)
    got = [next(iterator).tolist() for _ in range(2)]
    later = skipped.state_dict()
    del iterator
    again = make()
    again.load_state_dict(later)
    assert got + rows(again) == whole[5:]


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_a_stateful_loader_resumed_twice_in_one_epoch_continues_exactly(kind):
    """torchdata 0.11 counts the batches it fast-forwards a stream without state_dict() by twice,
    so its state after a resume pointed 3 batches too far."""

    def make():
        data = _Twenty() if kind == "stream" else list(range(20))
        return prepare_data_loader(DataLoader(data, batch_size=2), use_stateful_dataloader=True)

    whole, state, got = rows(make()), None, []
    for taken in (3, 2):
        loader = make()
        if state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        got += [next(iterator).tolist() for _ in range(taken)]
        state = loader.state_dict()
        del iterator
    last = make()
    last.load_state_dict(state)
    assert got + rows(last) == whole


# -- resume -----------------------------------------------------------------------------------------
def _counting_loader(stateful, shuffle):
    """Process 1 of 2 over 30 counted samples in batches of 2 (seed 7)."""
    return prepare_data_loader(
        DataLoader(Counting(30), batch_size=2, shuffle=shuffle),
        num_processes=2,
        process_index=1,
        data_seed=7,
        use_stateful_dataloader=stateful,
    )


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_equals_uninterrupted_run(stateful, shuffle):
    def make():
        return _counting_loader(stateful, shuffle)

    reference = make()
    expected = [rows(reference) for _ in range(2)]
    loader = make()
    got, state = [], None
    for k, batch in enumerate(loader):
        got.append(batch.tolist())
        if k == 2:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    assert len(resumed) == len(expected[0]) - 3, "len() is the resumed pass's length (docs/resume.md)"
    rest = rows(resumed)
    assert len(rest) == len(expected[0]) - 3
    got += rest
    assert got == expected[0]
    assert len(resumed) == len(expected[0]), "the next pass has the full length again"
    assert rows(resumed) == expected[1], "the next epoch continues with the uninterrupted run's order"


@pytest.mark.parametrize("next_epoch", ["set_epoch", "iter", "end_finished_pass"])
@pytest.mark.parametrize("stateful", [False, True])
def test_a_resumed_pass_read_to_its_last_batch_gives_len_to_the_next_epoch_as_it_begins(stateful, next_epoch):
    """A loop that stops at ``len()`` (Lightning's, Ignite's: ``next()`` ``len()`` times) never asks the resumed
    pass for more, so it stays open: while its last batch is processed ``len()`` is still that pass's; once the
    next epoch begins (``set_epoch`` of it, ``iter()`` of the next pass, or a front end's ``end_finished_pass`` at
    its epoch's end) ``len()`` is the next epoch's, whole, the position that epoch's start (it loads), and the next
    pass that epoch's batches."""

    def make():
        return _counting_loader(stateful, shuffle=True)

    reference = make()
    expected = [rows(reference) for _ in range(2)]
    saved = make()
    first = iter(saved)
    for _ in range(3):
        next(first)
    resumed = make()
    resumed.load_state_dict(saved.state_dict())
    rest = iter(resumed)
    assert [next(rest).tolist() for _ in range(len(resumed))] == expected[0][3:]  # no StopIteration asked for
    assert resumed.end_of_dataloader
    assert len(resumed) == len(expected[0]) - 3, "inside the last batch: the resumed pass's length"
    batches = None
    if next_epoch == "set_epoch":
        resumed.set_epoch(1)
    elif next_epoch == "iter":
        batches = iter(resumed)
    else:
        assert resumed.end_finished_pass()
        assert not resumed.end_finished_pass(), "ended once"
    assert len(resumed) == len(expected[1]), "the next epoch's whole length, not the resumed pass's"
    state = resumed.state_dict()
    position = resumed.resume.position()
    assert (position.epoch, position.batches_yielded, position.consumed) == (1, 0, 0)
    loaded = make()
    loaded.load_state_dict(state)  # the new epoch's start: nothing of the finished pass counted in it
    assert rows(loaded) == expected[1]
    assert [b.tolist() for b in (batches if batches is not None else resumed)] == expected[1]


def test_stateful_iterable_resume_after_last_received_batch():
    def make():
        return prepare_data_loader(
            DataLoader(Stream(17), batch_size=2), num_processes=2, process_index=0, use_stateful_dataloader=True
        )

    expected = rows(make())
    loader = make()
    got = []
    iterator = iter(loader)
    for _ in range(2):
        got.append(next(iterator).tolist())
    state = loader.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert got + rows(resumed) == expected


def test_stateful_loader_is_a_stateful_dataloader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = prepare_data_loader(DataLoader(range(4), batch_size=2), use_stateful_dataloader=True)
    assert isinstance(loader, StatefulDataLoader) and isinstance(loader, DataLoaderShard)
    direct = DataLoaderShard(range(4), batch_size=2, use_stateful_dataloader=True)
    assert isinstance(direct, StatefulDataLoader)
