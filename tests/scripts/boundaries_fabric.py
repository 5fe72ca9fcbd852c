"""The boundary matrix's adapter for Fabric (``tests/scripts/boundaries.py`` runs it).

Trains with ``ShardplugFabricDDPStrategy``, accumulating with ``fabric.no_backward_sync`` by the documented
rule (a step after every ``accumulation``-th batch of the epoch and after its last); saves ``fabric.save(path,
state)`` with the loader in the state (``<point>.ckpt``, a relay's ``relay_b<batch>.ckpt``), resumed with
``fabric.load``. The ranks are forked before the first ``Fabric`` (``_ranks.start_ranks``: its launcher takes them as
started for it; one ``Fabric`` per run).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch
from _adapters import SavesPointFiles, training_loader
from _boundaries import Setup
from _ranks import start_ranks
from lightning.fabric import Fabric

from shardplug_lightning import ShardplugFabricDDPStrategy

PRELOAD = ["torch", "shardplug"]
"""What the fork server of a rank's DataLoader workers imports (what a worker imports again): not Lightning,
which a worker never imports (a fork server importing it cost a 3-process first run a third of its time)."""


class Adapter(SavesPointFiles):
    suffix = ".ckpt"

    def __init__(self, processes: int, dataset: Any, worker_context: Any) -> None:
        self.devices, self.dataset, self.worker_context, self.out = processes, dataset, worker_context, ""
        self.rank = start_ranks(processes)

    def processes(self) -> int:
        return self.devices

    def train(self, setup: Setup, saves: dict[str, int] | None = None, load: str | None = None) -> dict[str, Any]:
        """Train to the end of epoch 1 (from ``load``), recording every batch; ``saves``: the batch of epoch 0
        after which each point is saved (-1: the epoch's end), and the first run is killed in epoch 1."""
        seeded = setup.shuffle == "seeded"
        fabric = Fabric(
            accelerator="cpu",
            devices=self.devices,
            strategy=ShardplugFabricDDPStrategy(
                use_seedable_sampler=seeded, data_seed=5 if seeded else None, process_group_backend="gloo"
            ),
        )
        fabric.launch()
        self.rank = fabric.global_rank
        loader = fabric.setup_dataloaders(training_loader(setup, self.dataset, self.worker_context))
        prepared = loader._dataloader  # the prepared loader under Fabric's wrapper
        prepared.track_padding()
        layer = torch.nn.Linear(1, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        model, optimizer, scheduler = fabric.setup(layer, optimizer, scheduler=schedule)
        state: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "loader": loader,
            "epoch": 0,
            "steps": 0,
        }
        if load is not None:
            state.update(fabric.load(load, state))
        start = prepared.epoch  # saves are made in the first epoch with batches, the run is killed in the next

        def save(point: str) -> None:
            fabric.save(os.path.join(self.out, "ckpt", f"{point}{self.suffix}"), state)

        rows: list[list[Any]] = []
        for epoch in range(state["epoch"], setup.epochs):
            state["epoch"] = epoch
            prepared.set_epoch(epoch)  # a position at the epoch's end saved inside it: this epoch's empty rest
            offset = prepared.epoch_length - len(prepared)  # the batches of this epoch a resumed pass does not yield
            for i, batch in enumerate(loader):
                if saves is not None and epoch == start + 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # the interruption: no teardown, no last save
                b = offset + i
                real = prepared.batch_real_count
                ids = batch.tolist()
                row = [epoch, b, ids[:real], ids[real:], state["steps"], int(schedule.last_epoch)]
                rows.append(row)
                if saves is not None:  # the first run never ends: each row is written as it comes
                    with open(os.path.join(self.out, f"first_rank{fabric.global_rank}.jsonl"), "a") as f:
                        f.write(json.dumps(row) + "\n")
                step = setup.steps_after(b, fabric.world_size)
                with fabric.no_backward_sync(model, enabled=not step):
                    fabric.backward(model(batch.float().unsqueeze(1) / setup.n).pow(2).mean() / setup.accumulation)
                if step:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    if not fabric.strategy.step_was_skipped:
                        state["steps"] += 1
                for point, after in (saves or {}).items():
                    if epoch == start and after == b:
                        save(point)
            state["epoch"] = epoch + 1
            for point, after in (saves or {}).items():
                if epoch == start and after == -1:
                    save(point)
        return {"rows": rows, "counters": [state["steps"], int(schedule.last_epoch)]}
