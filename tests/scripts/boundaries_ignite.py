"""The boundary matrix's adapter for Ignite (``tests/scripts/boundaries.py`` runs it).

Trains with ``ShardplugHandler`` (Ignite counts epochs from 1; rows use the oracle's 0-based epochs and batch
indices in the epoch); a first run keeps a ``Checkpoint`` of the trainer, the model, the optimizer and the
handler on every ``ITERATION_COMPLETED`` and one on ``EPOCH_COMPLETED``, a relay one on every iteration
(``relay_checkpoint_<iteration>.pt``); positions resume with ``Checkpoint.load_objects``. The ranks are
copies of the program (``_ranks.launch``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from _adapters import training_loader
from _boundaries import Setup, relay_epoch
from _ranks import launch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver

from shardplug import ShardplugConfig
from shardplug_ignite import ShardplugHandler

PRELOAD = ["torch", "ignite.engine", "ignite.handlers", "shardplug_ignite"]
"""What the fork server of a rank's DataLoader workers imports (what a worker imports again): Ignite's too (without
it, a resumed run of workers that start each epoch took 1.6 times as long)."""


class Adapter:
    def __init__(self, processes: int, dataset: Any, worker_context: Any) -> None:
        self.rank = launch(processes)
        self.dataset, self.worker_context, self.out = dataset, worker_context, ""

    def first(self, setup: Setup) -> None:
        self.train(setup, first=True)

    def relay(self, setup: Setup, folder: str, processes: int, point: str) -> None:
        self.train(setup, load=self.saved(setup, folder, processes)[point], kill=relay_epoch(point) + 2)

    def saved(self, setup: Setup, folder: str, processes: int) -> dict[str, str]:
        """The checkpoint of each point of a first run's ``folder`` (on ``processes``), by point."""
        points = {}
        for point in setup.saved_points():
            batch = setup.save_batch(point, processes)
            if batch is None:  # the one checkpoint of EPOCH_COMPLETED (named by the iteration it came at)
                (points[point],) = map(str, Path(folder).glob("epoch_end_checkpoint_*.pt"))
            else:  # the checkpoint of ITERATION_COMPLETED after that batch of the first epoch
                points[point] = os.path.join(folder, f"iteration_checkpoint_{batch + 1}.pt")
        return points

    def relay_saved(self, setup: Setup, folder: str, processes: int, epoch: int, batch: int) -> str:
        """A relay's checkpoint after ``batch`` of its ``epoch`` (named by the iteration after that batch)."""
        return os.path.join(folder, f"relay_checkpoint_{epoch * setup.batches_per_epoch(processes) + batch + 1}.pt")

    def variants(self, point: str, path: str, epoch: int) -> list[tuple[str, str]]:
        return [(point, path)]

    def train(
        self, setup: Setup, first: bool = False, load: str | None = None, kill: int | None = None
    ) -> dict[str, Any]:
        """Train to the end of epoch 2 (from ``load``), recording every batch; ``first``: save checkpoints and
        be killed in epoch 2; ``kill``: the epoch in which a relay (saving after every iteration) is killed."""
        relay = kill is not None
        kill = 2 if first else kill
        seeded = setup.shuffle == "seeded"
        handler = ShardplugHandler(
            ShardplugConfig(
                gradient_accumulation_steps=setup.accumulation,
                use_seedable_sampler=seeded,
                data_seed=5 if seeded else None,
            )
        )
        loader = handler.prepare_data_loader(
            # not persistent: an Engine lives in reference cycles, and torch's iterator of persistent workers
            # freed by the cycle collector waits 5 s for each worker (its queues were finalized first)
            training_loader(setup, self.dataset, self.worker_context, persistent_workers=False)
        )
        loader.track_padding()
        model = idist.auto_model(torch.nn.Linear(1, 1))  # DDP under gloo
        trainer = handler.create_trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            lambda y_pred, y: y_pred.pow(2).mean(),
            prepare_batch=lambda batch, device, non_blocking: (batch.float().unsqueeze(1) / setup.n, batch),
        )
        schedule = handler.attach_scheduler(
            trainer, torch.optim.lr_scheduler.LambdaLR(handler.optimizers[0], lambda step: 1.0 / (1 + step))
        )
        rows: list[list[Any]] = []

        def record(engine: Engine) -> None:
            state = engine.state
            if state.epoch == kill:
                os.kill(os.getpid(), signal.SIGKILL)  # the interruption: no teardown, no last checkpoint
            real = loader.batch_real_count
            ids = state.batch.tolist()
            index = state.iteration - 1 - (state.epoch - 1) * state.epoch_length
            row = [state.epoch - 1, index, ids[:real], ids[real:], handler.optimizer_step, int(schedule.last_epoch)]
            rows.append(row)
            if first or relay:  # the first run never ends: each row is written as it comes
                with open(os.path.join(self.out, f"first_rank{self.rank}.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")

        trainer.add_event_handler(Events.ITERATION_STARTED, record)
        to_save = {"trainer": trainer, "model": model, "optimizer": handler.optimizers[0], "shardplug": handler}
        folder = os.path.join(self.out, "ckpt")
        if first:
            for prefix, event in (("iteration", Events.ITERATION_COMPLETED), ("epoch_end", Events.EPOCH_COMPLETED)):
                saver = Checkpoint(
                    to_save, DiskSaver(folder, require_empty=False), filename_prefix=prefix, n_saved=None
                )
                trainer.add_event_handler(event, saver)
        if relay:
            saver = Checkpoint(to_save, DiskSaver(folder, require_empty=False), "relay", n_saved=None)
            trainer.add_event_handler(Events.ITERATION_COMPLETED, saver)
        if load is not None:
            Checkpoint.load_objects(to_save, load)
        trainer.run(loader, max_epochs=setup.epochs)
        return {"rows": rows, "counters": [handler.optimizer_step, int(schedule.last_epoch)]}
