"""The per-process shard of an iterable dataset."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .config import ShardplugConfig
from .fingerprint import FirstBatchCheck
from .layout import ShardLayout
from .plan import StreamPlan, sized_length
from .shuffle import epoch_seed
from .streams import hf_shuffles, splits_by_worker

__all__ = ["IterableDatasetShard"]


class IterableDatasetShard(IterableDataset[Any]):
    """This process's part of every global batch of an iterable dataset.

    Every process reads the stream and keeps its slice of each global batch: the global batch is
    ``batch_size`` elements when splitting (slice ``batch_size // N``), ``batch_size * N``
    otherwise (slice ``batch_size``).  A short final global batch is dropped (``drop_last``) or
    completed with elements of the first global batch, cycled.  Inside ``DataLoader`` workers,
    worker ``w`` of ``W`` keeps only global batches ``w, w+W, ...``, so each element reaches
    exactly one worker and batches arrive in stream order; a dataset that splits itself across
    workers (Hugging Face, webdataset, ``splits_by_worker = True``: see ``streams.py``) is not split
    again: each worker's part is shared by process, and padded from its own start.
    ``even_batches=False``: a short final global batch is not completed; the first processes get
    its leftovers.  The arithmetic is :class:`~shardplug.core.plan.StreamPlan`'s.

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
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
        # A one-element batch cannot be cut: it is then read as N one-element slices.
        layout = ShardLayout(
            num_processes, process_index, split_batches and batch_size > 1, even_batches, drop_last, batch_size
        )
        splits = splits_by_worker(dataset)
        # A stream that splits itself across workers pads each worker's part: its length is not the stream's.
        length = None if splits else sized_length(dataset)
        # every process must read the same stream: the first global batch of each pass is compared
        self.plan = StreamPlan(layout, length, splits_by_worker=splits, first_batch=FirstBatchCheck())
        self.dataset = dataset
        self.batch_size = batch_size
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
        :meth:`~shardplug.core.plan.StreamPlan.begin_pass`."""
        self.plan.begin_pass()

    def check_first_batch(self) -> None:
        """Every process compares the first global batch of this pass (a collective: call it on every
        process, after the pass's first batch was fetched or the pass ended); a ``RuntimeError`` on
        every process when the streams differ.  The plan's ``pass_batches`` does it for the loader."""
        cast(FirstBatchCheck, self.plan.first_batch).agree()  # set where there are several processes

    def state_at(self, elements: int) -> Any:
        """The dataset's ``state_dict()`` after its first ``elements`` elements of this pass, if recorded."""
        return self.plan.saved_state(elements)

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
    def from_layout(cls, dataset: Any, layout: ShardLayout) -> IterableDatasetShard:
        """The shard of ``dataset`` under ``layout`` (``prepare_data_loader``'s; a layout without batch
        size reads batches of one)."""
        return cls(
            dataset,
            layout.batch_size or 1,
            layout.drop_last,
            layout.num_processes,
            layout.process_index,
            layout.split_batches,
            layout.even_batches,
        )


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
