"""Where a pass that begins starts: after a loaded position, then after a ``skip_first_batches`` skip.

:func:`place` answers a :class:`PassStart` (a value: ``consumed_at_start``, how much of the epoch,
in the plan's unit, was consumed before the pass; ``resumed``, this process's batches of the epoch before
it; how many batches to read and drop first) and tells the plan where its batches start
(:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.start_after`); the pass takes the start as its own.

Example::

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> from shardplug.core.loader.cursor import ParkedStart
    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.map_style import BatchSamplerPlan
    >>> plan = BatchSamplerPlan(BatchSampler(SequentialSampler(range(12)), 2, False), ShardLayout(2, 0, batch_size=2))
    >>> place(plan, ParkedStart(skip=2), reads_through=False, workers_split_stream=False)
    PassStart(consumed_at_start=4, resumed=2, discard=0, fast_forwarded=0, empty=False)
"""

from __future__ import annotations

from typing import NamedTuple

from shardplug.core.loader.cursor import ParkedStart
from shardplug.core.resume.position import Position
from shardplug.core.sharding.shard_plan import ShardPlan

__all__ = ["place", "PassPlacement", "PassStart"]


class PassStart(NamedTuple):
    """Where a pass starts: ``consumed_at_start`` (the epoch consumed before it, in the plan's unit),
    ``resumed`` (this process's batches of the epoch before it), ``discard`` (batches to read and drop
    first), ``fast_forwarded`` (batches drawn before the first one handed out, whose records are not the
    batches handed out) and ``empty`` (the rest of an epoch whose end was loaded: nothing is read)."""

    consumed_at_start: int = 0
    resumed: int = 0
    discard: int = 0
    fast_forwarded: int = 0
    empty: bool = False


def place(plan: ShardPlan, parked: ParkedStart, reads_through: bool, workers_split_stream: bool) -> PassStart:
    """Where a pass of a loader with ``plan`` that begins starts: after the ``parked`` position and its skip
    (``reads_through``: a skip is read through the loader's ``StatefulDataLoader``, whose state then counts the
    batches; ``workers_split_stream``: only whole batches tell where each DataLoader worker is)."""
    return PassPlacement(plan, reads_through, workers_split_stream).place(parked)


class PassPlacement:
    """How a pass of a loader with ``plan`` is placed (see :func:`place`)."""

    __slots__ = ("plan", "reads_through", "workers_split_stream")

    def __init__(self, plan: ShardPlan, reads_through: bool, workers_split_stream: bool) -> None:
        self.plan = plan
        self.reads_through = reads_through
        self.workers_split_stream = workers_split_stream

    def place(self, parked: ParkedStart) -> PassStart:
        """Where a pass that begins starts: after ``parked.position`` and ``parked.skip`` batches more
        (``parked.ended``: the rest of an epoch whose end was loaded, an empty pass)."""
        if parked.ended:  # the rest of an epoch whose end was loaded: nothing (the DataLoader is not read)
            return PassStart(empty=True)
        position, skip = parked.position, parked.skip
        start = self._start_after(position, parked.repositions) if position is not None else PassStart()
        if skip:  # skip_first_batches: this pass starts that many batches later still
            plan = self.plan
            consumed = start.consumed_at_start + skip * plan.consumed_per_batch
            start = start._replace(consumed_at_start=consumed, resumed=start.resumed + skip)
            if self.reads_through:  # read through the StatefulDataLoader: its state counts them
                start = start._replace(discard=start.discard + skip, fast_forwarded=start.fast_forwarded + skip)
            elif self.workers_split_stream:  # only whole batches tell where each worker is: read and drop them
                start = start._replace(discard=start.discard + skip)
            else:
                start = start._replace(discard=plan.start_after(consumed))
        return start

    def _batches_before(self, consumed: int) -> int:
        """The batches of the epoch before ``consumed`` (of another layout's position) counted on this one, the
        same on every process (a position is): this process's, where every process yields as many batches
        (padding, ``drop_last``); else the whole steps of this layout the place holds (``even_batches=False``:
        the processes' own counts differ by where the saved layout's leftovers fell, never by more than a step).

        Example (21 samples in batches of 3, a place after 3 global batches of 7, 2 processes)::

            >>> from torch.utils.data import BatchSampler, SequentialSampler
            >>> from shardplug.core.sharding.layout import ShardLayout
            >>> from shardplug.core.sharding.map_style import BatchSamplerPlan
            >>> def placed(index, even):
            ...     layout = ShardLayout(2, index, even_batches=even, batch_size=3)
            ...     plan = BatchSamplerPlan(BatchSampler(SequentialSampler(range(21)), 3, False), layout)
            ...     return PassPlacement(plan, False, False)._batches_before(3)
            >>> [placed(index, even=True) for index in range(2)], [placed(index, even=False) for index in range(2)]
            ([2, 2], [1, 1])
        """
        plan = self.plan
        layout = plan.layout
        full, rest = plan.num_batches(0), plan.num_batches(consumed)
        if full is None or rest is None or not (layout.pads or layout.drop_last or layout.num_processes == 1):
            return consumed // plan.consumed_per_batch
        return full - rest

    def _start_after(self, position: Position, repositions: bool) -> PassStart:
        """The start after what ``position`` consumed (``repositions``: a StatefulDataLoader loaded its own
        state, which places the pass)."""
        plan = self.plan
        layout = plan.layout
        same_layout = (position.num_processes, position.split_batches) == (layout.num_processes, layout.split_batches)
        consumed = position.consumed
        if repositions:  # a StatefulDataLoader that loaded its own state
            # drawn (and logged where the sampler logs), never handed out
            return PassStart(consumed, position.batches_yielded, fast_forwarded=position.batches_yielded)
        if same_layout:
            if self.workers_split_stream:  # only whole batches tell where each worker is: read and drop them
                return PassStart(consumed, position.batches_yielded, discard=position.batches_yielded)
            resumed = position.batches_yielded
        else:
            resumed = self._batches_before(consumed)
        return PassStart(consumed, resumed, discard=plan.start_after(consumed, position.dataset_state))
