"""Fabric: ``fabric.save`` inside epoch 1, ``fabric.load`` into a fresh loader (the last scenario of
``lightning_scenarios.py OUT_DIR``, run by rank 0 alone once the 2-process group is gone).

One device, 12 shuffled samples (seed 5), batch 2:
two uninterrupted epochs; a run saved after 3 batches of epoch 1 and left; a fresh loader that loads that
save and finishes epoch 1. Fabric's loader wrapper sets its own count of passes (0 for a fresh one) as the
samplers' epoch at every ``iter()``. Writes ``OUT_DIR/fabric_epochs.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from shardplug_lightning import ShardplugFabricDDPStrategy

OUT = sys.argv[1]
N, BATCH, STOP = 12, 2, 3


def main() -> None:
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        strategy=ShardplugFabricDDPStrategy(use_seedable_sampler=True, data_seed=5, process_group_backend="gloo"),
    )
    fabric.launch()

    def loader() -> Any:
        return fabric.setup_dataloaders(DataLoader(list(range(N)), batch_size=BATCH, shuffle=True))

    full = loader()
    epochs = [[b.tolist() for b in full] for _ in range(2)]
    first = loader()
    for _ in first:  # epoch 0
        pass
    before = []
    for i, batch in enumerate(first):  # epoch 1
        before.append(batch.tolist())
        if i + 1 == STOP:
            fabric.save(os.path.join(OUT, "epoch1.ckpt"), {"loader": first})
            break
    resumed = loader()
    fabric.load(os.path.join(OUT, "epoch1.ckpt"), {"loader": resumed})
    rest = [b.tolist() for b in resumed]
    with open(os.path.join(OUT, "fabric_epochs.json"), "w") as f:
        json.dump({"uninterrupted": epochs, "before": before, "rest": rest}, f)
