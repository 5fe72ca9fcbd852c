"""Benchmarks of ``shardplug.Mixture`` (docs/mixtures.md, docs/benchmarks.md "Mixtures").

M1: the first batch after a resume at 90 % of an epoch of 10**9 samples over 8 sources, one process of 1,024
(time, and resident memory above what the imports hold: the order is computed, never stored).
M2: per-batch time of a prepared loader over a Mixture of 8 sources against the same loader over one data set
of the same samples (batch 32, one process): with items that cost nothing to read (the mixture's own overhead,
bare) and with items that cost about 20 us each (a light decode).

Usage: ``python benchmarks/mixture.py [--quick]`` (``--quick``: tiny sizes, for the suite's check that it runs).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

import shardplug


class Span(Dataset[int]):
    """``n`` samples ``start .. start + n - 1`` (each read in ``cost`` seconds of busy work)."""

    def __init__(self, start: int, n: int, cost: float = 0.0) -> None:
        self.start, self.n, self.cost = start, n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.cost:
            until = time.perf_counter() + self.cost
            while time.perf_counter() < until:
                pass
        return self.start + int(i)


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _sources(total: int, cost: float = 0.0) -> dict[str, Span]:
    sizes = [total // 4, total // 4, total // 8, total // 8, total // 8, total // 16, total // 32, total // 32]
    sizes[0] += total - sum(sizes)
    return {f"s{k}": Span(sum(sizes[:k]), size, cost) for k, size in enumerate(sizes)}


WEIGHTS = {f"s{k}": w for k, w in enumerate([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])}


def m1_first_batch_after_resume(total: int, processes: int) -> tuple[float, float]:
    """(seconds, MiB above the imports) of the first batch after a resume at 90 % of the epoch."""
    gc.collect()
    before = _rss_mib()
    start = time.perf_counter()
    mixture = shardplug.Mixture(_sources(total), WEIGHTS, seed=0)
    loader = shardplug.prepare_data_loader(DataLoader(mixture, batch_size=32), num_processes=processes, process_index=7)
    consumed = (total * 9 // 10) // 32 // processes * processes
    state = loader.state_dict()
    state.update(consumed=consumed, batches_yielded=consumed // processes, epoch=3)
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start, _rss_mib() - before


def _per_batch(make: Callable[[], Any], batches: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        loader = make()
        start = time.perf_counter()
        for k, _batch in enumerate(loader):
            if k + 1 == batches:
                break
        best = min(best, (time.perf_counter() - start) / batches)
    return best


def m2_overhead(total: int, batches: int, cost: float, repeats: int) -> tuple[float, float]:
    """(seconds per batch over the mixture, over one data set of the same samples and cost)."""
    mixture = shardplug.Mixture(_sources(total, cost), WEIGHTS, seed=0)
    one = Span(0, total, cost)
    mixed = plain = float("inf")
    for _ in range(repeats):  # interleaved, the best of each: the machine's load changes alike for both
        mixed = min(
            mixed, _per_batch(lambda: shardplug.prepare_data_loader(DataLoader(mixture, batch_size=32)), batches, 1)
        )
        plain = min(
            plain, _per_batch(lambda: shardplug.prepare_data_loader(DataLoader(one, batch_size=32)), batches, 1)
        )
    return mixed, plain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that it runs")
    quick = parser.parse_args(argv).quick
    total, processes = (10**6, 8) if quick else (10**9, 1024)
    seconds, mib = m1_first_batch_after_resume(total, processes)
    print(
        f"M1 first batch after a resume at 90% of {total:.0e} over 8 sources, N={processes}: "
        f"{seconds * 1000:.1f} ms, {mib:.1f} MiB above the imports"
    )
    batches, repeats = (20, 1) if quick else (300, 7)
    for cost, label in ((0.0, "bare items"), (20e-6, "items of ~20 us")):
        mixed, plain = m2_overhead(10**5 if quick else 10**7, batches, cost, repeats)
        print(
            f"M2 per batch of 32, {label}: mixture {mixed * 1e6:.0f} us vs one data set {plain * 1e6:.0f} us "
            f"({mixed / plain:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
