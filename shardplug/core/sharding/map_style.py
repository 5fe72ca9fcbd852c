"""Map-style data: one order on every process, and this process's batches of its global batches.

The whole path of this kind of sharding: the sampler every process draws alike (:func:`agreed_sampler`),
the wrapper (:class:`BatchSamplerShard`, or :class:`IndexSamplerShard` for a loader without batches) and
its :class:`BatchSamplerPlan` (which global batches or slices, by the index arithmetic of
:mod:`~shardplug.core.sharding.arithmetic`; ``len()``; where a pass resumes).  The seedable shuffles live in
:mod:`shardplug.core.shuffle.seedable`.

``prepare_data_loader`` calls :func:`shard` with the layout it built: the sampler
under the user's loader is replaced where needed so that every process draws the same order
(:func:`agreed_sampler`), then its batches are shared out by a :class:`BatchSamplerShard` (or,
for a loader without batches, an :class:`IndexSamplerShard`) built on that layout.  The user's
loader, batch sampler and sampler are never modified.

Example::

    >>> from torch.utils.data import DataLoader
    >>> layout = ShardLayout.for_batches(2, num_processes=2, process_index=1)
    >>> part = shard(DataLoader(range(6), batch_size=2), layout, MapOptions())
    >>> list(part.loader_kwargs["batch_sampler"])
    [[2, 3], [0, 1]]
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import require_group
from shardplug.core.config import ShardplugConfig
from shardplug.core.sharding.arithmetic import (
    ArithmeticShard,
    EpochHead,
    EpochOrder,
    shard_length,
    walk_shard_counted,
)
from shardplug.core.sharding.kinds import Shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import (
    PassRecord,
    PlanDefaults,
    ShardPlan,
    check_consumed,
    global_batch_samples,
    sized_length,
)
from shardplug.core.shuffle.seedable import (
    BijectiveRandomSampler,
    SeedableRandomSampler,
    advance_past_randperm,
    draw_seed,
)

__all__ = [
    "BatchSamplerPlan",
    "BatchSamplerShard",
    "IndexSamplerShard",
    "draw_seed",
    "Agreement",
    "MapOptions",
    "Shuffling",
    "order_agreement",
    "shard",
    "agreed_sampler",
    "replaceable",
    "is_batch_sampler",
    "index_sampler",
]


class BatchSamplerPlan(PlanDefaults):
    """One process's batches of a batch sampler's global batches (map-style data).

    Standard ``BatchSampler`` over ``SequentialSampler`` / ``RandomSampler`` /
    ``SeedableRandomSampler`` are computed by arithmetic (any start at the same cost); any other
    batch sampler is walked, by indices only.
    """

    unit = "global_batches"
    stream = False
    first_holds_most = True  # leftovers go to the first processes
    identifies_samples = True  # batch records hold dataset indices

    def __init__(self, batch_sampler: Iterable[Sequence[int]], layout: ShardLayout) -> None:
        self.batch_sampler = batch_sampler
        self.layout = layout
        self.pending_start = 0
        """Global batches the next pass starts after (see :meth:`start_after`)."""

    parked_record: PassRecord | None = None
    """The record the next pass fills (its loader's pass parks it here with the start, as it begins)."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = consumed  # a position's (validated) or the cursor's: index_batches checks it
        return 0

    def next_pass(self) -> Iterator[list[int]]:
        """:meth:`index_batches` after the start and with the record parked for the next pass, which it takes
        at its first batch (one-shot: what torch's ``DataLoader`` draws when it iterates the batch sampler; an
        iterator it makes and drops unread takes nothing)."""
        first, record, self.pending_start, self.parked_record = self.pending_start, self.parked_record, 0, None
        yield from self._index_batches(first, record if record is not None else PassRecord())  # first: checked

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        """The next batch logged where the batch sampler drew it (those a ``StatefulDataLoader``
        fast-forwarded past were logged too: they are dropped first)."""
        log = record.batches
        while record.fast_forwarded:
            log.popleft()  # type: ignore[union-attr]
            record.fast_forwarded -= 1
        return log.popleft()  # type: ignore[union-attr]

    @property
    def sampler(self) -> Any:
        return getattr(self.batch_sampler, "sampler", None)

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def _global_length(self) -> tuple[int, int | None]:
        """(number of global batches, size of the last one or None when unknown / full)."""
        batch_sampler: Any = self.batch_sampler
        sampler = getattr(batch_sampler, "sampler", None)
        sized = sampler is not None and hasattr(sampler, "__len__")
        samples = None
        if type(batch_sampler) is BatchSampler and sized:  # torch's len(), from its sampler's (asked once)
            samples, per_batch = len(sampler), batch_sampler.batch_size  # type: ignore[arg-type]
            num = samples // per_batch if batch_sampler.drop_last else -(-samples // per_batch)
        else:
            num = len(batch_sampler)
        size = self.layout.batch_size
        if size is None or self.layout.drop_last or num == 0 or not sized:
            return num, None
        if samples is None:
            samples = len(sampler)  # type: ignore[arg-type]
        return num, samples - (num - 1) * size

    def epoch_size(self) -> int | None:
        try:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        except TypeError:
            return None

    def num_batches(self, consumed: int = 0) -> int:
        """Batches after ``consumed`` global batches (a ``TypeError`` for a batch sampler without ``len``)."""
        num, last = self._global_length()
        return shard_length(num - check_consumed(consumed), last, self.layout.batch_size, self.layout)

    def samples_before(self, consumed: int) -> int | None:
        return global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> bool | None:
        # Process 0 has the most batches (leftovers go to the first processes).
        try:
            num, last = self._global_length()
        except TypeError:
            return None
        first = dataclasses.replace(self.layout, process_index=0)
        return shard_length(num - consumed, last, self.layout.batch_size, first) == 0

    def arithmetic(self, sampler: Any = None) -> bool:
        """Whether this plan's batches are computed by arithmetic (``sampler``: the batch sampler's, when known)."""
        if sampler is None:
            sampler = self.sampler
        return type(self.batch_sampler) is BatchSampler and (
            type(sampler) in (SequentialSampler, RandomSampler) or isinstance(sampler, SeedableRandomSampler)
        )

    def batches(self, consumed: int = 0, record: PassRecord | None = None) -> Iterator[tuple[list[int], int]]:
        """This process's batches after ``consumed`` global batches, with their real counts.

        Draws the epoch's order as iterating the batch sampler would (one pass of its sampler).
        """
        record = record if record is not None else PassRecord(track=True)
        for batch in self.index_batches(consumed, record):
            yield batch, record.batches.popleft()[1]  # type: ignore[union-attr]

    def index_batches(self, consumed: int = 0, record: PassRecord | None = None) -> Iterator[list[int]]:
        """This process's batches after ``consumed`` global batches (what a batch sampler yields);
        ``record`` receives the pass's start, the epoch's order and, when tracking, each batch
        with its real count."""
        return self._index_batches(check_consumed(consumed), record if record is not None else PassRecord())

    def _index_batches(self, consumed: int, record: PassRecord) -> Iterator[list[int]]:
        """:meth:`index_batches` after ``consumed`` (checked)."""
        record.started_at = consumed
        log = record.batches
        sampler = getattr(self.batch_sampler, "sampler", None)
        if self.arithmetic(sampler):
            order, generator = epoch_order(sampler)
            if order is not None:
                if generator is not None:
                    # RandomSampler draws a second permutation when it is exhausted: draw it now,
                    # so the generator is at the next epoch's state as soon as this pass began
                    # (a position saved at the end of the pass then records that state).
                    advance_past_randperm(generator, order.n)
                record.head = order
                shard = ArithmeticShard(order, self.layout.batch_size, self.layout.drop_last, self.layout, consumed)  # type: ignore[arg-type]
                for chunk, reals in shard.chunks():
                    if log is not None:
                        log.extend(zip(chunk, reals))
                    yield from chunk
                return
        # Skipped global batches are iterated as indices only: nothing is loaded for them.
        record.head = head = EpochHead.for_layout(self.layout.batch_size, self.layout)
        for batch, real in walk_shard_counted(self.batch_sampler, self.layout.batch_size, self.layout, consumed, head):
            if log is not None:
                log.append((batch, real))
            yield batch


def epoch_order(sampler: Any) -> tuple[EpochOrder | None, torch.Generator | None]:
    """The epoch order of a standard sampler, drawn exactly as iterating it would draw it.

    A sampler with an ``epoch_order()`` method of its own (a :class:`~shardplug.core.sharding.mixture.MixtureSampler`)
    says its order itself.  Returns ``(order, generator_to_advance)`` or ``(None, None)`` for other samplers.
    ``RandomSampler`` draws a second permutation when it is exhausted; the returned generator
    (the sampler's own ``generator``) must draw it too, so that later epochs stay identical to the
    plain ``RandomSampler``'s.  Without a ``generator`` there is none to advance (``None``).
    """
    if type(sampler) is SequentialSampler:
        return EpochOrder(len(sampler.data_source)), None
    if isinstance(sampler, BijectiveRandomSampler):
        return EpochOrder(len(sampler.data_source), bijection=sampler.permutation()), None
    if isinstance(sampler, SeedableRandomSampler):
        perm = sampler.index_order()
        return (EpochOrder(perm.numel(), perm), None) if perm is not None else (None, None)
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n or n == 0:
            return None, None
        if sampler.generator is None:
            # RandomSampler seeds a generator of its own from the global RNG and throws it away after
            # the pass: its second permutation changes nothing anyone sees, so it is never drawn
            own = torch.Generator().manual_seed(draw_seed())
            return EpochOrder(n, torch.randperm(n, generator=own)), None
        return EpochOrder(n, torch.randperm(n, generator=sampler.generator)), sampler.generator
    own_order = getattr(sampler, "epoch_order", None)  # a sampler that says its order (a mixture's positions)
    if own_order is not None:
        return own_order(), None
    return None, None


logger = logging.getLogger(__name__)

_INDEX_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
    range,
)
"""Samplers known to yield single indices (what a batch sampler wraps, never one itself)."""


