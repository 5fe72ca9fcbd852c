"""shardplug benchmarks: every figure against a baseline measured in the same run.

    python benchmarks/run.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/run.py --quick    # tiny sizes: checks the benchmarks still run (CI)

Each figure prints shardplug's time, the baseline's, their ratio and the target; when the
reference implementation (``accelerate``) happens to be installed, its ratio too.  Times are
the best of several repeats (these machines are noisy; absolute times mean little).
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import shardplug  # noqa: E402
from shardplug import (  # noqa: E402
    BatchSamplerShard,
    BijectiveRandomSampler,
    DataLoaderDispatcher,
    SeedableRandomSampler,
    prepare_data_loader,
)
from shardplug.core.sharding.native import NativeStreamPlan  # noqa: E402

try:  # optional: the reference, for a side-by-side ratio only
    import accelerate.data_loader as reference  # type: ignore[import-not-found]
except ImportError:
    reference = None


@dataclass
class Row:
    figure: str
    ours: float
    baseline: float
    target: str
    reference: float | None = None
    unit: str = "s"

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("nan")

    @property
    def reference_ratio(self) -> str:
        if self.reference is None or not self.baseline:
            return "-"
        return f"{self.reference / self.baseline:.2f}x"


def measure_reference(what: str, fn: Callable[[], float]) -> float | None:
    """The reference's time for ``what``, when ``accelerate`` is installed and the call works."""
    if reference is None:
        return None
    try:
        return fn()
    except Exception as exc:  # the reference is optional: report and go on
        progress(f"reference {what} not measured: {type(exc).__name__}: {exc}")
        return None


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_interleaved(first: Callable[[], object], second: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best times of ``first`` and ``second``, run alternately (a burst of load hits both alike)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


def progress(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


class Plain(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _drain(loader) -> None:
    for _ in loader:
        pass


def p1_overhead(n: int, repeats: int) -> list[Row]:
    rows = []
    for num_processes in (1, 2):
        prepared = prepare_data_loader(DataLoader(Plain(n), batch_size=1), num_processes=num_processes, process_index=0)
        plain = DataLoader(Plain(n // num_processes), batch_size=1)
        _drain(prepared)
        ours, base = best_of(lambda: _drain(prepared), repeats), best_of(lambda: _drain(plain), repeats)  # noqa: B023 (run within this iteration)

        def ref(num_processes: int = num_processes) -> float:
            theirs = reference.prepare_data_loader(
                DataLoader(Plain(n), batch_size=1), num_processes=num_processes, process_index=0
            )
            _drain(theirs)
            return best_of(lambda: _drain(theirs), repeats)

        rows.append(
            Row(
                f"P1 per-batch overhead, bs 1, {n} samples, N={num_processes}",
                ours,
                base,
                "<= 1.05x",
                measure_reference("P1", ref),
            )
        )
    return rows


def p2_index_sharding(n: int, repeats: int) -> list[Row]:
    sampler = SeedableRandomSampler(range(n), data_seed=0)
    shard = BatchSamplerShard(BatchSampler(sampler, 32, False), num_processes=8, process_index=3)

    def ours() -> None:
        for _ in shard:
            pass

    base = best_of(lambda: torch.randperm(n), repeats)

    def ref() -> float:
        theirs = reference.BatchSamplerShard(
            BatchSampler(RandomSampler(range(n), generator=torch.Generator().manual_seed(0)), 32, False),
            num_processes=8,
            process_index=3,
        )
        return best_of(lambda: [None for _ in theirs], repeats)

    bijective = BatchSamplerShard(
        BatchSampler(BijectiveRandomSampler(range(n), data_seed=0), 32, False), num_processes=8, process_index=3
    )
    return [
        Row(
            f"P2 one process's indices, {n} shuffled, bs 32, N=8 (vs randperm)",
            best_of(ours, repeats),
            base,
            "<= 2x",
            measure_reference("P2", ref),
        ),
        Row(
            "P2 same, shuffle_algorithm='bijective' (vs randperm)",
            best_of(lambda: _drain(bijective), repeats),
            base,
            "<= 0.3x",
        ),
        *p2_direct_shards(n, repeats),
    ]


def p2_direct_shards(n: int, repeats: int) -> list[Row]:
    """A ``BatchSamplerShard`` built by hand over ``BatchSampler(RandomSampler(n), 32)`` (what users of the
    reference do), without and with a generator, drained, against a ``randperm(n)`` in the same run
    (the two interleaved)."""
    rows = []
    for label, generator in (("", None), (" with a generator", torch.Generator().manual_seed(0))):
        shard = BatchSamplerShard(
            BatchSampler(RandomSampler(range(n), generator=generator), 32, False), num_processes=8, process_index=3
        )
        ours, base = best_of_interleaved(lambda: _drain(shard), lambda: torch.randperm(n), repeats)  # noqa: B023 (run within this iteration)
        rows.append(
            Row(
                f"P2 BatchSamplerShard built directly over BatchSampler(RandomSampler({n}){label}, 32), N=8 "
                "(vs randperm)",
                ours,
                base,
                "<= 1.3x",
            )
        )
    return rows


def p3_stateful(n: int, repeats: int) -> Row | None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        progress("P3 skipped: torchdata is not installed")
        return None
    prepared = prepare_data_loader(DataLoader(Plain(n), batch_size=1), use_stateful_dataloader=True)
    bare = StatefulDataLoader(Plain(n), batch_size=1)
    _drain(prepared), _drain(bare)  # warm-up
    ours, base = best_of_interleaved(lambda: _drain(prepared), lambda: _drain(bare), repeats)

    def ref() -> float:
        theirs = reference.prepare_data_loader(
            DataLoader(Plain(n), batch_size=1), num_processes=1, process_index=0, use_stateful_dataloader=True
        )
        _drain(theirs)
        return best_of(lambda: _drain(theirs), repeats)

    return Row(
        f"P3 stateful loader, bs 1, {n} samples (vs StatefulDataLoader)",
        ours,
        base,
        "<= 1.15x",
        measure_reference("P3", ref),
    )


def p5_resume(n: int, repeats: int) -> list[Row]:
    rows = []
    perm = best_of(lambda: torch.randperm(n), repeats)
    for shuffle in (False, True):
        loader = prepare_data_loader(DataLoader(Plain(n), batch_size=1, shuffle=shuffle), data_seed=1)
        times = {}
        for fraction in (0.01, 0.9, 0.99):

            def first_batch() -> None:
                loader.resume.resume_at(epoch=0, batches_yielded=int(n * fraction))  # noqa: B023 (called within this iteration)
                next(iter(loader))  # noqa: B023 (called within this iteration)

            times[fraction] = best_of(first_batch, repeats)
        spread = max(times.values()) / min(times.values())
        if shuffle:

            def ref() -> float:
                theirs = reference.prepare_data_loader(
                    DataLoader(Plain(n), batch_size=1, shuffle=True), num_processes=1, process_index=0
                )
                return best_of(lambda: next(iter(reference.skip_first_batches(theirs, int(n * 0.9)))), repeats)

            rows.append(
                Row(
                    f"P5 resume at 90% of {n}, shuffled (vs randperm; 1%..99% spread {spread:.2f}x)",
                    times[0.9],
                    perm,
                    "<= 1.5x",
                    measure_reference("P5", ref),
                )
            )
        else:
            rows.append(
                Row(
                    f"P5 resume at 90% of {n}, sequential (1%..99% spread {spread:.2f}x)",
                    times[0.9],
                    0.010,
                    "<= 10 ms",
                    unit="s vs 10 ms",
                )
            )
    return rows


class HeavyFiles(IterableDataset):
    """Records stored in ``files``, each costing CPU time to decode.

    It shards itself (``n_shards`` / ``shard()``, as file-based streams do) and splits its files
    among DataLoader workers, so every record is decoded once in all.
    """

    splits_by_worker = True  # its __iter__ reads only its DataLoader worker's files

    def __init__(self, files: list[int], per_file: int, work: int) -> None:
        self.files, self.per_file, self.work = list(files), per_file, work

    @property
    def n_shards(self) -> int:
        return len(self.files)

    def shard(self, num_shards: int, index: int) -> HeavyFiles:
        return HeavyFiles(self.files[index::num_shards], self.per_file, self.work)

    def __len__(self) -> int:
        return len(self.files) * self.per_file

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        files = self.files if info is None else self.files[info.id :: info.num_workers]
        for f in files:
            for k in range(self.per_file):
                checksum = 0
                for byte in range(self.work):  # a pure-Python decode (parsing), the usual CPU cost
                    checksum = (checksum * 31 + byte + k) & 0xFFFF
                yield f * self.per_file + k


def p6_iterable_workers(files: int, per_file: int, work: int, repeats: int) -> Row:
    own = sorted(x for x in HeavyFiles(list(range(files))[0::2], per_file, 1))

    def raw(workers: int) -> float:  # torch alone on process 0's files: what this machine allows
        loader = DataLoader(
            HeavyFiles(list(range(files))[0::2], per_file, work),
            batch_size=4,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
        _drain(loader)
        return best_of(lambda: _drain(loader), repeats)

    def run(workers: int) -> float:
        dataset = HeavyFiles(list(range(files)), per_file, work)
        loader = prepare_data_loader(
            DataLoader(dataset, batch_size=4, num_workers=workers, persistent_workers=workers > 0),
            num_processes=2,
            process_index=0,
        )  # workers start once, as in training
        seen = sorted(x for batch in loader for x in batch.tolist())
        if seen != own:
            raise AssertionError(f"with {workers} workers process 0 did not read its records exactly once")
        return best_of(lambda: _drain(loader), repeats)

    # One intra-op thread, as DataLoader workers have: otherwise the no-worker baseline already
    # decodes on both cores through torch's own threads, and the figure measures that instead.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with_workers, without = run(2), run(0)
        raw_speedup = raw(0) / raw(2)
    finally:
        torch.set_num_threads(threads)
    return Row(
        f"P6 iterable sharding itself by file + CPU decode, N=2, workers 2 vs 0 (time; throughput "
        f"{without / with_workers:.2f}x; a plain DataLoader on the same records: {raw_speedup:.2f}x)",
        with_workers,
        without,
        ">= 1.6x throughput (<= 0.625x time)",
    )


class Floats(Dataset):
    """``n`` float rows of ``width`` values, read from a preallocated pool (collation copies them)."""

    def __init__(self, n: int, width: int, pool_rows: int = 512) -> None:
        self.n = n
        self.pool = torch.randn(pool_rows, width)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.pool[i % self.pool.shape[0]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _p4_worker(rank: int, world: int, n: int, width: int, per_process: int, repeats: int) -> dict:
    """One gloo process of P4: time an epoch of dispatch mode and of per-process shards, interleaved."""
    dataset = Floats(n, width)

    def dispatcher(overlap_reads: bool | None, shared_memory: bool | None):
        DataLoaderDispatcher.shared_memory = shared_memory  # read when the loader is built
        loader = prepare_data_loader(
            DataLoader(dataset, batch_size=per_process), dispatch_batches=True, put_on_device=True, device="cpu"
        )
        loader.overlap_reads = overlap_reads
        DataLoaderDispatcher.shared_memory = None
        return loader

    loaders = {
        "dispatch": dispatcher(None, None),  # one host: rows through shared memory
        "process_group": dispatcher(None, False),  # every row through the process group (other hosts)
        "overlapped": dispatcher(True, False),  # process group, process 0 reads step t+1 while t is sent
        "shards": prepare_data_loader(DataLoader(dataset, batch_size=per_process), dispatch_batches=False),
    }
    dispatch, shared = loaders["process_group"], loaders["dispatch"]

    def epoch(loader) -> float:
        dist.barrier()
        start = time.perf_counter()
        rows = sum(batch.shape[0] for batch in loader)
        dist.barrier()
        assert rows == n // world, f"rank {rank} got {rows} rows, expected {n // world}"
        return time.perf_counter() - start

    for loader in loaders.values():  # warm-up (first header, allocator)
        epoch(loader)
    times: dict[str, list[float]] = {name: [] for name in loaders}
    before, shared_before = dispatch.dispatch_stats.snapshot(), shared.dispatch_stats.snapshot()
    for _ in range(repeats):
        for name, loader in loaders.items():
            times[name].append(epoch(loader))
    stats, shared_stats = dispatch.dispatch_stats.since(before), shared.dispatch_stats.since(shared_before)
    # calibration: a bare scatter of one global batch (each process's rows from process 0)
    parts = [torch.randn(per_process, width) for _ in range(world)] if rank == 0 else None
    out = torch.empty(per_process, width)

    def scatter_steps() -> None:
        for _ in range(n // (per_process * world)):
            dist.scatter(out, parts, src=0)

    scatter = best_of(lambda: (dist.barrier(), scatter_steps(), dist.barrier()), repeats)
    return {
        **{name: min(t) for name, t in times.items()},
        "stats": stats,
        "shared_stats": shared_stats,
        "scatter": scatter,
    }


def _rank_entry(rank: int, world: int, port: int, out_dir: str, target: Callable[..., dict], args: tuple) -> None:
    """One gloo process of a benchmark: ``target(rank, world, *args)``, its result (or error) written for the parent."""
    torch.set_num_threads(1)
    result: object
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        result = ("ok", target(rank, world, *args))
    except BaseException as exc:  # hand it to the parent instead of losing it in the child
        import traceback

        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def _run_ranks(target: Callable[..., dict], world: int, args: tuple, timeout: float, label: str) -> list[dict]:
    """Run ``target(rank, world, *args)`` on ``world`` spawned gloo processes; their results, by rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_rank_entry, args=(r, world, port, out_dir, target, args)) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if hung:
            raise TimeoutError(f"{label}: ranks {hung} still running after {timeout} s")
        results = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"{label}: rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"{label}: rank {r} failed: {value}")
            results.append(value)
    return results


def p4_dispatch(global_batch_bytes: int, steps: int, repeats: int, timeout: float) -> list[Row]:
    """Dispatch mode vs each process loading its own shard, 2 gloo processes on one host, one epoch
    each: rows through shared memory (this host) and through the process group (other hosts)."""
    world, per_process = 2, 128
    width = global_batch_bytes // (4 * per_process * world)
    n = per_process * world * steps
    results = _run_ranks(_p4_worker, world, (n, width, per_process, repeats), timeout, "P4")
    zero = results[0]
    stats = zero["stats"]
    global_bytes = per_process * world * width * 4
    sent_per_step = stats["bytes_sent"] / max(stats["steps"], 1)
    headers = stats["headers"]
    mib = global_bytes / 2**20
    # without overlap process 0 reads N shards' worth, then scatters: (N * read + scatter) / read
    floor = (world * zero["shards"] + zero["scatter"]) / zero["shards"]
    in_place = zero["shared_stats"]["bytes_collated_in_place"] / max(zero["shared_stats"]["bytes_shared"], 1)
    shared = (
        f"P4 dispatch, N=2 gloo, {mib:g} MiB batches, shared memory (vs own shards; floor {world}x: "
        f"process 0 reads {world} shards; {in_place:.2f} of the shared rows collated in place)"
    )
    group = (
        f"P4 dispatch, N=2 gloo, {mib:g} MiB batches, process group (vs own shards; sent "
        f"{sent_per_step / global_bytes:.2f} batch/step, {headers} header/{stats['steps']} steps; read + scatter "
        f"floor {floor:.1f}x, reads overlapped with sends {zero['overlapped'] / zero['shards']:.1f}x)"
    )
    return [
        Row(shared, zero["dispatch"], zero["shards"], "<= 2.5x"),
        Row(group, zero["process_group"], zero["shards"], "<= 4x"),
    ]


def _status_mib(field: str) -> float:
    """A memory figure of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in MiB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    """This process's resident memory now, in MiB (Linux)."""
    return _status_mib("VmRSS")


def _release_freed_memory() -> None:
    """Hand memory that was freed back to the system (glibc keeps some), so RSS counts what is held."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS then includes freed memory
        pass


def _p7_child(what: str, n: int, world: int) -> dict:
    """One P7 measurement in a fresh process: memory is counted above what the imports hold."""
    _release_freed_memory()
    baseline = _rss_mib()
    if what == "bijective":
        start = time.perf_counter()
        loader = prepare_data_loader(
            DataLoader(Plain(n), batch_size=32, shuffle=True),
            num_processes=world,
            process_index=world // 2,
            data_seed=1,
            shuffle_algorithm="bijective",
        )
        next(iter(loader))
        first = time.perf_counter() - start
        memory = _rss_mib() - baseline
        start = time.perf_counter()
        indices = sum(len(batch) for batch in loader.batch_sampler)
        return {"first": first, "memory": memory, "epoch": time.perf_counter() - start, "indices": indices}
    if what == "randperm":
        start = time.perf_counter()
        torch.randperm(n)
        return {"time": time.perf_counter() - start}
    if what == "audit":
        audit = shardplug.SampleAudit(n)
        step = 1 << 20
        for first in range(0, n, step):  # the whole epoch seen: every page of the bitmaps touched
            audit.record(0, torch.arange(first, min(first + step, n)), min(step, n - first))
        report = audit.report(0)
        assert report.exact
        _release_freed_memory()
        return {"memory": _rss_mib() - baseline}
    raise ValueError(what)


def _peak_rss_mib() -> float:
    """This process's peak resident memory since the last :func:`_reset_peak_rss`, in MiB (Linux)."""
    return _status_mib("VmHWM")


def _reset_peak_rss() -> None:
    """Make the peak resident memory start again from the current one (Linux ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _p7_gather_worker(rank: int, world: int, n: int, of: int) -> dict:
    """One process of ``of`` over ``n`` samples (its ids spread over the whole epoch, as a shuffle's are):
    the peak memory of ``audit.gathered().report()`` above the records it holds."""
    audit = shardplug.SampleAudit(n)
    step = 1 << 20
    for first in range(rank, n, step * of):
        ids = torch.arange(first, min(first + step * of, n), of)
        audit.record(0, ids, ids.numel())
    _release_freed_memory()
    held = _rss_mib()
    _reset_peak_rss()
    report = audit.gathered().report(0)
    peak = _peak_rss_mib() - held
    assert report.seen == sum(len(range(r, n, of)) for r in range(world)) and report.duplicated_count == 0
    return {"peak": peak, "records": audit.nbytes / 2**20}


def p7_audit_report(n: int, sizes: tuple[int, int], timeout: float) -> Row:
    """The peak memory of ``gathered().report()`` for one process of 1,024 (2 gloo processes, each with the
    records of one process of 1,024), measured at two sizes and extrapolated linearly to ``n``."""
    small, large = (_run_ranks(_p7_gather_worker, 2, (size, 1024), timeout, "P7 audit report")[0] for size in sizes)
    slope = (large["peak"] - small["peak"]) / (sizes[1] - sizes[0])
    peak = max(small["peak"] + slope * (n - sizes[0]), large["peak"])
    return Row(
        f"P7 audit.gathered().report() peak above the records, one process of 1024, {n:.0e} samples (measured "
        f"at {sizes[0]:.0e}: {small['peak']:.0f} MiB and {sizes[1]:.0e}: {large['peak']:.0f} MiB, extrapolated "
        "linearly)",
        peak,
        500.0,
        "<= 500 MB",
        unit="MiB",
    )


def _largest_randperm() -> int:
    """The largest randperm this machine allows comfortably (a third of its free memory, 8 bytes
    an index plus randperm's own working copy), at most a billion."""
    with open("/proc/meminfo") as meminfo:
        free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    return int(min(10**9, free // 3 // 16))


P7_IN_PROCESS = [False]
"""``--quick``: P7's measures run in this process (their figures mean nothing at quick sizes; no child's start)."""


def _p7_measure(what: str, n: int, world: int = 1) -> dict:
    import json

    if P7_IN_PROCESS[0]:
        return _p7_child(what, n, world)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--p7-child", what, str(n), str(world)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"P7 {what} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def p7_billion(n: int, world: int, randperm_n: int, audit_n: int) -> list[Row]:
    """The bijective shuffle at a billion samples, one process of ``world``; randperm at the
    largest size this machine allows beside it; the audit's memory on a sized-down dataset."""
    ours = _p7_measure("bijective", n, world)
    perm = _p7_measure("randperm", randperm_n)["time"]
    per_billion = perm * n / randperm_n  # randperm is linear in n: what it would cost at n
    small, large = (_p7_measure("audit", size)["memory"] for size in (audit_n // 10, audit_n))
    per_sample = (large - small) / (audit_n - audit_n // 10)  # MiB a sample: the slope between two sizes
    audit = small + per_sample * (n - audit_n // 10)
    label = f"n={n:.0e}, N={world}, one process"
    return [
        Row(
            f"P7 first batch, bijective shuffle, {label} (vs randperm({randperm_n:.0e}))",
            ours["first"],
            perm,
            "<= 50 ms",
        ),
        Row(
            f"P7 resident memory above imports after the first batch, {label}",
            ours["memory"],
            100.0,
            "<= 100 MB",
            unit="MiB",
        ),
        Row(
            f"P7 whole epoch of one process's {ours['indices']} indices, {label} (vs randperm({n:.0e}) extrapolated)",
            ours["epoch"],
            per_billion,
            "<= 1 s",
        ),
        Row(
            f"P7 audit memory for {n:.0e} samples, one epoch (measured at {audit_n // 10:.0e} and {audit_n:.0e}, "
            f"extrapolated linearly: {per_sample * 2**20 * 8:.2f} bits a sample)",
            audit,
            250.0,
            "<= 250 MB",
            unit="MiB",
        ),
    ]


READS = [0]
"""Elements the P8 stream decoded in this process (its map function counts them)."""


def _decode(row: dict, work: int) -> dict:
    """A pure-Python decode of one record (parsing), the usual CPU cost of a stream."""
    READS[0] += 1
    checksum = 0
    for byte in range(work):
        checksum = (checksum * 31 + byte + row["x"]) & 0xFFFF
    return {"x": row["x"], "checksum": checksum}


class _Opaque(IterableDataset):
    """A stream that hides how to shard it (no ``n_shards`` / ``shard``): every process reads it."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def __iter__(self):
        return iter(self.stream)


def _p8_worker(rank: int, world: int, files: list, work: int, step_ms: float, repeats: int) -> dict:
    """One gloo process of P8: a Hugging Face stream sharded natively vs read by every process."""
    import datasets

    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    stream = stream.map(_decode, fn_kwargs={"work": work})
    loaders = {
        "native": prepare_data_loader(DataLoader(stream, batch_size=8)),  # no len(): the agreement
        "unagreed": prepare_data_loader(DataLoader(stream, batch_size=8), even_batches=False),
        "read_all": prepare_data_loader(DataLoader(_Opaque(stream), batch_size=8)),
    }

    def train_step() -> None:  # step_ms of the caller's work a step, the CPU free (an accelerator's step)
        time.sleep(step_ms / 1e3)

    def epoch(loader) -> tuple[float, int, int]:
        dist.barrier()
        READS[0] = 0
        start = time.perf_counter()
        steps = 0
        for _ in loader:
            train_step()
            steps += 1
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed, READS[0], steps

    measured: dict[str, list] = {name: [] for name in loaders}
    for loader in loaders.values():
        epoch(loader)  # warm-up
    for _ in range(repeats):
        for name, loader in loaders.items():
            measured[name].append(epoch(loader))
    return {name: (min(t for t, _, _ in runs), runs[0][1], runs[0][2]) for name, runs in measured.items()}


def p8_streams(rows_per_shard: int, work: int, step_ms: float, repeats: int, timeout: float) -> list[Row]:
    """A Hugging Face stream with a decode-heavy map on 2 gloo processes, ``step_ms`` of the caller's
    work a step: native shards vs read by all, and the cost of the exhaustion agreement (one
    all-reduce a step, in flight while the caller works) vs none."""
    try:
        import datasets
    except ImportError:
        progress("P8 skipped: pip install datasets")
        return []
    world = 2
    with tempfile.TemporaryDirectory() as data_dir:
        files = []
        for s in range(4):
            path = os.path.join(data_dir, f"part-{s}.parquet")
            datasets.Dataset.from_dict({"x": list(range(s * rows_per_shard, (s + 1) * rows_per_shard))}).to_parquet(
                path
            )
            files.append(path)
        results = _run_ranks(_p8_worker, world, (files, work, step_ms, repeats), timeout, "P8")
    zero, total = results[0], 4 * rows_per_shard
    native, unagreed, read_all = zero["native"], zero["unagreed"], zero["read_all"]
    return [
        Row(
            f"P8 HF stream, decode-heavy map, N=2: native shards vs read by every process (time; elements decoded "
            f"by process 0: native {native[1] / total:.2f}, read-all {read_all[1] / total:.2f} of the stream)",
            native[0],
            read_all[0],
            "native reads 1/N (+ padding)",
        ),
        Row(
            f"P8 exhaustion agreement (one all-reduce per {NativeStreamPlan.steps_per_agreement} steps), "
            f"at {step_ms:g} ms of work a step (vs none)",
            native[0],
            unagreed[0],
            "<= 1.05x",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: check that every benchmark runs")
    parser.add_argument("--p7-child", nargs=3, metavar=("WHAT", "N", "WORLD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.p7_child:
        import json

        what, n, world = args.p7_child
        print(json.dumps(_p7_child(what, int(n), int(world))))
        return 0
    quick = args.quick
    P7_IN_PROCESS[0] = quick
    repeats = 1 if quick else 5
    rows: list[Row] = []
    progress("P1 per-batch overhead")
    rows += p1_overhead(2_000 if quick else 50_000, repeats)
    progress("P2 index sharding")
    rows += p2_index_sharding(100_000 if quick else 10_000_000, repeats)
    progress("P3 stateful loader")
    p3 = p3_stateful(2_000 if quick else 20_000, repeats)
    if p3 is not None:
        rows.append(p3)
    progress("P4 dispatch over 2 gloo processes")
    rows += p4_dispatch(2**20 if quick else 16 * 2**20, 8 if quick else 32, 1 if quick else 5, 120 if quick else 600)
    progress("P5 resume position")
    rows += p5_resume(100_000 if quick else 10_000_000, repeats)
    progress("P6 iterable with workers")
    rows.append(p6_iterable_workers(4 if quick else 8, 3 if quick else 60, 500 if quick else 50_000, 1 if quick else 3))
    progress("P8 streams: native shards vs read by all, exhaustion agreement")
    rows += p8_streams(40 if quick else 500, 100 if quick else 2000, 1.0, 1 if quick else 3, 120 if quick else 600)
    progress("P7 a billion samples: bijective shuffle and audit")
    rows += p7_billion(10**9, 1024, 10**6 if quick else _largest_randperm(), 10**6 if quick else 10**8)
    rows.append(p7_audit_report(10**9, (10**5, 10**6) if quick else (10**7, 10**8), 120 if quick else 900))
    reference_version = getattr(sys.modules.get("accelerate"), "__version__", "?")
    print(
        f"\nshardplug {shardplug.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs"
        f"{', reference: accelerate ' + reference_version if reference else ''}"
    )
    print(f"{'figure':<100} {'shardplug':>10} {'baseline':>10} {'ratio':>7} {'reference':>9}  target")
    for row in rows:
        print(
            f"{row.figure:<100} {row.ours:>10.4f} {row.baseline:>10.4f} {row.ratio:>6.2f}x "
            f"{row.reference_ratio:>9}  {row.target}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
