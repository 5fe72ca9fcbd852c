"""torchdata.nodes graphs: what a graph reads, the plan of its rows, and its per-row work rebuilt on a part.

A ``torchdata.nodes`` graph (a ``Loader`` or a ``BaseNode``) is read once, from its root down to its
source (:func:`read_graph`).  A map-style graph (a ``SamplerWrapper`` at the bottom, as
``MapStyleWrapper`` builds it) becomes a :class:`MapGraph`: its sampler and its batching stand for an
equivalent ``DataLoader`` over the sampler's keys (:class:`GraphKeysLoader`), which goes through the
map-style sharding path like any ``DataLoader`` (which rows each process gets, ``len()``, padding and
resume: one rule, in one place).  Its per-row and per-batch work (``Mapper`` / ``ParallelMapper``,
``PinMemory``, ``Prefetcher``) is rebuilt on this process's part at each pass (``MapGraph.run``), and
its batches leave through the prepared loader's one hand-out seam.

A weighted mixture (``MultiNodeWeightedSampler``) becomes a :class:`MixtureGraph`: each of its sources
is a map-style graph of rows, sharded alike; the mixture itself is rebuilt with one seed for every
process, so every process draws the same sources in the same order (the weights hold for the whole job)
and each reads its own rows of them.

What cannot be sharded from outside is refused with the fix: a user's iterator (``IterableWrapper``),
an ``Unbatcher``, a second ``Batcher``, a ``SamplerWrapper`` with its own ``epoch_updater``, and any
node this module does not know.

Example::

    >>> import torchdata.nodes as tn
    >>> from torch.utils.data import SequentialSampler
    >>> graph = read_graph(tn.Loader(tn.Batcher(tn.SamplerWrapper(SequentialSampler(range(5))), 2, drop_last=False)))
    >>> graph.batch_size, graph.drop_last, len(graph.plan_loader().dataset)
    (2, False, 5)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, TypeGuard

from torch.utils.data import DataLoader, Dataset

from shardplug.core._internal import compat
from shardplug.core.graphs.row_tags import OnRow
from shardplug.core.sharding.distributed_sampler import is_distributed_sampler

__all__ = ["GraphLike", "is_graph", "read_graph", "MapGraph", "MixtureGraph", "GraphKeysLoader"]

logger = logging.getLogger(__name__)

_FIX_ITERATOR = (
    "an IterableWrapper reads a user's iterator, which shardplug cannot shard from outside (every process would "
    "read all of it). Build the graph on a map-style source (tn.SamplerWrapper(sampler) or "
    "tn.MapStyleWrapper(dataset, sampler)), or shard inside the iterator (read only this process's part: "
    "torch.distributed.get_rank() of get_world_size()) and use it without prepare_data_loader"
)


def _nodes() -> Any:
    """``torchdata.nodes`` (an ``ImportError`` naming the fix where torchdata is missing or too old)."""
    try:
        import torchdata.nodes as tn
    except ImportError as error:  # pragma: no cover - torchdata is a test dependency
        raise ImportError("torchdata.nodes graphs need torchdata >= 0.10: pip install 'torchdata>=0.10'") from error
    return tn


class _NodeLike(Protocol):
    """A ``torchdata.nodes.BaseNode`` as the type checker sees it (torchdata has no type information)."""

    def get_state(self) -> dict[str, Any]: ...


class _LoaderLike(Protocol):
    """A ``torchdata.nodes.Loader`` as the type checker sees it."""

    root: Any


GraphLike = _NodeLike | _LoaderLike
"""A ``torchdata.nodes`` graph: a ``Loader`` or a ``BaseNode``."""


def is_graph(obj: object) -> TypeGuard[GraphLike]:
    """Whether ``obj`` is a ``torchdata.nodes`` graph (a ``Loader`` or a ``BaseNode``), without importing
    torchdata when it is not loaded (then it cannot be one)."""
    import sys

    if "torchdata.nodes" not in sys.modules:
        return False
    tn = sys.modules["torchdata.nodes"]
    return isinstance(obj, (tn.Loader, tn.BaseNode))


def _keep(batch: list[Any]) -> list[Any]:
    """The collation of the plan's loader: a batch of keys stays a list."""
    return batch


