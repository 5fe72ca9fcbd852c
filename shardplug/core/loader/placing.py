"""Where a pass that begins starts: after a loaded position, then after a ``skip_first_batches`` skip.

:class:`_PassPlacement` sets the pass's counters (``consumed_at_start``: how much of the epoch, in the
plan's unit, was consumed before it; ``resumed``: this process's batches of the epoch before it) and
tells the plan where its batches start (:meth:`~shardplug.core.sharding.shard_plan._ShardPlan.start_after`);
what the plan cannot skip the loader reads and drops (the count it returns).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import _InnerState
from shardplug.core.sharding.shard_plan import _ShardPlan

if TYPE_CHECKING:
    from shardplug.core.loader.passes import _LoaderPass

__all__ = ["_PassPlacement"]


class _PassPlacement:
    """How a pass of a loader with ``plan`` is placed: ``inner`` is its ``StatefulDataLoader``'s state,
    ``reads_through``: a skip is read through that ``StatefulDataLoader`` (its state then counts the
    batches), ``workers_split_stream``: only whole batches tell where each DataLoader worker is."""

    __slots__ = ("plan", "inner", "reads_through", "workers_split_stream")

    def __init__(self, plan: _ShardPlan, inner: _InnerState, reads_through: bool, workers_split_stream: bool) -> None:
        self.plan = plan
        self.inner = inner
        self.reads_through = reads_through
        self.workers_split_stream = workers_split_stream

    def place(self, current: _LoaderPass, position: Position | None, ended: bool, skip: int) -> int:
        """Position the pass ``current`` (which begins) after ``position`` and ``skip`` batches more
        (``ended``: the rest of an epoch whose end was loaded, an empty pass); return how many batches
        it reads and drops first."""
        discard = 0
        if ended:  # the rest of an epoch whose end was loaded: nothing (the DataLoader is not read)
            current.empty = True
            self.inner.repositions = False
            return 0
        if position is not None:
            discard = self._start_after(position, current)
        if skip:  # skip_first_batches: this pass starts that many batches later still
            plan = self.plan
            current.consumed_at_start += skip * plan.consumed_per_batch
            current.resumed += skip
            if self.reads_through:  # read through the StatefulDataLoader: its state counts them
                discard += skip
                current.record.fast_forwarded += skip  # their records are not the batches handed out
            elif self.workers_split_stream:  # only whole batches tell where each worker is: read and drop them
                discard += skip
            else:
                discard = plan.start_after(current.consumed_at_start)
        self.inner.repositions = False  # a loaded state of the StatefulDataLoader's own repositions this pass only
        return discard

    def _start_after(self, position: Position, current: _LoaderPass) -> int:
        """Position the pass ``current`` after what ``position`` consumed; return batches to read and drop."""
        plan = self.plan
        layout = plan.layout
        same_layout = (position.num_processes, position.split_batches) == (layout.num_processes, layout.split_batches)
        current.consumed_at_start = position.consumed
        if self.inner.repositions:  # a StatefulDataLoader that loaded its own state
            current.resumed = position.batches_yielded
            current.record.fast_forwarded = current.resumed  # drawn (and logged where the sampler logs), never handed
            return 0
        if same_layout:
            current.resumed = position.batches_yielded
            if self.workers_split_stream:  # only whole batches tell where each worker is: read and drop them
                return position.batches_yielded
        else:
            full, rest = plan.num_batches(0), plan.num_batches(position.consumed)
            current.resumed = (
                full - rest if full is not None and rest is not None else (position.consumed // plan.consumed_per_batch)
            )
        return plan.start_after(position.consumed, position.dataset_state)
