"""Shuffles every process draws alike: seeds, the seedable sampler, and one epoch's order.

Example::

    >>> s = SeedableRandomSampler(range(5), data_seed=7)
    >>> s.set_epoch(1)
    >>> sorted(s) == [0, 1, 2, 3, 4]
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

import torch
from torch.utils.data import RandomSampler
from torch.utils.data.distributed import DistributedSampler

from shardplug.core._internal.arguments import is_int

__all__ = [
    "SeedableRandomSampler",
    "BijectiveRandomSampler",
    "KeyedPermutation",
    "SHUFFLE_ALGORITHMS",
    "check_seed",
    "check_shuffle_algorithm",
    "draw_seed",
    "epoch_seed",
    "sampler_kind",
]

_SEED_SPACE = 2**64
_MASK64 = _SEED_SPACE - 1
_MASK32 = 2**32 - 1

SHUFFLE_ALGORITHMS = ("randperm", "bijective")
"""``"randperm"``: one ``torch.randperm`` per epoch (the reference's orders); ``"bijective"``: a
keyed bijection evaluated where it is needed (:class:`KeyedPermutation`), for datasets too large
to hold a permutation per process."""


def check_seed(name: str, seed: Any) -> int | None:
    """``seed`` when it is ``None`` or an integer torch accepts as a seed, else a clear error."""
    if seed is None:
        return None
    if not is_int(seed):
        raise TypeError(f"{name}={seed!r} is invalid: it must be an integer or None")
    if not -(2**63) <= seed < _SEED_SPACE:
        raise ValueError(f"{name}={seed} is out of range: torch seeds lie in [-2**63, 2**64); pick a smaller seed")
    return seed


def check_shuffle_algorithm(algorithm: Any) -> str:
    """``algorithm`` when it names a shuffle (:data:`SHUFFLE_ALGORITHMS`), else a clear error."""
    if algorithm not in SHUFFLE_ALGORITHMS:
        raise ValueError(
            f"shuffle_algorithm={algorithm!r} is invalid: it must be one of {list(SHUFFLE_ALGORITHMS)} "
            "('randperm': torch.randperm per epoch, the default; 'bijective': no permutation in memory)"
        )
    return cast("str", algorithm)


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
    With ``data_seed=None`` the seed is ``generator.initial_seed()`` when a ``generator`` is given,
    else drawn from the global torch RNG at the first iteration.  Neither is known to be the same
    on every process (:attr:`seed_to_agree`): a prepared loader takes process 0's where a process
    group runs, so all processes share it; a seed set later (``data_seed``, a position) is kept.

    Example::

        >>> a, b = SeedableRandomSampler(range(6), data_seed=3), SeedableRandomSampler(range(6), data_seed=3)
        >>> list(a) == list(b)
        True
        >>> s = SeedableRandomSampler(range(6), generator=torch.Generator().manual_seed(5))
        >>> s.seed, s.seed_to_agree
        (5, True)
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=None)
        from_generator = data_seed is None and generator is not None
        if data_seed is None and generator is not None:
            data_seed = generator.initial_seed()
        self.seed = check_seed("data_seed", data_seed)
        self._from_generator = from_generator
        self.epoch = 0

    @property
    def seed(self) -> int | None:
        """The seed of epoch 0's order (``None``: not drawn yet)."""
        return self._seed

    @seed.setter
    def seed(self, seed: int | None) -> None:
        self._seed = seed
        self._from_generator = False  # set on purpose (agreed, restored): no longer the generator's

    @property
    def seed_to_agree(self) -> bool:
        """Whether processes may hold different seeds: none drawn yet, or a generator's ``initial_seed()``
        (a generator seeded per process, as ``torch.Generator().manual_seed(rank)``)."""
        return self._seed is None or self._from_generator

    def take_seed(self, other: SeedableRandomSampler) -> None:
        """Use ``other``'s seed, still to agree where ``other``'s is (:attr:`seed_to_agree`)."""
        self._seed, self._from_generator = other._seed, other._from_generator

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def resolve_seed(self) -> int:
        if self._seed is None:
            self.seed = draw_seed()
        return self._seed  # type: ignore[return-value]

    def _epoch_generator(self) -> torch.Generator:
        seed = self._seed if self._seed is not None else self.resolve_seed()
        return torch.Generator().manual_seed(epoch_seed(seed, self.epoch))

    def index_order(self) -> torch.Tensor | None:
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


def _splitmix64(value: int) -> int:
    """One step of the SplitMix64 generator: a well-mixed 64-bit function of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class KeyedPermutation:
    """A permutation of ``[0, n)`` keyed by ``(seed, epoch)``, evaluated, never stored.

    A Feistel network over the ``b`` bits that hold ``n`` (``2**b < 2n``; the halves differ by
    one bit when ``b`` is odd), with round keys drawn from ``(seed, epoch)`` by SplitMix64 and a
    keyed multiply-shift hash as round function.  Values that land outside ``[0, n)`` walk the
    cycle again until they are inside (cycle-walking: fewer than 2 steps expected), which keeps it
    a bijection of ``[0, n)``.  Every operation is a vectorised torch integer op (never past
    ``2**63``), so ``perm(positions)`` costs O(len(positions)) whatever ``n`` (up to ``2**62``),
    and gives the same indices on every process, rerun and number of processes.

    Example::

        >>> perm = KeyedPermutation(10, seed=3, epoch=0)
        >>> sorted(perm(torch.arange(10)).tolist()) == list(range(10))
        True
        >>> perm(torch.tensor([7])).item() == perm(torch.arange(10))[7].item()
        True
    """

    rounds = 6

    def __init__(self, n: int, seed: int, epoch: int = 0) -> None:
        if not is_int(n) or not 0 <= n <= 2**62:
            raise ValueError(f"n={n!r} is invalid: a keyed permutation covers 0 <= n <= 2**62 samples")
        self.n = n
        self.bits = max((n - 1).bit_length(), 2)
        state = _splitmix64((epoch_seed(seed, epoch) ^ 0x5348415244504C55) & _MASK64)  # "SHARDPLU"
        keys = []
        for _ in range(self.rounds):
            state = _splitmix64(state)
            keys.append((state & _MASK32, (state >> 33) | 1))  # (xor key, odd multiplier < 2**31)
        self.keys = tuple(keys)

    def _encrypt(self, values: torch.Tensor) -> torch.Tensor:
        """One pass of the Feistel network over ``bits``-bit values (a bijection of ``[0, 2**bits)``).

        Works in place on ``values`` (two temporaries per round: this is the hot loop)."""
        low = self.bits // 2  # bits of the right half; the left half has bits - low
        for key, multiplier in self.keys:
            high = self.bits - low
            right = values & ((1 << low) - 1)
            # right ^ key < 2**32 and multiplier < 2**31: the product stays below 2**63 (no overflow)
            mixed = (
                torch.bitwise_xor(right, key).mul_(multiplier).bitwise_right_shift_(15).bitwise_and_((1 << high) - 1)
            )
            mixed.bitwise_xor_(values.bitwise_right_shift_(low))  # left ^ f(right)
            values = right.bitwise_left_shift_(high).bitwise_or_(mixed)  # (right, left ^ f(right))
            low = high  # the halves trade places (and sizes, when bits is odd)
        return values

    def at(self, position: int) -> int:
        """The index at one ``position`` (in ``[0, n)``), with Python integers: the same network as
        :meth:`__call__` (every value stays below ``2**63``), without a tensor per call (for a few positions)."""
        rounds = self._int_rounds or self.int_rounds()
        n, value = self.n, position
        while True:  # cycle-walking, as __call__
            for key, multiplier, low, low_mask, high, high_mask in rounds:
                right = value & low_mask
                value = (right << high) | (((((right ^ key) * multiplier) >> 15) & high_mask) ^ (value >> low))
            if value < n:
                return value

    _int_rounds: tuple[tuple[int, int, int, int, int, int], ...] | None = None

    def int_rounds(self) -> tuple[tuple[int, int, int, int, int, int], ...]:
        """Each round of :meth:`_encrypt` as constants: (key, multiplier, low, low mask, high, high mask), the
        ``bits`` split as :meth:`_encrypt` splits them (what :meth:`at` computes with; computed once)."""
        if self._int_rounds is None:
            rounds, low = [], self.bits // 2
            for key, multiplier in self.keys:
                high = self.bits - low
                rounds.append((key, multiplier, low, (1 << low) - 1, high, (1 << high) - 1))
                low = high
            self._int_rounds = tuple(rounds)
        return self._int_rounds

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The indices at ``positions`` (int64, each in ``[0, n)``) of this epoch's order."""
        out = self._encrypt(positions.to(torch.int64, copy=True))
        flat = out.view(-1)
        todo = torch.nonzero(flat >= self.n).flatten()
        while todo.numel():  # cycle-walking: every chain ends inside [0, n)
            walked = self._encrypt(flat[todo])  # (indexing copies)
            flat[todo] = walked
            todo = todo[walked >= self.n]
        return out


class BijectiveRandomSampler(SeedableRandomSampler):
    """A shuffle for datasets of any size: position ``k`` of epoch ``e``'s order is
    ``KeyedPermutation(n, seed, e)(k)``, computed where it is needed (no permutation in memory).

    A prepared loader computes each process's rows from it directly: O(n / N) work per process
    and epoch, O(batch) for the first batch and for any resume point.  Orders differ from
    ``torch.randperm``'s (use :class:`SeedableRandomSampler` for the reference's orders).

    Example::

        >>> s = BijectiveRandomSampler(range(6), data_seed=1)
        >>> sorted(s) == list(range(6)), list(s) == list(BijectiveRandomSampler(range(6), data_seed=1))
        (True, True)
    """

    def __init__(
        self, data_source: Sized, data_seed: int | None = None, generator: torch.Generator | None = None
    ) -> None:
        super().__init__(data_source, generator=generator, data_seed=data_seed)

    def permutation(self) -> KeyedPermutation:
        """This epoch's order, as a function of positions."""
        return KeyedPermutation(len(self.data_source), self.resolve_seed(), self.epoch)

    def index_order(self) -> torch.Tensor | None:
        return None  # never materialised: see permutation()

    def __iter__(self) -> Iterator[int]:
        perm, n = self.permutation(), len(self.data_source)
        for start in range(0, n, 1 << 16):
            yield from perm(torch.arange(start, min(start + (1 << 16), n), dtype=torch.int64)).tolist()


def sampler_kind(sampler: Any) -> str:
    """A short name of the kind of index sampler (recorded in positions)."""
    if sampler is None:
        return "none"
    if isinstance(sampler, BijectiveRandomSampler):
        return "bijective_random"
    if isinstance(sampler, SeedableRandomSampler):
        return "seedable_random"
    if isinstance(sampler, DistributedSampler):  # its order is its options': a position names them
        return f"DistributedSampler(shuffle={sampler.shuffle}, seed={sampler.seed}, drop_last={sampler.drop_last})"
    return type(sampler).__name__


_RANDPERM_SIMPLE_BELOW = (2**32 - 1) // 20
"""torch's CPU ``randperm(n)`` draws one 32-bit number per position below this size (a Fisher-Yates
shuffle); above it, another algorithm."""
_ADVANCE_CHUNK = 1 << 20
_advance_matches: list[bool] = []  # whether the cheap advance was checked to equal randperm's (once)


def _cheap_advance(generator: torch.Generator, n: int) -> None:
    """Draw the ``n - 1`` 32-bit numbers a small CPU ``randperm(n)`` draws, without shuffling."""
    left = n - 1
    while left > 0:
        count = min(left, _ADVANCE_CHUNK)
        torch.empty(count, dtype=torch.int32).random_(generator=generator)
        left -= count


def _cheap_advance_matches() -> bool:
    """Whether :func:`_cheap_advance` leaves a generator where ``randperm`` does, in this torch (checked once)."""
    if not _advance_matches:
        same = True
        for n in (2, 1000, 3 * _ADVANCE_CHUNK // 2):
            by_perm, by_draws = torch.Generator().manual_seed(n), torch.Generator().manual_seed(n)
            torch.randperm(n, generator=by_perm)
            _cheap_advance(by_draws, n)
            same = same and torch.equal(by_perm.get_state(), by_draws.get_state())
        _advance_matches.append(same)
    return _advance_matches[0]


def advance_past_randperm(generator: torch.Generator, n: int) -> None:
    """Leave ``generator`` where ``torch.randperm(n, generator=generator)`` would, without the
    permutation where that is known to be exact (a CPU generator, ``n`` below torch's threshold:
    about 7x faster); otherwise by drawing it."""
    if generator.device.type == "cpu" and 1 < n < _RANDPERM_SIMPLE_BELOW and _cheap_advance_matches():
        _cheap_advance(generator, n)
    else:
        torch.randperm(n, generator=generator)
