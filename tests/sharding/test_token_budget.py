"""A TokenBudgetBatchSampler prepared by prepare_data_loader, each process's loader built in one process (the
plan needs no process group: every process computes it alike; real groups: tests/sharding/test_multiprocess.py).

Every process yields ``len()`` micro-batches, as many as the others, each within the budget, every sample once
per epoch; a position saved inside an epoch resumes exactly on the same number of processes, and on another the
rest of the epoch comes once, in equal steps; the step's global token and sample counts match the batches.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import shardplug
from shardplug import TokenBudgetBatchSampler, prepare_data_loader, skip_first_batches, step_totals
from shardplug.core.loader.passes import LengthMismatchWarning
from shardplug.core.sharding import budget_plan

LENGTHS = np.random.default_rng(3).integers(1, 100, size=50)
BUDGET = 400


def _loaders(
    n: int, lengths=LENGTHS, budget=BUDGET, loader_options=None, window=None, **sampler_options
) -> list[shardplug.PreparedDataLoader]:
    """Process ``i``'s prepared loader of ``n`` (``window``: the plan's windows of that many samples)."""
    loader_options = dict(loader_options or {})
    prepare_options = {
        name: loader_options.pop(name)
        for name in ("use_stateful_dataloader", "prefetch_depth")
        if name in loader_options
    }
    loaders = []
    for i in range(n):
        sampler = TokenBudgetBatchSampler(lengths, budget, **sampler_options)
        if window is not None:
            sampler.spec = dataclasses.replace(sampler.spec, window=window)
        data = DataLoader(range(len(lengths)), batch_sampler=sampler, **loader_options)
        loaders.append(prepare_data_loader(data, num_processes=n, process_index=i, **prepare_options))
    return loaders


def _epoch(loaders) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for loader in loaders]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_process_the_same_number_of_micro_batches_within_budget_every_sample_once(n: int) -> None:
    loaders = _loaders(n, seed=4)
    lengths = [len(loader) for loader in loaders]
    for epoch in range(2):
        for loader in loaders:
            loader.set_epoch(epoch)
        parts = _epoch(loaders)
        assert [len(part) for part in parts] == lengths == [lengths[0]] * n
        assert all(LENGTHS[batch].sum() <= BUDGET for part in parts for batch in part)
        assert sorted(i for part in parts for batch in part for i in batch) == list(range(50))
    assert _epoch(_loaders(n, seed=4)) != parts  # the epoch changes the order


def test_padding_for_equal_steps_is_marked() -> None:
    lengths = np.array([390, 390, 390])  # 3 micro-batches on 2 processes: the last step is padded
    loaders = _loaders(2, lengths=lengths, shuffle=False)
    for loader in loaders:
        loader.track_padding()
    real, padding = [], []
    for loader in loaders:
        for batch in loader:
            count = loader.batch_real_count
            real += batch.tolist()[:count]
            padding += batch.tolist()[count:]
    assert sorted(real) == [0, 1, 2] and len(padding) == 1
    assert len(loaders[0]) == len(loaders[1])


def test_drop_last_drops_a_step_some_process_has_no_sample_for() -> None:
    lengths = np.array([390] * 5)  # 5 micro-batches on 2 processes
    parts = _epoch(_loaders(2, lengths=lengths, shuffle=False, drop_last=True))
    assert [len(part) for part in parts] == [2, 2]
    assert len({i for part in parts for batch in part for i in batch}) == 4


def _resumed(saved_on: int, resumed_on: int, after: int) -> tuple[list[int], list[list[list[int]]], dict]:
    """The samples of ``after`` steps on ``saved_on`` processes, then the rest of the epoch on ``resumed_on``."""
    first = _loaders(saved_on, seed=9)
    iterators = [iter(loader) for loader in first]
    seen = [i for _ in range(after) for it in iterators for i in next(it).tolist()]
    state = first[0].state_dict()
    assert all(loader.state_dict() == state for loader in first)
    rest = _loaders(resumed_on, seed=9)
    for loader in rest:
        loader.load_state_dict(state)
    lengths = [len(loader) for loader in rest]
    parts = _epoch(rest)
    assert [len(part) for part in parts] == lengths == [lengths[0]] * resumed_on  # exact len(), equal steps
    return seen, parts, state


def test_a_position_resumes_exactly_on_the_same_number_of_processes() -> None:
    whole = _epoch(_loaders(2, seed=9))
    _, parts, state = _resumed(2, 2, after=2)
    assert state["unit"] == "samples" and state["consumed"] > 0
    assert parts == [part[2:] for part in whole]


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(3, 2), (2, 3), (1, 3)])
def test_a_resize_plans_the_rest_of_the_epoch_again_every_remaining_sample_once(saved_on: int, resumed_on: int) -> None:
    seen, parts, _ = _resumed(saved_on, resumed_on, after=2)
    rest = [i for part in parts for batch in part for i in batch]
    assert sorted(seen + rest) == list(range(50))


@pytest.mark.parametrize("stateful", [False, True], ids=["dataloader", "stateful"])
def test_workers_read_the_same_micro_batches_and_a_position_of_theirs_resumes_exactly(stateful: bool) -> None:
    """Two DataLoader workers (and the StatefulDataLoader) hand out the plan's micro-batches of the loader without
    workers; a position saved after two of them resumes on another number of processes with every sample once."""
    whole = _epoch(_loaders(2, seed=9))
    options = {"num_workers": 2, "use_stateful_dataloader": stateful}
    assert _epoch(_loaders(2, seed=9, loader_options=options)) == whole
    saved = _loaders(2, seed=9, loader_options=options)
    iterators = [iter(loader) for loader in saved]
    seen = [i for it in iterators for _ in range(2) for i in next(it).tolist()]
    state = saved[0].state_dict()
    resumed = _loaders(3, seed=9, loader_options=options)
    for loader in resumed:
        loader.load_state_dict(state)
    parts = _epoch(resumed)
    assert len({len(part) for part in parts}) == 1, "equal steps on every process"
    assert sorted(seen + [i for part in parts for batch in part for i in batch]) == list(range(50))


def test_a_resize_and_back_resumes_the_resized_plan() -> None:
    first = _loaders(2, seed=9)
    iterators = [iter(loader) for loader in first]
    seen = [i for it in iterators for i in next(it).tolist()]
    middle = _loaders(3, seed=9)
    for loader in middle:
        loader.load_state_dict(first[0].state_dict())
    iterators = [iter(loader) for loader in middle]
    seen += [i for it in iterators for i in next(it).tolist()]
    last = _loaders(2, seed=9)
    for loader in last:
        loader.load_state_dict(middle[0].state_dict())
    seen += [i for part in _epoch(last) for batch in part for i in batch]
    assert sorted(seen) == list(range(50))


def test_skip_first_batches_starts_after_them() -> None:
    whole = _epoch(_loaders(2, seed=1))
    skipped = [skip_first_batches(loader, 2) for loader in _loaders(2, seed=1)]
    assert [len(loader) for loader in skipped] == [len(part) - 2 for part in whole]
    assert _epoch(skipped) == [part[2:] for part in whole]


def test_step_totals_are_the_steps_real_tokens_and_samples_over_all_processes() -> None:
    loaders = _loaders(3, seed=2)
    parts = _epoch(loaders)
    iterators = [iter(loader) for loader in loaders]
    for step in range(len(parts[0])):
        for it in iterators:
            next(it)
        group = step - step % 2
        batches = [part[s] for part in parts for s in range(group, min(group + 2, len(parts[0])))]
        expected = (int(sum(LENGTHS[b].sum() for b in batches)), sum(len(b) for b in batches))
        assert all(tuple(step_totals(loader, accumulation_steps=2)) == expected for loader in loaders)


def test_a_sample_longer_than_the_budget_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 500 tokens, more than max_tokens=400.*raise max_tokens"):
        TokenBudgetBatchSampler([3, 500, 2], BUDGET)


def test_lengths_must_match_the_dataset() -> None:
    with pytest.raises(ValueError, match="3 lengths and the dataset 4 samples"):
        prepare_data_loader(DataLoader(range(4), batch_sampler=TokenBudgetBatchSampler([1, 2, 3], BUDGET)))


DISPATCH = {"dispatch_batches": True, "put_on_device": True, "device": "cpu"}


def test_dispatched_on_one_process_the_loader_hands_out_the_plans_micro_batches_whole() -> None:
    """Dispatch reads the plan's micro-batches and hands each out whole, with the plan's marks and len() (several
    processes on real groups: tests/sharding/test_multiprocess.py)."""
    loaders = []
    for options in ({}, DISPATCH):
        loader = prepare_data_loader(
            DataLoader(range(50), batch_sampler=TokenBudgetBatchSampler(LENGTHS, BUDGET)), **options
        )
        loader.track_padding()
        loaders.append(loader)
    assert type(loaders[1]).__name__ == "DataLoaderDispatcher" and len(loaders[1]) == len(loaders[0])
    epochs = [
        [(batch.tolist(), loader.batch_indices, loader.batch_real_count) for batch in loader] for loader in loaders
    ]
    assert epochs[1] == epochs[0]


def test_a_dispatched_pass_plans_the_windows_as_it_reaches_them(monkeypatch) -> None:
    """Dispatched, the first batch plans the first window only (not the epoch: at 10^7 lengths that is seconds),
    and the pass hands out what len() says, its last batch marked."""
    planned: list[tuple[int, int, int]] = []
    plan_window = budget_plan.plan_window
    monkeypatch.setattr(budget_plan, "plan_window", lambda *args: planned.append(args[4]) or plan_window(*args))
    sampler = TokenBudgetBatchSampler(MANY, BUDGET, seed=6)
    sampler.spec = dataclasses.replace(sampler.spec, window=50)
    loader = prepare_data_loader(DataLoader(range(MANY.size), batch_sampler=sampler), **DISPATCH)
    batches = iter(loader)
    first = next(batches).tolist()
    assert planned == [(0, 0, 0)]
    samples, marks = _marked(loader, batches)
    assert marks == [False] * (len(marks) - 1) + [True] and len(marks) + 1 == len(loader)
    assert sorted(first + samples) == list(range(MANY.size))


@pytest.mark.parametrize("dispatch", [False, True], ids=["own", "dispatched"])
def test_options_without_meaning_for_a_token_budget_are_refused_with_the_fix(dispatch: bool) -> None:
    """split_batches=True (no batch to cut: each process's micro-batch is planned) with either loader;
    slice_fn_for_dispatch (each process receives its micro-batch whole) where batches are dispatched."""
    options = {**DISPATCH, "num_processes": 2, "process_index": 0} if dispatch else {"num_processes": 2}
    loader = DataLoader(range(3), batch_sampler=TokenBudgetBatchSampler([1, 2, 3], BUDGET))
    with pytest.raises(ValueError, match=r"split_batches=True .*TokenBudgetBatchSampler.*pass split_batches=False"):
        prepare_data_loader(loader, split_batches=True, **options)
    if dispatch:
        with pytest.raises(ValueError, match=r"slice_fn_for_dispatch=<function.*whole.*slice_fn_for_dispatch=None"):
            prepare_data_loader(loader, slice_fn_for_dispatch=lambda *args: args[0], **options)


def test_a_memmap_of_lengths_is_read_as_it_is(tmp_path) -> None:
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS.astype(np.int32))
    lengths = np.load(path, mmap_mode="r")
    sampler = TokenBudgetBatchSampler(lengths, BUDGET)
    assert isinstance(sampler.lengths, np.memmap)
    assert sorted(i for batch in sampler for i in batch) == list(range(50))


MANY = np.random.default_rng(8).integers(1, 100, size=400)


@pytest.mark.parametrize("window", [None, 50], ids=["one-window", "windows-of-50"])
def test_step_totals_after_a_resume_are_the_uninterrupted_runs(window: int | None) -> None:
    """Resumed inside an optimizer step (k = 2), also where the step began in the window before the place's, the
    step's totals count its micro-batches handed out before the resume too."""
    whole = _loaders(2, MANY, seed=6, window=window)
    expected = [
        [tuple(step_totals(loader, accumulation_steps=k)) for loader in whole for k in (1, 2)] for _ in zip(*whole)
    ]
    steps = len(whole[0])
    first_window = whole[0].plan.budget.strata().steps_through(2, 0)
    places = [3] if window is None else [3, first_window if first_window % 2 else first_window + 1]  # odd: inside
    assert places[-1] < steps - 10
    for place in places:
        first = _loaders(2, MANY, seed=6, window=window)
        iterators = [iter(loader) for loader in first]
        for _ in range(place):
            for it in iterators:
                next(it)
        resumed = _loaders(2, MANY, seed=6, window=window)
        for loader in resumed:
            loader.load_state_dict(first[0].state_dict())
            assert loader.epoch_length == steps
        got = [
            [tuple(step_totals(loader, accumulation_steps=k)) for loader in resumed for k in (1, 2)]
            for _ in zip(*resumed)
        ]
        assert len(got) > 10
        assert got == expected[place:]


def test_step_totals_after_skip_first_batches_are_the_uninterrupted_runs() -> None:
    whole = _loaders(2, MANY, seed=6)
    expected = [[tuple(step_totals(loader, 2)) for loader in whole] for _ in zip(*whole)]
    assert len(expected) > 10
    skipped = [skip_first_batches(loader, 3) for loader in _loaders(2, MANY, seed=6)]
    assert [loader.epoch_length for loader in skipped] == [len(whole[0])] * 2  # the whole epoch's plan is made too
    got = [[tuple(step_totals(loader, 2)) for loader in skipped] for _ in zip(*skipped)]
    assert got[1:] == expected[4:]


def test_a_refused_position_leaves_the_plan_as_it_was() -> None:
    """A position refused by a later check (another dataset length) leaves nothing in the plan: a run reaching
    its place (one of this layout's too) then plans and saves there as an uninterrupted run."""
    options = {"seed": 0}
    saved = _loaders(3, budget=150, **options)[0]
    batches = iter(saved)
    next(batches), next(batches)
    state = saved.state_dict()
    assert state["dataset_state"] is not None  # inside its window: the window's plan for 3 processes
    refusing, uninterrupted = _loaders(2, budget=150, **options)[0], _loaders(2, budget=150, **options)[0]
    with pytest.raises(ValueError, match="dataset"):
        refusing.load_state_dict({**state, "dataset_length": 51})
    places = []
    for loader in (refusing, uninterrupted):
        batches = iter(loader)
        while loader.state_dict()["consumed"] < state["consumed"]:
            next(batches)
        places.append((loader.state_dict(), [batch.tolist() for batch in batches]))
    assert places[0][0]["consumed"] == state["consumed"]  # the refused position's place
    assert places[0] == places[1]


def test_a_resume_plans_the_epoch_once_from_its_place(monkeypatch) -> None:
    """Loading a position and reading the first batch plan the rest of the epoch once, from the position's place
    (no plan of the whole epoch: it would about double the time to the first batch after a resume)."""
    saved = _loaders(2, seed=4)[0]
    batches = iter(saved)
    next(batches), next(batches)
    state = saved.state_dict()
    resumed = _loaders(2, seed=4)[0]
    plan, starts = TokenBudgetBatchSampler.plan, []

    def recorded(self, num_processes=1, start=0, replans=None, epoch=None):
        starts.append(start)
        return plan(self, num_processes, start, replans, epoch)

    monkeypatch.setattr(TokenBudgetBatchSampler, "plan", recorded)
    resumed.load_state_dict(state)
    first = next(iter(resumed)).tolist()
    assert starts == [state["consumed"]]
    assert first == next(batches).tolist()


def test_a_dispatched_step_that_is_not_the_plans_is_an_error_not_wrong_marks() -> None:
    """A process receiving a step whose real samples (as process 0's message tells them) are not its own plan's
    fails with a DispatchError naming the fix: process 0 planned another epoch (set_epoch on some processes only)."""
    from shardplug.core.dispatch.budget_steps import BudgetDispatchPlan
    from shardplug.core.dispatch.dispatch_plan import DispatchError
    from shardplug.core.sharding.layout import ShardLayout
    from shardplug.core.sharding.shard_plan import PassRecord
    from shardplug.core.sharding.token_budget import TokenBudgetPlan

    layout = ShardLayout(2, 1)
    plan = BudgetDispatchPlan(layout, TokenBudgetPlan(TokenBudgetBatchSampler(LENGTHS, BUDGET, seed=1), layout))
    reading = TokenBudgetBatchSampler(LENGTHS, BUDGET, seed=1)

    def received(epoch: int, record: PassRecord):
        reading.set_epoch(epoch)  # the steps process 0 read, as its messages tell them
        told = TokenBudgetPlan(reading, layout)
        told.begin_reading()
        for step in range(told.num_batches()):
            real, record.step_samples = told.pass_step(step)
            record.step_real = (real, 0)
            yield step, False

    record = PassRecord()
    assert len(list(plan.pass_batches(received(0, record), record))) == plan.num_batches()
    plan.source.start_after(0)
    with pytest.raises(DispatchError, match="plan has .* set_epoch, load_state_dict and skip_first_batches alike"):
        list(plan.pass_batches(received(1, record), record))


def _marked(loader, batches=None) -> tuple[list[int], list[bool]]:
    """The samples of the rest of ``loader``'s pass (``batches``: one begun) and whether each batch was marked
    its last."""
    samples, marks = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error", LengthMismatchWarning)  # the pass yields what len() says
        for batch in batches if batches is not None else loader:
            samples += batch.tolist()
            marks.append(loader.end_of_dataloader)
    return samples, marks


@pytest.mark.parametrize(
    "options", [{}, {"use_stateful_dataloader": True, "prefetch_depth": 2}], ids=["plain", "ahead"]
)
def test_a_pass_plans_the_windows_as_it_reaches_them_and_marks_its_last_batch(monkeypatch, options) -> None:
    """The first batch, of a fresh pass and after a resume on another number of processes, plans the place's
    window only (not the rest of the epoch nor, on another number, the windows before the place: at 10^7 lengths
    that is seconds); the pass marks its last batch
    (``end_of_dataloader``) as the plan reaches it, and yields what ``len()`` says."""
    planned: list[tuple[int, int, int]] = []
    plan_window = budget_plan.plan_window
    monkeypatch.setattr(budget_plan, "plan_window", lambda *args: planned.append(args[4]) or plan_window(*args))
    saved = _loaders(2, MANY, window=50, loader_options=dict(options), seed=6)
    iterators = [iter(loader) for loader in saved]
    seen = [i for it in iterators for i in next(it).tolist()]
    assert planned == [(0, 0, 0), (0, 0, 0)]  # each process: the first window
    for _ in range(6):
        seen += [i for it in iterators for i in next(it).tolist()]
    state = saved[0].state_dict()
    position = state.get("_shardplug_position", state)  # (the StatefulDataLoader's state holds it)
    place, place_window = position["consumed"], position["consumed"] // 50
    assert position["dataset_state"] is not None  # inside its window
    for resumed_on in (2, 3):
        resumed = _loaders(resumed_on, MANY, window=50, loader_options=dict(options), seed=6)
        rest = []
        for loader in resumed:
            planned.clear()
            loader.load_state_dict(state)
            batches = iter(loader)
            rest += next(batches).tolist()
            # the place's window (where the first batch is its last step, the next one too: is it the pass's last?)
            after = planned[1:] if resumed_on == 2 else planned[2:]
            if resumed_on == 2:
                assert planned[0] == (0, place_window, 0)
            else:  # planned for 2 and its rest for 3 (the batches before the place on 3: counted, not planned)
                assert planned[:2] == [(0, place_window, 0), (0, place_window, 1)]
            assert after in ([], [(0, place_window + 1, 0)])
            plan, length = loader.plan, len(loader)  # the pass's: the rest of its epoch
            assert plan.batches_before(place) == plan.num_batches(0) - plan.num_batches(place)
            samples, marks = _marked(loader, batches)
            rest += samples
            assert marks == [False] * (len(marks) - 1) + [True] and len(marks) + 1 == length
        assert sorted(seen + rest) == list(range(MANY.size))
    for loader in saved:  # a whole pass: its last batch marked
        assert _marked(loader)[1] == [False] * (len(loader) - 1) + [True]


def test_a_resize_at_a_window_start_counts_the_batches_before_it_on_the_new_layout() -> None:
    """A position at a window's start (no ``dataset_state``) resumed on another number of processes: the pass
    counts the batches the new layout has before the place (the epoch's less those from the place), also where
    a plan from the epoch's start, passing the place, was made first (with ``drop_last`` a loaded loader asks
    whether its epoch's start has a step)."""
    saved = _loaders(2, MANY, window=50, drop_last=True, seed=6)
    iterators = [iter(loader) for loader in saved]
    position = saved[0].state_dict()
    while position["consumed"] % 50 or not position["consumed"]:
        for it in iterators:
            next(it)
        position = saved[0].state_dict()
    assert position["dataset_state"] is None
    counted = _loaders(3, MANY, window=50, drop_last=True, seed=6)[0].plan
    before = counted.num_batches(0) - counted.num_batches(position["consumed"])
    assert before > 0
    for loader in _loaders(3, MANY, window=50, drop_last=True, seed=6):
        loader.load_state_dict(position)
        next(iter(loader))
        assert loader.state_dict()["batches_yielded"] == before + 1


@pytest.mark.parametrize("resumed_on", [2, 3])
def test_a_position_inside_a_later_epoch_resumes_in_that_epoch(resumed_on: int) -> None:
    """A position saved inside epoch 1 (its place one of epoch 1's plan, not of epoch 0's) loads into a new loader,
    whose sampler stands at epoch 0 until the pass begins: its place is asked of its own epoch, and the rest of
    that epoch comes once (the uninterrupted run's on the same number of processes)."""
    saved = _loaders(2, seed=5, cost="padded")
    for loader in saved:
        assert len(list(loader))  # epoch 0, whole
    iterators = [iter(loader) for loader in saved]  # epoch 1
    seen = [i for _ in range(2) for it in iterators for i in next(it).tolist()]
    state = saved[0].state_dict()
    assert state["epoch"] == 1 and state["dataset_state"] is not None  # inside its window
    uninterrupted = [[batch.tolist() for batch in it] for it in iterators]
    resumed = _loaders(resumed_on, seed=5, cost="padded")
    for loader in resumed:
        loader.load_state_dict(state)
    parts = _epoch(resumed)
    assert sorted(seen + [i for part in parts for batch in part for i in batch]) == list(range(50))
    if resumed_on == 2:
        assert parts == uninterrupted


def test_a_later_pass_at_a_loaded_positions_place_saves_its_own_window_plan() -> None:
    """A position of 3 processes resumed on 2 plans the rest of its window again; a later pass (here the next
    epoch's, in the same order without shuffle) that stands at the same place planned that window from its start
    on 2: its position says so, and resuming it reads every sample once."""
    lengths = [54, 52, 34, 94, 37, 66, 38]

    def steps(loaders, count: int) -> list[int]:
        iterators = [iter(loader) for loader in loaders]
        return [i for _ in range(count) for it in iterators for i in next(it).tolist()]

    saved = _loaders(3, lengths=lengths, budget=100, shuffle=False)
    steps(saved, 1)
    position = saved[0].state_dict()
    assert position["dataset_state"] is not None  # inside its window
    resized = _loaders(2, lengths=lengths, budget=100, shuffle=False)
    for loader in resized:
        loader.load_state_dict(position)
    _epoch(resized)
    seen = steps(resized, 1)  # the next epoch's pass
    state = resized[0].state_dict()
    uninterrupted = _loaders(2, lengths=lengths, budget=100, shuffle=False)
    assert steps(uninterrupted, 1) == seen
    assert state["consumed"] == position["consumed"]  # the loaded position's place, in another epoch
    expected = uninterrupted[0].state_dict()
    assert (state["consumed"], state["dataset_state"]) == (expected["consumed"], expected["dataset_state"])
    resumed = _loaders(2, lengths=lengths, budget=100, shuffle=False)
    for loader in resumed:
        loader.load_state_dict(state)
    assert sorted(seen + [i for part in _epoch(resumed) for batch in part for i in batch]) == list(range(7))


@example(  # the place of epoch 1's cut is epoch 0's loaded place: the loaded window's history was saved again
    lengths=[0, 0, 0, 0, 0, 1, 1, 14, 14, 14, 14],
    sizes=[1, 2, 1],
    cuts=[0.5, 0.5],
    cost="tokens",
    drop_last=False,
    window=6,
)
@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=60),
    sizes=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    cuts=st.lists(st.floats(0, 1, exclude_max=True), min_size=2, max_size=2),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
    drop_last=st.booleans(),
    window=st.integers(2, 20),
)
def test_chained_resumes_through_the_loader_read_every_sample_of_each_epoch_once(
    lengths: list[int], sizes: list[int], cuts: list[float], cost: str, drop_last: bool, window: int
) -> None:
    """Through the loaders: epoch 0 read on N0 up to a cut, resumed on N1 to its end and into epoch 1 up to a cut,
    resumed on N2 to the end of epoch 1. Each epoch: every sample once (at most once with ``drop_last``), every
    process as many micro-batches, ``len()`` what a pass yields (a later pass at a loaded place once saved the
    loaded window's history as its own: samples lost and repeated). A position with no step left on the new
    number of processes (``drop_last``) resumes at the next epoch's start."""
    options = dict(cost=cost, drop_last=drop_last, seed=3)
    read: dict[int, list[int]] = {}

    def loaders(n: int, state: dict | None = None) -> list[shardplug.PreparedDataLoader]:
        made = _loaders(n, np.asarray(lengths), budget=30, window=window, **options)
        for loader in made:
            loader.track_padding()
            if state is not None:
                loader.load_state_dict(state)
        return made

    def take(parts: list[shardplug.PreparedDataLoader], cut: float | None) -> None:
        epoch, length = parts[0].epoch, len(parts[0])
        assert [len(loader) for loader in parts] == [length] * len(parts)
        pairs = [(iter(loader), loader) for loader in parts]
        for _ in range(length if cut is None else int(cut * length)):
            read.setdefault(epoch, []).extend(i for it, loader in pairs for i in _real_rows(next(it), loader))
        if cut is None:
            assert all(next(it, None) is None for it, _ in pairs)  # len() was what the pass yields

    first = loaders(sizes[0])
    take(first, cuts[0])
    second = loaders(sizes[1], first[0].state_dict())
    moved_on = second[0].epoch == 1  # nothing of epoch 0 left on N1 (drop_last)
    assert not moved_on or drop_last
    take(second, None)
    if not moved_on:
        for loader in second:
            loader.set_epoch(1)
        take(second, cuts[1])
        take(loaders(sizes[2], second[0].state_dict()), None)
    for epoch, samples in read.items():  # each read to its end, over two loaders
        assert len(set(samples)) == len(samples), epoch
        if not drop_last:
            assert sorted(samples) == list(range(len(lengths))), epoch


def _real_rows(batch, loader: shardplug.PreparedDataLoader) -> list[int]:
    """The batch's real samples (a padding micro-batch holds none)."""
    return batch.tolist()[: loader.batch_real_count]
