"""Which global batches (or slices of them) one process receives: the index arithmetic.

Two ways to compute a process's share of an epoch, with identical results:

* :func:`walk_shard` walks any iterable of batches (the general path: user batch samplers,
  variable-size batches, samplers without ``__len__``).
* :class:`ArithmeticShard` computes the rows directly from an epoch order (a permutation or
  the identity) for a standard ``BatchSampler``: no Python pass over the other processes'
  batches, memory ``O(n / N)`` beyond the permutation, and any start position at the same cost.

Padding (``even_batches``) reads the epoch's order as a cycle: a short last batch is completed
with the first indices of the epoch, and further padding batches continue that cycle.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from shardplug.core.sharding.layout import ShardLayout

__all__ = ["ShardLayout", "walk_shard", "walk_shard_counted", "shard_length", "ArithmeticShard", "EpochOrder"]

_ROWS_PER_CHUNK = 4096
_FIRST_CHUNK = 4


def _check_len(batch: Sequence[int], batch_size: int | None) -> None:
    try:
        size = len(batch)
    except TypeError:
        raise TypeError(
            f"the batch sampler yielded {batch!r}, a single index rather than a batch of indices (it yields single "
            "indices); wrap it: BatchSampler(your_sampler, batch_size=..., drop_last=False)"
        ) from None
    if batch_size is not None and size > batch_size:
        raise ValueError(
            f"the batch sampler yielded a batch of {len(batch)} indices but declares batch_size={batch_size}; "
            "fix the batch sampler, or set its batch_size to None for variable-size batches"
        )


def _cycle_fill(head: list[int], count: int, offset: int) -> list[int]:
    """``count`` indices of the epoch's cyclic order, starting at ``offset`` into ``head``."""
    if not head:
        raise ValueError("cannot pad batches of an epoch that yielded no index")
    return [head[(offset + k) % len(head)] for k in range(count)]


def walk_shard(
    batches: Iterable[Sequence[int]], batch_size: int | None, layout: ShardLayout, skip: int = 0
) -> Iterator[list[int]]:
    """Yield this process's batches by walking the global batches in order.

    The first ``skip`` global batches are passed over (their indices only, for padding).  The
    caller's lists are never modified: padded batches are new lists.
    """
    for batch, _ in walk_shard_counted(batches, batch_size, layout, skip):
        yield batch


def walk_shard_counted(
    batches: Iterable[Sequence[int]],
    batch_size: int | None,
    layout: ShardLayout,
    skip: int = 0,
    head: EpochHead | None = None,
) -> Iterator[tuple[list[int], int]]:
    """Like :func:`walk_shard`, with the number of real (not padding) leading indices of each batch.

    ``head`` (optional) receives the epoch's first indices as they are walked.
    """
    n_proc = layout.num_processes
    iterator = iter(batches)
    if head is None:
        head = EpochHead.for_layout(batch_size, layout)
    for batch in itertools.islice(iterator, skip):
        _check_len(batch, batch_size)
        head.see(batch)
    if n_proc == 1:
        for batch in iterator:
            _check_len(batch, batch_size)
            yield batch, len(batch)  # type: ignore[misc]
    elif layout.split_batches:
        yield from _walk_split(iterator, batch_size, layout, head)
    else:
        yield from _walk_whole(iterator, batch_size, layout, head)


class EpochHead:
    """The first indices (and batches) of an epoch: what padding cycles through."""

    def __init__(self, need: int, num_batches: int) -> None:
        self.need, self.num_batches = need, num_batches
        self.indices: list[int] = []
        self.batches: list[Sequence[int]] = []

    @classmethod
    def for_layout(cls, batch_size: int | None, layout: ShardLayout) -> EpochHead:
        need = (batch_size or 0) * (1 if layout.split_batches else layout.num_processes)
        return cls(need, layout.num_processes)

    def first(self, count: int) -> list[int]:
        """Up to ``count`` first indices of the epoch."""
        indices = self.indices or [i for batch in self.batches for i in batch]
        return list(indices[:count])

    def see(self, batch: Sequence[int]) -> None:
        if len(self.indices) < self.need:
            self.indices.extend(batch[: self.need - len(self.indices)])
        if len(self.batches) < self.num_batches:
            self.batches.append(batch)


