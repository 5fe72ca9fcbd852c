"""Lightning resumed twice in a row on one device: Lightning's loop state after the first resume.

Usage: ``python lightning_resume_chain.py OUT_DIR``. Trains 30 samples (batch 2, ``drop_last``, a seeded
shuffle) for 2 epochs with a ``ModelCheckpoint`` after every step; resumes from the checkpoint of epoch 0's
last step (checkpointing every step again), then from that run's checkpoint inside epoch 1, and from the
same checkpoint with the epoch progress an older shardplug left there (epoch 1 counted as not started).
Writes ``OUT_DIR/chain.json``: each run's ``[epoch, batch_idx, sample ids]`` rows and the epoch progress
its checkpoint inside epoch 1 holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "integrations" / "lightning" / "tests" / "scripts")]
from _exit import leave  # noqa: E402  (how a scenario process ends)

from shardplug_lightning import ShardplugDDPStrategy  # noqa: E402

OUT = sys.argv[1]


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.rows: list[list[Any]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.rows.append([self.current_epoch, batch_idx, batch.tolist()])
        return self.layer(batch.float().unsqueeze(1) / 30).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(30), batch_size=2, shuffle=True, drop_last=True)


def fit(ckpt_path: str | None, folder: str | None) -> list[list[Any]]:
    callbacks = [ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_top_k=-1)] if folder else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(folder),
        callbacks=callbacks,
        strategy=ShardplugDDPStrategy(use_seedable_sampler=True, data_seed=5, process_group_backend="gloo"),
    )
    model = Recorder()
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.rows


def epoch_progress(path: str) -> dict[str, Any]:
    return torch.load(path, weights_only=False)["loops"]["fit_loop"]["epoch_progress"]["current"]


def main() -> None:
    out: dict[str, Any] = {"whole": fit(None, os.path.join(OUT, "first"))}
    out["second"] = fit(os.path.join(OUT, "first", "step=15.ckpt"), os.path.join(OUT, "second"))
    inside = os.path.join(OUT, "second", "step=20.ckpt")  # epoch 1, after its 5th batch
    out["progress"] = epoch_progress(inside)
    out["third"] = fit(inside, None)
    old = torch.load(inside, weights_only=False)  # as an older shardplug left it: epoch 1 not started
    for counts in old["loops"]["fit_loop"]["epoch_progress"].values():
        counts["ready"] = counts["started"] = counts["processed"]
    torch.save(old, os.path.join(OUT, "old.ckpt"))
    out["old"] = fit(os.path.join(OUT, "old.ckpt"), None)
    with open(os.path.join(OUT, "chain.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
