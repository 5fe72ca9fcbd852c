"""A stream already split by node (process): what this process reads is its part, read as it is.

Such a stream reads only this process's part by itself: litdata's and MosaicML ``streaming``'s
``StreamingDataset`` (once they see several processes), a Hugging Face stream after
``split_dataset_by_node``, a webdataset pipeline with ``nodesplitter=split_by_node``, or a stream
of your own that declares ``split_by_node = True`` (see :func:`shardplug.core.sharding.stream_traits.node_split`).
shardplug does not split it again: it wraps it in a :class:`NodePart`, which only splits it across
DataLoader workers where the stream does not do that itself, and hands the loader's epoch to it.
Equal step counts come from the parts' batch counts when every process knows its own (its part
has ``len()`` and shardplug knows what each DataLoader worker reads: the processes exchange them
once, when the loader is prepared), else from the agreement of
:class:`~shardplug.core.sharding.native.NativeStreamPlan` on when the first part runs out (:func:`shard`: the
planner's entry).  Where the library
itself drops or repeats samples to give its ranks equal parts (litdata's forced ``drop_last``,
streaming's even-out), process 0 says so in one warning when the first pass begins, with the count
where the parts' lengths and the library's epoch tell it (:func:`tail_notice`).

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
import operator
import warnings
from collections.abc import Iterator
from typing import Any, cast

import torch  # noqa: F401  (the docstring example)
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from shardplug.core._internal.collectives import all_gather_objects, all_reduce_int_async, waiting_for, world_size
from shardplug.core.sharding.counting import loader_length, worker_batches
from shardplug.core.sharding.kinds import NodeSplit, Shard, ShardingKind
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.native import NativeStreamPlan
from shardplug.core.sharding.shard_plan import sized_length
from shardplug.core.sharding.stream_traits import stream_library

__all__ = ["NodePart", "shard", "check_node_split", "tail_notice", "library_epoch_samples"]

_UNREAD: Any = object()

logger = logging.getLogger(__name__)


class NodePart(IterableDataset[Any]):
    """This process's part of a stream already split by node: ``dataset`` as it is, split across
    DataLoader workers when ``split_workers`` (worker ``w`` of ``W`` keeps elements ``w, w+W, ...``;
    a stream that splits itself across workers is read whole in each worker).

    A litdata or streaming ``StreamingDataset`` starts a resumed pass through its own state
    (:meth:`start`), given the batches of ``batch_size`` its ``num_workers`` DataLoader workers make
    on each of ``num_processes`` processes: litdata is told them (``set_batch_size``,
    ``set_num_workers``, as its own ``StreamingDataLoader`` does), streaming must have been built
    with ``batch_size`` (else the pass reads past what was consumed, exactly).  Only where every
    rank's part holds as many samples (:attr:`equal_parts`): litdata with ``drop_last=False`` gives
    its last rank what is left over (to one of its workers), and a shorter part is padded with its
    first batch, which a stream started by its own state would not read; such parts are read past."""

    equal_parts = False
    """Every process's part holds as many samples (their ``len()``, exchanged by :func:`shard`)."""
    notice: str | None = None
    """A warning the first pass gives, once (set by :func:`shard`: see :func:`tail_notice`)."""

    def __init__(
        self,
        dataset: Any,
        split_workers: bool,
        batch_size: int | None = None,
        num_processes: int = 1,
        num_workers: int = 0,
        library: str | None = _UNREAD,
    ) -> None:
        self.dataset = dataset
        self.split_workers = split_workers
        self.splits_by_worker = not split_workers
        self.batch_size, self.num_processes, self.num_workers = batch_size, num_processes, num_workers
        self.epoch = 0
        if library is _UNREAD:  # not told (see ShardingKind.library): read it here
            library = stream_library(dataset)
        self.library = library if batch_size is not None else None
        self._loaded = False  # a state of the stream's own was loaded (a later pass from the start clears it)
        if self.library == "litdata":
            dataset.set_batch_size(batch_size)
            dataset.set_num_workers(num_workers)

    def __iter__(self) -> Iterator[Any]:
        """A generator, never the stream's own iterator: a ``StatefulDataLoader`` would call that
        iterator's ``state_dict()`` (litdata's returns itself, whose ``state_dict`` needs arguments)."""
        info = get_worker_info()
        items = iter(self.dataset)
        if info is not None and self.split_workers:
            items = itertools.islice(items, info.id, None, info.num_workers)
        yield from items

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
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        elif stream_library(self.dataset) == "streaming":
            self.dataset.next_epoch = epoch

    def start(self, batches: int) -> tuple[int, bool]:
        """Before a pass's reader starts: position the stream after as many of this process's first
        ``batches`` batches of the epoch as it can through its own state (litdata's and streaming's
        ``state_dict`` with the arguments they need), and clear a state loaded before where the pass
        starts from the beginning.  Returns (the batches the stream starts after by itself, the rest
        the pass reads past; whether its state changed: workers started before do not have it).
        The first call gives :attr:`notice`, if any."""
        if self.notice is not None:
            notice, self.notice = self.notice, None
            warnings.warn(notice, UserWarning, stacklevel=2)
        if self.library == "streaming":
            self.dataset.next_epoch = self.epoch  # streaming counts its passes: a pass cut short moved it on
        if self.library is None or (batches == 0 and not self._loaded):
            return 0, False
        place = self._place(batches)
        dataset, batch_size = self.dataset, cast(int, self.batch_size)
        if self.library == "litdata":
            if place:
                dataset.load_state_dict(dataset.state_dict(place * batch_size, self.num_workers, batch_size))
            else:
                dataset.reset_state_dict()
        else:
            state = dict(
                dataset.state_dict(num_samples=0, from_beginning=True),
                epoch=self.epoch,
                sample_in_epoch=place * batch_size * self.num_processes,  # streaming counts every rank's samples
            )
            if world_size() > 1:  # the processes of a node share one resume block: all read it before any writes
                with waiting_for("every process to read the stream's shared resume block"):
                    dist.barrier()
            dataset.load_state_dict(state)
        self._loaded = place > 0
        return place, True

    def _place(self, batches: int) -> int:
        """The most of the first ``batches`` batches the library's own resume reproduces: only full
        batches before any worker's last one, where every rank holds as many samples (the library
        then shares them alike among each rank's workers, so this holds on every process; nothing
        otherwise); for litdata, whole turns of the DataLoader's workers (a plain DataLoader's next
        pass starts with worker 0).  Streaming needs its ``batch_size``."""
        n, batch_size = sized_length(self.dataset), cast(int, self.batch_size)
        if n is None or not self.equal_parts:
            return 0
        if self.library == "streaming" and getattr(self.dataset, "batch_size", None) != batch_size:
            return 0
        workers = max(self.num_workers, 1)
        place = min(batches, max(n // batch_size - workers, 0))
        return place - place % workers if self.library == "litdata" else place


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


def shard(
    dataset: Any, layout: ShardLayout, num_workers: int, batch_size: int | None, drop_last: bool, kind: ShardingKind
) -> Shard:
    """This process's part of a stream already split by node (``kind``: what the planner read of it), its
    plan and the DataLoader's batch size (a collective when several processes run: they exchange their
    parts' batch and sample counts, ``None`` where unknown)."""
    split = cast(NodeSplit, kind.split)  # a stream of this kind is split by node
    check_node_split(split, layout)
    part = NodePart(
        dataset,
        split_workers=num_workers > 0 and not kind.splits_by_worker,
        batch_size=layout.process_batch_size,
        num_processes=layout.num_processes,
        num_workers=num_workers,
        library=kind.library,
    )
    own = _batches(part, layout.process_batch_size, drop_last, num_workers)
    mine = (own, sized_length(dataset))  # (batches, samples) of this part, None where unknown
    counts = "the batch and sample counts of every process's part of the stream"
    parts = all_gather_objects(mine, what=counts) if world_size() == layout.num_processes > 1 else [mine]
    known = _all_known([batches for batches, _ in parts], layout.num_processes)
    samples = _all_known([n for _, n in parts], layout.num_processes)
    part.equal_parts = samples is not None and len(set(samples)) == 1
    if layout.process_index == 0:
        part.notice = tail_notice(dataset, samples, kind.library)
    logger.info(
        "the stream is already split by node (%s): process %d reads its part as it is (%s batches; step counts %s)",
        split.how,
        layout.process_index,
        "unknown" if own is None else own,
        "from the parts' lengths" if known is not None else "agreed while reading",
    )
    plan = NativeStreamPlan(layout, known, agree=all_reduce_int_async, start=part.start)
    loader_batch_size = layout.process_batch_size if batch_size is not None else None
    return Shard(part, plan, {"batch_size": loader_batch_size, "drop_last": drop_last})


def _all_known(values: list[int | None], num_processes: int) -> list[int] | None:
    """``values`` of every process, when each is known (``None`` otherwise)."""
    found = [v for v in values if v is not None]
    return found if len(found) == num_processes else None


def tail_notice(dataset: Any, parts: list[int] | None, library: str | None = _UNREAD) -> str | None:
    """What a litdata or streaming ``StreamingDataset`` does to the epoch by itself, where it drops
    or repeats samples so that its ranks read as many (``None`` where it reads each sample once):
    counted from its ranks' ``parts`` (their ``len()``, ``None`` when not every one is known) and
    the samples its epoch is drawn from, with the fix where there is one.

    Example (streaming's ``len()`` of 32 on each of 2 ranks, for an epoch of 63 samples)::

        part 0: 32 samples, part 1: 32 samples -> "... repeats 1 of its 63 samples ..."
    """
    if library is _UNREAD:  # not told (see ShardingKind.library): read it here
        library = stream_library(dataset)
    if library is None or (library == "litdata" and getattr(dataset, "drop_last", None) is False):
        return None  # not a library's stream, or litdata told to keep every sample
    total = library_epoch_samples(dataset, library)
    fix = (
        "; pass drop_last=False to litdata's StreamingDataset to read every sample (shardplug then evens the steps, "
        "the padding marked)"
        if library == "litdata"
        else "; they are real samples to shardplug, not padding (metrics gathered over the epoch count them twice)"
    )
    how = "it forces drop_last=True when distributed" if library == "litdata" else "it evens out its ranks"
    if total is None or parts is None:
        verb = "may drop" if library == "litdata" else "may repeat"
        return f"{library}'s StreamingDataset {verb} samples every epoch so that its ranks read as many ({how}){fix}"
    extra = sum(parts) - total
    if extra == 0:
        return None
    verb = "drops" if extra < 0 else "repeats"
    return (
        f"{library}'s StreamingDataset {verb} {abs(extra)} of its {total} samples every epoch, so that its "
        f"{len(parts)} ranks read as many ({how}: {', '.join(map(str, parts))} samples per rank){fix}"
    )


def library_epoch_samples(dataset: Any, library: str | None) -> int | None:
    """The samples an epoch of a litdata or streaming ``StreamingDataset`` (``library``) is drawn from, over all
    its ranks (their public attributes: litdata's ``region_of_interest``, the sample range it reads
    of each chunk; streaming's ``epoch_size``), ``None`` for any other stream or where not found.
    Its ranks' parts (their ``len()``) hold fewer where the library drops samples, more where it repeats."""
    if library == "litdata":
        region = getattr(dataset, "region_of_interest", None)
        try:
            return sum(int(end) - int(start) for start, end in region) if region else None
        except (TypeError, ValueError):
            return None
    if library == "streaming":
        try:
            return operator.index(getattr(dataset, "epoch_size", None))  # type: ignore[arg-type]
        except TypeError:
            return None
    return None


def _batches(part: NodePart, batch_size: int | None, drop_last: bool, num_workers: int) -> int | None:
    """Batches a DataLoader with ``num_workers`` workers yields over ``part``, when known without
    reading it (each worker makes its own last batch, so the workers' parts are counted)."""
    if num_workers == 0:
        return loader_length(part.dataset, batch_size, drop_last)
    lengths = part.worker_lengths(num_workers)
    return None if lengths is None else worker_batches(lengths, batch_size, drop_last)
