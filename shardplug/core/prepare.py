"""``prepare_data_loader`` and ``skip_first_batches``: from a user's ``DataLoader`` to a per-process one."""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from .dispatch import DataLoaderDispatcher, DispatchOptions, check_slice_fn
from .iterable import IterableDatasetShard
from .layout import ShardLayout
from .loaders import DataLoaderShard, PreparedDataLoader, combined_class, stateful_dataloader_class
from .collectives import all_reduce_int_async, world_size
from .native import ProcessPart, can_shard, process_part
from .plan import LocalPlan, NativeStreamPlan, ShardPlan, sized_length
from .rng import check_rng_types
from .samplers import BatchSamplerShard, IndexSamplerShard
from .streams import asks_for_its_worker, declared_worker_split, node_split, shuffle_fingerprint, single_node_only
from .shuffle import BijectiveRandomSampler, SeedableRandomSampler, check_seed, check_shuffle_algorithm, draw_seed
from .topology import ProcessTopology, resolve_data_topology

__all__ = ["prepare_data_loader", "skip_first_batches"]

logger = logging.getLogger(__name__)


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    """Every ``DataLoader`` setting that does not describe which indices are read."""
    settings = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):
        settings["in_order"] = loader.in_order
    return settings


def _rebuild(
    loader: DataLoader, cls: type, dataset: Any, loader_kwargs: dict[str, Any], stateful: bool
) -> PreparedDataLoader:
    """A ``cls`` that is also the user's ``DataLoader`` subclass, with the user's extra attributes."""
    user_cls = type(loader)
    if issubclass(user_cls, PreparedDataLoader):
        user_cls = next(c for c in user_cls.__mro__ if not issubclass(c, PreparedDataLoader))
    bases: list[type] = [cls, user_cls]
    if stateful:
        bases.append(stateful_dataloader_class())
    new_cls = combined_class(*bases)
    new = object.__new__(new_cls)
    stateful_base = stateful_dataloader_class() if stateful or _subclasses_stateful(user_cls) else None
    init = stateful_base.__init__ if stateful_base is not None else DataLoader.__init__
    init(new, dataset, **loader_kwargs)
    for key, value in vars(loader).items():
        if key not in vars(new) and not key.startswith("_DataLoader__") and key != "_iterator":
            new.__dict__[key] = value
    return new


def _subclasses_stateful(cls: type) -> bool:
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata") for c in cls.__mro__)


def _bijective_sampler(sampler: Any, data_seed: Optional[int]) -> BijectiveRandomSampler:
    """The :class:`BijectiveRandomSampler` that replaces a shuffling ``RandomSampler``."""
    if isinstance(sampler, BijectiveRandomSampler):
        return sampler
    if not isinstance(sampler, RandomSampler) or sampler.replacement or sampler._num_samples is not None:
        raise ValueError(
            f"shuffle_algorithm='bijective' needs a shuffled DataLoader (shuffle=True: a RandomSampler without "
            f"replacement or num_samples), but its sampler is {type(sampler).__name__}; pass shuffle=True, or "
            "shuffle_algorithm='randperm'"
        )
    if data_seed is None and isinstance(sampler, SeedableRandomSampler):
        data_seed = sampler.seed
    return BijectiveRandomSampler(sampler.data_source, data_seed=data_seed, generator=sampler.generator)


