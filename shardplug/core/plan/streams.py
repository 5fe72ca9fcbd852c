"""A stream every process reads whole, keeping its part of each global batch (:class:`StreamPlan`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from ..collectives import world_size
from ..fingerprint import FirstBatchCheck, checked_first_batch
from ..layout import ShardLayout
from .padding import PaddingTag, untagged
from .protocol import PassRecord, PlanDefaults, check_consumed

__all__ = ["StreamPlan"]


class StreamPlan(PlanDefaults):
    """A stream every process reads whole, keeping its part of each global batch.

    A global batch is ``step_batch_size`` consecutive elements; process ``i`` keeps the slice
    ``[i*w, (i+1)*w)`` of it (``w`` = ``process_batch_size``).  A short final global batch is
    dropped (``drop_last``), completed with the epoch's first elements, cycled (``even_batches``),
    or left short (``even_batches=False``: the leftovers go to the first processes).  Inside
    DataLoader workers, worker ``w`` of ``W`` keeps global batches ``w, w+W, ...``; a stream that
    splits itself across workers (``splits_by_worker``) is shared out within each worker's part.

    What the reader (:class:`~shardplug.core.iterable.IterableDatasetShard`) finds while it reads is
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
        self.untracked_reason: str | None = None
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
