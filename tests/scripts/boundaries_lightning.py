"""A Lightning run killed after epoch 0 and resumed from each of its checkpoints on another number of devices.

Usage: ``python boundaries_lightning.py OUT_DIR DEVICES SETUP_JSON first`` trains 2 epochs (the setup of
``tests/_boundaries.py``) with a real ``ModelCheckpoint`` for every boundary of epoch 0 (every optimizer
step; a micro-batch inside an accumulation cycle; ``save_on_train_epoch_end``; after the epoch-end
validation), then every rank kills itself (SIGKILL) at the first batch of epoch 1. ``python
boundaries_lightning.py OUT_DIR DEVICES SETUP_JSON relay CKPT_DIR:PROCESSES:POINT`` resumes that point, saving after
every batch of its first epoch (``relay_b<batch_idx>.ckpt``), killed in the next (the relay). ``python
boundaries_lightning.py OUT_DIR DEVICES SETUP_JSON resume CKPT_DIR:PROCESSES[:EPOCH:POINT=BATCH,...]...`` resumes every
checkpoint of each
CKPT_DIR with ``Trainer.fit(ckpt_path=...)`` on DEVICES devices to the end of epoch 1, then runs a fresh
run of that size. Every rank writes ``OUT_DIR/<mode>_rank<r>.json``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "integrations" / "lightning" / "tests" / "scripts")]
from _boundaries import Setup, relay_epoch  # noqa: E402  (the tests' helpers)
from _exit import leave  # noqa: E402  (how a scenario process ends)

from shardplug_lightning import ShardplugDDPStrategy  # noqa: E402

OUT, DEVICES, SETUP, MODE, SOURCES = (
    sys.argv[1],
    int(sys.argv[2]),
    Setup.from_json(sys.argv[3]),
    *sys.argv[4:5],
    sys.argv[5:],
)


class Indices(Dataset):
    def __len__(self) -> int:
        return SETUP.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Recorder(pl.LightningModule):
    def __init__(self, kill: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
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
            with open(os.path.join(OUT, f"first_rank{self.global_rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        return self.layer(batch.float().unsqueeze(1) / SETUP.n).pow(2).mean()

    def scheduled(self) -> int:
        return int(self.schedule.last_epoch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val", self.layer(batch.float().unsqueeze(1)).mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        context = None
        if SETUP.workers:  # a rank runs gloo's threads: its workers come from a fork server (which has
            # imported what a worker's run of this program imports again)
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["torch", "lightning.pytorch", "shardplug_lightning"])
        return DataLoader(
            Indices(),
            batch_size=SETUP.batch,
            shuffle=True,
            drop_last=SETUP.drop_last,
            num_workers=SETUP.workers,
            multiprocessing_context=context,
            # not persistent: a Trainer lives in reference cycles, and torch's iterator of persistent workers
            # freed by the cycle collector waits 5 s for each worker (its queues were finalized first)
            persistent_workers=False,
        )

    def val_dataloader(self) -> Any:
        return DataLoader(Indices(), batch_size=4) if SETUP.validation else []


class InAccumulation(Callback):
    """Saves after epoch 0's micro-batch ``SETUP.accumulation`` (inside an accumulation cycle: no step after it)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == SETUP.accumulation:
            trainer.save_checkpoint(os.path.join(OUT, "ckpt", "in_accumulation", "in_accumulation.ckpt"))


class EveryBatch(Callback):
    """Saves after every batch of ``epoch`` (a relay's positions: ``relay_b<batch_idx>.ckpt``)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(os.path.join(OUT, "ckpt", f"relay_b{batch_idx}.ckpt"))


def with_old_epoch_progress(path: str) -> str:
    """A copy of the checkpoint at ``path`` with the epoch progress an older shardplug left after a resume from
    an epoch's last step (the running epoch counted as not started)."""
    checkpoint = torch.load(path, weights_only=False)
    for counts in checkpoint["loops"]["fit_loop"]["epoch_progress"].values():
        counts["ready"] = counts["started"] = counts["processed"]
    old = path.replace(".ckpt", "-old.ckpt")
    torch.save(checkpoint, old)
    return old