def _shuffle_sampler(sampler: Any, use_seedable_sampler: bool, data_seed: Optional[int]) -> tuple[Any, Optional[torch.Generator]]:
    """Replace a shuffling sampler so every process draws the same order.

    Returns ``(sampler, generator to synchronise from process 0)``.  A ``RandomSampler`` without
    generator becomes a :class:`SeedableRandomSampler`; any other sampler that draws its order from
    a ``generator`` attribute (``SubsetRandomSampler``, ``WeightedRandomSampler``, ...) gets a
    generator of its own (seeded with ``data_seed``), synchronised from process 0 at each pass.
    The user's sampler is never modified.
    """
    if isinstance(sampler, DistributedSampler):
        raise ValueError(
            "the DataLoader already uses a DistributedSampler, and prepare_data_loader shards it again; "
            "remove the DistributedSampler (pass shuffle=True or a plain sampler) and let shardplug shard the data"
        )
    if isinstance(sampler, SeedableRandomSampler):
        return sampler, None
    if isinstance(sampler, RandomSampler) and (sampler.generator is None or use_seedable_sampler):
        seedable = SeedableRandomSampler(
            sampler.data_source, replacement=sampler.replacement, num_samples=sampler._num_samples, data_seed=data_seed
        )
        return seedable, None
    if not hasattr(sampler, "generator"):
        return sampler, None
    generator = sampler.generator
    if generator is not None and data_seed is not None:
        _refuse_ignored_seed(sampler, data_seed)
    if generator is None:  # it would draw from each process's global RNG: give it one all processes share
        sampler = copy.copy(sampler)
        sampler.generator = generator = torch.Generator()
        generator.manual_seed(data_seed if data_seed is not None else draw_seed())
    return sampler, generator if isinstance(generator, torch.Generator) else None


def _refuse_ignored_seed(sampler: Any, data_seed: int) -> None:
    """``data_seed`` would not reach ``sampler``: it draws its order from a generator of its own."""
    if isinstance(sampler, RandomSampler):
        fix = ("pass use_seedable_sampler=True to shuffle by data_seed (every epoch a pure function of the seed), or "
               "data_seed=None to keep the generator's order")
    else:
        fix = ("seed that generator yourself (generator.manual_seed(...), the same on every process), or pass "
               "data_seed=None (use_seedable_sampler=True only replaces a RandomSampler)")
    raise ValueError(
        f"data_seed={data_seed} would be ignored: the {type(sampler).__name__} draws its order from its own "
        f"generator (the DataLoader's or the sampler's generator=), which is kept; {fix}"
    )


def _shard_batch_sampler(batch_sampler: Any, sampler: Any, layout: ShardLayout) -> BatchSamplerShard:
    if type(batch_sampler) is BatchSampler:
        batch_sampler = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    elif getattr(batch_sampler, "sampler", None) is not sampler and hasattr(batch_sampler, "sampler"):
        batch_sampler = copy.copy(batch_sampler)  # never modify the user's batch sampler
        batch_sampler.sampler = sampler
    return BatchSamplerShard(
        batch_sampler, layout.num_processes, layout.process_index, layout.split_batches, layout.even_batches
    )


def _is_batch_sampler(sampler: Any) -> bool:
    """A sampler that yields batches of indices (passed as ``sampler=`` with ``batch_size=None``)."""
    return isinstance(sampler, (BatchSampler, BatchSamplerShard)) or hasattr(sampler, "batch_size")


