"""Tiny evaluation sets and a cut accumulation cycle on 2 CPU processes (one launch, several Trainers).

Usage: ``python lightning_eval_edges.py OUT_DIR``; every rank writes ``OUT_DIR/edges_rank<r>.json``.
Scenarios: validation sets of 3 (one batch, fewer than the processes) and 5 samples at batch 4
(smaller than one global batch), with ``allow_zero_length_dataloader_with_multiple_devices``, two
validation loaders of 27 and 3 samples, ``test`` on 3 samples, ``eval_even_batches=True``; and a
``fit`` with ``accumulate_grad_batches=2`` whose first epoch is cut after a cycle's first micro-batch.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from torch.utils.data import DataLoader, TensorDataset

import shardplug
import shardplug_lightning  # noqa: F401  (registers the strategies)
from shardplug_lightning import ShardplugDDPStrategy

OUT = sys.argv[1]
BATCH = 4


class Evaluated(pl.LightningModule):
    """Records what each rank's evaluation steps hold; logs with per-step and epoch collectives."""

    def __init__(self, sizes: tuple[int, ...] = (3,), allow_zero: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.sizes = sizes
        self.allow_zero_length_dataloader_with_multiple_devices = allow_zero
        self.steps: list[dict[str, Any]] = []

    def _step(self, batch: torch.Tensor, dataloader_idx: int = 0) -> None:
        loader = self.trainer.val_dataloaders if not self.trainer.testing else self.trainer.test_dataloaders
        loader = loader[dataloader_idx] if isinstance(loader, (list, tuple)) else loader
        real = shardplug.drop_padding(batch, loader)  # a no-op where the strategy dropped it already
        self.steps.append({"loader": dataloader_idx, "batch": batch.tolist(), "real": real.tolist()})
        rows = torch.tensor(float(len(real)))
        self.log("rows", rows, reduce_fx="sum", sync_dist=True, batch_size=1, add_dataloader_idx=True)
        self.log("step_rows", rows, on_step=True, on_epoch=False, sync_dist=True, batch_size=1)  # per step

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, dataloader_idx)

    def test_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._step(batch, dataloader_idx)

    def val_dataloader(self) -> Any:
        loaders = [DataLoader(list(range(n)), batch_size=BATCH) for n in self.sizes]
        return loaders[0] if len(loaders) == 1 else loaders

    def test_dataloader(self) -> Any:
        return self.val_dataloader()


class CutCycle(pl.LightningModule):
    """Sample i is [2**i, 1]: w . x with SGD(lr=1) tells how many micro-batches each update summed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(self.layer.weight)
        self.weights: list[list[float]] = [self.layer.weight.detach().flatten().tolist()]
        self.steps_seen = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        if self.current_epoch == 0 and batch_idx == 1:
            return -1  # cut the epoch after the first micro-batch of a cycle
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step != self.steps_seen:
            self.steps_seen = self.trainer.global_step
            self.weights.append(self.layer.weight.detach().flatten().tolist())

    def train_dataloader(self) -> DataLoader:
        x = torch.tensor([[2.0**i, 1.0] for i in range(12)])
        return DataLoader(TensorDataset(x), batch_size=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def trainer(**kwargs: Any) -> pl.Trainer:
    strategy = ShardplugDDPStrategy(timeout=datetime.timedelta(seconds=30), **kwargs.pop("strategy_kwargs", {}))
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(kwargs)
    return pl.Trainer(**settings)


def _evaluate(model: Evaluated, stage: str = "validate", **kwargs: Any) -> dict[str, Any]:
    t = trainer(**kwargs)
    results = getattr(t, stage)(model, verbose=False)
    return {"steps": model.steps, "results": results, "rank": t.global_rank}


def main() -> None:
    out: dict[str, Any] = {}
    out["three"] = _evaluate(Evaluated((3,)))
    out["three_allow_zero"] = _evaluate(Evaluated((3,), allow_zero=True))
    out["five"] = _evaluate(Evaluated((5,)))
    out["two_loaders"] = _evaluate(Evaluated((27, 3)))
    out["test_three"] = _evaluate(Evaluated((3,)), stage="test")
    out["padded"] = _evaluate(Evaluated((3,)), strategy_kwargs={"eval_even_batches": True})
    model = CutCycle()
    t = trainer(max_epochs=2, accumulate_grad_batches=2, limit_val_batches=0)
    t.fit(model)
    out["cut"] = {"weights": model.weights, "global_step": t.global_step}
    with open(os.path.join(OUT, f"edges_rank{t.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