def _walk_whole(
    batches: Iterator[Sequence[int]], batch_size: int | None, layout: ShardLayout, head: EpochHead
) -> Iterator[tuple[list[int], int]]:
    n_proc, rank = layout.num_processes, layout.process_index
    group: list[Sequence[int]] = []
    for batch in batches:
        _check_len(batch, batch_size)
        head.see(batch)
        if len(group) == n_proc:  # held because its last batch was short, but more data came
            yield group[rank], len(group[rank])  # type: ignore[misc]
            group = []
        group.append(batch)
        if len(group) == n_proc and (batch_size is None or len(batch) == batch_size):
            yield group[rank], len(group[rank])  # type: ignore[misc]
            group = []
    if not group or layout.drop_last:
        return
    if not layout.even_batches:
        if rank < len(group):
            yield group[rank], len(group[rank])  # type: ignore[misc]
        return
    if rank < len(group) and (batch_size is None or rank < len(group) - 1 or len(group[rank]) == batch_size):
        yield group[rank], len(group[rank])  # type: ignore[misc]
        return
    if batch_size is None:  # variable-size batches: pad with whole batches from the epoch start
        source = head.batches
        yield list(source[(rank - len(group)) % len(source)]), 0
        return
    filled = len(group[-1])
    if rank == len(group) - 1:  # the short last batch, completed from the epoch's start
        yield list(group[-1]) + _cycle_fill(head.indices, batch_size - filled, 0), filled
        return
    offset = batch_size - filled + (rank - len(group)) * batch_size
    yield _cycle_fill(head.indices, batch_size, offset), 0


def _walk_split(
    batches: Iterator[Sequence[int]], batch_size: int | None, layout: ShardLayout, head: EpochHead
) -> Iterator[tuple[list[int], int]]:
    n_proc, rank = layout.num_processes, layout.process_index
    if batch_size is None:
        raise ValueError("split_batches=True needs a batch sampler with a batch_size; pass split_batches=False")
    step = batch_size // n_proc
    lo, hi = rank * step, (rank + 1) * step
    for batch in batches:
        _check_len(batch, batch_size)
        head.see(batch)
        if len(batch) == batch_size:
            yield list(batch[lo:hi]), step
            continue
        # A short batch: the end of the epoch (or a sampler that yields short batches).
        real = min(max(len(batch) - lo, 0), step)
        if layout.drop_last:
            continue
        if layout.even_batches:
            yield (list(batch) + _cycle_fill(head.indices, batch_size - len(batch), 0))[lo:hi], real
        elif lo < len(batch):
            yield list(batch[lo:hi]), real


