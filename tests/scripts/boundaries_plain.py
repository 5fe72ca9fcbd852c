"""The boundary matrix's adapter for plain PyTorch (``TrainingRun``; ``tests/scripts/boundaries.py`` runs it).

Saves ``torch.save`` checkpoints of the loader's, the optimizer's, the scheduler's, the model's and the
gradient state's ``state_dict()`` (rank 0 writes: ``<point>.pt``, a relay's ``relay_b<batch>.pt``), resumed
with ``torch.load`` and ``load_state_dict``; the ranks are copies of the program (``_ranks.launch``).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from _adapters import SavesPointFiles, training_loader
from _boundaries import Setup
from _ranks import launch
from torch.nn.parallel import DistributedDataParallel

from shardplug import ShardplugConfig, TrainingRun

PRELOAD = ["torch", "shardplug"]
"""What the fork server of a rank's DataLoader workers imports (what a worker imports again)."""


class Adapter(SavesPointFiles):
    suffix = ".pt"

    def __init__(self, processes: int, dataset: Any, worker_context: Any) -> None:
        self.rank = launch(processes)
        self.dataset, self.worker_context, self.out = dataset, worker_context, ""

    def processes(self) -> int:
        return dist.get_world_size()

    def train(self, setup: Setup, saves: dict[str, int] | None = None, load: str | None = None) -> dict[str, Any]:
        """Train to the end of epoch 1 (from ``load``), recording every batch; ``saves``: the batch of epoch 0
        after which each point is saved (-1: the epoch's end), and the first run is killed in epoch 1."""
        seeded = setup.shuffle == "seeded"
        run = TrainingRun(
            ShardplugConfig(
                gradient_accumulation_steps=setup.accumulation,
                use_seedable_sampler=seeded,
                data_seed=5 if seeded else None,
            )
        )
        loader = run.prepare_data_loader(training_loader(setup, self.dataset, self.worker_context))
        loader.track_padding()
        layer = torch.nn.Linear(1, 1)
        model = DistributedDataParallel(layer)
        optimizer = run.prepare_optimizer(torch.optim.SGD(layer.parameters(), lr=0.1))
        scheduler = run.prepare_scheduler(
            torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0 / (1 + step))
        )
        state: dict[str, Any] = {"epoch": 0, "steps": 0}
        if load is not None:
            saved = torch.load(load, weights_only=True)
            layer.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            loader.load_state_dict(saved["loader"])
            run.gradient_state.load_state_dict(saved["gradient_state"])
            state.update(epoch=saved["epoch"], steps=saved["steps"])
        start = loader.epoch  # saves are made in the first epoch with batches, the run is killed in the next

        def save(point: str, epoch: int) -> None:
            if self.rank == 0:
                torch.save(
                    {
                        "model": layer.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "loader": loader.state_dict(),
                        "gradient_state": run.gradient_state.state_dict(),
                        "epoch": epoch,
                        "steps": state["steps"],
                    },
                    os.path.join(self.out, "ckpt", f"{point}{self.suffix}"),
                )
            dist.barrier()

        rows: list[list[Any]] = []
        for epoch in range(state["epoch"], setup.epochs):
            loader.set_epoch(epoch)
            offset = loader.epoch_length - len(loader)  # the batches of this epoch a resumed pass does not yield
            for i, batch in enumerate(loader):
                if saves is not None and epoch == start + 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # the interruption: no teardown, no last save
                real = loader.batch_real_count
                ids = batch.tolist()
                row = [epoch, offset + i, ids[:real], ids[real:], state["steps"], int(scheduler.scheduler.last_epoch)]
                rows.append(row)
                if saves is not None:  # the first run never ends: each row is written as it comes
                    with open(os.path.join(self.out, f"first_rank{self.rank}.jsonl"), "a") as f:
                        f.write(json.dumps(row) + "\n")
                with run.accumulate(model):
                    run.backward(model(batch.float().unsqueeze(1) / setup.n).pow(2).mean())
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    if run.sync_gradients and not optimizer.step_was_skipped:
                        state["steps"] += 1
                for point, after in (saves or {}).items():
                    if epoch == start and after == offset + i:
                        save(point, epoch)
            for point, after in (saves or {}).items():
                if epoch == start and after == -1:
                    save(point, epoch + 1)
        return {"rows": rows, "counters": [state["steps"], int(scheduler.scheduler.last_epoch)]}
