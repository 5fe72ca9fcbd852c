"""The prepared loader of a ``torchdata.nodes`` graph: this process's part, with the guarantees of a ``DataLoader``.

:func:`prepare_graph` reads the graph (:func:`~shardplug.core.sharding.nodes.read_graph`) and prepares the
``DataLoader`` equivalent to its rows through ``prepare_data_loader`` (the map-style path decides the rows,
``len()``, the padding and where a pass resumes); the result is

* a :class:`NodesLoaderShard` for a map-style graph: the graph's work rebuilt on this process's batches,
  each batch counted when it is handed out (:class:`PassCounter`: the position counts what the user
  received, not what a ``Prefetcher`` or ``ParallelMapper`` read ahead), with ``len()``, ``set_epoch``,
  ``end_of_dataloader``, padding marks (``batch_real_count``) and ``state_dict()`` / ``load_state_dict()``
  that resume exactly, also on another number of processes;
* a :class:`MixtureLoaderShard` for a ``MultiNodeWeightedSampler``: each source sharded alike, the mixture
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

import torch

from shardplug.core._internal.collectives import all_gather_objects
from shardplug.core.loader.building import LoaderIdentity, PassCounts, pass_position
from shardplug.core.loader.passes import PassListener
from shardplug.core.loader.prepared import PreparedDataLoader
from shardplug.core.loader.transfer import DeviceTransfer
from shardplug.core.padding.audit import SampleAudit
from shardplug.core.padding.tracking import PaddingTracker, leading_rows
from shardplug.core.sharding.nodes import MapGraph, MixtureGraph, read_graph
from shardplug.core.sharding.steps import Mark, Step, leading_samples

__all__ = ["GraphLoaderShard", "NodesLoaderShard", "MixtureLoaderShard", "PassCounter", "prepare_graph"]

logger = logging.getLogger(__name__)

_END = object()

MIXTURE_FORMAT = 1
"""Version of the dict :meth:`MixtureLoaderShard.state_dict` writes."""


class PassCounter:
    """One pass at a time over the plan's loader ``inner`` (a prepared ``DataLoader`` of keys): begins it in
    the caller's thread (its agreement with the other processes happens there, never in a node's worker
    thread), counts the batches handed out, and tells the position after the last one handed out.

    Example::

        >>> from shardplug import prepare_data_loader
        >>> from torch.utils.data import DataLoader
        >>> counter = PassCounter(prepare_data_loader(DataLoader(range(6), batch_size=2)))
        >>> step = next(counter.begin()); counter.handed(step.mark); counter.position()["batches_yielded"]
        1
    """

    def __init__(self, inner: PreparedDataLoader) -> None:
        self.inner = inner
        self.started: PassCounts | None = None  # where the pass began (None: none since a load / set_epoch)
        self.epoch = 0
        self.count = 0
        self.complete = False
        self._batches: Iterator[Any] | None = None

    def _mark(self) -> Mark:
        inner = self.inner
        indices = inner.batch_indices
        return Mark(inner.batch_real_count, list(indices) if indices is not None else None, inner.end_of_dataloader)

    def begin(self) -> Iterator[Step]:
        """Start a pass of ``inner`` here (its first batch is read now): its steps, each with its mark."""
        self.end()
        inner = self.inner
        batches = iter(inner)
        first = next(batches, _END)
        current = inner.resume.last_pass
        self.started, self.epoch, self.count = current.counts(), inner.epoch, 0
        self.complete = first is _END and current.complete
        if first is _END:
            return iter(())
        self._batches = batches
        return self._steps(Step(first, self._mark()), batches)

    def _steps(self, first: Step, batches: Iterator[Any]) -> Iterator[Step]:
        yield first
        for batch in batches:
            yield Step(batch, self._mark())

    def handed(self, mark: Mark) -> None:
        """A batch with ``mark`` was handed out."""
        self.count += 1
        if mark.last:
            self.complete = True

    def end(self) -> None:
        """The pass is over: an incomplete pass does not end the epoch (its next pass starts it again, as
        after a ``break`` out of a ``DataLoader``), even where the plan's loader was read to its end ahead."""
        batches, self._batches = self._batches, None
        if batches is None:
            return
        try:
            batches.close()  # type: ignore[attr-defined]
        except (AttributeError, ValueError):  # a node's thread is reading it: it stops at its next batch
            pass
        if not self.complete and self.inner.resume.last_pass.complete:
            self.inner.set_epoch(self.inner.epoch)

    def position(self) -> dict[str, Any]:
        """The position after the last batch handed out (as ``inner.state_dict()`` writes it)."""
        started, inner = self.started, self.inner
        if started is None:
            return inner.state_dict()
        counts = PassCounts(
            started.resumed + self.count,
            started.resumed,
            started.consumed_at_start,
            self.complete,
            self.complete,
            started.generator_state,
        )
        identity = LoaderIdentity(self.epoch, inner.total_dataset_length, inner.num_workers)
        return pass_position(inner.plan, identity, counts, inner.resume.shuffles()).to_dict()

    def load(self, state: dict[str, Any]) -> None:
        """Continue after ``state`` (validated by ``inner`` before anything changes)."""
        self.end()
        self.inner.load_state_dict(state)
        self.started = None

    def set_epoch(self, epoch: int) -> None:
        """The next pass reads ``epoch`` (a pass in progress ends first)."""
        self.end()
        self.inner.set_epoch(epoch)
        self.started = None