class _Keys(Dataset[Any]):
    """The dataset of a sampler's keys: key ``k`` reads as ``k`` (the graph's own work reads the data)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: Any) -> Any:
        return key


def _source_of(node: Any, tn: Any) -> Any:
    """The node ``node`` reads from (a ``ParallelMapper`` with ``prebatch`` reads through its own ``Batcher``)."""
    if isinstance(node, tn.ParallelMapper) and node.prebatch is not None:
        return node.source.source
    return node.source


def _map_fn(node: Any) -> Callable[[Any], Any]:
    """The user's ``map_fn`` of a ``ParallelMapper`` (not its ``prebatch`` wrapper)."""
    return node.map_fn.map_fn if node.prebatch is not None else node.map_fn  # type: ignore[no-any-return]


def _rebuild_node(node: Any, source: Any, wrap: Callable[[Callable[..., Any]], Any] | None) -> Any:
    """``node`` again, reading ``source``, with the same settings; a mapper's ``map_fn`` through ``wrap``."""
    tn = _nodes()
    if isinstance(node, tn.ParallelMapper):
        fn = _map_fn(node)
        return tn.ParallelMapper(
            source,
            wrap(fn) if wrap is not None else fn,
            num_workers=node.num_workers,
            in_order=node.in_order,
            method=node.method,
            multiprocessing_context=node.multiprocessing_context,
            max_concurrent=node.max_concurrent,
            snapshot_frequency=node.snapshot_frequency,
            prebatch=node.prebatch,
        )
    if isinstance(node, tn.Prefetcher):
        return tn.Prefetcher(source, node.prefetch_factor, snapshot_frequency=node.snapshot_frequency)
    if isinstance(node, tn.PinMemory):
        device = compat.pin_memory_device(node)
        return tn.PinMemory(source, pin_memory_device=device or "", snapshot_frequency=node.snapshot_frequency)
    if isinstance(node, tn.Batcher):
        return tn.Batcher(source, node.batch_size, drop_last=node.drop_last)
    raise TypeError(f"cannot rebuild {type(node).__name__}")  # read_graph refused it before


def _build(stages: tuple[Any, ...], source: Any, batch_at: int | None) -> Any:
    """The graph's work ``stages`` (from the source up) rebuilt on ``source`` (a
    :class:`~shardplug.core.graphs.added_nodes.BatchSource`): the stages below the ``Batcher`` (at ``batch_at``;
    ``None``: none) on tagged rows, the rest on the batches; the ``Batcher`` itself is the plan's batching (the
    source's batches are its batches)."""
    from shardplug.core.graphs import added_nodes  # imports torchdata: only for graphs

    below = stages if batch_at is None else stages[:batch_at]
    above = () if batch_at is None else stages[batch_at + 1 :]
    node = source
    if any(isinstance(s, _nodes().ParallelMapper) for s in below):
        node = added_nodes.Rows(node)
        for stage in below:
            node = _rebuild_node(stage, node, OnRow)
        node = added_nodes.Regroup(node)
    else:  # Prefetcher / PinMemory only: they work on the batches as they are
        for stage in below:
            node = _rebuild_node(stage, node, None)
    for stage in above:
        node = _rebuild_node(stage, node, None)
    return node


@dataclasses.dataclass(frozen=True)
class MapGraph:
    """A map-style graph: its ``sampler`` (the keys), the ``initial_epoch`` of its ``SamplerWrapper``, its
    work from the source up (``stages``), and its batching (``batch_at``: the ``Batcher``'s place in
    ``stages``, ``None`` without one: single rows; ``batch_size`` / ``drop_last``: the ``Batcher``'s)."""

    sampler: Any
    initial_epoch: int
    stages: tuple[Any, ...]
    batch_at: int | None
    batch_size: int
    drop_last: bool

    def plan_loader(self) -> GraphKeysLoader:
        """The ``DataLoader`` equivalent to the graph's rows (:class:`GraphKeysLoader`): what the map-style
        path shards."""
        return GraphKeysLoader(self)

    @property
    def hands_out_lists(self) -> bool:
        """Whether a handed-out batch is the ``Batcher``'s list of samples (no per-batch mapper above it)."""
        tn = _nodes()
        above = () if self.batch_at is None else self.stages[self.batch_at + 1 :]
        return self.batch_at is not None and not any(isinstance(s, tn.ParallelMapper) for s in above)

    def run(self, batches: Iterator[list[Any]]) -> Iterator[Any]:
        """The graph's work on ``batches`` of keys (this process's part): what the user's graph hands out for
        them, in their order (a batch, or without a ``Batcher`` its one row)."""
        from shardplug.core.graphs.added_nodes import BatchSource  # imports torchdata: only for graphs

        source = BatchSource(batches)
        root = _build(self.stages, source, self.batch_at)
        root.reset()
        try:
            for batch in root:
                yield batch if self.batch_at is not None else batch[0]
        finally:
            source.stop()  # a pass left early: a node's thread reading ahead stops at its next batch


