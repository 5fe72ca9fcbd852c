"""``prepare_data_loader`` and ``skip_first_batches``: from a user's ``DataLoader`` to a per-process one.

``prepare_data_loader`` is a planner: it reads its options (from a :class:`ShardplugConfig`, or
from keywords), builds the :class:`ShardLayout` once, recognises the kind of sharding once
(:func:`kind_of`) and calls that kind's module once (its ``shard()``: ``map_style``, ``distributed_sampler``,
``local``, ``read_all``, ``native`` or ``presplit``), which hands back the dataset, the DataLoader's keywords and
the plan (a :class:`~shardplug.core.sharding.kinds.Shard`); it builds the loader with them.  Dispatch
is one reader and a scatter: process 0's batches are the data's own kind under the layout's
:meth:`~ShardLayout.reader` (map-style, or a stream read as it is), which the dispatcher shares out.

Example (the walk of a stream that shards itself: the planner enters each module once)::

    prepare_data_loader(DataLoader(stream, batch_size=8), dispatch_batches=False)
      -> ShardLayout.for_batches (the layout)       -> kind_of -> stream_kind (stream_traits: "native")
      -> native.shard (its part, its plan)          -> the loader (DataLoaderShard, with the plan)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast, overload

import torch
from torch.utils.data import DataLoader, IterableDataset

from shardplug.core._internal import compat
from shardplug.core._internal.arguments import check_prefetch_depth
from shardplug.core._internal.topology import ProcessTopology, Readers, resolve_data_topology
from shardplug.core.config import ShardplugConfig
from shardplug.core.dispatch.dispatcher import DataLoaderDispatcher, DispatchOptions, check_slice_fn
from shardplug.core.graphs.prepared_graphs import MixtureLoaderShard, prepare_graph
from shardplug.core.graphs.reading import GraphLike, is_graph
from shardplug.core.loader.prepared import DataLoaderShard, LoaderOptions, PreparedDataLoader, combined_class
from shardplug.core.resume.stateful import stateful_dataloader_class
from shardplug.core.sharding import (
    distributed_sampler,
    local,
    map_style,
    mixture,
    native,
    presplit,
    read_all,
    token_budget,
)
from shardplug.core.sharding.kinds import (
    DISPATCH,
    DISTRIBUTED_SAMPLER,
    LOCAL,
    MAP_STYLE,
    MIXTURE,
    NATIVE,
    PRESPLIT,
    TOKEN_BUDGET,
    Shard,
    ShardingKind,
)
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.stream_traits import stream_kind
from shardplug.core.shuffle.rng import check_rng_types
from shardplug.core.shuffle.seedable import check_seed, check_shuffle_algorithm

__all__ = ["prepare_data_loader", "skip_first_batches", "can_prepare"]

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
    prefetch_depth: int | None

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
    loader: DataLoader[Any],
    cls: type,
    dataset: Any,
    loader_kwargs: dict[str, Any],
    stateful: bool,
    options: LoaderOptions,
) -> PreparedDataLoader:
    """A ``cls`` that is also the user's ``DataLoader`` subclass, with the user's extra attributes, built in one
    call (:meth:`~shardplug.core.loader.prepared.PreparedDataLoader.assemble`): the ``DataLoader``'s own
    ``__init__`` (or the ``StatefulDataLoader``'s) with ``loader_kwargs``, then shardplug's ``options``."""
    user_cls: type = type(loader)
    if issubclass(user_cls, PreparedDataLoader):
        user_cls = next(c for c in user_cls.__mro__ if not issubclass(c, PreparedDataLoader))
    bases: list[type] = [cls, user_cls]
    if stateful:
        bases.append(stateful_dataloader_class())
    new_cls = cast("type[PreparedDataLoader]", combined_class(*bases))
    stateful_base = stateful_dataloader_class() if stateful or _subclasses_stateful(user_cls) else None
    init = stateful_base.__init__ if stateful_base is not None else DataLoader.__init__
    extras = {k: v for k, v in vars(loader).items() if not compat.is_dataloader_internal(k)}
    new = new_cls.assemble(init, dataset, loader_kwargs, options)
    for key, value in extras.items():
        if key not in vars(new):
            new.__dict__[key] = value
    return new


def _subclasses_stateful(cls: type) -> bool:
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata") for c in cls.__mro__)


@overload
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
    prefetch_depth: int | None = ShardplugConfig.prefetch_depth,
) -> PreparedDataLoader: ...


@overload
def prepare_data_loader(
    dataloader: GraphLike,
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
    prefetch_depth: int | None = ShardplugConfig.prefetch_depth,
) -> PreparedDataLoader | MixtureLoaderShard: ...


def prepare_data_loader(
    dataloader: DataLoader[Any] | object,
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
    prefetch_depth: int | None = ShardplugConfig.prefetch_depth,
) -> PreparedDataLoader | MixtureLoaderShard:
    """Return this process's loader for ``dataloader``, keeping all its settings and its class.

    Map-style data gets a :class:`BatchSamplerShard`; iterable data an
    :class:`IterableDatasetShard`, or with ``dispatch_batches`` a :class:`DataLoaderDispatcher`
    in which only process 0 reads.  Torch's own ``RandomSampler`` without a generator is replaced by
    a :class:`SeedableRandomSampler` whose seed process 0 chooses, so every process shuffles alike
    (a sampler of the user's own keeps its order, with a generator agreed from process 0).
    ``shuffle_algorithm="bijective"`` replaces it with a :class:`BijectiveRandomSampler` instead:
    no permutation in memory, each process computes only its own rows (for very large datasets).
    The layout (:class:`ShardLayout`) is validated once, here, and the loader is built with its
    plan (from the kind's module in ``sharding/``) in the same call.

    ``config``: a :class:`ShardplugConfig` whose data options replace the keywords (the run's
    ``device``, ``num_processes``, ``process_index`` and ``torch_device_mesh`` stay arguments); a
    keyword that disagrees with it is a ``TypeError`` (apply overrides with ``config.replace(...)``).

    ``prefetch_depth``: batches read ahead of the one handed out; on a CUDA device their copy runs on a side
    stream while the step computes (``None``, the default, and ``0``: off; prefetching is opt-in). What the
    loader tells (``len()``, ``end_of_dataloader``, padding, ``state_dict()``) counts the batches handed out,
    never those read ahead. Dispatching loaders do not read ahead.

    Example::

        loader = prepare_data_loader(DataLoader(dataset, batch_size=16, shuffle=True))
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                ...
        loader = prepare_data_loader(DataLoader(dataset, batch_size=16), config=ShardplugConfig(split_batches=True))

    A ``torchdata.nodes`` graph (a ``Loader`` or a ``BaseNode``) is prepared too: its map-style rows by the same
    rule as a ``DataLoader``'s, its work rebuilt on this process's part (see ``docs/nodes.md``).
    """
    if is_graph(dataloader):
        arguments = dict(locals())
        return prepare_graph(arguments.pop("dataloader"), prepare_data_loader, arguments)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be {_PREPARABLE}, got {type(dataloader).__name__}")
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
        prefetch_depth=check_prefetch_depth(prefetch_depth),
    )
    dataloader = _unwrapped(dataloader, options)
    rng = _check_arguments(dataloader, options)
    num_processes, process_index = resolve_data_topology(num_processes, process_index, torch_device_mesh)
    layout = _layout(dataloader, num_processes, process_index, options)
    readers = Readers.of(num_processes, torch_device_mesh)
    kind = kind_of(dataloader, options, layout, readers)  # the kind of sharding: decided here, once
    dispatch = kind.name == DISPATCH
    shard = _shard(dataloader, kind, _reading_layout(kind, layout), options, readers)
    kwargs = _loader_settings(dataloader)
    kwargs.update(shard.loader_kwargs)
    generator = shard.synchronized_generator
    if generator is None and "generator" in rng and dataloader.generator is not None:
        generator = dataloader.generator
    loader_options = LoaderOptions(
        device=_batch_device(device, options),
        rng_types=rng,
        synchronized_generator=generator,
        non_blocking=options.non_blocking,
        plan=shard.plan,
        prefetch_depth=_prefetch_depth(options, dispatch),
    )
    if dispatch:
        loader_options = DispatchOptions.from_layout(
            layout, loader_options, options.slice_fn_for_dispatch, torch_device_mesh
        )
    new = _rebuild(
        dataloader,
        DataLoaderDispatcher if dispatch else DataLoaderShard,
        shard.dataset,
        kwargs,
        options.use_stateful_dataloader,
        loader_options,
    )
    if dataloader.batch_size is None and dataloader.batch_sampler is not None:
        _report_like_torch(new)
    new.agree_at_prepare(shard.prepare_check)
    logger.debug(
        "prepared %s for process %d of %d (split_batches=%s, even_batches=%s, kind=%s)",
        type(dataloader).__name__,
        process_index,
        num_processes,
        layout.split_batches,
        layout.even_batches,
        kind.name,
    )
    return new


def kind_of(dataloader: DataLoader[Any], options: _DataOptions, layout: ShardLayout, readers: Readers) -> ShardingKind:
    """The kind of sharding of ``dataloader`` under ``layout`` (see :mod:`~shardplug.core.sharding.kinds`):
    map-style data, unless dispatched; a stream in one look at it
    (:func:`~shardplug.core.sharding.stream_traits.stream_kind`, with its checks).  Dispatch needs
    ``put_on_device``: a ``ValueError`` otherwise."""
    if isinstance(dataloader.dataset, IterableDataset):
        kind = stream_kind(
            dataloader.dataset,
            options.dispatch_batches,
            options.put_on_device,
            layout,
            dataloader.num_workers,
            readers,
        )
    elif isinstance(dataloader.dataset, mixture.Mixture):  # its own order (a sampler of the user's is refused there)
        kind = ShardingKind(DISPATCH, reads=MIXTURE) if options.dispatch_batches else ShardingKind(MIXTURE)
    elif isinstance(dataloader.batch_sampler, token_budget.TokenBudgetBatchSampler):
        if options.dispatch_batches and options.slice_fn_for_dispatch is not None:
            raise ValueError(
                f"slice_fn_for_dispatch={options.slice_fn_for_dispatch!r} cuts a step's joined rows into every "
                "process's part, but with a TokenBudgetBatchSampler each process receives its own micro-batch of "
                "the plan whole, never a cut; pass slice_fn_for_dispatch=None, or dispatch_batches=False"
            )
        # dispatched: process 0 reads every process's micro-batches of the plan, each process receives its own
        kind = ShardingKind(DISPATCH, reads=TOKEN_BUDGET) if options.dispatch_batches else ShardingKind(TOKEN_BUDGET)
    elif distributed_sampler.is_distributed_sampler(map_style.index_sampler(dataloader)):
        if options.dispatch_batches:
            raise ValueError(
                "dispatch_batches=True has process 0 read every process's rows, but the DataLoader's "
                "DistributedSampler already gives each process its own; pass dispatch_batches=False (the "
                "DistributedSampler is then adopted: the batches of native DDP), or remove the DistributedSampler"
            )
        kind = ShardingKind(DISTRIBUTED_SAMPLER)  # a user's DistributedSampler: adopted, as native DDP reads it
    else:
        kind = ShardingKind(DISPATCH, reads=MAP_STYLE) if options.dispatch_batches else ShardingKind(MAP_STYLE)
    if kind.name == DISPATCH and not options.put_on_device:
        raise ValueError(
            "dispatch_batches=True sends each process its rows, which needs put_on_device=True; "
            "pass put_on_device=True, or dispatch_batches=False"
        )
    return kind


def _reading_layout(kind: ShardingKind, layout: ShardLayout) -> ShardLayout:
    """The layout the kind's module plans under: the loader's, or for dispatch process 0 reading every global batch
    (:meth:`~ShardLayout.reader`); a token budget's plan is every process's either way (dispatched, process 0 reads
    every process's micro-batches of it)."""
    return layout.reader() if kind.name == DISPATCH and kind.reads != TOKEN_BUDGET else layout


def _shard(
    dataloader: DataLoader[Any], kind: ShardingKind, layout: ShardLayout, options: _DataOptions, readers: Readers
) -> Shard:
    """The one call into the module of ``kind`` (for dispatch: of the kind process 0 reads the data by,
    under the reader's ``layout``)."""
    dataset, batch_size, drop_last = dataloader.dataset, dataloader.batch_size, dataloader.drop_last
    name = kind.reads if kind.name == DISPATCH else kind.name
    if name == MAP_STYLE:
        return map_style.shard(dataloader, layout, options)  # the data options whole: the shuffle's are read there
    if name == MIXTURE:
        return mixture.shard(dataloader, layout, options)
    if name == DISTRIBUTED_SAMPLER:
        return distributed_sampler.shard(dataloader, layout, options)
    if name == TOKEN_BUDGET:  # dispatched: the plan of every process, process 0 reading every micro-batch of it
        return token_budget.shard(dataloader, layout, reads_all=kind.name == DISPATCH)
    if name == LOCAL:  # one reader: a dispatcher's process 0 compares nothing
        return local.shard(dataset, layout, batch_size, drop_last, readers if kind.name == LOCAL else Readers())
    if kind.name == PRESPLIT:
        return presplit.shard(dataset, layout, dataloader.num_workers, batch_size, drop_last, kind)
    if kind.name == NATIVE:
        return native.shard(dataset, layout, dataloader.num_workers, drop_last, kind)
    return read_all.shard(dataset, layout, batch_size, drop_last, kind)


def _report_like_torch(loader: DataLoader[Any]) -> None:
    """What torch's ``DataLoader`` reports when it was built with a ``batch_sampler=``: ``batch_size``
    ``None`` and ``drop_last`` ``False`` (the batch sampler decides both; the layout keeps its values).

    Example: ``prepare_data_loader(DataLoader(data, batch_sampler=bs)).batch_size is None``."""
    object.__setattr__(loader, "batch_size", None)  # DataLoader forbids setting them after __init__
    object.__setattr__(loader, "drop_last", False)


def _unwrapped(dataloader: DataLoader[Any], options: _DataOptions) -> DataLoader[Any]:
    """The ``DataLoader`` to prepare: ``dataloader`` itself, or the one it wraps where it is its own iterator (its
    class defines ``__next__``; its ``__iter__`` returns itself, so shardplug's pass could not read through it):
    Ray Train's ``prepare_data_loader`` returns such a wrapper (``compat.wrapped_dataloader``: the ``DataLoader``
    with the job's ``DistributedSampler``, which is adopted; the wrapper only moves batches to ``device``). One that
    moves them off the CPU needs ``put_on_device=True`` in its place; one that wraps no ``DataLoader`` is refused."""
    cls = type(dataloader).__name__
    if not hasattr(type(dataloader), "__next__"):
        return dataloader
    inner = compat.wrapped_dataloader(dataloader)
    if not isinstance(inner, DataLoader) or hasattr(type(inner), "__next__"):
        raise TypeError(
            f"dataloader is a {cls}, a DataLoader that is its own iterator (its class defines __next__), whose "
            "batches shardplug cannot read through it; pass the DataLoader it reads from to prepare_data_loader"
        )
    device = getattr(dataloader, "device", None)
    if isinstance(device, torch.device) and device.type != "cpu" and not options.put_on_device:
        raise ValueError(
            f"dataloader is a {cls} that moves each batch to {device} around a DataLoader, which is prepared in its "
            "place (it is its own iterator); pass put_on_device=True so that shardplug moves the batches to this "
            "process's device, or build it with move_to_device=False"
        )
    logger.debug("prepared the %s that the %s wraps (it is its own iterator)", type(inner).__name__, cls)
    return inner


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


def _layout(dataloader: DataLoader[Any], num_processes: int, process_index: int, options: _DataOptions) -> ShardLayout:
    """The one layout of this loader: its global batch size and ``drop_last`` (the batch sampler's,
    also one passed as ``sampler=``), the topology and the options."""
    if options.split_batches and isinstance(dataloader.batch_sampler, token_budget.TokenBudgetBatchSampler):
        raise ValueError(
            "split_batches=True cuts each global batch into a slice per process, but a TokenBudgetBatchSampler "
            "plans every process's own micro-batches (each within max_tokens, none to cut); pass split_batches=False"
        )
    batch_size = dataloader.batch_size
    if batch_size is None and dataloader.batch_sampler is not None:
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
    if batch_size is None:  # a batch sampler passed as ``sampler=`` (map_style.is_batch_sampler) says its own
        batch_size = getattr(dataloader.sampler, "batch_size", None)
    source = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
    drop_last = bool(dataloader.drop_last or getattr(source, "drop_last", False))
    return ShardLayout.for_batches(
        batch_size, num_processes, process_index, options.split_batches, options.even_batches, drop_last
    )


def _batch_device(device: str | torch.device | None, options: _DataOptions) -> torch.device | None:
    """Where batches go: ``device`` (default: the process's) with ``put_on_device``, else nowhere."""
    if not options.put_on_device:
        return None
    return torch.device(device) if device is not None else torch.device(ProcessTopology.current().device)


def _prefetch_depth(options: _DataOptions, dispatch: bool) -> int | None:
    """The loader's prefetch depth: the option, or 0 for a dispatching loader (whose batches arrive from
    process 0 step by step); an explicit depth there is a ``ValueError``."""
    if not dispatch:
        return options.prefetch_depth
    if options.prefetch_depth:
        raise ValueError(
            f"prefetch_depth={options.prefetch_depth!r} is not supported with dispatch_batches=True (process 0 "
            "sends each step's rows as the step comes); pass prefetch_depth=None or 0, or dispatch_batches=False"
        )
    return 0


_PREPARABLE = "a torch.utils.data.DataLoader or a torchdata.nodes graph (a Loader or a BaseNode)"


def can_prepare(loader: object) -> bool:
    """Whether ``prepare_data_loader`` takes ``loader``: a ``DataLoader`` or a ``torchdata.nodes`` graph (what it
    then refuses of a graph, e.g. a user's iterator, it refuses with the fix).

    Example::

        >>> from torch.utils.data import DataLoader
        >>> can_prepare(DataLoader(range(4))), can_prepare(range(4))
        (True, False)
    """
    return isinstance(loader, DataLoader) or is_graph(loader)


@overload
def skip_first_batches(dataloader: DataLoader[Any], num_batches: int = 0) -> PreparedDataLoader: ...


@overload
def skip_first_batches(
    dataloader: GraphLike | MixtureLoaderShard, num_batches: int = 0
) -> PreparedDataLoader | MixtureLoaderShard: ...


def skip_first_batches(
    dataloader: DataLoader[Any] | object, num_batches: int = 0
) -> PreparedDataLoader | MixtureLoaderShard:
    """A loader of the same kind and settings that starts after its first ``num_batches`` batches.

    The skip applies to the next pass only and keeps the epoch counter; skipped map-style batches
    are never loaded (only their indices are computed), except with ``use_stateful_dataloader=True``:
    they are read through the ``StatefulDataLoader``, so that its own saved state counts them.
    """
    if not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches={num_batches!r} must be an integer >= 0")
    if isinstance(dataloader, (PreparedDataLoader, MixtureLoaderShard)):
        return dataloader.skipped_copy(num_batches)
    if is_graph(dataloader):
        return prepare_data_loader(dataloader, num_processes=1, process_index=0).skipped_copy(num_batches)
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be {_PREPARABLE}, got {type(dataloader).__name__}")
    new = prepare_data_loader(dataloader, num_processes=1, process_index=0)
    new.cursor.skip = num_batches
    return new
