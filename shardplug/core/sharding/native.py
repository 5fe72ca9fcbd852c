"""A stream that shards itself (``n_shards``, ``shard(num_shards, index)``): this process's part, and its plan.

The whole path of this kind of sharding: :func:`_part` / :class:`ProcessPart` (which shards this
process reads), :func:`shard` (the planner's entry: the part, its plan and the DataLoader's batch size) and
:class:`NativeStreamPlan` (equal step counts from the parts' lengths, or from an agreement on when the
first part runs out; ``len()``; where a pass resumes).

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
    >>> [list(_part(Shards(range(5)), 2, i, worker_split=False)) for i in range(2)]
    [[0, 1, 20, 21, 40], [10, 11, 30, 31, 41]]
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset, get_worker_info

from shardplug.core._internal.collectives import all_reduce_int_async
from shardplug.core._internal.rows import first_leaf, map_leaves
from shardplug.core.sharding.counting import loader_length, worker_batches
from shardplug.core.sharding.kinds import Shard, ShardingKind
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import PassRecord, PlanDefaults, check_consumed, sized_length

__all__ = ["NativeStreamPlan", "ProcessPart", "shard", "hf_concatenate"]


logger = logging.getLogger(__name__)


def _rows(batch: Any) -> int:
    """Samples in a collated batch: the length of its first leaf (or of the batch itself)."""
    leaf = first_leaf(batch)
    return len(leaf) if hasattr(leaf, "__len__") else 1


def _detached(batch: Any) -> Any:
    """A copy of ``batch``'s tensors, kept as padding (the caller may change the batch in place)."""
    return map_leaves(batch, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


class NativeStreamPlan(PlanDefaults):
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
    stream = True
    consumed_per_batch = 1

    def __init__(
        self,
        layout: ShardLayout,
        counts: Sequence[int] | None = None,
        agree: Callable[[int, str], Callable[[], int]] | None = None,
        start: Callable[[int], tuple[int, bool]] | None = None,
    ) -> None:
        self.layout = layout
        self.counts = list(counts) if counts is not None else None
        self.agree = agree
        self.start = start
        """Called before each pass's reader starts with the batches a resume skips: how many of them the
        stream starts after by itself (its own state; the pass reads past the rest), and whether its
        state changed (see :meth:`~shardplug.core.sharding.presplit.NodePart.start`); ``None``: the pass reads
        past them."""
        self.pending_start = 0
        self.placed_by_stream = 0

    def epoch_size(self) -> int | None:
        return self.num_batches(0)

    def num_batches(self, consumed: int = 0) -> int | None:
        if self.counts is None:
            return None
        if self.layout.pads:
            target = max(self.counts)
        elif self.layout.drop_last:
            target = min(self.counts)
        else:
            target = self.counts[self.layout.process_index]
        return max(target - check_consumed(consumed), 0)

    def finished(self, consumed: int) -> bool | None:
        if self.counts is None:
            return None
        if self.layout.pads or self.layout.drop_last:
            return self.num_batches(consumed) == 0
        return max(self.counts) <= consumed

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = check_consumed(consumed)
        return 0  # pass_batches reads past them (keeping the first one: padding reads it)

    @contextlib.contextmanager
    def start_in_workers(self, num_workers: int) -> Iterator[bool]:
        """The stream positions itself here, before its reader starts, where it can (:attr:`start`)."""
        changed = False
        if self.start is not None:
            self.placed_by_stream, changed = self.start(self.pending_start)
        yield changed

    def samples_before(self, consumed: int) -> int | None:
        return None  # each process counts its own part's batches: no global batch boundary

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        return record.batches.popleft() if record.batches else (None, 0)

    steps_per_agreement = 8
    """Steps agreed on by one collective: each process reads that many batches ahead and tells how
    many it has (one all-reduce per ``steps_per_agreement`` steps, in flight during a step).  Lower
    it for very large batches (they are held ahead); measured: 1.03x the time of no agreement at
    8, 1.06x at 4, 1.11x at 1, for 1 ms steps on 2 gloo processes (``benchmarks/run.py`` P8)."""

    @property
    def read_ahead(self) -> int:
        """Batches read from the loader ahead of those handed out (the agreement's chunk): a
        ``StatefulDataLoader``'s own state is past the place, so a resume skips by this plan's count."""
        return self.steps_per_agreement

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

        skip, self.placed_by_stream = start - self.placed_by_stream, 0
        for _ in range(skip):  # read past what the position consumed (padding steps included)
            if fetch() is _END:
                break
        total = self.num_batches(start)
        chunk = self.steps_per_agreement

        def begin(taken: int) -> tuple[list[Any], Callable[[], int]]:
            """The next ``chunk`` batches this process has, and (waiting when called) how many steps
            every process takes of them."""
            ahead: list[Any] = []
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
                    logger.info(
                        "stopped after %d batches: another process's part of the stream ran out first "
                        "(drop_last=True); this process's remaining elements were not used",
                        start + taken,
                    )
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

    def _steps(self, available: int, taken: int, total: int | None) -> Callable[[], int]:
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


def _part(dataset: Any, num_processes: int, process_index: int, worker_split: bool) -> Any:
    """Process ``process_index``'s part of a stream that shards natively (``worker_split``: it splits
    itself across DataLoader workers)."""
    shards, n = dataset.n_shards, num_processes
    whole = shards // n
    if shards % n == 0 and worker_split:
        return dataset.shard(num_shards=n, index=process_index)  # the dataset splits its part across workers
    own = [dataset.shard(num_shards=shards, index=k) for k in range(process_index, whole * n, n)]
    rest = [dataset.shard(num_shards=shards, index=k) for k in range(whole * n, shards)]
    return ProcessPart(own, rest, n, process_index, join=hf_concatenate if worker_split else None)


def hf_concatenate(parts: list[Any]) -> Any:
    """Hugging Face streams joined one after the other (``datasets.concatenate_datasets``: the
    result keeps every part's shards, and so the split across DataLoader workers)."""
    package = sys.modules[type(parts[0]).__module__.split(".")[0]]  # imported: its objects exist
    return parts[0] if len(parts) == 1 else package.concatenate_datasets(parts)


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


def shard(dataset: Any, layout: ShardLayout, num_workers: int, drop_last: bool, kind: ShardingKind) -> Shard:
    """This process's part of a stream that shards itself (``kind``: what the planner read of it), its
    plan and the DataLoader's batch size.  A part is read once in all (the rows of shards that do not
    divide among the processes by every process) instead of by every process; equal step counts come
    from the parts' batch counts when they are known without reading (every part has ``len()``, and
    shardplug knows what each DataLoader worker reads), else from an agreement between the processes
    (:class:`~shardplug.core.sharding.native.NativeStreamPlan`)."""
    n_shards, n = dataset.n_shards, layout.num_processes
    own = _part(dataset, n, layout.process_index, kind.splits_by_worker)  # the planner found it shards natively
    if n_shards % n:
        logger.info(
            "the stream has n_shards=%d over %d processes: each process reads %d shards by itself, and its rows of the "
            "last %d (read by every process)",
            n_shards,
            n,
            n_shards // n,
            n_shards % n,
        )
    batch_size = layout.process_batch_size
    counts: list[int | None] | None = None
    if _batches_of_part(own, batch_size, drop_last, num_workers) is not None:
        parts = (own if j == layout.process_index else _part(dataset, n, j, kind.splits_by_worker) for j in range(n))
        counts = [_batches_of_part(part, batch_size, drop_last, num_workers) for part in parts]
    known = None if counts is None or any(count is None for count in counts) else cast("list[int]", counts)
    plan = NativeStreamPlan(layout, known, agree=all_reduce_int_async)
    return Shard(own, plan, {"batch_size": batch_size, "drop_last": drop_last})


def _batches_of_part(part: Any, batch_size: int | None, drop_last: bool, num_workers: int) -> int | None:
    """Batches a DataLoader with ``num_workers`` workers yields over a process's part, when known
    without reading: each worker makes its own last batch, so the parts of the workers are counted
    (known only where shardplug splits the shards across workers: a part that splits itself does not say)."""
    if num_workers == 0:
        return loader_length(part, batch_size, drop_last)
    lengths = part.worker_lengths(num_workers) if isinstance(part, ProcessPart) else None
    return None if lengths is None else worker_batches(lengths, batch_size, drop_last)
