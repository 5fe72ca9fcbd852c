"""Lightning's own check of ``set_epoch`` calls, under ``ShardplugDDPStrategy`` on 2 CPU processes.

Usage: ``python lightning_set_epoch.py OUT_DIR``; every rank writes ``OUT_DIR/set_epoch_rank<r>.json``.

The scenario of Lightning 2.6's ``loops/test_evaluation_loop.py::test_evaluation_loop_sampler_set_epoch_called``
with the shardplug strategy in place of the default one: a ``RandomSampler`` given a ``set_epoch`` that records
its calls, as ``sampler=`` and inside a ``BatchSampler`` as ``batch_sampler=``; ``fit`` for 2 epochs of one
training and one validation batch (with the sanity check), then ``validate`` with a new loader; and the same over
whole epochs (each pass complete). Each run records the calls its training sampler, its validation sampler and the
later validation sampler got.
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
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

import shardplug_lightning  # noqa: F401  (registers the strategies)
from shardplug_lightning import ShardplugDDPStrategy

OUT = sys.argv[1]
SAMPLES, FEATURES = 64, 8


class Recorded:
    """A user's loader whose shuffling sampler records every ``set_epoch`` it gets."""

    def __init__(self, as_batch_sampler: bool) -> None:
        data = TensorDataset(torch.randn(SAMPLES, FEATURES))
        sampler = RandomSampler(data)
        self.calls: list[int] = []
        sampler.set_epoch = self.calls.append  # type: ignore[attr-defined]
        if as_batch_sampler:
            self.loader = DataLoader(data, batch_sampler=BatchSampler(sampler, 2, True))
        else:
            self.loader = DataLoader(data, sampler=sampler)


class Model(pl.LightningModule):
    """A linear layer; the loss is its output's mean."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(FEATURES, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.layer(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(as_batch_sampler: bool, whole_epochs: bool = False) -> tuple[dict[str, list[int]], int]:
    """``fit`` then ``validate`` as Lightning's test does (or over whole epochs: each training pass
    complete); the calls each sampler got, and this rank."""
    limit = None if whole_epochs else 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardplugDDPStrategy(timeout=datetime.timedelta(seconds=30)),
        limit_train_batches=limit,
        limit_val_batches=limit,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    train, val = Recorded(as_batch_sampler), Recorded(as_batch_sampler)
    trainer.fit(model, train_dataloaders=train.loader, val_dataloaders=val.loader)
    later = Recorded(as_batch_sampler)
    trainer.validate(model, later.loader, verbose=False)
    return {"train": train.calls, "val": val.calls, "validate": later.calls}, trainer.global_rank


def main() -> None:
    out: dict[str, Any] = {}
    rank = 0
    for name, as_batch_sampler, whole in (
        ("sampler", False, False),
        ("batch_sampler", True, False),
        ("whole", False, True),
    ):
        out[name], rank = run(as_batch_sampler, whole)
    with open(os.path.join(OUT, f"set_epoch_rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
