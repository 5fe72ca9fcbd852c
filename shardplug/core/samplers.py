"""The per-process shard of a batch sampler (the seedable shuffle lives in ``shuffle.py``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import (
    BatchSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from .config import ShardplugConfig
from .layout import ShardLayout
from .plan import BatchSamplerPlan, PassRecord
from .shuffle import SeedableRandomSampler, draw_seed

__all__ = ["SeedableRandomSampler", "BatchSamplerShard", "IndexSamplerShard", "draw_seed"]

logger = logging.getLogger(__name__)

_INDEX_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
    range,
)
"""Samplers known to yield single indices (what a batch sampler wraps, never one itself)."""


def check_batch_sampler(batch_sampler: Any) -> None:
    """Refuse what cannot be a batch sampler: not iterable, or known to yield single indices."""
    wrap = "wrap your index sampler: BatchSampler(sampler, batch_size=..., drop_last=False)"
    if not hasattr(batch_sampler, "__iter__"):
        raise TypeError(
            f"batch_sampler={batch_sampler!r} is not an iterable of batches of indices; pass a batch sampler "
            f"(e.g. a torch.utils.data.BatchSampler), or {wrap}"
        )
    if isinstance(batch_sampler, _INDEX_SAMPLERS) and not hasattr(batch_sampler, "batch_size"):
        raise TypeError(
            f"batch_sampler={type(batch_sampler).__name__}(...) yields single indices, not batches of them; {wrap}"
        )


class BatchSamplerShard(Sampler[list[int]]):
    """The batches of ``batch_sampler`` that belong to process ``process_index`` of ``num_processes``.

    ``split_batches=False``: process ``i`` yields global batches ``i, i+N, i+2N, ...``.
    ``split_batches=True``: every global batch is cut into ``N`` slices; process ``i`` gets slice ``i``.
    ``even_batches=True`` (and no ``drop_last``) pads the end of the epoch with indices from its
    start so every process yields the same number of full batches.  ``len()`` is exactly the
    number of batches yielded.  With one process the batches pass through unchanged.

    Example::

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> bs = BatchSampler(SequentialSampler(range(21)), batch_size=3, drop_last=False)
        >>> [list(BatchSamplerShard(bs, 2, i))[-1] for i in range(2)]
        [[18, 19, 20], [0, 1, 2]]
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = ShardplugConfig.split_batches,
        even_batches: bool = ShardplugConfig.even_batches,
    ) -> None:
        check_batch_sampler(batch_sampler)
        batch_size = getattr(batch_sampler, "batch_size", None)
        drop_last = bool(getattr(batch_sampler, "drop_last", False))
        layout = ShardLayout.for_batches(
            batch_size, num_processes, process_index, split_batches, even_batches, drop_last
        )
        self.batch_sampler = batch_sampler
        self.plan = BatchSamplerPlan(batch_sampler, layout)
        self.epoch = 0
        self._record: PassRecord | None = None

    @property
    def layout(self) -> ShardLayout:
        return self.plan.layout

    num_processes = property(lambda self: self.layout.num_processes)
    process_index = property(lambda self: self.layout.process_index)
    split_batches = property(lambda self: self.layout.split_batches)
    even_batches = property(lambda self: self.layout.even_batches)
    drop_last = property(lambda self: self.layout.drop_last)
    batch_size = property(lambda self: self.layout.batch_size)
    per_process_batch_size = property(lambda self: self.layout.process_batch_size)
    batches_per_step = property(
        lambda self: self.layout.batches_per_step, doc="Global batches per step of all processes."
    )

    @property
    def sampler(self) -> Any:
        """The index sampler under the wrapped batch sampler (frameworks call ``set_epoch`` on it)."""
        return self.plan.sampler

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler and to its sampler (each that has ``set_epoch``)."""
        self.epoch = int(epoch)
        targets = [self.batch_sampler, self.sampler]
        for k, target in enumerate(targets):
            if target is not None and hasattr(target, "set_epoch") and all(target is not t for t in targets[:k]):
                target.set_epoch(epoch)

    def skip_next(self, num_batches: int) -> None:
        """Make the next iteration start after this process's first ``num_batches`` batches (one-shot)."""
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self.start_at_global(num_batches * self.batches_per_step)

    def start_at_global(self, global_batches: int) -> None:
        """Make the next iteration share out only the global batches after the first ``global_batches``
        (one-shot).  The count may come from a run with another number of processes: the rest of
        the epoch is then split among this run's processes."""
        self.plan.start_after(global_batches)

    def record_next_pass(self, record: PassRecord) -> None:
        """Fill ``record`` with what the next iteration hands out (one-shot; see :class:`PassRecord`)."""
        self._record = record

    def __len__(self) -> int:
        return self.plan.num_batches(self.plan.pending_start)

    def __iter__(self) -> Iterator[list[int]]:
        record, self._record = self._record, None
        yield from self.plan.next_pass(record)

    @classmethod
    def from_layout(cls, batch_sampler: Iterable[list[int]], layout: ShardLayout) -> BatchSamplerShard:
        """The shard of ``batch_sampler`` under a layout already built and validated
        (``prepare_data_loader``'s: its batch size and ``drop_last`` are the batch sampler's)."""
        check_batch_sampler(batch_sampler)
        shard = cls.__new__(cls)
        shard.batch_sampler, shard.plan, shard.epoch, shard._record = (
            batch_sampler,
            BatchSamplerPlan(batch_sampler, layout),
            0,
            None,
        )
        return shard


class IndexSamplerShard(Sampler[int]):
    """This process's indices of ``sampler`` for a loader without batches (``DataLoader(batch_size=None)``):
    the indices are shared out as batches of one, so every rule of :class:`BatchSamplerShard`
    holds (equal counts with ``even_batches``, padding from the epoch's start).

    Example::

        >>> from torch.utils.data import SequentialSampler
        >>> [list(IndexSamplerShard(SequentialSampler(range(5)), 2, i)) for i in range(2)]
        [[0, 2, 4], [1, 3, 0]]
    """

    def __init__(
        self,
        sampler: Iterable[int],
        num_processes: int = 1,
        process_index: int = 0,
        even_batches: bool = ShardplugConfig.even_batches,
    ) -> None:
        self.shard = BatchSamplerShard(
            BatchSampler(sampler, 1, False), num_processes, process_index, False, even_batches
        )

    @property
    def sampler(self) -> Any:
        return self.shard.sampler

    def set_epoch(self, epoch: int) -> None:
        self.shard.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[int]:
        for (index,) in self.shard:
            yield index

    @classmethod
    def from_layout(cls, sampler: Iterable[int], layout: ShardLayout) -> IndexSamplerShard:
        """The shard of ``sampler`` under the processes and ``even_batches`` of ``layout`` (built by
        ``prepare_data_loader``; the indices go out as batches of one, never split)."""
        shard = cls.__new__(cls)
        ones = dataclasses.replace(layout, batch_size=1, split_batches=False, drop_last=False)
        shard.shard = BatchSamplerShard.from_layout(BatchSampler(sampler, 1, False), ones)
        return shard
