"""Resume a Lightning run with another number of devices (run by ``test_lightning_strategy.py``).

Usage: ``python lightning_elastic.py OUT_DIR DEVICES first`` trains 2 epochs over 36 shuffled
samples (batch 2 per device, seed 5) and stops after 4 optimizer steps, with a checkpoint there
(``OUT_DIR/ckpt``). ``python lightning_elastic.py OUT_DIR DEVICES resume CKPT_DIR...`` resumes from
each checkpoint with ``fit(ckpt_path=...)`` on ``DEVICES`` devices, then runs a fresh one of that
size for reference. Every rank writes ``OUT_DIR/<mode>_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from shardplug_lightning import ShardplugDDPStrategy

OUT, DEVICES, MODE, SOURCES = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
N, BATCH, STOP = 36, 2, 4


class Indices(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.rows: list[list[Any]] = []  # (epoch, batch_idx, real indices, padding indices, global_step)

    def on_train_start(self) -> None:
        self.trainer.train_dataloader.track_padding()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        real = self.trainer.train_dataloader.batch_real_count
        ids = batch.tolist()
        self.rows.append([self.current_epoch, batch_idx, ids[:real], ids[real:], self.global_step])
        return self.layer(batch.float().unsqueeze(1) / N).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indices(), batch_size=BATCH, shuffle=True)


def trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=ShardplugDDPStrategy(use_seedable_sampler=True, data_seed=5),
        **kwargs,
    )


def main() -> None:
    ckpt_dir = os.path.join(OUT, "ckpt")
    if MODE == "first":
        model = Recorder()
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=STOP, save_top_k=-1, save_last=False)
        t = trainer(enable_checkpointing=True, callbacks=[checkpoint], max_steps=STOP)
        t.fit(model)
        out = {"rows": model.rows}
    else:
        out = {"resumed": []}
        for source in SOURCES:
            resumed = Recorder()
            t = trainer(enable_checkpointing=False)
            t.fit(resumed, ckpt_path=os.path.join(source, f"epoch=0-step={STOP}.ckpt"))
            out["resumed"].append({"rows": resumed.rows, "global_step": t.global_step})
        fresh = Recorder()
        t = trainer(enable_checkpointing=False)
        t.fit(fresh)
        out["fresh"] = fresh.rows
    with open(os.path.join(OUT, f"{MODE}_rank{t.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
