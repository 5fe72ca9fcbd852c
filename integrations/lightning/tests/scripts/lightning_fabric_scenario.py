"""Fabric with ``strategy="shardplug_ddp"`` on 2 CPU processes: what ``setup_dataloaders`` gives each rank.

A scenario of ``lightning_scenarios.py OUT_DIR`` (its process group already up: ``fabric.launch()``
joins it); every rank writes ``OUT_DIR/fabric_rank<r>.json``.

Also a ``shardplug.Mixture`` resized from 3 processes to Fabric's 2: 3 processes, played by explicit
``num_processes`` / ``process_index`` loaders in each rank (a mixture's order needs no process group), read
``MIXTURE_STOP`` steps and ``fabric.save`` the position; the loader of ``setup_dataloaders`` loads it
(``fabric.load``) and reads the rest of that epoch and the next.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import shardplug
import shardplug_lightning  # noqa: F401  (registers "shardplug_ddp" for Fabric)

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))  # the core's test helpers
from _datasets import MIXTURE_WEIGHTS, mixture_sources  # noqa: E402

MIXTURE_STOP, MIXTURE_SAVED_ON = 2, 3  # steps of batches of 4 before the save, on 3 processes: 24 of 53 positions


def _budget_loader() -> DataLoader:
    budget = shardplug.TokenBudgetBatchSampler([(7 * i) % 23 + 1 for i in range(42)], 40, cost="attention", seed=5)
    return DataLoader(list(range(42)), batch_sampler=budget)


def _budget_resize(fabric: Fabric) -> dict[str, Any]:
    """A token budget's position saved by rank 0 of 3 processes after 3 micro-batches (``fabric.save``; the 3
    loaders built for 3 processes inside this group), loaded by ``fabric.load`` on these 2: the rest of the epoch
    (what the 3 read before it: ``seen``)."""
    saved = [shardplug.prepare_data_loader(_budget_loader(), num_processes=3, process_index=i) for i in range(3)]
    batches = [iter(loader) for loader in saved]
    seen = [i for it in batches for _ in range(3) for i in next(it).tolist()]
    path = os.path.join(sys.argv[1], "fabric_token_budget_resize.ckpt")
    fabric.save(path, {"loader": saved[0]})
    loader = fabric.setup_dataloaders(_budget_loader())
    fabric.load(path, {"loader": loader})
    return {"seen": seen, "rest": [batch.tolist() for batch in loader], "len": len(loader)}


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="shardplug_ddp")
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(list(range(42)), batch_size=4, shuffle=True))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    epochs = []
    for _ in range(2):
        seen = []
        for batch in loader:
            loss = model(batch.float().unsqueeze(1)).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append(batch.tolist())
        epochs.append(seen)
    data = list(range(42))  # code written for DDP: its DistributedSampler adopted, Fabric sets its epoch
    ddp = fabric.setup_dataloaders(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=3)))
    ddp_epochs = [[batch.tolist() for batch in ddp] for _ in range(2)]
    budget_loader = fabric.setup_dataloaders(_budget_loader())
    budget_epochs = [[batch.tolist() for batch in budget_loader] for _ in range(2)]
    budget_resize = _budget_resize(fabric)
    error = ""
    try:  # a DistributedSampler of another process
        other = DistributedSampler(data, num_replicas=2, rank=1 - fabric.global_rank)
        fabric.setup_dataloaders(DataLoader(data, sampler=other))
    except ValueError as exc:
        error = str(exc)
    record = {
        "strategy": type(fabric.strategy).__name__,
        "epochs": epochs,
        "seeds": loader._dataloader.state_dict()["seeds"],
        "len": len(loader),
        "step_was_skipped": fabric.strategy.step_was_skipped,
        "error": error,
        "ddp_epochs": ddp_epochs,
        "token_budget": {"epochs": budget_epochs, "len": len(budget_loader)},
        "mixture": _mixture_resized(fabric),
        "token_budget_resize": budget_resize,
    }
    with open(os.path.join(sys.argv[1], f"fabric_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(record, f)


def _mixture_resized(fabric: Fabric) -> dict[str, list[list[int]]]:
    """The mixture's global rows before the save (3 processes, in global order), and this rank's real rows of each
    batch after ``fabric.load`` (the rest of epoch 0, then epoch 1)."""
    mixture = shardplug.Mixture(mixture_sources(), MIXTURE_WEIGHTS, seed=5)
    saved_on = MIXTURE_SAVED_ON
    saving = [
        shardplug.prepare_data_loader(DataLoader(mixture, batch_size=4), num_processes=saved_on, process_index=r)
        for r in range(saved_on)
    ]
    reads = [iter(loader) for loader in saving]
    before = [next(read).tolist() for _ in range(MIXTURE_STOP) for read in reads]
    path = os.path.join(sys.argv[1], "mixture.ckpt")
    fabric.save(path, {"loader": saving[0]})  # the same position on every process
    loader = fabric.setup_dataloaders(DataLoader(mixture, batch_size=4))
    fabric.load(path, {"loader": loader})
    loader._dataloader.track_padding()
    after = []
    for _ in range(2):
        after += [batch.tolist()[: loader._dataloader.batch_real_count] for batch in loader]
    return {"before": before, "after": after}
