"""The order of a weighted mixture: which source, and which of its samples, at any global position.

A mixture's order is a pure function of its seed, its sources' lengths and its weights, evaluated at a
position in O(1) time and memory (no array, no replay): :class:`MixtureOrder`.

* **Which source.** The weights of a segment (a stretch of positions with one set of weights: the whole
  order, or one step of a schedule) are split in a binary tree over the sources' sorted names; at each
  node a Bresenham rule with a seeded phase ``theta`` sends the node's ``n``-th position left when
  ``floor(((n + 1) * Q_left + theta) / Q)`` exceeds ``floor((n * Q_left + theta) / Q)`` (``Q``: the node's
  weight, ``Q_left``: its left half's).  A node's left count before ``n`` is that floor, which never
  decreases and grows by at most one a position, so each source's count before a position is a few
  floors, and it lies within ``depth`` (the tree's, ``ceil(log2(sources))``) of ``position * weight``:
  over any 10,000 positions each share is within ``depth / 10,000`` of its weight (0.1 % up to 1,024
  sources).
* **Which sample.** A source is read in cycles: its ``k``-th draw is sample ``perm_c(k mod len)`` of cycle
  ``c = k // len``, ``perm_c`` a :class:`~shardplug.core.shuffle.seedable.KeyedPermutation` keyed by the
  seed, the source's name and ``c``: every sample once per cycle.
* **Segments.** A schedule's step, or new weights given where a run resumes, starts a segment at its
  position with the draws each source had there: nothing of a source's current cycle is repeated or
  skipped.  Positions before it keep the earlier segments (the saved state carries them).

Weights are quantised to integers (parts of ``2**32`` of their sum), so every process computes the same
order from the same floats.

Example::

    >>> order = MixtureOrder(seed=0, lengths={"a": 3, "b": 100}, segments=[(0, {"a": 1, "b": 1})])
    >>> [order.locate(p).source for p in range(6)].count("a")
    3
    >>> draws = [order.locate(p) for p in range(400) if order.locate(p).source == "a"][:6]
    >>> sorted(d.sample for d in draws[:3]) == [0, 1, 2] and [d.cycle for d in draws] == [0, 0, 0, 1, 1, 1]
    True
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from shardplug.core._internal.arguments import is_int
from shardplug.core.shuffle.seedable import KeyedPermutation, _splitmix64

__all__ = ["Draw", "MixtureOrder", "quantize_weights", "WEIGHT_UNITS"]

_MASK64 = 2**64 - 1
WEIGHT_UNITS = 2**32
"""The integer total a segment's weights are quantised to (a positive weight gets one unit at least)."""
_PERMUTATIONS_KEPT = 64


class Draw(NamedTuple):
    """What one global position of a mixture reads: ``source`` (its name), ``draw`` (how many of that
    source's samples the order drew before this one), ``cycle`` (``draw // len(source)``) and ``sample`` (the
    index into the source)."""

    source: str
    draw: int
    cycle: int
    sample: int


def quantize_weights(weights: Mapping[str, int | float]) -> dict[str, int]:
    """Weights as integers that sum to about :data:`WEIGHT_UNITS` (checked by the caller: finite, >= 0, a
    positive sum); a positive weight keeps one unit at least.

    Example::

        >>> quantize_weights({"a": 0.5, "b": 0.5, "c": 0})
        {'a': 2147483648, 'b': 2147483648, 'c': 0}
    """
    total = math.fsum(float(w) for w in weights.values())
    out = {}
    for name, weight in weights.items():
        units = round(float(weight) / total * WEIGHT_UNITS)
        out[name] = max(units, 1) if weight > 0 else 0
    return out


def _source_seed(seed: int, name: str) -> int:
    """The seed of ``name``'s permutations: a pure function of the mixture's seed and the name."""
    return _splitmix64((seed ^ (zlib.crc32(name.encode()) << 16)) & _MASK64) % 2**63


