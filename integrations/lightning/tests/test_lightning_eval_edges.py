"""Tiny evaluation sets and a cut accumulation cycle with a real Trainer / Fabric on 2 CPU processes.

``scripts/lightning_eval_edges.py`` (one launch, several Trainers) and
``scripts/lightning_fabric_eval_edges.py`` (one Fabric launch) write per-rank JSON checked here:
every rank runs every evaluation step (a per-step ``self.log(sync_dist=True)`` / all-reduce), no rank
is refused for an empty loader, and every sample counts exactly once. ``scripts/lightning_set_epoch.py``:
Lightning's own test of the ``set_epoch`` calls an evaluation loop makes, under the strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_lightning_strategy import WORLD, _run_script


@pytest.fixture(scope="module")
def edges(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("lightning_eval_edges")
    _run_script("lightning_eval_edges.py", out)
    return [json.loads((out / f"edges_rank{r}.json").read_text()) for r in range(WORLD)]


def _check(ranks: list[dict[str, Any]], scenario: str, sizes: tuple[int, ...]) -> None:
    steps = [r[scenario]["steps"] for r in ranks]
    for index, n in enumerate(sizes):
        per_rank = [[s for s in rank if s["loader"] == index] for rank in steps]
        assert len({len(p) for p in per_rank}) == 1 and per_rank[0], f"{scenario}: steps per rank differ"
        real = sorted(i for p in per_rank for s in p for i in s["real"])
        assert real == list(range(n)), f"{scenario}[{index}]: {real}"
        key = "rows" if len(sizes) == 1 else f"rows/dataloader_idx_{index}"
        assert all(r[scenario]["results"][index][key] == n for r in ranks)  # self.log(sync_dist=True) sum


@pytest.mark.parametrize(
    "scenario, sizes",
    [
        ("three", (3,)),
        ("three_allow_zero", (3,)),
        ("five", (5,)),
        ("two_loaders", (27, 3)),
        ("test_three", (3,)),
        ("padded", (3,)),
    ],
)
def test_tiny_evaluation_sets_run_on_every_rank_and_count_each_sample_once(edges, scenario, sizes) -> None:
    _check(edges, scenario, sizes)


def test_padding_is_dropped_before_the_step_by_default(edges) -> None:
    assert [s["batch"] for s in edges[1]["three"]["steps"]] == [[]]  # a step of pure padding: 0 rows
    padded = [s for r in edges for s in r["padded"]["steps"]]  # eval_even_batches=True: kept, marked
    assert all(len(s["batch"]) == 4 for s in padded) and sorted(i for s in padded for i in s["real"]) == [0, 1, 2]


def test_an_epoch_cut_after_the_first_micro_batch_leaves_every_update_exactly_k(edges) -> None:
    for rank in edges:
        weights = rank["cut"]["weights"]
        # -dw[1] * k = micro-batches an update summed per rank (DDP averages the ranks' equal counts)
        counts = [round((before[1] - after[1]) * 2) for before, after in zip(weights, weights[1:])]
        assert counts == [2, 2, 2] and rank["cut"]["global_step"] == 3


def test_fabric_evaluation_loaders_are_even_and_count_each_sample_once(tmp_path: Path) -> None:
    _run_script("lightning_fabric_eval_edges.py", tmp_path)
    ranks = [json.loads((tmp_path / f"fabric_edges_rank{r}.json").read_text()) for r in range(WORLD)]
    sizes = {"three": 3, "five": 5, "big": 27, "three_after_big": 3}
    for name, n in sizes.items():
        for mode in ("mark", "drop"):
            runs = [r[f"{name}_{mode}"] for r in ranks]
            assert runs[0]["steps"] == runs[1]["steps"] >= 1
            assert all(sorted(run["gathered"]) == list(range(n)) for run in runs), (name, mode)


def test_lightning_own_set_epoch_test_passes_under_the_strategy(tmp_path: Path) -> None:
    """Lightning 2.6's ``test_evaluation_loop_sampler_set_epoch_called`` (``sampler=`` and ``batch_sampler=``) with
    the shardplug strategy on 2 processes: the user's training sampler gets ``set_epoch`` once per epoch, the
    validation sampler once per validation (the sanity check, then each epoch), a later ``validate`` its epoch."""
    _run_script("lightning_set_epoch.py", tmp_path)
    for rank in range(WORLD):
        run = json.loads((tmp_path / f"set_epoch_rank{rank}.json").read_text())
        for loader in ("sampler", "batch_sampler", "whole"):  # whole: the same over complete epochs
            assert run[loader] == {"train": [0, 1], "val": [0, 0, 1], "validate": [2]}, (rank, loader, run[loader])
