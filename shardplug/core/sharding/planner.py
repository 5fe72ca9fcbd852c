"""``prepare_data_loader`` and ``skip_first_batches``: from a user's ``DataLoader`` to a per-process one.

``prepare_data_loader`` is a planner: it reads its options (from a :class:`ShardplugConfig`, or
from keywords), builds the :class:`ShardLayout` once, decides the kind of sharding once, and
builds one plan, which it hands to the shard it builds (``map_shards.py`` for map-style data,
``native.py`` or :class:`IterableDatasetShard` for streams, the dispatcher's options) and to the
loader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import require_group
from shardplug.core._internal.topology import ProcessTopology, Readers, resolve_data_topology
from shardplug.core.config import ShardplugConfig
from shardplug.core.dispatch.dispatcher import DataLoaderDispatcher, DispatchOptions, check_slice_fn
from shardplug.core.loader.prepared import DataLoaderShard, PreparedDataLoader, combined_class
from shardplug.core.resume.stateful import stateful_dataloader_class
from shardplug.core.sharding.fingerprint import FirstBatchCheck
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.local import LocalPlan
from shardplug.core.sharding.map_style import MapOptions, is_batch_sampler, shard_map_style
from shardplug.core.sharding.native import loader_length, native_shard
from shardplug.core.sharding.presplit import node_part
from shardplug.core.sharding.read_all import IterableDatasetShard
from shardplug.core.sharding.shard_plan import ShardPlan, sized_length
from shardplug.core.sharding.stream_traits import check_stream, check_worker_split, node_split
from shardplug.core.shuffle.rng import check_rng_types
from shardplug.core.shuffle.seedable import check_seed, check_shuffle_algorithm

__all__ = ["prepare_data_loader", "skip_first_batches"]

logger = logging.getLogger(__name__)


class _DataOptions(NamedTuple):
    """The data options of one ``prepare_data_loader`` call (the fields of :class:`ShardplugConfig`
    that ``prepare_data_loader`` reads), from its keywords or from its ``config``."""

    split_batches: bool
    put_on_device: bool
    rng_types: Iterable[str] | None
    dispatch_batches: bool | None
    even_batches: bool
    slice_fn_for_dispatch: Callable[..., Any] | None
    use_seedable_sampler: bool
    data_seed: int | None
    non_blocking: bool
    use_stateful_dataloader: bool
    shuffle_algorithm: str

    @classmethod
    def resolve(cls, config: ShardplugConfig | None, **keywords: Any) -> _DataOptions:
        """The keywords, or with ``config`` the config's values; a keyword that was given (it is not
        the default) and disagrees with ``config`` is a ``TypeError`` naming both and the fix."""
        if config is None:
            return cls(**keywords)
        if not isinstance(config, ShardplugConfig):
            raise TypeError(f"config={config!r} is invalid: pass a ShardplugConfig, or None to use the keywords")
        clashes = [
            name
            for name, value in keywords.items()
            if not _same(value, getattr(ShardplugConfig, name)) and not _same(value, getattr(config, name))
        ]
        if clashes:
            given = ", ".join(f"{name}={keywords[name]!r}" for name in clashes)
            says = ", ".join(f"{name}={getattr(config, name)!r}" for name in clashes)
            raise TypeError(
                f"prepare_data_loader got config= and {given}, and the config says {says}; pass the options one way: "
                f"config=config.replace({given}), or the keywords without config="
            )
        return cls(**{name: getattr(config, name) for name in cls._fields})


def _same(a: Any, b: Any) -> bool:
    """Whether two option values agree (``rng_types`` as any sequence of the same names)."""
    if a is b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return tuple(a) == tuple(b)
    return type(a) is type(b) and a == b


def _loader_settings(loader: DataLoader[Any]) -> dict[str, Any]:
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
    loader: DataLoader[Any], cls: type, dataset: Any, loader_kwargs: dict[str, Any], stateful: bool
) -> DataLoaderShard:
    """A ``cls`` that is also the user's ``DataLoader`` subclass, with the user's extra attributes."""
    user_cls: type = type(loader)
    if issubclass(user_cls, PreparedDataLoader):
        user_cls = next(c for c in user_cls.__mro__ if not issubclass(c, PreparedDataLoader))
    bases: list[type] = [cls, user_cls]
    if stateful:
        bases.append(stateful_dataloader_class())
    new_cls = combined_class(*bases)
    new = cast(DataLoaderShard, object.__new__(new_cls))  # cls: DataLoaderShard or a subclass
    stateful_base = stateful_dataloader_class() if stateful or _subclasses_stateful(user_cls) else None
    init = stateful_base.__init__ if stateful_base is not None else DataLoader.__init__
    init(new, dataset, **loader_kwargs)
    for key, value in vars(loader).items():
        if key not in vars(new) and not compat.is_dataloader_internal(key):
            new.__dict__[key] = value
    return new


def _subclasses_stateful(cls: type) -> bool:
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata") for c in cls.__mro__)


def prepare_data_loader(
    dataloader: DataLoader[Any],
    device: str | torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = ShardplugConfig.split_batches,
    put_on_device: bool = ShardplugConfig.put_on_device,
    rng_types: Iterable[str] | None = ShardplugConfig.rng_types,
    dispatch_batches: bool | None = ShardplugConfig.dispatch_batches,
    even_batches: bool = ShardplugConfig.even_batches,
    slice_fn_for_dispatch: Callable[..., Any] | None = ShardplugConfig.slice_fn_for_dispatch,
    use_seedable_sampler: bool = ShardplugConfig.use_seedable_sampler,
    data_seed: int | None = ShardplugConfig.data_seed,
    non_blocking: bool = ShardplugConfig.non_blocking,
    use_stateful_dataloader: bool = ShardplugConfig.use_stateful_dataloader,
    torch_device_mesh: Any = None,
    shuffle_algorithm: str = ShardplugConfig.shuffle_algorithm,
    config: ShardplugConfig | None = None,
) -> PreparedDataLoader:
    """Return this process's loader for ``dataloader``, keeping all its settings and its class.

    Map-style data gets a :class:`BatchSamplerShard`; iterable data an
    :class:`IterableDatasetShard`, or with ``dispatch_batches`` a :class:`DataLoaderDispatcher`
    in which only process 0 reads.  Torch's own ``RandomSampler`` without a generator is replaced by
    a :class:`SeedableRandomSampler` whose seed process 0 chooses, so every process shuffles alike
    (a sampler of the user's own keeps its order, with a generator agreed from process 0).
    ``shuffle_algorithm="bijective"`` replaces it with a :class:`BijectiveRandomSampler` instead:
    no permutation in memory, each process computes only its own rows (for very large datasets).
    The layout (:class:`ShardLayout`) is validated once, here, and the loader is built with its
    plan (``plan/``) in the same call.

    ``config``: a :class:`ShardplugConfig` whose data options replace the keywords (the run's
    ``device``, ``num_processes``, ``process_index`` and ``torch_device_mesh`` stay arguments); a
    keyword that disagrees with it is a ``TypeError`` (apply overrides with ``config.replace(...)``).

    Example::

        loader = prepare_data_loader(DataLoader(dataset, batch_size=16, shuffle=True))
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
        loader = prepare_data_loader(DataLoader(dataset, batch_size=16), config=ShardplugConfig(split_batches=True))
    """
    options = _DataOptions.resolve(
        config,
        split_batches=split_batches,
        put_on_device=put_on_device,
        rng_types=rng_types,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        slice_fn_for_dispatch=slice_fn_for_dispatch,
        use_seedable_sampler=use_seedable_sampler,
        data_seed=data_seed,
        non_blocking=non_blocking,
        use_stateful_dataloader=use_stateful_dataloader,
        shuffle_algorithm=shuffle_algorithm,
    )
    rng = _check_arguments(dataloader, options)
    num_processes, process_index = resolve_data_topology(num_processes, process_index, torch_device_mesh)
    iterable = isinstance(dataloader.dataset, IterableDataset)  # the kind of sharding: decided here, once
    layout = _layout(dataloader, num_processes, process_index, options)
    dispatch = _dispatches(iterable, options, dataloader.dataset if iterable and num_processes > 1 else None)
    kwargs = _loader_settings(dataloader)
    dataset, generator = dataloader.dataset, None
    if iterable:
        dataset, plan = _plan_stream(dataloader, layout, dispatch, kwargs, Readers.of(num_processes, torch_device_mesh))
    else:  # map-style: a dispatcher's process 0 reads every batch
        shard = shard_map_style(
            dataloader,
            layout.reader() if dispatch else layout,
            MapOptions(options.shuffle_algorithm, options.use_seedable_sampler, options.data_seed),
        )
        if shard.agreement is not None and not dispatch:  # a dispatcher's order is process 0's alone
            require_group(num_processes, process_index, *shard.agreement)
        kwargs.update(shard.loader_kwargs)
        plan, generator = shard.plan, shard.synchronized_generator
    if generator is None and "generator" in rng and dataloader.generator is not None:
        generator = dataloader.generator
    finish: dict[str, Any] = {}
    if dispatch:
        finish["dispatch"] = DispatchOptions.from_layout(layout, options.slice_fn_for_dispatch, torch_device_mesh)
    new = _rebuild(
        dataloader,
        DataLoaderDispatcher if dispatch else DataLoaderShard,
        dataset,
        kwargs,
        options.use_stateful_dataloader,
    )
    new.finish_init(_batch_device(device, options), rng, generator, 0, options.non_blocking, plan=plan, **finish)
    if dataloader.batch_size is None and dataloader.batch_sampler is not None:
        _report_like_torch(new)
    sharded_map_data = not iterable and not dispatch and num_processes > 1  # every process reads its part
    new.agree_at_prepare((sized_length(dataset), layout.batch_size) if sharded_map_data else None)
    logger.debug(
        "prepared %s for process %d of %d (split_batches=%s, even_batches=%s, dispatch=%s)",
        type(dataloader).__name__,
        process_index,
        num_processes,
        layout.split_batches,
        layout.even_batches,
        dispatch,
    )
    return new


def _report_like_torch(loader: DataLoader[Any]) -> None:
    """What torch's ``DataLoader`` reports when it was built with a ``batch_sampler=``: ``batch_size``
    ``None`` and ``drop_last`` ``False`` (the batch sampler decides both; the layout keeps its values).

    Example: ``prepare_data_loader(DataLoader(data, batch_sampler=bs)).batch_size is None``."""
    object.__setattr__(loader, "batch_size", None)  # DataLoader forbids setting them after __init__
    object.__setattr__(loader, "drop_last", False)


def _check_arguments(dataloader: DataLoader[Any], options: _DataOptions) -> tuple[str, ...]:
    """Refuse what cannot be prepared (each error names the argument and the fix); the RNG names."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    rng = check_rng_types(options.rng_types)
    check_slice_fn(options.slice_fn_for_dispatch)
    check_seed("data_seed", options.data_seed)
    check_shuffle_algorithm(options.shuffle_algorithm)
    if isinstance(dataloader.dataset, IterableDataset) and options.shuffle_algorithm != "randperm":
        raise ValueError(
            f"shuffle_algorithm={options.shuffle_algorithm!r} shuffles the indices of map-style data, but this "
            "DataLoader reads an iterable dataset (its order is the stream's); pass shuffle_algorithm='randperm'"
        )
    if options.use_stateful_dataloader:
        stateful_dataloader_class()
    return rng


def _dispatches(iterable: bool, options: _DataOptions, stream: Any = None) -> bool:
    """Whether process 0 reads and sends each process its rows (``None``: for streams put on device,
    except a ``stream`` already split by node: every process reads its own part)."""
    dispatch = options.dispatch_batches
    split = node_split(stream) if stream is not None else None
    if dispatch and split is not None:
        raise ValueError(
            f"dispatch_batches=True has process 0 read the stream for every process, but this stream is already "
            f"split by node ({split.how}): process 0 holds only its own part; pass dispatch_batches=False (each "
            "process reads its part), or dispatch the stream before it is split"
        )
    if dispatch is None:
        dispatch = iterable and options.put_on_device and split is None
    if dispatch and not options.put_on_device:
        raise ValueError(
            "dispatch_batches=True sends each process its rows, which needs put_on_device=True; "
            "pass put_on_device=True, or dispatch_batches=False"
        )
    return bool(dispatch)


def _layout(dataloader: DataLoader[Any], num_processes: int, process_index: int, options: _DataOptions) -> ShardLayout:
    """The one layout of this loader: its global batch size and ``drop_last`` (the batch sampler's,
    also one passed as ``sampler=``), the topology and the options."""
    batch_size = dataloader.batch_size
    if batch_size is None and dataloader.batch_sampler is not None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None and is_batch_sampler(dataloader.sampler):
        batch_size = getattr(dataloader.sampler, "batch_size", None)
    source = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    drop_last = bool(dataloader.drop_last or getattr(source, "drop_last", False))
    return ShardLayout.for_batches(
        batch_size, num_processes, process_index, options.split_batches, options.even_batches, drop_last
    )


def _batch_device(device: str | torch.device | None, options: _DataOptions) -> str | torch.device | None:
    """Where batches go: ``device`` (default: the process's) with ``put_on_device``, else nowhere."""
    if not options.put_on_device:
        return None
    return device if device is not None else ProcessTopology.current().device


def _plan_stream(
    dataloader: DataLoader[Any], layout: ShardLayout, dispatch: bool, kwargs: dict[str, Any], readers: Readers
) -> tuple[Any, ShardPlan]:
    """(the dataset this process's DataLoader reads, its plan) for a stream; ``kwargs`` get the
    DataLoader's batch size (per process when the stream is sharded) and ``drop_last``.  ``readers``:
    the ranks that read it, which must all see the same stream (they are compared)."""
    dataset, batch_size, drop_last = dataloader.dataset, dataloader.batch_size, dataloader.drop_last
    kwargs.update(batch_size=batch_size, drop_last=drop_last)
    if dispatch or layout.num_processes == 1:  # one process reads the stream as it is
        length = loader_length(dataset, batch_size, drop_last)
        if dispatch or readers.size == 1:
            return dataset, LocalPlan(layout.reader() if dispatch else layout, length)
        # the ranks of a device mesh's one data index each read it whole: alike, or refused
        check_stream(dataset, 1, 0, readers)
        check = FirstBatchCheck(replicas=True) if readers.group is None else None  # compared over the group
        return dataset, LocalPlan(layout, length, first_batch=check)
    check_stream(dataset, layout.num_processes, layout.process_index, readers)
    check_worker_split(dataset, dataloader.num_workers)
    split = node_split(dataset)
    if split is not None:  # the stream reads only this process's part by itself
        kwargs["batch_size"] = layout.process_batch_size if batch_size is not None else None
        return node_part(dataset, split, layout, dataloader.num_workers, drop_last)
    native = native_shard(dataset, layout, dataloader.num_workers, drop_last)
    if native is not None:
        kwargs["batch_size"] = layout.process_batch_size
        return native
    shard = IterableDatasetShard.from_layout(dataset, layout)
    kwargs["batch_size"] = shard.process_slice_size if batch_size is not None else None
    return shard, shard.plan


def skip_first_batches(dataloader: DataLoader[Any], num_batches: int = 0) -> PreparedDataLoader:
    """A loader of the same kind and settings that starts after its first ``num_batches`` batches.

    The skip applies to the next pass only and keeps the epoch counter; skipped map-style batches
    are never loaded (only their indices are computed), except with ``use_stateful_dataloader=True``:
    they are read through the ``StatefulDataLoader``, so that its own saved state counts them.
    """
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader.skipped_copy(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    new = prepare_data_loader(dataloader, num_processes=1, process_index=0)
    new.resume.pending.skip = num_batches
    return new