def check_batch_sampler(batch_sampler: Any) -> None:
    """Refuse what cannot be a batch sampler: not iterable, or known to yield single indices."""
    wrap = "wrap your index sampler: BatchSampler(sampler, batch_size=..., drop_last=False)"
    if not hasattr(batch_sampler, "__iter__"):
        raise TypeError(
            f"batch_sampler={batch_sampler!r} is not an iterable of batches of indices; pass a batch sampler "
            f"(e.g. a torch.utils.data.BatchSampler), or {wrap}"
        )
    if isinstance(batch_sampler, _INDEX_SAMPLERS) and not hasattr(batch_sampler, "batch_size"):
        raise TypeError(
            f"batch_sampler={type(batch_sampler).__name__}(...) yields single indices, not batches of them; {wrap}"
        )


class BatchSamplerShard(Sampler[list[int]]):
    """The batches of ``batch_sampler`` that belong to process ``process_index`` of ``num_processes``.

    ``split_batches=False``: process ``i`` yields global batches ``i, i+N, i+2N, ...``.
    ``split_batches=True``: every global batch is cut into ``N`` slices; process ``i`` gets slice ``i``.
    ``even_batches=True`` (and no ``drop_last``) pads the end of the epoch with indices from its
    start so every process yields the same number of full batches.  ``len()`` is exactly the
    number of batches yielded.  With one process the batches pass through unchanged.

    Example::

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> bs = BatchSampler(SequentialSampler(range(21)), batch_size=3, drop_last=False)
        >>> [list(BatchSamplerShard(bs, 2, i))[-1] for i in range(2)]
        [[18, 19, 20], [0, 1, 2]]
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = ShardplugConfig.split_batches,
        even_batches: bool = ShardplugConfig.even_batches,
    ) -> None:
        check_batch_sampler(batch_sampler)
        batch_size = getattr(batch_sampler, "batch_size", None)
        drop_last = bool(getattr(batch_sampler, "drop_last", False))
        layout = ShardLayout.for_batches(
            batch_size, num_processes, process_index, split_batches, even_batches, drop_last
        )
        self.batch_sampler = batch_sampler
        self.plan = BatchSamplerPlan(batch_sampler, layout)
        self.epoch = 0

    @property
    def layout(self) -> ShardLayout:
        return self.plan.layout

    num_processes = property(lambda self: self.layout.num_processes)
    process_index = property(lambda self: self.layout.process_index)
    split_batches = property(lambda self: self.layout.split_batches)
    even_batches = property(lambda self: self.layout.even_batches)
    drop_last = property(lambda self: self.layout.drop_last)
    batch_size = property(lambda self: self.layout.batch_size)
    per_process_batch_size = property(lambda self: self.layout.process_batch_size)
    batches_per_step = property(
        lambda self: self.layout.batches_per_step, doc="Global batches per step of all processes."
    )

    @property
    def sampler(self) -> Any:
        """The index sampler under the wrapped batch sampler (frameworks call ``set_epoch`` on it)."""
        return self.plan.sampler

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the wrapped batch sampler and to its sampler (each that has ``set_epoch``)."""
        self.epoch = int(epoch)
        targets = [self.batch_sampler, self.sampler]
        for k, target in enumerate(targets):
            if target is not None and hasattr(target, "set_epoch") and all(target is not t for t in targets[:k]):
                target.set_epoch(epoch)

    def skip_next(self, num_batches: int) -> None:
        """Make the next iteration start after this process's first ``num_batches`` batches (one-shot)."""
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self.start_at_global(num_batches * self.batches_per_step)

    def start_at_global(self, global_batches: int) -> None:
        """Make the next iteration share out only the global batches after the first ``global_batches``
        (one-shot).  The count may come from a run with another number of processes: the rest of
        the epoch is then split among this run's processes."""
        self.plan.start_after(global_batches)

    def __len__(self) -> int:
        return self.plan.num_batches(self.plan.pending_start)

    def __iter__(self) -> Iterator[list[int]]:
        return self.plan.next_pass()

    @classmethod
    def from_layout(
        cls, batch_sampler: Iterable[list[int]], layout: ShardLayout, plan: BatchSamplerPlan | None = None
    ) -> BatchSamplerShard:
        """The shard of ``batch_sampler`` under a layout already built and validated
        (``prepare_data_loader``'s: its batch size and ``drop_last`` are the batch sampler's); ``plan``: a
        kind's own plan of that batch sampler (default: a :class:`BatchSamplerPlan`; a mixture's, a user's
        ``DistributedSampler``'s)."""
        check_batch_sampler(batch_sampler)
        shard = cls.__new__(cls)
        shard.batch_sampler, shard.epoch = batch_sampler, 0
        shard.plan = plan if plan is not None else BatchSamplerPlan(batch_sampler, layout)
        return shard


