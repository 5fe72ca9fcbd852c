"""The position of a loader's last pass: its counters (the cursor's :class:`~shardplug.core.loader.cursor.PassState`),
the loader's identity and its shuffle's state.

:func:`pass_position` reads where a pass stands (its batches, what the epoch consumed before it) and
describes it as a :class:`~shardplug.core.resume.position.Position`: identical on every process, in
the plan's unit, so a position saved with N processes can be loaded with M.  A pass over for every
process is the next epoch's start.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from shardplug.core.loader.cursor import PassState
from shardplug.core.resume.position import Position
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import ShardPlan, consumed_after, plan_traits
from shardplug.core.shuffle.agreement import Shuffles

__all__ = ["layout_fields", "pass_position", "LoaderIdentity"]


class LoaderIdentity(NamedTuple):
    """What a position records of the loader besides its plan: its epoch, the dataset's length (``None``
    for a stream) and its number of DataLoader workers."""

    epoch: int
    dataset_length: int | None
    num_workers: int


def layout_fields(layout: ShardLayout) -> dict[str, Any]:
    """What a position records of the layout it describes a place in, beside ``drop_last`` and ``batch_size``
    (which a resize keeps): the number of processes, ``split_batches``, ``even_batches`` and the batch sizes."""
    return {
        "num_processes": layout.num_processes,
        "split_batches": layout.split_batches,
        "even_batches": layout.even_batches,
        "process_batch_size": layout.process_batch_size,
        "step_batch_size": layout.step_batch_size,
    }


def pass_position(plan: ShardPlan, loader: LoaderIdentity, current: PassState, shuffles: Shuffles) -> Position:
    """Where a pass that stands at ``current`` (the cursor's pass) stands, in the layout of ``plan``."""
    layout = plan.layout
    generator = shuffles.generator
    epoch, done, dataset_state = loader.epoch, current.yielded, None
    consumed = consumed_after(plan, current.record.started_at, done - current.resumed)
    generator_state = current.generator_state
    # A pass is over for every process once none has a batch left. A process with fewer batches
    # (even_batches=False) reports the same place as the others until its loop has ended by itself,
    # then the epoch's end (the others finish theirs before they meet it again).
    finished = plan.finished(consumed)
    if finished is None:  # unknown lengths: where every process yields as many batches, all end together,
        # and process 0's last batch is the job's last where it holds the most (docs/resume.md)
        finished = (
            layout.pads
            or layout.drop_last
            or layout.num_processes == 1
            or (plan_traits(plan).first_holds_most and layout.process_index == 0)
        )
    if current.complete and (current.exhausted or finished):
        epoch, done, consumed = epoch + 1, 0, 0
        generator_state = generator.get_state() if generator is not None else None
    else:
        dataset_state = plan.saved_state(consumed)  # the plan's own part (a dataset's own position)
    if generator_state is None and generator is not None:
        generator_state = generator.get_state()
    if dataset_state is None and plan_traits(plan).state_everywhere:  # an order that holds at an epoch's start too
        dataset_state = plan.saved_state(consumed)
    return Position(
        epoch=epoch,
        batches_yielded=done,
        consumed=consumed,
        unit=plan.unit,
        drop_last=layout.drop_last,
        dataset_length=None if plan.stream else loader.dataset_length,
        batch_size=layout.batch_size,
        **layout_fields(layout),
        sampler=shuffles.kind(plan.stream),
        num_workers=loader.num_workers,
        seeds=shuffles.seeds(),
        generator_state=generator_state,
        dataset_state=dataset_state,
    )