class GraphLoaderShard:
    """What ``prepare_data_loader`` returns for a ``torchdata.nodes`` graph: an iterable with ``state_dict()`` /
    ``load_state_dict()`` (:class:`NodesLoaderShard`, :class:`MixtureLoaderShard`)."""

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError

    def skipped_copy(self, num_batches: int) -> GraphLoaderShard:
        """A loader whose next pass starts after its first ``num_batches`` batches (``skip_first_batches``)."""
        raise NotImplementedError


class NodesLoaderShard(GraphLoaderShard):
    """This process's part of a map-style ``torchdata.nodes`` graph (what ``prepare_data_loader(graph)``
    returns; see the module).  ``inner`` is the prepared loader of the graph's keys (its plan decides the
    rows); the graph's work runs on them at each pass.

    ``len()``, ``epoch_length``, ``total_batch_size``, ``set_epoch``, ``end_of_dataloader``,
    ``batch_real_count`` / ``batch_indices`` (after ``track_padding()``), ``drop_padding_rows()``,
    ``enable_audit()``, ``state_dict()`` / ``load_state_dict()`` as on a prepared ``DataLoader``.
    """

    def __init__(
        self,
        graph: MapGraph,
        inner: PreparedDataLoader,
        device: torch.device | None = None,
        non_blocking: bool = False,
    ) -> None:
        self.graph = graph
        self.inner = inner
        self.counter = PassCounter(inner)
        self.device = device
        self.non_blocking = non_blocking
        self.gradient_state: PassListener | None = None
        self.end_of_dataloader = False
        self.batch_real_count: int | None = None
        self.batch_indices: list[Any] | None = None
        self._tracker: PaddingTracker | None = None

    def __iter__(self) -> Iterator[Any]:
        return self._run()

    def _run(self) -> Iterator[Any]:
        counter, graph = self.counter, self.graph
        source, root = graph.rebuild(counter.begin())
        root.reset()
        transfer = DeviceTransfer.to(self.device, self.non_blocking)
        state = self.gradient_state
        self.end_of_dataloader = False
        if state is not None:
            state.loader_started(self)
        try:
            for step in root:
                counter.handed(step.mark)
                batch = self._hand_out(step)
                if state is not None:
                    state.batch_ready(self, step.mark.last)
                yield transfer(batch) if transfer is not None else batch
        finally:
            source.stop()
            counter.end()
            if state is not None:
                state.loader_stopped(self)

    def _hand_out(self, step: Step) -> Any:
        """The batch the user receives for ``step``: its marks set, its padding cut where dropped."""
        mark = step.mark
        self.end_of_dataloader = mark.last
        self.batch_real_count, self.batch_indices = mark.real, mark.indices
        batch = self.graph.batch_of(step)
        if self._tracker is not None and mark.real is not None:
            batch = self._tracker.hand_out(batch, mark.indices, mark.real, self.epoch)
        return batch

    # -- lengths and epochs -----------------------------------------------------------------
    def __len__(self) -> int:
        """Batches the pass yields (the pass in progress, else the next one; exact after a resume)."""
        return len(self.inner)

    @property
    def epoch_length(self) -> int | None:
        return self.inner.epoch_length

    @property
    def total_batch_size(self) -> int | None:
        return self.inner.total_batch_size

    @property
    def total_dataset_length(self) -> int | None:
        return self.inner.total_dataset_length

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.inner.epoch = epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next pass (its shuffle); passes advance it by themselves after a complete one."""
        self.counter.set_epoch(epoch)

    @property
    def resume(self) -> Any:
        """The resume state of the plan's loader (front ends read ``resumed_batches`` from it)."""
        return self.inner.resume

    # -- positions --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: after the last batch handed out (a position as a prepared ``DataLoader``
        writes it, identical on every process)."""
        return self.counter.position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after ``state_dict`` at the next pass (validated first; also from another number of processes)."""
        self.counter.load(state_dict)

    # -- padding ----------------------------------------------------------------------------
    @property
    def hands_out_batches(self) -> bool:
        """Whether the graph batches its rows (a ``Batcher``): only batches have padding rows to drop."""
        return self.graph.batch_at is not None

    def track_padding(self) -> None:
        """Mark each batch's padding: ``batch_real_count`` leading rows are real, ``batch_indices`` its keys."""
        self.inner.track_padding()

    def drop_padding_rows(self) -> None:
        """Hand out only the real rows of every batch (a ``Batcher``'s list is cut to its real samples)."""
        if not self.hands_out_batches:
            raise ValueError(
                "drop_padding_rows() needs batches with rows; this graph hands out single samples (it has no "
                "Batcher): keep them and skip those with loader.batch_real_count == 0"
            )
        self.track_padding()
        tracker = PaddingTracker()
        tracker.dropping = True
        tracker.cut = leading_samples if self.graph.hands_out_lists else leading_rows
        self._tracker = tracker

    def enable_audit(self) -> SampleAudit:
        """Record the keys this process consumes, per epoch (see :class:`SampleAudit`)."""
        return self.inner.enable_audit()

    @property
    def audit(self) -> SampleAudit | None:
        return self.inner.audit

    def skipped_copy(self, num_batches: int) -> NodesLoaderShard:
        """A loader whose next pass starts after its first ``num_batches`` batches (``skip_first_batches``)."""
        return NodesLoaderShard(self.graph, self.inner.skipped_copy(num_batches), self.device, self.non_blocking)


