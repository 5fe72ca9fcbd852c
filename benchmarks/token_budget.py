"""Token budgets: the balance of a step's micro-batches and the padding, shardplug's plan against the same samples
batched by a user's token-budget sampler and dealt round-robin by ``prepare_data_loader`` (what a user gets without
``TokenBudgetBatchSampler``), and the planning time per 10^6 lengths.

    python benchmarks/token_budget.py            # full sizes (about a minute on 2 cores)
    python benchmarks/token_budget.py --quick    # tiny sizes: checks the benchmark still runs (CI)

Balance: for each step, max / mean of the N micro-batches' costs (``"tokens"``: sum of lengths; ``"attention"``:
sum of squared lengths; ``"padded"``: rows x longest), its median, 95th percentile and maximum over the epoch's
steps. Padding: padded tokens / real tokens - 1 (rows x longest). The baselines' batches, each within the budget:

* ``random``: filled in the epoch's shuffled order (a user's sampler that does not know lengths beyond the budget);
* ``by length``: the shuffled order sorted by length in chunks of 100 batches, batches filled in that order, then
  shuffled (the usual remedy against padding; Hugging Face's ``LengthGroupedSampler`` order where transformers is
  installed, else the same idea written here).

Every baseline goes through ``BatchSamplerShard`` (the path ``prepare_data_loader`` takes for a user's batch
sampler): global batch ``s * N + p`` is process ``p``'s at step ``s``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import tracemalloc
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardplug import BatchSamplerShard, TokenBudgetBatchSampler, prepare_data_loader  # noqa: E402
from shardplug.core.sharding.budget_plan import BudgetSpec, Strata, plan_epoch  # noqa: E402

try:  # optional: Hugging Face's length-grouped order, for the "by length" baseline
    from transformers.trainer_pt_utils import LengthGroupedSampler  # type: ignore[import-not-found]
except ImportError:
    LengthGroupedSampler = None


def lengths_of(kind: str, n: int, high: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "lognormal":
        values = rng.lognormal(np.log(high) / 2.2, 1.3, size=n)
    else:
        values = rng.zipf(1.5, size=n) * 2.0
    return np.clip(values, 2, high).astype(np.int64)


def greedy_batches(order: np.ndarray, lengths: np.ndarray, budget: int, padded: bool) -> list[list[int]]:
    """Batches filled in ``order`` while they fit ``budget`` (tokens, or rows x longest for ``padded``)."""
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = longest = 0
    for i in order.tolist():
        n = int(lengths[i])
        fits = ((len(batch) + 1) * max(longest, n) <= budget) if padded else (tokens + n <= budget)
        if batch and not fits:
            batches.append(batch)
            batch, tokens, longest = [], 0, 0
        batch.append(i)
        tokens, longest = tokens + n, max(longest, n)
    if batch:
        batches.append(batch)
    return batches


def by_length_order(lengths: np.ndarray, rows_per_batch: int, seed: int) -> np.ndarray:
    """Hugging Face's length-grouped order where installed, else megabatches of 100 batches sorted by length."""
    if LengthGroupedSampler is not None:
        import torch

        sampler = LengthGroupedSampler(
            rows_per_batch, lengths=lengths.tolist(), generator=torch.Generator().manual_seed(seed)
        )
        return np.fromiter(iter(sampler), dtype=np.int64, count=len(lengths))
    order = random_order(lengths.size, seed)
    chunk = rows_per_batch * 100
    parts = [
        part[np.argsort(-lengths[part], kind="stable")] for part in np.array_split(order, max(1, order.size // chunk))
    ]
    return np.concatenate(parts)


def random_order(n: int, seed: int) -> np.ndarray:
    """A shuffled order of ``n`` samples (a user's random sampler)."""
    return np.random.default_rng(seed).permutation(n)


def dealt(batches: list[list[int]], n: int) -> list[list[list[int]]]:
    """Each process's batches of ``batches`` as ``prepare_data_loader`` shares out a user's batch sampler."""
    return [list(BatchSamplerShard(batches, n, p, even_batches=True)) for p in range(n)]


def cost_of(batch: list[int] | np.ndarray, lengths: np.ndarray, cost: str) -> float:
    values = lengths[np.asarray(batch, dtype=np.int64)].astype(np.float64)
    if cost == "tokens":
        return float(values.sum())
    if cost == "attention":
        return float((values**2).sum())
    return float(values.size * values.max())


def ratios(costs: np.ndarray) -> tuple[float, float, float]:
    """Median, 95th percentile and maximum over steps of the step's max / mean (``costs``: steps x N)."""
    ratio = costs.max(axis=1) / costs.mean(axis=1)
    return float(np.median(ratio)), float(np.percentile(ratio, 95)), float(ratio.max())


def padding(batches: list[list[int]] | list[np.ndarray], lengths: np.ndarray) -> float:
    padded = sum(len(b) * int(lengths[np.asarray(b, dtype=np.int64)].max()) for b in batches)
    return padded / float(sum(int(lengths[np.asarray(b, dtype=np.int64)].sum()) for b in batches)) - 1


def plan_stats(lengths: np.ndarray, budget: int, n: int, cost: str) -> tuple[tuple[float, float, float], float]:
    """:func:`plan_rows` computed on the plan's arrays (no batch lists: for millions of lengths)."""
    plan = plan_epoch(BudgetSpec(budget, cost=cost, seed=1), lengths, n)
    values, starts = lengths[plan.samples].astype(np.float64), plan.bounds[:-1]
    rows_by_longest = np.diff(plan.bounds) * np.maximum.reduceat(values, starts)
    if cost == "attention":
        costs = np.add.reduceat(values**2, starts)
    else:
        costs = rows_by_longest if cost == "padded" else np.add.reduceat(values, starts)
    return ratios(costs.reshape(-1, n)), float(rows_by_longest.sum() / lengths.sum() - 1)


def plan_rows(lengths: np.ndarray, budget: int, n: int, cost: str) -> tuple[tuple[float, float, float], float]:
    plan = plan_epoch(BudgetSpec(budget, cost=cost, seed=1), lengths, n)
    samples, bounds = plan.samples, plan.bounds  # (each joins every window: once)
    batches = [samples[bounds[k] : bounds[k + 1]] for k in range(bounds.size - 1)]
    costs = np.array([cost_of(b, lengths, cost) for b in batches]).reshape(-1, n)
    return ratios(costs), padding(batches, lengths)


def baseline_rows(
    lengths: np.ndarray, budget: int, n: int, cost: str, order: np.ndarray
) -> tuple[tuple[float, float, float], float]:
    batches = greedy_batches(order, lengths, budget, padded=cost == "padded")
    if order is not None and cost == "padded":
        rng = np.random.default_rng(3)
        batches = [batches[i] for i in rng.permutation(len(batches))]  # formed by length, then shuffled
    parts = dealt(batches, n)
    steps = min(len(part) for part in parts)
    costs = np.array([[cost_of(parts[p][s], lengths, cost) for p in range(n)] for s in range(steps)])
    return ratios(costs), padding(batches, lengths)


def figure(path: str) -> None:
    """An SVG of one step's micro-batches per process (each sample a bar as long as its tokens), the plan's
    (``cost="attention"``) beside a user's batches dealt round-robin, for the issue's probe lengths."""
    lengths = lengths_of("lognormal", 6_000, 4_096)
    budget, n, step = 16_384, 4, 3
    plan = plan_epoch(BudgetSpec(budget, cost="attention", seed=1), lengths, n)
    samples, bounds = plan.samples, plan.bounds
    ours = [samples[bounds[k] : bounds[k + 1]] for k in range(step * n, step * n + n)]
    theirs = [part[step] for part in dealt(greedy_batches(random_order(lengths.size, 1), lengths, budget, False), n)]
    scale, bar, gap, left = 560 / budget, 22, 8, 150
    rows = []
    y = 30
    for title, batches in (
        ("TokenBudgetBatchSampler (attention)", ours),
        ("a user's sampler, dealt round-robin", theirs),
    ):
        costs = [cost_of(b, lengths, "attention") for b in batches]
        rows.append(
            f'<text x="10" y="{y - 8}" font-size="13" font-weight="bold">{title}: max / mean of the step\'s '
            f"attention {max(costs) / (sum(costs) / n):.2f}</text>"
        )
        for p, batch in enumerate(batches):
            x = left
            rows.append(f'<text x="10" y="{y + 16}" font-size="12">process {p}: {int(costs[p] / 1e6)}M</text>')
            for k, i in enumerate(np.asarray(batch).tolist()):
                width = max(int(lengths[i]) * scale, 1)
                fill = "#4a78b0" if k % 2 == 0 else "#9cbbe0"
                rows.append(f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{bar}" fill="{fill}"/>')
                x += width
            y += bar + gap
        y += 30
    end = left + budget * scale
    rows.append(f'<line x1="{end}" y1="10" x2="{end}" y2="{y - 30}" stroke="#c33" stroke-dasharray="4"/>')
    rows.append(f'<text x="{end - 80}" y="{y - 12}" font-size="12" fill="#c33">max_tokens</text>')
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(end) + 20}" height="{y}" font-family="sans-serif">'
        + "".join(rows)
        + "</svg>\n"
    )
    with open(path, "w") as f:
        f.write(svg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (checks that the benchmark runs)")
    parser.add_argument("--figure", metavar="SVG", help="write the figure of one step (docs) and stop")
    args = parser.parse_args()
    if args.figure:
        figure(args.figure)
        return
    sets = [("lognormal", 6_000, 4_096, 16_384)]  # the probe: 2 to 4,096 tokens, a budget of 16,384
    if not args.quick:
        sets += [("lognormal", 200_000, 131_072, 262_144), ("zipf", 200_000, 131_072, 262_144)]
    print("T1 balance of a step (max / mean of its N micro-batches' costs: median / p95 / max) and padding")
    header = f"{'lengths':<28} {'N':>2} {'cost':<10} {'shardplug plan':<30} {'random, round-robin':<30}"
    print(f"{header} by length, round-robin")
    for kind, n_samples, high, budget in sets:
        lengths = lengths_of(kind, n_samples, high)
        shuffled = random_order(lengths.size, 1)
        grouped = by_length_order(lengths, max(1, budget // int(np.mean(lengths))), seed=1)
        for n in (2,) if args.quick else (2, 4, 8):
            for cost in ("tokens", "attention", "padded"):
                cells = []
                for (med, p95, top), pad in (
                    plan_rows(lengths, budget, n, cost),
                    baseline_rows(lengths, budget, n, cost, shuffled),
                    baseline_rows(lengths, budget, n, cost, grouped),
                ):
                    cells.append(f"{med:.3f}/{p95:.3f}/{top:.2f} pad {pad * 100:.1f}%")
                name = f"{kind} {n_samples} (≤{high}, T={budget})"
                print(f"{name:<28} {n:>2} {cost:<10} {cells[0]:<30} {cells[1]:<30} {cells[2]}")
    print("\nT1b the plan alone where an epoch is many windows (of 131,072 samples, each one sample of each group)")
    for kind in ("lognormal", "zipf"):
        size = 20_000 if args.quick else 2_000_000
        lengths = lengths_of(kind, size, 131_072)
        for cost in ("attention", "padded"):
            (med, p95, top), pad = plan_stats(lengths, 262_144, 8, cost)
            print(f"T1b {kind} {size:,} (≤131072, T=262144)  8 {cost:<10} {med:.3f}/{p95:.3f}/{top:.2f} pad {pad:.1%}")
    sizes = [10**4] if args.quick else [10**6, 10**7]
    print("\nT2 planning time of one epoch, wall and this process's CPU (one core of its own; best of 3)")
    for size in sizes:
        lengths = lengths_of("lognormal", size, 4_096)
        for cost in ("tokens", "attention", "padded"):
            best = (float("inf"), float("inf"))

            def plan_all(cost: str = cost, lengths: np.ndarray = lengths) -> None:
                plan = plan_epoch(BudgetSpec(16_384, cost=cost, seed=1), lengths, 8)
                assert not plan.has_step(plan.num_steps)  # every window planned

            for _ in range(1 if size >= 10**7 else 3):
                best = min(best, _timed(plan_all), key=lambda times: times[1])
            wall, cpu = best
            print(
                f"T2 {size:>10,} lengths, N = 8, cost={cost:<9} {wall:6.2f} s ({cpu:.2f} s of CPU, "
                f"{cpu / size * 1e6:.2f} s per 10^6)"
            )

    print("\nT3 the first batch (N = 8, cost=attention): of a pass, of a resume (load_state_dict and the first batch)")
    print("   on 8 and on 4 processes (CPU: this process's, what one core of its own takes); peak memory of a plan")
    for size in sizes:
        lengths = lengths_of("lognormal", size, 4_096).astype(np.int32)
        name = f"T3 {size:>10,} lengths"
        rows = [("a pass from the epoch's start", first_seconds(lengths))]
        rows += [(f"position at {share:.0%} of the epoch", resume_seconds(lengths, share)) for share in (0.1, 0.5, 0.9)]
        rows.append(("position at 50% of the epoch on 4 processes", resume_seconds(lengths, 0.5, resumed_on=4)))
        for what, (wall, cpu) in rows:
            print(f"{name}, {what}: {wall:6.2f} s to the first batch ({cpu:.2f} s of CPU)")
        strata = Strata(lengths, BudgetSpec(16_384, cost="attention", seed=1))
        wall, cpu = _timed(functools.partial(strata.order, 0))
        what = "the epoch's order alone (a ranking by length, in each of these)"
        print(f"{name}: {what} {wall:6.2f} s ({cpu:.2f} s of CPU)")
        tracemalloc.start()
        plan = plan_epoch(BudgetSpec(16_384, cost="attention", seed=1), lengths, 8)
        assert not plan.has_step(plan.num_steps)  # every window planned
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del plan
        print(
            f"T3 {size:>10,} lengths: the plan holds {held / lengths.nbytes:.2f}x the int32 lengths array, "
            f"{peak / lengths.nbytes:.2f}x while it is made"
        )


def _loader(lengths: np.ndarray, num_processes: int = 8) -> Any:
    """Process 0's prepared loader of micro-batches of ``lengths`` (``max_tokens=16384``, ``cost="attention"``)."""
    sampler = TokenBudgetBatchSampler(lengths, 16_384, cost="attention", seed=1)
    data = DataLoader(range(lengths.size), batch_sampler=sampler, collate_fn=lambda batch: batch)
    return prepare_data_loader(data, num_processes=num_processes, process_index=0)


def _timed(work: Any) -> tuple[float, float]:
    """Seconds of wall time and of this process's CPU time that ``work()`` took (on a loaded machine the CPU time
    is what one core of its own would take)."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def first_seconds(lengths: np.ndarray) -> tuple[float, float]:
    """Seconds (wall, CPU) from ``iter()`` of a new loader (process 0 of 8) to its first batch."""
    loader = _loader(lengths)
    return _timed(lambda: next(iter(loader)))


def resume_seconds(lengths: np.ndarray, share: float, resumed_on: int = 8) -> tuple[float, float]:
    """Seconds (wall, CPU) from ``load_state_dict`` of a position at ``share`` of the epoch (saved by process 0 of
    8) to the first batch (process 0 of ``resumed_on``)."""
    saved = _loader(lengths)
    batches = iter(saved)
    for _ in range(int(len(saved) * share)):
        next(batches)
    state = saved.state_dict()
    del saved, batches
    resumed = _loader(lengths, resumed_on)
    return _timed(lambda: (resumed.load_state_dict(state), next(iter(resumed))))


if __name__ == "__main__":
    main()
