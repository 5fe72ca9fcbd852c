"""Token-budget plans as pure functions (one process, no process group).

For any lengths, budget, cost and number of processes: every process has the same number of micro-batches,
each within the budget, every sample comes once per epoch (padding marked, or dropped with ``drop_last``), and
a place between steps planned again for another number of processes gives every remaining sample once. On
seeded heavy-tailed lengths (log-normal and Zipf, 2 to 128k tokens) the costs of a step's micro-batches are
balanced (max / mean, from the plan) and ``"padded"`` pads little.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplug.core.sharding.budget_plan import (
    BudgetSpec,
    EpochPlan,
    Replans,
    Strata,
    _from,
    _replay,
    _template,
    by_length,
    plan_epoch,
    plan_window,
)


def _real(plan: EpochPlan) -> np.ndarray:
    """The real samples of every micro-batch of ``plan``, in order."""
    sizes = np.diff(plan.bounds)
    inside = np.arange(plan.samples.size) - np.repeat(plan.bounds[:-1], sizes)
    return plan.samples[inside < np.repeat(plan.real, sizes)]


def _step_costs(plan: EpochPlan, lengths: np.ndarray, cost: str) -> np.ndarray:
    """Each micro-batch's cost (padding rows counted: they are computed), one row per step."""
    values = lengths[plan.samples].astype(np.float64)
    starts = plan.bounds[:-1]
    if cost == "tokens":
        costs = np.add.reduceat(values, starts)
    elif cost == "attention":
        costs = np.add.reduceat(values**2, starts)
    else:
        costs = np.diff(plan.bounds) * np.maximum.reduceat(values, starts)
    return costs.reshape(-1, plan.num_processes)


_lengths = st.lists(st.integers(0, 40), min_size=0, max_size=120)


@settings(max_examples=150, deadline=None)
@given(
    lengths=_lengths,
    extra=st.integers(0, 30),
    n=st.integers(1, 5),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=st.integers(1, 50),
)
def test_equal_counts_within_budget_every_sample_once(
    lengths: list[int], extra: int, n: int, cost: str, shuffle: bool, drop_last: bool, window: int
) -> None:
    budget = max(max(lengths, default=0) + extra, 1)  # samples of the whole budget too
    spec = BudgetSpec(budget, cost=cost, shuffle=shuffle, seed=3, drop_last=drop_last, window=window)
    plan = plan_epoch(spec, lengths, n, epoch=1)
    assert plan.bounds.size - 1 == plan.num_steps * n  # every process: num_steps micro-batches
    sizes = np.diff(plan.bounds)
    assert (sizes >= 1).all()
    tokens = np.add.reduceat(np.asarray(lengths, dtype=np.int64)[plan.samples], plan.bounds[:-1]) if sizes.size else []
    assert all(t <= budget for t in tokens)
    real = _real(plan)
    assert np.unique(real).size == real.size  # never twice
    assert (plan.real.reshape(-1, n).sum(axis=1) >= 1).all()  # no step of padding only
    if not drop_last:
        assert sorted(real.tolist()) == list(range(len(lengths)))
        assert plan.consumed[-1:].tolist() == ([len(lengths)] if lengths else [])
    else:
        assert (plan.real >= 1).all()  # no padding
        assert plan.consumed[-1:].tolist() == ([len(lengths)] if plan.num_steps else [])
    assert (np.diff(plan.consumed) >= 0).all()


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=100),
    sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
    window=st.integers(5, 60),
)
def test_a_place_planned_again_on_other_numbers_of_processes_gives_the_rest_once(
    lengths: list[int], sizes: list[int], cuts: list[float], cost: str, window: int
) -> None:
    spec = BudgetSpec(40, cost=cost, seed=5, window=window)
    seen: list[int] = []
    start, replans = 0, None
    for n, cut in zip(sizes, cuts):
        plan = plan_epoch(spec, lengths, n, epoch=2, start=start, replans=replans)
        taken = int(cut * plan.num_steps)
        if taken:
            seen += [i for s in range(taken) for p in range(n) for i in _real_of(plan, s, p)]
            start = int(plan.consumed[taken - 1])
        assert plan.steps_before(start) == taken
        replans = plan.replans_at(start)
    last = plan_epoch(spec, lengths, sizes[-1], epoch=2, start=start, replans=replans)
    seen += _real(last).tolist()
    assert sorted(seen) == list(range(len(lengths)))
    # the same place on the same number of processes continues the same plan
    again = plan_epoch(spec, lengths, sizes[-1], epoch=2, start=start, replans=replans)
    assert again.samples.tolist() == last.samples.tolist()


