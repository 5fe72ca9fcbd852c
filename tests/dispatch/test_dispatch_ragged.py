"""Dispatch of batches whose shape changes from one process's batch to the next, on real gloo groups.

A collate that pads each batch to its own longest sequence (the usual way to batch text) gives the
batches of one step different widths: each process receives its own batch, with its own width,
through shared memory and through the process group, with DataLoader workers, and a resumed pass
continues exactly. A collate that does not pad gives a list of tensors of different lengths: it is
cut and sent row by row. ``split_batches=True`` cuts one batch per step, its padding rows taken from
the batch itself when the epoch's first rows have another width. One launch per number of
processes runs every scenario (both transports in it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist import run_gloo, worker_context
from torch.utils.data import DataLoader, Dataset

import shardplug

BATCH = 2


class Sequences(Dataset):
    """Sample ``i``: ``1 + (i * 7) % 5`` tokens, every one equal to ``i`` (neighbouring lengths differ)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((length(i),), i)


def length(i: int) -> int:
    return 1 + (i * 7) % 5


def pad_per_batch(samples: list[torch.Tensor]) -> dict[str, Any]:
    """Pads each batch to its own longest sample with -1; the ids and the lengths beside."""
    width = max(len(s) for s in samples)
    tokens = torch.full((len(samples), width), -1)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample)] = sample
    return {"tokens": tokens, "ids": torch.tensor([int(s[0]) for s in samples])}


def as_rows(samples: list[torch.Tensor]) -> dict[str, Any]:
    """No padding: a list of tensors of different lengths, one per sample."""
    return {"tokens": list(samples), "ids": torch.tensor([int(s[0]) for s in samples])}


def _size(world: int, split: bool = False) -> int:
    """Three whole steps, then a short one: 3 rows in 2 batches (one process without a batch on 3
    processes); split, ``world + 1`` rows of one batch, padded to ``2 * world``."""
    return BATCH * world * 3 + (world + 1 if split else 3)


def _loader(world: int, collate: Any, *, shm: bool, workers: int = 0, split: bool = False) -> Any:
    shardplug.DataLoaderDispatcher.shared_memory = shm  # read when the loader is built
    data = DataLoader(
        Sequences(_size(world, split)),
        batch_size=BATCH * world if split else BATCH,
        collate_fn=collate,
        num_workers=workers,
        multiprocessing_context=worker_context(workers),
    )
    return shardplug.prepare_data_loader(data, put_on_device=True, dispatch_batches=True, split_batches=split)


def _seen(batch: dict[str, Any]) -> dict[str, Any]:
    """What a process received: ids, each row's tokens (without the -1 padding), the width."""
    tokens = batch["tokens"]
    rows = list(tokens) if isinstance(tokens, list) else list(tokens.unbind(0)) if tokens.numel() else []
    return {
        "ids": batch["ids"].tolist(),
        "rows": [row[row >= 0].tolist() for row in rows],
        "width": None if isinstance(tokens, list) else int(tokens.shape[1]),
        "ragged": isinstance(tokens, list),
    }


def _epoch(loader: Any) -> dict[str, Any]:
    batches = [(_seen(batch), loader.end_of_dataloader) for batch in loader]
    return {"batches": [b for b, _ in batches], "ends": [e for _, e in batches], "len": len(loader)}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["padded_shm"] = _epoch(_loader(world, pad_per_batch, shm=True))
    out["padded_group"] = _epoch(_loader(world, pad_per_batch, shm=False))
    out["padded_workers"] = _epoch(_loader(world, pad_per_batch, shm=False, workers=2))
    out["rows_shm"] = _epoch(_loader(world, as_rows, shm=True))
    out["rows_split"] = _epoch(_loader(world, as_rows, shm=False, split=True))
    out["padded_split"] = _epoch(_loader(world, pad_per_batch, shm=True, split=True))
    loader = _loader(world, pad_per_batch, shm=True)  # resume after two steps, in a new loader
    taken = []
    for batch in loader:
        taken.append(_seen(batch))
        if len(taken) == 2:
            break
    resumed = _loader(world, pad_per_batch, shm=False)
    resumed.load_state_dict(loader.state_dict())
    out["resume"] = {"before": taken, "rest": _epoch(resumed)}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_gloo(_scenarios, world_size=request.param, timeout=120)


def _check_epoch(world: int, results: list[dict[str, Any]], name: str) -> list[list[dict[str, Any]]]:
    """Every sample exactly once (padding: the epoch's first samples again, or split, the last
    step's own when the epoch's first have another width), each row intact, equal steps and the end
    of the pass on every process."""
    split = name.endswith("split")
    n = _size(world, split)
    per_rank = [res[name]["batches"] for res in results]
    assert len({len(b) for b in per_rank}) == 1 and all(res[name]["len"] == len(per_rank[0]) for res in results)
    assert all(res[name]["ends"] == [False] * (len(per_rank[0]) - 1) + [True] for res in results)
    ids = [i for batches in per_rank for batch in batches for i in batch["ids"]]
    assert sorted(set(ids)) == list(range(n)), name
    duplicates = sorted(ids)
    for i in range(n):
        duplicates.remove(i)
    pads = set(range(world)) | (set(range(n - world - 1, n)) if split else set())
    assert set(duplicates) <= pads and len(duplicates) < world, f"{name}: padding {duplicates}"
    for batches in per_rank:
        for batch in batches:
            assert batch["rows"] == [[i] * length(i) for i in batch["ids"]], name
    return per_rank


@pytest.mark.parametrize("name", ["padded_shm", "padded_group", "padded_workers"])
def test_each_process_receives_its_own_batch_with_its_own_width(runs, name: str) -> None:
    world, results = runs
    per_rank = _check_epoch(world, results, name)
    widths = {batch["width"] for batches in per_rank for batch in batches}
    assert len(widths) > 1, "the batches of the epoch have widths of their own"
    for rank, batches in enumerate(per_rank):
        for step, batch in enumerate(batches[:3]):  # the whole steps: global batch step * world + rank
            first = (step * world + rank) * BATCH
            assert batch["ids"] == [first, first + 1]
            assert batch["width"] == max(length(i) for i in batch["ids"]), "padded to its own longest row"


def test_a_short_last_step_of_batches_of_their_own_widths_gives_each_its_batch(runs) -> None:
    world, results = runs
    last = [res["padded_shm"]["batches"][-1]["ids"] for res in results]
    n = _size(world)
    assert last[:2] == [[n - 3, n - 2], [n - 1]]  # the last two batches, whole
    assert all(ids == [0] for ids in last[2:])  # a process without a batch: one padding row


@pytest.mark.parametrize("name", ["rows_shm", "rows_split"])
def test_a_list_of_tensors_of_different_lengths_is_sent_row_by_row(runs, name: str) -> None:
    world, results = runs
    per_rank = _check_epoch(world, results, name)
    assert all(batch["ragged"] for batches in per_rank for batch in batches if len(batch["ids"]) > 1)


def test_split_batches_pads_a_short_step_with_rows_of_its_own_width(runs) -> None:
    world, results = runs
    per_rank = _check_epoch(world, results, "padded_split")
    assert {len(batch["ids"]) for batches in per_rank for batch in batches} == {BATCH}


def test_a_resumed_pass_continues_after_the_last_step_handed_out(runs) -> None:
    world, results = runs
    for res in results:
        whole = res["padded_shm"]["batches"]
        assert res["resume"]["before"] == whole[:2]
        assert res["resume"]["rest"]["batches"] == whole[2:]
