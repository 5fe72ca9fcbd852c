"""Dispatch protocol on real gloo groups: headers only when shapes change, (N-1)/N of a batch sent per
step, errors and early stops leave every process in step for the next pass."""

from __future__ import annotations

import pytest
import torch
from _dist import run_gloo
from torch.utils.data import DataLoader, Dataset

import shardplug

WIDTH = 6  # floats per sample


class Floats(Dataset):
    """Sample ``i`` is ``WIDTH`` floats equal to ``i``; reading ``fail_at`` raises once (when set)."""

    def __init__(self, n: int, fail_at: int = -1) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            self.fail_at = -1
            raise ValueError(f"cannot read sample {i}")
        return torch.full((WIDTH,), float(i))


def _ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch[:, 0].tolist()]


def _dispatcher(dataset: Dataset, batch_size: int, overlap_reads: bool) -> shardplug.DataLoaderDispatcher:
    loader = shardplug.prepare_data_loader(
        DataLoader(dataset, batch_size=batch_size), put_on_device=True, dispatch_batches=True
    )
    loader.overlap_reads = overlap_reads  # both ways, whatever the cores of this machine
    return loader


def _protocol(rank: int, world: int) -> dict:
    out = {}
    for mode, (overlap_reads, shared_memory) in MODES.items():
        shardplug.DataLoaderDispatcher.shared_memory = shared_memory  # read when a loader is built
        out[mode] = _scenarios(rank, world, overlap_reads)
    return out


# (process 0 reads the next step while the current one is sent, rows through shared memory)
MODES = {
    "reads_overlap_sends": (True, False),
    "reads_after_sends": (False, False),
    "shared_memory": (True, True),
}


def _scenarios(rank: int, world: int, overlap_reads: bool) -> dict:
    out: dict = {}
    # 4 * world samples per full step, plus a short final step: the row count changes once
    loader = _dispatcher(Floats(4 * world * 3 + 2), batch_size=4, overlap_reads=overlap_reads)
    before = loader.dispatch_stats.snapshot()
    batches = []
    for batch in loader:
        if rank == 0:
            batch.add_(1000.0)  # process 0 changes its rows while the others' may still be in flight
        batches.append((_ids(batch), loader.end_of_dataloader))
    out["epoch"] = batches
    out["len"] = len(loader)
    out["stats"] = loader.dispatch_stats.since(before)
    out["second_epoch"] = [_ids(b) for b in loader]

    # an error while reading reaches every process; the next pass starts cleanly
    loader = _dispatcher(Floats(4 * world * 3, fail_at=4 * world + 1), batch_size=4, overlap_reads=overlap_reads)
    got = []
    try:
        for batch in loader:
            got.append(_ids(batch))
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["before_error"] = got
    out["after_error"] = [_ids(b) for b in loader]

    # every process stops after one batch; the next pass is in step
    loader = _dispatcher(Floats(4 * world * 3), batch_size=4, overlap_reads=overlap_reads)
    for _batch in loader:
        break
    out["after_break"] = [_ids(b) for b in loader]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def all_runs(request):
    return request.param, run_gloo(_protocol, world_size=request.param, timeout=120)


@pytest.fixture(params=list(MODES))
def runs(all_runs, request):
    world, results = all_runs
    return world, [res[request.param] for res in results]


def test_rows_end_flag_and_len(runs):
    world, results = runs
    full_steps, n = 3, 4 * world * 3 + 2
    for r, res in enumerate(results):
        expected = [list(range(s * 4 * world + 4 * r, s * 4 * world + 4 * r + 4)) for s in range(full_steps)]
        tail = list(range(4 * world * 3, n)) + [k % n for k in range(-2 % world)]
        k = len(tail) // world
        expected.append(tail[r * k : (r + 1) * k])
        shift = 1000 if r == 0 else 0
        assert [ids for ids, _ in res["epoch"]] == [[i + shift for i in rows] for rows in expected]
        assert [last for _, last in res["epoch"]] == [False] * full_steps + [True]
        assert res["len"] == full_steps + 1
        assert res["second_epoch"] == expected, "process 0's in-place change must not reach the others"


def test_header_is_sent_once_per_pass_and_only_other_rows_are_sent(runs, request):
    world, results = runs
    shared = MODES[request.node.callspec.params["runs"]][1]
    global_bytes = 4 * world * WIDTH * 4  # one full step: 4 * world rows of WIDTH float32
    tail_bytes = -(-2 // world) * world * WIDTH * 4  # the final step, padded to a multiple of world
    others = (3 * global_bytes + tail_bytes) * (world - 1) // world
    for r, res in enumerate(results):
        stats = res["stats"]
        assert stats["steps"] == 4
        assert stats["headers"] == 1, "a row-count change is announced without a new header"
        if r == 0:  # the others' rows only: through the process group, or written to shared memory
            assert (stats["bytes_sent"], stats["bytes_shared"]) == ((0, others) if shared else (others, 0))
            assert stats["bytes_received"] == 0
        else:
            assert stats["bytes_sent"] == stats["bytes_shared"] == 0
            assert stats["bytes_received"] == (0 if shared else others // (world - 1))


def test_errors_reach_every_process_and_the_next_pass_works(runs):
    world, results = runs
    for r, res in enumerate(results):
        assert res["error"] is not None and "cannot read sample" in res["error"]
        if r > 0:
            assert res["error"].startswith("DispatchError")
        assert res["before_error"] == [list(range(4 * r, 4 * r + 4))]
        assert res["after_error"] == [list(range(s * 4 * world + 4 * r, s * 4 * world + 4 * r + 4)) for s in range(3)]


def test_stopping_early_on_every_process_keeps_them_in_step(runs):
    world, results = runs
    for r, res in enumerate(results):
        assert res["after_break"] == [list(range(s * 4 * world + 4 * r, s * 4 * world + 4 * r + 4)) for s in range(3)]
