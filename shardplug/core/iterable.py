"""The per-process shard of an iterable dataset."""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .topology import _check_processes

__all__ = ["IterableDatasetShard"]


class IterableDatasetShard(IterableDataset):
    """This process's part of every global batch of an iterable dataset.

    Every process reads the stream and keeps its slice of each global batch: the global batch is
    ``batch_size`` elements when splitting (slice ``batch_size // N``), ``batch_size * N``
    otherwise (slice ``batch_size``).  A short final global batch is dropped (``drop_last``) or
    completed with elements of the first global batch, cycled.  Inside ``DataLoader`` workers,
    worker ``w`` of ``W`` keeps only global batches ``w, w+W, ...``, so each element reaches
    exactly one worker and batches arrive in stream order.

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
        split_batches: bool = False,
    ) -> None:
        _check_processes(num_processes, process_index)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1")
        if split_batches and batch_size > 1 and batch_size % num_processes != 0:
            raise ValueError(
                f"split_batches=True needs a batch size that is a multiple of num_processes, got "
                f"batch_size={batch_size} and num_processes={num_processes}; change the batch size or pass "
                "split_batches=False"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.epoch = 0
        self._skip_elements = 0
        self._resume_state: Any = None
        # dataset.state_dict() at the last few global-batch boundaries, keyed by elements read
        self._boundary_states: dict[int, Any] = {}
        generator = getattr(dataset, "generator", None)
        self._generator_seed: Optional[int] = (
            generator.initial_seed() if isinstance(generator, torch.Generator) and not hasattr(dataset, "set_epoch") else None
        )

    @property
    def _splits(self) -> bool:
        # A one-element batch cannot be cut: it is then read as N one-element slices.
        return self.split_batches and self.batch_size > 1

    @property
    def global_batch_size(self) -> int:
        return self.batch_size if self._splits else self.batch_size * self.num_processes

    @property
    def process_slice_size(self) -> int:
        return self.batch_size // self.num_processes if self._splits else self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def skip_elements(self, count: int) -> None:
        """Make the next iteration start after the stream's first ``count`` elements (one-shot).

        They are read (the stream has no other way to advance) but never batched or yielded;
        the first global batch, which padding cycles through, is still taken from the epoch's start.
        """
        if count < 0:
            raise ValueError(f"count={count} must be >= 0")
        self._skip_elements = int(count)

    @property
    def repositions_itself(self) -> bool:
        """The dataset has ``state_dict()`` / ``load_state_dict()`` and is read in this process
        (no DataLoader workers), so a resume loads its state instead of re-reading the stream."""
        return (
            callable(getattr(self.dataset, "state_dict", None))
            and callable(getattr(self.dataset, "load_state_dict", None))
            and get_worker_info() is None
        )

    def state_at(self, elements: int) -> Any:
        """The dataset's ``state_dict()`` after its first ``elements`` elements of this pass, if recorded."""
        return self._boundary_states.get(elements)

    def resume_from(self, elements: int, dataset_state: Any = None) -> None:
        """Make the next iteration start after the stream's first ``elements`` elements (one-shot):
        by loading ``dataset_state`` into the dataset when given, else by reading past them."""
        if dataset_state is None:
            self.skip_elements(elements)
        else:
            self._resume_state = (int(elements), dataset_state)

    def _process_slice(self) -> slice:
        size = self.process_slice_size
        return slice(self.process_index * size, (self.process_index + 1) * size)

    def __iter__(self) -> Iterator[Any]:
        if self._generator_seed is not None:
            self.dataset.generator.manual_seed(self._generator_seed + self.epoch)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        global_size, own = self.global_batch_size, self._process_slice()
        record = self.repositions_itself
        read = 0
        self._boundary_states = {}
        resume, self._resume_state = self._resume_state, None
        if resume is not None:  # the dataset repositions itself (its first batch is then what pads)
            read = resume[0]
            self.dataset.load_state_dict(resume[1])
        stream = iter(self.dataset)
        # The epoch's first global batch: what a short last global batch is completed with.
        head: list[Any] = []
        skip, self._skip_elements = self._skip_elements, 0
        for element in itertools.islice(stream, skip):
            if len(head) < global_size:
                head.append(element)
        read += skip
        if record:
            self._boundary_states[read] = self.dataset.state_dict()
        buffer: list[Any] = []
        index = 0
        for element in stream:
            if len(head) < global_size:
                head.append(element)
            buffer.append(element)
            if len(buffer) < global_size:
                continue
            read += global_size
            if record:  # a few boundaries are enough: the loader looks at most two batches ahead
                self._boundary_states[read] = self.dataset.state_dict()
                self._boundary_states.pop(read - 4 * global_size, None)
            if index % workers == worker:
                yield from buffer[own]
            index += 1
            buffer = []
        if buffer and not self.drop_last:
            padded = buffer + list(itertools.islice(itertools.cycle(head), global_size - len(buffer)))
            if index % workers == worker:
                yield from padded[own]

    def __len__(self) -> int:
        n = len(self.dataset)
        global_size = self.global_batch_size
        batches = n // global_size if self.drop_last else -(-n // global_size)
        return batches * self.process_slice_size
