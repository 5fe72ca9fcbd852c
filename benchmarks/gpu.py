"""shardplug on a GPU: feeding batches and optimizer steps, each figure against a baseline of the same run.

    python benchmarks/gpu.py            # full sizes (a minute or two on one GPU)
    python benchmarks/gpu.py --quick    # tiny sizes: checks the script still runs

Without CUDA it says so and exits with status 0 (the figures need a GPU; ``make gpu-check`` runs this
and tests/gpu/). Figures:

* feed: ready batches in pinned host memory and a compute step of about the copy's length; shardplug
  (``put_on_device=True``, ``prefetch_depth=2``, opt-in) against max(copy, compute), against a hand-written loop
  that copies batch k+1 on a side stream while batch k computes, and against copy-then-compute on one stream;
  then the defaults (pageable memory, ``non_blocking=False``, depth 0) against plain ``.to(device)`` of the same.
  Every batch a feed hands to its step is checksummed on the device and checked after the run (a missing
  wait shows as a wrong checksum, never as a speed-up);
* step: fp16 ``GradScaler`` + ``AdamW(fused=True)``, ``PreparedOptimizer`` + ``PreparedScheduler`` against
  torch's own loop, with the host waits per step counted twice: ``torch.cuda.set_sync_debug_mode`` (stream and
  device synchronizes) and ``torch.cuda.Event.synchronize`` calls (which the former does not see);
* small batches and images per epoch: shardplug's loader against a plain ``DataLoader`` moved by hand.

When ``accelerate`` happens to be installed, its figure is shown beside shardplug's (never a dependency).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from shardplug import prepare_data_loader  # noqa: E402
from shardplug.core.stepping.optimizer import PreparedOptimizer  # noqa: E402
from shardplug.core.stepping.scheduler import PreparedScheduler  # noqa: E402

try:  # optional: the reference, for a side-by-side figure only
    import accelerate.data_loader as reference  # type: ignore[import-not-found]
except ImportError:
    reference = None

DEVICE = torch.device("cuda", 0)


def best_of(repeats: int, run: Callable[[], None], after: Callable[[], None] | None = None) -> float:
    """The best wall time of ``repeats`` runs of ``run`` (the GPU drained before and after each; ``after``
    runs after each, untimed)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        if after is not None:
            after()
    return best


