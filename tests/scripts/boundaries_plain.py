"""A plain PyTorch run (``TrainingRun``) killed after epoch 0 and resumed from each save on another number of ranks.

Usage: ``python boundaries_plain.py OUT_DIR PROCESSES SETUP_JSON first`` trains 2 epochs (the setup of
``tests/_boundaries.py``) on PROCESSES gloo ranks, saves ``torch.save`` checkpoints of the loader's, the
optimizer's, the scheduler's and the model's ``state_dict()`` at every boundary of epoch 0 (after its
first, a middle and its last optimizer step, inside an accumulation cycle, at its end; rank 0 writes),
then every rank kills itself (SIGKILL) at the first batch of epoch 1. ``python boundaries_plain.py
OUT_DIR PROCESSES SETUP_JSON relay CKPT_DIR:N:POINT`` resumes that point and saves after every batch of its
first epoch (``relay_b<batch>.pt``), killed in the next (the relay); ``python boundaries_plain.py
OUT_DIR PROCESSES SETUP_JSON resume CKPT_DIR:N[:EPOCH:POINT=BATCH,...]...`` resumes every checkpoint of each
CKPT_DIR (saved on N processes) with ``torch.load`` and ``load_state_dict`` to the end of epoch 1, then runs a fresh run
of that size. Every rank writes ``OUT_DIR/<mode>_rank<r>.json`` (the first run: ``first_rank<r>.jsonl``,
a row per batch as it comes).
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
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "scripts")]
from _boundaries import Setup  # noqa: E402  (the tests' helpers)
from _ranks import launch, leave  # noqa: E402  (this directory: how ranks start and end)

from shardplug import ShardplugConfig, TrainingRun  # noqa: E402

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


def train(rank: int, saves: dict[str, int] | None = None, load: str | None = None) -> dict[str, Any]:
    """Train to the end of epoch 1 (from ``load``), recording every batch; ``saves``: the batch of epoch 0
    after which each point is saved (-1: the epoch's end), and the first run is killed in epoch 1."""
    seeded = SETUP.shuffle == "seeded"
    run = TrainingRun(
        ShardplugConfig(
            gradient_accumulation_steps=SETUP.accumulation,
            use_seedable_sampler=seeded,
            data_seed=5 if seeded else None,
        )
    )
    context = None
    if SETUP.workers:  # a rank runs gloo's threads: its workers come from a fork server
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "shardplug"])
    loader = run.prepare_data_loader(
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
        if rank == 0:
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
                os.path.join(OUT, "ckpt", f"{point}.pt"),
            )
        dist.barrier()

    rows: list[list[Any]] = []
    for epoch in range(state["epoch"], SETUP.epochs):
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
                with open(os.path.join(OUT, f"first_rank{rank}.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
            with run.accumulate(model):
                run.backward(model(batch.float().unsqueeze(1) / SETUP.n).pow(2).mean())
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


def main() -> None:
    rank = launch(PROCESSES)
    if MODE == "first":
        os.makedirs(os.path.join(OUT, "ckpt"), exist_ok=True)
        saves = {point: SETUP.save_batch(point, PROCESSES) for point in SETUP.saved_points()}
        train(rank, saves={point: -1 if batch is None else batch for point, batch in saves.items()})
        raise AssertionError("the run was not killed")
    if MODE == "relay":  # resumed from a first run's point, saved after every batch of its first epoch
        os.makedirs(os.path.join(OUT, "ckpt"), exist_ok=True)
        folder, _, point = SOURCES[0].split(":")
        saves = {f"relay_b{b}": b for b in range(SETUP.batches_per_epoch(PROCESSES))}
        train(rank, saves=saves, load=os.path.join(folder, f"{point}.pt"))
        return
    out: dict[str, Any] = {"resumed": {}}
    for source in SOURCES:
        folder, processes, *relayed = source.split(":")
        if relayed:  # a relay's positions: EPOCH:point=batch,...
            for point, batch in (item.split("=") for item in relayed[1].split(",")):
                out["resumed"][f"relay{processes}:{point}"] = train(
                    rank, load=os.path.join(folder, f"relay_b{batch}.pt")
                )
            continue
        for point in SETUP.saved_points():
            out["resumed"][f"{processes}:{point}"] = train(rank, load=os.path.join(folder, f"{point}.pt"))
    out["fresh"] = train(rank)
    with open(os.path.join(OUT, f"{MODE}_rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    leave()
