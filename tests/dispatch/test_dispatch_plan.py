"""The rows of a dispatched step, as the plan decides them (one process, no process group).

For any rows and number of processes: the parts of a step are consecutive, cover it exactly
and differ by at most one row; a short step is padded to a multiple of N with the epoch's head,
cycled; N full batches of equal rows are every process's part as they are; a step whose
batches do not agree is refused. Batches whose shapes beyond dim 0 differ (padded each to its own
longest row) are every process's part whole; lists of one tensor per row are cut row by row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplug import DispatchError
from shardplug.core._internal.rows import RaggedRows, flatten, mark_ragged_rows, slice_rows
from shardplug.core.dispatch.dispatch_plan import CutStep, DispatchPlan
from shardplug.core.sharding.layout import ShardLayout


def _plan(n: int, even_batches: bool = True, split_batches: bool = False) -> DispatchPlan:
    return DispatchPlan(ShardLayout.for_batches(n if split_batches else 1, n, 0, split_batches, even_batches))


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 60), n=st.integers(1, 8))
def test_the_parts_of_a_step_are_consecutive_and_as_equal_as_can_be(rows: int, n: int) -> None:
    step = torch.arange(rows)
    parts = _plan(n, even_batches=False).cut(step, slice_rows)
    assert torch.cat(parts).tolist() == list(range(rows))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 30), n=st.integers(1, 6), head=st.integers(1, 6))
def test_a_short_step_is_padded_with_the_epoch_head_cycled(rows: int, n: int, head: int) -> None:
    plan = _plan(n)
    first = torch.arange(100, 100 + head)
    padded = plan.step([torch.arange(rows)], [rows], plan.head_rows([first]), uncut=False)
    kept = min(head, plan.head_size)
    missing = -rows % n
    assert padded.tolist() == list(range(rows)) + [100 + i % kept for i in range(missing)]
    assert len(padded) % n == 0


def test_n_full_batches_of_equal_rows_are_the_parts_as_they_are() -> None:
    plan = _plan(3)
    group = [torch.full((2,), j) for j in range(3)]
    step = plan.step(group, plan.check_step(group), None, uncut=True)
    assert isinstance(step, CutStep) and plan.cut(step, slice_rows) is group
    joined = plan.step(group, plan.check_step(group), None, uncut=False)  # a slice_fn of the user's: joined
    assert joined.tolist() == [0, 0, 1, 1, 2, 2]


def test_unequal_batches_are_joined_and_padded_from_the_head() -> None:
    plan = _plan(2)
    group = [torch.arange(3), torch.arange(3, 5)]
    step = plan.step(group, plan.check_step(group), plan.head_rows(group), uncut=True)
    assert [part.tolist() for part in plan.cut(step, slice_rows)] == [[0, 1, 2], [3, 4, 0]]


def test_a_step_drops_its_short_group_only_with_drop_last() -> None:
    keep = DispatchPlan(ShardLayout.for_batches(2, 2))
    drop = DispatchPlan(ShardLayout.for_batches(2, 2, drop_last=True))
    assert keep.takes_step([torch.zeros(2)]) and not drop.takes_step([torch.zeros(2)])
    assert drop.takes_step([torch.zeros(2), torch.zeros(2)])


@pytest.mark.parametrize(
    "group, words",
    [
        ([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(2, 3, 1)}], "differ in structure, dtype or number of dim"),
        ([{"x": torch.zeros(2, 3)}, {"y": torch.zeros(2, 3)}], "differ in structure, dtype or number of dim"),
        ([{"x": torch.zeros(2), "y": torch.zeros(3)}], "the same number of rows"),
        ([7], "no tensor with a batch dimension"),
    ],
)
def test_a_step_that_cannot_be_dispatched_is_refused(group: list, words: str) -> None:
    with pytest.raises(DispatchError, match=words):
        _plan(2).check_step(group)


def test_a_slice_fn_whose_parts_disagree_is_refused() -> None:
    def uneven_width(batch, rows, j, n):
        return batch[rows, : j + 1]

    with pytest.raises(DispatchError, match="slice_fn_for_dispatch returned parts"):
        _plan(2).cut(torch.zeros(4, 3), uneven_width)


# -- batches of their own shapes (a collate that pads each batch to its longest row) ---------------
def _widths(parts: list) -> list[tuple[int, ...]]:
    return [tuple(part.shape) for part in parts]


def test_batches_of_their_own_widths_are_every_process_part_whole() -> None:
    plan = _plan(2)
    group = [torch.zeros(2, 4), torch.ones(2, 7)]
    step = plan.step(group, plan.check_step(group), plan.head_rows(group), uncut=True)
    assert isinstance(step, CutStep) and _widths(plan.cut(step, slice_rows)) == [(2, 4), (2, 7)]
    unequal = [torch.zeros(2, 4), torch.ones(1, 7)]  # unequal rows too: still whole, not joined
    assert _widths(plan.cut(plan.step(unequal, [2, 1], None, uncut=True), slice_rows)) == [(2, 4), (1, 7)]


@pytest.mark.parametrize("even", [True, False])
def test_a_short_step_of_batches_of_their_own_widths_pads_the_processes_left_without_one(even: bool) -> None:
    plan = _plan(3, even_batches=even)
    first = [torch.arange(6).view(2, 3), torch.arange(6, 14).view(2, 4)]
    head = plan.head_rows(first)  # the epoch's first rows (their batches cannot be joined: the first's only)
    assert head.tolist() == [[0, 1, 2], [3, 4, 5]]
    last = [torch.full((2, 5), 7), torch.full((1, 2), 8)]
    parts = plan.cut(plan.step(last, plan.check_step(last), head, uncut=True), slice_rows)
    assert _widths(parts[:2]) == [(2, 5), (1, 2)]
    assert parts[2].tolist() == ([[0, 1, 2]] if even else [])  # one padding row, or none


def test_a_split_step_is_padded_with_its_own_rows_when_the_head_has_another_width() -> None:
    plan = _plan(2, split_batches=True)
    head = plan.head_rows([torch.zeros(2, 5)])
    padded = plan.step([torch.arange(6).view(3, 2)], [3], head, uncut=False)
    assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [0, 1]]  # the step's own first row, its width
    same = plan.step([torch.ones(3, 5)], [3], head, uncut=False)
    assert same[3].tolist() == [0.0] * 5  # the epoch's first row where the widths agree


def test_a_slice_fn_cannot_cut_batches_of_their_own_widths() -> None:
    plan = _plan(2)
    group = [torch.zeros(2, 4), torch.zeros(2, 5)]
    with pytest.raises(DispatchError, match="leave slice_fn_for_dispatch unset"):
        plan.step(group, plan.check_step(group), None, uncut=False)


def test_lists_of_one_tensor_per_row_are_cut_and_joined_row_by_row() -> None:
    plan = _plan(2)
    a = {"tokens": [torch.full((3,), 0), torch.full((1,), 1)], "ids": torch.tensor([0, 1])}
    b = {"tokens": [torch.full((2,), 2), torch.full((2,), 3)], "ids": torch.tensor([2, 3])}  # one length by chance
    c = {"tokens": [torch.full((4,), 4)], "ids": torch.tensor([4])}
    marked = mark_ragged_rows([a, b])
    assert all(isinstance(batch["tokens"], RaggedRows) for batch in marked)
    assert len({str(flatten(batch)[1]) for batch in marked}) == 1, "one structure for the step"
    step = plan.step(mark_ragged_rows([c]), [1], plan.head_rows(marked), uncut=False)  # a short last step, padded
    parts = plan.cut(step, slice_rows)
    assert [[t.tolist() for t in part["tokens"]] for part in parts] == [[[4, 4, 4, 4]], [[0, 0, 0]]]
    assert [part["ids"].tolist() for part in parts] == [[4], [0]]
    pair = [torch.zeros(2, 3), torch.zeros(2)]  # default_collate's [inputs, labels]: a container
    assert mark_ragged_rows([pair])[0] is pair and len(flatten(pair)[0]) == 2