def prepare_data_loader(
    dataloader: DataLoader,
    device: Union[str, torch.device, None] = None,
    num_processes: Optional[int] = None,
    process_index: Optional[int] = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    rng_types: Optional[Iterable[str]] = None,
    dispatch_batches: Optional[bool] = None,
    even_batches: bool = True,
    slice_fn_for_dispatch: Optional[Callable[..., Any]] = None,
    use_seedable_sampler: bool = False,
    data_seed: Optional[int] = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
    torch_device_mesh: Any = None,
    shuffle_algorithm: str = "randperm",
) -> PreparedDataLoader:
    """Return this process's loader for ``dataloader``, keeping all its settings and its class.

    Map-style data gets a :class:`BatchSamplerShard`; iterable data an
    :class:`IterableDatasetShard`, or with ``dispatch_batches`` a :class:`DataLoaderDispatcher`
    in which only process 0 reads.  A shuffling sampler without a generator is replaced by a
    :class:`SeedableRandomSampler` whose seed process 0 chooses, so every process shuffles alike.
    ``shuffle_algorithm="bijective"`` replaces it with a :class:`BijectiveRandomSampler` instead:
    no permutation in memory, each process computes only its own rows (for very large datasets).
    The layout (:class:`ShardLayout`) is validated once, here, and the loader is built with its
    plan (``plan.py``) in the same call.

    Example::

        loader = prepare_data_loader(DataLoader(dataset, batch_size=16, shuffle=True))
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    num_processes, process_index = resolve_data_topology(num_processes, process_index, torch_device_mesh)
    rng = check_rng_types(rng_types)
    check_slice_fn(slice_fn_for_dispatch)
    check_seed("data_seed", data_seed)
    check_shuffle_algorithm(shuffle_algorithm)
    dataset = dataloader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if iterable and shuffle_algorithm != "randperm":
        raise ValueError(
            f"shuffle_algorithm={shuffle_algorithm!r} shuffles the indices of map-style data, but this DataLoader "
            "reads an iterable dataset (its order is the stream's); pass shuffle_algorithm='randperm'"
        )
    if dispatch_batches is None:
        dispatch_batches = iterable and put_on_device
    if dispatch_batches and not put_on_device:
        raise ValueError(
            "dispatch_batches=True sends each process its rows, which needs put_on_device=True; "
            "pass put_on_device=True, or dispatch_batches=False"
        )
    if use_stateful_dataloader:
        stateful_dataloader_class()
    batch_size = dataloader.batch_size
    if batch_size is None and dataloader.batch_sampler is not None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None and _is_batch_sampler(dataloader.sampler):
        batch_size = getattr(dataloader.sampler, "batch_size", None)
    source = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    drop_last = bool(dataloader.drop_last or getattr(source, "drop_last", False))
    layout = ShardLayout.for_batches(batch_size, num_processes, process_index, split_batches, even_batches, drop_last)
    batch_device = (device if device is not None else ProcessTopology.current().device) if put_on_device else None
    kwargs: dict[str, Any] = _loader_settings(dataloader)
    synchronized_generator: Optional[torch.Generator] = None
    plan: Optional[ShardPlan] = None
    cls: type = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    new_dataset = dataset
    if iterable:
        kwargs.update(batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        if not dispatch_batches and num_processes > 1:
            new_dataset, plan, kwargs["batch_size"] = _shard_stream(dataset, dataloader, layout)
        elif not dispatch_batches:  # one process reads the stream as it is
            plan = LocalPlan(layout, _length_of_loader(dataset, dataloader.batch_size, dataloader.drop_last))
    else:
        sampler = _index_sampler(dataloader)
        if shuffle_algorithm == "bijective":
            sampler = _bijective_sampler(sampler, data_seed)
        sampler, synchronized_generator = _shuffle_sampler(sampler, use_seedable_sampler, data_seed)
        shard_layout = ShardLayout(batch_size=batch_size) if dispatch_batches else layout  # process 0 reads all
        if dataloader.batch_sampler is not None:
            kwargs.update(batch_sampler=_shard_batch_sampler(dataloader.batch_sampler, sampler, shard_layout))
        elif _is_batch_sampler(dataloader.sampler):  # a batch sampler passed as ``sampler=``
            kwargs.update(sampler=_shard_batch_sampler(dataloader.sampler, sampler, shard_layout), batch_size=None)
        else:  # DataLoader(batch_size=None): single samples, shared out as batches of one
            shard = IndexSamplerShard(sampler, shard_layout.num_processes, shard_layout.process_index, even_batches)
            kwargs.update(sampler=shard, batch_size=None)
    if synchronized_generator is None and "generator" in rng and dataloader.generator is not None:
        synchronized_generator = dataloader.generator
    finish: dict[str, Any] = {"plan": plan}
    if dispatch_batches:
        finish["dispatch"] = DispatchOptions(
            split_batches, slice_fn_for_dispatch, torch_device_mesh, num_processes, process_index, even_batches
        )
    new = _rebuild(dataloader, cls, new_dataset, kwargs, use_stateful_dataloader)
    new._finish_init(batch_device, rng, synchronized_generator, 0, non_blocking, **finish)
    sharded_map_data = not iterable and not dispatch_batches and num_processes > 1  # every process reads its part
    new.agree_at_prepare((sized_length(dataset), batch_size) if sharded_map_data else None)
    logger.debug(
        "prepared %s for process %d of %d (split_batches=%s, even_batches=%s, dispatch=%s)",
        type(dataloader).__name__, process_index, num_processes, split_batches, even_batches, dispatch_batches,
    )
    return new


def _check_stream(dataset: Any, num_processes: int) -> None:
    """Refuse a stream that is already split by node, or that cannot run on several processes."""
    how = node_split(dataset)
    if how is not None:
        raise ValueError(
            f"this stream is already split by node ({how}), and prepare_data_loader would split it a second time "
            f"over num_processes={num_processes} (losing data, and giving the processes unequal numbers of "
            "batches); pass the stream before that split: shardplug gives each process its part (by shard when "
            "the stream can shard itself), or prepare with num_processes=1"
        )
    fingerprint = shuffle_fingerprint(dataset)
    if fingerprint is not None and world_size() == num_processes > 1:
        fingerprints: list[Any] = [None] * num_processes
        dist.all_gather_object(fingerprints, fingerprint)
        if len(set(fingerprints)) > 1:
            raise ValueError(
                "the stream shuffles differently on each process (a Hugging Face shuffle() without seed draws its "
                "own seed in every process), so the processes' parts would overlap and miss elements; pass "
                "shuffle(seed=...) with the same seed on every process"
            )
    if single_node_only(dataset):
        raise ValueError(
            "this WebDataset keeps webdataset's default nodesplitter=single_node_only, which refuses to run on more "
            "than one process; build it with WebDataset(urls, nodesplitter=None, ...): shardplug gives each "
            "process its part"
        )


def _shard_stream(dataset: Any, dataloader: DataLoader, layout: ShardLayout) -> tuple[Any, ShardPlan, Optional[int]]:
    """(this process's dataset, its plan, the per-process DataLoader batch size) for a stream."""
    _check_stream(dataset, layout.num_processes)
    loader_batch = dataloader.batch_size
    _check_worker_split(dataset, dataloader.num_workers)
    own = _native_part(dataset, layout)
    if own is not None:
        if layout.splits and loader_batch is not None:
            loader_batch //= layout.num_processes
        counts: Optional[list[Optional[int]]] = None
        # the parts' batch counts, when they have len() and shardplug knows what each DataLoader worker reads
        workers, drop_last = dataloader.num_workers, dataloader.drop_last
        if _batches_of_part(own, loader_batch, drop_last, workers) is not None:
            parts = (own if j == layout.process_index else process_part(dataset, layout.num_processes, j)
                     for j in range(layout.num_processes))
            counts = [_batches_of_part(part, loader_batch, drop_last, workers) for part in parts]
        known = None if counts is None or any(count is None for count in counts) else counts
        plan = NativeStreamPlan(layout, known, agree=all_reduce_int_async)
        return own, plan, loader_batch
    shard = IterableDatasetShard(
        dataset,
        batch_size=loader_batch or 1,
        drop_last=dataloader.drop_last,
        num_processes=layout.num_processes,
        process_index=layout.process_index,
        split_batches=layout.split_batches,
        even_batches=layout.even_batches,
    )
    return shard, shard.plan, (shard.process_slice_size if loader_batch is not None else None)


def _batches_of_part(part: Any, batch_size: Optional[int], drop_last: bool, num_workers: int) -> Optional[int]:
    """Batches a DataLoader with ``num_workers`` workers yields over a process's part, when known
    without reading: each worker makes its own last batch, so the parts of the workers are counted
    (known only where shardplug splits the shards across workers: a part that splits itself does not say)."""
    if num_workers == 0:
        return _length_of_loader(part, batch_size, drop_last)
    lengths = part.worker_lengths(num_workers) if isinstance(part, ProcessPart) else None
    if lengths is None:
        return None
    return sum(_count_batches(n, batch_size, drop_last) for n in lengths)


def _count_batches(n: int, batch_size: Optional[int], drop_last: bool) -> int:
    if batch_size is None:
        return n
    return n // batch_size if drop_last else -(-n // batch_size)


def _length_of_loader(dataset: Any, batch_size: Optional[int], drop_last: bool) -> Optional[int]:
    """Batches a DataLoader over ``dataset`` yields, when the dataset is sized."""
    n = sized_length(dataset)
    if n is None:
        return None
    return _count_batches(n, batch_size, drop_last)


def _check_worker_split(dataset: Any, num_workers: int) -> None:
    """Refuse to guess whether a stream of your own splits itself across DataLoader workers where
    the answer matters and is in doubt: it shards itself, or its ``__iter__`` asks for its worker.
    Guessing wrong reads everything twice, or half of it."""
    if num_workers == 0 or declared_worker_split(dataset) is not None:
        return
    if can_shard(dataset):
        why = "shards itself (n_shards, shard())"
    elif asks_for_its_worker(dataset):
        why = "calls torch.utils.data.get_worker_info() in its __iter__"
    else:
        return  # a plain stream: every worker reads all of it, shardplug splits it
    raise ValueError(
        f"{type(dataset).__name__} {why}, and with num_workers={num_workers} shardplug must know whether it splits "
        "itself across DataLoader workers: declare splits_by_worker = True on the class if its __iter__ reads only its "
        "worker's part, or splits_by_worker = False if every worker reads all of it (shardplug then splits it)"
    )


def _native_part(dataset: Any, layout: ShardLayout) -> Optional[Any]:
    """This process's part of a stream that shards itself (:func:`~shardplug.core.native.process_part`),
    or ``None`` when every process must read the whole stream.  A part is read once in all (the
    rows of shards that do not divide among the processes by every process) instead of by every
    process; equal step counts come from the parts' lengths or from an agreement between the
    processes (:class:`~shardplug.core.plan.NativeStreamPlan`)."""
    if not can_shard(dataset):
        return None
    n_shards, n = dataset.n_shards, layout.num_processes
    own = process_part(dataset, n, layout.process_index)
    if own is None:
        why = (f"fewer than num_processes={n}" if n_shards < n else
               f"not a multiple of num_processes={n}, and its parts cannot be joined keeping its own split across "
               "DataLoader workers")
        logger.warning(
            "the stream has n_shards=%s, %s: every process reads the whole stream (%dx the I/O of its part); give it "
            "a number of shards that %d divides to shard it natively", n_shards, why, n, n,
        )
    elif n_shards % n:
        logger.info(
            "the stream has n_shards=%d over %d processes: each process reads %d shards by itself, and its rows of the "
            "last %d (read by every process)", n_shards, n, n_shards // n, n_shards % n,
        )
    return own


def _index_sampler(loader: DataLoader) -> Any:
    """The sampler of single indices under the loader (under its batch sampler when there is one)."""
    if loader.batch_sampler is not None:
        return getattr(loader.batch_sampler, "sampler", loader.sampler)
    return getattr(loader.sampler, "sampler", loader.sampler)


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> PreparedDataLoader:
    """A loader of the same kind and settings that starts after its first ``num_batches`` batches.

    The skip applies to the next pass only and keeps the epoch counter; skipped map-style batches
    are never loaded (only their indices are computed), except with ``use_stateful_dataloader=True``:
    they are read through the ``StatefulDataLoader``, so that its own saved state counts them.
    """
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader._skipped_copy(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    new = prepare_data_loader(dataloader, num_processes=1, process_index=0)
    new._skip_pending = num_batches
    return new