def shard_length(num_batches: int, last_batch_size: int | None, batch_size: int | None, layout: ShardLayout) -> int:
    """Number of batches this process yields for ``num_batches`` global batches.

    ``last_batch_size`` is the size of the final global batch (``None`` or ``batch_size`` when full).
    """
    n_proc, rank = layout.num_processes, layout.process_index
    if num_batches <= 0:
        return 0
    if n_proc == 1:
        return num_batches
    last_full = batch_size is None or last_batch_size is None or last_batch_size >= batch_size
    if layout.split_batches:
        if layout.drop_last:
            return num_batches - (0 if last_full else 1)
        if layout.even_batches or last_full:
            return num_batches
        step = batch_size // n_proc  # type: ignore[operator]
        return num_batches - 1 + (1 if rank * step < last_batch_size else 0)  # type: ignore[operator]
    if layout.drop_last:
        groups = num_batches // n_proc
        if num_batches % n_proc == 0 and not last_full:
            groups -= 1
        return groups
    if layout.even_batches:
        return -(-num_batches // n_proc)
    return (num_batches - rank + n_proc - 1) // n_proc


class EpochOrder:
    """The order of one epoch's indices, as a lookup from positions to indices.

    ``EpochOrder(n)`` is ``0 .. n-1`` (never materialised); ``EpochOrder(n, perm)`` is a
    permutation; ``EpochOrder(n, bijection=f)`` a function of positions (e.g. a
    :class:`~shardplug.core.shuffle.seedable.KeyedPermutation`).  Positions past ``n`` wrap around (that
    is what padding reads).
    """

    def __init__(
        self,
        n: int,
        permutation: torch.Tensor | None = None,
        bijection: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.n = n
        self.permutation = permutation
        self.bijection = bijection

    def lookup(self, positions: torch.Tensor, wraps: bool = True) -> torch.Tensor:
        """The indices at ``positions`` (``wraps=False``: the caller knows they are all below ``n``)."""
        wrapped = positions % self.n if self.n and wraps else positions
        if self.bijection is not None:
            return self.bijection(wrapped)
        return wrapped if self.permutation is None else self.permutation[wrapped]


class ArithmeticShard:
    """One process's batches of a ``BatchSampler(order, batch_size, drop_last)`` by arithmetic.

    ``first_global`` global batches are taken as already consumed (a resume, possibly by a
    different number of processes): the rest of the epoch is shared out as a fresh epoch would
    be, and padding still reads the epoch's start.

    Example::

        >>> plan = ArithmeticShard(EpochOrder(10), 3, False, ShardLayout(3, 0))
        >>> list(plan.rows())
        [[0, 1, 2], [9, 0, 1]]
    """

    def __init__(
        self, order: EpochOrder, batch_size: int, inner_drop_last: bool, layout: ShardLayout, first_global: int = 0
    ) -> None:
        self.order = order
        self.batch_size = batch_size
        self.layout = layout
        n = order.n
        total = n // batch_size if inner_drop_last else -(-n // batch_size)
        self.last_batch_size = n - (total - 1) * batch_size if total else 0
        self.first_global = min(max(first_global, 0), total)
        self.num_global_batches = total - self.first_global

    def __len__(self) -> int:
        return shard_length(self.num_global_batches, self.last_batch_size, self.batch_size, self.layout)

    def _row_geometry(self) -> tuple[int, int, int]:
        """(stride between rows, offset of row 0, width of a row) in epoch positions."""
        n_proc, rank, b = self.layout.num_processes, self.layout.process_index, self.batch_size
        origin = self.first_global * b
        if self.layout.split_batches and n_proc > 1:
            step = b // n_proc
            return b, origin + rank * step, step
        return b * n_proc, origin + rank * b, b

    def rows(self, start: int = 0) -> Iterator[list[int]]:
        """Yield this process's batches, beginning with its ``start``-th batch."""
        for batches, _ in self.chunks(start):
            yield from batches

    def chunks(self, start: int = 0) -> Iterator[tuple[list[list[int]], Iterable[int]]]:
        """Batches in chunks of rows, with the real (not padding) count of each row."""
        total = shard_length(self.num_global_batches, self.last_batch_size, self.batch_size, self.layout)  # len(self)
        stride, offset, width = self._row_geometry()
        n = self.order.n
        # The only row that may end before its width: the final one without padding.
        last_end = offset + (total - 1) * stride + width if total else 0
        short_last = total > 0 and last_end > n and not self.layout.pads
        full_rows = total - 1 if short_last else total
        columns = torch.arange(width, dtype=torch.int64)
        first, size = max(start, 0), _FIRST_CHUNK  # small at first (the first batch costs O(batch)), then growing
        while first < full_rows:
            count = min(size, full_rows - first)
            size = min(2 * size, _ROWS_PER_CHUNK)
            bases = torch.arange(first, first + count, dtype=torch.int64) * stride + offset
            wraps = (first + count - 1) * stride + offset + width > n  # padding reads the epoch's start
            yield self.order.lookup(bases[:, None] + columns, wraps).tolist(), _RealCounts(n, bases, width)
            first += count
        if short_last and start < total:
            begin = offset + (total - 1) * stride
            yield [self.order.lookup(torch.arange(begin, n, dtype=torch.int64)).tolist()], [n - begin]


class _RealCounts:
    """Real (not padding) counts of a chunk of rows, computed only when asked for."""

    def __init__(self, n: int, bases: torch.Tensor, width: int) -> None:
        self.n, self.bases, self.width = n, bases, width

    def __iter__(self) -> Iterator[int]:
        return iter((self.n - self.bases).clamp(0, self.width).tolist())
