"""Weighted mixtures of map-style data sets: :class:`Mixture`, and the whole path of its sharding.

A :class:`Mixture` is a map-style data set whose index is a *global position*: position ``p`` reads the
source and sample :class:`~shardplug.core.shuffle.mixture_order.MixtureOrder` computes for it (a pure
function of the seed, the sources' lengths and the weights, O(1) at any position).  Epoch ``e`` covers
positions ``[e * S, (e + 1) * S)``, ``S = len(mixture)`` (``samples_per_epoch``).  ``prepare_data_loader``
shares those positions out as any map-style order (:class:`MixtureSampler`, under a
:class:`~shardplug.core.sharding.map_style.BatchSamplerShard` whose plan is a :class:`MixturePlan`), so each
process's batches are the global sequence split by the usual rules, and a position saved on ``N`` processes
resumes on ``M``.  The mixture's order replaces the loader's shuffle: ``shuffle=True`` and ``shuffle=False``
read the same order (the mixture shuffles each source itself, by its ``seed``); a sampler of one's own is
refused.

A position carries the mixture's order so far (its weights and where they changed): a Mixture built with
other weights (or another source) that loads it goes on from the saved position with its own weights, each
source from its next draw (:meth:`MixtureOrder.continued`).

Example::

    >>> mixture = Mixture({"a": range(10), "b": range(100, 130)}, {"a": 0.25, "b": 0.75}, seed=0)
    >>> len(mixture), sorted({mixture.locate(p).source for p in range(8)})
    (40, ['a', 'b'])
    >>> [mixture[p] for p in range(4)] == [mixture.sources[d.source][d.sample] for d in mixture.locate_many(range(4))]
    True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, SequentialSampler

from shardplug.core._internal import compat
from shardplug.core._internal.arguments import is_int
from shardplug.core.sharding.arithmetic import EpochOrder
from shardplug.core.sharding.kinds import Shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.map_style import BatchSamplerPlan, BatchSamplerShard, Shuffling, replaceable
from shardplug.core.sharding.shard_plan import PassRecord
from shardplug.core.shuffle.mixture_order import Draw, MixtureOrder, quantize_weights
from shardplug.core.shuffle.seedable import check_seed

__all__ = ["Mixture", "MixtureSampler", "MixturePlan", "shard"]


def _check_sources(sources: Any) -> dict[str, Any]:
    if not isinstance(sources, Mapping) or not sources:
        raise TypeError(
            f"sources={sources!r} is invalid: pass a non-empty mapping of names to map-style data sets, e.g. "
            "{'web': web, 'code': code}"
        )
    for name, source in sources.items():
        if not isinstance(name, str):
            raise TypeError(f"sources has the key {name!r}: name each source with a string")
        if isinstance(source, IterableDataset) or not hasattr(source, "__getitem__") or not hasattr(source, "__len__"):
            raise TypeError(
                f"sources[{name!r}]={type(source).__name__} is not a map-style data set (__getitem__ and __len__): a "
                "mixture reads its sources by index to place every sample once per cycle; pass a map-style data set "
                "(e.g. a list, a torch Dataset, a Hugging Face Dataset), or prepare a stream on its own"
            )
        if len(source) == 0:
            raise ValueError(
                f"sources[{name!r}] is empty (len 0): it has no sample to draw; remove it from sources and weights"
            )
    return dict(sources)


def _check_weights(argument: str, weights: Any, names: list[str]) -> dict[str, float]:
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"{argument}={weights!r} is invalid: pass a mapping of the sources' names to numbers, e.g. "
            f"{dict.fromkeys(names, 1)}"
        )
    if sorted(weights) != sorted(names):
        missing, extra = sorted(set(names) - set(weights)), sorted(set(weights) - set(names), key=str)
        raise ValueError(
            f"{argument} names {sorted(weights, key=str)} but the sources are {sorted(names)} (missing {missing}, "
            f"unknown {extra}); give every source a weight (0 to leave one out) and no other name"
        )
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(
                f"{argument}[{name!r}]={weight!r} is invalid: a weight is a finite number >= 0; pass 0 to leave the "
                "source out"
            )
    if not any(weights.values()):
        raise ValueError(f"{argument}={dict(weights)} are all zero: no source would be drawn; give one a weight > 0")
    return {name: weights[name] for name in names}


def _check_schedule(weights: Any, names: list[str]) -> list[tuple[int, dict[str, float]]]:
    """``weights`` as schedule steps: one mapping (from position 0), or ``(position, mapping)`` pairs."""
    if isinstance(weights, Mapping):
        return [(0, _check_weights("weights", weights, names))]
    if not isinstance(weights, Sequence) or isinstance(weights, str) or not weights:
        raise TypeError(
            f"weights={weights!r} is invalid: pass a mapping of the sources' names to numbers, or a schedule: a list "
            "of (global position, mapping) pairs, the first at position 0"
        )
    steps: list[tuple[int, dict[str, float]]] = []
    for k, step in enumerate(weights):
        if not isinstance(step, (tuple, list)) or len(step) != 2 or not is_int(step[0]):
            raise TypeError(f"weights[{k}]={step!r} is invalid: a schedule's step is a (global position, mapping) pair")
        position = step[0]
        previous = steps[-1][0] if steps else -1
        if (k == 0 and position != 0) or position <= previous:
            raise ValueError(
                f"weights[{k}] starts at position {position}: a schedule starts at position 0 and its positions "
                "increase; sort the steps, the first at 0"
            )
        steps.append((position, _check_weights(f"weights[{k}][1]", step[1], names)))
    return steps


class Mixture(Dataset[Any]):
    """A weighted mixture of map-style data sets, indexed by global position (see the module docstring).

    ``sources``: names to map-style data sets; ``weights``: the same names to numbers >= 0 (shares of the
    positions; not all zero), or a schedule ``[(0, weights), (position, weights), ...]`` whose steps take
    effect at exactly their global positions; ``seed``: the order's (each source's cycles, the interleaving);
    ``samples_per_epoch``: the positions of one epoch (default: the sum of the sources' lengths).

    ``mixture[p]`` is what the source drawn at global position ``p`` returns; :meth:`locate` says which source,
    cycle and sample that is.
    """

    def __init__(
        self,
        sources: Mapping[str, Any],
        weights: Mapping[str, float] | Sequence[tuple[int, Mapping[str, float]]],
        *,
        seed: int,
        samples_per_epoch: int | None = None,
    ) -> None:
        self.sources = _check_sources(sources)
        names = sorted(self.sources)
        if not is_int(seed):
            raise TypeError(f"seed={seed!r} is invalid: pass an integer (the same on every process and every run)")
        check_seed("seed", seed)
        self.seed: int = seed
        self.schedule = _check_schedule(weights, names)
        lengths = {name: len(self.sources[name]) for name in names}
        if samples_per_epoch is None:
            samples_per_epoch = sum(lengths.values())
        if not is_int(samples_per_epoch) or samples_per_epoch < 1:
            raise ValueError(
                f"samples_per_epoch={samples_per_epoch!r} is invalid: pass an integer >= 1, or None for the sum of "
                "the sources' lengths"
            )
        self.samples_per_epoch = samples_per_epoch
        self.configured = MixtureOrder(self.seed, lengths, [(start, quantize_weights(w)) for start, w in self.schedule])
        self.order = self.configured
        self._readers: tuple[MixtureOrder, list[Any], bool] | None = None
        self.version = 0
        """Counts the changes of :attr:`order` (a position with other weights loaded)."""

    def __len__(self) -> int:
        return self.samples_per_epoch

    def locate(self, position: int) -> Draw:
        """Which source, draw, cycle and sample global ``position`` reads."""
        return self.order.locate(position)

    def locate_many(self, positions: Sequence[int] | range) -> list[Draw]:
        return self.order.locate_many(list(positions))

    def sources_of(self, positions: Sequence[int]) -> list[str]:
        """The source of each of ``positions`` (global positions): for per-source metrics of a batch
        (``loader.batch_sources`` does this for the batch being processed)."""
        return [self.order.draw_of(p)[0] for p in positions]

    def __getitem__(self, position: int) -> Any:
        draw = self.order.locate(int(position))
        return self._source(draw.source, position)[draw.sample]

    def _source(self, name: str, position: int) -> Any:
        source = self.sources.get(name)
        if source is None:
            raise KeyError(
                f"position {position} reads source {name!r}, which this Mixture no longer has (it was removed where "
                "the run resumed, and the epoch's padding reads the epoch's first positions again); give the source "
                "weight 0 instead of removing it, until the epoch ends"
            )
        return source

    def __getitems__(self, positions: list[int]) -> list[Any]:
        """A batch's samples, each source with a ``__getitems__`` read once per batch with it (the others row by
        row); the batch located at once (:meth:`MixtureOrder.locate_batch`)."""
        order = self.order
        codes, samples = order.locate_batch(positions)
        readers = self._readers
        if readers is None or readers[0] is not order:
            readers = self._readers = self._readers_of(order)
        _, sources, batched = readers
        if not batched:
            return [sources[c][s] for c, s in zip(codes, samples)]
        by_source: dict[int, list[int]] = {}
        for k, code in enumerate(codes):
            by_source.setdefault(code, []).append(k)
        out: list[Any] = [None] * len(codes)
        for code, where in by_source.items():
            source = self._source(order.names[code], positions[where[0]])
            many = getattr(source, "__getitems__", None)
            rows = [samples[k] for k in where]
            items = many(rows) if many is not None else [source[s] for s in rows]
            for k, item in zip(where, items):
                out[k] = item
        return out

    def _readers_of(self, order: MixtureOrder) -> tuple[MixtureOrder, list[Any], bool]:
        """(``order``, the source of each of its codes, whether a batch is read source by source: a source has a
        ``__getitems__``, or one of the order's is no longer here, to be named where a position reads it)."""
        sources = [self.sources.get(name) for name in order.names]
        batched = any(source is None or hasattr(source, "__getitems__") for source in sources)
        return order, sources, batched

    def continue_from(self, position: int, state: Any) -> None:
        """Go on from global ``position`` of the order ``state`` saved (:meth:`MixtureOrder.state`), with this
        mixture's weights from there on."""
        order = MixtureOrder.from_state(state).continued(position, self.configured)
        if order.state() != self.order.state():
            self.order = order
            self.version += 1

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}: {len(source)}" for name, source in self.sources.items())
        return f"Mixture({{{sizes}}}, seed={self.seed}, samples_per_epoch={self.samples_per_epoch})"


