"""Token-budget plans: one epoch's micro-batches for all processes at once, as pure functions.

A plan is a function of the samples' lengths, the budget (``max_tokens``), the cost balanced (``"tokens"``: the
sum of lengths, for packed rows; ``"padded"``: rows times the longest, for padded batches; ``"attention"``: the
sum of squared lengths), the seed, the epoch and the number of processes ``N``; every process computes it alike.

How an epoch is planned:

1. the samples are ranked by length (shortest first) and the ranking is cut into groups of ``K`` samples of
   about one length, ``K`` the number of windows (``n // window``; the ``n mod K`` shortest samples form a group of
   their own);
2. the epoch's windows: window ``w`` takes one sample of each group, drawn from ``(seed, epoch)`` (each group's
   ``K`` samples dealt at random to the ``K`` windows; the short group's to the last window), so every window is a
   random sample of the epoch with the same spread of lengths; their bounds in the epoch's order do not depend on
   ``N`` or the epoch, so a place at a window's start is the same on every number of processes;
3. each window's samples are dealt, longest first, into ``S`` steps of ``N`` micro-batches, by rounds: a step takes
   ``N`` consecutive samples of the sorted order (so of about one length), the longest ones to the step with the
   fewest tokens, and inside the step the longest to its least costly micro-batch, always under ``max_tokens``.
   For ``"padded"`` the sorted samples are cut into runs of rows times the longest within the budget instead (a
   micro-batch holds samples of nearly one length), and the runs, sorted by cost, are taken ``N`` at a time.
   ``S`` is the same for every window of the epoch (the last one, with the short group, its own) and every epoch
   (:class:`Strata`): the fewest steps that fit a window of each group's longest sample; where the window's own
   samples dealt into ``S`` steps do not fit, they take the places that window of longest samples has (each
   sample no longer than the one it stands for);
4. the window's steps are shuffled; step ``s`` gives process ``p`` its micro-batch ``s * N + p``.

Every process therefore has the same number of micro-batches.  A step whose ``N`` micro-batches cannot all hold
a sample (a window with fewer samples than its micro-batches: long samples, or the epoch's last few) is padded
with the window's shortest sample, marked as padding (a micro-batch of ``0`` real samples), or dropped with
``drop_last`` (its samples then count as consumed).

Every epoch on ``N`` processes therefore has the same number of steps, counted without planning it
(:meth:`Strata.steps_through`).  An :class:`EpochPlan` plans its windows as they are asked for (a step, a place):
the first batch of a pass, also of a resumed one, plans the place's window only.  The plan does not depend on the
order they are asked in.

A place in an epoch is the number of samples the steps before it consumed (:attr:`EpochPlan.consumed`), with,
inside a window, the numbers of processes the window was planned for (:data:`Replans`): on another number of
processes the rest of the window is planned again for it, then the next windows as usual, so every remaining
sample comes once, in equal steps.

Example::

    >>> plan = plan_epoch(BudgetSpec(max_tokens=10, shuffle=False), [4, 3, 6, 2, 5, 1], num_processes=2)
    >>> [plan.micro_batch(step, p)[0] for step in range(plan.num_steps) for p in range(2)]
    [[2], [4], [0, 5], [1, 3]]
    >>> plan.consumed.tolist(), plan.tokens.tolist()
    ([2, 6], [6, 5, 5, 5])
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "COSTS",
    "OVERSIZED",
    "WINDOW",
    "BudgetSpec",
    "EpochPlan",
    "Replans",
    "Strata",
    "WindowTemplate",
    "as_lengths",
    "by_length",
    "plan_epoch",
    "plan_window",
    "sample_costs",
]

COSTS = ("tokens", "padded", "attention")
OVERSIZED = ("error", "alone")
WINDOW = 1 << 17
"""Samples planned together (a window of the epoch's order): the more, the closer the costs of a step's
micro-batches and, for ``"padded"``, the lengths within one."""
FILL = 0.95
"""The share of ``N * max_tokens`` a step's tokens aim at: the rest is room to balance under the budget."""

Replans = tuple[tuple[int, int], ...]
"""How a window was planned: ``((N0, 0), (N1, c1), ...)``, the window planned for ``N0`` processes, its rest
after ``c1`` of its samples planned again for ``N1``, and so on."""


@dataclass(frozen=True)
class BudgetSpec:
    """What a plan is a function of besides the lengths, the epoch and the number of processes."""

    max_tokens: int
    cost: str = "tokens"
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    window: int = WINDOW
    oversized: str = "error"
    """A sample longer than ``max_tokens``: ``"error"`` (a ``ValueError`` naming it), or ``"alone"`` (a
    micro-batch of its own, the only one above the budget)."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1 (the tokens a micro-batch holds)")
        if self.cost not in COSTS:
            raise ValueError(f"cost={self.cost!r} is invalid: pass one of {list(COSTS)}")
        if not _is_int(self.seed) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an integer >= 0 (the same on every process)")
        if self.oversized not in OVERSIZED:
            raise ValueError(f"oversized={self.oversized!r} is invalid: pass one of {list(OVERSIZED)}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window={self.window!r} must be an integer >= 1")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def as_lengths(lengths: Any, max_tokens: int, oversized: str = "error") -> np.ndarray:
    """``lengths`` (a sequence, a numpy array or a ``numpy.memmap``) as a 1-d integer array, checked: every length
    an integer >= 0 and, unless ``oversized="alone"``, none above ``max_tokens``.  A memmap of integers is used
    as it is (not copied)."""
    array = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be one length per sample (1-d), got an array of shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if not np.issubdtype(array.dtype, np.floating) or not np.all(array == np.floor(array)):
            raise ValueError(f"lengths must be integers (tokens per sample), got dtype {array.dtype}")
        array = array.astype(np.int64)
    if array.size:
        low = int(array.min())
        if low < 0:
            index = int(np.argmin(array))
            raise ValueError(f"lengths[{index}]={low} is negative: pass each sample's number of tokens (>= 0)")
        high = int(array.max())
        if high > max_tokens and oversized != "alone":
            index = int(np.argmax(array))
            longer = int(np.count_nonzero(array > max_tokens))
            raise ValueError(
                f"sample {index} has {high} tokens, more than max_tokens={max_tokens} ({longer} sample(s) do): no "
                f"micro-batch can hold it; raise max_tokens to at least {high}, truncate or remove the samples "
                "longer than max_tokens, or pass oversized='alone' to give each of them a micro-batch of its own"
            )
    return array


def sample_costs(lengths: np.ndarray, cost: str) -> np.ndarray:
    """Each sample's cost (``"padded"``: its length; a micro-batch's padded cost is rows times the longest)."""
    lengths = lengths.astype(np.int64, copy=False)
    return lengths * lengths if cost == "attention" else lengths


def _index_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64  # 4 bytes a sample where they suffice


_CHUNK = 1 << 16
"""Samples handled at once where an array of the epoch is made (no second array of ``n`` on the way)."""


def _length_keys(lengths: np.ndarray) -> np.ndarray:
    """A 16-bit key of each length, in the lengths' order: the length itself below 4,096, above it the length to
    within 1 / 2,048 of it (a float of 11 bits of mantissa)."""
    values = np.minimum(lengths.astype(np.int64), (1 << 40) - 1)
    shift = np.maximum(np.frexp(values.astype(np.float64))[1] - 12, 0)
    keys: np.ndarray = ((shift << 11) + (values >> shift)).astype(np.uint16)
    return keys


def by_length(lengths: np.ndarray) -> np.ndarray:
    """The samples ranked by length, shortest first: a stable counting sort on :func:`_length_keys` (samples of
    lengths within 1 / 2,048 of each other may keep their index order), read a chunk at a time (a memmap is read
    through, never whole)."""
    n = int(lengths.size)
    ranked: np.ndarray = np.empty(n, dtype=_index_dtype(n))
    chunk = 1 << 14
    counts = np.zeros(1 << 16, dtype=np.int64)
    for at in range(0, n, chunk):
        counts += np.bincount(_length_keys(lengths[at : at + chunk]), minlength=1 << 16)
    places = np.zeros(1 << 16, dtype=np.int64)  # each key's next place in the ranking
    np.cumsum(counts[:-1], out=places[1:])
    del counts
    for at in range(0, n, chunk):
        keys = _length_keys(lengths[at : at + chunk])
        inside = np.argsort(keys, kind="stable")  # a radix sort
        sorted_keys = keys[inside]
        firsts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])  # each key's run
        runs = np.diff(np.r_[firsts, sorted_keys.size])
        into_run = np.arange(sorted_keys.size) - np.repeat(firsts, runs)
        ranked[places[sorted_keys] + into_run] = inside + at
        places[sorted_keys[firsts]] += runs
    return ranked


@dataclass(frozen=True)
class WindowTemplate:
    """The plan of a window of each group's longest sample on some number of processes: its ``bins`` micro-batches
    (``steps`` kept ones, each as many as every window of its kind keeps) and ``where``, the micro-batch of each
    of its samples in the window's order (the groups', shortest first)."""

    bins: int
    steps: int
    where: np.ndarray


class EpochOrder:
    """An epoch's samples by window: window ``w`` is column ``w`` of ``groups`` (one sample of each group, shortest
    first), the last window also ``short`` (the short group).  A window planned writes its samples, in the order
    its steps consume them, over its own (:meth:`window`), so the order and the plan are held once together."""

    def __init__(self, groups: np.ndarray, short: np.ndarray) -> None:
        self.groups, self.short = groups, short
        self.dtype = groups.dtype
        self._last: np.ndarray | None = None

    def window(self, w: int) -> np.ndarray:
        """Window ``w``'s samples (a view: what is written to it stays in the order)."""
        if w == self.groups.shape[1] - 1 and self.short.size:
            if self._last is None:  # the one window not a column: its own array
                self._last = np.concatenate([self.groups[:, w], self.short])
            return self._last
        return self.groups[:, w]


