"""``strategy="shardplug_model_parallel"`` on 2 CPU processes: which data each rank gets.

A scenario of ``lightning_scenarios.py OUT_DIR``. Two fits: tensor parallel over both ranks
(one data-parallel group: identical data), then data parallel over both (disjoint halves).
Every rank writes ``OUT_DIR/model_parallel_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from shardplug_lightning import ShardplugModelParallelStrategy


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.batches: list[list[int]] = []

    def configure_model(self) -> None:
        pass  # no parallelization needed to see the data topology

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.batches.append(batch.tolist())
        return self.layer(batch.float().unsqueeze(1)).pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(list(range(16)), batch_size=2, shuffle=True)


def main() -> None:
    out: dict[str, Any] = {}
    rank = 0
    for name, (dp, tp) in {"tensor_parallel": (1, 2), "data_parallel": (2, 1)}.items():
        model = Recorder()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            strategy=ShardplugModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp, data_seed=3),
        )
        trainer.fit(model)
        rank = trainer.global_rank
        out[name] = {"batches": model.batches, "strategy": type(trainer.strategy).__name__}
    with open(os.path.join(sys.argv[1], f"model_parallel_rank{rank}.json"), "w") as f:
        json.dump(out, f)
