"""Plain PyTorch training with gradient accumulation and mixed precision, on one or more processes.

    torchrun --nproc_per_node 2 examples/train_accumulation.py      # 2 CPU processes over gloo
    python examples/train_accumulation.py                           # one process

Every process reads its own shard of the data; each optimizer step accumulates
``--accumulation-steps`` micro-batches, with no gradient all-reduce on the micro-batches in between;
fp16 autocast with a ``GradScaler`` whose skipped steps are detected exactly (the scheduler does not
advance on them).
"""

from __future__ import annotations

import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from shardplug import ShardplugConfig, TrainingRun

logger = logging.getLogger("train_accumulation")


def make_data(n: int = 512) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    return TensorDataset(x, x @ w + 0.01 * torch.randn(n, 1, generator=gen))


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--accumulation-steps", type=int, default=4)
    args = parser.parse_args()

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)  # the same initial model on every process

    scaler = torch.amp.GradScaler("cuda" if torch.cuda.is_available() else "cpu")
    run = TrainingRun(
        ShardplugConfig(gradient_accumulation_steps=args.accumulation_steps, put_on_device=True),
        scaler=scaler,
    )
    logging.basicConfig(level=logging.INFO if run.process_index == 0 else logging.WARNING, format="%(message)s")

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)).to(run.device)
    ddp_model = DistributedDataParallel(model) if dist.is_initialized() else model

    dataset = make_data()
    user_loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    # Sized the plain-PyTorch way, on the unsharded loader: the prepared scheduler steps
    # num_processes times per optimizer step (ShardplugConfig.scale_scheduler_by_num_processes).
    total_steps = args.epochs * math.ceil(len(user_loader) / args.accumulation_steps)

    loader = run.prepare_data_loader(user_loader)
    optimizer = run.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=2e-2))
    scheduler = run.prepare_scheduler(
        torch.optim.lr_scheduler.OneCycleLR(optimizer.optimizer, max_lr=2e-2, total_steps=total_steps)
    )

    loss_sum = torch.zeros(())
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        loss_sum, seen, steps, skipped = torch.zeros((), device=run.device), 0, 0, 0
        for x, y in loader:
            with run.accumulate(ddp_model):  # no_sync() on the micro-batches that do not step
                with torch.autocast(run.device.type, dtype=torch.float16):
                    loss = F.mse_loss(ddp_model(x), y)
                run.backward(loss)  # / accumulation steps, scaled by the GradScaler
                run.clip_grad_norm_(model.parameters(), max_norm=1.0)  # unscales; sync micro-batches only
                optimizer.step()  # acts on sync micro-batches only, through the scaler
                scheduler.step()  # only after a real (not skipped) optimizer step
                optimizer.zero_grad()
                if run.sync_gradients:
                    steps += 1
                    skipped += optimizer.step_was_skipped
            loss_sum += loss.detach().float() * len(x)
            seen += len(x)
        if dist.is_initialized():
            dist.all_reduce(loss_sum)
            loss_sum /= dist.get_world_size()
        logger.info(
            "epoch %d: mean loss %.4f, %d optimizer steps (%d skipped by the scaler), lr %.2e, scheduler step %d/%d",
            epoch,
            loss_sum.item() / seen,
            steps,
            skipped,
            scheduler.get_last_lr()[0],
            scheduler.last_epoch,
            total_steps,
        )
    final = loss_sum.item() / seen
    if dist.is_initialized():
        dist.barrier()  # every process is done before the group goes away
        dist.destroy_process_group()
    return final


if __name__ == "__main__":
    main()