class _Segment:
    """One stretch of positions with one set of weights (quantised), from ``start``, with the draws
    each source had before ``start`` (``counts``)."""

    __slots__ = ("start", "weights", "names", "tree", "counts")

    def __init__(self, seed: int, start: int, weights: Mapping[str, int], counts: Mapping[str, int]) -> None:
        self.start = start
        self.weights = dict(weights)
        self.names = sorted(weights)
        self.counts = dict(counts)
        self.tree = self._build(seed, 0, len(self.names), [self.weights[name] for name in self.names])
        """A leaf is a source's name; a node ``(left units, units, theta, left subtree, right subtree)``."""

    def _build(self, seed: int, lo: int, hi: int, units: list[int]) -> Any:
        if hi - lo == 1:
            return self.names[lo]
        mid = (lo + hi) // 2
        left, total = sum(units[lo:mid]), sum(units[lo:hi])
        key = (seed ^ _splitmix64((self.start * 0x9E3779B1 + (lo << 20) + hi) & _MASK64)) & _MASK64
        theta = _splitmix64(key) % total if total else 0
        return (left, total, theta, self._build(seed, lo, mid, units), self._build(seed, mid, hi, units))

    def draws_before(self, offset: int) -> dict[str, int]:
        """Each source's positions among the segment's first ``offset`` (they sum to ``offset``)."""
        out: dict[str, int] = {}
        stack = [(self.tree, offset)]
        while stack:
            node, n = stack.pop()
            if isinstance(node, str):
                out[node] = n
                continue
            left_units, total, theta, left_tree, right_tree = node
            left = (n * left_units + theta) // total if total else 0
            stack.append((left_tree, left))
            stack.append((right_tree, n - left))
        return out

    def which(self, offset: int) -> tuple[str, int]:
        """The source of the segment's position ``offset``, and how many of the segment's positions before
        it are that source's."""
        node, n = self.tree, offset
        while type(node) is tuple:
            left_units, total, theta, left_tree, right_tree = node
            before = (n * left_units + theta) // total
            if ((n + 1) * left_units + theta) // total > before:
                node, n = left_tree, before
            else:
                node, n = right_tree, n - before
        return node, n


