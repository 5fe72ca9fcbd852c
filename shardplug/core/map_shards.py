"""Map-style data: one order on every process, and this process's shard of it.

``prepare_data_loader`` calls :func:`shard_map_style` with the layout it built: the sampler
under the user's loader is replaced where needed so that every process draws the same order
(:func:`agreed_sampler`), then its batches are shared out by a :class:`BatchSamplerShard` (or,
for a loader without batches, an :class:`IndexSamplerShard`) built on that layout.  The user's
loader, batch sampler and sampler are never modified.

Example::

    >>> from torch.utils.data import DataLoader
    >>> layout = ShardLayout.for_batches(2, num_processes=2, process_index=1)
    >>> shard = shard_map_style(DataLoader(range(6), batch_size=2), layout, MapOptions())
    >>> list(shard.loader_kwargs["batch_sampler"])
    [[2, 3], [0, 1]]
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from . import compat
from .config import ShardplugConfig
from .layout import ShardLayout
from .plan import ShardPlan
from .samplers import BatchSamplerShard, IndexSamplerShard
from .shuffle import BijectiveRandomSampler, SeedableRandomSampler, draw_seed

__all__ = [
    "Agreement",
    "MapOptions",
    "MapShard",
    "order_agreement",
    "shard_map_style",
    "agreed_sampler",
    "replaceable",
    "is_batch_sampler",
    "index_sampler",
]


class MapOptions(NamedTuple):
    """The options that decide how map-style data is shuffled."""

    shuffle_algorithm: str = ShardplugConfig.shuffle_algorithm
    use_seedable_sampler: bool = ShardplugConfig.use_seedable_sampler
    data_seed: int | None = ShardplugConfig.data_seed


class Agreement(NamedTuple):
    """What the processes need the process group for to draw one order (``needs``), what goes wrong
    without it (``without``) and the way to one order without a group (``fix``):
    :func:`~shardplug.core.collectives.require_group`'s arguments."""

    needs: str
    without: str
    fix: str


class MapShard(NamedTuple):
    """What :func:`shard_map_style` decided: the loader's (batch) sampler keywords, its plan, the
    generator to synchronise from process 0 at each pass (``None``: none), and what the processes
    must agree on through the process group (``None``: their order is one without it)."""

    loader_kwargs: dict[str, Any]
    plan: ShardPlan
    synchronized_generator: torch.Generator | None
    agreement: Agreement | None = None


def shard_map_style(dataloader: DataLoader[Any], layout: ShardLayout, options: MapOptions) -> MapShard:
    """This process's shard of ``dataloader``'s indices under ``layout`` (see the module)."""
    sampler = original = index_sampler(dataloader)
    if options.shuffle_algorithm == "bijective":
        sampler = bijective_sampler(sampler, options.data_seed)
    sampler, generator = agreed_sampler(sampler, options.use_seedable_sampler, options.data_seed)
    agreement = order_agreement(original, sampler, generator if options.data_seed is None else None)
    if dataloader.batch_sampler is not None:
        shard = _batch_sampler_shard(dataloader.batch_sampler, sampler, layout)
        return MapShard({"batch_sampler": shard}, shard.plan, generator, agreement)
    if is_batch_sampler(dataloader.sampler):  # a batch sampler passed as ``sampler=``
        shard = _batch_sampler_shard(dataloader.sampler, sampler, layout)
        return MapShard({"sampler": shard, "batch_size": None}, shard.plan, generator, agreement)
    # DataLoader(batch_size=None): single samples, shared out as batches of one
    single = IndexSamplerShard.from_layout(sampler, layout)
    return MapShard({"sampler": single, "batch_size": None}, single.shard.plan, generator, agreement)


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
    if isinstance(sampler, DistributedSampler):
        raise ValueError(
            "the DataLoader already uses a DistributedSampler, and prepare_data_loader shards it again; "
            "remove the DistributedSampler (pass shuffle=True or a plain sampler) and let shardplug shard the data"
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
