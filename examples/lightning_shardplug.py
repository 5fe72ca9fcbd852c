"""Train a small model with Lightning on 2 CPU processes, data sharded by shardplug.

Run:  python examples/lightning_shardplug.py        (about 15 s; Lightning starts rank 1 itself)

Each rank prints which samples it trained on per epoch and which it validated on: the two ranks
share one shuffle (a new one each epoch), their training samples are disjoint (apart from the
few padding samples that make every rank's epoch equally long), and validation sees each sample
exactly once.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import shardplug_lightning  # noqa: F401  registers strategy="shardplug_ddp"

N_TRAIN, N_VAL = 50, 21


class Synthetic(Dataset):
    """y = 3x - 1 plus noise; item i also carries its index so we can see who read it."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=g)
        self.y = 3 * self.x - 1 + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[int]] = {}
        self.validated: list[int] = []

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(index.tolist())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        self.validated = []

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        if not self.trainer.sanity_checking:
            self.validated.extend(index.tolist())
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)  # epoch-level only

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        steps = int(self.trainer.estimated_stepping_batches)  # per-process optimizer steps
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Synthetic(N_TRAIN, seed=0), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Synthetic(N_VAL, seed=1), batch_size=4)


def main() -> None:
    model = Regression()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="shardplug_ddp",
        max_epochs=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    rank = trainer.global_rank
    lines = [f"[rank {rank}] {len(trainer.train_dataloader)} training batches per epoch"]
    for epoch, indices in sorted(model.seen.items()):
        lines.append(f"[rank {rank}] epoch {epoch}: trained on {len(indices)} samples, first ten {indices[:10]}")
    lines.append(f"[rank {rank}] validated on {model.validated} (last validation: each sample on one rank only)")
    weight, bias = model.net.weight.item(), model.net.bias.item()
    lines.append(f"[rank {rank}] learned y = {weight:.2f}x {bias:+.2f} (target y = 3x - 1)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
