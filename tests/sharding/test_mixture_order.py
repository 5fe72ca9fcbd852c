"""The order of a weighted mixture (shardplug.core.shuffle.mixture_order): which source and which sample at any
global position, as a pure function of the seed, the lengths and the weights."""

from __future__ import annotations

from collections import defaultdict

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
    saved_at=st.integers(0, 10**6),
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
