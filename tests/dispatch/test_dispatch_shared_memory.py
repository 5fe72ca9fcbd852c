"""Dispatch through shared memory on real gloo processes: process 0 collates the other processes'
batches straight into their ring slots, and nobody's batches change when the ring is reused."""

from __future__ import annotations

import time

import pytest
import torch
from _dist import run_gloo
from torch.utils.data import DataLoader, default_collate

import shardplug

BATCH, WIDTH, FULL_STEPS = 3, 8, 5


def _sample(i: int) -> dict:
    return {"x": torch.full((WIDTH,), float(i)), "id": i, "text": f"s{i}"}


def _size(world: int) -> int:
    return BATCH * world * FULL_STEPS + 2  # a short final step, padded


def _epoch(loader, rank: int) -> list[tuple[list[int], list[int], list[str]]]:
    held = []
    for batch in loader:
        if rank == 0:
            batch["x"].add_(1000.0)  # process 0 changes its own rows in place
        else:
            time.sleep(0.02)  # a slow receiver: process 0 runs ahead as far as the receipts let it
        held.append(batch)  # kept to the end: a batch that shared its ring slot would change meanwhile
    return [([int(v) for v in b["x"][:, 0].tolist()], b["id"].tolist(), list(b["text"])) for b in held]


def _run(rank: int, world: int) -> dict:
    data = [_sample(i) for i in range(_size(world))]
    out = {}
    for name, options in {
        "default_collate": {},
        "own_collate_fn": {"collate_fn": lambda samples: default_collate(samples)},
        "workers": {"num_workers": 2},
    }.items():
        shardplug.DataLoaderDispatcher.shared_memory = True
        loader = shardplug.prepare_data_loader(
            DataLoader(data, batch_size=BATCH, **options), put_on_device=True, dispatch_batches=True
        )
        first = _epoch(loader, rank)
        before = loader.dispatch_stats.snapshot()
        second = _epoch(loader, rank)
        out[name] = {"epochs": [first, second], "stats": loader.dispatch_stats.since(before)}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def runs(request):
    return request.param, run_gloo(_run, world_size=request.param, timeout=120)


def _expected(world: int, rank: int) -> list[list[int]]:
    n = _size(world)
    steps = [list(range((s * world + rank) * BATCH, (s * world + rank + 1) * BATCH)) for s in range(FULL_STEPS)]
    tail = [n - 2, n - 1] + [k % n for k in range(-2 % world)]
    share = len(tail) // world
    return steps + [tail[rank * share : (rank + 1) * share]]


@pytest.mark.parametrize("name", ["default_collate", "own_collate_fn", "workers"])
def test_every_process_keeps_exactly_its_rows_while_the_ring_is_reused(runs, name):
    world, results = runs
    for rank, result in enumerate(results):
        for epoch in result[name]["epochs"]:
            expected = _expected(world, rank)
            shift = 1000 if rank == 0 else 0
            assert [xs for xs, _, _ in epoch] == [[i + shift for i in step] for step in expected]
            assert [ids for _, ids, _ in epoch] == expected
            assert [texts for _, _, texts in epoch] == [[f"s{i}" for i in step] for step in expected]


def test_default_collate_puts_the_other_processes_rows_straight_into_shared_memory(runs):
    world, results = runs
    row_bytes = WIDTH * 4 + 8  # x (float32) and id (int64) of one row; the text travels pickled
    others = world - 1
    stats = results[0]["default_collate"]["stats"]
    assert stats["bytes_shared"] == others * (FULL_STEPS * BATCH + 1) * row_bytes
    # every full step is collated in place; the padded final step is joined, then copied
    assert stats["bytes_collated_in_place"] == others * FULL_STEPS * BATCH * row_bytes
    assert stats["bytes_sent"] == 0


@pytest.mark.parametrize("name", ["own_collate_fn", "workers"])
def test_collation_shardplug_does_not_run_is_copied_into_shared_memory(runs, name):
    world, results = runs
    stats = results[0][name]["stats"]
    assert stats["bytes_shared"] > 0 and stats["bytes_collated_in_place"] == 0