class MixtureOrder:
    """The (source, sample) at every global position of a mixture (see the module docstring).

    ``lengths``: each source's length; ``segments``: ``(start, weights)`` pairs, the first at 0, starts
    increasing, weights quantised (:func:`quantize_weights`) and naming sources of ``lengths``.
    """

    def __init__(
        self, seed: int, lengths: Mapping[str, int], segments: Sequence[tuple[int, Mapping[str, int]]]
    ) -> None:
        self.seed = int(seed)
        self.lengths = dict(lengths)
        if not segments or segments[0][0] != 0:
            raise ValueError(f"a mixture order's segments must start at position 0, got {list(segments)[:1]}")
        self.segments: list[_Segment] = []
        counts = dict.fromkeys(self.lengths, 0)
        for k, (start, weights) in enumerate(segments):
            if k:
                previous = self.segments[-1]
                if start <= previous.start:
                    raise ValueError(
                        f"a mixture order's segment starts must increase, got {start} after {previous.start}"
                    )
                for name, n in previous.draws_before(start - previous.start).items():
                    counts[name] = counts.get(name, 0) + n
            self.segments.append(_Segment(self.seed, int(start), weights, counts))
        self.starts = [segment.start for segment in self.segments]
        self._permutations: dict[tuple[str, int], KeyedPermutation] = {}

    def _segment(self, position: int) -> _Segment:
        if type(position) is not int and not is_int(position) or position < 0:
            raise IndexError(f"position={position!r} is invalid: a mixture's positions are integers >= 0")
        if len(self.segments) == 1:
            return self.segments[0]
        return self.segments[bisect.bisect_right(self.starts, position) - 1]

    def counts_at(self, position: int) -> dict[str, int]:
        """How many samples of each source the positions before ``position`` drew."""
        segment = self._segment(position)
        counts = dict(segment.counts)
        for name, n in segment.draws_before(position - segment.start).items():
            counts[name] = counts.get(name, 0) + n
        return counts

    def weights_at(self, position: int) -> dict[str, int]:
        """The (quantised) weights in effect at ``position``."""
        return dict(self._segment(position).weights)

    def draw_of(self, position: int) -> tuple[str, int]:
        """(source, draw) at ``position``: the source's draw number, before its permutation."""
        segment = self._segment(position)
        name, n = segment.which(position - segment.start)
        return name, segment.counts.get(name, 0) + n

    def permutation(self, name: str, cycle: int) -> KeyedPermutation:
        """The order of ``name``'s samples in its ``cycle``-th cycle (a few kept: consecutive positions share them)."""
        key = (name, cycle)
        perm = self._permutations.get(key)
        if perm is None:
            if len(self._permutations) >= _PERMUTATIONS_KEPT:
                self._permutations.clear()
            perm = self._permutations[key] = KeyedPermutation(self.lengths[name], _source_seed(self.seed, name), cycle)
        return perm

    def locate(self, position: int) -> Draw:
        """The :class:`Draw` at ``position``."""
        return self.locate_many([position])[0]

    def locate_many(self, positions: Sequence[int]) -> list[Draw]:
        """The :class:`Draw` at each of ``positions`` (a handful of Python integer operations each)."""
        out = []
        lengths, permutations = self.lengths, self._permutations
        for p in positions:
            segment = self._segment(p)
            name, n = segment.which(p - segment.start)
            draw = segment.counts.get(name, 0) + n
            length = lengths.get(name)
            if length is None:
                raise KeyError(f"position {p} reads source {name!r}, which this mixture has no more")
            cycle, inside = divmod(draw, length)
            perm = permutations.get((name, cycle)) or self.permutation(name, cycle)
            out.append(Draw(name, draw, cycle, perm.at(inside)))
        return out

    # -- saving and continuing ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Plain values (loadable with ``torch.load(weights_only=True)``) that :meth:`from_state` reads back."""
        return {
            "seed": self.seed,
            "lengths": dict(self.lengths),
            "segments": [[s.start, dict(s.weights)] for s in self.segments],
        }

    @classmethod
    def from_state(cls, state: Any) -> MixtureOrder:
        """The order :meth:`state` described (a ``ValueError`` for anything else)."""
        try:
            return cls(state["seed"], state["lengths"], [(start, weights) for start, weights in state["segments"]])
        except (TypeError, KeyError, ValueError) as error:
            raise ValueError(
                f"the position's mixture state {state!r} is not one a Mixture saved ({error}); pass the "
                "loader.state_dict() of a loader over a Mixture, unchanged"
            ) from None

    def check_continues(self, configured: MixtureOrder) -> None:
        """Refuse to go on with ``configured`` from this saved order where no place would keep every source's
        cycle: another seed, or a source of another length."""
        if configured.seed != self.seed:
            raise ValueError(
                f"the position was saved by a Mixture with seed={self.seed} and this Mixture has seed="
                f"{configured.seed}: every source's order would change mid-cycle; build the Mixture with "
                f"seed={self.seed}"
            )
        for name, length in configured.lengths.items():
            if self.lengths.get(name, length) != length:
                raise ValueError(
                    f"source {name!r} had {self.lengths[name]} samples when the position was saved and has {length} "
                    "now: its cycles would read other samples; resume with the same source, or add the new one "
                    "under another name"
                )

    def continued(self, at: int, configured: MixtureOrder) -> MixtureOrder:
        """This (saved) order up to ``at``, then ``configured``'s weights: the segment in effect at ``at`` goes on
        where ``configured`` has the same weights there, else a segment starts at ``at`` with the draws every
        source had; ``configured``'s later steps follow.  ``configured`` itself when nothing differs."""
        self.check_continues(configured)
        kept = [(s.start, s.weights) for s in self.segments if s.start <= at]
        if configured.weights_at(at) != kept[-1][1]:
            if kept[-1][0] == at:  # a segment that starts where the run resumes: nothing of it was read
                kept.pop()
            kept.append((at, configured.weights_at(at)))
        kept += [(s.start, s.weights) for s in configured.segments if s.start > at]
        if kept == [(s.start, s.weights) for s in configured.segments]:
            return configured
        lengths = {**self.lengths, **configured.lengths}
        return MixtureOrder(self.seed, lengths, kept)