class Strata:
    """What every epoch's plan shares: the groups of samples of about one length that each window takes one of,
    and the plans of a window of each group's longest sample (:class:`WindowTemplate`), which set how many steps
    every window has.  Made from the lengths and the spec; holds the groups' longest lengths, not the ranking.

    Windows ``0 .. K - 2`` hold ``size`` samples (one of each group), the last one ``size + short`` (the short
    group's too)."""

    def __init__(self, lengths: np.ndarray, spec: BudgetSpec) -> None:
        self.lengths, self.spec = lengths, spec
        n = int(lengths.size)
        self.windows = max(1, n // spec.window)
        self.size = n // self.windows
        self.short = n - self.size * self.windows
        starts = np.arange(self.windows + 1, dtype=np.int64) * self.size
        starts[-1] = n
        self.window_starts = starts
        self._longest: np.ndarray | None = None
        self._templates: dict[tuple[int, bool], WindowTemplate] = {}

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's order: each group's samples dealt to the windows (at random from ``(seed, epoch)``)."""
        ranked = by_length(self.lengths)
        short = self.short
        full = ranked[short:].reshape(self.size, self.windows)  # a group a row, a window a column
        if self._longest is None:
            self._longest = self._group_longest(ranked)
        if self.spec.shuffle:
            generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.spec.seed, epoch, 0x7B])))
            rows = max(1, _CHUNK // self.windows)
            for at in range(0, self.size, rows):
                full[at : at + rows] = generator.permuted(full[at : at + rows], axis=1)
            ranked[:short] = generator.permutation(ranked[:short])
        return EpochOrder(full, ranked[:short])

    def _group_longest(self, ranked: np.ndarray) -> np.ndarray:
        """Each group's longest length (the short group's last), from the ranking by length."""
        full = ranked[self.short :].reshape(self.size, self.windows)
        longest = np.empty(self.size + (1 if self.short else 0), dtype=np.int64)
        rows = max(1, _CHUNK // self.windows)
        groups = longest[: self.size]
        for at in range(0, self.size, rows):
            groups[at : at + rows] = self.lengths[full[at : at + rows]].max(axis=1)
        if self.short:
            longest[-1] = int(self.lengths[ranked[: self.short]].max())
        return longest

    def template(self, num_processes: int, window: int) -> WindowTemplate:
        """The template of window ``window`` on ``num_processes`` (one for the last window, one for the others)."""
        last = window == self.windows - 1 and self.short > 0
        key = (num_processes, last)
        made = self._templates.get(key)
        if made is None:
            longest = self._longest
            if longest is None:  # (an order made first keeps them: one ranking, not a shuffled order too)
                longest = self._longest = self._group_longest(by_length(self.lengths))
            proxies = longest[: self.size]
            if last:
                proxies = np.concatenate([proxies, np.full(self.short, longest[-1], dtype=np.int64)])
            made = _template(proxies, self.spec, num_processes)
            self._templates[key] = made
        return made

    def steps_through(self, num_processes: int, window: int, first: int = 0) -> int:
        """The steps on ``num_processes`` of the windows ``first .. window`` each planned from its start."""
        if window < first:
            return 0
        count = window - first + 1
        last = self.windows - 1
        if window < last or not self.short:
            return count * self.template(num_processes, 0).steps
        return (count - 1) * self.template(num_processes, 0).steps + self.template(num_processes, last).steps


@dataclass
class WindowPlan:
    """One window's steps for ``num_processes``: ``samples`` (the micro-batches' samples, padding included),
    ``bounds`` (micro-batch ``k`` is ``samples[bounds[k]:bounds[k + 1]]``; step ``s``, process ``p`` is
    ``k = s * N + p``), ``real`` (real samples of each micro-batch, its padding after them), ``tokens`` (its real
    tokens), ``consumed`` (the
    window's samples consumed after each step; the last one counts the samples ``drop_last`` dropped) and
    ``sequence`` (the window's samples in the order the steps consume them, those dropped last)."""

    samples: np.ndarray
    bounds: np.ndarray
    real: np.ndarray
    tokens: np.ndarray
    consumed: np.ndarray
    sequence: np.ndarray


def _deal_steps(lengths: np.ndarray, costs: np.ndarray, steps: int, n_proc: int, max_tokens: int) -> np.ndarray | None:
    """The bin (``step * n_proc + process``) of each sample (given longest first), or ``None`` when some sample
    finds no room.  By rounds of ``steps * n_proc`` samples: each step takes ``n_proc`` consecutive samples (so of
    about one length), the longest to the step with the fewest tokens, and inside the step the longest to the least
    costly micro-batch; what does not fit goes to the micro-batches with the most room (of those with as much,
    the ones with no sample first: samples of no tokens leave none of a step's micro-batches all empty)."""
    count, bins = lengths.size, steps * n_proc
    cost = np.zeros(bins, dtype=np.float64)
    tokens = np.zeros(bins, dtype=np.int64)
    filled = np.zeros(bins, dtype=bool)
    step_tokens = np.zeros(steps, dtype=np.int64)
    where = np.full(count, -1, dtype=np.int64)
    pending = np.empty(0, dtype=np.int64)
    taken = 0

    def place(items: np.ndarray, targets: np.ndarray) -> np.ndarray:
        fits = (tokens[targets] + lengths[items] <= max_tokens) | (tokens[targets] == 0)  # oversized: alone
        chosen, into = items[fits], targets[fits]
        where[chosen] = into
        np.add.at(cost, into, costs[chosen])
        np.add.at(tokens, into, lengths[chosen])
        filled[into] = True
        np.add.at(step_tokens, into // n_proc, lengths[chosen])
        missed: np.ndarray = items[~fits]
        return missed

    while taken < count or pending.size:
        if pending.size:  # to the micro-batches with the most room, one each (the rest wait for the next round)
            before, ready = pending.size, min(pending.size, bins)
            pending = np.concatenate([place(pending[:ready], np.lexsort((filled, tokens))[:ready]), pending[ready:]])
            if pending.size == before and taken >= count:
                return None
        new = min(bins, count - taken)
        if not new:
            continue
        items = np.arange(taken, taken + new, dtype=np.int64)
        taken += new
        whole = new // n_proc * n_proc
        blocks = items[:whole].reshape(-1, n_proc)
        chosen = np.argsort(step_tokens, kind="stable")[: blocks.shape[0]]
        inside = np.argsort(cost.reshape(steps, n_proc)[chosen], axis=1, kind="stable")
        targets = chosen[:, None] * n_proc + inside
        missed = place(blocks.ravel(), targets.ravel())
        pending = np.concatenate([pending, missed, items[whole:]])
    return where


def _runs(lengths: np.ndarray, max_tokens: int) -> np.ndarray:
    """Cuts of samples sorted longest first into runs whose rows times the longest fit ``max_tokens`` (each run
    as many rows as fit): the runs' starts, and the count at the end.  A run's rows only grow along the sorted
    samples, so the runs of one number of rows are cut at once (a loop over those numbers, not over runs)."""
    count = lengths.size
    safe = np.maximum(lengths.astype(np.int64, copy=False), 1)
    rows = np.where(lengths > 0, np.maximum(max_tokens // safe, 1), max_tokens + count)  # non-decreasing
    starts = [np.zeros(1, dtype=np.int64)]
    at = 0
    while at < count:
        step = int(rows[at])
        end = int(rows.searchsorted(step, side="right"))  # where runs of more rows begin
        runs = -(-(end - at) // step)
        starts.append(at + step * np.arange(1, runs + 1, dtype=np.int64))
        at += step * runs
    cuts = np.concatenate(starts)
    cuts[-1] = min(int(cuts[-1]), count)
    return cuts


def _padded_bins(lengths: np.ndarray, num_processes: int, max_tokens: int) -> np.ndarray:
    """The bin of each sample (sorted longest first) for ``"padded"``: runs of nearly one length, a multiple of
    ``num_processes`` of them: the runs are cut under a budget a little below ``max_tokens`` where that gives a
    multiple (every run then about as full), else the runs with the most rows are halved."""
    cuts = _runs(lengths, max_tokens)
    count = cuts.size - 1
    target = -(-count // num_processes) * num_processes
    high, low = max_tokens, None  # budgets giving at most and more than the target's runs
    for _ in range(6):  # a lower budget giving exactly the multiple: by the ratio of the counts, then halving
        if count == target:
            break
        guess = min(high - 1, int(high * count / target)) if low is None else (low + high) // 2
        if guess <= (low or 0) or guess < max(int(lengths[0]), 1):
            break
        trial = _runs(lengths, guess)
        if trial.size - 1 <= target:
            high, cuts, count = guess, trial, trial.size - 1
        else:
            low = guess
    extra = (-count) % num_processes
    if extra:
        rows = np.diff(cuts)
        halves = np.argsort(-rows, kind="stable")[:extra]
        halves = halves[rows[halves] >= 2]
        middles = cuts[halves] + rows[halves] // 2
        cuts = np.sort(np.concatenate([cuts, middles]))
    bins = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size:
        bins[cuts[1:-1]] = 1
        bins = np.cumsum(bins)
    return bins


def _assign(
    window_lengths: np.ndarray, spec: BudgetSpec, n_proc: int, steps: int | None = None
) -> tuple[np.ndarray, int] | None:
    """The micro-batch (bin) of each sample (sorted longest first) and the number of bins, a multiple of
    ``n_proc``; ``steps``: dealt into that many steps (``None`` where they do not fit), else the fewest that fit."""
    count = window_lengths.size
    if spec.cost == "padded":
        where = _padded_bins(window_lengths, n_proc, spec.max_tokens)
        bins = int(where[-1]) + 1 if count else 0
        bins += (-bins) % n_proc
        if steps is not None and bins != steps * n_proc:
            return None
        return where, bins
    costs = sample_costs(window_lengths, spec.cost).astype(np.float64)
    if steps is not None:
        dealt = _deal_steps(window_lengths, costs, steps, n_proc, spec.max_tokens)
        return None if dealt is None else (dealt, steps * n_proc)
    total = int(window_lengths.sum())
    halves = int(np.count_nonzero(window_lengths * 2 > spec.max_tokens))  # each needs a bin of its own
    most = -(-count // n_proc)  # a sample a micro-batch always fits: more steps would be padding only
    steps = min(max(1, math.ceil(total / (n_proc * spec.max_tokens * FILL)), math.ceil(halves / n_proc)), most)
    while True:
        found = _deal_steps(window_lengths, costs, steps, n_proc, spec.max_tokens)
        if found is not None:
            return found, steps * n_proc
        assert steps < most, "a deal of one sample a micro-batch always fits"
        steps = min(steps + max(1, steps // 16), most)


def _kept_steps(where: np.ndarray, bins: int, n_proc: int, spec: BudgetSpec) -> int:
    """The steps a window keeps of its bins: all, or with ``drop_last`` those whose micro-batches all hold a sample
    (``"padded"`` takes the runs by cost, the empty ones last)."""
    steps = bins // n_proc
    if not spec.drop_last:
        return steps
    filled = np.bincount(where, minlength=bins) > 0
    if spec.cost == "padded":
        return int(np.count_nonzero(filled)) // n_proc
    return int(np.count_nonzero(filled.reshape(steps, n_proc).all(axis=1)))


def _template(proxies: np.ndarray, spec: BudgetSpec, n_proc: int) -> WindowTemplate:
    """The plan of a window of the lengths ``proxies`` (in the window's order) as a :class:`WindowTemplate`."""
    if not proxies.size:
        return WindowTemplate(0, 0, np.empty(0, dtype=np.int64))
    by_size = np.argsort(-proxies, kind="stable")
    assigned = _assign(proxies[by_size], spec, n_proc)
    assert assigned is not None
    where, bins = np.empty(proxies.size, dtype=np.int64), assigned[1]
    where[by_size] = assigned[0]
    return WindowTemplate(bins, _kept_steps(assigned[0], bins, n_proc, spec), where)


def plan_window(
    ids: np.ndarray,
    lengths: np.ndarray,
    spec: BudgetSpec,
    num_processes: int,
    key: Sequence[int],
    template: WindowTemplate | None = None,
) -> WindowPlan:
    """The steps of one window's samples ``ids`` (``lengths``: all samples' lengths) for ``num_processes``;
    ``key`` seeds the shuffle of its samples of one length and of its steps (with ``spec.seed``).  ``template``:
    the window is planned from its start, ``ids`` in the window's order; it keeps the template's steps (its own
    samples dealt into them, or, where they do not fit, in the template's places)."""
    n_proc = num_processes
    if not ids.size:
        empty = np.empty(0, dtype=np.int64)
        return WindowPlan(ids, np.zeros(1, dtype=np.int64), empty, empty, empty, ids)
    count = ids.size
    mixed = np.arange(count)
    if spec.shuffle:  # samples of one length in a random order (the sort below keeps it)
        mixed = np.random.Generator(np.random.PCG64(np.random.SeedSequence([spec.seed, *key, 0x5A]))).permutation(count)
    window_lengths = lengths[ids[mixed]].astype(np.int64, copy=False)
    longest_first = np.argsort(-window_lengths, kind="stable")
    by_length = mixed[longest_first]  # positions in ids, longest first
    ids, window_lengths = ids[by_length], window_lengths[longest_first]
    if template is None:
        assigned = _assign(window_lengths, spec, n_proc)
    else:
        assigned = _assign(window_lengths, spec, n_proc, template.bins // n_proc)
        if assigned is not None and _kept_steps(*assigned, n_proc, spec) != template.steps:
            assigned = None
        if assigned is None:  # in the places of the samples they stand for (none shorter)
            assigned = (template.where[by_length], template.bins)
    assert assigned is not None
    where, bins = assigned
    if spec.cost == "padded":
        heads = np.zeros(bins, dtype=np.int64)
        rows: np.ndarray = np.bincount(where, minlength=bins)
        np.maximum.at(heads, where, window_lengths)
        bin_cost: np.ndarray = (rows * heads).astype(np.float64)
    else:
        costs = sample_costs(window_lengths, spec.cost).astype(np.float64)
        bin_cost = np.bincount(where, weights=costs, minlength=bins)
        rows = np.bincount(where, minlength=bins)
    # the bins by cost, N at a time: a step's micro-batches cost about the same (empty bins last)
    if spec.cost == "padded":  # the runs by cost, N at a time
        ranked = np.lexsort((np.arange(bins), -bin_cost, rows == 0))
    else:  # the steps as dealt
        ranked = np.arange(bins)
    num_steps = bins // n_proc
    step_of_rank = np.arange(bins) // n_proc
    full = np.ones(num_steps, dtype=bool)
    np.logical_and.at(full, step_of_rank, rows[ranked] > 0)
    order = np.arange(num_steps)
    if spec.shuffle and num_steps > 1:
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([spec.seed, *key, 0x57])))
        order = generator.permutation(num_steps)
    kept = order[full[order]]
    dropped = order[~full[order]] if spec.drop_last else np.empty(0, dtype=np.int64)
    if not spec.drop_last:
        kept = order
    slot = np.full(bins, -1, dtype=np.int64)  # each bin's micro-batch in the window's plan
    layout = (kept[:, None] * n_proc + np.arange(n_proc)).ravel()
    slot[ranked[layout]] = np.arange(layout.size)
    kept_bins = layout.size
    real = np.zeros(kept_bins, dtype=np.int64)
    live = slot[where] >= 0
    sample_slot = slot[where]
    np.add.at(real, sample_slot[live], 1)
    pads = real == 0
    sizes = np.where(pads, 1, real)
    bounds = np.zeros(kept_bins + 1, dtype=np.int64)
    np.cumsum(sizes, out=bounds[1:])
    chosen = np.flatnonzero(live)
    placing = chosen[np.argsort(sample_slot[chosen], kind="stable")]  # longest first within a micro-batch
    sequence = samples = ids[placing]
    if pads.any():  # padding: the window's shortest sample, marked (0 real samples)
        real_bounds = np.zeros(kept_bins + 1, dtype=np.int64)
        np.cumsum(real, out=real_bounds[1:])
        samples = np.insert(sequence, real_bounds[:-1][pads], ids[-1])
    tokens = np.bincount(sample_slot[chosen], weights=window_lengths[chosen], minlength=kept_bins).astype(np.int64)
    step_real = real.reshape(-1, n_proc).sum(axis=1) if kept_bins else np.empty(0, dtype=np.int64)
    consumed = np.cumsum(step_real)
    if dropped.size:
        lost = np.flatnonzero(~live)
        sequence = np.concatenate([sequence, ids[lost]])
        if consumed.size:
            consumed[-1] = count
    return WindowPlan(samples, bounds, real, tokens, consumed, sequence)


@dataclass
class _Planned:
    """One window's steps in an :class:`EpochPlan`, from the epoch's place ``at`` on: its micro-batches' real
    samples lie, in the order they are consumed, in ``sequence`` (a view of the window in the epoch's order;
    micro-batch ``k``: ``sequence[offsets[k]:offsets[k + 1]]``, none for padding: ``[pad]`` instead); ``tokens``
    their real tokens, ``consumed`` the epoch's samples consumed after each of its steps."""

    at: int
    offsets: np.ndarray
    tokens: np.ndarray
    consumed: np.ndarray
    pad: int
    sequence: np.ndarray


class EpochPlan:
    """One epoch's micro-batches for ``num_processes`` from a place (``start``) on: step ``s`` gives process ``p``
    micro-batch ``k = s * N + p`` (:meth:`micro_batch`).  The windows are planned as they are asked for, in the
    epoch's order: the first one (``start``'s) when the plan is made, the next ones when a step of theirs or a place
    after them is asked (:attr:`num_steps` counts the windows not planned yet by their :class:`Strata`); a window
    planned stays planned, its samples written over its own in the epoch's order (:class:`EpochOrder`), so the
    order and the plan are held once together.

    The whole plan as arrays (every window planned): ``samples[bounds[k]:bounds[k + 1]]`` micro-batch ``k``, of
    which the first ``real[k]`` are real (the rest padding); ``tokens[k]`` its real tokens; ``consumed[s]`` the
    epoch's samples consumed after step ``s``; ``first_replans`` how ``start``'s window was planned."""

    def __init__(
        self,
        spec: BudgetSpec,
        lengths: np.ndarray,
        num_processes: int,
        epoch: int,
        start: int,
        strata: Strata,
        replans: Replans | None,
    ) -> None:
        self.spec, self.lengths, self.num_processes, self.epoch = spec, lengths, num_processes, epoch
        self.strata = strata
        self.start, self.order, self.window_starts = start, strata.order(epoch), strata.window_starts
        window_starts = self.window_starts
        size = int(window_starts[-1])
        self.first_replans: Replans = ((num_processes, 0),)
        self.windows: list[_Planned] = []
        self.steps_through: list[int] = []
        """The plan's steps through each planned window."""
        self.consumed_through: list[int] = []
        """The epoch's samples consumed through each planned window's steps (non-decreasing)."""
        first = self.window_of(start)
        self.first_window = first
        self.next_window = window_starts.size - 1  # nothing left to plan, unless the epoch has a rest
        if size and start < size:
            self.next_window = first + 1
            self._keep(first, *self._first_window(first, replans))

    def _first_window(self, first: int, replans: Replans | None) -> tuple[WindowPlan, int]:
        """The plan of ``start``'s window from ``start`` on (``replans``: how it was planned before), and
        ``start``."""
        starts, start, n_proc = self.window_starts, self.start, self.num_processes
        begin = int(starts[first])
        local = start - begin
        ids = self.order.window(first)
        history = tuple(replans) if replans and local else ((n_proc, 0),)
        wp, base = _replay(ids, self.lengths, self.spec, self.epoch, first, history, local, self.strata)
        if history[-1][0] != n_proc:
            rest = wp.sequence[local - base :]
            history = (*history, (n_proc, local))
            wp = plan_window(rest, self.lengths, self.spec, n_proc, (self.epoch, first, len(history) - 1))
            base = local
        self.first_replans = history
        return _from(wp, local - base, begin + base)

    def _keep(self, window: int, wp: WindowPlan, at: int) -> None:
        """Keeps the plan ``wp`` of window ``window`` whose samples begin at ``at`` in the epoch: its samples over
        the window's in the order."""
        sequence = self.order.window(window)[at - int(self.window_starts[window]) :]
        sequence[: wp.sequence.size] = wp.sequence
        offsets = np.zeros(wp.real.size + 1, dtype=np.int64)
        np.cumsum(wp.real, out=offsets[1:])
        pads = np.flatnonzero(wp.real == 0)
        pad = int(wp.samples[wp.bounds[pads[0]]]) if pads.size else -1
        consumed = wp.consumed + at
        self.windows.append(_Planned(at, offsets, wp.tokens, consumed, pad, sequence))
        before = self.steps_through[-1] if self.steps_through else 0
        self.steps_through.append(before + consumed.size)
        last = self.consumed_through[-1] if self.consumed_through else self.start
        self.consumed_through.append(int(consumed[-1]) if consumed.size else last)

    def _plan_next(self) -> bool:
        """Plans the next window (``False``: every window is planned)."""
        window = self.next_window
        starts = self.window_starts
        if window >= starts.size - 1:
            return False
        begin = int(starts[window])
        ids = self.order.window(window)
        template = self.strata.template(self.num_processes, window)
        wp = plan_window(ids, self.lengths, self.spec, self.num_processes, (self.epoch, window, 0), template)
        self._keep(window, wp, begin)
        self.next_window = window + 1
        return True

    def _window_of_step(self, step: int) -> int | None:
        """The planned window of the plan's step ``step`` (planning up to it), ``None`` past the plan's end."""
        through = self.steps_through
        while (not through or through[-1] <= step) and self._plan_next():
            pass
        if step < 0 or not through or through[-1] <= step:
            return None
        return bisect.bisect_right(through, step)

    def _first_step(self, window: int) -> int:
        return self.steps_through[window - 1] if window else 0

    def window_of(self, consumed: int) -> int:
        """The epoch's window of the place ``consumed`` (the one a plan from there begins with)."""
        starts = self.window_starts
        return min(int(np.searchsorted(starts, consumed, side="right")) - 1, starts.size - 2)

    def steps_through_window(self, window: int) -> int:
        """The plan's steps in the epoch's windows up to ``window`` (those not planned yet counted by the
        :class:`Strata`: as many as they will have)."""
        planned = min(window - self.first_window, len(self.windows) - 1)
        through = self.steps_through[planned] if planned >= 0 else 0
        return through + self.strata.steps_through(self.num_processes, window, self.next_window)

    def _plan_all(self) -> None:
        while self._plan_next():
            pass

    @property
    def num_steps(self) -> int:
        """The plan's steps (the windows not planned yet counted by the :class:`Strata`)."""
        return self.steps_through_window(self.window_starts.size - 2)

    def has_step(self, step: int) -> bool:
        """Whether the plan has a step ``step`` (planning the windows up to it only)."""
        return self._window_of_step(step) is not None

    def micro_batch(self, step: int, process: int) -> tuple[list[int], int]:
        """(sample indices, real count) of ``process``'s micro-batch at ``step``."""
        window = self._window_of_step(step)
        if window is None or not 0 <= process < self.num_processes:
            raise IndexError(f"step {step}, process {process} is not in this plan ({self.num_processes} processes)")
        planned = self.windows[window]
        k = (step - self._first_step(window)) * self.num_processes + process
        low, high = int(planned.offsets[k]), int(planned.offsets[k + 1])
        if low == high:
            return [planned.pad], 0
        return planned.sequence[low:high].tolist(), high - low

    def consumed_at(self, step: int) -> int:
        """The epoch's samples consumed after the plan's step ``step``."""
        window = self._window_of_step(step)
        if window is None:
            raise IndexError(f"step {step} is not in this plan")
        return int(self.windows[window].consumed[step - self._first_step(window)])

    def totals(self, first: int, end: int) -> tuple[int, int]:
        """The real tokens and samples of the steps ``[first, end)`` over all processes (those in the plan)."""
        tokens = samples = 0
        n_proc = self.num_processes
        step = max(first, 0)
        while step < end:
            window = self._window_of_step(step)
            if window is None:
                break
            planned, begin = self.windows[window], self._first_step(window)
            stop = min(end, self.steps_through[window])
            low, high = (step - begin) * n_proc, (stop - begin) * n_proc
            tokens += int(planned.tokens[low:high].sum())
            samples += int(planned.offsets[high] - planned.offsets[low])
            step = stop
        return tokens, samples

    def passes(self, consumed: int) -> bool:
        """Whether the plan passes the place ``consumed`` (its start, or after one of its steps)."""
        return consumed == self.start or self._step_after(consumed) is not None

    def _step_after(self, consumed: int) -> int | None:
        """The step after which the epoch has consumed ``consumed`` samples (the first such), ``None`` if none."""
        through = self.consumed_through
        while (not through or through[-1] < consumed) and self._plan_next():
            pass
        window = bisect.bisect_left(through, consumed)
        if window >= len(through):
            return None
        values = self.windows[window].consumed
        local = int(np.searchsorted(values, consumed))
        if local >= values.size or int(values[local]) != consumed:
            return None
        return self._first_step(window) + local

    def steps_before(self, consumed: int) -> int:
        """The steps of this plan before the place ``consumed`` (a place it passes: a ``ValueError`` otherwise)."""
        if consumed == self.start:
            return 0
        step = self._step_after(consumed)
        if step is None:
            raise ValueError(
                f"consumed={consumed} is not a place between steps of this epoch's plan (from {self.start}, on "
                f"{self.num_processes} processes); load the position this loader saved"
            )
        return step + 1

    def replans_at(self, consumed: int) -> Replans | None:
        """How the window of the place ``consumed`` was planned (``None`` at a window's start: nothing to say)."""
        starts = self.window_starts
        if consumed in starts:
            return None
        window = int(np.searchsorted(starts, consumed, side="right")) - 1
        first = int(np.searchsorted(starts, self.start, side="right")) - 1
        return self.first_replans if window == first else ((self.num_processes, 0),)

    def _joined(self, part: Any) -> np.ndarray:
        """``part`` of every window (each planned) joined."""
        self._plan_all()
        arrays = [part(planned) for planned in self.windows]
        return np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)

    @property
    def real(self) -> np.ndarray:
        return self._joined(lambda planned: np.diff(planned.offsets))

    @property
    def tokens(self) -> np.ndarray:
        return self._joined(lambda planned: planned.tokens)

    @property
    def consumed(self) -> np.ndarray:
        return self._joined(lambda planned: planned.consumed)

    @property
    def bounds(self) -> np.ndarray:
        sizes = np.maximum(self.real, 1)
        bounds = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        return bounds

    @property
    def samples(self) -> np.ndarray:
        def part(planned: _Planned) -> np.ndarray:
            offsets = planned.offsets
            sequence = planned.sequence[: int(offsets[-1])]
            pads = np.flatnonzero(offsets[1:] == offsets[:-1])
            return np.insert(sequence, offsets[pads], planned.pad) if pads.size else sequence

        return self._joined(part).astype(self.order.dtype, copy=False)


def plan_epoch(
    spec: BudgetSpec,
    lengths: Any,
    num_processes: int,
    epoch: int = 0,
    start: int = 0,
    replans: Replans | None = None,
    strata: Strata | None = None,
) -> EpochPlan:
    """The epoch's plan for ``num_processes`` from the place ``start`` (samples consumed) on; ``replans``: how
    ``start``'s window was planned before (``None``: from the window's start on ``num_processes``, or it is a
    window's start).  Only ``start``'s window is planned now, the others as they are asked for
    (:class:`EpochPlan`).  ``strata``: the lengths' :class:`Strata` for ``spec``, where one was made before."""
    lengths = as_lengths(lengths, spec.max_tokens, spec.oversized)
    n = int(lengths.size)
    if not 0 <= start <= n:
        raise ValueError(f"start={start} is outside the epoch of {n} samples; load the position this loader saved")
    if strata is None or strata.spec != spec or strata.lengths.size != n:
        strata = Strata(lengths, spec)
    return EpochPlan(spec, lengths, num_processes, epoch, start, strata, replans)


def _replay(
    ids: np.ndarray,
    lengths: np.ndarray,
    spec: BudgetSpec,
    epoch: int,
    window: int,
    history: Replans,
    local: int,
    strata: Strata,
) -> tuple[WindowPlan, int]:
    """The plan of a window as ``history`` planned it up to its last replan: (that plan, where it began)."""
    rest, base = ids, 0
    wp: WindowPlan | None = None
    for i, (processes, at) in enumerate(history):
        if not _is_int(processes) or processes < 1 or not _is_int(at) or not base <= at <= local:
            raise ValueError(
                f"the position's plan of its window {list(history)} does not describe a place at {local} samples "
                "into it; load the position this loader saved"
            )
        if wp is not None:
            rest = wp.sequence[at - base :]
            base = at
        template = strata.template(int(processes), window) if i == 0 else None  # from the window's start
        wp = plan_window(rest, lengths, spec, int(processes), (epoch, window, i), template)
    assert wp is not None
    return wp, base


def _from(wp: WindowPlan, local: int, begin: int) -> tuple[WindowPlan, int]:
    """``wp`` from its place ``local`` (samples consumed in it) on, placed at ``begin`` in the epoch."""
    if local == 0:
        return wp, begin
    steps = int(np.searchsorted(wp.consumed, local)) + 1
    if steps > wp.consumed.size or int(wp.consumed[steps - 1]) != local:
        raise ValueError(
            f"the position's place ({local} samples into its window) is not between two steps of the window's "
            "plan; load the position this loader saved"
        )
    n_proc = (wp.bounds.size - 1) // max(wp.consumed.size, 1)
    cut = steps * n_proc
    bounds = wp.bounds[cut:] - wp.bounds[cut]
    samples = wp.samples[wp.bounds[cut] :]
    consumed = wp.consumed[steps:] - local
    rest = WindowPlan(samples, bounds, wp.real[cut:], wp.tokens[cut:], consumed, wp.sequence[local:])
    return rest, begin + local
