"""Map-style data: one process's batches of a batch sampler's global batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from ..layout import ShardLayout
from ..shuffle import BijectiveRandomSampler, SeedableRandomSampler, advance_past_randperm, draw_seed
from .arithmetic import ArithmeticShard, EpochHead, EpochOrder, shard_length, walk_shard_counted
from .protocol import PassRecord, PlanDefaults, check_consumed, global_batch_samples

__all__ = ["BatchSamplerPlan"]


class BatchSamplerPlan(PlanDefaults):
    """One process's batches of a batch sampler's global batches (map-style data).

    Standard ``BatchSampler`` over ``SequentialSampler`` / ``RandomSampler`` /
    ``SeedableRandomSampler`` are computed by arithmetic (any start at the same cost); any other
    batch sampler is walked, by indices only.
    """

    unit = "global_batches"
    stream = False
    exact_length = True
    first_holds_most = True  # leftovers go to the first processes
    untracked_reason = None

    def __init__(self, batch_sampler: Iterable[Sequence[int]], layout: ShardLayout) -> None:
        self.batch_sampler = batch_sampler
        self.layout = layout
        self.pending_start = 0
        """Global batches the next pass starts after (see :meth:`start_after`)."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = check_consumed(consumed)
        return 0

    def next_pass(self, record: PassRecord | None = None) -> Iterator[list[int]]:
        """:meth:`index_batches` after the pending start, which it takes (one-shot)."""
        first, self.pending_start = self.pending_start, 0
        return self.index_batches(first, record)

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        """The next batch logged where the batch sampler drew it (those a ``StatefulDataLoader``
        fast-forwarded past were logged too: they are dropped first)."""
        log = record.batches
        while record.fast_forwarded:
            log.popleft()  # type: ignore[union-attr]
            record.fast_forwarded -= 1
        return log.popleft()  # type: ignore[union-attr]

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def _global_length(self) -> tuple[int, int | None]:
        """(number of global batches, size of the last one or None when unknown / full)."""
        num = len(self.batch_sampler)  # type: ignore[arg-type]
        size = self.layout.batch_size
        if size is None or self.layout.drop_last or num == 0:
            return num, None
        sampler = self.sampler
        if sampler is None or not hasattr(sampler, "__len__"):
            return num, None
        return num, len(sampler) - (num - 1) * size

    def epoch_size(self) -> int | None:
        try:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        except TypeError:
            return None

    def num_batches(self, consumed: int = 0) -> int:
        """Batches after ``consumed`` global batches (a ``TypeError`` for a batch sampler without ``len``)."""
        num, last = self._global_length()
        return shard_length(num - check_consumed(consumed), last, self.layout.batch_size, self.layout)

    def samples_before(self, consumed: int) -> int | None:
        return global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> bool | None:
        # Process 0 has the most batches (leftovers go to the first processes).
        try:
            num, last = self._global_length()
        except TypeError:
            return None
        first = dataclasses.replace(self.layout, process_index=0)
        return shard_length(num - consumed, last, self.layout.batch_size, first) == 0

    def _arithmetic(self) -> bool:
        sampler = self.sampler
        return type(self.batch_sampler) is BatchSampler and (
            type(sampler) in (SequentialSampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler)
        )

    def batches(self, consumed: int = 0, record: PassRecord | None = None) -> Iterator[tuple[list[int], int]]:
        """This process's batches after ``consumed`` global batches, with their real counts.

        Draws the epoch's order as iterating the batch sampler would (one pass of its sampler).
        """
        record = record if record is not None else PassRecord(track=True)
        for batch in self.index_batches(consumed, record):
            yield batch, record.batches.popleft()[1]  # type: ignore[union-attr]

    def index_batches(self, consumed: int = 0, record: PassRecord | None = None) -> Iterator[list[int]]:
        """This process's batches after ``consumed`` global batches (what a batch sampler yields);
        ``record`` receives the pass's start, the epoch's order and, when tracking, each batch
        with its real count."""
        record = record if record is not None else PassRecord()
        record.started_at = consumed = check_consumed(consumed)
        log = record.batches
        if self._arithmetic():
            order, generator = epoch_order(self.sampler)
            if order is not None:
                if generator is not None:
                    # RandomSampler draws a second permutation when it is exhausted: draw it now,
                    # so the generator is at the next epoch's state as soon as this pass began
                    # (a position saved at the end of the pass then records that state).
                    advance_past_randperm(generator, order.n)
                record.head = order
                shard = ArithmeticShard(order, self.layout.batch_size, self.layout.drop_last, self.layout, consumed)  # type: ignore[arg-type]
                for chunk, reals in shard.chunks():
                    if log is not None:
                        log.extend(zip(chunk, reals))
                    yield from chunk
                return
        # Skipped global batches are iterated as indices only: nothing is loaded for them.
        record.head = head = EpochHead.for_layout(self.layout.batch_size, self.layout)
        for batch, real in walk_shard_counted(self.batch_sampler, self.layout.batch_size, self.layout, consumed, head):
            if log is not None:
                log.append((batch, real))
            yield batch


def epoch_order(sampler: Any) -> tuple[EpochOrder | None, torch.Generator | None]:
    """The epoch order of a standard sampler, drawn exactly as iterating it would draw it.

    Returns ``(order, generator_to_advance)`` or ``(None, None)`` for other samplers.
    ``RandomSampler`` draws a second permutation when it is exhausted; the returned generator
    (the sampler's own ``generator``) must draw it too, so that later epochs stay identical to the
    plain ``RandomSampler``'s.  Without a ``generator`` there is none to advance (``None``).
    """
    if type(sampler) is SequentialSampler:
        return EpochOrder(len(sampler.data_source)), None
    if isinstance(sampler, BijectiveRandomSampler):
        return EpochOrder(len(sampler.data_source), bijection=sampler.permutation()), None
    if isinstance(sampler, SeedableRandomSampler):
        perm = sampler.index_order()
        return (EpochOrder(perm.numel(), perm), None) if perm is not None else (None, None)
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n or n == 0:
            return None, None
        if sampler.generator is None:
            # RandomSampler seeds a generator of its own from the global RNG and throws it away after
            # the pass: its second permutation changes nothing anyone sees, so it is never drawn
            own = torch.Generator().manual_seed(draw_seed())
            return EpochOrder(n, torch.randperm(n, generator=own)), None
        return EpochOrder(n, torch.randperm(n, generator=sampler.generator)), sampler.generator
    return None, None
