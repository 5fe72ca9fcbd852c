"""A user's torch ``DistributedSampler``, adopted: the batches native DDP gives, with shardplug's resume.

Code written for DDP builds its loaders with ``DistributedSampler(dataset, shuffle=..., seed=..., drop_last=...)``.
Its order is a known function of the sampler's seed, its epoch and the dataset's length (torch's
``distributed.py``): ``randperm(n)`` from ``seed + epoch`` (or ``0 .. n-1``), wrapped around to
``ceil(n / R) * R`` positions (or cut to ``floor(n / R) * R`` with the sampler's ``drop_last``), and process
``r`` takes positions ``r, r + R, r + 2R, ...`` of it, batched by the ``DataLoader``.  This kind's
:class:`DistributedSamplerPlan` computes exactly those batches, and on top of them what a saved position
needs: after ``k`` batches of ``b`` on ``R`` processes the job consumed positions ``[0, k * b * R)`` of that
order (a prefix), so the rest can be dealt strided over any number of processes ``M`` (with the padding, or
the ``drop_last``, for ``M``): every remaining sample exactly once.  The positions wrapped around are
padding, marked like every other padding (their indices read the epoch's start).

:func:`shard` is the planner's entry (the checks that refuse a sampler shardplug cannot follow, then the
sampler shard with its plan); :func:`process_positions` and :func:`epoch_order` are the arithmetic.

Example (10 samples, 3 processes, batches of 2: torch's own batches, then a resume on 2 processes)::

    >>> from torch.utils.data import BatchSampler, DistributedSampler
    >>> def plan(rank, processes, start=0):
    ...     sampler = DistributedSampler(range(10), num_replicas=processes, rank=rank, shuffle=False)
    ...     layout = ShardLayout(processes, rank, batch_size=2)
    ...     return DistributedSamplerPlan(BatchSampler(sampler, 2, False), layout)
    >>> [[b for b, _ in plan(r, 3).batches()] for r in range(3)]
    [[[0, 3], [6, 9]], [[1, 4], [7, 0]], [[2, 5], [8, 1]]]
    >>> [[b for b, _ in plan(r, 2).batches(consumed=3)] for r in range(2)]  # after 1 step of 3 processes
    [[[6, 8]], [[7, 9]]]
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from shardplug.core.sharding import counting
from shardplug.core.sharding.arithmetic import EpochOrder
from shardplug.core.sharding.kinds import Shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.map_style import BatchSamplerPlan, BatchSamplerShard, Shuffling, index_sampler
from shardplug.core.sharding.shard_plan import PassRecord, check_consumed, sized_length

__all__ = ["DistributedSamplerPlan", "shard", "epoch_order", "process_positions", "is_distributed_sampler"]

logger = logging.getLogger(__name__)

_REMOVE = "or remove the DistributedSampler (pass shuffle=True, or a plain sampler) and let shardplug shard the data"


def is_distributed_sampler(sampler: Any) -> bool:
    """Whether ``sampler`` is a torch ``DistributedSampler`` (or a subclass: :func:`shard` refuses those whose
    order it cannot know)."""
    return isinstance(sampler, DistributedSampler)


def epoch_order(sampler: DistributedSampler[Any]) -> EpochOrder:
    """The order of ``sampler``'s current epoch before it is wrapped around or cut, drawn as torch draws it:
    ``randperm(n)`` from a generator seeded with ``seed + epoch`` (``shuffle=True``), else ``0 .. n-1``.

    Example::

        >>> sampler = DistributedSampler(range(5), num_replicas=1, rank=0, seed=3)
        >>> sampler.set_epoch(2)
        >>> epoch_order(sampler).permutation.tolist() == list(sampler)
        True
    """
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return EpochOrder(n)
    generator = torch.Generator()
    generator.manual_seed(sampler.seed + sampler.epoch)
    return EpochOrder(n, torch.randperm(n, generator=generator))


def process_positions(n: int, start: int, num_processes: int, process_index: int, drop_last: bool) -> range:
    """The positions of the epoch's order (:func:`epoch_order`, read cyclically past ``n``: the padding) that
    process ``process_index`` of ``num_processes`` takes once the first ``start`` were consumed: the rest is
    wrapped around to a multiple of ``num_processes`` (cut to one with ``drop_last``), and dealt strided.
    With ``start=0`` this is torch's ``indices[rank:total_size:num_replicas]``.

    Example::

        >>> list(process_positions(10, 0, 3, 1, drop_last=False)), list(process_positions(10, 0, 3, 1, drop_last=True))
        ([1, 4, 7, 10], [1, 4, 7])
        >>> list(process_positions(10, 6, 2, 0, drop_last=False))
        [6, 8]
    """
    rest = max(n - start, 0)
    each = rest // num_processes if drop_last else -(-rest // num_processes)
    first = start + process_index
    return range(first, first + each * num_processes, num_processes)


class DistributedSamplerPlan(BatchSamplerPlan):
    """This process's batches of a ``BatchSampler`` over a user's ``DistributedSampler`` (see the module).

    A position counts global batches of ``batch_size`` positions of the epoch's order, ``num_processes`` of them
    per step, as the map-style plan does: ``consumed`` global batches are positions ``[0, consumed * batch_size)``,
    whatever number of processes consumed them.  The order is drawn from the sampler's own epoch
    (:meth:`sampler_epoch`): the loader's epoch follows it, and the loader's ``set_epoch`` sets it.
    """

    def __init__(self, batch_sampler: BatchSampler, layout: ShardLayout) -> None:
        super().__init__(batch_sampler, layout)
        self.distributed: DistributedSampler[Any] = batch_sampler.sampler  # type: ignore[assignment]

    def sampler_epoch(self) -> int:
        """The epoch the sampler stands at (its ``epoch``): what its order is drawn from."""
        return int(self.distributed.epoch)

    def _rows(self, consumed: int) -> tuple[int, range]:
        """(the epoch's length, this process's positions after ``consumed`` global batches)."""
        layout = self.layout
        n = len(self.distributed.dataset)  # type: ignore[arg-type]
        start = check_consumed(consumed) * layout.batch_size  # type: ignore[operator]
        return n, process_positions(n, start, layout.num_processes, layout.process_index, self.distributed.drop_last)

    def num_batches(self, consumed: int = 0) -> int:
        _, positions = self._rows(consumed)
        return counting.batches(len(positions), self.layout.batch_size, self.layout.drop_last)

    def epoch_size(self) -> int | None:
        """Global batches an epoch can hold: every place inside an epoch, saved on any number of processes,
        consumed fewer positions than the dataset has (the padding comes last)."""
        n = len(self.distributed.dataset)  # type: ignore[arg-type]
        size: int = self.layout.batch_size  # type: ignore[assignment]
        return max(-(-n // size), self.layout.num_processes * self.num_batches(0))

    def finished(self, consumed: int) -> bool | None:
        return self.num_batches(consumed) == 0  # every process yields as many batches

    def last_step_real(self, consumed: int) -> int:
        """Real samples in the last global batch of a pass after ``consumed`` (0 when it is full): every process's
        last batch, less the positions past the epoch's length (the padding, each the last of its process's
        positions). With the sampler's ``drop_last`` the last step holds what the cut left, with the loader's the
        last full batches (the padding may be among them)."""
        layout = self.layout
        n = len(self.distributed.dataset)  # type: ignore[arg-type]
        size: int = layout.batch_size  # type: ignore[assignment]
        start = check_consumed(consumed) * size
        real = 0
        for index in range(layout.num_processes):
            positions = process_positions(n, start, layout.num_processes, index, self.distributed.drop_last)
            count = counting.batches(len(positions), size, layout.drop_last)
            last = positions[(count - 1) * size : count * size] if count else range(0)
            real += len(range(last.start, min(last.stop, n), last.step)) if last else 0
        return 0 if real == size * layout.num_processes else real

    def _index_batches(self, consumed: int, record: PassRecord) -> Iterator[list[int]]:
        """This process's batches after ``consumed`` (checked), of the sampler's epoch order; each is logged
        with its real count (the positions before the epoch's length: the padding comes last)."""
        record.started_at = consumed
        record.head = order = epoch_order(self.distributed)
        n, positions = self._rows(consumed)
        size: int = self.layout.batch_size  # type: ignore[assignment]
        count = counting.batches(len(positions), size, self.layout.drop_last)
        taken = torch.arange(positions.start, positions.stop, positions.step, dtype=torch.int64)[: count * size]
        indices = order.lookup(taken).tolist()  # past n: the epoch's start again (the padding)
        real = len(range(positions.start, min(positions.stop, n), positions.step))
        log = record.batches
        for k in range(count):
            batch = indices[k * size : (k + 1) * size]
            if log is not None:
                log.append((batch, min(max(real - k * size, 0), len(batch))))
            yield batch


def shard(dataloader: DataLoader[Any], layout: ShardLayout, options: Shuffling) -> Shard:
    """This process's shard of a ``dataloader`` whose sampler is a ``DistributedSampler`` (checked by
    :func:`check_adoptable`): the batch sampler shard with its :class:`DistributedSamplerPlan`, over the user's
    own sampler (its ``set_epoch`` is the loader's, and the loader's is its)."""
    sampler = index_sampler(dataloader)
    check_adoptable(sampler, dataloader, layout, options)
    batch_sampler = dataloader.batch_sampler
    plan = DistributedSamplerPlan(batch_sampler, layout)  # type: ignore[arg-type]
    shard = BatchSamplerShard.from_layout(batch_sampler, layout, plan)  # type: ignore[arg-type]
    check = (sized_length(dataloader.dataset), layout.batch_size) if layout.num_processes > 1 else None
    logger.debug(
        "adopted the DataLoader's DistributedSampler (shuffle=%s, seed=%s, drop_last=%s) on process %d of %d",
        sampler.shuffle,
        sampler.seed,
        sampler.drop_last,
        layout.process_index,
        layout.num_processes,
    )
    return Shard(dataloader.dataset, plan, {"batch_sampler": shard}, None, check)


def check_adoptable(sampler: Any, dataloader: DataLoader[Any], layout: ShardLayout, options: Shuffling) -> None:
    """Refuse a ``DistributedSampler`` whose batches shardplug cannot follow exactly (each error names the
    argument, its value and the fix): one built for another job (``num_replicas``, ``rank``), a subclass with an
    order of its own, batches not made by torch's ``BatchSampler``, options that would change its order."""
    cls = type(sampler).__name__
    for name, mine, job in (
        ("num_replicas", sampler.num_replicas, layout.num_processes),
        ("rank", sampler.rank, layout.process_index),
    ):
        if mine != job:
            raise ValueError(
                f"the DataLoader's {cls} has {name}={mine}, but this process is process {layout.process_index} of "
                f"{layout.num_processes} sharing the data: its batches would be another job's; build it with "
                f"{cls}(dataset, num_replicas={layout.num_processes}, rank={layout.process_index}) (left out, torch "
                f"reads both from the process group), {_REMOVE}"
            )
    n = len(sampler.dataset)
    each = n // sampler.num_replicas if sampler.drop_last else -(-n // sampler.num_replicas)  # torch's num_samples
    if (sampler.num_samples, sampler.total_size) != (each, each * sampler.num_replicas):
        raise ValueError(
            f"the DataLoader's {cls} has num_samples={sampler.num_samples}, but torch's DistributedSampler gives each "
            f"of its {sampler.num_replicas} processes {each} of a dataset of {n} samples: its dataset changed length "
            "since it was built, or it was changed, and its batches cannot be known; build the DistributedSampler "
            f"after the dataset is complete, {_REMOVE}"
        )
    for method in ("__iter__", "__len__"):
        if getattr(type(sampler), method) is not getattr(DistributedSampler, method):
            raise ValueError(
                f"the DataLoader's sampler is {cls}, a DistributedSampler subclass with a {method} of its own: "
                "shardplug cannot know its order, so it can neither resume nor resize it; use torch's "
                f"DistributedSampler itself, {_REMOVE} (a sampler of your own is then sharded as it is)"
            )
    if type(dataloader.batch_sampler) is not BatchSampler or dataloader.batch_size is None:
        what = "batch_size=None" if dataloader.batch_sampler is None else type(dataloader.batch_sampler).__name__
        raise ValueError(
            f"the DataLoader reads its DistributedSampler through {what}, whose batches shardplug cannot follow; "
            "give the DataLoader a batch_size (DataLoader(dataset, batch_size=..., sampler=sampler)), "
            f"{_REMOVE}"
        )
    refusals = (
        (layout.split_batches and layout.num_processes > 1, "split_batches=True", "split_batches=False"),
        (options.shuffle_algorithm != "randperm", f"shuffle_algorithm={options.shuffle_algorithm!r}", None),
        (options.data_seed is not None, f"data_seed={options.data_seed!r}", "data_seed=None"),
    )
    for refused, given, fix in refusals:
        if refused:
            keep = f"pass {fix}" if fix else "pass shuffle_algorithm='randperm'"
            raise ValueError(
                f"{given} would change the order of the DataLoader's DistributedSampler, which decides this loader's "
                f"batches as under native DDP (its seed={sampler.seed}, shuffle={sampler.shuffle}, "
                f"drop_last={sampler.drop_last}); {keep} to keep them, {_REMOVE}"
            )
