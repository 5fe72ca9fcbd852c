"""An Ignite run killed after epoch 1 and resumed from each of its ``Checkpoint`` files on another number of processes.

Usage: ``python boundaries_ignite.py OUT_DIR PROCESSES SETUP_JSON first`` trains 2 epochs (the setup of
``tests/_boundaries.py``; Ignite counts them from 1) with ``ShardplugHandler`` on PROCESSES gloo ranks, with a
``Checkpoint`` of the trainer, the model, the optimizer and the handler on every ``ITERATION_COMPLETED`` and one
on ``EPOCH_COMPLETED``, then every rank kills itself (SIGKILL) at the first iteration of epoch 2. ``python
boundaries_ignite.py OUT_DIR PROCESSES SETUP_JSON resume CKPT_DIR:N...`` resumes, with
``Checkpoint.load_objects``, the checkpoint of every boundary of the first epoch of each CKPT_DIR (saved on N
processes: after its first, a middle and its last optimizer step, inside an accumulation cycle, at its end) to
the end of epoch 2, then runs a fresh run of that size. ``python boundaries_ignite.py OUT_DIR PROCESSES
SETUP_JSON relay CKPT_DIR:N:POINT`` resumes that point, saving after every iteration
(``relay_checkpoint_<iteration>.pt``), killed in the epoch after its first (the relay); a source
``CKPT_DIR:N:EPOCH:POINT=BATCH,...`` of ``resume`` names a relay's. Rows use the oracle's 0-based epochs and
batch indices in the epoch. Every rank writes ``OUT_DIR/<mode>_rank<r>.json`` (the first run:
``first_rank<r>.jsonl``, a row per batch as it comes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "scripts")]
from _boundaries import Setup, relay_epoch  # noqa: E402  (the tests' helpers)
from _ranks import launch, leave  # noqa: E402  (this directory: how ranks start and end)

from shardplug import ShardplugConfig  # noqa: E402
from shardplug_ignite import ShardplugHandler  # noqa: E402

OUT, PROCESSES, SETUP, MODE, SOURCES = (
    sys.argv[1],
    int(sys.argv[2]),
    Setup.from_json(sys.argv[3]),
    sys.argv[4],
    sys.argv[5:],
)


class Indices(Dataset):
    def __len__(self) -> int:
        return SETUP.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def train(rank: int, first: bool = False, load: str | None = None, kill: int | None = None) -> dict[str, Any]:
    """Train to the end of epoch 2 (from ``load``), recording every batch; ``first``: save checkpoints and
    be killed in epoch 2; ``kill``: the epoch in which a relay (saving after every iteration) is killed."""
    relay = kill is not None
    kill = 2 if first else kill
    seeded = SETUP.shuffle == "seeded"
    handler = ShardplugHandler(
        ShardplugConfig(
            gradient_accumulation_steps=SETUP.accumulation,
            use_seedable_sampler=seeded,
            data_seed=5 if seeded else None,
        )
    )
    context = None
    if SETUP.workers:  # a rank runs gloo's threads: its workers come from a fork server (which has
        # imported what a worker's run of this program imports again)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "ignite.engine", "ignite.handlers", "shardplug_ignite"])
    loader = handler.prepare_data_loader(
        DataLoader(
            Indices(),
            batch_size=SETUP.batch,
            shuffle=True,
            drop_last=SETUP.drop_last,
            num_workers=SETUP.workers,
            multiprocessing_context=context,
            # not persistent: an Engine lives in reference cycles, and torch's iterator of persistent workers
            # freed by the cycle collector waits 5 s for each worker (its queues were finalized first)
            persistent_workers=False,
        )
    )
    loader.track_padding()
    model = idist.auto_model(torch.nn.Linear(1, 1))  # DDP under gloo
    trainer = handler.create_trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda y_pred, y: y_pred.pow(2).mean(),
        prepare_batch=lambda batch, device, non_blocking: (batch.float().unsqueeze(1) / SETUP.n, batch),
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
            with open(os.path.join(OUT, f"first_rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")

    trainer.add_event_handler(Events.ITERATION_STARTED, record)
    to_save = {"trainer": trainer, "model": model, "optimizer": handler.optimizers[0], "shardplug": handler}
    if first:
        folder = os.path.join(OUT, "ckpt")
        for prefix, event in (("iteration", Events.ITERATION_COMPLETED), ("epoch_end", Events.EPOCH_COMPLETED)):
            saver = Checkpoint(to_save, DiskSaver(folder, require_empty=False), filename_prefix=prefix, n_saved=None)
            trainer.add_event_handler(event, saver)
    if relay:
        saver = Checkpoint(to_save, DiskSaver(os.path.join(OUT, "ckpt"), require_empty=False), "relay", n_saved=None)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, saver)
    if load is not None:
        Checkpoint.load_objects(to_save, load)
    trainer.run(loader, max_epochs=SETUP.epochs)
    return {"rows": rows, "counters": [handler.optimizer_step, int(schedule.last_epoch)]}


def saved(source: str) -> dict[str, str]:
    """The checkpoint of each point of ``source`` (``CKPT_DIR:PROCESSES``, a first run's), by point."""
    folder, processes = source.rsplit(":", 1)
    points = {}
    for point in SETUP.saved_points():
        batch = SETUP.save_batch(point, int(processes))
        if batch is None:  # the one checkpoint of EPOCH_COMPLETED (named by the iteration it came at)
            (points[point],) = map(str, Path(folder).glob("epoch_end_checkpoint_*.pt"))
        else:  # the checkpoint of ITERATION_COMPLETED after that batch of the first epoch
            points[point] = os.path.join(folder, f"iteration_checkpoint_{batch + 1}.pt")
    return points


def main() -> None:
    rank = launch(PROCESSES)
    if MODE == "first":
        train(rank, first=True)
        raise AssertionError("the run was not killed")
    if MODE == "relay":  # resumed from a first run's point, saved after every iteration of its first epoch
        folder, processes, point = SOURCES[0].split(":")
        train(rank, load=saved(f"{folder}:{processes}")[point], kill=relay_epoch(point) + 2)
        return
    out: dict[str, Any] = {"resumed": {}}
    for source in SOURCES:
        folder, processes, *relayed = source.split(":")
        if relayed:  # a relay's positions: EPOCH:point=batch,... (named by the iteration after that batch)
            epoch, per_epoch = int(relayed[0]), SETUP.batches_per_epoch(int(processes))
            for point, batch in (item.split("=") for item in relayed[1].split(",")):
                path = os.path.join(folder, f"relay_checkpoint_{epoch * per_epoch + int(batch) + 1}.pt")
                out["resumed"][f"relay{processes}:{point}"] = train(rank, load=path)
            continue
        for point, path in saved(source).items():
            out["resumed"][f"{source.rsplit(':', 1)[1]}:{point}"] = train(rank, load=path)
    out["fresh"] = train(rank)
    with open(os.path.join(OUT, f"{MODE}_rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
