"""A stream this process reads as it is: the loader's own batches are its part (:class:`LocalPlan`).

The whole path of this kind: :func:`shard` (the planner's entry: one process, or a dispatcher's process 0,
which reads the stream for every process) and :class:`LocalPlan` (``len()``: the loader's batches,
counted by :mod:`~shardplug.core.sharding.counting`; a pass resumes by reading past what was consumed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardplug.core._internal.topology import Readers
from shardplug.core.sharding.counting import loader_length
from shardplug.core.sharding.fingerprint import FirstBatchCheck, checked_first_batch
from shardplug.core.sharding.kinds import Shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import PassRecord, PlanDefaults, check_consumed, global_batch_samples

__all__ = ["LocalPlan", "shard"]


class LocalPlan(PlanDefaults):
    """The loader's own batches are this process's part: a stream that sharded itself (each
    process reads only its shards), or data read by this process alone.  A position counts this
    loader's batches, so it resumes only with the same number of processes.  ``stream``: whether
    that data is a stream (``False`` for map-style data read as it is: its positions then name its
    sampler and length).  ``first_batch``: where every rank of the group reads the same data whole
    (the ranks of a device mesh's only data index), the check that their first batches agree."""

    unit = "batches"
    consumed_per_batch = 1
    untracked_reason = (
        "the data is not sharded by shardplug here (a stream that shards itself, or one process), so padding "
        "cannot be told apart; use loader.remainder for the last global batch"
    )

    def __init__(
        self,
        layout: ShardLayout,
        length: int | None = None,
        stream: bool = True,
        first_batch: FirstBatchCheck | None = None,
    ) -> None:
        self.layout = layout
        self.length = length
        self.stream = stream
        self.first_batch = first_batch

    def begin_pass(self) -> None:
        if self.first_batch is not None:
            self.first_batch.begin_pass()

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The loader's batches; with ``first_batch``, the ranks' first batches compared once it was read."""
        if self.first_batch is None:
            return batches
        return checked_first_batch(batches, self.first_batch, record=True)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        return check_consumed(consumed)  # the loader reads and drops them

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        raise ValueError(self.untracked_reason)

    def epoch_size(self) -> int | None:
        return self.length

    def num_batches(self, consumed: int = 0) -> int | None:
        return None if self.length is None else max(self.length - check_consumed(consumed), 0)

    def samples_before(self, consumed: int) -> int | None:
        return global_batch_samples(self.layout, consumed)  # its batches are the global ones

    def finished(self, consumed: int) -> bool | None:
        rest = self.num_batches(consumed)
        return None if rest is None else rest == 0


def shard(dataset: Any, layout: ShardLayout, batch_size: int | None, drop_last: bool, readers: Readers) -> Shard:
    """A stream read as it is under ``layout`` (one process, or a dispatcher's reader), its plan and the
    DataLoader's own batch size.  ``readers``: the ranks that read it, which the planner checked shuffle
    alike; where several do without a process group of their own (a device mesh's one data index), their
    first batches are compared."""
    check = FirstBatchCheck(replicas=True) if readers.size > 1 and readers.group is None else None
    plan = LocalPlan(layout, loader_length(dataset, batch_size, drop_last), first_batch=check)
    return Shard(dataset, plan, {"batch_size": batch_size, "drop_last": drop_last})
