"""torchdata.nodes graphs trained on by 2 CPU processes under ``strategy="shardplug_ddp"`` (run by
``test_lightning_nodes.py``).

Usage: ``python lightning_nodes.py OUT_DIR``.  Every rank writes ``OUT_DIR/nodes_rank<r>.json``:

* ``fit``: the batches it trained on and validated, by epoch, of a 2-epoch fit whose training and validation
  loaders are ``tn.Loader`` graphs (a shuffled sampler, ``ParallelMapper`` threads, ``Batcher``, ``Prefetcher``);
  a checkpoint is saved after the second training batch of epoch 0;
* ``resumed``: the batches a second fit from that checkpoint trained on;
* ``warned`` / ``silenced``: the ``UnshardedLoaderWarning`` messages of a validation whose loader is an iterable
  of batches of its own, with the default strategy and with ``iterables_read_own_part=True``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torchdata.nodes as tn
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from torch.utils.data import RandomSampler, SequentialSampler

import shardplug_lightning  # noqa: F401  (registers strategy="shardplug_ddp")
from shardplug_lightning import ShardplugDDPStrategy, UnshardedLoaderWarning

OUT = Path(sys.argv[1])
N_TRAIN, N_VAL, BATCH = 18, 10, 4


def read(key: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([float(key)]), "key": torch.tensor(key)}


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}


def graph(n: int, shuffle: bool) -> tn.Loader:
    sampler = RandomSampler(range(n)) if shuffle else SequentialSampler(range(n))
    rows = tn.ParallelMapper(tn.SamplerWrapper(sampler), read, num_workers=2)
    batches = tn.Mapper(tn.Batcher(rows, batch_size=BATCH, drop_last=False), collate)
    return tn.Loader(tn.Prefetcher(batches, prefetch_factor=2))


class Model(pl.LightningModule):
    def __init__(self, val: Any = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.val = val
        self.train_batches: list[tuple[int, list[int]]] = []
        self.val_batches: list[tuple[int, list[int]]] = []

    def train_dataloader(self) -> Any:
        return graph(N_TRAIN, shuffle=True)

    def val_dataloader(self) -> Any:
        return self.val if self.val is not None else graph(N_VAL, shuffle=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_batches.append((self.current_epoch, batch["key"].tolist()))
        return self.layer(batch["x"]).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_batches.append((self.current_epoch, batch["key"].tolist() if isinstance(batch, dict) else []))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class SaveMidEpoch(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == 1:
            trainer.save_checkpoint(OUT / "mid.ckpt")


def trainer(strategy: Any = "shardplug_ddp", **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class OwnIterable:
    """An iterable of batches that is neither a DataLoader nor a graph: the strategy cannot shard it."""

    def __iter__(self) -> Any:
        return iter([{"x": torch.zeros(2, 1), "key": torch.zeros(2, dtype=torch.long)}] * 3)


def unsharded_warnings(strategy: Any) -> list[str]:
    model = Model(val=OwnIterable())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(strategy).validate(model, verbose=False)
    return [str(w.message) for w in caught if issubclass(w.category, UnshardedLoaderWarning)]


def main() -> None:
    record: dict[str, Any] = {}
    model = Model()
    fit = trainer(max_epochs=2, callbacks=[SaveMidEpoch()])
    fit.fit(model)
    rank = fit.global_rank
    record["fit"] = {"train": model.train_batches, "val": model.val_batches}
    again = Model()
    trainer(max_epochs=2).fit(again, ckpt_path=OUT / "mid.ckpt")
    record["resumed"] = again.train_batches
    record["warned"] = unsharded_warnings("shardplug_ddp")
    record["silenced"] = unsharded_warnings(ShardplugDDPStrategy(iterables_read_own_part=True))
    (OUT / f"nodes_rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave()