def _eager(
    spec: BudgetSpec, lengths: list[int], n: int, epoch: int, start: int, replans: Replans | None
) -> tuple[list[tuple[list[int], int]], list[int], list[int]]:
    """The reference: the plan from ``start`` with every window planned at once and joined, as (samples, real)
    per micro-batch, real tokens per micro-batch and the samples consumed after each step."""
    array = np.asarray(lengths, dtype=np.int64)
    strata = Strata(array, spec)
    order, bounds = strata.order(epoch), strata.window_starts
    batches: list[tuple[list[int], int]] = []
    tokens: list[int] = []
    consumed: list[int] = []
    for w in range(bounds.size - 1):
        begin, end = int(bounds[w]), int(bounds[w + 1])
        if start >= end:  # windows before the place's
            continue
        local = max(start - begin, 0)
        history = tuple(replans) if replans and local else ((n, 0),)
        wp, base = _replay(order.window(w), array, spec, epoch, w, history, local, strata)
        if history[-1][0] != n:  # a resize: the rest of the window planned again
            wp, base = plan_window(wp.sequence[local - base :], array, spec, n, (epoch, w, len(history))), local
        wp, at = _from(wp, local - base, begin + base)
        for k in range(wp.bounds.size - 1):
            batches.append((wp.samples[wp.bounds[k] : wp.bounds[k + 1]].tolist(), int(wp.real[k])))
        tokens += wp.tokens.tolist()
        consumed += (wp.consumed + at).tolist()
        start = end  # the next windows from their starts
    return batches, tokens, consumed


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=0, max_size=120),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    cuts=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    queries=st.lists(st.tuples(st.sampled_from(["step", "place", "totals"]), st.floats(0, 1.2)), max_size=6),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
    drop_last=st.booleans(),
    window=st.integers(1, 40),
)
def test_a_plan_made_window_by_window_as_asked_is_the_whole_epoch_planned_at_once(
    lengths: list[int],
    sizes: list[int],
    cuts: list[float],
    queries: list[tuple[str, float]],
    cost: str,
    drop_last: bool,
    window: int,
) -> None:
    """Whatever is asked first (a step's micro-batches, a place, a range's totals: each plans the windows up to
    it only), on drawn resume places and resizes, the plan is the one of every window planned at once."""
    spec = BudgetSpec(40, cost=cost, seed=5, drop_last=drop_last, window=window)
    start, replans = 0, None
    for n, cut in zip(sizes, cuts):
        batches, tokens, consumed = _eager(spec, lengths, n, 2, start, replans)
        steps = len(consumed)
        plan = plan_epoch(spec, lengths, n, epoch=2, start=start, replans=replans)
        assert len(plan.windows) <= 1  # the place's window only, so far
        for kind, share in queries:
            step = int(share * steps)
            if kind == "step":
                assert plan.has_step(step) == (step < steps)
                if step < steps:
                    assert [plan.micro_batch(step, p) for p in range(n)] == batches[step * n : step * n + n]
            elif kind == "place" and step < steps:
                place = consumed[step]
                assert plan.passes(place) and plan.steps_before(place) == consumed.index(place) + 1
            elif kind == "totals":
                end = min(step + 2, steps)
                span = range(min(step, steps) * n, end * n)
                assert plan.totals(step, step + 2) == (sum(tokens[k] for k in span), sum(batches[k][1] for k in span))
        assert plan.num_steps == steps and plan.consumed.tolist() == consumed
        assert [(plan.samples[a:b].tolist(), int(r)) for a, b, r in zip(plan.bounds, plan.bounds[1:], plan.real)] == (
            batches
        )
        assert plan.tokens.tolist() == tokens
        taken = int(cut * steps)
        if taken:
            start = consumed[taken - 1]
        replans = plan.replans_at(start)


