"""The prepared loader of a ``torchdata.nodes`` graph: this process's part, with the guarantees of a ``DataLoader``.

:func:`prepare_graph` reads the graph (:func:`~shardplug.core.graphs.reading.read_graph`):

* a map-style graph becomes the ``DataLoader`` of its keys (:class:`~shardplug.core.graphs.reading.GraphKeysLoader`),
  prepared by ``prepare_data_loader`` like any ``DataLoader``: the map-style path decides the rows, ``len()``, the
  padding and where a pass resumes, and the prepared loader's one hand-out seam counts, marks and moves each batch
  that the graph's work (rebuilt on this process's part) hands out. The result is a
  :class:`~shardplug.core.loader.prepared.PreparedDataLoader` (``len()``, ``set_epoch``, ``end_of_dataloader``,
  ``batch_real_count``, ``drop_padding_rows()``, ``state_dict()`` / ``load_state_dict()``, also from another
  number of processes);
* a ``MultiNodeWeightedSampler`` becomes a :class:`MixtureLoaderShard`: each source prepared alike, the mixture
  drawn with one seed on every process; it resumes exactly on the same number of processes.

Example::

    >>> import torchdata.nodes as tn
    >>> from torch.utils.data import SequentialSampler
    >>> from shardplug import prepare_data_loader
    >>> graph = tn.Loader(tn.Batcher(tn.SamplerWrapper(SequentialSampler(range(6))), batch_size=2, drop_last=False))
    >>> part = prepare_data_loader(graph, num_processes=2, process_index=1)
    >>> [batch for batch in part], len(part)
    ([[2, 3], [0, 1]], 2)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from shardplug.core._internal.collectives import all_gather_objects
from shardplug.core.graphs.reading import MapGraph, MixtureGraph, read_graph
from shardplug.core.loader.prepared import PreparedDataLoader

__all__ = ["MixtureLoaderShard", "prepare_graph"]

logger = logging.getLogger(__name__)

MIXTURE_FORMAT = 1
"""Version of the dict :meth:`MixtureLoaderShard.state_dict` writes."""


class MixtureLoaderShard:
    """This process's part of a ``MultiNodeWeightedSampler`` graph (see the module): every process draws the
    same sources in the same order (one ``seed``), each reads its own rows of them.  ``state_dict()`` is the
    graph's own state (torchdata's, with each source's position) and resumes exactly on the same number of
    processes; another number is refused.
    """

    def __init__(self, graph: MixtureGraph, parts: Mapping[str, PreparedDataLoader], seed: int) -> None:
        import torchdata.nodes as tn

        first = next(iter(parts.values()))
        self.num_processes = first.plan.layout.num_processes
        self.seed = seed
        self.parts = dict(parts)
        self.loader = tn.Loader(graph.rebuild(self.parts, seed))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def skipped_copy(self, num_batches: int) -> MixtureLoaderShard:
        raise ValueError(
            f"skip_first_batches(num_batches={num_batches}) on a MultiNodeWeightedSampler graph: a mixture's position "
            "is its state, not a count of batches; save loader.state_dict() and load it with load_state_dict()"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": MIXTURE_FORMAT,
            "num_processes": self.num_processes,
            "seed": self.seed,
            "graph": self.loader.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after ``state_dict`` (saved by this loader on the same number of processes)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != MIXTURE_FORMAT:
            raise ValueError(
                f"this is not the state of a prepared MultiNodeWeightedSampler graph (format {MIXTURE_FORMAT}); pass "
                "what its state_dict() returned"
            )
        saved = state_dict["num_processes"]
        if saved != self.num_processes:
            raise ValueError(
                f"the state's num_processes={saved} differs from this job's {self.num_processes}: a weighted mixture "
                f"resumes exactly only on the number of processes it was saved with; resume with {saved} processes, "
                "or start the epoch afresh (do not load the state)"
            )
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"the state's seed={state_dict['seed']} differs from this loader's seed={self.seed}: the mixture "
                "would draw other sources; prepare it with the seed it was saved with (data_seed=)"
            )
        self.loader.load_state_dict(state_dict["graph"])


def _agreed_seed(graph: MixtureGraph, data_seed: int | None) -> int:
    """The mixture's seed (``data_seed``, else the node's ``seed``), the same on every process or a ``ValueError``."""
    seed = int(graph.mixture.seed if data_seed is None else data_seed)
    seeds = all_gather_objects(seed, what="every process's seed of the MultiNodeWeightedSampler")
    if len(set(seeds)) > 1:
        raise ValueError(
            f"the MultiNodeWeightedSampler's seed differs between processes ({seeds}, by process): every process "
            "must draw the same sources for the weights to hold across the job; build it with the same seed= on "
            "every process, or pass data_seed= to prepare_data_loader"
        )
    return seed


def _check_graph_options(arguments: Mapping[str, Any]) -> None:
    config = arguments.get("config")
    dispatch = config.dispatch_batches if config is not None else arguments.get("dispatch_batches")
    if dispatch:
        raise ValueError(
            "dispatch_batches=True: a torchdata.nodes graph is read by every process (each its own part, the graph's "
            "work on it), never by process 0 for all; pass dispatch_batches=False"
        )


def _plan_arguments(arguments: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """``prepare_data_loader`` arguments for the loader of a graph's keys: no ``StatefulDataLoader`` (the
    position is shardplug's), never dispatched."""
    kwargs = dict(arguments)
    changes = {"use_stateful_dataloader": False, "dispatch_batches": False, **changes}
    config = kwargs.get("config")
    if config is not None:
        for name in changes:
            kwargs.pop(name, None)
        kwargs["config"] = config.replace(**changes)
    else:
        kwargs.update(changes)
    return kwargs


def prepare_graph(
    graph: Any, prepare: Callable[..., PreparedDataLoader], arguments: Mapping[str, Any]
) -> PreparedDataLoader | MixtureLoaderShard:
    """This process's loader for a ``torchdata.nodes`` graph: the graph's keys prepared by ``prepare``
    (``prepare_data_loader``) with ``arguments`` (its keywords), its work rebuilt on them (see the module)."""
    _check_graph_options(arguments)
    read = read_graph(graph)
    if isinstance(read, MapGraph):
        loader = prepare(read.plan_loader(), **_plan_arguments(arguments))
        # the graph's SamplerWrapper owns the epoch (torchdata sets the next one on the sampler at every new pass):
        # over a DistributedSampler too, whose epoch a DataLoader's pass would otherwise read as DDP does (unmoved)
        loader.keeps_own_epoch = True
        if read.initial_epoch:
            loader.set_epoch(read.initial_epoch)
        logger.debug("prepared a torchdata.nodes graph: %d stage(s) on this process's part", len(read.stages))
        return loader
    config = arguments.get("config")
    data_seed = config.data_seed if config is not None else arguments.get("data_seed")
    seed = _agreed_seed(read, data_seed)
    changes = {"rng_types": None, "even_batches": True, "put_on_device": False}
    parts = {
        name: prepare(source.plan_loader(), **_plan_arguments(arguments, **changes))
        for name, source in read.sources.items()
    }
    return MixtureLoaderShard(read, parts, seed)
