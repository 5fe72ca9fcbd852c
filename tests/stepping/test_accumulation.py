"""GradientState: accumulation cycles, loader passes, nesting, early exits."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from shardplug.core.stepping.accumulation import GradientState


class FakeLoader:
    """Calls the loader hooks exactly as the contract says (first next(), before each batch, finally)."""

    def __init__(self, n: int, state: GradientState) -> None:
        self.n = n
        self.gradient_state = state

    def __iter__(self):
        state = self.gradient_state
        state.loader_started(self)
        try:
            for i in range(self.n):
                state.batch_ready(self, end_of_dataloader=(i == self.n - 1))
                yield i
        finally:
            state.loader_stopped(self)


def expected_pattern(n: int, k: int) -> list[bool]:
    """Sync flags of one epoch of n micro-batches with k per step, computed the slow way."""
    flags, count = [], 0
    for i in range(n):
        count += 1
        sync = count == k or i == n - 1
        flags.append(sync)
        if sync:
            count = 0
    return flags


def run_epoch(state: GradientState, loader) -> list[bool]:
    return [state.begin_micro_batch() for _ in loader]


def test_without_loader_syncs_every_kth():
    state = GradientState(num_steps=3)
    assert state.sync_gradients  # nothing to accumulate yet
    flags = [state.begin_micro_batch() for _ in range(7)]
    assert flags == [False, False, True, False, False, True, False]
    assert state.micro_batches == 1


def test_num_steps_one_always_syncs():
    state = GradientState()
    assert all(state.begin_micro_batch() for _ in range(5))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_invalid_num_steps(bad):
    with pytest.raises(ValueError, match="num_steps"):
        GradientState(num_steps=bad)


def test_force_sync():
    state = GradientState(num_steps=4)
    assert state.begin_micro_batch() is False
    assert state.begin_micro_batch(force_sync=True) is True
    assert state.micro_batches == 0


@given(n=st.integers(1, 30), k=st.integers(1, 8), epochs=st.integers(1, 3))
@settings(max_examples=60, deadline=None)
def test_last_batch_of_each_epoch_syncs_and_starts_a_new_cycle(n, k, epochs):
    state = GradientState(num_steps=k)
    loader = FakeLoader(n, state)
    for _ in range(epochs):
        assert run_epoch(state, loader) == expected_pattern(n, k)
        assert not state.in_dataloader and state.sync_gradients and state.micro_batches == 0


def test_end_of_dataloader_and_in_dataloader_flags():
    state = GradientState(num_steps=2)
    loader = FakeLoader(3, state)
    seen = []
    for _ in loader:
        seen.append((state.in_dataloader, state.end_of_dataloader, state.active_dataloader is loader))
    assert seen == [(True, False, True), (True, False, True), (True, True, True)]
    assert not state.in_dataloader and not state.end_of_dataloader and state.active_dataloader is None


def test_nested_finished_eval_loop_does_not_force_sync():
    state = GradientState(num_steps=4)
    train, evaluation = FakeLoader(8, state), FakeLoader(2, state)
    flags = []
    for i, _ in enumerate(train):
        if i % 2 == 0:  # evaluation between fetching the batch and the micro-batch
            for _ in evaluation:
                pass
        sync = state.begin_micro_batch()
        for _ in evaluation:  # evaluation inside the micro-batch
            assert state.sync_gradients == sync
        assert state.sync_gradients == sync
        flags.append(sync)
    assert flags == expected_pattern(8, 4)


def test_running_eval_loop_reports_its_own_end():
    state = GradientState(num_steps=2)
    train, evaluation = FakeLoader(3, state), FakeLoader(2, state)
    for _ in train:
        ends = [state.end_of_dataloader for _ in evaluation]
        assert ends == [False, True]
        assert state.active_dataloader is train
    assert not state.in_dataloader


def test_outer_loop_last_batch_does_not_sync_inner_micro_batches():
    # accelerate#1847: an outer loader's last batch made every inner micro-batch sync
    state = GradientState(num_steps=3)
    outer, inner = FakeLoader(2, state), FakeLoader(6, state)
    for _ in outer:
        assert run_epoch(state, inner) == expected_pattern(6, 3)


def test_same_loader_twice_in_zip_does_not_unregister_early():
    state = GradientState(num_steps=2)
    short, long = FakeLoader(3, state), FakeLoader(5, state)
    flags = []
    for _a, _b in zip(short, short):
        flags.append(state.begin_micro_batch())
        assert len(state._passes) == 2
    assert flags == expected_pattern(3, 2)
    # zip(short, long): the shorter loader's last batch ends the loop and must sync
    it = zip(short, long)
    flags = [state.begin_micro_batch() for _ in it]
    assert flags == expected_pattern(3, 2)
    assert state.in_dataloader  # ``long`` is still suspended inside the zip object
    del it
    assert not state.in_dataloader


@pytest.mark.parametrize("leave", ["break", "exception"])
def test_leaving_a_loop_early_resets(leave):
    state = GradientState(num_steps=4)
    loader = FakeLoader(10, state)
    for _ in range(2):  # twice: nothing piles up
        try:
            for i, _ in enumerate(loader):
                state.begin_micro_batch()
                if i == 1:
                    if leave == "break":
                        break
                    raise KeyError("boom")
        except KeyError:
            pass
        assert not state.in_dataloader
        assert state._passes == []
        assert state.sync_gradients is True and state.micro_batches == 0
    # a fresh cycle starts on the next epoch
    assert run_epoch(state, loader) == expected_pattern(10, 4)


def test_two_states_are_independent():
    a, b = GradientState(num_steps=2), GradientState(num_steps=2)
    assert a.begin_micro_batch() is False
    assert b.sync_gradients is True and b.micro_batches == 0
    la = FakeLoader(3, a)
    for _ in la:
        assert not b.in_dataloader


def test_garbage_collected_loader_is_forgotten():
    class Loader:  # a loader whose pass never reported its end before it was collected
        pass

    state = GradientState(num_steps=2)
    loader = Loader()
    state.loader_started(loader)
    state.batch_ready(loader, end_of_dataloader=False)
    assert state.in_dataloader
    del loader
    assert not state.in_dataloader


def test_unregistered_stop_is_harmless():
    state = GradientState(num_steps=2)
    state.loader_stopped(object())
    assert not state.in_dataloader and state.sync_gradients


def test_pickle_round_trip_keeps_counters_not_passes():
    state = GradientState(num_steps=3)
    loader = FakeLoader(5, state)
    it = iter(loader)
    next(it)
    state.begin_micro_batch()
    copy = pickle.loads(pickle.dumps(state))
    assert (copy.num_steps, copy.micro_batches, copy.sync_gradients) == (3, 1, False)
    assert not copy.in_dataloader and state.in_dataloader
    it.close()


def test_through_a_real_prepared_loader():
    prepare = pytest.importorskip("shardplug.core.planner")
    state = GradientState(num_steps=2)
    loader = prepare.prepare_data_loader(DataLoader(torch.arange(10), batch_size=2), num_processes=1, process_index=0)
    loader.gradient_state = state
    for _ in range(2):
        assert run_epoch(state, loader) == [False, True, False, True, True]
        assert not state.in_dataloader
    for i, _ in enumerate(loader):  # break out of a real loader: reset
        state.begin_micro_batch()
        if i == 0:
            break
    assert not state.in_dataloader and state.sync_gradients and state.micro_batches == 0


def test_micro_batches_counts_the_cycle_and_the_state_keeps_its_step_key():
    state = GradientState(num_steps=3)
    state.begin_micro_batch()
    assert state.micro_batches == 1 and not hasattr(state, "step")  # "step" means an optimizer update
    assert "micro_batches=1" in repr(state) and state.state_dict() == {"num_steps": 3, "step": 1}


@pytest.mark.parametrize("saved_on", [3, 2, 1])
def test_a_resumed_pass_steps_at_its_layouts_cycles_of_the_epoch(saved_on, caplog):
    """A position saved inside a cycle resumes with the updates where the epoch's cycles of the loading layout put
    them (after every k-th batch of the epoch and its last), whatever cycle the loaded state carried: on the
    layout it was saved on that is the saved cycle, on another the one rule every front end follows."""
    from shardplug import prepare_data_loader

    def loader(processes: int):
        return prepare_data_loader(DataLoader(range(48), batch_size=2), num_processes=processes, process_index=0)

    saved = loader(saved_on)
    batches = iter(saved)
    for _ in range(2):  # 2 batches of each process: a cycle of 3 two micro-batches in
        next(batches)
    position = saved.state_dict()
    state = GradientState(num_steps=3)
    state.load_state_dict({"num_steps": 3, "step": 2})  # the saved cycle
    resumed = loader(2)
    resumed.gradient_state = state
    resumed.load_state_dict(position)
    flags = run_epoch(state, resumed)
    before = 24 // 2 - len(flags)  # the epoch's batches on 2 processes before the resumed pass
    assert before == saved_on
    assert flags == [(i + 1) % 3 == 0 or i == 11 for i in range(before, 12)]
    assert ("fewer micro-batches" in caplog.text) == (before % 3 not in (0, 2))