def _real_of(plan: EpochPlan, step: int, process: int) -> list[int]:
    indices, real = plan.micro_batch(step, process)
    return indices[:real]


def test_a_place_inside_a_window_resumes_the_uninterrupted_plan() -> None:
    lengths = np.random.default_rng(1).integers(1, 50, size=500)
    spec = BudgetSpec(200, window=128)
    whole = plan_epoch(spec, lengths, 3)
    step = whole.num_steps // 2
    place = int(whole.consumed[step - 1])
    rest = plan_epoch(spec, lengths, 3, start=place, replans=whole.replans_at(place))
    k = step * 3
    assert rest.samples.tolist() == whole.samples[whole.bounds[k] :].tolist()
    assert rest.consumed.tolist() == whole.consumed[step:].tolist()


def test_the_order_is_agreed_by_seed_and_epoch() -> None:
    lengths = np.arange(1, 300) % 37 + 1
    spec = BudgetSpec(100, seed=11)
    assert (
        plan_epoch(spec, lengths, 2, epoch=4).samples.tolist() == plan_epoch(spec, lengths, 2, epoch=4).samples.tolist()
    )
    assert (
        plan_epoch(spec, lengths, 2, epoch=4).samples.tolist() != plan_epoch(spec, lengths, 2, epoch=5).samples.tolist()
    )


def test_a_sample_longer_than_the_budget_is_named_with_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"sample 2 has 90 tokens, more than max_tokens=64.*raise max_tokens to at least 90"
    ):
        plan_epoch(BudgetSpec(64), [3, 5, 90, 4], 2)


def _heavy_tailed(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    if kind == "lognormal":
        values = rng.lognormal(7.0, 1.5, size=n)
    else:
        values = rng.zipf(1.5, size=n) * 2.0
    return np.clip(values, 2, 131072).astype(np.int64)


@pytest.mark.parametrize("kind", ["lognormal", "zipf"])
@pytest.mark.parametrize("cost", ["tokens", "attention", "padded"])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_heavy_tailed_steps_are_balanced(kind: str, cost: str, n: int) -> None:
    lengths = _heavy_tailed(kind, 200_000)
    plan = plan_epoch(BudgetSpec(262_144, cost=cost, seed=1, window=1 << 16), lengths, n)  # 3 windows
    costs = _step_costs(plan, lengths, cost)
    ratio = costs.max(axis=1) / costs.mean(axis=1)
    assert np.median(ratio) <= 1.01
    assert np.percentile(ratio, 95) <= (1.05 if cost != "padded" or kind == "lognormal" else 1.1)
    if cost != "padded":
        assert ratio.max() <= 1.15  # every step (the padded cost's longest rows cannot be matched in every window)
    if cost == "padded":
        padded = (np.diff(plan.bounds) * np.maximum.reduceat(lengths[plan.samples], plan.bounds[:-1])).sum()
        assert padded / lengths.sum() - 1 <= (0.02 if kind == "lognormal" else 0.03)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=80),
    n=st.integers(1, 4),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
)
def test_oversized_alone_gives_each_long_sample_a_micro_batch_of_its_own(lengths: list[int], n: int, cost: str) -> None:
    budget = 30
    plan = plan_epoch(BudgetSpec(budget, cost=cost, seed=2, oversized="alone"), lengths, n)
    assert sorted(_real(plan).tolist()) == list(range(len(lengths)))
    for k in range(plan.bounds.size - 1):
        batch = plan.samples[plan.bounds[k] : plan.bounds[k + 1]]
        tokens = sum(lengths[i] for i in batch.tolist())
        assert tokens <= budget or batch.size == 1  # above the budget only alone


