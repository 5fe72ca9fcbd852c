"""The one batch counter: how many batches a DataLoader makes of ``n`` samples, known without reading them.

Every kind of sharding counts its ``len()`` here (a stream read as it is, its natively sharded parts,
its parts already split by node), so that one rule decides a short last batch.

Example::

    >>> batches(5, batch_size=2, drop_last=False), batches(5, batch_size=2, drop_last=True), batches(5, None, False)
    (3, 2, 5)
    >>> worker_batches([3, 2], batch_size=2, drop_last=False)  # each DataLoader worker makes its own last batch
    3
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shardplug.core.sharding.shard_plan import sized_length

__all__ = ["batches", "loader_length", "worker_batches"]


def batches(n: int, batch_size: int | None, drop_last: bool) -> int:
    """Batches of ``batch_size`` a DataLoader makes of ``n`` samples (``None``: no batching, one per sample)."""
    if batch_size is None:
        return n
    return n // batch_size if drop_last else -(-n // batch_size)


def loader_length(dataset: Any, batch_size: int | None, drop_last: bool) -> int | None:
    """Batches a DataLoader over ``dataset`` yields, when the dataset is sized (``None`` otherwise)."""
    n = sized_length(dataset)
    return None if n is None else batches(n, batch_size, drop_last)


def worker_batches(lengths: Iterable[int], batch_size: int | None, drop_last: bool) -> int:
    """Batches a DataLoader yields whose workers read ``lengths`` samples each (each makes its own last batch)."""
    return sum(batches(n, batch_size, drop_last) for n in lengths)
