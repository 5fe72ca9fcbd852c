"""The order of a weighted mixture (shardplug.core.shuffle.mixture_order): which source and which sample at any
global position, as a pure function of the seed, the lengths and the weights."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplug.core.shuffle.mixture_order import WEIGHT_UNITS, MixtureOrder, quantize_weights
from shardplug.core.shuffle.seedable import KeyedPermutation

NAMES = [f"s{k:02d}" for k in range(40)]
WINDOW = 10_000


def _order(seed: int, lengths: dict[str, int], *steps: tuple[int, dict[str, float]]) -> MixtureOrder:
    return MixtureOrder(seed, lengths, [(start, quantize_weights(w)) for start, w in steps])


weights_st = st.integers(2, 40).flatmap(
    lambda n: st.lists(st.integers(0, 1000), min_size=n, max_size=n).filter(lambda ws: sum(ws) > 0)
)


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, seed=st.integers(0, 2**63), start=st.integers(0, 10**9))
def test_counts_sum_to_the_position_and_grow_by_the_source_drawn(weights: list[int], seed: int, start: int) -> None:
    names = NAMES[: len(weights)]
    order = _order(seed, dict.fromkeys(names, 7), (0, dict(zip(names, weights))))
    counts = order.counts_at(start)
    assert sum(counts.values()) == start
    for p in range(start, start + 300):
        name, draw = order.draw_of(p)
        assert draw == counts[name], "a position's draw is its source's count before it"
        counts[name] += 1
        assert counts == order.counts_at(p + 1)


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, seed=st.integers(0, 2**63), start=st.integers(0, 10**9))
def test_every_window_of_ten_thousand_positions_holds_each_weight_within_a_tenth_of_a_percent(
    weights: list[int], seed: int, start: int
) -> None:
    names = NAMES[: len(weights)]
    order = _order(seed, dict.fromkeys(names, 1000), (0, dict(zip(names, weights))))
    before, after = order.counts_at(start), order.counts_at(start + WINDOW)
    for name, weight in zip(names, weights):
        share = (after[name] - before[name]) / WINDOW
        assert abs(share - weight / sum(weights)) <= 0.001, (name, share, weight / sum(weights))


def test_the_windowed_shares_hold_position_by_position_for_three_sources() -> None:
    order = _order(5, {"web": 10_000, "code": 10_000, "math": 100}, (0, {"web": 0.5, "code": 0.3, "math": 0.2}))
    seen = [order.draw_of(p)[0] for p in range(3 * WINDOW)]
    for name, weight in {"web": 0.5, "code": 0.3, "math": 0.2}.items():
        running = sum(1 for s in seen[:WINDOW] if s == name)
        for p in range(WINDOW, len(seen)):
            assert abs(running / WINDOW - weight) <= 0.001
            running += (seen[p] == name) - (seen[p - WINDOW] == name)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
    weights=st.lists(st.integers(1, 9), min_size=5, max_size=5),
    seed=st.integers(0, 2**63),
)
def test_every_sample_once_per_source_cycle(lengths: list[int], weights: list[int], seed: int) -> None:
    names = NAMES[: len(lengths)]
    order = _order(seed, dict(zip(names, lengths)), (0, dict(zip(names, weights))))
    cycles: dict[tuple[str, int], list[int]] = defaultdict(list)
    for draw in order.locate_many(list(range(600))):
        cycles[(draw.source, draw.cycle)].append(draw.sample)
    length = dict(zip(names, lengths))
    for (name, _cycle), samples in cycles.items():
        assert len(set(samples)) == len(samples), "a sample twice in one cycle"
        assert set(samples) <= set(range(length[name]))
    for name in names:  # every cycle but the last is complete
        done = [c for (n, c) in cycles if n == name]
        for cycle in range(max(done, default=0)):
            assert sorted(cycles[(name, cycle)]) == list(range(length[name]))


@settings(max_examples=40, deadline=None)
@given(step=st.integers(1, 10**6), seed=st.integers(0, 2**63))
def test_a_scheduled_step_takes_effect_at_exactly_its_position(step: int, seed: int) -> None:
    lengths = {"a": 50, "b": 50, "c": 5}
    plain = _order(seed, lengths, (0, {"a": 0.5, "b": 0.5, "c": 0}))
    scheduled = _order(seed, lengths, (0, {"a": 0.5, "b": 0.5, "c": 0}), (step, {"a": 0, "b": 0, "c": 1}))
    for p in range(max(0, step - 50), step):
        assert scheduled.locate(p) == plain.locate(p), "positions before the step are unchanged"
    assert [scheduled.locate(p).source for p in range(step, step + 50)] == ["c"] * 50
    assert scheduled.counts_at(step) == {**plain.counts_at(step), "c": 0}
    assert scheduled.locate(step).draw == 0


@settings(max_examples=40, deadline=None)
@given(
    saved_at=st.one_of(st.integers(0, 10**6), st.integers(2**31, 2**40)),
    old=st.lists(st.integers(1, 9), min_size=3, max_size=3),
    new=st.lists(st.integers(0, 9), min_size=4, max_size=4).filter(lambda ws: sum(ws) > 0),
    seed=st.integers(0, 2**63),
)
def test_new_weights_at_a_saved_position_repeat_and_skip_nothing(
    saved_at: int, old: list[int], new: list[int], seed: int
) -> None:
    lengths = {"a": 13, "b": 1000, "c": 1000, "d": 3}  # d is added at the resume
    saved = _order(seed, {k: lengths[k] for k in "abc"}, (0, dict(zip("abc", old))))
    configured = _order(seed, lengths, (0, dict(zip("abcd", new))))
    resumed = saved.continued(saved_at, configured)
    for p in range(max(0, saved_at - 20), saved_at):
        assert resumed.locate(p) == saved.locate(p), "what was consumed stays what it was"
    counts = {**saved.counts_at(saved_at), "d": 0}
    assert resumed.counts_at(saved_at) == counts
    for draw in resumed.locate_many(list(range(saved_at, saved_at + 400))):
        assert draw.draw == counts[draw.source], "each source goes on with its next draw"
        counts[draw.source] += 1
    same = saved.continued(saved_at, _order(seed, {k: lengths[k] for k in "abc"}, (0, dict(zip("abc", old)))))
    assert same.state() == saved.state(), "the same weights continue the same order"
    around = list(range(max(0, saved_at - 100), saved_at + 100))
    assert _vector(resumed, around) == _scalar(resumed, around), "the vectorised order across the change"


def test_quantised_weights_sum_to_the_units() -> None:
    assert abs(sum(quantize_weights({"a": 0.5, "b": 0.3, "c": 0.2}).values()) - WEIGHT_UNITS) <= 3


def test_the_order_reads_back_from_its_state() -> None:
    order = _order(3, {"a": 4, "b": 9}, (0, {"a": 1, "b": 2}), (77, {"a": 2, "b": 1}))
    again = MixtureOrder.from_state(order.state())
    assert [again.locate(p) for p in range(200)] == [order.locate(p) for p in range(200)]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2**40), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000), k=st.integers(0, 2**40))
def test_a_permutations_value_at_one_position_is_its_tensors(n: int, seed: int, epoch: int, k: int) -> None:
    perm = KeyedPermutation(n, seed, epoch)
    positions = [k % n, (k * 7 + 1) % n, n - 1]
    assert [perm.at(p) for p in positions] == perm(torch.tensor(positions)).tolist()


def _scalar(order: MixtureOrder, positions: list[int]) -> list[tuple[str, int, int, int]]:
    return [tuple(draw) for draw in order.locate_each(positions)]  # type: ignore[misc]


def _vector(order: MixtureOrder, positions: list[int]) -> list[tuple[str, int, int, int]]:
    arrays = order.locate_arrays(positions)
    assert arrays is not None, "positions below 2**62 and units below 2**33 take the vectorised path"
    return [(order.names[c], *rest) for c, *rest in zip(*(a.tolist() for a in arrays))]


lengths_st = st.lists(
    st.one_of(st.integers(1, 40), st.integers(1, 10**7), st.integers(1, 2**40), st.integers(2**61, 2**62)),
    min_size=1,
    max_size=12,
)
positions_st = st.one_of(st.integers(0, 10**4), st.integers(10**9 - 100, 10**9 + 100), st.integers(2**31, 2**62 - 1))


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_st,
    units=st.lists(st.one_of(st.integers(0, 3), st.integers(0, 2**32), st.integers(0, 2**33 - 1)), min_size=12),
    steps=st.lists(st.integers(1, 2**62 - 1), max_size=3, unique=True),
    seed=st.integers(0, 2**64 - 1),
    starts=st.lists(positions_st, min_size=1, max_size=4),
    loose=st.lists(positions_st, max_size=40),
)
def test_the_vectorised_order_is_the_scalar_one_bit_for_bit(
    lengths: list[int], units: list[int], steps: list[int], seed: int, starts: list[int], loose: list[int]
) -> None:
    """Drawn lengths (up to 2**62), units near the bound of 2**33 (their sum below it: ``node_table``), schedules
    with steps anywhere below 2**62, runs of positions around 10**9 and past 2**31: every value as
    ``locate_each`` computes it with Python integers."""
    names = NAMES[: len(lengths)]

    def weights(shift: int) -> dict[str, int]:
        out = dict(zip(names, units[shift : shift + len(names)] + [1] * len(names)))
        scale = max(1, -(-sum(out.values()) // (2**33 - 1)))
        out = {name: w // scale for name, w in out.items()}
        return out if sum(out.values()) else {**out, names[0]: 1}

    segments = [(0, weights(0))] + [(start, weights(k + 1)) for k, start in enumerate(sorted(steps))]
    order = MixtureOrder(seed, dict(zip(names, lengths)), segments)
    positions = [p for start in starts for p in range(start, min(start + 70, 2**62))] + loose
    assert _vector(order, positions) == _scalar(order, positions)


def test_what_the_vectorised_order_does_not_take_goes_one_by_one() -> None:
    order = _order(5, {"a": 10, "b": 7}, (0, {"a": 1, "b": 3}))
    assert order.locate_arrays([2**62]) is None and order.locate_arrays([-1]) is None
    floats: list[Any] = [1.0, 2.0]
    assert order.locate_arrays(floats) is None and order.locate_arrays([2**64 + 1]) is None
    beyond = list(range(2**62 - 40, 2**62 + 40))
    assert order.locate_many(beyond) == order.locate_each(beyond)
    try:
        order.locate_many(list(range(-1, 100)))
    except IndexError as error:
        assert "position=-1" in str(error)
    else:
        raise AssertionError("a negative position is refused")
    wide = MixtureOrder(5, {"a": 10, "b": 7}, [(0, {"a": 2**33, "b": 3})])  # units past node_table's bound
    assert wide.locate_arrays([0, 1]) is None
    assert wide.locate_many(list(range(100))) == wide.locate_each(list(range(100)))


@settings(max_examples=30, deadline=None)
@given(
    processes=st.integers(1, 5),
    rank=st.integers(0, 4),
    size=st.integers(1, 40),
    batches=st.integers(1, 300),
    jumps=st.lists(st.integers(0, 10**12), max_size=3),
    seed=st.integers(0, 2**63),
)
def test_batches_read_ahead_are_the_order(
    processes: int, rank: int, size: int, batches: int, jumps: list[int], seed: int
) -> None:
    """A process's batches (every ``processes``-th run of ``size`` positions), with jumps (a resume, another
    epoch) and a batch out of the run: ``locate_batch`` reads them ahead, and gives the order's values."""
    order = _order(seed, {"a": 13, "b": 1000, "c": 10**6}, (0, {"a": 0.2, "b": 0.3, "c": 0.5}), (5000, {"a": 1}))
    codes = {name: k for k, name in enumerate(order.names)}
    firsts = [(rank % processes + k * processes) * size for k in range(batches)]
    for jump in jumps:
        firsts[len(firsts) // 2 :] = [jump + f for f in firsts[len(firsts) // 2 :]]
    firsts.insert(len(firsts) // 3, 7)
    for first in firsts:
        positions = list(range(first, first + size))
        expected = order.locate_each(positions)
        assert order.locate_batch(positions) == ([codes[d.source] for d in expected], [d.sample for d in expected])
    scattered = [9, 3, 4, 2**40]
    assert order.locate_batch(scattered) == (
        [codes[d.source] for d in order.locate_each(scattered)],
        [d.sample for d in order.locate_each(scattered)],
    )