class GraphKeysLoader(DataLoader[Any]):
    """The ``DataLoader`` of a map-style graph's keys (its sampler's), batched as the graph batches them (single
    rows: batches of one), whose iteration runs the graph's work on its batches.

    ``prepare_data_loader`` shards it by the map-style rule of every ``DataLoader``; under the prepared loader,
    each pass reads this process's batches of keys through the graph's work (``__iter__``), and hands them out
    through the prepared loader's one seam (counted, padding marked, moved to the device): a position counts
    what the user received, not what a ``Prefetcher`` or ``ParallelMapper`` read ahead.

    Example::

        >>> import torchdata.nodes as tn
        >>> graph = read_graph(tn.Batcher(tn.Mapper(tn.SamplerWrapper(range(5)), str), 2, drop_last=False))
        >>> list(graph.plan_loader())
        [['0', '1'], ['2', '3'], ['4']]
    """

    def __init__(self, graph: MapGraph) -> None:
        sampler = graph.sampler  # a user's DistributedSampler yields keys of its whole dataset, its part of them
        keys = len(sampler.dataset) if is_distributed_sampler(sampler) else len(sampler)
        super().__init__(
            _Keys(keys),
            sampler=graph.sampler,
            batch_size=graph.batch_size,
            drop_last=graph.drop_last,
            collate_fn=_keep,
        )
        self.graph = graph

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # the graph's batches, not a _BaseDataLoaderIter
        return self.graph.run(DataLoader.__iter__(self))

    @property
    def hands_out_batches(self) -> bool:
        """Whether the graph batches its rows (a ``Batcher``): only batches have padding rows to drop."""
        return self.graph.batch_at is not None

    @property
    def padding_cut(self) -> Callable[[Any, int | None], Any] | None:
        """How the padding comes off a batch of this graph: a ``Batcher``'s list is cut to its leading samples
        (``None``: as any batch, by rows); single rows have none to cut (a ``ValueError``)."""
        if not self.hands_out_batches:
            raise ValueError(
                "drop_padding_rows() needs batches with rows; this graph hands out single samples (it has no "
                "Batcher): keep them and skip those with loader.batch_real_count == 0"
            )
        return _leading_samples if self.graph.hands_out_lists else None


@dataclasses.dataclass(frozen=True)
class MixtureGraph:
    """A weighted mixture: its sources (each a :class:`MapGraph` of rows), the mixture node (its weights,
    stop criteria and seed), and the work above it (``stages``, from the mixture up)."""

    sources: Mapping[str, MapGraph]
    mixture: Any
    stages: tuple[Any, ...]

    def rebuild(self, parts: Mapping[str, Any], seed: int) -> Any:
        """The mixture on this process's ``parts`` of its sources (their prepared loaders, of rows), drawn with
        ``seed`` alike on every process, and the work above it as the graph has it."""
        from shardplug.core.graphs.added_nodes import RowSource  # imports torchdata: only for graphs

        tn = _nodes()
        sources = {name: RowSource(part) for name, part in parts.items()}
        node = tn.MultiNodeWeightedSampler(
            sources,
            dict(self.mixture.weights),
            stop_criteria=self.mixture.stop_criteria,
            rank=0,
            world_size=1,
            seed=seed,
        )
        for stage in self.stages:
            node = _rebuild_node(stage, node, None)
        return node


def _refuse(node: Any, why: str) -> TypeError:
    return TypeError(f"cannot prepare this torchdata.nodes graph: its {type(node).__name__} node: {why}")