class Checksum:
    """The sum of every batch a feed hands to its step, kept on the device; :meth:`check` compares it with the
    sum of the batches the data holds and raises on a difference."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.expected = sum(float(b.double().sum()) for b in batches)
        self.seen: list[torch.Tensor] = []
        self.name = ""

    def __call__(self, batch: torch.Tensor) -> None:
        self.seen.append(batch.sum(dtype=torch.float64))

    def check(self) -> None:
        total = float(torch.stack(self.seen).sum()) if self.seen else 0.0
        self.seen.clear()
        if total != self.expected:
            raise SystemExit(f"{self.name}: the batches fed sum to {total}, the data to {self.expected}")

    def timed(self, name: str, run: Callable[[], None]) -> float:
        self.name = name
        self.seen.clear()
        return best_of(3, run, self.check)


class Ready(Dataset):
    """Batches made once, in pinned host memory (a loader whose batches are ready: only the copy is left)."""

    def __init__(self, count: int, mib: int) -> None:
        numel = mib * (1 << 20) // 4
        self.batches = [torch.full((numel,), float(i)).pin_memory() for i in range(count)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batches[i]


def compute_step(weight: torch.Tensor, rounds: int, checksum: Checksum | None = None) -> Callable[[torch.Tensor], None]:
    def step(batch: torch.Tensor) -> None:
        if checksum is not None:
            checksum(batch)  # before the step changes it
        x = weight
        for _ in range(rounds):
            x = x @ weight
        batch.add_(1)  # the step uses its batch

    return step


def feed(quick: bool) -> list[tuple[str, float, float | None]]:
    count, mib = (6, 8) if quick else (24, 128)
    data = Ready(count, mib)
    weight = torch.randn(2048, 2048, device=DEVICE) / 64
    copy_time = best_of(3, lambda: [b.to(DEVICE, non_blocking=True) for b in data.batches]) / count
    rounds = 1
    while rounds < 4096:  # a step of about the copy's length
        trial = compute_step(weight, rounds)
        if best_of(2, lambda: trial(torch.zeros(1, device=DEVICE))) >= copy_time:  # noqa: B023 (run at once)
            break
        rounds *= 2
    plain_step = compute_step(weight, rounds)
    compute_time = best_of(3, lambda: [plain_step(torch.zeros(1, device=DEVICE)) for _ in range(count)]) / count
    limit = max(copy_time, compute_time)
    checksum = Checksum(data.batches)
    step = compute_step(weight, rounds, checksum)

    def one_stream() -> None:
        for batch in data.batches:
            step(batch.to(DEVICE, non_blocking=True))

    def side_stream() -> None:
        side = torch.cuda.Stream()
        current = torch.cuda.current_stream()

        def start(batch: torch.Tensor) -> tuple[torch.Tensor, Any]:
            with torch.cuda.stream(side):
                moved = batch.to(DEVICE, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            return moved, event

        upcoming = start(data.batches[0])
        for k in range(count):
            moved, event = upcoming
            if k + 1 < count:
                upcoming = start(data.batches[k + 1])
            current.wait_event(event)
            moved.record_stream(current)
            step(moved)

    pageable = [b.clone() for b in data.batches]  # the default: a loader that does not pin

    def plain_pageable() -> None:
        for batch in pageable:
            step(batch.to(DEVICE))  # non_blocking=False, as torch's default

    def loader_of(depth: int | None, source: Any = data, non_blocking: bool = True) -> Callable[[], None]:
        loader = prepare_data_loader(
            DataLoader(source, batch_size=None),
            num_processes=1,
            process_index=0,
            put_on_device=True,
            device=DEVICE,
            non_blocking=non_blocking,
            prefetch_depth=depth,
        )

        def run() -> None:
            for batch in loader:
                step(batch)

        return run

    runs = [
        ("feed: copy then compute, one stream", one_stream),
        ("feed: hand-written side-stream loop", side_stream),
        ("feed: shardplug, prefetch_depth=0", loader_of(0)),
        ("feed: shardplug, prefetch_depth=2 (opt-in)", loader_of(2)),
        ("feed: plain .to(device) from pageable memory (torch's defaults)", plain_pageable),
        ("feed: shardplug defaults (pageable, non_blocking=False, depth 0)", loader_of(None, pageable, False)),
        ("feed: shardplug, pageable memory, prefetch_depth=2", loader_of(2, pageable, False)),
    ]
    rows = [("feed: max(copy, compute), per batch", limit, None)]
    rows += [(name, checksum.timed(name, run) / count, None) for name, run in runs]
    if reference is not None:
        try:
            shard = reference.DataLoaderShard(data, batch_size=None, device=DEVICE, non_blocking=True)
        except TypeError as exc:  # another accelerate version: its figure is left out, with why
            print(f"accelerate's DataLoaderShard left out: {exc}")
        else:

            def accelerate_run() -> None:
                for batch in shard:
                    step(batch)

            name = "feed: accelerate DataLoaderShard"
            rows.append((name, checksum.timed(name, accelerate_run) / count, None))
    return [(name, value, value / limit) for name, value, _ in rows]


def _model(width: int, depth: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(DEVICE)


def step_figures(quick: bool, width: int, depth: int, batch: int, label: str) -> list[tuple[str, float, float | None]]:
    steps = 20 if quick else 200

    def loop(prepared: bool, count_syncs: bool = False) -> tuple[float, float]:
        torch.manual_seed(0)
        model = _model(width, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
        scaler = torch.amp.GradScaler("cuda")
        opt_: Any = opt
        sched_: Any = sched
        if prepared:
            opt_ = PreparedOptimizer(opt, scaler=scaler)
            sched_ = PreparedScheduler(sched, opt_, num_processes=1)
        x = torch.randn(batch, width, device=DEVICE)
        syncs = 0
        original = torch.cuda.Event.synchronize

        def counted(event: Any) -> None:
            nonlocal syncs
            syncs += 1
            original(event)

        def one() -> None:
            nonlocal syncs
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if count_syncs:
                    torch.cuda.set_sync_debug_mode("warn")
                    torch.cuda.Event.synchronize = counted  # type: ignore[method-assign,assignment]
                try:
                    if prepared:
                        opt_.step()
                    else:
                        scaler.step(opt)
                        scaler.update()
                    sched_.step()
                    opt_.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.Event.synchronize = original  # type: ignore[method-assign,assignment]
            syncs += sum("synchroniz" in str(w.message) for w in caught)

        for _ in range(5):
            one()
        if count_syncs:
            syncs = 0
            for _ in range(steps):
                one()
            return 0.0, syncs / steps
        return best_of(3, lambda: [one() for _ in range(steps)]) / steps, 0.0

    raw, _ = loop(False)
    ours, _ = loop(True)
    _, raw_syncs = loop(False, count_syncs=True)
    _, our_syncs = loop(True, count_syncs=True)
    return [
        (f"step {label}: torch's own loop", raw, None),
        (f"step {label}: PreparedOptimizer + PreparedScheduler", ours, ours / raw),
        (f"step {label}: host waits per step (syncs + event waits), torch's own loop", raw_syncs, None),
        (f"step {label}: host waits per step (syncs + event waits), shardplug", our_syncs, None),
    ]


def _epoch(loader: Iterable[Any], move: bool) -> None:
    for batch in loader:
        batch = batch.to(DEVICE, non_blocking=True) if move else batch
        batch.float().sum()


def loader_figures(quick: bool) -> list[tuple[str, float, float | None]]:
    rows: list[tuple[str, float, float | None]] = []
    samples = list(torch.randn(2000 if quick else 20000, 16))
    plain = DataLoader(samples, batch_size=8)
    ours = prepare_data_loader(DataLoader(samples, batch_size=8), put_on_device=True, device=DEVICE)
    raw = best_of(3, lambda: _epoch(plain, True)) / len(plain)
    mine = best_of(3, lambda: _epoch(ours, False)) / len(plain)
    rows += [("small batches: plain DataLoader + .to(), per batch", raw, None)]
    rows += [("small batches: shardplug", mine, mine / raw)]
    images = torch.randint(0, 255, (256 if quick else 4096, 3, 224, 224), dtype=torch.uint8)
    settings = {"batch_size": 128, "num_workers": 2 if quick else 6, "persistent_workers": True, "pin_memory": True}
    plain = DataLoader(list(images), **settings)
    ours = prepare_data_loader(DataLoader(list(images), **settings), put_on_device=True, device=DEVICE)
    raw = best_of(3, lambda: _epoch(plain, True))
    mine = best_of(3, lambda: _epoch(ours, False))
    rows += [("images per epoch: plain DataLoader + .to()", raw, None)]
    rows += [("images per epoch: shardplug", mine, mine / raw)]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    quick = parser.parse_args().quick
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; these figures need a GPU (make gpu-check on a GPU machine)")
        return 0
    print(f"device: {torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}")
    rows = feed(quick)
    rows += step_figures(quick, 2048, 4, 256, "4 x Linear(2048), batch 256")
    rows += step_figures(quick, 256, 2, 32, "2 x Linear(256), batch 32 (launch-bound)")
    rows += loader_figures(quick)
    width = max(len(name) for name, _, _ in rows)
    for name, value, ratio in rows:
        shown = f"{value * 1e3:9.3f} ms" if "waits" not in name else f"{value:9.2f}   "
        print(f"{name:<{width}}  {shown}" + (f"  {ratio:5.2f}x" if ratio is not None else ""))
    print(
        "targets: feed <= 1.05x max(copy, compute); launch-bound step <= 1.01x; small batches <= 1.03x; "
        "host waits per fused step with a prepared scheduler: 1 event wait by design (docs/gpu.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
