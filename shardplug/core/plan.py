"""Which rows one process gets in one epoch, how many batches that is, and where a pass resumes.

One plan per kind of sharding, all answering the same small protocol (:class:`ShardPlan`):

* :class:`BatchSamplerPlan`: map-style data; the global batches of a batch sampler, shared out
  by index arithmetic (standard samplers) or by walking the batches (any other batch sampler).
* :class:`StreamPlan`: a stream every process reads whole, keeping its part of each global batch.
* :class:`NativeStreamPlan`: a stream that sharded itself (each process reads only its shards);
  equal step counts from the parts' lengths, or from an agreement on when the first runs out.
* :class:`LocalPlan`: the loader's own batches are this process's part (data nobody else reads).
* :class:`DispatchPlan`: process 0 reads, every process receives its rows of each step.

A position counts what the whole job consumed of the epoch in the plan's ``unit`` (global
batches, stream elements, or this loader's batches); ``num_batches(consumed)`` is the number of
batches this process yields after it, with this plan's number of processes: so a position saved
with N processes continues with M.

Example::

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> plan = BatchSamplerPlan(BatchSampler(SequentialSampler(range(21)), 3, False), ShardLayout(2, 1, batch_size=3))
    >>> plan.num_batches(), plan.num_batches(consumed=4)
    (4, 2)
    >>> [batch for batch, real in plan.batches(consumed=4)]
    [[15, 16, 17], [0, 1, 2]]
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from .batch_plan import ArithmeticShard, EpochHead, EpochOrder, shard_length, walk_shard_counted
from .layout import ShardLayout
from .shuffle import SeedableRandomSampler, advance_past_randperm, epoch_order

__all__ = [
    "ShardPlan", "PassRecord", "BatchSamplerPlan", "StreamPlan", "LocalPlan", "NativeStreamPlan", "DispatchPlan", "UNITS",
    "sized_length", "PaddingTag", "TaggedBatch", "TagCollate",
]

UNITS = ("global_batches", "elements", "batches")

logger = logging.getLogger(__name__)


def sized_length(obj: Any) -> Optional[int]:
    """``len(obj)``, or ``None`` for an object without one (also when ``__len__`` raises
    ``TypeError`` / ``NotImplementedError``, as unsized ``DataLoader`` and stream wrappers do)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


@runtime_checkable
class ShardPlan(Protocol):
    """What every plan answers, for one process and one epoch."""

    layout: ShardLayout
    unit: str
    """What a position counts: ``"global_batches"``, ``"elements"`` or ``"batches"``."""

    @property
    def consumed_per_batch(self) -> int:
        """How much of the epoch, in ``unit``, the whole job consumes per batch of this process."""

    def epoch_size(self) -> Optional[int]:
        """The epoch's size in ``unit`` (``None`` when unknown before the end, e.g. a stream)."""

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        """Batches this process yields after ``consumed`` (``None`` when unknown without reading)."""

    def finished(self, consumed: int) -> Optional[bool]:
        """Whether no process has a batch left after ``consumed`` (``None`` when unknown)."""

    def samples_before(self, consumed: int) -> Optional[int]:
        """Samples of the epoch the whole job consumed before a pass that starts after ``consumed``
        (``None`` when unknown): where the pass's global batches start, so also what its last one holds."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        """Make the next pass begin after ``consumed`` (one-shot).  Returns how many of the
        loader's batches the loader itself must read and drop (0 when the plan skips them)."""

    untracked_reason: Optional[str]
    """Why batches cannot be told apart from padding (``None``: :meth:`batch_record` works)."""

    reads_ahead: bool
    """The plan reads batches ahead of those handed out (an agreement on when a process runs out): the
    DataLoader's own count and a StatefulDataLoader's state are not the pass's."""

    needs_tags: bool
    """The batches' places cannot be computed: padding tracking tags each element where it is read."""

    def batch_record(self, record: "PassRecord", batch: int) -> tuple[list[int], int]:
        """(indices or stream positions, real count) of the pass's ``batch``-th batch."""

    def pass_batches(self, batches: Iterator[Any], record: "PassRecord") -> Iterator[Any]:
        """The loader's batches of a pass as this plan hands them out (most plans: unchanged)."""


class _Unchanged:
    """``pass_batches`` of the plans whose batches come out of the DataLoader as they are handed out."""

    identifies_samples = True
    """Batch records name each sample (dataset indices or stream positions), so an audit can count them."""
    reads_ahead = False
    needs_tags = False

    def pass_batches(self, batches: Iterator[Any], record: "PassRecord") -> Iterator[Any]:
        return batches