class MixtureSampler(torch.utils.data.Sampler[int]):
    """The global positions of a :class:`Mixture`'s current epoch, in order: ``e * S .. (e + 1) * S - 1``."""

    def __init__(self, mixture: Mixture) -> None:
        self.data_source = mixture
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        start = self.epoch * len(self.data_source)
        return iter(range(start, start + len(self.data_source)))

    def positions(self, places: torch.Tensor) -> torch.Tensor:
        """The global positions at ``places`` of the epoch (each in ``[0, S)``)."""
        return places + self.epoch * len(self.data_source)

    def epoch_order(self) -> EpochOrder:
        return EpochOrder(len(self.data_source), bijection=self.positions)


class MixturePlan(BatchSamplerPlan):
    """The plan of a mixture's positions: a map-style plan (which rows, ``len()``, where a pass resumes), whose
    saved state is the mixture's order so far, at every place (:attr:`state_everywhere`), and whose records
    name positions in the epoch (the audit's ids)."""

    state_everywhere = True

    def __init__(self, batch_sampler: BatchSampler, layout: ShardLayout, mixture: Mixture) -> None:
        super().__init__(batch_sampler, layout)
        self.mixture = mixture
        self.workers_version = mixture.version

    def arithmetic(self, sampler: Any = None) -> bool:
        return True

    @property
    def mixture_sampler(self) -> MixtureSampler:
        return self.sampler  # type: ignore[no-any-return]

    def saved_state(self, consumed: int) -> Any:
        return self.mixture.order.state()

    def check_saved_state(self, state: Any) -> None:
        """Refuse an order this mixture cannot go on from (not a mixture's, another seed, a source of another
        length), before anything changes."""
        MixtureOrder.from_state(state).check_continues(self.mixture.configured)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        if dataset_state is not None:
            at = self.mixture_sampler.epoch * len(self.mixture) + (self.samples_before(consumed) or 0)
            self.mixture.continue_from(at, dataset_state)
        return super().start_after(consumed, dataset_state)

    def start_in_workers(self, num_workers: int) -> contextlib.AbstractContextManager[bool]:
        """Whether the workers' copies of the mixture would hold an older order than this process's (a position
        with other weights was loaded since they started): persistent workers then start anew."""
        return self._workers_start(num_workers)

    @contextlib.contextmanager
    def _workers_start(self, num_workers: int) -> Iterator[bool]:
        yield num_workers > 0 and self.workers_version != self.mixture.version
        self.workers_version = self.mixture.version

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        indices, real = super().batch_record(record, batch)
        size = len(self.mixture)
        return [p % size for p in indices], real


