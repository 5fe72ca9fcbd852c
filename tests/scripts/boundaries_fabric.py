"""A Fabric run killed after epoch 0 and resumed from each ``fabric.save`` checkpoint on another number of devices.

Usage: ``python boundaries_fabric.py OUT_DIR DEVICES SETUP_JSON first`` trains 2 epochs (the setup of
``tests/_boundaries.py``) with ``ShardplugFabricDDPStrategy``, accumulating with ``fabric.no_backward_sync`` by
the documented rule (a step after every ``accumulation``-th batch of the epoch and after its last), saves
``fabric.save(path, state)`` with the loader in the state at every boundary of epoch 0 (after its first, a
middle and its last optimizer step, inside an accumulation cycle, at its end), then every rank kills itself
(SIGKILL) at the first batch of epoch 1. ``python boundaries_fabric.py OUT_DIR DEVICES SETUP_JSON resume
CKPT_DIR:N...`` resumes every checkpoint of each CKPT_DIR (saved on N devices) with ``fabric.load`` to the end
of epoch 1, then runs a fresh run of that size. ``python boundaries_fabric.py OUT_DIR DEVICES SETUP_JSON relay
CKPT_DIR:N:POINT`` resumes that point and saves after every batch of its first epoch (``relay_b<batch>.ckpt``),
killed in the next (the relay); a source ``CKPT_DIR:N:EPOCH:POINT=BATCH,...`` of ``resume`` names a relay's.
Every rank writes ``OUT_DIR/<mode>_rank<r>.json`` (the first run: ``first_rank<r>.jsonl``, a row per batch as it
comes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "scripts")]
from _boundaries import Setup  # noqa: E402  (the tests' helpers)
from _ranks import leave  # noqa: E402  (this directory: how a rank ends)

from shardplug_lightning import ShardplugFabricDDPStrategy  # noqa: E402

OUT, DEVICES, SETUP, MODE, SOURCES = (
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


def train(fabric: Fabric, saves: dict[str, int] | None = None, load: str | None = None) -> dict[str, Any]:
    """Train to the end of epoch 1 (from ``load``), recording every batch; ``saves``: the batch of epoch 0
    after which each point is saved (-1: the epoch's end), and the first run is killed in epoch 1."""
    context = None
    if SETUP.workers:  # a rank runs gloo's threads: its workers come from a fork server (which has
        # imported what a worker's run of this program imports again)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "lightning.fabric", "shardplug_lightning"])
    loader = fabric.setup_dataloaders(
        DataLoader(
            Indices(),
            batch_size=SETUP.batch,
            shuffle=True,
            drop_last=SETUP.drop_last,
            num_workers=SETUP.workers,
            multiprocessing_context=context,
            persistent_workers=bool(SETUP.workers),
        )
    )
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
        fabric.save(os.path.join(OUT, "ckpt", f"{point}.ckpt"), state)

    rows: list[list[Any]] = []
    for epoch in range(state["epoch"], SETUP.epochs):
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
                with open(os.path.join(OUT, f"first_rank{fabric.global_rank}.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
            step = SETUP.steps_after(b, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=not step):
                fabric.backward(model(batch.float().unsqueeze(1) / SETUP.n).pow(2).mean() / SETUP.accumulation)
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


def main() -> None:
    seeded = SETUP.shuffle == "seeded"
    fabric = Fabric(
        accelerator="cpu",
        devices=DEVICES,
        strategy=ShardplugFabricDDPStrategy(
            use_seedable_sampler=seeded, data_seed=5 if seeded else None, process_group_backend="gloo"
        ),
    )
    fabric.launch()
    if MODE == "first":
        os.makedirs(os.path.join(OUT, "ckpt"), exist_ok=True)
        saves = {point: SETUP.save_batch(point, DEVICES) for point in SETUP.saved_points()}
        train(fabric, saves={point: -1 if batch is None else batch for point, batch in saves.items()})
        raise AssertionError("the run was not killed")
    if MODE == "relay":  # resumed from a first run's point, saved after every batch of its first epoch
        os.makedirs(os.path.join(OUT, "ckpt"), exist_ok=True)
        folder, _, point = SOURCES[0].split(":")
        saves = {f"relay_b{b}": b for b in range(SETUP.batches_per_epoch(DEVICES))}
        train(fabric, saves=saves, load=os.path.join(folder, f"{point}.ckpt"))
        return
    out: dict[str, Any] = {"resumed": {}}
    for source in SOURCES:
        folder, processes, *relayed = source.split(":")
        if relayed:  # a relay's positions: EPOCH:point=batch,...
            for point, batch in (item.split("=") for item in relayed[1].split(",")):
                path = os.path.join(folder, f"relay_b{batch}.ckpt")
                out["resumed"][f"relay{processes}:{point}"] = train(fabric, load=path)
            continue
        for point in SETUP.saved_points():
            out["resumed"][f"{processes}:{point}"] = train(fabric, load=os.path.join(folder, f"{point}.ckpt"))
    out["fresh"] = train(fabric)
    with open(os.path.join(OUT, f"{MODE}_rank{fabric.global_rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