class MixtureLoaderShard(GraphLoaderShard):
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
        counters = {name: PassCounter(part) for name, part in parts.items()}
        self.loader = tn.Loader(graph.rebuild(counters, seed))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def skipped_copy(self, num_batches: int) -> GraphLoaderShard:
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
    """``prepare_data_loader`` arguments for the plan's loader of keys: batches stay where they are (the
    loader moves the graph's batches), no ``StatefulDataLoader`` (the position is shardplug's)."""
    kwargs = dict(arguments)
    kwargs.pop("device", None)
    changes = {"put_on_device": False, "use_stateful_dataloader": False, "dispatch_batches": False, **changes}
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
) -> NodesLoaderShard | MixtureLoaderShard:
    """This process's loader for a ``torchdata.nodes`` graph: the graph's rows prepared by ``prepare``
    (``prepare_data_loader``) with ``arguments`` (its keywords), its work rebuilt on them (see the module)."""
    _check_graph_options(arguments)
    read = read_graph(graph)
    config = arguments.get("config")
    if isinstance(read, MapGraph):
        inner = prepare(read.plan_loader(), **_plan_arguments(arguments))
        if read.initial_epoch:
            inner.set_epoch(read.initial_epoch)
        put = config.put_on_device if config is not None else arguments.get("put_on_device", False)
        device = arguments.get("device")
        non_blocking = bool(config.non_blocking if config is not None else arguments.get("non_blocking", False))
        target = None
        if put:
            from shardplug.core._internal.topology import ProcessTopology

            target = torch.device(device) if device is not None else torch.device(ProcessTopology.current().device)
        logger.debug("prepared a torchdata.nodes graph: %d stage(s) on this process's part", len(read.stages))
        return NodesLoaderShard(read, inner, target, non_blocking)
    data_seed = config.data_seed if config is not None else arguments.get("data_seed")
    seed = _agreed_seed(read, data_seed)
    parts = {
        name: prepare(source.plan_loader(), **_plan_arguments(arguments, rng_types=None, even_batches=True))
        for name, source in read.sources.items()
    }
    return MixtureLoaderShard(read, parts, seed)
