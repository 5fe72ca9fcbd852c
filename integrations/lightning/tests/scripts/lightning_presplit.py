"""litdata's and MosaicML streaming's ``StreamingDataset`` trained on by 2 CPU processes under
``strategy="shardplug_ddp"`` (a scenario of ``lightning_scenarios.py OUT_DIR``, run when the test
wrote the datasets: both libraries installed).

``OUT_DIR/litdata`` and ``OUT_DIR/mds`` (and
its copies ``mds_native0``, ``mds_native1``) hold the samples ``{"index": i}``.  Each stream is
built in ``train_dataloader``, once the process group is up, so it splits itself by rank; every
rank writes ``OUT_DIR/presplit_rank<r>.json``: the batches it trained on by epoch, and what the
library's own split gives it through a plain DataLoader.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import shardplug_lightning  # noqa: F401  (registers strategy="shardplug_ddp")

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))  # the core's test helpers
from _stream_libraries import litdata_module, streaming_base, streaming_world  # noqa: E402

OUT = Path(sys.argv[1])
BATCH = 4


def stream(kind: str, directory: str = "mds") -> Any:
    if kind == "litdata":
        return litdata_module().StreamingDataset(str(OUT / "litdata"), shuffle=True, seed=7)
    local = str(OUT / directory)  # a streaming dataset alive at the same time as another needs its own directory
    return streaming_base().StreamingDataset(local=local, shuffle=True, shuffle_seed=7, batch_size=BATCH)


class Model(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = torch.nn.Linear(1, 1)
        self.train_batches: list[tuple[int, list[int]]] = []

    def train_dataloader(self) -> DataLoader:
        streaming_world(self.trainer.global_rank, self.trainer.world_size)  # what torchrun would set
        return DataLoader(stream(self.kind), batch_size=BATCH)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.train_batches.append((self.current_epoch, batch["index"].tolist()))
        return self.layer(batch["index"].float().unsqueeze(1)).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def native(kind: str, epoch: int, rank: int) -> list[int]:
    """This rank's samples of ``epoch`` from the library's own split (its epoch set through its API;
    litdata told the batch size, as its StreamingDataLoader does)."""
    streaming_world(rank, 2)  # the Trainer's teardown removed WORLD_SIZE
    dataset = stream(kind, f"mds_native{epoch}")
    if kind == "litdata":
        dataset.set_batch_size(BATCH)
        dataset.set_num_workers(0)
        dataset.set_epoch(epoch)
    else:
        dataset.next_epoch = epoch
    return [x for batch in DataLoader(dataset, batch_size=BATCH) for x in batch["index"].tolist()]


def main() -> None:
    record: dict[str, Any] = {}
    for kind in ("litdata", "streaming"):
        model = Model(kind)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="shardplug_ddp",
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        rank = trainer.global_rank
        record[kind] = {
            "train": model.train_batches,
            "native": [native(kind, epoch, rank) for epoch in range(2)],
            "part": type(trainer.train_dataloader.dataset).__name__,
        }
    (OUT / f"presplit_rank{rank}.json").write_text(json.dumps(record))