class IndexSamplerShard(Sampler[int]):
    """This process's indices of ``sampler`` for a loader without batches (``DataLoader(batch_size=None)``):
    the indices are shared out as batches of one, so every rule of :class:`BatchSamplerShard`
    holds (equal counts with ``even_batches``, padding from the epoch's start).

    Example::

        >>> from torch.utils.data import SequentialSampler
        >>> [list(IndexSamplerShard(SequentialSampler(range(5)), 2, i)) for i in range(2)]
        [[0, 2, 4], [1, 3, 0]]
    """

    def __init__(
        self,
        sampler: Iterable[int],
        num_processes: int = 1,
        process_index: int = 0,
        even_batches: bool = ShardplugConfig.even_batches,
    ) -> None:
        self.shard = BatchSamplerShard(
            BatchSampler(sampler, 1, False), num_processes, process_index, False, even_batches
        )

    @property
    def sampler(self) -> Any:
        return self.shard.sampler

    def set_epoch(self, epoch: int) -> None:
        self.shard.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.shard)

    def __iter__(self) -> Iterator[int]:
        for (index,) in self.shard:
            yield index

    @classmethod
    def from_layout(cls, sampler: Iterable[int], layout: ShardLayout) -> IndexSamplerShard:
        """The shard of ``sampler`` under the processes and ``even_batches`` of ``layout`` (built by
        ``prepare_data_loader``; the indices go out as batches of one, never split)."""
        shard = cls.__new__(cls)
        ones = dataclasses.replace(layout, batch_size=1, split_batches=False, drop_last=False)
        shard.shard = BatchSamplerShard.from_layout(BatchSampler(sampler, 1, False), ones)
        return shard


