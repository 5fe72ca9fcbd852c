"""This process's part of a stream that shards itself (``n_shards``, ``shard(num_shards, index)``).

``N`` processes and ``S`` shards, ``S = q*N + r``: process ``i`` reads ``q`` whole shards
(``i, i+N, ...``) by itself, and when ``r > 0`` its rows of the last ``r`` shards: every process
reads those, and keeps the elements at positions ``i, i+N, ...`` of each worker's part of them.
So processes hold nearly equal row counts (shards of equal size: at most one element apart per
worker) and each element is read by one process, except the last ``r/S`` of the stream, read by
all. A divisible stream (``r = 0``) is the plain case: ``dataset.shard(N, i)``.

DataLoader workers: a dataset that splits itself across workers (Hugging Face, webdataset,
``splits_by_worker = True``) does, within each part (Hugging Face parts are joined with
``datasets.concatenate_datasets``, which keeps that). Any other dataset is split by shardplug:
worker ``w`` of ``W`` reads shards ``w, w+W, ...`` of its process's shards.

Example (5 shards of 2 elements over 2 processes, the last shard's rows shared)::

    >>> class Shards(torch.utils.data.IterableDataset):
    ...     def __init__(self, shards):
    ...         self.shards = list(shards)
    ...     n_shards = property(lambda self: len(self.shards))
    ...     def shard(self, num_shards, index):
    ...         return Shards(self.shards[index::num_shards])
    ...     def __iter__(self):
    ...         return (10 * s + k for s in self.shards for k in range(2))
    >>> [list(process_part(Shards(range(5)), 2, i)) for i in range(2)]
    [[0, 1, 20, 21, 40], [10, 11, 30, 31, 41]]
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, cast

import torch  # noqa: F401  (the docstring example)
from torch.utils.data import IterableDataset, get_worker_info

from .collectives import all_reduce_int_async
from .layout import ShardLayout
from .plan import NativeStreamPlan, sized_length
from .streams import can_shard, hf_concatenate, is_hf_iterable, splits_by_worker

__all__ = ["can_shard", "process_part", "ProcessPart", "native_shard", "loader_length"]

logger = logging.getLogger(__name__)


def process_part(dataset: Any, num_processes: int, process_index: int) -> Any | None:
    """Process ``process_index``'s part of a stream that shards itself, or ``None`` when it has
    fewer shards than processes (then every process reads it), or shards that do not divide and
    that split themselves across workers without being a Hugging Face stream (their parts cannot
    be joined with the worker split kept)."""
    shards, n = dataset.n_shards, num_processes
    whole = shards // n
    if whole == 0:
        return None
    self_splitting = splits_by_worker(dataset)
    if shards % n == 0 and self_splitting:
        return dataset.shard(num_shards=n, index=process_index)  # the dataset splits its part across workers
    if not self_splitting or is_hf_iterable(dataset):
        own = [dataset.shard(num_shards=shards, index=k) for k in range(process_index, whole * n, n)]
        rest = [dataset.shard(num_shards=shards, index=k) for k in range(whole * n, shards)]
        return ProcessPart(own, rest, n, process_index, join=hf_concatenate if self_splitting else None)
    return None


class ProcessPart(IterableDataset[Any]):
    """Whole shards ``own``, then every ``num_processes``-th element (from ``process_index``) of
    the shards ``rest`` (see the module).  ``join`` makes one dataset of several (and keeps their
    own split across workers); without it shardplug splits the shards across workers."""

    def __init__(
        self, own: list[Any], rest: list[Any], num_processes: int, process_index: int, join: Any = None
    ) -> None:
        self.num_processes, self.process_index = num_processes, process_index
        self.splits_by_worker = join is not None
        self.own = [join(own)] if join is not None and own else own
        self.rest = [join(rest)] if join is not None and rest else rest

    def _parts(self) -> tuple[list[Any], list[Any]]:
        """The shards this DataLoader worker reads (all of them in the main process)."""
        info = get_worker_info()
        if info is None or self.splits_by_worker:
            return self.own, self.rest
        return self.own[info.id :: info.num_workers], self.rest[info.id :: info.num_workers]

    def __iter__(self) -> Iterator[Any]:
        own, rest = self._parts()
        for part in own:
            yield from part
        position = 0
        for part in rest:
            for element in part:
                if position % self.num_processes == self.process_index:
                    yield element
                position += 1

    def __len__(self) -> int:
        """Elements of this part in the main process (a ``TypeError`` when a shard has no length)."""
        lengths = [sized_length(part) for part in self.own + self.rest]
        if any(length is None for length in lengths):
            raise TypeError("a shard of this stream has no len()")
        sizes = cast("list[int]", lengths)  # none is None (checked above)
        rest = sum(sizes[len(self.own) :])
        mine = max(rest - self.process_index + self.num_processes - 1, 0) // self.num_processes
        return sum(sizes[: len(self.own)]) + mine

    def worker_lengths(self, num_workers: int) -> list[int] | None:
        """Elements each of ``num_workers`` DataLoader workers reads of this part, when every shard
        has a length and shardplug splits the shards across workers (``None`` otherwise)."""
        if self.splits_by_worker:
            return None  # each part splits itself: what a worker reads is the dataset's
        lengths = []
        for worker in range(num_workers):
            own = [sized_length(part) for part in self.own[worker::num_workers]]
            rest = [sized_length(part) for part in self.rest[worker::num_workers]]
            if any(length is None for length in own + rest):
                return None
            shared = sum(rest)  # type: ignore[arg-type]
            mine = max(shared - self.process_index + self.num_processes - 1, 0) // self.num_processes
            lengths.append(sum(own) + mine)  # type: ignore[arg-type]
        return lengths

    def set_epoch(self, epoch: int) -> None:
        for part in self.own + self.rest:
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)


def native_shard(
    dataset: Any, layout: ShardLayout, num_workers: int, drop_last: bool
) -> tuple[Any, NativeStreamPlan] | None:
    """This process's part of a stream that shards itself, and its plan, or ``None`` when every
    process must read the whole stream.  A part is read once in all (the rows of shards that do not
    divide among the processes by every process) instead of by every process; equal step counts come
    from the parts' batch counts when they are known without reading (every part has ``len()``, and
    shardplug knows what each DataLoader worker reads), else from an agreement between the processes
    (:class:`~shardplug.core.plan.NativeStreamPlan`)."""
    own = _own_part(dataset, layout)
    if own is None:
        return None
    batch_size = layout.process_batch_size
    counts: list[int | None] | None = None
    if _batches_of_part(own, batch_size, drop_last, num_workers) is not None:
        parts = (
            own if j == layout.process_index else process_part(dataset, layout.num_processes, j)
            for j in range(layout.num_processes)
        )
        counts = [_batches_of_part(part, batch_size, drop_last, num_workers) for part in parts]
    known = None if counts is None or any(count is None for count in counts) else cast("list[int]", counts)
    return own, NativeStreamPlan(layout, known, agree=all_reduce_int_async)


def _own_part(dataset: Any, layout: ShardLayout) -> Any | None:
    """:func:`process_part` for this process, saying why when the stream cannot be sharded natively."""
    if not can_shard(dataset):
        return None
    n_shards, n = dataset.n_shards, layout.num_processes
    own = process_part(dataset, n, layout.process_index)
    if own is None:
        why = (
            f"fewer than num_processes={n}"
            if n_shards < n
            else f"not a multiple of num_processes={n}, and its parts cannot be joined keeping its own split across "
            "DataLoader workers"
        )
        logger.warning(
            "the stream has n_shards=%s, %s: every process reads the whole stream (%dx the I/O of its part); give it "
            "a number of shards that %d divides to shard it natively",
            n_shards,
            why,
            n,
            n,
        )
    elif n_shards % n:
        logger.info(
            "the stream has n_shards=%d over %d processes: each process reads %d shards by itself, and its rows of the "
            "last %d (read by every process)",
            n_shards,
            n,
            n_shards // n,
            n_shards % n,
        )
    return own


def _batches_of_part(part: Any, batch_size: int | None, drop_last: bool, num_workers: int) -> int | None:
    """Batches a DataLoader with ``num_workers`` workers yields over a process's part, when known
    without reading: each worker makes its own last batch, so the parts of the workers are counted
    (known only where shardplug splits the shards across workers: a part that splits itself does not say)."""
    if num_workers == 0:
        return loader_length(part, batch_size, drop_last)
    lengths = part.worker_lengths(num_workers) if isinstance(part, ProcessPart) else None
    if lengths is None:
        return None
    return sum(_count_batches(n, batch_size, drop_last) for n in lengths)


def _count_batches(n: int, batch_size: int | None, drop_last: bool) -> int:
    if batch_size is None:
        return n
    return n // batch_size if drop_last else -(-n // batch_size)


def loader_length(dataset: Any, batch_size: int | None, drop_last: bool) -> int | None:
    """Batches a DataLoader over ``dataset`` yields, when the dataset is sized (``None`` otherwise)."""
    n = sized_length(dataset)
    if n is None:
        return None
    return _count_batches(n, batch_size, drop_last)