class PassRecord:
    """What one pass over a plan handed out: where it started, the epoch's order (padding reads
    its start) and, when ``track`` is set, each batch's indices and number of real samples.

    One record per pass: a pass left early leaves its record behind, never in the next pass.
    """

    __slots__ = ("started_at", "head", "batches")

    def __init__(self, track: bool = False) -> None:
        self.started_at = 0
        self.head: Union[EpochOrder, EpochHead, None] = None
        self.batches: Optional[deque[tuple[list[int], int]]] = deque() if track else None

    def first_indices(self, count: int) -> list[int]:
        """Up to ``count`` first indices of the epoch's order (once the pass has started)."""
        head = self.head
        if isinstance(head, EpochOrder):
            return head.lookup(torch.arange(min(count, head.n), dtype=torch.int64)).tolist()
        return head.first(count) if head is not None else []


def _global_batch_samples(layout: ShardLayout, consumed: int) -> Optional[int]:
    """Samples in ``consumed`` global batches (every global batch before a pass's start is full)."""
    return None if layout.batch_size is None else _check_consumed(consumed) * layout.batch_size


def _check_consumed(consumed: int) -> int:
    if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
        raise ValueError(f"consumed={consumed!r} must be an integer >= 0")
    return consumed


class BatchSamplerPlan(_Unchanged):
    """One process's batches of a batch sampler's global batches (map-style data).

    Standard ``BatchSampler`` over ``SequentialSampler`` / ``RandomSampler`` /
    ``SeedableRandomSampler`` are computed by arithmetic (any start at the same cost); any other
    batch sampler is walked, by indices only.
    """

    unit = "global_batches"
    untracked_reason = None

    def __init__(self, batch_sampler: Iterable[Sequence[int]], layout: ShardLayout) -> None:
        self.batch_sampler = batch_sampler
        self.layout = layout
        self.pending_start = 0
        """Global batches the next pass starts after (see :meth:`start_after`)."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = _check_consumed(consumed)
        return 0

    def next_pass(self, record: Optional[PassRecord] = None) -> Iterator[list[int]]:
        """:meth:`index_batches` after the pending start, which it takes (one-shot)."""
        first, self.pending_start = self.pending_start, 0
        return self.index_batches(first, record)

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        return record.batches.popleft()  # type: ignore[union-attr]

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def _global_length(self) -> tuple[int, Optional[int]]:
        """(number of global batches, size of the last one or None when unknown / full)."""
        num = len(self.batch_sampler)  # type: ignore[arg-type]
        size = self.layout.batch_size
        if size is None or self.layout.drop_last or num == 0:
            return num, None
        sampler = self.sampler
        if sampler is None or not hasattr(sampler, "__len__"):
            return num, None
        return num, len(sampler) - (num - 1) * size

    def epoch_size(self) -> Optional[int]:
        try:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        except TypeError:
            return None

    def num_batches(self, consumed: int = 0) -> int:
        """Batches after ``consumed`` global batches (a ``TypeError`` for a batch sampler without ``len``)."""
        num, last = self._global_length()
        return shard_length(num - _check_consumed(consumed), last, self.layout.batch_size, self.layout)

    def samples_before(self, consumed: int) -> Optional[int]:
        return _global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> Optional[bool]:
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

    def batches(self, consumed: int = 0, record: Optional[PassRecord] = None) -> Iterator[tuple[list[int], int]]:
        """This process's batches after ``consumed`` global batches, with their real counts.

        Draws the epoch's order as iterating the batch sampler would (one pass of its sampler).
        """
        record = record if record is not None else PassRecord(track=True)
        for batch in self.index_batches(consumed, record):
            yield batch, record.batches.popleft()[1]  # type: ignore[union-attr]

    def index_batches(self, consumed: int = 0, record: Optional[PassRecord] = None) -> Iterator[list[int]]:
        """This process's batches after ``consumed`` global batches (what a batch sampler yields);
        ``record`` receives the pass's start, the epoch's order and, when tracking, each batch
        with its real count."""
        record = record if record is not None else PassRecord()
        record.started_at = consumed = _check_consumed(consumed)
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


class StreamPlan(_Unchanged):
    """A stream every process reads whole, keeping its part of each global batch.

    A global batch is ``step_batch_size`` consecutive elements; process ``i`` keeps the slice
    ``[i*w, (i+1)*w)`` of it (``w`` = ``process_batch_size``).  A short final global batch is
    dropped (``drop_last``), completed with the epoch's first elements, cycled (``even_batches``),
    or left short (``even_batches=False``: the leftovers go to the first processes).  Inside
    DataLoader workers, worker ``w`` of ``W`` keeps global batches ``w, w+W, ...``.

    Example::

        >>> plan = StreamPlan(ShardLayout(2, 1, batch_size=2), length=11)
        >>> list(plan.elements(iter(range(11)))), plan.num_batches()
        ([2, 3, 6, 7, 10, 0], 3)
    """

    unit = "elements"

    def __init__(self, layout: ShardLayout, length: Optional[int] = None) -> None:
        if layout.batch_size is None:
            raise ValueError("a stream shard needs a batch size (elements per process batch); pass batch_size >= 1")
        self.layout = layout
        self.length = length
        self.pending_start: tuple[int, Any] = (0, None)
        """(elements, dataset state) the next pass starts after (see :meth:`start_after`)."""
        self.untracked_reason: Optional[str] = None
        self.needs_tags = length is None
        """Without the stream's length (no ``len()``, or a stream that splits itself across workers, each
        worker padding its own part) the batches' places cannot be computed: tracking tags the elements."""
        self.observed: Optional[int] = None
        """Elements of the stream, counted when a pass read it to its end in this process (no DataLoader
        workers; reset when a pass begins): where ``length`` is unknown, the end of the epoch is then known."""
        self.tags = False
        """Each element leaves the reader as a :class:`PaddingTag` (set by ``track_padding`` where
        :attr:`needs_tags`); :meth:`pass_batches` takes the tags off the collated batches."""
        self.identifies_samples = length is not None  # tagged positions are the reader's, not sample ids

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        """The next pass starts after ``consumed`` elements: by loading ``dataset_state`` into the
        dataset when given (a dataset that repositions itself), else by reading past them."""
        self.pending_start = (_check_consumed(consumed), dataset_state)
        return 0

    def take_start(self) -> tuple[int, Any]:
        start, self.pending_start = self.pending_start, (0, None)
        return start

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.step_batch_size  # type: ignore[return-value]

    @property
    def width(self) -> int:
        return self.layout.process_batch_size  # type: ignore[return-value]

    def epoch_size(self) -> Optional[int]:
        return self.length

    def _own_count(self, leftover: int) -> int:
        """Elements of this process's slice within a global batch of ``leftover`` elements."""
        width = self.width
        return min(max(leftover - self.layout.process_index * width, 0), width)

    def num_elements(self, consumed: int = 0) -> Optional[int]:
        """Elements this process yields after ``consumed`` elements of the stream."""
        if self.length is None:
            return None
        rest = max(self.length - _check_consumed(consumed), 0)
        full, leftover = divmod(rest, self.consumed_per_batch)
        count = full * self.width
        if leftover and not self.layout.drop_last:
            count += self.width if self.layout.even_batches else self._own_count(leftover)
        return count

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        elements = self.num_elements(consumed)
        return None if elements is None else -(-elements // self.width)

    def samples_before(self, consumed: int) -> Optional[int]:
        return _check_consumed(consumed)

    def finished(self, consumed: int) -> Optional[bool]:
        # Process 0 has the most elements (leftovers go to the first processes).
        length = self.length if self.length is not None else self.observed
        first = StreamPlan(dataclasses.replace(self.layout, process_index=0), length)
        elements = first.num_elements(consumed)
        return None if elements is None else elements == 0

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The loader's batches, their padding tags (when :attr:`tags`) taken off into ``record``."""
        return _untagged(batches, record) if self.tags else batches

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        """(stream positions, real count) of this process's ``batch``-th batch of the pass
        (tagged: positions in the part of the stream its reader read)."""
        if self.tags:
            return record.batches.popleft()  # type: ignore[union-attr]
        n, width = self.length, self.width
        first = record.started_at + batch * self.consumed_per_batch + self.layout.process_index * width
        if n is None:
            return list(range(first, first + width)), width
        real = min(max(n - first, 0), width)
        size = width if self.layout.even_batches else real
        return ([(first + k) % n for k in range(size)] if n else []), real

    def elements(
        self,
        stream: Iterator[Any],
        worker: int = 0,
        workers: int = 1,
        skip: int = 0,
        read: int = 0,
        on_boundary: Optional[Callable[[int], None]] = None,
        on_first: Optional[Callable[[list[Any]], None]] = None,
    ) -> Iterator[Any]:
        """This process's elements of ``stream`` (for DataLoader worker ``worker`` of ``workers``).

        The first ``skip`` elements are read but not yielded (a resume); the epoch's first
        global batch, which padding cycles through, is still taken from what is read first.
        ``on_boundary(read)`` is called at each global batch boundary, ``read`` counting from ``read``;
        ``on_first(elements)`` with the first whole (or final) global batch this call reads.
        """
        size, width = self.consumed_per_batch, self.width
        own = slice(self.layout.process_index * width, (self.layout.process_index + 1) * width)
        cut = self._tagged_slice(own, read) if self.tags else (lambda buffer, start, real: buffer[own])
        head: list[Any] = []
        for element in itertools.islice(stream, skip):
            if len(head) < size:
                head.append(element)
        read += skip
        if on_boundary is not None:
            on_boundary(read)
        buffer: list[Any] = []
        index = 0
        for element in stream:
            if len(head) < size:
                head.append(element)
            buffer.append(element)
            if len(buffer) < size:
                continue
            read += size
            if on_boundary is not None:
                on_boundary(read)
            if index % workers == worker:
                if on_first is not None:
                    on_first(buffer)
                    on_first = None
                yield from cut(buffer, read - size, size)
            index += 1
            buffer = []
        self.observed = read + len(buffer)  # the stream's end was reached (in a worker: that worker's copy)
        if on_first is not None:
            on_first(buffer if index % workers == worker else [])  # no whole global batch reached this reader
        if not buffer or self.layout.drop_last or index % workers != worker:
            return
        real = len(buffer)
        if self.layout.even_batches:
            buffer += list(itertools.islice(itertools.cycle(head), size - len(buffer)))
        yield from cut(buffer, read, real)

    @staticmethod
    def _tagged_slice(own: slice, first: int) -> Callable[[list[Any], int, int], list[Any]]:
        """``cut(buffer, start, real)``: the slice ``own`` of a global batch read from position ``start``
        (its first ``real`` elements real, the rest cycled from the head, read from ``first``), tagged."""
        def cut(buffer: list[Any], start: int, real: int) -> list[Any]:
            places = [start + k if k < real else first + (k - real) for k in range(len(buffer))]
            return [PaddingTag(e, p, k < real) for k, e, p in zip(range(own.start, own.stop), buffer[own], places[own])]
        return cut


class PaddingTag(NamedTuple):
    """One element on its way from a reader to the collation, with its place and whether it is real."""

    element: Any
    position: int
    real: bool


class TaggedBatch(NamedTuple):
    """A collated batch and its elements' tags (a named tuple: ``pin_memory`` keeps its type)."""

    batch: Any
    positions: tuple[int, ...]
    real: int


class TagCollate:
    """A ``collate_fn`` that takes the :class:`PaddingTag` off each element, collates the elements with
    ``collate_fn`` and hands the tags on beside the batch (a :class:`TaggedBatch`); anything else
    passes to ``collate_fn`` unchanged."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Any:
        if isinstance(data, PaddingTag):  # no automatic batching: one element per batch
            element, position, real = data
            return TaggedBatch(self.collate_fn(element), (position,), int(real))
        if isinstance(data, list) and data and isinstance(data[0], PaddingTag):
            return TaggedBatch(self.collate_fn([t[0] for t in data]), tuple(t[1] for t in data), sum(t[2] for t in data))
        return self.collate_fn(data)


def _untagged(batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
    """``batches`` without their tags, each batch's (positions, real count) appended to ``record``."""
    for batch in batches:
        if isinstance(batch, TaggedBatch):
            batch, positions, real = batch
            if record.batches is not None:
                record.batches.append((list(positions), real))
        yield batch


class LocalPlan(_Unchanged):
    """The loader's own batches are this process's part: a stream that sharded itself (each
    process reads only its shards), or data read by this process alone.  A position counts this
    loader's batches, so it resumes only with the same number of processes."""

    unit = "batches"
    consumed_per_batch = 1
    identifies_samples = False
    untracked_reason = (
        "the data is not sharded by shardplug here (a stream that shards itself, or one process), so padding "
        "cannot be told apart; use loader.remainder for the last global batch"
    )

    def __init__(self, layout: ShardLayout, length: Optional[int] = None) -> None:
        self.layout = layout
        self.length = length

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        return _check_consumed(consumed)  # the loader reads and drops them

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        raise ValueError(self.untracked_reason)

    def epoch_size(self) -> Optional[int]:
        return self.length

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        return None if self.length is None else max(self.length - _check_consumed(consumed), 0)

    def samples_before(self, consumed: int) -> Optional[int]:
        return _global_batch_samples(self.layout, consumed)  # its batches are the global ones

    def finished(self, consumed: int) -> Optional[bool]:
        rest = self.num_batches(consumed)
        return None if rest is None else rest == 0


def _rows(batch: Any) -> int:
    """Samples in a collated batch: the length of its first tensor (or of the batch itself)."""
    while isinstance(batch, (list, tuple, dict)) and not isinstance(batch, torch.Tensor) and len(batch):
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        elif isinstance(batch[0], (torch.Tensor, list, tuple, dict)):
            batch = batch[0]
        else:
            return len(batch)
    return len(batch) if hasattr(batch, "__len__") else 1


def _detached(batch: Any) -> Any:
    """A copy of ``batch``'s tensors, kept as padding (the caller may change the batch in place)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return type(batch)({k: _detached(v) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_detached(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_detached(v) for v in batch)
    return batch


class NativeStreamPlan:
    """A stream that sharded itself: this process reads only its shards (``dataset.shard(N, i)``).

    Each element is read by one process.  Equal step counts come from the parts' batch counts
    (``counts``, when every part's length is known) or else from an agreement between the
    processes on when the first of them runs out: one integer all-reduce per
    :attr:`steps_per_agreement` steps, each process reading that many batches ahead.  Then
    ``even_batches=True``: a process that is done yields padding from the start of its own part
    (real count 0) until every process is done; ``drop_last=True``: every process stops at the
    first step some process cannot fill; ``even_batches=False``: no padding, a process may yield
    fewer batches.  ``agree(value, op)`` starts the reduction and returns a function that waits
    for it: the next agreement travels while the caller works on a chunk's last step.  A position
    counts this loader's batches (padding included): it resumes with the same number of processes.
    """

    unit = "batches"
    consumed_per_batch = 1
    untracked_reason = None
    identifies_samples = False  # the stream's elements have no index shardplug knows
    reads_ahead = True
    needs_tags = False
    """Batches are read from the loader ahead of those handed out (the agreement's chunk), so a
    ``StatefulDataLoader``'s own state is past the place: a resume skips by this plan's count instead."""

    def __init__(
        self,
        layout: ShardLayout,
        counts: Optional[Sequence[int]] = None,
        agree: Optional[Callable[[int, str], Callable[[], int]]] = None,
    ) -> None:
        self.layout = layout
        self.counts = list(counts) if counts is not None else None
        self.agree = agree
        self.pending_start = 0

    def epoch_size(self) -> Optional[int]:
        return self.num_batches(0)

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        if self.counts is None:
            return None
        if self.layout.pads:
            target = max(self.counts)
        elif self.layout.drop_last:
            target = min(self.counts)
        else:
            target = self.counts[self.layout.process_index]
        return max(target - _check_consumed(consumed), 0)

    def finished(self, consumed: int) -> Optional[bool]:
        if self.counts is None:
            return None
        if self.layout.pads or self.layout.drop_last:
            return self.num_batches(consumed) == 0
        return max(self.counts) <= consumed

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = _check_consumed(consumed)
        return 0  # pass_batches reads past them (keeping the first one: padding reads it)

    def samples_before(self, consumed: int) -> Optional[int]:
        return None  # each process counts its own part's batches: no global batch boundary

    def batch_record(self, record: PassRecord, batch: int) -> tuple[Optional[list[int]], int]:
        return record.batches.popleft() if record.batches else (None, 0)  # type: ignore[return-value]

    steps_per_agreement = 8
    """Steps agreed on by one collective: each process reads that many batches ahead and tells how
    many it has (one all-reduce per ``steps_per_agreement`` steps, in flight during a step).  Lower
    it for very large batches (they are held ahead); measured: 1.03x the time of no agreement at
    8, 1.06x at 4, 1.11x at 1, for 1 ms steps on 2 gloo processes (``benchmarks/run.py`` P8)."""

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        start, self.pending_start = self.pending_start, 0
        iterator = iter(batches)
        head: list[Any] = []  # the first batch of this process's part: what padding repeats
        exhausted = False

        def fetch() -> Any:
            nonlocal exhausted
            batch = _END if exhausted else next(iterator, _END)
            exhausted = batch is _END
            if batch is not _END and not head:
                head.append(_detached(batch))
            return batch

        for _ in range(start):  # read past what the position consumed (padding steps included)
            if fetch() is _END:
                break
        total = self.num_batches(start)
        chunk = self.steps_per_agreement

        def begin(taken: int) -> tuple[list[Any], Callable[[], int]]:
            """The next ``chunk`` batches this process has, and (waiting when called) how many steps
            every process takes of them."""
            ahead = []
            while len(ahead) < chunk and not exhausted:
                batch = fetch()
                if batch is not _END:
                    ahead.append(batch)
            return ahead, self._steps(len(ahead), taken, total)

        taken = 0
        ahead, agreed = begin(taken)
        while True:
            steps = agreed()
            following = None
            for k in range(steps):
                if k == steps - 1 and steps == chunk:  # the next agreement travels during this chunk's last step
                    following = begin(taken + steps)
                yield self._step(ahead, k, head, record)
            taken += steps
            if following is None:  # fewer than a chunk: some (or every) process ran out
                if len(ahead) > steps:
                    logger.info("stopped after %d batches: another process's part of the stream ran out first "
                                "(drop_last=True); this process's remaining elements were not used", start + taken)
                return
            ahead, agreed = following

    def _step(self, ahead: list[Any], k: int, head: list[Any], record: PassRecord) -> Any:
        """The ``k``-th step of a chunk: this process's batch, or padding when it has none left."""
        if k < len(ahead):
            if record.batches is not None:
                record.batches.append((None, _rows(ahead[k])))  # type: ignore[arg-type]
            return ahead[k]
        if not head:
            raise ValueError(
                f"process {self.layout.process_index}'s part of the stream is empty, so it has nothing to pad with "
                "while the other processes go on; give the stream at least num_processes shards with data, or "
                "pass even_batches=False"
            )
        if record.batches is not None:
            record.batches.append((None, 0))  # type: ignore[arg-type]
        return head[0]

    def _steps(self, available: int, taken: int, total: Optional[int]) -> Callable[[], int]:
        """How many of the next chunk's steps every process takes, as a function that waits for the
        answer: the counts decide when they are known, else an agreement (started now)."""
        if total is not None:  # the counts say how many steps: padding fills what this part lacks
            answer = max(min(self.steps_per_agreement, total - taken), 0)
            return lambda: answer
        if self.layout.num_processes == 1 or not (self.layout.pads or self.layout.drop_last) or self.agree is None:
            return lambda: available  # even_batches=False: no padding, no agreement
        pending = self.agree(available, "max" if self.layout.pads else "min")
        return pending


_END = object()


class DispatchPlan(_Unchanged):
    """Process 0 reads the global batches; each step takes one of them (splitting) or ``N``, and
    every process receives its rows.  ``length`` is the number of global batches per epoch;
    ``source`` the plan of process 0's global batches (it skips them on a resume), or ``None``
    when they are read and dropped."""

    unit = "global_batches"
    identifies_samples = False
    untracked_reason = (
        "dispatch_batches=True: only process 0 reads indices, so padding is not tracked per batch; use "
        "loader.remainder for the real rows of the last step, or dispatch_batches=False"
    )

    def __init__(self, layout: ShardLayout, length: Optional[int] = None, source: Optional[ShardPlan] = None) -> None:
        self.layout = layout
        self.length = length
        self.source = source

    @property
    def sampler(self) -> Any:
        """The index sampler of process 0's global batches: its source's (``None`` for a stream).
        The loader finds the shuffle to seed, save and restore through it, as for any plan."""
        return getattr(self.source, "sampler", None)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        if self.source is not None:
            return self.source.start_after(consumed)
        return _check_consumed(consumed)

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        raise ValueError(self.untracked_reason)

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def epoch_size(self) -> Optional[int]:
        return self.length

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        if self.length is None:
            return None
        rest = max(self.length - _check_consumed(consumed), 0)
        per_step = self.consumed_per_batch
        return rest // per_step if self.layout.drop_last else -(-rest // per_step)

    def samples_before(self, consumed: int) -> Optional[int]:
        return _global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> Optional[bool]:
        rest = self.num_batches(consumed)
        return None if rest is None else rest == 0