class Shuffling(Protocol):
    """What :func:`shard` reads of the data options (:class:`MapOptions`, or ``prepare_data_loader``'s whole)."""

    @property
    def shuffle_algorithm(self) -> str: ...

    @property
    def use_seedable_sampler(self) -> bool: ...

    @property
    def data_seed(self) -> int | None: ...


class MapOptions(NamedTuple):
    """The options that decide how map-style data is shuffled (for a direct call of :func:`shard`;
    ``prepare_data_loader`` hands its data options over whole)."""

    shuffle_algorithm: str = ShardplugConfig.shuffle_algorithm
    use_seedable_sampler: bool = ShardplugConfig.use_seedable_sampler
    data_seed: int | None = ShardplugConfig.data_seed


class Agreement(NamedTuple):
    """What the processes need the process group for to draw one order (``needs``), what goes wrong
    without it (``without``) and the way to one order without a group (``fix``):
    :func:`~shardplug.core._internal.collectives.require_group`'s arguments."""

    needs: str
    without: str
    fix: str


def shard(dataloader: DataLoader[Any], layout: ShardLayout, options: Shuffling) -> Shard:
    """This process's shard of ``dataloader``'s indices under ``layout`` (see the module): the (batch)
    sampler keywords, its plan, the generator to synchronise from process 0 at each pass, and what the
    processes compare when the loader is prepared.  Where the processes need the process group to
    draw one order, it must be there (a dispatcher's one reader needs none)."""
    sampler = original = index_sampler(dataloader)
    if options.shuffle_algorithm == "bijective":
        sampler = bijective_sampler(sampler, options.data_seed)
    sampler, generator = agreed_sampler(sampler, options.use_seedable_sampler, options.data_seed)
    agreement = order_agreement(original, sampler, generator if options.data_seed is None else None)
    if dataloader.batch_sampler is not None:
        shard = _batch_sampler_shard(dataloader.batch_sampler, sampler, layout)
        kwargs: dict[str, Any] = {"batch_sampler": shard}
        plan: ShardPlan = shard.plan
    elif is_batch_sampler(dataloader.sampler):  # a batch sampler passed as ``sampler=``
        shard = _batch_sampler_shard(dataloader.sampler, sampler, layout)
        kwargs, plan = {"sampler": shard, "batch_size": None}, shard.plan
    else:  # DataLoader(batch_size=None): single samples, shared out as batches of one
        single = IndexSamplerShard.from_layout(sampler, layout)
        kwargs, plan = {"sampler": single, "batch_size": None}, single.shard.plan
    if agreement is not None:
        require_group(layout.num_processes, layout.process_index, *agreement)
    # every process reads its part: they compare the dataset's length and the batch size
    check = (sized_length(dataloader.dataset), layout.batch_size) if layout.num_processes > 1 else None
    return Shard(dataloader.dataset, plan, kwargs, generator, check)