def trainer(**kwargs: Any) -> pl.Trainer:
    seeded = SETUP.shuffle == "seeded"
    return pl.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        max_epochs=SETUP.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        accumulate_grad_batches=SETUP.accumulation,
        limit_val_batches=None if SETUP.validation else 0,
        strategy=ShardplugDDPStrategy(
            use_seedable_sampler=seeded, data_seed=5 if seeded else None, process_group_backend="gloo"
        ),
        **kwargs,
    )


def checkpoints() -> list[Callback]:
    ckpt = os.path.join(OUT, "ckpt")
    callbacks: list[Callback] = [
        ModelCheckpoint(os.path.join(ckpt, "steps"), "{step}", every_n_train_steps=1, save_top_k=-1),
        ModelCheckpoint(os.path.join(ckpt, "epoch_end"), "epoch_end", save_on_train_epoch_end=True, save_top_k=-1),
    ]
    if SETUP.validation:
        callbacks.append(
            ModelCheckpoint(os.path.join(ckpt, "after_validation"), "after_validation", save_top_k=-1, monitor="val")
        )
    if SETUP.accumulation > 1:
        callbacks.append(InAccumulation())
    return callbacks


def saved(source: str) -> dict[str, str]:
    """The checkpoint of each point of ``source`` (``CKPT_DIR:PROCESSES``, a first run's), by point."""
    folder, processes = source.rsplit(":", 1)
    points = {}
    for point in SETUP.saved_points():
        batch = SETUP.save_batch(point, int(processes))
        if point == "in_accumulation" or batch is None:
            points[point] = os.path.join(folder, point, f"{point}.ckpt")
        else:  # the optimizer steps counted to that batch
            step = sum(SETUP.steps_after(b, int(processes)) for b in range(batch + 1))
            points[point] = os.path.join(folder, "steps", f"step={step}.ckpt")
    return points


def main() -> None:
    if MODE == "first":
        t = trainer(callbacks=checkpoints())
        t.fit(Recorder(kill=1))
        raise AssertionError("the run was not killed")
    if MODE == "relay":  # resumed from a first run's point, saved after every batch of its first epoch
        folder, processes, point = SOURCES[0].split(":")
        epoch = relay_epoch(point)
        t = trainer(callbacks=[EveryBatch(epoch)], enable_checkpointing=True)
        t.fit(Recorder(kill=epoch + 1), ckpt_path=saved(f"{folder}:{processes}")[point])
        return
    out: dict[str, Any] = {"resumed": {}}
    t = None
    for source in SOURCES:
        folder, processes, *relayed = source.split(":")
        for point, batch in (item.split("=") for item in relayed[1].split(",")) if relayed else ():
            path = os.path.join(folder, f"relay_b{batch}.ckpt")
            for key, ckpt in ((point, path), (f"{point}-old", with_old_epoch_progress(path))):
                if key.endswith("-old") and relayed[0] == "0":
                    continue  # only a relay resumed from an epoch's last step left that epoch progress
                model = Recorder()
                t = trainer(enable_checkpointing=False)
                t.fit(model, ckpt_path=ckpt)
                out["resumed"][f"relay{processes}:{key}"] = {
                    "rows": model.rows,
                    "counters": [t.global_step, model.scheduled()],
                }
        if relayed:
            continue
        for point, path in saved(source).items():
            key = f"{source.rsplit(':', 1)[1]}:{point}"
            model = Recorder()
            t = trainer(enable_checkpointing=False)
            t.fit(model, ckpt_path=path)
            out["resumed"][key] = {"rows": model.rows, "counters": [t.global_step, model.scheduled()]}
    fresh = Recorder()
    t = trainer(enable_checkpointing=False)
    t.fit(fresh)
    out["fresh"] = {"rows": fresh.rows, "counters": [t.global_step, fresh.scheduled()]}
    with open(os.path.join(OUT, f"{MODE}_rank{t.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
