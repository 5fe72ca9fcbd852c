"""A plain ``LightningCLI(Model, DataModule)`` script, run on 2 CPU processes by ``test_lightning_cli.py``.

Usage (the strategy class and its options from the command line)::

    python lightning_cli.py fit --model.out OUT_DIR --model.run cli \\
        --trainer.strategy shardplug_lightning.ShardplugDDPStrategy --trainer.strategy.split_batches true \\
        --trainer.accelerator cpu --trainer.devices 2 ...

After that fit, the same launch fits again from ``OUT_DIR/cli.yaml`` (``fit --config OUT_DIR/cli.yaml``,
written by the test: ``trainer.strategy.class_path`` / ``init_args``). ``strategy`` launches rank 1 by
re-executing this command line, so both ranks parse it; every rank writes
``OUT_DIR/<run>_rank<r>.json``: the batches it trained on, its strategy's class and options.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import shardplug_lightning  # noqa: F401  (what a user's script imports for the class path)


class Model(pl.LightningModule):
    """Records the sample indices of every training batch of this rank."""

    def __init__(self, out: str, run: str) -> None:
        super().__init__()
        self.out, self.run = Path(out), run
        self.layer = torch.nn.Linear(1, 1)
        self.batches: list[list[int]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.batches.append(batch.tolist())
        return self.layer(batch.float().unsqueeze(1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def on_train_end(self) -> None:
        strategy: Any = self.trainer.strategy
        config = dataclasses.asdict(strategy.shardplug_config)
        record = {
            "strategy": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "world_size": self.trainer.world_size,
            "config": {k: v for k, v in config.items() if k != "slice_fn_for_dispatch"},
            "eval_even_batches": strategy.eval_even_batches,
            "process_group_backend": strategy._process_group_backend,
            "batches": self.batches,
        }
        (self.out / f"{self.run}_rank{self.global_rank}.json").write_text(json.dumps(record))


class DataModule(pl.LightningDataModule):
    """``DataLoader(range(size))``: each batch says which samples it holds."""

    def __init__(self, size: int = 42, batch_size: int = 4, shuffle: bool = False, num_workers: int = 0) -> None:
        super().__init__()
        self.size, self.batch_size, self.shuffle, self.num_workers = size, batch_size, shuffle, num_workers

    def train_dataloader(self) -> DataLoader:
        data = list(range(self.size))
        # workers from a fork server: forking them from a rank whose threads run (Lightning's process
        # observer, gloo's) can hang the child in CPython's fork (python/cpython#112275)
        context = multiprocessing.get_context("forkserver") if self.num_workers else None
        return DataLoader(
            data,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            multiprocessing_context=context,
        )


def main() -> None:
    cli = LightningCLI(Model, DataModule)  # the command line
    LightningCLI(Model, DataModule, args=["fit", "--config", str(cli.model.out / "cli.yaml")])  # a YAML config
    leave()


if __name__ == "__main__":
    main()
