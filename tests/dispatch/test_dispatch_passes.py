"""Dispatch passes on real gloo groups: process 0 leaving a pass early (break, exception, garbage
collection, a new iter()) ends it on every process at the same step, nothing hangs or crosses
passes, and the end of a pass and len() are process 0's everywhere."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from _dist import run_gloo
from torch.utils.data import DataLoader, Dataset

import shardplug

STEPS = 5  # full steps of one epoch (2 rows per process per step)


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


def _dispatcher(world: int, n: int | None = None) -> shardplug.DataLoaderDispatcher:
    n = 2 * world * STEPS if n is None else n
    return shardplug.prepare_data_loader(DataLoader(Rows(n), batch_size=2), put_on_device=True, dispatch_batches=True)


def _ids(batch: torch.Tensor) -> list[int]:
    return [int(v) for v in batch.flatten().tolist()]


class Stop(RuntimeError):
    pass


def _scenarios(rank: int, world: int) -> dict:
    out: dict = {}

    # break on process 0 only, then a collective of the user's: the others end the pass there too
    loader = _dispatcher(world)
    got = []
    for step, batch in enumerate(loader):
        got.append(_ids(batch))
        if rank == 0 and step == 1:
            break
    dist.barrier()
    out["break"] = got
    out["after_break"] = [_ids(b) for b in loader]  # the next pass is whole and in step

    # an exception in process 0's loop body, caught outside the loop
    loader = _dispatcher(world)
    got = []
    try:
        for step, batch in enumerate(loader):
            got.append(_ids(batch))
            if rank == 0 and step == 2:
                raise Stop("process 0 fails in its training step")
    except Stop:
        pass
    dist.barrier()
    out["exception"] = got

    # process 0 abandons an iterator (garbage collected) and starts a new pass
    loader = _dispatcher(world)
    if rank == 0:
        it = iter(loader)
        first = [_ids(next(it))]
        del it
        gc.collect()
        second = [_ids(b) for b in loader]
    else:
        first = [_ids(b) for b in loader]  # one loop: must end where process 0 left, not run into its next pass
        second = [_ids(b) for b in loader]
    out["abandoned"] = (first, second)

    # process 0 opens a second iterator while the first is still referenced
    loader = _dispatcher(world)
    if rank == 0:
        old = iter(loader)
        first = [_ids(next(old)), _ids(next(old))]
        second = [_ids(b) for b in loader]
        del old
    else:
        first = [_ids(b) for b in loader]
        second = [_ids(b) for b in loader]
    out["reopened"] = (first, second)

    # every process stops early at a different step: the rest of the pass never leaks into the next
    loader = _dispatcher(world)
    for step, _batch in enumerate(loader):
        if step == rank:
            break
    dist.barrier()
    out["all_break"] = [_ids(b) for b in loader]

    # process 0's data decides len() and the end of the pass, whatever the others hold
    loader = _dispatcher(world, n=2 * world * 3 if rank == 0 else 2 * world * 5)
    flags = []
    for _batch in loader:
        flags.append(loader.end_of_dataloader)
    out["uneven"] = {"len": len(loader), "flags": flags}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def runs(request):
    return request.param, run_gloo(_scenarios, world_size=request.param, timeout=90)


def _epoch(world: int, rank: int) -> list[list[int]]:
    """Rows of process ``rank`` in a whole epoch: step s gives it rows [2(sN + rank), +2)."""
    return [[2 * (s * world + rank), 2 * (s * world + rank) + 1] for s in range(STEPS)]


def test_break_on_process_0_ends_the_pass_everywhere_and_a_barrier_does_not_hang(runs):
    world, results = runs
    for rank, res in enumerate(results):
        assert res["break"] == _epoch(world, rank)[:2]
        assert res["after_break"] == _epoch(world, rank)


def test_an_exception_on_process_0_ends_the_pass_at_the_same_step(runs):
    world, results = runs
    for rank, res in enumerate(results):
        assert res["exception"] == _epoch(world, rank)[:3]


@pytest.mark.parametrize("case", ["abandoned", "reopened"])
def test_a_pass_left_by_process_0_never_leaks_into_the_next(runs, case):
    world, results = runs
    taken = {"abandoned": 1, "reopened": 2}[case]
    for rank, res in enumerate(results):
        first, second = res[case]
        assert first == _epoch(world, rank)[:taken]
        assert second == _epoch(world, rank)


def test_processes_that_left_at_different_steps_start_the_next_pass_in_step(runs):
    world, results = runs
    for rank, res in enumerate(results):
        assert res["all_break"] == _epoch(world, rank)


def test_len_and_the_end_of_the_pass_are_process_0s(runs):
    world, results = runs
    for res in results:
        assert res["uneven"] == {"len": 3, "flags": [False, False, True]}
