"""The shuffles under a prepared loader, and their agreement with process 0.

Every process must draw the same order: a :class:`SeedableRandomSampler` whose seed is unset or its
generator's (``seed_to_agree``) gets process 0's seed, and the named RNGs (and a synchronised
generator) process 0's states, once per pass (:func:`synchronize`) or once when the loader is
prepared (:func:`agree_at_prepare`, which also compares what each process was given).
:class:`Shuffles` finds them under a loader: its seedable samplers (their seeds go into a position)
and the generator a shuffling sampler draws from (its state goes into a position).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardplug.core._internal.collectives import all_gather_objects, broadcast_object, global_rank, world_size
from shardplug.core.shuffle.rng import apply_rng_states, rng_states
from shardplug.core.shuffle.seedable import SeedableRandomSampler, sampler_kind

__all__ = ["Shuffles", "synchronize", "agree_at_prepare", "check_same_data"]


class Shuffles:
    """The shuffles of one loader: ``plan_sampler`` is the index sampler its plan shares out
    (:attr:`~shardplug.core.sharding.shard_plan.ShardPlan.sampler`), ``loader_sampler`` the DataLoader's own.
    What they are is found once, when the loader is prepared: ``seedable``, the seedable samplers (each once),
    whose seeds are agreed and saved; ``generator``, the generator a shuffling index sampler draws its order
    from (its ``generator``), if any.

    Example::

        >>> from shardplug.core.shuffle.seedable import SeedableRandomSampler
        >>> sampler = SeedableRandomSampler(range(4), data_seed=3)
        >>> shuffles = Shuffles(sampler, sampler)
        >>> len(shuffles.seedable), shuffles.generator, shuffles.seeds()
        (1, None, (3,))
    """

    __slots__ = ("plan_sampler", "loader_sampler", "seedable", "generator")

    def __init__(self, plan_sampler: Any, loader_sampler: Any) -> None:
        self.plan_sampler = plan_sampler
        self.loader_sampler = loader_sampler
        found: list[SeedableRandomSampler] = []
        for sampler in (loader_sampler, plan_sampler):
            if isinstance(sampler, SeedableRandomSampler) and all(sampler is not f for f in found):
                found.append(sampler)
        self.seedable = found
        generator = None
        if plan_sampler is not None and not isinstance(plan_sampler, SeedableRandomSampler):
            generator = getattr(plan_sampler, "generator", None)
        self.generator: torch.Generator | None = generator if isinstance(generator, torch.Generator) else None

    def seeds(self) -> tuple[int | None, ...]:
        return tuple(s.seed for s in self.seedable)

    def restore(self, seeds: Iterable[int | None], generator_state: torch.Tensor | None) -> None:
        """Seeds and generator state as a position saved them."""
        for sampler, seed in zip(self.seedable, seeds):
            sampler.seed = seed
        generator = self.generator
        if generator is not None and generator_state is not None:
            generator.set_state(generator_state.clone())

    def kind(self, stream: bool) -> str:
        """What a position names as its sampler (``"stream"`` for a stream)."""
        return "stream" if stream else sampler_kind(self.plan_sampler or self.loader_sampler)


def synchronize(
    samplers: list[SeedableRandomSampler], rng_types: tuple[str, ...], synchronized_generator: torch.Generator | None
) -> None:
    """Agree the shuffle seeds still to agree and the named RNG states with process 0 (one broadcast)."""
    unseeded = []
    for sampler in samplers:  # a loop, not a comprehension: no call of its own at each pass's start
        if sampler.seed_to_agree:
            unseeded.append(sampler)
    names = rng_types
    if synchronized_generator is not None and "generator" not in names:
        names = names + ("generator",)
    if not unseeded and not names:
        return
    payload = None
    if global_rank() == 0:
        seeds = [s.resolve_seed() for s in unseeded]
        payload = (seeds, rng_states(names, synchronized_generator))
    seeds, states = broadcast_object(payload, what="the seeds of the shuffles and the states of the RNGs to agree")
    for sampler, seed in zip(unseeded, seeds):
        sampler.seed = seed
    apply_rng_states(states, synchronized_generator)


def agree_at_prepare(samplers: list[SeedableRandomSampler], data: tuple[int | None, int | None] | None) -> None:
    """Agree the shuffle seeds still to agree (unset, or a generator's: see
    :attr:`~shardplug.core.shuffle.seedable.SeedableRandomSampler.seed_to_agree`) with process 0 now, in one
    all-gather that also compares every process's ``data`` (dataset length, batch size): a mismatch
    is a ``ValueError`` on every process.

    Only where a seed must be agreed (such a shuffle and a process group): the collective then
    replaces the one the first pass would make (:func:`synchronize`), so there is none extra; without
    one nothing is compared (``data=None``: also where only process 0 reads, i.e. dispatch)."""
    unseeded = [s for s in samplers if s.seed_to_agree]
    if not unseeded or world_size() == 1:
        return
    seeds = [s.resolve_seed() for s in unseeded] if global_rank() == 0 else None
    everyone = all_gather_objects(
        (seeds, data), what="process 0's shuffle seed and every dataset length and batch size"
    )
    for sampler, seed in zip(unseeded, everyone[0][0]):
        sampler.seed = seed
    if data is not None:
        check_same_data([theirs for _, theirs in everyone], global_rank())


def check_same_data(data: list[Any], rank: int) -> None:
    """Refuse processes whose (dataset length, batch size) differ (``data`` by rank): their passes would
    yield different numbers of batches, and the first collective after the shorter one would block
    until the process group's timeout."""
    other = next((j for j, theirs in enumerate(data) if theirs != data[0]), None)
    if other is None:
        return
    first, second = 0, other  # the same pair named on every process
    (n1, b1), (n2, b2) = data[first], data[second]
    what = (
        f"a dataset of {n1} samples on process {first} and of {n2} on process {second}"
        if n1 != n2
        else f"batch_size={b1} on process {first} and batch_size={b2} on process {second}"
    )
    raise ValueError(
        f"prepare_data_loader was given {what} (this is process {rank}); the processes would yield different "
        "numbers of batches and the first collective after the shorter pass (a DDP all-reduce) would block until "
        "the process group's timeout. Give every process the same dataset and batch size: shardplug gives each "
        "process its part"
    )
