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

import numpy as np

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

    def node_table(self, codes: Mapping[str, int]) -> np.ndarray | None:
        """The tree as rows of int64 for :func:`_descend` (``None`` where a node's units reach ``2**33``, which
        its bounds do not cover): a node's row is (left units >> 16, left units & 0xFFFF, left units, units, theta,
        left child's row, right child's row, source code); a leaf ``(0, 0, 0, 1, 0, itself, itself, its code)``
        keeps a row where it is (it never goes left, and ``n - 0`` is ``n``), internal nodes have code -1."""
        rows: list[list[int]] = []

        def add(node: Any) -> int:
            at = len(rows)
            rows.append([])
            if isinstance(node, str):
                rows[at] = [0, 0, 0, 1, 0, at, at, codes[node]]
                return at
            left_units, total, theta, left_tree, right_tree = node
            left, right = add(left_tree), add(right_tree)
            # a node of 0 units is never reached (its parent sends nothing its way): 1 only keeps the division defined
            rows[at] = [left_units >> 16, left_units & 0xFFFF, left_units, max(total, 1), theta, left, right, -1]
            return at

        add(self.tree)
        if max(row[3] for row in rows) >= _UNITS_BOUND:
            return None
        return np.array(rows, dtype=np.int64)

    def depth(self) -> int:
        """The most nodes between the root and a leaf (0 for one source)."""
        deepest, stack = 0, [(self.tree, 0)]
        while stack:
            node, d = stack.pop()
            if isinstance(node, str):
                deepest = max(deepest, d)
            else:
                stack += [(node[3], d + 1), (node[4], d + 1)]
        return deepest


