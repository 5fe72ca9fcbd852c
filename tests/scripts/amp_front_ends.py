"""One mixed-precision run with overflowing steps through plain PyTorch, Lightning, Fabric and Ignite.

Usage: ``python amp_front_ends.py OUT.json``. For each optimizer set (SGD, AdamW, fused AdamW, two
optimizers) and each front end, the same model, data, float16 autocast on CPU and ``GradScaler``
train 6 batches whose loss is inf at batches 1 and 4; the record holds the skip reports of every
step, the scheduler's position and learning rate, the final scale and the parameters, and the
``last_epoch`` of the scheduler the user created, read after each step (``epochs``). The test
asserts the four front ends agree. One process (``devices=1``), so the run is deterministic.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

KINDS = ("sgd", "adamw", "adamw_fused", "two")
OVERFLOW = (1, 4)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(12, 4, generator=g), torch.randn(12, 2, generator=g)), batch_size=2)


def optimizers(kind: str, net: Net) -> list[torch.optim.Optimizer]:
    if kind == "sgd":
        return [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)]
    if kind == "two":
        return [torch.optim.SGD(net.a.parameters(), lr=0.1), torch.optim.AdamW(net.b.parameters(), lr=0.01, fused=True)]
    return [torch.optim.AdamW(net.parameters(), lr=0.01, fused=kind == "adamw_fused")]


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)


def loss_of(prediction: torch.Tensor, y: torch.Tensor, batch: int) -> torch.Tensor:
    loss = F.mse_loss(prediction.float(), y)
    return loss * math.inf if batch in OVERFLOW else loss


def record(
    net: Net, sched: Any, skips: list[list[bool]], grad_scaler: torch.amp.GradScaler, epochs: list[int]
) -> dict[str, Any]:
    return {
        "skips": skips,
        "epochs": epochs,
        "last_epoch": sched.last_epoch,
        "lr": sched.get_last_lr(),
        "scale": grad_scaler.get_scale(),
        "params": [p.detach().flatten().tolist() for p in net.parameters()],
    }


def plain(kind: str) -> dict[str, Any]:
    from shardplug.core.stepping.training import TrainingRun

    net, grad_scaler = Net(), scaler()
    run = TrainingRun(scaler=grad_scaler, num_processes=1, process_index=0)
    loader = run.prepare_data_loader(data())
    inner = optimizers(kind, net)
    prepared = [run.prepare_optimizer(o) for o in inner]
    raw = scheduler(inner[0])
    sched = run.prepare_scheduler(raw)
    skips, epochs = [], []
    for i, (x, y) in enumerate(loader):
        with run.accumulate(net):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(net(x), y, i)
            run.backward(loss)
            for opt in prepared:
                opt.step()
            sched.step()
            for opt in prepared:
                opt.zero_grad()
        epochs.append(raw.last_epoch)  # the scheduler the user created, read right after scheduler.step()
        skips.append([opt.step_was_skipped for opt in prepared])
    return record(net, sched, skips, grad_scaler, epochs)


def ignite(kind: str) -> dict[str, Any]:
    from ignite.engine import Engine, Events

    from shardplug_ignite import ShardplugHandler

    net, grad_scaler = Net(), scaler()
    handler = ShardplugHandler(scaler=grad_scaler, num_processes=1, process_index=0)
    loader = handler.prepare_data_loader(data())
    inner = optimizers(kind, net)
    skips: list[list[bool]] = []
    if kind != "two":
        holder: dict[str, Engine] = {}
        trainer = handler.create_trainer(
            net,
            inner[0],
            lambda p, y: loss_of(p, y, holder["t"].state.iteration - 1),
            autocast=True,
            autocast_dtype=torch.float16,
        )
        holder["t"] = trainer
    else:
        prepared = [handler.prepare_optimizer(o) for o in inner]

        def step(engine: Engine, batch: Any) -> None:
            x, y = batch
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(net(x), y, engine.state.iteration - 1)
            handler.backward(loss)
            for opt in prepared:
                opt.step()
            for opt in prepared:
                opt.zero_grad()

        trainer = Engine(step)
        handler.attach(trainer)
    raw = scheduler(inner[0])
    sched = handler.attach_scheduler(trainer, raw)
    epochs: list[int] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: skips.append([o.step_was_skipped for o in handler.optimizers])
    )
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: epochs.append(raw.last_epoch))
    trainer.run(loader, max_epochs=1)
    return record(net, sched, skips, grad_scaler, epochs)


def lightning(kind: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    from shardplug_lightning import ShardplugDDPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.automatic_optimization = kind != "two"
            self.skips: list[list[bool]] = []
            self.epochs: list[int] = []  # the scheduler created in configure_optimizers, read after each step

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            loss = loss_of(self.net(x), y, batch_idx)
            if self.automatic_optimization:
                return loss
            opts = self.optimizers()
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            row = []
            for opt in opts:
                opt.step()
                row.append(self.trainer.strategy.step_was_skipped)
            self.lr_schedulers().step()
            self.skips.append(row)
            return None

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.automatic_optimization:
                self.skips.append([self.trainer.strategy.step_was_skipped])
            self.epochs.append(self.raw.last_epoch)  # Lightning stepped the scheduler before this hook

        def configure_optimizers(self) -> Any:
            opts = optimizers(kind, self.net)
            self.raw = scheduler(opts[0])
            return opts, [{"scheduler": self.raw, "interval": "step"}]

        def train_dataloader(self) -> DataLoader:
            return data()

    grad_scaler = scaler()
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ShardplugDDPStrategy(),
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=grad_scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    sched = trainer.lr_scheduler_configs[0].scheduler
    out = record(module.net, sched, module.skips, grad_scaler, module.epochs)
    out["scheduler_type"] = type(sched).__name__
    return out


def fabric(kind: str) -> dict[str, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    from shardplug_lightning import ShardplugFabricDDPStrategy

    grad_scaler = scaler()
    runner = Fabric(
        accelerator="cpu",
        devices=1,
        strategy=ShardplugFabricDDPStrategy(),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=grad_scaler)],
    )
    runner.launch()
    net = Net()
    inner = optimizers(kind, net)
    raw = scheduler(inner[0])
    model, *opts, sched = runner.setup(net, *inner, scheduler=raw)
    loader = runner.setup_dataloaders(data())
    skips, epochs = [], []
    for i, (x, y) in enumerate(loader):
        for opt in opts:
            opt.zero_grad()
        with runner.autocast():
            loss = loss_of(model(x), y, i)
        runner.backward(loss)
        row = []
        for opt in opts:
            opt.step()
            row.append(runner.strategy.step_was_skipped)
        sched.step()
        epochs.append(raw.last_epoch)
        skips.append(row)
    out = record(net, sched, skips, grad_scaler, epochs)
    out["scheduler_type"] = type(sched).__name__
    return out


def main() -> None:
    results = {
        kind: {
            name: fn(kind)
            for name, fn in (("plain", plain), ("ignite", ignite), ("lightning", lightning), ("fabric", fabric))
        }
        for kind in KINDS
    }
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
