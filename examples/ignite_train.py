"""Train a small classifier with PyTorch-Ignite and shardplug on 2 CPU processes (gloo).

Run: python examples/ignite_train.py      (spawns its own 2 processes; finishes in seconds)

Each rank prints the samples it trained on per epoch (disjoint halves of a new shuffle every
epoch), the iterations at which the optimizer really stepped (gradient accumulation 2, the end of
each epoch always steps), the learning rate driven by those real steps, and the validation metrics
computed over every sample exactly once.
"""

from __future__ import annotations

import socket

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss
from torch.utils.data import DataLoader, TensorDataset

from shardplug_ignite import ShardplugConfig, ShardplugEvents, ShardplugHandler


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    ids = torch.arange(n)
    return TensorDataset(torch.cat([ids.unsqueeze(1).float(), x], dim=1), y)  # column 0: the sample id


def training(local_rank: int) -> None:
    rank = idist.get_rank()
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
    train_loader = handler.prepare_data_loader(DataLoader(make_data(24, 0), batch_size=4, shuffle=True))
    val_loader = handler.prepare_eval_loader(DataLoader(make_data(21, 1), batch_size=4))

    torch.manual_seed(0)
    model = idist.auto_model(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)

    def features(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x[:, 1:])  # drop the id column

    trainer = handler.create_trainer(model, optimizer, F.cross_entropy, model_fn=features)
    scheduler = handler.attach_scheduler(trainer, torch.optim.lr_scheduler.StepLR(handler.optimizers[0], 3, 0.5))
    evaluator = handler.create_evaluator(
        model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)}, model_fn=features
    )

    seen: list[int] = []
    steps: list[int] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.extend(int(i) for i in e.state.batch[0][:, 0].tolist())
    )
    trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED, lambda e: steps.append(e.state.iteration))

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Engine) -> None:
        evaluator.run(val_loader)
        metrics = evaluator.state.metrics
        lines = idist.all_gather(
            f"  rank {rank} epoch {engine.state.epoch}: samples {sorted(seen)}\n"
            f"           optimizer stepped at iterations {steps}, lr now {scheduler.get_last_lr()[0]:.3f}, "
            f"val accuracy {metrics['accuracy']:.3f} loss {metrics['loss']:.3f}"
        )
        if rank == 0:
            print("\n".join(lines), flush=True)
        seen.clear()
        steps.clear()

    trainer.run(train_loader, max_epochs=3)
    if rank == 0:
        print(f"done: {trainer.state.optimizer_step} real optimizer steps over {trainer.state.iteration} iterations")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    with idist.Parallel(backend="gloo", nproc_per_node=2, master_port=_free_port()) as parallel:
        parallel.run(training)