def _ahead_first(size: int) -> int:
    """Batches of ``size`` positions :meth:`MixtureOrder.locate_batch` reads ahead at first."""
    return max(4, -(-_AHEAD_FIRST // size))


class _Vector(NamedTuple):
    """An order's numbers for :meth:`MixtureOrder.locate_arrays`: per segment its node table and depth, and each
    source's draws before it (a row per segment, a column per code); each source's length; the starts."""

    tables: list[np.ndarray]
    depths: list[int]
    counts: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray


class _Ahead(NamedTuple):
    """Batches :meth:`MixtureOrder.locate_batch` located ahead: ``batches`` runs of ``size`` consecutive
    positions, the ``k``-th from ``first + k * stride``; their codes and samples, a row per batch."""

    first: int
    stride: int
    size: int
    batches: int
    codes: np.ndarray
    samples: np.ndarray


_ARRAYS_FROM = 64
"""Fewer positions than this go one by one (numpy's cost per call is more than theirs)."""
_WALKED_ONE_BY_ONE = 48
"""The chains of a cycle-walk that go on in numpy while more than this many are left; the last ones go on with
Python integers (a pass of the Feistel rounds costs numpy about 50 calls, whatever the rows)."""
_AHEAD_FIRST = 512
_AHEAD_MOST = 4096
"""Positions :meth:`MixtureOrder.locate_batch` locates at once, in whole batches: at first (4 batches at least),
and at most (4,096 positions take about a millisecond and 64 KiB, 0.25 us each)."""

_UNITS_BOUND = 2**33
"""A node's units stay below it (quantised weights sum to about 2**32): the bounds of :func:`_descend`."""
_POSITIONS_BOUND = 2**62
"""Positions (and so draws, offsets, cycles) the vectorised path takes stay below it (the bounds of
:func:`_descend` and :func:`_encrypt_rows`); the rest go one by one with Python integers."""


def _descend(table: np.ndarray, depth: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`_Segment.which` for every one of ``offsets`` at once: (source codes, positions before each of
    them that are its source's).  ``table``: :meth:`_Segment.node_table`.

    At a node, with ``n`` the row's offset there, ``L``, ``T``, ``theta`` the node's: ``before`` is
    ``(n * L + theta) // T`` and the row goes left when ``(n * L + theta) % T + L >= T`` (``(n + 1) * L + theta``
    crosses the next multiple of ``T``; ``L <= T``, so once at most): the scalar rule.  ``n * L`` would pass
    2**63, so it is split: ``n = q * T + r``, ``L = Lh * 2**16 + Ll``, ``r * Lh = a1 * T + m1`` and
    ``m1 * 2**16 + r * Ll + theta = a2 * T + m``, hence ``n * L + theta = (q * L + a1 * 2**16 + a2) * T + m``.
    No int64 overflows: ``n < 2**62`` (:data:`_POSITIONS_BOUND`; ``before <= n``), ``L <= T < 2**33``
    (:data:`_UNITS_BOUND`), ``theta < T``; so ``q * L <= n``, ``r * Lh < 2**33 * 2**17 = 2**50``,
    ``a1 < 2**17``, ``m1 * 2**16 < 2**49``, ``r * Ll < 2**49``, their sum with ``theta`` below ``2**51``,
    ``m + L < 2**34``.
    """
    node = np.zeros(offsets.shape, dtype=np.int64)
    n = offsets
    columns = table.T.copy()
    for _ in range(depth):
        high, low, units_left, units, theta, left_child, right_child, _code = columns[:, node]
        q, r = np.divmod(n, units)
        a1, m1 = np.divmod(r * high, units)
        m1 <<= 16
        m1 += r * low
        m1 += theta
        a2, m = np.divmod(m1, units)
        before = q * units_left
        before += a1 << 16
        before += a2
        m += units_left
        left = m >= units
        n = np.where(left, before, n - before)
        node = np.where(left, left_child, right_child)
    return table[node, 7], n


def _encrypt_rows(values: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """One pass of :class:`KeyedPermutation`'s Feistel network over ``values`` (int64), each row with its own
    permutation's rounds: ``rounds[6 * k : 6 * k + 6]`` (rows of a table) are round ``k``'s (key, multiplier,
    low, low mask, high, high mask), as :meth:`KeyedPermutation.at` takes them, so the values are its (``values``
    is written over).  No int64 overflows: a value has ``bits <= 62`` bits (``n <= 2**62``), so ``right`` has
    ``low <= 31``; ``right ^ key < 2**32`` and the multiplier ``< 2**31`` (their product ``< 2**63``);
    ``right << high < 2**bits``."""
    for k in range(0, len(rounds), 6):
        key, multiplier, low, low_mask, high, high_mask = rounds[k : k + 6]
        right = values & low_mask
        mixed = right ^ key
        mixed *= multiplier
        mixed >>= 15
        mixed &= high_mask
        values >>= low
        mixed ^= values
        right <<= high
        right |= mixed
        values = right
    return values


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
        self.names = sorted(set(self.lengths).union(*(segment.weights for segment in self.segments)))
        """Every source's name, sorted: a source's *code* (:meth:`locate_arrays`) is its index here."""
        self._vector: _Vector | bool | None = None  # built at the first locate_arrays (False: it cannot be)
        self._rounds: dict[tuple[int, int], list[int]] = {}
        self._ahead: _Ahead | None = None
        self._last: tuple[int, int] | None = None  # (first position, size) of the batch locate_batch read last
        self._ahead_count = 0  # batches to read ahead next (set by locate_batch)

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
        """The :class:`Draw` at each of ``positions`` (:meth:`locate_arrays` for many, else one by one)."""
        if len(positions) >= _ARRAYS_FROM:
            arrays = self.locate_arrays(positions)
            if arrays is not None:
                names = self.names
                return [Draw(names[c], *rest) for c, *rest in zip(*(a.tolist() for a in arrays))]
        return self.locate_each(positions)

    def locate_each(self, positions: Sequence[int]) -> list[Draw]:
        """The :class:`Draw` at each of ``positions``, one by one with Python integers (a handful of operations
        each; any position)."""
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

    def locate_arrays(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, ...] | None:
        """(codes, draws, cycles, samples) at ``positions``, int64 arrays, the values of :meth:`locate_each` (a
        source as its index in :attr:`names`), each step one numpy operation over all of them; ``None`` where
        this path does not go (a position that is not an integer in ``[0, 2**62)``, an order whose numbers
        would not fit in int64): :meth:`locate_each` then."""
        vector = self._vectorised()
        at = np.asarray(positions)
        if vector is None or at.dtype.kind not in "iu" or at.ndim != 1:
            return None
        if at.size and (at.min() < 0 or at.max() >= _POSITIONS_BOUND):
            return None
        at = at.astype(np.int64, copy=False)
        if len(self.segments) == 1:
            codes, n = _descend(vector.tables[0], vector.depths[0], at)
            draws = vector.counts[0][codes] + n
        else:
            segment = np.searchsorted(vector.starts, at, side="right") - 1
            codes, draws = np.empty_like(at), np.empty_like(at)
            for k in np.unique(segment).tolist():  # one or two in a batch
                rows = np.flatnonzero(segment == k)
                codes[rows], n = _descend(vector.tables[k], vector.depths[k], at[rows] - vector.starts[k])
                draws[rows] = vector.counts[k][codes[rows]] + n
        cycles, inside = np.divmod(draws, vector.lengths[codes])
        return codes, draws, cycles, self._permute(codes, cycles, inside)

    def _permute(self, codes: np.ndarray, cycles: np.ndarray, inside: np.ndarray) -> np.ndarray:
        """``permutation(names[code], cycle).at(inside)`` for every row (walking the cycle as
        :meth:`~shardplug.core.shuffle.seedable.KeyedPermutation.at` does)."""
        if not len(codes):
            return inside
        by = np.lexsort((cycles, codes))  # the rows of each (source, cycle) together
        code, cycle = codes[by], cycles[by]
        first = np.empty(len(by), dtype=bool)
        first[0] = True
        np.not_equal(code[1:], code[:-1], out=first[1:])
        first[1:] |= cycle[1:] != cycle[:-1]
        which = np.empty_like(by)
        which[by] = np.cumsum(first) - 1  # each row's (source, cycle) among the distinct ones
        pairs = list(zip(code[first].tolist(), cycle[first].tolist()))
        # row 6 * k + j: round k's j-th constant (as KeyedPermutation.int_rounds), row 36: n
        table = np.array([self._rounds_of(c, y) for c, y in pairs], dtype=np.int64).T[:, which]
        samples = _encrypt_rows(inside, table[:-1])
        walking = np.flatnonzero(samples >= table[-1])
        while len(walking) > _WALKED_ONE_BY_ONE:  # cycle-walking: every chain ends inside [0, n)
            rows = table[:, walking]
            walked = _encrypt_rows(samples[walking], rows[:-1])
            samples[walking] = walked
            walking = walking[walked >= rows[-1]]
        for k, value, pair in zip(walking.tolist(), samples[walking].tolist(), which[walking].tolist()):
            c, y = pairs[pair]  # at(value) walks on from value: the same chain
            samples[k] = self.permutation(self.names[c], y).at(value)
        return samples

    def _rounds_of(self, code: int, cycle: int) -> list[int]:
        """The constants of ``permutation(names[code], cycle)``: its rounds' (key, multiplier, low, low mask,
        high, high mask), then ``n``."""
        rounds = self._rounds.get((code, cycle))
        if rounds is None:
            if len(self._rounds) >= _PERMUTATIONS_KEPT:
                self._rounds.clear()
            perm = self.permutation(self.names[code], cycle)
            rounds = self._rounds[code, cycle] = [value for step in perm.int_rounds() for value in step] + [perm.n]
        return rounds

    def _vectorised(self) -> _Vector | None:
        if self._vector is None:
            codes = {name: k for k, name in enumerate(self.names)}
            tables = [segment.node_table(codes) for segment in self.segments]
            lengths = [self.lengths.get(name, 0) for name in self.names]
            self._vector = False
            # every source drawn has a length (else locate_each names the missing one), and numbers in int64
            if all(table is not None for table in tables) and min(lengths) >= 1 and self.starts[-1] < _POSITIONS_BOUND:
                counts = np.zeros((len(self.segments), len(self.names)), dtype=np.int64)
                for k, segment in enumerate(self.segments):
                    for name, count in segment.counts.items():
                        counts[k, codes[name]] = count  # <= the segment's start
                self._vector = _Vector(
                    tables,  # type: ignore[arg-type]
                    [segment.depth() for segment in self.segments],
                    counts,
                    np.array(lengths, dtype=np.int64),
                    np.array(self.starts, dtype=np.int64),
                )
        return self._vector if isinstance(self._vector, _Vector) else None

    def locate_batch(self, positions: Sequence[int]) -> tuple[list[int], list[int]]:
        """(codes, samples) at a batch's ``positions``, as :meth:`locate_arrays` (or :meth:`locate_each`) gives
        them, read ahead: a batch of consecutive positions that follows the previous one at a stride
        (``stride`` positions later, the same size: a process's, a worker's next batch) is located together
        with the next ones at that stride (``_AHEAD_FIRST`` positions, 4 batches at least; 4 times as many each
        time all of them were asked for, up to ``_AHEAD_MOST``); a batch among those is read from there.  So
        numpy's cost per call is shared by many batches.  A guess that misses costs time only: a batch is read
        from there only where all its positions are the ones located."""
        size = len(positions)
        first = positions[0] if size else None
        if type(first) is not int:
            return self._locate_rows(positions)
        ahead, last = self._ahead, self._last
        self._last = (first, size)
        consecutive = positions[-1] - first == size - 1 and positions == list(range(first, first + size))
        if ahead is not None and ahead.size == size and consecutive:
            k, rest = divmod(first - ahead.first, ahead.stride)
            if not rest and 0 <= k < ahead.batches:
                if k == ahead.batches - 1:  # read to its end: the next one is longer
                    self._ahead_count = max(min(4 * ahead.batches, _AHEAD_MOST // size), ahead.batches)
                return ahead.codes[k].tolist(), ahead.samples[k].tolist()
        if consecutive and last is not None and last[1] == size and first > last[0]:
            stride = first - last[0]
            going_on = ahead is not None and (ahead.stride, ahead.size) == (stride, size)
            count = self._ahead_count if going_on else _ahead_first(size)
            self._ahead_count = _ahead_first(size)  # unless this block is read to its end
            if first + stride * count + size < _POSITIONS_BOUND:
                block = first + stride * np.arange(count, dtype=np.int64)[:, None] + np.arange(size, dtype=np.int64)
                arrays = self.locate_arrays(block.ravel())
                if arrays is not None:
                    codes, samples = arrays[0].reshape(count, size), arrays[3].reshape(count, size)
                    self._ahead = _Ahead(first, stride, size, count, codes, samples)
                    return codes[0].tolist(), samples[0].tolist()
        return self._locate_rows(positions)

    def _locate_rows(self, positions: Sequence[int]) -> tuple[list[int], list[int]]:
        arrays = self.locate_arrays(positions) if len(positions) >= _ARRAYS_FROM else None
        if arrays is not None:
            return arrays[0].tolist(), arrays[3].tolist()
        codes = {name: k for k, name in enumerate(self.names)}
        draws = self.locate_each([int(p) for p in positions])
        return [codes[d.source] for d in draws], [d.sample for d in draws]

    def __getstate__(self) -> dict[str, Any]:
        """What a copy (a DataLoader worker's) takes: no caches."""
        state = self.__dict__.copy()
        state.update(_vector=None, _rounds={}, _ahead=None, _last=None, _ahead_count=0, _permutations={})
        return state

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
