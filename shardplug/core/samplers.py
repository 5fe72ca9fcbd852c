"""Samplers: a seedable shuffle and the per-process shard of a batch sampler."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterable, Iterator, Optional, Sized, Union

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from .batch_plan import ArithmeticShard, EpochHead, EpochOrder, ShardLayout, shard_length, walk_shard_counted
from .topology import _check_processes

__all__ = ["SeedableRandomSampler", "BatchSamplerShard", "draw_seed"]

logger = logging.getLogger(__name__)


def draw_seed() -> int:
    """A fresh seed from the global torch RNG (what ``RandomSampler`` draws when it has no generator)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order in epoch ``e`` is a pure function of ``seed + e``.

    Every process that uses the same seed draws the same order, every epoch and every rerun.
    With ``data_seed=None`` the seed is drawn from the global torch RNG at the first iteration;
    a prepared loader agrees it from process 0 first, so all processes share it.

    Example::

        >>> s = SeedableRandomSampler(range(5), data_seed=7)
        >>> s.set_epoch(1)
        >>> sorted(s) == [0, 1, 2, 3, 4]
        True
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        data_seed: Optional[int] = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=None)
        if data_seed is None and generator is not None:
            data_seed = generator.initial_seed()
        self.seed: Optional[int] = data_seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resolve_seed(self) -> int:
        if self.seed is None:
            self.seed = draw_seed()
        return self.seed

    def _epoch_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.resolve_seed() + self.epoch)

    def index_order(self) -> Optional[torch.Tensor]:
        """This epoch's permutation, when the sampler draws exactly one (no replacement, all samples)."""
        if self.replacement or self.num_samples != len(self.data_source):
            return None
        return torch.randperm(len(self.data_source), generator=self._epoch_generator())

    def __iter__(self) -> Iterator[int]:
        order = self.index_order()
        if order is not None:
            yield from order.tolist()
            return
        generator, n = self._epoch_generator(), len(self.data_source)
        if self.replacement:
            yield from torch.randint(high=n, size=(self.num_samples,), dtype=torch.int64, generator=generator).tolist()
            return
        for _ in range(self.num_samples // n):
            yield from torch.randperm(n, generator=generator).tolist()
        yield from torch.randperm(n, generator=generator).tolist()[: self.num_samples % n]


def _epoch_order(sampler: Any) -> tuple[Optional[EpochOrder], Optional[torch.Generator]]:
    """The epoch order of a standard sampler, drawn exactly as iterating it would draw it.

    Returns ``(order, generator_to_advance_at_end)`` or ``(None, None)`` for other samplers.
    ``RandomSampler`` draws a second permutation when it is exhausted; the returned generator
    must draw it too, so that later epochs stay identical to the plain ``RandomSampler``'s.
    """
    if type(sampler) is SequentialSampler:
        return EpochOrder(len(sampler.data_source)), None
    if isinstance(sampler, SeedableRandomSampler):
        perm = sampler.index_order()
        return (EpochOrder(perm.numel(), perm), None) if perm is not None else (None, None)
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n or n == 0:
            return None, None
        generator = sampler.generator
        if generator is None:
            generator = torch.Generator().manual_seed(draw_seed())
        return EpochOrder(n, torch.randperm(n, generator=generator)), generator
    return None, None


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
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        _check_processes(num_processes, process_index)
        batch_size = getattr(batch_sampler, "batch_size", None)
        if split_batches and num_processes > 1:
            if batch_size is None:
                raise ValueError(
                    "split_batches=True needs a batch size, but the batch sampler has batch_size=None; "
                    "give it a batch_size that is a multiple of num_processes, or pass split_batches=False"
                )
            if batch_size % num_processes != 0:
                raise ValueError(
                    f"split_batches=True needs a batch size that is a multiple of num_processes, got "
                    f"batch_size={batch_size} and num_processes={num_processes}; use a batch size of "
                    f"{(batch_size // num_processes + 1) * num_processes} or pass split_batches=False"
                )
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size: Optional[int] = batch_size
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        self.epoch = 0
        self._first_global = 0
        self.started_at = 0  # global batches the current (or last) iteration skipped at its start
        self._head: Union[EpochOrder, EpochHead, None] = None
        # When set (by a loader that tracks padding or audits), each yielded batch is appended
        # with its number of real, not padding, leading indices.
        self.log: Optional[deque[tuple[list[int], int]]] = None

    @property
    def layout(self) -> ShardLayout:
        return ShardLayout(self.num_processes, self.process_index, self.split_batches, self.even_batches, self.drop_last)

    @property
    def sampler(self) -> Any:
        """The index sampler under the wrapped batch sampler (frameworks call ``set_epoch`` on it)."""
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def per_process_batch_size(self) -> Optional[int]:
        if self.batch_size is None:
            return None
        return self.batch_size // self.num_processes if self.split_batches else self.batch_size

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler, else to its sampler."""
        self.epoch = int(epoch)
        target = self.batch_sampler if hasattr(self.batch_sampler, "set_epoch") else self.sampler
        if target is not None and hasattr(target, "set_epoch"):
            target.set_epoch(epoch)

    @property
    def batches_per_step(self) -> int:
        """Global batches consumed each time every process takes one batch."""
        return 1 if self.split_batches or self.num_processes == 1 else self.num_processes

    def skip_next(self, num_batches: int) -> None:
        """Make the next iteration start after this process's first ``num_batches`` batches (one-shot)."""
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self.start_at_global(num_batches * self.batches_per_step)

    def start_at_global(self, global_batches: int) -> None:
        """Make the next iteration share out only the global batches after the first ``global_batches``
        (one-shot).  The count may come from a run with another number of processes: the rest of
        the epoch is then split among this run's processes."""
        if global_batches < 0:
            raise ValueError(f"global_batches={global_batches} must be >= 0")
        self._first_global = int(global_batches)

    def first_indices(self, count: int) -> list[int]:
        """Up to ``count`` first indices of the current epoch's order (once its iteration started)."""
        head = self._head
        if isinstance(head, EpochOrder):
            return head.lookup(torch.arange(min(count, head.n), dtype=torch.int64)).tolist()
        return head.first(count) if head is not None else []

    def _uses_arithmetic(self) -> bool:
        return type(self.batch_sampler) is BatchSampler and (
            type(self.sampler) in (SequentialSampler, RandomSampler) or isinstance(self.sampler, SeedableRandomSampler)
        )

    def _global_length(self) -> tuple[int, Optional[int]]:
        """(number of global batches, size of the last one or None when unknown / full)."""
        num = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.batch_size is None or self.drop_last or num == 0:
            return num, None
        sampler = self.sampler
        if sampler is None or not hasattr(sampler, "__len__"):
            return num, None
        return num, len(sampler) - (num - 1) * self.batch_size

    def full_length(self) -> int:
        """Batches per epoch for this process, ignoring a pending skip."""
        num, last = self._global_length()
        return shard_length(num, last, self.batch_size, self.layout)

    def __len__(self) -> int:
        if not self._first_global:
            return self.full_length()
        num, last = self._global_length()
        return shard_length(num - self._first_global, last, self.batch_size, self.layout)

    def __iter__(self) -> Iterator[list[int]]:
        first, self._first_global = self._first_global, 0
        self.started_at = first
        log = self.log
        if self._uses_arithmetic():
            order, generator = _epoch_order(self.sampler)
            if order is not None:
                self._head = order
                plan = ArithmeticShard(order, self.batch_size, self.drop_last, self.layout, first)  # type: ignore[arg-type]
                if log is None:
                    yield from plan.rows()
                else:
                    for batch, real in plan.rows_counted():
                        log.append((batch, real))
                        yield batch
                if generator is not None:  # keep the user's generator in step with RandomSampler
                    torch.randperm(order.n, generator=generator)
                return
        # Skipped global batches are iterated as indices only: nothing is loaded for them.
        self._head = head = EpochHead.for_layout(self.batch_size, self.layout)
        for batch, real in walk_shard_counted(self.batch_sampler, self.batch_size, self.layout, first, head):
            if log is not None:
                log.append((batch, real))
            yield batch
