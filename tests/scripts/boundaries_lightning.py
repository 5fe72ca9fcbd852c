"""The boundary matrix's adapter for Lightning (``tests/scripts/boundaries.py`` runs it).

A first run saves with a real ``ModelCheckpoint`` at every boundary of epoch 0 (every optimizer step; a
micro-batch inside an accumulation cycle; ``save_on_train_epoch_end``; after the epoch-end validation), a relay
after every batch of its first epoch (``relay_b<batch_idx>.ckpt``); positions resume with
``Trainer.fit(ckpt_path=...)``, a relay's saved after a resume from an epoch's last step also as an older
shardplug left its epoch progress (``<point>-old``). The ranks are forked before the first ``Trainer``
(``_ranks.start_ranks``: Lightning takes them as started for it).
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from _adapters import training_loader
from _boundaries import Setup, relay_epoch
from _ranks import start_ranks
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from shardplug_lightning import ShardplugDDPStrategy

PRELOAD = ["torch", "shardplug"]
"""What the fork server of a rank's DataLoader workers imports (what a worker imports again): not Lightning,
which a worker never imports (a fork server importing it cost a 3-process first run a third of its time)."""


class Recorder(pl.LightningModule):
    def __init__(self, adapter: Adapter, setup: Setup, kill: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.adapter, self.setup_ = adapter, setup
        self.kill = kill  # the epoch whose first batch kills the run (it writes its rows as they come)
        self.rows: list[list[Any]] = []
        self.schedule: Any = None

    def on_train_start(self) -> None:
        self.trainer.train_dataloader.track_padding()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.kill is not None and self.current_epoch == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)  # the interruption: no teardown, no last checkpoint
        real = self.trainer.train_dataloader.batch_real_count
        ids = batch.tolist()
        row = [self.current_epoch, batch_idx, ids[:real], ids[real:], self.global_step, self.scheduled()]
        self.rows.append(row)
        if self.kill is not None:  # the first run never ends: each row is written as it comes
            with open(os.path.join(self.adapter.out, f"first_rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        return self.layer(batch.float().unsqueeze(1) / self.setup_.n).pow(2).mean()

    def scheduled(self) -> int:
        return int(self.schedule.last_epoch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val", self.layer(batch.float().unsqueeze(1)).mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        # not persistent: a Trainer lives in reference cycles, and torch's iterator of persistent workers
        # freed by the cycle collector waits 5 s for each worker (its queues were finalized first)
        return training_loader(self.setup_, self.adapter.dataset, self.adapter.worker_context, persistent_workers=False)

    def val_dataloader(self) -> Any:
        return DataLoader(self.adapter.dataset(self.setup_.n), batch_size=4) if self.setup_.validation else []


class InAccumulation(Callback):
    """Saves after epoch 0's micro-batch ``accumulation`` (inside an accumulation cycle: no step after it)."""

    def __init__(self, path: str, accumulation: int) -> None:
        self.path, self.accumulation = path, accumulation

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.accumulation:
            trainer.save_checkpoint(self.path)


class EveryBatch(Callback):
    """Saves after every batch of ``epoch`` (a relay's positions: ``relay_b<batch_idx>.ckpt``)."""

    def __init__(self, folder: str, epoch: int) -> None:
        self.folder, self.epoch = folder, epoch

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(os.path.join(self.folder, f"relay_b{batch_idx}.ckpt"))


def with_old_epoch_progress(path: str) -> str:
    """A copy of the checkpoint at ``path`` with the epoch progress an older shardplug left after a resume from
    an epoch's last step (the running epoch counted as not started)."""
    checkpoint = torch.load(path, weights_only=False)
    for counts in checkpoint["loops"]["fit_loop"]["epoch_progress"].values():
        counts["ready"] = counts["started"] = counts["processed"]
    old = path.replace(".ckpt", "-old.ckpt")
    torch.save(checkpoint, old)
    return old


class Adapter:
    def __init__(self, processes: int, dataset: Any, worker_context: Any) -> None:
        self.devices, self.dataset, self.worker_context, self.out = processes, dataset, worker_context, ""
        self.rank = start_ranks(processes)

    def trainer(self, setup: Setup, **kwargs: Any) -> pl.Trainer:
        seeded = setup.shuffle == "seeded"
        return pl.Trainer(
            accelerator="cpu",
            devices=self.devices,
            max_epochs=setup.epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            accumulate_grad_batches=setup.accumulation,
            limit_val_batches=None if setup.validation else 0,
            strategy=ShardplugDDPStrategy(
                use_seedable_sampler=seeded, data_seed=5 if seeded else None, process_group_backend="gloo"
            ),
            **kwargs,
        )

    def fit(self, setup: Setup, model: Recorder, ckpt_path: str | None = None, **kwargs: Any) -> pl.Trainer:
        t = self.trainer(setup, **kwargs)
        t.fit(model, ckpt_path=ckpt_path)
        self.rank = t.global_rank
        return t

    def first(self, setup: Setup) -> None:
        ckpt = os.path.join(self.out, "ckpt")
        callbacks: list[Callback] = [
            ModelCheckpoint(os.path.join(ckpt, "steps"), "{step}", every_n_train_steps=1, save_top_k=-1),
            ModelCheckpoint(os.path.join(ckpt, "epoch_end"), "epoch_end", save_on_train_epoch_end=True, save_top_k=-1),
        ]
        if setup.validation:
            callbacks.append(
                ModelCheckpoint(
                    os.path.join(ckpt, "after_validation"), "after_validation", save_top_k=-1, monitor="val"
                )
            )
        if setup.accumulation > 1:
            callbacks.append(
                InAccumulation(os.path.join(ckpt, "in_accumulation", "in_accumulation.ckpt"), setup.accumulation)
            )
        self.fit(setup, Recorder(self, setup, kill=1), callbacks=callbacks)

    def relay(self, setup: Setup, folder: str, processes: int, point: str) -> None:
        epoch = relay_epoch(point)
        callbacks = [EveryBatch(os.path.join(self.out, "ckpt"), epoch)]
        load = self.saved(setup, folder, processes)[point]
        self.fit(setup, Recorder(self, setup, kill=epoch + 1), load, callbacks=callbacks, enable_checkpointing=True)

    def saved(self, setup: Setup, folder: str, processes: int) -> dict[str, str]:
        """The checkpoint of each point of a first run's ``folder`` (on ``processes``), by point."""
        points = {}
        for point in setup.saved_points():
            batch = setup.save_batch(point, processes)
            if point == "in_accumulation" or batch is None:
                points[point] = os.path.join(folder, point, f"{point}.ckpt")
            else:  # the optimizer steps counted to that batch
                step = sum(setup.steps_after(b, processes) for b in range(batch + 1))
                points[point] = os.path.join(folder, "steps", f"step={step}.ckpt")
        return points

    def relay_saved(self, setup: Setup, folder: str, processes: int, epoch: int, batch: int) -> str:
        return os.path.join(folder, f"relay_b{batch}.ckpt")

    def variants(self, point: str, path: str, epoch: int) -> list[tuple[str, str]]:
        """The relay's checkpoint, and (only a relay resumed from an epoch's last step left that epoch progress)
        the same with an older shardplug's epoch progress."""
        return [(point, path)] + ([(f"{point}-old", with_old_epoch_progress(path))] if epoch else [])

    def train(self, setup: Setup, load: str | None = None) -> dict[str, Any]:
        model = Recorder(self, setup)
        t = self.fit(setup, model, load, enable_checkpointing=False)
        return {"rows": model.rows, "counters": [t.global_step, model.scheduled()]}
