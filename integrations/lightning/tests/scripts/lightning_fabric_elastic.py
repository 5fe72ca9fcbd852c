"""Fabric with ``strategy="shardplug_ddp"``: ``fabric.save`` mid-epoch, ``fabric.load`` with another number of devices.

Usage: ``python lightning_fabric_elastic.py OUT_DIR DEVICES first|resume [CKPT]``. ``first``: 2 epochs
over 36 shuffled samples (batch 2 per device, seed 5), saving after 4 batches, stopping there.
``resume``: load CKPT, finish the run, then a fresh run of that size for reference. Every rank
writes ``OUT_DIR/fabric_<mode>_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from shardplug_lightning import ShardplugFabricDDPStrategy

OUT, DEVICES, MODE, CKPT = sys.argv[1], int(sys.argv[2]), sys.argv[3], (sys.argv[4:] or [None])[0]
N, BATCH, STOP, EPOCHS = 36, 2, 4, 2


def run(fabric: Fabric, load: Any = None, stop: Any = None) -> list[list[Any]]:
    loader = fabric.setup_dataloaders(DataLoader(list(range(N)), batch_size=BATCH, shuffle=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0}
    if load is not None:
        remainder = fabric.load(load, state)
        state.update(remainder)
    rows: list[list[Any]] = []
    for epoch in range(state["epoch"], EPOCHS):
        state["epoch"] = epoch
        for batch in loader:
            rows.append([epoch, batch.tolist()])
            if stop is not None and len(rows) == stop:
                fabric.save(os.path.join(OUT, "fabric.ckpt"), state)
                return rows
        state["epoch"] = epoch + 1
    return rows


def main() -> None:
    fabric = Fabric(
        accelerator="cpu", devices=DEVICES, strategy=ShardplugFabricDDPStrategy(use_seedable_sampler=True, data_seed=5)
    )
    fabric.launch()
    if MODE == "first":
        out = {"rows": run(fabric, stop=STOP)}
    else:
        out = {"rows": run(fabric, load=CKPT), "fresh": run(fabric)}
    with open(os.path.join(OUT, f"fabric_{MODE}_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
