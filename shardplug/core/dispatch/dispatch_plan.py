"""Dispatch: process 0 reads the global batches, every process receives its rows."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from shardplug.core._internal.rows import (
    batch_rows,
    concatenate_rows,
    describe_path,
    flatten,
    leaf_spec,
    mark_ragged_rows,
    slice_rows,
    take_rows,
)
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import (
    PassRecord,
    PlanDefaults,
    ShardPlan,
    check_consumed,
    check_saved_state,
    global_batch_samples,
)

__all__ = ["DispatchPlan", "DispatchError", "CutStep", "StepPadding"]


class DispatchError(RuntimeError):
    """Raised on every process when process 0 cannot dispatch a batch."""


class CutStep:
    """A step that is already cut: one batch per process (``N`` full batches of equal rows)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts


class StepPadding(NamedTuple):
    """Where the padding of one step begins, as every process learns it with the step: the step's
    ``real`` rows over all processes, the first process whose part holds padding (``part``; the number
    of processes when no part does) and that part's real rows (``rows``). The parts before it are
    all real, those after it all padding (padding always comes last, in process order). ``samples``: a
    fingerprint of the step's samples where every process's plan names them (a token budget's steps, whose
    parts are whole micro-batches: see :mod:`~shardplug.core.dispatch.budget_steps`), which each process
    checks against its own plan; 0 elsewhere.

    Example (a step of 3 real rows padded to 4, cut in 2 parts of 2)::

        >>> padding = StepPadding(real=3, part=1, rows=1)
        >>> [padding.real_rows(j, 2) for j in range(2)]
        [2, 1]
    """

    real: int
    part: int
    rows: int
    samples: int = 0

    def real_rows(self, process_index: int, own_rows: int) -> int:
        """The real rows of process ``process_index``'s part of ``own_rows`` rows."""
        if process_index < self.part:
            return own_rows
        return self.rows if process_index == self.part else 0

    def mark(self, record: PassRecord, process_index: int, rows: int | None) -> None:
        """Note in ``record`` (the pass's) that this step is being handed out: its real rows, and those of
        process ``process_index``'s part of ``rows`` rows (and the fingerprint of its samples)."""
        record.step_real = (self.real, self.real_rows(process_index, rows or 0))
        record.step_samples = self.samples


_FIX = "pass split_batches=True (one batch per step, no concatenation) or dispatch_batches=False"


def _trailing(leaf: Any) -> Any:
    """What must agree between the parts of one step: a tensor's dtype and shape beyond dim 0."""
    dtype, shape = leaf_spec(leaf)
    return (dtype, shape[1:]) if shape is not None else dtype


def _kind(leaf: Any) -> Any:
    """What must agree between the batches of one step: a tensor's dtype and number of dimensions."""
    dtype, shape = leaf_spec(leaf)
    return (dtype, len(shape)) if shape is not None else dtype


def _joinable(batches: list[Any]) -> bool:
    """Whether ``batches`` (of one structure) can be joined along their rows: every tensor leaf has
    the same shape beyond dim 0 in all of them.

    Example::

        >>> _joinable([torch.zeros(2, 4), torch.zeros(3, 4)]), _joinable([torch.zeros(2, 4), torch.zeros(2, 5)])
        (True, False)
    """
    flat = [flatten(batch) for batch in batches]
    if any(skeleton != flat[0][1] or len(leaves) != len(flat[0][0]) for leaves, skeleton in flat):
        return False
    return all(len({_trailing(leaf) for leaf in column}) == 1 for column in zip(*(leaves for leaves, _ in flat)))


