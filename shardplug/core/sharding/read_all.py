"""A stream every process reads whole, keeping its part of each global batch.

The whole path of this kind of sharding: :func:`shard` (the planner's entry), :class:`IterableDatasetShard`
(the wrapper each process's DataLoader reads: it batches the stream into global batches and keeps its
slice of each) and its :class:`StreamPlan` (which slice, ``len()``, where a pass resumes: after
``consumed`` stream elements).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardplug.core._internal.arguments import is_int
from shardplug.core._internal.collectives import world_size
from shardplug.core.config import ShardplugConfig
from shardplug.core.sharding.fingerprint import FirstBatchCheck, checked_first_batch
from shardplug.core.sharding.kinds import Shard, ShardingKind
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.marks import PaddingTag, untagged
from shardplug.core.sharding.shard_plan import PassRecord, PlanDefaults, check_consumed, sized_length
from shardplug.core.sharding.stream_traits import hf_shuffles, splits_by_worker
from shardplug.core.shuffle.seedable import epoch_seed

__all__ = ["StreamPlan", "IterableDatasetShard", "shard"]


class StreamPlan(PlanDefaults):
    """A stream every process reads whole, keeping its part of each global batch.

    A global batch is ``step_batch_size`` consecutive elements; process ``i`` keeps the slice
    ``[i*w, (i+1)*w)`` of it (``w`` = ``process_batch_size``).  A short final global batch is
    dropped (``drop_last``), completed with the epoch's first elements, cycled (``even_batches``),
    or left short (``even_batches=False``: the leftovers go to the first processes).  Inside
    DataLoader workers, worker ``w`` of ``W`` keeps global batches ``w, w+W, ...``; a stream that
    splits itself across workers (``splits_by_worker``) is shared out within each worker's part.

    What the reader (:class:`~shardplug.core.sharding.read_all.IterableDatasetShard`) finds while it reads is
    kept here for the loader: the stream's length once read to its end (:attr:`observed`), the
    dataset's own state at the last global-batch boundaries (:attr:`boundary_states`, a position's
    ``dataset_state``) and the fingerprint of each pass's first global batch (``first_batch``,
    compared between the processes once the pass's first batch was read).

    Example::

        >>> plan = StreamPlan(ShardLayout(2, 1, batch_size=2), length=11)
        >>> list(plan.elements(iter(range(11)))), plan.num_batches()
        ([2, 3, 6, 7, 10, 0], 3)
    """

    unit = "elements"
    stream = True
    first_holds_most = True  # leftovers go to the first processes (each DataLoader worker's too)

    def __init__(
        self,
        layout: ShardLayout,
        length: int | None = None,
        splits_by_worker: bool = False,
        first_batch: FirstBatchCheck | None = None,
    ) -> None:
        if layout.batch_size is None:
            raise ValueError("a stream shard needs a batch size (elements per process batch); pass batch_size >= 1")
        self.layout = layout
        self.length = length
        self.splits_by_worker = splits_by_worker
        self.first_batch = first_batch
        self.boundary_states: dict[int, Any] = {}
        """The dataset's ``state_dict()`` at the last few global-batch boundaries of the pass, keyed by
        elements read (recorded where the dataset repositions itself and is read in this process)."""
        self.pending_start: tuple[int, Any] = (0, None)
        """(elements, dataset state) the next pass starts after (see :meth:`start_after`)."""
        self.needs_tags = length is None
        """Without the stream's length (no ``len()``, or a stream that splits itself across workers, each
        worker padding its own part) the batches' places cannot be computed: tracking tags the elements."""
        self.observed: int | None = None
        """Elements of the stream, counted when a pass read it to its end in this process (no DataLoader
        workers; reset when a pass begins): where ``length`` is unknown, the end of the epoch is then known."""
        self.tags = False
        """Each element leaves the reader as a :class:`PaddingTag` (set by ``track_padding`` where
        :attr:`needs_tags`); :meth:`pass_batches` takes the tags off the collated batches."""
        self.identifies_samples = length is not None  # tagged positions are the reader's, not sample ids

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        """The next pass starts after ``consumed`` elements: by loading ``dataset_state`` into the
        dataset when given (a dataset that repositions itself), else by reading past them."""
        self.pending_start = (check_consumed(consumed), dataset_state)
        return 0

    def take_start(self) -> tuple[int, Any]:
        """The pending start (the reader takes it when its pass begins: one-shot)."""
        start, self.pending_start = self.pending_start, (0, None)
        return start

    @contextlib.contextmanager
    def start_in_workers(self, num_workers: int) -> Iterator[bool]:
        if num_workers == 0:  # the reader runs in this process and takes the start itself
            yield False
            return
        yield self.pending_start != (0, None)
        self.take_start()  # the workers carry it: this process's copy must not carry it into the next pass

    def saved_state(self, consumed: int) -> Any:
        """The dataset's own state after ``consumed`` elements of this pass (a dataset that repositions
        itself, read in this process), if recorded."""
        return self.boundary_states.get(consumed)

    def begin_pass(self) -> None:
        self.observed = None
        if self.first_batch is not None:
            self.first_batch.begin_pass()

    def start_tagging(self) -> bool:
        if not self.needs_tags or self.tags:
            return False
        self.tags = True
        return True

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.step_batch_size  # type: ignore[return-value]

    @property
    def width(self) -> int:
        return self.layout.process_batch_size  # type: ignore[return-value]

    def epoch_size(self) -> int | None:
        return self.length

    def _own_count(self, leftover: int) -> int:
        """Elements of this process's slice within a global batch of ``leftover`` elements."""
        width = self.width
        return min(max(leftover - self.layout.process_index * width, 0), width)

    def num_elements(self, consumed: int = 0) -> int | None:
        """Elements this process yields after ``consumed`` elements of the stream."""
        if self.length is None:
            return None
        rest = max(self.length - check_consumed(consumed), 0)
        full, leftover = divmod(rest, self.consumed_per_batch)
        count = full * self.width
        if leftover and not self.layout.drop_last:
            count += self.width if self.layout.even_batches else self._own_count(leftover)
        return count

    def num_batches(self, consumed: int = 0) -> int | None:
        elements = self.num_elements(consumed)
        return None if elements is None else -(-elements // self.width)

    def samples_before(self, consumed: int) -> int | None:
        return check_consumed(consumed)

    def finished(self, consumed: int) -> bool | None:
        # Process 0 has the most elements (leftovers go to the first processes).
        length = self.length if self.length is not None else self.observed
        first = StreamPlan(dataclasses.replace(self.layout, process_index=0), length)
        elements = first.num_elements(consumed)
        return None if elements is None else elements == 0

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The loader's batches, their padding tags (when :attr:`tags`) taken off into ``record``; on
        several processes the first global batches are compared once the first batch was read."""
        if self.tags:
            batches = untagged(batches, record)
        if self.first_batch is not None and self.layout.num_processes > 1 and world_size() > 1:
            batches = checked_first_batch(batches, self.first_batch)
        return batches

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
        on_boundary: Callable[[int], None] | None = None,
        on_first: Callable[[list[Any]], None] | None = None,
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


class IterableDatasetShard(IterableDataset[Any]):
    """This process's part of every global batch of an iterable dataset.

    Every process reads the stream and keeps its slice of each global batch: the global batch is
    ``batch_size`` elements when splitting (slice ``batch_size // N``), ``batch_size * N``
    otherwise (slice ``batch_size``).  A short final global batch is dropped (``drop_last``) or
    completed with elements of the first global batch, cycled.  Inside ``DataLoader`` workers,
    worker ``w`` of ``W`` keeps only global batches ``w, w+W, ...``, so each element reaches
    exactly one worker and batches arrive in stream order; a dataset that splits itself across
    workers (Hugging Face, webdataset, ``splits_by_worker = True``: see
    :mod:`~shardplug.core.sharding.stream_traits`) is not split
    again: each worker's part is shared by process, and padded from its own start.
    ``even_batches=False``: a short final global batch is not completed; the first processes get
    its leftovers.  The arithmetic is :class:`~shardplug.core.sharding.read_all.StreamPlan`'s.

    Example::

        >>> list(IterableDatasetShard(range(11), batch_size=2, num_processes=2, process_index=1))
        [2, 3, 6, 7, 10, 0]
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = ShardplugConfig.split_batches,
        even_batches: bool = ShardplugConfig.even_batches,
    ) -> None:
        if not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"dataset={dataset!r} is not iterable; pass an IterableDataset (or any iterable of samples) to "
                "shard, and a map-style dataset to a DataLoader (prepare_data_loader shards its sampler)"
            )
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
        # A one-element batch cannot be cut: it is then read as N one-element slices.
        layout = ShardLayout(
            num_processes, process_index, split_batches and batch_size > 1, even_batches, drop_last, batch_size
        )
        self._setup(dataset, layout, split_batches, splits_by_worker(dataset))

    def _setup(self, dataset: Any, layout: ShardLayout, split_batches: bool, splits: bool) -> None:
        """The shard of ``dataset`` under ``layout`` (its batch size set), ``splits``: whether the
        dataset splits itself across DataLoader workers."""
        # A stream that splits itself across workers pads each worker's part: its length is not the stream's.
        length = None if splits else sized_length(dataset)
        # every process must read the same stream: the first global batch of each pass is compared
        self.plan = StreamPlan(layout, length, splits_by_worker=splits, first_batch=FirstBatchCheck())
        self.dataset = dataset
        self.batch_size = cast(int, layout.batch_size)
        self.split_batches = split_batches
        self.epoch = 0
        generator = getattr(dataset, "generator", None)
        self._generator_seed: int | None = (
            generator.initial_seed()
            if isinstance(generator, torch.Generator) and not hasattr(dataset, "set_epoch")
            else None
        )

    splits_by_worker = property(lambda self: self.plan.splits_by_worker)
    drop_last = property(lambda self: self.plan.layout.drop_last)
    even_batches = property(lambda self: self.plan.layout.even_batches)
    num_processes = property(lambda self: self.plan.layout.num_processes)
    process_index = property(lambda self: self.plan.layout.process_index)

    @property
    def global_batch_size(self) -> int:
        """Elements of one global batch (all processes' slices together)."""
        return self.plan.consumed_per_batch

    @property
    def process_slice_size(self) -> int:
        """Elements of this process's slice of each global batch."""
        return self.plan.width

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def repositions_itself(self) -> bool:
        """The dataset has ``state_dict()`` (callable without arguments) and ``load_state_dict()`` and
        is read in this process (no DataLoader workers), so a resume loads its state instead of re-reading the stream
        (not a shuffled Hugging Face stream: its state loses the shuffle buffer, so it is skipped
        exactly instead)."""
        return (
            callable(getattr(self.dataset, "state_dict", None))
            and callable(getattr(self.dataset, "load_state_dict", None))
            and takes_no_arguments(self.dataset.state_dict)  # litdata's, streaming's need what shardplug lacks
            and get_worker_info() is None
            and not hf_shuffles(self.dataset)  # its state does not restore the shuffle buffer: skip exactly instead
        )

    def begin_pass(self) -> None:
        """The loader starts a pass (in its own process, before any worker reads it): its plan's
        :meth:`~shardplug.core.sharding.read_all.StreamPlan.begin_pass`."""
        self.plan.begin_pass()

    def __iter__(self) -> Iterator[Any]:
        if self._generator_seed is not None:
            self.dataset.generator.manual_seed(epoch_seed(self._generator_seed, self.epoch))
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        first_reader = worker == 0  # the reader of the pass's first global batch records it
        if self.splits_by_worker:  # the dataset gives this worker its own part: share all of it by process
            workers, worker = 1, 0
        read = 0
        self.plan.boundary_states = {}
        skip, dataset_state = self.plan.take_start()
        if dataset_state is not None:  # the dataset repositions itself (its first batch is then what pads)
            read, skip = skip, 0
            self.dataset.load_state_dict(dataset_state)
        on_boundary = self._record_state if self.repositions_itself else None
        on_first = (
            cast(FirstBatchCheck, self.plan.first_batch).recorder() if first_reader and self.num_processes > 1 else None
        )
        yield from self.plan.elements(iter(self.dataset), worker, workers, skip, read, on_boundary, on_first)

    def _record_state(self, read: int) -> None:
        """Keep the dataset's state at a few global-batch boundaries: the loader looks at most two batches ahead."""
        states = self.plan.boundary_states
        states[read] = self.dataset.state_dict()
        states.pop(read - 4 * self.global_batch_size, None)

    def __len__(self) -> int:
        if self.plan.length is None:
            raise TypeError(f"{type(self.dataset).__name__} has no len(), so neither has its shard")
        return self.plan.num_elements()  # type: ignore[return-value]

    @classmethod
    def from_layout(cls, dataset: Any, layout: ShardLayout, splits: bool) -> IterableDatasetShard:
        """The shard of ``dataset`` under ``layout`` (``prepare_data_loader``'s; a layout without batch
        size reads batches of one), ``splits``: whether the dataset splits itself across DataLoader
        workers (:attr:`~shardplug.core.sharding.kinds.ShardingKind.splits_by_worker`)."""
        batch_size = layout.batch_size or 1
        # A one-element batch cannot be cut: it is then read as N one-element slices.
        own = dataclasses.replace(layout, split_batches=layout.split_batches and batch_size > 1, batch_size=batch_size)
        shard = cls.__new__(cls)
        shard._setup(dataset, own, layout.split_batches, splits)
        return shard


def shard(dataset: Any, layout: ShardLayout, batch_size: int | None, drop_last: bool, kind: ShardingKind) -> Shard:
    """The shard of a stream every process reads whole (``kind``: what the planner read of it), its
    plan and the DataLoader's batch size: this process's slice of each global batch (``None`` for a
    DataLoader without batches)."""
    wrapper = IterableDatasetShard.from_layout(dataset, layout, kind.splits_by_worker)
    loader_batch_size = wrapper.process_slice_size if batch_size is not None else None
    return Shard(wrapper, wrapper.plan, {"batch_size": loader_batch_size, "drop_last": drop_last})


def takes_no_arguments(method: Any) -> bool:
    """Whether ``method`` can be called without arguments (a signature that cannot be read counts as yes)."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return True
    required = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )
    return all(
        p.default is not inspect.Parameter.empty or p.kind not in required for p in signature.parameters.values()
    )