def test_oversized_is_refused_by_default_with_the_option_named() -> None:
    with pytest.raises(ValueError, match="oversized='alone'"):
        plan_epoch(BudgetSpec(10), [3, 11], 1)
    with pytest.raises(ValueError, match=r"oversized='sometimes' is invalid"):
        BudgetSpec(10, oversized="sometimes")


@pytest.mark.parametrize("padding", [False, True], ids=["few-pads", "many-pads"])
def test_a_plan_is_made_within_twice_the_lengths_memory(padding: bool) -> None:
    """The epoch's order and the plan share one buffer (each window's samples written over its part of the order
    as it is planned; padding is not stored): at most twice the memory of an int32 lengths array while every
    window is planned; the same plan as the windows planned alone, also where many micro-batches are padding."""
    import tracemalloc

    lengths = np.random.default_rng(2).integers(1, 400, size=2_000 if padding else 500_000).astype(np.int32)
    # padding: windows of 7 samples on 8 processes, padded each; else micro-batches of about 100 samples
    spec = BudgetSpec(2_000 if padding else 20_000, cost="attention", seed=1, window=7 if padding else 8_192)
    tracemalloc.start()
    try:
        plan = plan_epoch(spec, lengths, 8)
        assert not plan.has_step(plan.num_steps)  # every window planned
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if not padding:
        assert peak <= 2 * lengths.nbytes
    n = lengths.size
    strata = Strata(lengths, spec)
    order, bounds = strata.order(0), strata.window_starts.tolist()
    windows = [
        plan_window(order.window(w), lengths, spec, 8, (0, w, 0), strata.template(8, w)).samples
        for w in range(len(bounds) - 1)
    ]
    assert np.array_equal(plan.samples, np.concatenate(windows))
    assert plan.samples.size > n if padding else plan.samples.size >= n


@settings(max_examples=120, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 60), min_size=0, max_size=150),
    n=st.integers(1, 4),
    cost=st.sampled_from(["tokens", "padded", "attention"]),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    window=st.integers(1, 40),
)
def test_every_epoch_has_the_same_steps_counted_before_it_is_planned(
    lengths: list[int], n: int, cost: str, drop_last: bool, shuffle: bool, window: int
) -> None:
    """Each epoch's windows are drawn from its own order, yet every epoch on N processes has as many steps, and
    ``num_steps`` says it before the windows after the first are planned (what ``len()`` and a framework's
    length of every epoch rely on)."""
    spec = BudgetSpec(61, cost=cost, shuffle=shuffle, seed=4, drop_last=drop_last, window=window)
    counts = []
    for epoch in range(3):
        plan = plan_epoch(spec, lengths, n, epoch=epoch)
        counts.append(plan.num_steps)
        assert len(plan.windows) <= 1  # counted, not planned
        assert not plan.has_step(counts[-1]) and plan.has_step(counts[-1] - 1) == (counts[-1] > 0)
        assert plan.consumed.size == counts[-1]  # every window planned now: the steps counted
    assert counts == [counts[0]] * 3


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=200), window=st.integers(1, 40))
def test_each_window_takes_one_sample_of_each_group_of_about_one_length(lengths: list[int], window: int) -> None:
    """Groups of K samples ranked by length (K windows; the n mod K shortest a group of their own, in the last
    window): every window holds one sample of each group, a random one each epoch."""
    array = np.asarray(lengths)
    strata = Strata(array, BudgetSpec(300, window=window, seed=2))
    ranked = by_length(array)
    assert np.array_equal(array[ranked], np.sort(array))  # exact below 4,096 tokens
    k, short = strata.windows, strata.short
    group = np.empty(array.size, dtype=np.int64)
    group[ranked[short:]] = np.arange(array.size - short) // k
    group[ranked[:short]] = -1
    for epoch in range(2):
        order = strata.order(epoch)
        for w in range(k):
            members = order.window(w)
            assert members.size == int(strata.window_starts[w + 1] - strata.window_starts[w])
            expected = list(range(strata.size)) + ([-1] * short if w == k - 1 else [])
            assert group[members].tolist() == expected
    if k > 1 and strata.size > 3:
        assert not np.array_equal(Strata(array, strata.spec).order(0).groups, strata.order(1).groups)


