"""Fabric: ``fabric.save`` inside epoch 1, ``fabric.load`` into a fresh loader (the last scenario of
``lightning_scenarios.py OUT_DIR``, run by rank 0 alone once the 2-process group is gone).

One device, 12 shuffled samples (seed 5), batch 2:
two uninterrupted epochs; a run saved after 3 batches of epoch 1 and left; a fresh loader that loads that
save and finishes epoch 1 (with a ``for`` loop, and once more with ``next()`` ``len()`` times, then ``iter()`` of
the next epoch's pass). Fabric's loader
wrapper sets its own count of passes (0 for a fresh one) as the samplers' epoch at every ``iter()``. Writes
``OUT_DIR/fabric_epochs.json``.
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
    counted = loader()  # the same save finished by a loop that stops at len(): it never asks for one more batch
    fabric.load(os.path.join(OUT, "epoch1.ckpt"), {"loader": counted})
    batches = iter(counted)
    counted_rest = [next(batches).tolist() for _ in range(len(counted))]
    lengths = {"len_at_last_batch": len(counted)}  # its last batch is still being processed
    batches = iter(counted)  # the next epoch's pass (the finished one's iterator is dropped)
    lengths["len_next_epoch"] = len(counted)
    record = {"uninterrupted": epochs, "before": before, "rest": rest, "counted_rest": counted_rest}
    with open(os.path.join(OUT, "fabric_epochs.json"), "w") as f:
        json.dump({**record, **lengths}, f)
