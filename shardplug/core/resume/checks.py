"""The refusals of a position that a loader cannot resume exactly, decided before anything changes.

:class:`PositionCheck` compares a saved :class:`~shardplug.core.resume.position.Position` with the
loader it is loaded into, beyond the identity that :meth:`Position.check_resumable` compares: another
number of processes where the place cannot be shared out anew, another number of DataLoader workers
where each worker makes its own batches.  Every refusal names the fix.

Example::

    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.local import LocalPlan
    >>> check = PositionCheck(LocalPlan(ShardLayout(batch_size=2)), num_workers=0, inner_state_resumes=False)
    >>> check.workers_split_stream
    False
"""

from __future__ import annotations

from collections.abc import Callable

from shardplug.core.resume.position import Position
from shardplug.core.sharding.shard_plan import ShardPlan, check_saved_state, plan_traits

__all__ = ["PositionCheck"]


class PositionCheck:
    """What refuses a position for a loader with ``plan`` and ``num_workers`` DataLoader workers
    (``inner_state_resumes``: a ``StatefulDataLoader``'s own state is where its resumed pass continues)."""

    __slots__ = ("plan", "num_workers", "inner_state_resumes", "splits_by_worker")

    def __init__(self, plan: ShardPlan, num_workers: int, inner_state_resumes: bool) -> None:
        self.plan = plan
        self.num_workers = num_workers
        self.inner_state_resumes = inner_state_resumes
        self.splits_by_worker = plan_traits(plan).splits_by_worker

    @property
    def workers_split_stream(self) -> bool:
        """Data that splits itself across this loader's DataLoader workers: where each worker is cannot be
        found by skipping stream elements."""
        return self.splits_by_worker and self.num_workers > 0

    def check_loadable(
        self, position: Position, current: Position, stateful: bool, epoch_length: Callable[[], int | None]
    ) -> None:
        """Everything that refuses ``position`` for this loader (``current``: where it stands now;
        ``stateful``: the ``StatefulDataLoader``'s own state is loaded beside it; ``epoch_length``: this
        process's batches per epoch, asked for last)."""
        processes = self.plan.layout.num_processes
        at_start = (position.consumed, position.batches_yielded) == (0, 0)  # nothing to share out anew
        if position.num_processes != processes and position.unit == current.unit and not at_start:
            self.refuse_resize(position, stateful and self.inner_state_resumes)
        self.check_workers(position)
        # a plan whose steps consume what it says (a token budget's) checked the place itself (note_place: a place
        # between two of its steps); its epoch's length would be a plan from the epoch's start, made for nothing
        batches = None if plan_traits(self.plan).plans_steps else epoch_length()
        position.check_resumable(current, self.plan.epoch_size(), batches)
        check_saved_state(self.plan, position.dataset_state)

    def check_workers(self, position: Position) -> None:
        """Refuse a position inside an epoch whose place depends on the number of DataLoader workers
        (the loader's batches are read again and dropped, and the workers make them in their own
        order: a natively sharded stream, a stream that splits itself across workers) when it was saved
        with another number of workers than this loader's."""
        inside = (position.consumed, position.batches_yielded) != (0, 0)
        workers = self.num_workers
        if not inside or not (self.splits_by_worker or position.unit == "batches") or position.num_workers == workers:
            return
        if position.num_workers is None:
            raise ValueError(
                "the position was saved by a shardplug that did not record its DataLoader's num_workers, and this "
                "stream's place inside an epoch depends on it (each worker makes its own batches); resume from a "
                "position saved at an epoch's end, or with a position saved by this shardplug"
            )
        raise ValueError(
            f"the position was saved with num_workers={position.num_workers} and this loader has "
            f"num_workers={workers}: each DataLoader worker makes its own batches of this stream, so its "
            f"place inside an epoch depends on the number of workers; resume with num_workers={position.num_workers}, "
            "or from a position saved at an epoch's end"
        )

    def refuse_resize(self, position: Position, inner_state: bool) -> None:
        """Refuse a position inside an epoch, of another number of processes, where this loader cannot resize
        (``inner_state``: a StatefulDataLoader's own state, each process's, is what resumes it)."""
        plan = self.plan
        moves = f"cannot move from {position.num_processes} to {plan.layout.num_processes} processes"
        anew = (
            f"resume with num_processes={position.num_processes}, or from a position saved at an epoch's end (it "
            "loads into any number of processes)"
        )
        if plan_traits(plan).agrees_steps or plan.unit == "batches":
            raise ValueError(
                "this stream is sharded natively (each process reads its own shards) or read by one process, so its "
                f"position counts this process's batches, and a position inside an epoch {moves}; {anew}"
            )
        if self.workers_split_stream:
            raise ValueError(
                f"with num_workers={self.num_workers} each DataLoader worker reads its own part of this stream "
                "(it splits itself across workers), so its place is found by reading whole batches of the layout that "
                f"saved it, and a position inside an epoch {moves}; {anew}"
            )
        if inner_state:
            raise ValueError(
                "use_stateful_dataloader=True resumes this stream from each process's own saved state (its "
                f"DataLoader workers' places), which {moves}; {anew}"
            )
