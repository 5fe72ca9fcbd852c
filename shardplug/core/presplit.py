"""A stream already split by node (process): what this process reads is its part, read as it is.

Such a stream reads only this process's part by itself: litdata's and MosaicML ``streaming``'s
``StreamingDataset`` (once they see several processes), a Hugging Face stream after
``split_dataset_by_node``, a webdataset pipeline with ``nodesplitter=split_by_node``, or a stream
of your own that declares ``split_by_node = True`` (see :func:`shardplug.core.streams.node_split`).
shardplug does not split it again: it wraps it in a :class:`NodePart`, which only splits it across
DataLoader workers where the stream does not do that itself, and hands the loader's epoch to it.
Equal step counts come from the parts' batch counts when every process knows its own (its part
has ``len()`` and shardplug knows what each DataLoader worker reads: the processes exchange them
once, when the loader is prepared), else from the agreement of
:class:`~shardplug.core.plan.NativeStreamPlan` on when the first part runs out.

Example (a stream of your own that reads rank ``r`` of ``w``; every worker would read all of it,
so shardplug splits it across workers)::

    >>> class MyPart(torch.utils.data.IterableDataset):
    ...     split_by_node = True
    ...     splits_by_worker = False
    ...     def __init__(self, rank, world_size):
    ...         self.rank, self.world_size = rank, world_size
    ...     def __iter__(self):
    ...         return iter(range(self.rank, 10, self.world_size))
    >>> list(NodePart(MyPart(1, 2), split_workers=True))
    [1, 3, 5, 7, 9]
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch  # noqa: F401  (the docstring example)
from torch.utils.data import IterableDataset, get_worker_info

from .collectives import all_gather_objects, all_reduce_int_async, world_size
from .layout import ShardLayout
from .native import loader_length
from .plan import NativeStreamPlan, sized_length
from .streams import NodeSplit, splits_by_worker, stream_library

__all__ = ["NodePart", "node_part", "check_node_split"]

logger = logging.getLogger(__name__)


class NodePart(IterableDataset[Any]):
    """This process's part of a stream already split by node: ``dataset`` as it is, split across
    DataLoader workers when ``split_workers`` (worker ``w`` of ``W`` keeps elements ``w, w+W, ...``;
    a stream that splits itself across workers is read whole in each worker)."""

    def __init__(self, dataset: Any, split_workers: bool) -> None:
        self.dataset = dataset
        self.split_workers = split_workers
        self.splits_by_worker = not split_workers

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None or not self.split_workers:
            return iter(self.dataset)
        return itertools.islice(iter(self.dataset), info.id, None, info.num_workers)

    def __len__(self) -> int:
        """Elements of this part (a ``TypeError`` when the stream has no length)."""
        n = sized_length(self.dataset)
        if n is None:
            raise TypeError(f"{type(self.dataset).__name__} has no len()")
        return n

    def worker_lengths(self, num_workers: int) -> list[int] | None:
        """Elements each of ``num_workers`` DataLoader workers reads, where shardplug splits the part
        and its length is known (``None`` otherwise: a stream that splits itself does not say)."""
        n = sized_length(self.dataset)
        if n is None or not self.split_workers:
            return None
        return [len(range(worker, n, num_workers)) for worker in range(num_workers)]

    def set_epoch(self, epoch: int) -> None:
        """Hand the loader's epoch to the stream: its ``set_epoch``, or streaming's ``next_epoch``
        (the epoch its next pass reads; it would otherwise count its passes itself)."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        elif stream_library(self.dataset) == "streaming":
            self.dataset.next_epoch = epoch


def check_node_split(split: NodeSplit, layout: ShardLayout) -> None:
    """Refuse a stream split for another process than this loader's (where the stream says which)."""
    if split.world_size is None or (split.rank, split.world_size) == (layout.process_index, layout.num_processes):
        return
    raise ValueError(
        f"this stream is already split by node ({split.how}), but this loader is process {layout.process_index} of "
        f"num_processes={layout.num_processes}, so the processes' parts would not make up the stream: build the "
        f"stream for rank {layout.process_index} of {layout.num_processes} (after torch.distributed is initialized), "
        f"or prepare it with num_processes={split.world_size}, process_index={split.rank}"
    )


def node_part(
    dataset: Any, split: NodeSplit, layout: ShardLayout, num_workers: int, drop_last: bool
) -> tuple[NodePart, NativeStreamPlan]:
    """This process's part of a stream already split by node, and its plan (a collective when
    several processes run: they exchange their parts' batch counts, ``None`` where unknown)."""
    check_node_split(split, layout)
    part = NodePart(dataset, split_workers=num_workers > 0 and not splits_by_worker(dataset))
    own = _batches(part, layout.process_batch_size, drop_last, num_workers)
    counts: list[int | None] = all_gather_objects(own) if world_size() == layout.num_processes > 1 else [own]
    found = [c for c in counts if c is not None]
    known = found if len(found) == layout.num_processes else None
    logger.info(
        "the stream is already split by node (%s): process %d reads its part as it is (%s batches; step counts %s)",
        split.how,
        layout.process_index,
        "unknown" if own is None else own,
        "from the parts' lengths" if known is not None else "agreed while reading",
    )
    return part, NativeStreamPlan(layout, known, agree=all_reduce_int_async)


def _batches(part: NodePart, batch_size: int | None, drop_last: bool, num_workers: int) -> int | None:
    """Batches a DataLoader with ``num_workers`` workers yields over ``part``, when known without
    reading it (each worker makes its own last batch, so the workers' parts are counted)."""
    if num_workers == 0:
        return loader_length(part.dataset, batch_size, drop_last)
    lengths = part.worker_lengths(num_workers)
    if lengths is None:
        return None
    return sum(loader_length(range(n), batch_size, drop_last) or 0 for n in lengths)