def _chain(graph: Any, tn: Any) -> tuple[list[Any], Any]:
    """The nodes from ``graph``'s root down to its source (excluded), and the source."""
    node = graph.root if isinstance(graph, tn.Loader) else graph
    above: list[Any] = []
    while True:
        if isinstance(node, (tn.SamplerWrapper, tn.MultiNodeWeightedSampler)):
            return above, node
        if isinstance(node, tn.IterableWrapper):
            raise _refuse(node, _FIX_ITERATOR)
        if isinstance(node, (tn.ParallelMapper, tn.Batcher, tn.PinMemory, tn.Prefetcher)):
            above.append(node)
            node = _source_of(node, tn)
            continue
        raise _refuse(
            node,
            "shardplug knows SamplerWrapper / MapStyleWrapper sources, MultiNodeWeightedSampler, Mapper, "
            "ParallelMapper, Batcher, PinMemory and Prefetcher; build the graph from those, or shard the data "
            "yourself and iterate the graph as it is",
        )


def _map_graph(stages: list[Any], source: Any, tn: Any) -> MapGraph:
    """The :class:`MapGraph` of a ``SamplerWrapper`` ``source`` and its work (from the source up)."""
    updater = getattr(source.epoch_updater, "__func__", source.epoch_updater)
    if updater is not getattr(tn.SamplerWrapper._default_epoch_updater, "__func__", None):
        raise _refuse(
            source,
            f"epoch_updater={source.epoch_updater!r}: shardplug sets the sampler's epoch itself (the next one after "
            "each complete pass, or loader.set_epoch(e)); build the SamplerWrapper without epoch_updater and call "
            "set_epoch on the prepared loader",
        )
    try:
        len(source.sampler)
    except TypeError:
        raise _refuse(
            source,
            f"its sampler {type(source.sampler).__name__} has no len(): shardplug shares a sampler's keys out by "
            "their number; give the sampler a __len__",
        ) from None
    batchers = [i for i, s in enumerate(stages) if isinstance(s, tn.Batcher)]
    if len(batchers) > 1:
        raise _refuse(
            stages[batchers[1]],
            "a second Batcher regroups the batches the first made, so a process's steps are no longer the plan's: "
            "batch once",
        )
    at = batchers[0] if batchers else None
    batcher = stages[at] if at is not None else None
    return MapGraph(
        sampler=source.sampler,
        initial_epoch=int(source.epoch),
        stages=tuple(stages),
        batch_at=at,
        batch_size=batcher.batch_size if batcher is not None else 1,
        drop_last=bool(batcher.drop_last) if batcher is not None else False,
    )


def read_graph(graph: Any) -> MapGraph | MixtureGraph:
    """What ``graph`` (a ``Loader`` or a ``BaseNode``) reads and does (see the module); a ``TypeError``
    naming the node and the fix for what cannot be sharded from outside."""
    tn = _nodes()
    above, source = _chain(graph, tn)
    stages = list(reversed(above))
    if isinstance(source, tn.SamplerWrapper):
        return _map_graph(stages, source, tn)
    sources: dict[str, MapGraph] = {}
    for name, node in source.source_nodes.items():
        inner_above, inner_source = _chain(node, tn)
        if not isinstance(inner_source, tn.SamplerWrapper):
            raise _refuse(inner_source, "a mixture of mixtures: give each source of the mixture a map-style graph")
        part = _map_graph(list(reversed(inner_above)), inner_source, tn)
        if part.batch_at is not None:
            raise _refuse(
                part.stages[part.batch_at],
                f"source {name!r} of the mixture batches its rows: batch after the MultiNodeWeightedSampler",
            )
        sources[name] = part
    return MixtureGraph(sources=sources, mixture=source, stages=tuple(stages))


def _leading_samples(batch: Any, real: int | None) -> Any:
    """The first ``real`` samples of a batch that is a list of samples (what a ``Batcher`` yields).

    Example::

        >>> _leading_samples([{"x": 1}, {"x": 2}, {"x": 3}], 2)
        [{'x': 1}, {'x': 2}]
    """
    if real is None or not isinstance(batch, (list, tuple)):
        return batch
    return batch[:real]