_DIVERGE = "each process would draw its own order, and their shards would overlap and miss samples"


def order_agreement(original: Any, sampler: Any, generator: torch.Generator | None) -> Agreement | None:
    """What the processes need the process group for to draw ``sampler``'s order alike, or ``None``
    when the order is one without a group: unshuffled, seeded (``data_seed``, a seeded sampler), or
    drawn from a generator of the user's own (seeded alike on every process, as a seed is given).
    ``original`` is the DataLoader's own sampler, ``generator`` one synchronised from process 0 that
    no ``data_seed`` seeded.

    Example::

        >>> order_agreement(RandomSampler(range(4)), SeedableRandomSampler(range(4)), None).fix
        ', or pass data_seed=... (the same on every process)'
        >>> order_agreement(RandomSampler(range(4)), SeedableRandomSampler(range(4), data_seed=1), None) is None
        True
    """
    fix = ", or pass data_seed=... (the same on every process)"
    if isinstance(sampler, SeedableRandomSampler) and sampler.seed is None:
        if sampler is original:  # the user's own seedable sampler: data_seed does not reach it
            fix = f", or give the {type(sampler).__name__} a data_seed=... (the same on every process)"
        return Agreement("agreeing on the seed of its shuffle (process 0 draws it)", _DIVERGE, fix)
    if generator is not None and getattr(original, "generator", None) is None:  # one shardplug seeded by chance
        needs = f"agreeing on the generator its {type(original).__name__} draws from (process 0 sends its state)"
        return Agreement(needs, _DIVERGE, fix)
    return None


def _batch_sampler_shard(batch_sampler: Any, sampler: Any, layout: ShardLayout) -> BatchSamplerShard:
    """The shard of ``batch_sampler`` reading ``sampler`` (a copy when the sampler was replaced)."""
    if type(batch_sampler) is BatchSampler:
        batch_sampler = BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    elif getattr(batch_sampler, "sampler", None) is not sampler and hasattr(batch_sampler, "sampler"):
        batch_sampler = copy.copy(batch_sampler)  # never modify the user's batch sampler
        batch_sampler.sampler = sampler
    return BatchSamplerShard.from_layout(batch_sampler, layout)


def is_batch_sampler(sampler: Any) -> bool:
    """A sampler that yields batches of indices (passed as ``sampler=`` with ``batch_size=None``)."""
    return isinstance(sampler, (BatchSampler, BatchSamplerShard)) or hasattr(sampler, "batch_size")


def index_sampler(loader: DataLoader[Any]) -> Any:
    """The sampler of single indices under the loader (under its batch sampler when there is one)."""
    if loader.batch_sampler is not None:
        return getattr(loader.batch_sampler, "sampler", loader.sampler)
    return getattr(loader.sampler, "sampler", loader.sampler)


