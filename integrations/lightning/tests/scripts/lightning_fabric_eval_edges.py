"""Fabric evaluation loaders on tiny sets (2 CPU processes, ``even_batches=False`` in the options).

Usage: ``python lightning_fabric_eval_edges.py OUT_DIR``; every rank writes
``OUT_DIR/fabric_edges_rank<r>.json``: per set, the steps it ran (each with an all-reduce) and the
samples ``gather_for_metrics`` returned.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import shardplug
from shardplug_lightning import ShardplugFabricDDPStrategy

SETS = {"three": 3, "five": 5, "big": 27, "three_after_big": 3}


def main() -> None:
    strategy = ShardplugFabricDDPStrategy(even_batches=False, timeout=datetime.timedelta(seconds=30))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    record = {}
    for name, n in SETS.items():
        for drop in (False, True):
            loader = fabric.strategy.prepare_eval_loader(DataLoader(list(range(n)), batch_size=4), drop_padding=drop)
            steps, gathered = 0, []
            for batch in loader:
                fabric.all_reduce(torch.tensor(1.0))  # a per-step collective: every rank must be here
                gathered.extend(shardplug.gather_for_metrics(batch, loader).tolist())
                steps += 1
            record[f"{name}_{'drop' if drop else 'mark'}"] = {"steps": steps, "gathered": gathered}
    with open(os.path.join(sys.argv[1], f"fabric_edges_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
    leave()
