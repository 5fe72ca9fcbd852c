"""Shuffles every process draws alike: seeds, the seedable sampler, and one epoch's order.

Example::

    >>> s = SeedableRandomSampler(range(5), data_seed=7)
    >>> s.set_epoch(1)
    >>> sorted(s) == [0, 1, 2, 3, 4]
    True
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sized

import torch
from torch.utils.data import RandomSampler, SequentialSampler

from .batch_plan import EpochOrder

__all__ = ["SeedableRandomSampler", "check_seed", "draw_seed", "epoch_seed", "epoch_order", "sampler_kind"]

_SEED_SPACE = 2**64


def check_seed(name: str, seed: Any) -> Optional[int]:
    """``seed`` when it is ``None`` or an integer torch accepts as a seed, else a clear error."""
    if seed is None:
        return None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"{name}={seed!r} is invalid: it must be an integer or None")
    if not -(2**63) <= seed < _SEED_SPACE:
        raise ValueError(f"{name}={seed} is out of range: torch seeds lie in [-2**63, 2**64); pick a smaller seed")
    return seed


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s order: ``seed + epoch``, wrapped into torch's seed range
    (torch reads a negative seed as its two's complement, so the wrap changes no order)."""
    return (seed + epoch) % _SEED_SPACE


def draw_seed() -> int:
    """A fresh seed from the global torch RNG (what ``RandomSampler`` draws when it has no generator)."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order in epoch ``e`` is a pure function of ``seed + e``.

    Every process that uses the same seed draws the same order, every epoch and every rerun.
    With ``data_seed=None`` the seed is drawn from the global torch RNG at the first iteration;
    a prepared loader agrees it from process 0 first, so all processes share it.

    Example::

        >>> a, b = SeedableRandomSampler(range(6), data_seed=3), SeedableRandomSampler(range(6), data_seed=3)
        >>> list(a) == list(b)
        True
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        data_seed: Optional[int] = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=None)
        if data_seed is None and generator is not None:
            data_seed = generator.initial_seed()
        self.seed: Optional[int] = check_seed("data_seed", data_seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resolve_seed(self) -> int:
        if self.seed is None:
            self.seed = draw_seed()
        return self.seed

    def _epoch_generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(epoch_seed(self.resolve_seed(), self.epoch))

    def index_order(self) -> Optional[torch.Tensor]:
        """This epoch's permutation, when the sampler draws exactly one (no replacement, all samples)."""
        if self.replacement or self.num_samples != len(self.data_source):
            return None
        return torch.randperm(len(self.data_source), generator=self._epoch_generator())

    def __iter__(self) -> Iterator[int]:
        order = self.index_order()
        if order is not None:
            yield from order.tolist()
            return
        generator, n = self._epoch_generator(), len(self.data_source)
        if self.replacement:
            yield from torch.randint(high=n, size=(self.num_samples,), dtype=torch.int64, generator=generator).tolist()
            return
        for _ in range(self.num_samples // n):
            yield from torch.randperm(n, generator=generator).tolist()
        yield from torch.randperm(n, generator=generator).tolist()[: self.num_samples % n]


def sampler_kind(sampler: Any) -> str:
    """A short name of the kind of index sampler (recorded in positions)."""
    if sampler is None:
        return "none"
    if isinstance(sampler, SeedableRandomSampler):
        return "seedable_random"
    return type(sampler).__name__


def epoch_order(sampler: Any) -> tuple[Optional[EpochOrder], Optional[torch.Generator]]:
    """The epoch order of a standard sampler, drawn exactly as iterating it would draw it.

    Returns ``(order, generator_to_advance)`` or ``(None, None)`` for other samplers.
    ``RandomSampler`` draws a second permutation when it is exhausted; the returned generator
    must draw it too, so that later epochs stay identical to the plain ``RandomSampler``'s.
    """
    if type(sampler) is SequentialSampler:
        return EpochOrder(len(sampler.data_source)), None
    if isinstance(sampler, SeedableRandomSampler):
        perm = sampler.index_order()
        return (EpochOrder(perm.numel(), perm), None) if perm is not None else (None, None)
    if type(sampler) is RandomSampler and not sampler.replacement:
        n = len(sampler.data_source)
        if sampler.num_samples != n or n == 0:
            return None, None
        generator = sampler.generator
        if generator is None:
            generator = torch.Generator().manual_seed(draw_seed())
        return EpochOrder(n, torch.randperm(n, generator=generator)), generator
    return None, None