def bijective_sampler(sampler: Any, data_seed: int | None) -> BijectiveRandomSampler:
    """The :class:`BijectiveRandomSampler` that replaces a shuffling ``RandomSampler``."""
    if isinstance(sampler, BijectiveRandomSampler):
        return sampler
    if isinstance(sampler, RandomSampler) and not replaceable(sampler):
        raise ValueError(
            f"shuffle_algorithm='bijective' replaces the DataLoader's RandomSampler, but its sampler is "
            f"{_own_sampler(sampler)}, whose order would be lost; pass shuffle_algorithm='randperm' (your sampler "
            "is sharded as it is), or shuffle=True without a sampler of your own"
        )
    if (
        not isinstance(sampler, RandomSampler)
        or sampler.replacement
        or compat.random_sampler_num_samples(sampler) is not None
    ):
        raise ValueError(
            f"shuffle_algorithm='bijective' needs a shuffled DataLoader (shuffle=True: a RandomSampler without "
            f"replacement or num_samples), but its sampler is {type(sampler).__name__}; pass shuffle=True, or "
            "shuffle_algorithm='randperm'"
        )
    bijective = BijectiveRandomSampler(sampler.data_source, data_seed=data_seed, generator=sampler.generator)
    if data_seed is None and isinstance(sampler, SeedableRandomSampler):
        bijective.take_seed(sampler)
    return bijective


def agreed_sampler(
    sampler: Any, use_seedable_sampler: bool, data_seed: int | None
) -> tuple[Any, torch.Generator | None]:
    """Replace a shuffling sampler so every process draws the same order.

    Returns ``(sampler, generator to synchronise from process 0)``.  Torch's own ``RandomSampler``
    (:func:`replaceable`) without generator becomes a :class:`SeedableRandomSampler`; any other
    sampler that draws its order from a ``generator`` attribute (``SubsetRandomSampler``,
    ``WeightedRandomSampler``, a ``RandomSampler`` subclass, ...) keeps its own ``__iter__`` and
    ``set_epoch`` and, without a generator, gets one (seeded with ``data_seed``), synchronised from
    process 0 at each pass.  The user's sampler is never modified.
    """
    if isinstance(sampler, DistributedSampler):  # prepare_data_loader adopts it as a kind of its own
        raise ValueError(
            "the sampler is a DistributedSampler, which already gives each process its part: sharding it again "
            "would give each process 1/N of its 1/N; prepare the DataLoader with prepare_data_loader (it adopts the "
            "DistributedSampler: the batches of native DDP), or pass shuffle=True or a plain sampler"
        )
    if isinstance(sampler, SeedableRandomSampler):
        return sampler, None
    if replaceable(sampler) and (sampler.generator is None or use_seedable_sampler):
        seedable = SeedableRandomSampler(
            sampler.data_source,
            replacement=sampler.replacement,
            num_samples=compat.random_sampler_num_samples(sampler),
            data_seed=data_seed,
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


def replaceable(sampler: Any) -> bool:
    """Whether ``sampler`` is torch's own ``RandomSampler``, which shardplug may replace by its own
    shuffle: exactly that class, with no ``set_epoch`` given to it.  A subclass, or a sampler given a
    ``set_epoch``, is the user's: it is sharded as it is (its order, its ``set_epoch`` calls).

    Example::

        >>> class Mine(RandomSampler):
        ...     pass
        >>> replaceable(RandomSampler(range(4))), replaceable(Mine(range(4)))
        (True, False)
    """
    return type(sampler) is RandomSampler and "set_epoch" not in vars(sampler)


def _own_sampler(sampler: Any) -> str:
    """How an error names a ``RandomSampler`` that is the user's own (:func:`replaceable`)."""
    if type(sampler) is RandomSampler:
        return "a RandomSampler given a set_epoch"
    return f"{type(sampler).__name__}, a RandomSampler subclass of your own"


def _refuse_ignored_seed(sampler: Any, data_seed: int) -> None:
    """``data_seed`` would not reach ``sampler``: it draws its order from a generator of its own."""
    if replaceable(sampler):
        fix = (
            "pass use_seedable_sampler=True to shuffle by data_seed (every epoch a pure function of the seed), or "
            "data_seed=None to keep the generator's order"
        )
    else:
        fix = (
            "seed that generator yourself (generator.manual_seed(...), the same on every process), or pass "
            "data_seed=None (use_seedable_sampler=True only replaces torch's own RandomSampler)"
        )
    raise ValueError(
        f"data_seed={data_seed} would be ignored: the {type(sampler).__name__} draws its order from its own "
        f"generator (the DataLoader's or the sampler's generator=), which is kept; {fix}"
    )
