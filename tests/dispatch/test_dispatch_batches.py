"""What dispatch delivers, on real gloo groups: shapes that change from step to step (variable
sequence lengths), and non-tensor leaves (per-row lists cut with their rows, other values kept)."""

from __future__ import annotations

import itertools

import pytest
import torch
from _dist import run_gloo
from torch.utils.data import DataLoader, Dataset

import shardplug
from shardplug.explain import ExplainOptions, explain


class Sentences(Dataset):
    """Sample ``i``: ``1 + i % 5`` tokens all equal to ``i``, its text and a constant source."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"tokens": torch.full((1 + i % 5,), i), "text": f"sentence {i}", "id": i}


def pad_collate(samples: list[dict], width: int = 0) -> dict:
    """Pads to the longest sample of the batch (every batch has its own width), or to ``width``."""
    width = width or max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), width), -1)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample["tokens"])] = sample["tokens"]
    return {
        "tokens": tokens,
        "text": [s["text"] for s in samples],
        "ids": [s["id"] for s in samples],
        "source": "corpus-a",
    }


def _scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    for split in (True, False):
        batch_size = 2 * world if split else 2
        loader = shardplug.prepare_data_loader(
            DataLoader(Sentences(), batch_size=batch_size, collate_fn=pad_collate),
            put_on_device=True,
            dispatch_batches=True,
            split_batches=split,
        )
        rows = []
        try:
            for batch in loader:
                rows.append(
                    {
                        "first_token": batch["tokens"][:, 0].tolist(),
                        "width": batch["tokens"].shape[1],
                        "text": batch["text"],
                        "ids": batch["ids"],
                        "source": batch["source"],
                    }
                )
            out[split] = rows
        except shardplug.DispatchError as exc:
            out[split] = f"DispatchError: {exc}"
        out[split, "headers"] = loader.dispatch_stats.headers
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def runs(request):
    return request.param, run_gloo(_scenarios, world_size=request.param, timeout=90)


def test_shapes_may_change_from_step_to_step(runs):
    world, results = runs
    seen = []
    for rank, res in enumerate(results):
        rows = res[True]
        assert isinstance(rows, list), rows
        for step, batch in enumerate(rows):
            start = step * 2 * world + 2 * rank
            assert batch["first_token"] == [start, start + 1]  # this process's rows of the global batch
            # the width of the whole global batch (the collate padded it before the cut)
            assert batch["width"] == max(1 + i % 5 for i in range(step * 2 * world, (step + 1) * 2 * world))
            seen += batch["ids"]
        widths = [batch["width"] for batch in rows]
        changes = sum(1 for a, b in zip(widths, widths[1:]) if a != b)
        assert res[True, "headers"] == 1 + changes  # a header at the start and whenever the width changes
    assert sorted(seen) == list(range(24))


@pytest.mark.parametrize("split", [True, False])
def test_lists_are_cut_with_their_rows_and_other_values_are_kept(runs, split):
    world, results = runs
    for res in results:
        rows = res[split]
        # without splitting, the N batches of a step have widths of their own: each process gets its own batch
        assert isinstance(rows, list), rows
        for batch in rows:
            assert batch["ids"] == batch["first_token"]
            assert batch["text"] == [f"sentence {i}" for i in batch["ids"]]
            assert batch["source"] == "corpus-a"


def _fixed_width(samples: list[dict]) -> dict:
    return pad_collate(samples, width=5)


def _uneven(rank: int, world: int) -> dict:
    out = {}
    for split, even in itertools.product((True, False), (False, True)):
        # three whole steps, then world + 1 leftover rows (uneven across processes); with even_batches=True
        # the last step is completed with the epoch's first rows
        loader = shardplug.prepare_data_loader(
            DataLoader(
                Sentences(2 * world * 3 + world + 1), batch_size=2 * world if split else 2, collate_fn=_fixed_width
            ),
            put_on_device=True,
            dispatch_batches=True,
            split_batches=split,
            even_batches=even,
        )
        out[split, even] = [(batch["ids"], batch["tokens"].shape[0], loader.end_of_dataloader) for batch in loader]
        out[split, even, "len"] = len(loader)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2procs", "3procs"])
def uneven_runs(request):
    return request.param, run_gloo(_uneven, world_size=request.param, timeout=90)


@pytest.mark.parametrize("split", [True, False])
def test_even_batches_false_pads_nothing_and_gives_the_leftovers_to_the_first_processes(uneven_runs, split):
    world, results = uneven_runs
    n, leftover = 2 * world * 3 + world + 1, world + 1
    seen = []
    for rank, res in enumerate(results):
        batches = res[split, False]
        assert len(batches) == res[split, False, "len"] == 4  # every process takes part in every step
        assert [end for _, _, end in batches] == [False, False, False, True]
        for ids, rows, _ in batches:
            assert rows == len(ids)
            seen += ids
        size = leftover // world + (1 if rank < leftover % world else 0)
        assert batches[-1][1] == size  # as even as possible, the first processes take one more
    assert sorted(seen) == list(range(n))  # no padding: every sample exactly once


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("even", [True, False])
def test_explain_shows_what_dispatchers_deliver(uneven_runs, split, even):
    """``shardplug explain --dispatch`` (the dispatcher's step reader and plan, without a process
    group) shows every process the rows and len() the real dispatchers gave it."""
    world, results = uneven_runs
    options = ExplainOptions(
        2 * world * 3 + world + 1, 2 * world if split else 2, world, split, even_batches=even, dispatch=True
    )
    shares = explain(options).epochs[0].shares
    for rank, res in enumerate(results):
        assert [list(batch.indices) for batch in shares[rank].batches] == [ids for ids, _, _ in res[split, even]]
        assert shares[rank].length == res[split, even, "len"]
    if even:  # the padding is the epoch's first rows, on the last processes
        assert sum(len(batch.padding) for share in shares for batch in share.batches) == -options.samples % world