def _check_sampler(dataloader: DataLoader[Any], data_seed: int | None, mixture: Mixture) -> None:
    """Refuse what would reorder the mixture's positions, or a seed that would not reach it."""
    batch_sampler = dataloader.batch_sampler
    sampler: Any = dataloader.sampler
    if batch_sampler is None or type(batch_sampler) is not BatchSampler:
        raise ValueError(
            f"a Mixture is read in batches of its global positions, and this DataLoader has "
            f"{'batch_size=None' if batch_sampler is None else 'a batch_sampler of its own'}; pass batch_size=... "
            "(and no batch_sampler): the mixture decides the order"
        )
    if type(sampler) is not SequentialSampler and not (
        replaceable(sampler) and not sampler.replacement and compat.random_sampler_num_samples(sampler) is None
    ):
        raise ValueError(
            f"the DataLoader's sampler is {type(sampler).__name__}, which would reorder the mixture's global "
            "positions (its weights and cycles hold in their order); pass shuffle=False or shuffle=True (both read "
            "the mixture's own order) and no sampler, and set the order by Mixture(seed=...)"
        )
    if data_seed is not None and data_seed != mixture.seed:
        raise ValueError(
            f"data_seed={data_seed} would be ignored: a Mixture's order is seeded by Mixture(seed={mixture.seed}); "
            f"pass data_seed=None (or {mixture.seed}), or build the Mixture with seed={data_seed}"
        )


def shard(dataloader: DataLoader[Any], layout: ShardLayout, options: Shuffling) -> Shard:
    """This process's shard of a loader over a :class:`Mixture`: its global positions shared out as a map-style
    order (see the module docstring)."""
    mixture = dataloader.dataset
    if not isinstance(mixture, Mixture):
        raise TypeError(f"mixture.shard needs a DataLoader over a Mixture, got {type(mixture).__name__}")
    _check_sampler(dataloader, options.data_seed, mixture)
    batch_sampler = BatchSampler(MixtureSampler(mixture), layout.batch_size, layout.drop_last)  # type: ignore[arg-type]
    plan = MixturePlan(batch_sampler, layout, mixture)
    shard = BatchSamplerShard.from_layout(batch_sampler, layout, plan)
    check = (len(mixture), layout.batch_size) if layout.num_processes > 1 else None
    return Shard(mixture, plan, {"batch_sampler": shard}, None, check)