def test_a_window_whose_samples_do_not_fit_the_templates_steps_takes_its_places() -> None:
    """A window planned from its start keeps its template's steps: where its own samples would make fewer runs
    (here 1 of 4 rows of 1 token, the template's 2 runs of 2 rows of 10), they take the places of the samples they
    stand for, each within the budget, every sample once."""
    spec = BudgetSpec(20, cost="padded", shuffle=False)
    template = _template(np.full(4, 10), spec, 1)
    assert (template.bins, template.steps) == (2, 2)
    lengths = np.ones(4, dtype=np.int64)
    natural = plan_window(np.arange(4), lengths, spec, 1, (0, 0, 0))
    assert natural.consumed.size == 1  # alone, the window is one step
    kept = plan_window(np.arange(4), lengths, spec, 1, (0, 0, 0), template)
    assert kept.consumed.tolist() == [2, 4] and sorted(kept.samples.tolist()) == [0, 1, 2, 3]
    assert (np.diff(kept.bounds) == 2).all()


def test_more_samples_waiting_for_room_than_micro_batches_are_placed_over_the_next_rounds() -> None:
    """Samples that find no room in a round wait for the micro-batches with the most room; more of them than
    micro-batches (three samples of the whole budget among short ones, 5 processes) raised a numpy ValueError."""
    lengths = [1, 14, 1, 1, 1, 55, 55, 2, 1, 5, 1, 2, 5, 5, 1, 1, 2, 55, 3, 19, 1, 1, 2]
    plan = plan_epoch(BudgetSpec(55, cost="attention", seed=3, window=49), lengths, 5)
    assert sorted(_real(plan).tolist()) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in plan.samples[a:b]) <= 55 for a, b in zip(plan.bounds, plan.bounds[1:]))


@pytest.mark.parametrize("cost", ["tokens", "attention"])
def test_no_step_is_padding_only_and_every_place_is_one_steps(cost: str) -> None:
    """Nine samples of nearly the budget on 3 processes: 3 steps, each with a real sample on every process (the
    budget's 95 % fill asked for 4: a step of padding only, and two steps after which the epoch had consumed as
    many samples, so a position saved after the empty step resumed before it)."""
    plan = plan_epoch(BudgetSpec(45, cost=cost), [44] * 9, 3)
    assert plan.num_steps == 3 and (plan.real == 1).all()
    assert [plan.steps_before(int(place)) for place in plan.consumed] == [1, 2, 3]


@pytest.mark.parametrize(
    ("lengths", "n", "oversized"),
    [([10] * 24 + [0, 0], 5, "error"), ([30, 0, 0, 0], 3, "alone")],
    ids=["full-and-empty", "oversized-and-empty"],
)
def test_samples_of_no_tokens_leave_no_step_of_padding_only(lengths: list[int], n: int, oversized: str) -> None:
    """A window's last samples, waiting for room, go to the micro-batches of no samples before those that hold
    samples of no tokens: the step none of the window's first samples reached gets one (else a step of padding
    only, and a position saved after it resumed before it)."""
    plan = plan_epoch(BudgetSpec(10, shuffle=False, oversized=oversized), lengths, n)
    assert (plan.real.reshape(-1, n).sum(axis=1) >= 1).all()
    assert [plan.steps_before(int(place)) for place in plan.consumed] == list(range(1, plan.num_steps + 1))