class DispatchPlan(PlanDefaults):
    """Process 0 reads the global batches; each step takes one of them (splitting) or ``N``, and
    every process receives its rows.  ``length`` is the number of global batches per epoch;
    ``source`` the plan of process 0's global batches (it skips them on a resume), or ``None``
    when they are read and dropped.

    The plan also owns the rows of each step: the check of the batches joined into one
    (:meth:`check_step`), the step they make, padded from the epoch's head (:meth:`step`), and
    which rows go to which process (:meth:`cut`).

    Example (2 processes, batches of 2: a short last step is padded with the epoch's first row)::

        >>> plan = DispatchPlan(ShardLayout.for_batches(2, num_processes=2), length=3)
        >>> plan.num_batches()
        2
        >>> group = [torch.tensor([4]), torch.tensor([5])]
        >>> step = plan.step(group, plan.check_step(group), plan.head_rows([torch.tensor([0, 1])]), uncut=False)
        >>> [part.tolist() for part in plan.cut(step, slice_rows)]
        [[4], [5]]
        >>> plan.cut(plan.step([torch.tensor([4])], [1], torch.tensor([0]), uncut=False), slice_rows)[1].tolist()
        [0]
    """

    unit = "global_batches"

    def __init__(self, layout: ShardLayout, length: int | None = None, source: ShardPlan | None = None) -> None:
        self.layout = layout
        self.length = length
        self.source = source

    @property
    def sampler(self) -> Any:
        """The index sampler of process 0's global batches: its source's (``None`` for a stream).
        The loader finds the shuffle to seed, save and restore through it, as for any plan."""
        return getattr(self.source, "sampler", None)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        if self.source is not None:
            return self.source.start_after(consumed, dataset_state)
        return check_consumed(consumed)

    def saved_state(self, consumed: int) -> Any:
        """Process 0's source's own part of a position (a mixture's order), where it has one."""
        return self.source.saved_state(consumed) if self.source is not None else None

    def start_in_workers(self, num_workers: int) -> contextlib.AbstractContextManager[bool]:
        """Process 0's source's (a mixture's workers start anew after its order changed); else nothing waits."""
        if self.source is not None:
            return self.source.start_in_workers(num_workers)
        return contextlib.nullcontext(False)

    def check_saved_state(self, state: Any) -> None:
        """The source's refusals of a saved state of its own (a mixture's)."""
        if self.source is not None:
            check_saved_state(self.source, state)

    @property
    def state_everywhere(self) -> bool:
        """Whether the source's saved state holds at every place (a mixture's order)."""
        return bool(getattr(self.source, "state_everywhere", False))

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        """The real rows of this process's part of the step being handed out, as the step's message told
        them (:class:`StepPadding`); no indices: only process 0 reads them."""
        if record.step_real is None:
            raise ValueError(f"dispatch: no step of this pass was handed out yet (batch {batch})")
        return None, record.step_real[1]

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def epoch_size(self) -> int | None:
        return self.length

    def num_batches(self, consumed: int = 0) -> int | None:
        if self.length is None:
            return None
        rest = max(self.length - check_consumed(consumed), 0)
        per_step = self.consumed_per_batch
        return rest // per_step if self.layout.drop_last else -(-rest // per_step)

    def samples_before(self, consumed: int) -> int | None:
        return global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> bool | None:
        rest = self.num_batches(consumed)
        return None if rest is None else rest == 0

    # -- the rows of one step: the check, the cut, the padding ----------------------------------
    @property
    def head_size(self) -> int:
        """Rows of the epoch's head kept to pad a short last step with: ``N - 1`` (at least one)."""
        return max(self.layout.num_processes - 1, 1)

    def takes_step(self, group: list[Any]) -> bool:
        """Whether the batches read for one step make a step: a short last group does not with ``drop_last``."""
        return not (self.layout.drop_last and len(group) < self.layout.batches_per_step)

    def check_step(self, group: list[Any]) -> list[int]:
        """The rows of each batch of one step; a :class:`DispatchError` when they cannot be
        dispatched together (no rows, tensors of different rows, or batches that differ in
        structure, dtype or number of dimensions). Shapes beyond dim 0 may differ (a collate that
        pads each batch to its own longest row): :meth:`step` then sends each process its own batch.

        Example::

            >>> plan = DispatchPlan(ShardLayout.for_batches(2, num_processes=2))
            >>> plan.check_step([torch.zeros(2, 3), torch.zeros(1, 5)])
            [2, 1]
        """
        rows, first = [], None
        for batch in group:
            leaves, skeleton = flatten(batch)
            count = batch_rows(leaves)
            if count is None:
                raise DispatchError(
                    "dispatch_batches=True cuts batches along their rows, but this batch has no tensor with a batch "
                    "dimension and no list of values to cut; give it one, or pass dispatch_batches=False"
                )
            for k, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != count:
                    raise DispatchError(
                        f"dispatch_batches=True needs every tensor of a batch to have the same number of rows, but "
                        f"{describe_path(skeleton, k)} has {leaf.shape[0]} and the batch {count}; "
                        "pass dispatch_batches=False"
                    )
            signature = (skeleton, [_kind(leaf) for leaf in leaves])
            if first is None:
                first = signature
            elif signature != first:
                raise DispatchError(
                    "dispatch_batches=True sends the batches of one step together, but they differ in structure, "
                    f"dtype or number of dimensions within the step ({first[1]} vs {signature[1]}); {_FIX}"
                )
            rows.append(count)
        return rows

    def step(self, group: list[Any], rows: list[int], head: Any, uncut: bool) -> Any:
        """The step made of ``group`` (its batches' ``rows`` checked): a :class:`CutStep` when
        ``uncut`` (the default cut of whole batches) and the group is ``N`` batches of equal rows
        -- batch ``j`` is exactly process ``j``'s rows --, else the batches joined along dim 0, a
        short step padded from ``head`` with ``even_batches``.

        Batches whose shapes beyond dim 0 differ cannot be joined: each process gets its own batch
        whole (a :class:`CutStep` of every batch, as its shape is), and with ``even_batches`` a
        process left without one in a short last step gets a batch of one padding row
        (:meth:`padding_parts`); without ``even_batches``, a batch of no rows.

        Example::

            >>> plan = DispatchPlan(ShardLayout.for_batches(2, num_processes=2))
            >>> head = plan.head_rows([torch.arange(2)])
            >>> plan.step([torch.arange(2), torch.arange(2, 3)], [2, 1], head, uncut=True).tolist()
            [0, 1, 2, 0]
            >>> ragged = plan.step([torch.zeros(2, 4), torch.zeros(1, 5)], [2, 1], head, uncut=True)
            >>> [tuple(part.shape) for part in plan.cut(ragged, slice_rows)]
            [(2, 4), (1, 5)]
        """
        if uncut and len(group) == self.layout.batches_per_step and len(set(rows)) == 1:
            return CutStep(group)
        if not _joinable(group):
            if not uncut:
                raise DispatchError(
                    "dispatch_batches=True with slice_fn_for_dispatch joins the batches of one step before it cuts "
                    "them, but they differ in shape beyond dim 0 within the step; leave slice_fn_for_dispatch unset "
                    f"(each process then gets its own batch, as its shape is), {_FIX}"
                )
            return CutStep(group + self.padding_parts(group, head))
        step = group[0] if len(group) == 1 else concatenate_rows(group)
        return self.pad_step(step, head) if self.layout.even_batches else step

    def padding_of(self, step: Any, rows: list[int]) -> StepPadding:
        """Where the padding of ``step`` (made by :meth:`step` of batches of ``rows`` rows) begins: the
        rows :meth:`pad_step` added come last, so the parts :meth:`cut` makes hold them last; the parts
        :meth:`padding_parts` added are padding whole.

        Example (2 processes, a short last step of 3 rows padded to 4)::

            >>> plan = DispatchPlan(ShardLayout.for_batches(4, num_processes=2, split_batches=True))
            >>> step = plan.step([torch.arange(3)], [3], torch.tensor([0]), uncut=False)
            >>> plan.padding_of(step, [3])
            StepPadding(real=3, part=1, rows=1, samples=0)
        """
        real, n = sum(rows), self.layout.num_processes
        if isinstance(step, CutStep):  # whole batches: those of the group real, the padding parts after them
            return StepPadding(real, len(rows), 0) if len(step.parts) > len(rows) else StepPadding(real, n, 0)
        for j, part in enumerate(self.part_slices(batch_rows(flatten(step)[0]) or 0)):
            if part.stop > real:
                return StepPadding(real, j, max(real - part.start, 0))
        return StepPadding(real, n, 0)

    def padding_parts(self, group: list[Any], head: Any) -> list[Any]:
        """The parts of the processes a short step of batches that cannot be joined leaves without
        a batch: one row of ``head`` each (cycled) with ``even_batches``, else no rows."""
        missing = range(self.layout.num_processes - len(group))
        if not self.layout.even_batches:
            return [slice_rows(group[0], slice(0, 0)) for _ in missing]
        source_rows = batch_rows(flatten(head)[0]) or 1
        return [take_rows(head, torch.tensor([k % source_rows])) for k in missing]

    def pad_step(self, step: Any, head: Any) -> Any:
        """``step`` completed to a multiple of ``N`` rows with the rows of ``head`` (wrapped); with
        its own first rows when the head's shape beyond dim 0 is another (a batch padded to its own
        longest row): the rows that pad are duplicates either way, counted out by ``remainder``."""
        rows = batch_rows(flatten(step)[0]) or 0
        missing = -rows % self.layout.num_processes
        if missing == 0:
            return step
        if not _joinable([step, head]):
            head = self.head_rows([step])
        source_rows = batch_rows(flatten(head)[0]) or 1
        picks = torch.arange(missing) % source_rows
        return concatenate_rows([step, take_rows(head, picks)])

    def head_rows(self, group: list[Any]) -> Any:
        """A copy of the first :attr:`head_size` rows of the joined ``group`` (fewer when it is shorter)."""
        count, taken, pieces = self.head_size, 0, []
        for batch in group:
            if taken >= count:
                break
            piece = slice_rows(batch, slice(0, count - taken))
            pieces.append(piece)
            taken += batch_rows(flatten(piece)[0]) or 0
        if len(pieces) > 1 and not _joinable(pieces):  # batches padded to lengths of their own: the first
            pieces, taken = pieces[:1], batch_rows(flatten(pieces[0])[0]) or 0
        rows = concatenate_rows(pieces) if len(pieces) > 1 else pieces[0]
        return take_rows(rows, torch.arange(min(count, taken)))

    def epoch_head(self, group: list[Any], record: PassRecord, load: Callable[[list[int]], Any] | None = None) -> Any:
        """The rows padding cycles through: a copy of the epoch's first :attr:`head_size` rows.

        They are the first rows of ``group`` (the pass's first step), unless the pass starts
        mid-epoch (a resume or a skip) and ``load`` makes a batch of dataset indices (map-style
        data): then the epoch's first indices, loaded.
        """
        if record.started_at > 0 and load is not None:
            return mark_ragged_rows([load(record.first_indices(self.head_size))])[0]
        return self.head_rows(group)

    def part_slices(self, rows: int) -> list[slice]:
        """The rows of a step of ``rows`` rows each process receives: consecutive ranges, the first
        ``rows % N`` one row longer (with ``even_batches`` a step's rows divide by ``N``).

        Example::

            >>> DispatchPlan(ShardLayout.for_batches(2, num_processes=3, even_batches=False)).part_slices(7)
            [slice(0, 3, None), slice(3, 5, None), slice(5, 7, None)]
        """
        n = self.layout.num_processes
        sizes = [rows // n + (1 if j < rows % n else 0) for j in range(n)]
        starts = [sum(sizes[:j]) for j in range(n)]
        return [slice(starts[j], starts[j] + sizes[j]) for j in range(n)]

    def cut(self, step: Any, slice_fn: Callable[[Any, slice, int, int], Any]) -> list[Any]:
        """Every process's part of ``step`` (``slice_fn(step, rows, j, N)`` for process ``j``); a
        :class:`DispatchError` when the parts differ in structure or in shape beyond dim 0."""
        if isinstance(step, CutStep):  # already one batch per process, nothing to cut
            return step.parts
        n = self.layout.num_processes
        slices = self.part_slices(batch_rows(flatten(step)[0]) or 0)
        parts = [slice_fn(step, slices[j], j, n) for j in range(n)]
        first_leaves, first_skeleton = flatten(parts[0])
        for part in parts[1:]:
            leaves, skeleton = flatten(part)
            if skeleton != first_skeleton or [_trailing(l) for l in leaves] != [_trailing(l) for l in first_leaves]:
                raise DispatchError(
                    "slice_fn_for_dispatch returned parts of different structure or shape for different processes"
                )
        return parts

    # -- answers of the loader's protocol (position keeping, pass start) --
    read_ahead = 1
    """Process 0 reads a step ahead (its announcement says whether a step is the pass's last), so a
    ``StatefulDataLoader``'s own state is past the step handed out last (and the other processes'
    states never moved): a resume skips by the position (by index for map-style data, by reading past
    the global batches of a stream), which is exact."""

    @property
    def stream(self) -> bool:
        """Process 0 reads a stream (its global batches are read and dropped on a resume: no ``source``)."""
        return self.source is None
