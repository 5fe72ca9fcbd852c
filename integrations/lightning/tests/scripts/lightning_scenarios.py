"""Scenarios run on 2 CPU processes by ``test_lightning_strategy.py`` (one launch, several Trainers).

Usage: ``python lightning_scenarios.py OUT_DIR``. ``strategy="shardplug_ddp"`` re-executes this
script for rank 1; every rank writes ``OUT_DIR/<scenario>_rank<r>.json`` with what it saw.  Fabric,
model parallelism and the streams that split themselves by rank are scenarios of their own modules
in this directory, run in the same process group; the last one, Fabric on one device, runs in rank 0
alone once that group is gone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _exit import leave  # noqa: E402  (this directory: how a scenario process ends)
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

import shardplug
from shardplug_lightning import ShardplugDDPStrategy
from shardplug_lightning._registry import STRATEGY_NAMES

OUT = sys.argv[1]
N_TRAIN, N_VAL, BATCH = 42, 21, 4


class Indices(Dataset):
    """Item i is the tensor ``i`` (so every batch tells which samples it holds)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Recorder(pl.LightningModule):
    def __init__(self, shuffle: bool = True, overflow_steps: tuple[int, ...] = (), schedule: str = "step") -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.shuffle = shuffle
        self.overflow_steps = overflow_steps
        self.schedule = schedule
        self.train_batches: list[tuple[int, list[int]]] = []  # (epoch, indices)
        self.val_batches: list[list[int]] = []
        self.test_batches: list[list[int]] = []
        self.grad_sync: list[bool] = []
        self.skipped: list[bool] = []
        self.scheduler_epochs: list[int] = []
        self.positions: list[tuple[int, int, int]] = []  # (Lightning epoch, loader epoch, batches yielded)
        self.loader_info: dict[str, Any] = {}
        self.epoch_starts: list[list[int]] = []  # (epoch, len(), num_training_batches, estimated_stepping_batches)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x = batch.float().unsqueeze(1) / N_TRAIN
        return self.layer(x).pow(2).mean()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.train_batches.append((self.current_epoch, batch.tolist()))
        self.grad_sync.append(bool(self.trainer.strategy.model.require_backward_grad_sync))
        loss = self._loss(batch)
        if self.trainer.global_step in self.overflow_steps:
            loss = loss * float("inf")
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.skipped.append(self.trainer.strategy.step_was_skipped)
        state = self.trainer.train_dataloader.state_dict()
        self.positions.append((self.current_epoch, state["epoch"], state["batches_yielded"]))
        configs = self.trainer.lr_scheduler_configs
        if configs:
            self.scheduler_epochs.append(int(configs[0].scheduler.last_epoch))

    def on_train_epoch_start(self) -> None:
        loader = self.trainer.train_dataloader
        self.loader_info = {
            "type": type(loader).__name__,
            "len": len(loader),
            "num_training_batches": self.trainer.num_training_batches,
        }
        t = self.trainer
        self.epoch_starts.append([t.current_epoch, len(loader), t.num_training_batches, t.estimated_stepping_batches])

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if not self.trainer.sanity_checking:
            self.val_batches.append(batch.tolist())

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.test_batches.append(batch.tolist())

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return batch

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_TRAIN), batch_size=BATCH, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_VAL), batch_size=BATCH)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_VAL), batch_size=BATCH)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_VAL), batch_size=BATCH)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.schedule == "onecycle":  # sized with estimated_stepping_batches (lightning#20550)
            total = int(self.trainer.estimated_stepping_batches)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


TOKEN_LENGTHS = [(7 * i) % 23 + 1 for i in range(N_TRAIN)]
"""Tokens of each training sample of the token-budget scenario (at most 23; a budget of 40 per micro-batch)."""


class TokenBudgets(Recorder):
    """Training micro-batches by a token budget."""

    def train_dataloader(self) -> DataLoader:
        sampler = shardplug.TokenBudgetBatchSampler(TOKEN_LENGTHS, 40, cost="attention", seed=5)
        return DataLoader(Indices(N_TRAIN), batch_sampler=sampler)

    def on_train_start(self) -> None:
        self.estimated = int(self.trainer.estimated_stepping_batches)


WINDOWED_LENGTHS = [(61 * i) % 199 + 1 for i in range(300)]
"""Tokens of each sample of the windowed token-budget scenario (planned in 7 windows of 40 or more samples, each
epoch's windows drawn from its own order)."""


class WindowedTokenBudgets(Recorder):
    """Micro-batches by a token budget planned in several windows, Lightning's length of each epoch as it starts
    and its ``estimated_stepping_batches``."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_lengths: list[int] = []

    def train_dataloader(self) -> DataLoader:
        sampler = shardplug.TokenBudgetBatchSampler(WINDOWED_LENGTHS, 256, cost="tokens", seed=0)
        sampler.spec = dataclasses.replace(sampler.spec, window=40)
        return DataLoader(Indices(len(WINDOWED_LENGTHS)), batch_sampler=sampler)

    def on_train_start(self) -> None:
        self.estimated = int(self.trainer.estimated_stepping_batches)

    def on_train_epoch_start(self) -> None:
        self.epoch_lengths.append(int(self.trainer.num_training_batches))


class PredictionRecorder(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.records: list[dict[str, Any]] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):  # type: ignore[override]
        self.records.append({"batch_indices": list(batch_indices), "batch": batch.tolist()})


class Streamed(Recorder):
    """Trains on a Hugging Face stream of the parquet shards in ``OUT/hf`` (rows ``{"x": i}``)."""

    def train_dataloader(self) -> DataLoader:
        import datasets

        files = sorted(os.path.join(OUT, "hf", name) for name in os.listdir(os.path.join(OUT, "hf")))
        stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
        # workers from a fork server: forking a process whose gloo and pyarrow threads run can deadlock a worker
        import multiprocessing

        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "datasets"])
        return DataLoader(
            stream.shuffle(seed=5, buffer_size=8), batch_size=BATCH, num_workers=2, multiprocessing_context=context
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["x"], batch_idx)

    def on_train_epoch_start(self) -> None:
        pass  # the stream has no len()


class TransferHooks(Recorder):
    """Records Lightning's batch-transfer hooks (each must run once per batch, in order) and the loader's
    position when each batch is trained on (with a prefetching loader it counts batches handed out)."""

    def __init__(self) -> None:
        super().__init__(shuffle=False)
        self.hooks: list[tuple[str, list[int]]] = []

    def _record(self, hook: str, batch: Any) -> None:
        if self.trainer.training:  # the training batches (validation's go through the hooks too)
            self.hooks.append((hook, batch.tolist()))

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._record("before", batch)
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        self._record("transfer", batch)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self._record("after", batch)
        return batch


def trainer(**kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=2,
        strategy="shardplug_ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(kwargs)
    return pl.Trainer(**settings)


def seeds_of(t: pl.Trainer) -> list[Any]:
    return t.train_dataloader.state_dict()["seeds"]


def dump(name: str, rank: int, data: dict[str, Any]) -> None:
    with open(os.path.join(OUT, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(data, f)


class EvenRandomSampler(RandomSampler):
    """A user's ``RandomSampler`` subclass: the even indices only, in its own shuffled order; it
    records the epochs it is given (the list is shared by any copy of the sampler)."""

    def __init__(self, data: Any) -> None:
        super().__init__(data)
        self.epochs: list[int] = []

    def __iter__(self) -> Any:
        return (i for i in super().__iter__() if i % 2 == 0)

    def __len__(self) -> int:
        return (len(self.data_source) + 1) // 2

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class UserSamplers(Recorder):
    """Training reads an ``EvenRandomSampler``; validation a plain ``RandomSampler`` given a
    ``set_epoch`` (as Lightning's own test of ``set_epoch`` calls does)."""

    def __init__(self) -> None:
        super().__init__()
        self.train_sampler = EvenRandomSampler(Indices(N_TRAIN))
        self.val_sampler = RandomSampler(Indices(N_VAL))
        self.val_epochs: list[int] = []
        self.val_sampler.set_epoch = self.val_epochs.append  # type: ignore[attr-defined]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_TRAIN), batch_size=BATCH, sampler=self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Indices(N_VAL), batch_size=BATCH, sampler=self.val_sampler)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_batches.append(batch.tolist())


class RankSampler(Sampler[int]):
    """A user's own rank-aware sampler (not a ``DistributedSampler``): this rank's indices ``rank::world``."""

    def __init__(self, n: int, rank: int, world: int) -> None:
        self.indices = list(range(rank, n, world))

    def __iter__(self) -> Any:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class OwnSharding(Recorder):
    """Trains on a loader that shards itself (``RankSampler``), validates with a ``DistributedSampler``."""

    def train_dataloader(self) -> DataLoader:
        sampler = RankSampler(N_TRAIN, self.global_rank, self.trainer.world_size)
        return DataLoader(Indices(N_TRAIN), batch_size=BATCH, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        data = Indices(N_VAL)
        sampler = DistributedSampler(data, self.trainer.world_size, self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.val_batches.append(batch.tolist())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass  # a plain DataLoader: no position to record


class WrittenForDDP(Recorder):
    """A module written for Lightning's ``ddp`` with ``use_distributed_sampler=False``: its loaders build their own
    ``DistributedSampler`` (training: shuffled with seed 3, for process ``sampler_rank``; validation: in order)."""

    def __init__(self, sampler_rank: int) -> None:
        super().__init__()
        self.sampler_rank = sampler_rank

    def train_dataloader(self) -> DataLoader:
        data = Indices(N_TRAIN)
        sampler = DistributedSampler(data, num_replicas=2, rank=self.sampler_rank, seed=3)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        data = Indices(N_VAL)
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=False))


RESUME_N, RESUME_EPOCHS, RESUME_VAL_EVERY = 32, 4, 8  # 4 batches per rank and epoch: validate every 2 epochs


class FailsInValidation(Recorder):
    """Validates every ``RESUME_VAL_EVERY`` batches across epochs; raises in the first validation (the
    end of epoch 1) when ``fail``. Records the global steps validation ran at."""

    def __init__(self, fail: bool) -> None:
        super().__init__(shuffle=False)
        self.fail = fail
        self.validated_at: list[int] = []

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Indices(RESUME_N), batch_size=BATCH)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if self.fail:
            raise RuntimeError("fails in validation")
        if batch_idx == 0:
            self.validated_at.append(self.trainer.global_step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        pass  # also run with Lightning's own ddp strategy

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def resume_from_validation(strategy: str, root: str) -> dict[str, Any]:
    """Checkpoints saved at the end of epoch 0 and when validation at the end of epoch 1 failed; what
    ``fit(ckpt_path=...)`` from each trains and counts."""
    settings: dict[str, Any] = dict(
        strategy=strategy,
        max_epochs=RESUME_EPOCHS,
        val_check_interval=RESUME_VAL_EVERY,
        check_val_every_n_epoch=None,
        default_root_dir=root,
    )
    epoch_end = ModelCheckpoint(os.path.join(root, "epochs"), save_on_train_epoch_end=True, save_top_k=-1)
    try:
        callbacks = [OnExceptionCheckpoint(root), epoch_end]
        trainer(callbacks=callbacks, enable_checkpointing=True, **settings).fit(FailsInValidation(fail=True))
    except RuntimeError as exc:
        assert "fails in validation" in str(exc), exc
    resumed = {}
    for name, path in (("validation", "on_exception.ckpt"), ("epoch_end", "epochs/epoch=0-step=4.ckpt")):
        model = FailsInValidation(fail=False)
        t = trainer(**settings)
        t.fit(model, ckpt_path=os.path.join(root, path))
        resumed[name] = {
            "train": model.train_batches,
            "validated_at": model.validated_at,
            "global_step": t.global_step,
            "total_ready": t.fit_loop.epoch_loop.batch_progress.total.ready,
            "total_batch_idx": t.fit_loop.epoch_loop.total_batch_idx,
            "current_epoch": t.current_epoch,
        }
    return resumed


def main() -> None:
    # 1. default options, shuffled, 2 epochs, validation after each epoch, then test
    model = Recorder()
    t = trainer(max_epochs=2)
    t.fit(model)
    rank = t.global_rank
    seeds = seeds_of(t)
    t.test(model, verbose=False)
    dump(
        "default",
        rank,
        {
            "strategy": type(t.strategy).__name__,
            "world_size": t.world_size,
            "train": model.train_batches,
            "val": model.val_batches,
            "test": model.test_batches,
            "seeds": seeds,
            "loader": model.loader_info,
        },
    )

    # 2. split_batches, sequential order
    model = Recorder(shuffle=False)
    t = trainer(strategy=ShardplugDDPStrategy(split_batches=True))
    t.fit(model)
    dump("split", rank, {"train": model.train_batches, "loader": model.loader_info})

    # 3. predict: BasePredictionWriter's batch_indices
    writer = PredictionRecorder()
    t = trainer(callbacks=[writer])
    predictions = t.predict(Recorder(), return_predictions=True)
    dump("predict", rank, {"writer": writer.records, "predictions": [p.tolist() for p in predictions]})

    # 4. accumulation k=2 + fp16 GradScaler, first optimizer step overflows
    model = Recorder(overflow_steps=(0,))
    t = trainer(
        accumulate_grad_batches=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(model)
    inner = t.lr_scheduler_configs[0].scheduler
    dump(
        "amp",
        rank,
        {
            "grad_sync": model.grad_sync,
            "skipped": model.skipped,
            "scheduler_epochs": model.scheduler_epochs,
            "global_step": t.global_step,
            "scheduler_type": type(inner).__name__,
            "warnings": [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)],
        },
    )

    # 5. resume mid-epoch, OneCycleLR sized with estimated_stepping_batches (lightning#20550); the lengths Lightning
    # and the loader say as the next epoch starts
    ckpt_dir = os.path.join(OUT, "ckpt")
    model = Recorder(schedule="onecycle")
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1, save_last=False)
    t = trainer(max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint])
    t.fit(model)
    full = model.train_batches
    full_lr = model.scheduler_epochs
    ckpt = os.path.join(ckpt_dir, "epoch=0-step=2.ckpt")
    resumed = Recorder(schedule="onecycle")
    t = trainer(max_epochs=2)
    t.fit(resumed, ckpt_path=ckpt)
    dump(
        "resume",
        rank,
        {
            "full": full,
            "resumed": resumed.train_batches,
            "full_scheduler": full_lr,
            "resumed_scheduler": resumed.scheduler_epochs,
            "global_step": t.global_step,
            "estimated_stepping_batches": int(t.estimated_stepping_batches),
            "epoch_starts": resumed.epoch_starts,  # the next epoch's: after the resumed one ended
        },
    )

    # 6. epochs cut short (limit_train_batches): the loader's epoch follows Lightning's
    model = Recorder()
    t = trainer(max_epochs=2, limit_train_batches=3)
    t.fit(model)
    dump("limited", rank, {"train": model.train_batches, "positions": model.positions, "seeds": seeds_of(t)})

    # 7. code written for DDP: a DistributedSampler of the job's is adopted (native DDP's batches, Lightning's
    # set_epoch on it every epoch), also with Trainer(use_distributed_sampler=False); one of another job is refused
    # and a checkpoint saved inside epoch 0 resumes with exactly the rest of it
    adopted = {}
    ddp_ckpt = os.path.join(OUT, "ddp_ckpt")
    for injection in (True, False):
        model = WrittenForDDP(rank)
        saves = [ModelCheckpoint(dirpath=ddp_ckpt, every_n_train_steps=3, save_top_k=-1)] if injection else []
        t = trainer(max_epochs=2, use_distributed_sampler=injection, enable_checkpointing=injection, callbacks=saves)
        t.fit(model)
        adopted[str(injection)] = {
            "train": model.train_batches,
            "val": model.val_batches,
            "positions": model.positions,
            "type": type(t.train_dataloader).__name__,
        }
    resumed = WrittenForDDP(rank)
    trainer(max_epochs=2).fit(resumed, ckpt_path=os.path.join(ddp_ckpt, "epoch=0-step=3.ckpt"))
    adopted["resumed"] = resumed.train_batches
    error = ""
    try:
        trainer().fit(WrittenForDDP(1 - rank))
    except ValueError as exc:
        error = str(exc)
    dump("errors", rank, {"distributed_sampler": error, "adopted": adopted, "registered": STRATEGY_NAMES})

    # 8. a Hugging Face stream (parquet shards written by the test), 2 workers: sharded natively
    model = Streamed()
    t = trainer(max_epochs=2)
    t.fit(model)
    dump("stream", rank, {"train": model.train_batches, "dataset": type(t.train_dataloader.dataset).__module__})

    # 9. a user's RandomSampler subclass (training) and a RandomSampler given a set_epoch (validation)
    model = UserSamplers()
    t = trainer(max_epochs=2)
    t.fit(model)
    dump(
        "user_samplers",
        rank,
        {
            "train": model.train_batches,
            "train_epochs": model.train_sampler.epochs,
            "val": model.val_batches,
            "val_epochs": model.val_epochs,
        },
    )

    # 10. Trainer(use_distributed_sampler=False): the loaders shard themselves and are used as they are
    model = OwnSharding()
    t = trainer(max_epochs=1, use_distributed_sampler=False)
    t.fit(model)
    dump(
        "own_sharding",
        rank,
        {"train": model.train_batches, "val": model.val_batches, "type": type(t.train_dataloader).__name__},
    )

    # 11. resumed from a checkpoint saved in end-of-epoch validation, with shardplug and with Lightning's ddp
    dump(
        "validation_resume",
        rank,
        {
            name: resume_from_validation(name, os.path.join(OUT, f"validation_resume_{name}"))
            for name in ("shardplug_ddp", "ddp")
        },
    )

    # 12. batches on the device through a prefetching loader (on the CPU: a look-ahead of 2 batches): the same
    # batches, Lightning's transfer hooks once per batch in order, positions counting batches handed out
    runs = {}
    for depth in (0, 2):
        model = TransferHooks()
        t = trainer(strategy=ShardplugDDPStrategy(put_on_device=True, prefetch_depth=depth))
        t.fit(model)
        runs[depth] = {"train": model.train_batches, "hooks": model.hooks, "positions": model.positions}
    dump("prefetch", rank, {"off": runs[0], "on": runs[2]})

    # 12b. micro-batches by a token budget, accumulation k=2: len() and estimated_stepping_batches exact; a
    # checkpoint after optimizer step 2 (4 micro-batches of epoch 0) resumed
    budget_dir = os.path.join(OUT, "token_budget_ckpt")
    model = TokenBudgets()
    checkpoint = ModelCheckpoint(dirpath=budget_dir, every_n_train_steps=2, save_top_k=-1, save_last=False)
    t = trainer(max_epochs=2, accumulate_grad_batches=2, enable_checkpointing=True, callbacks=[checkpoint])
    t.fit(model)
    resumed = TokenBudgets()
    t_resumed = trainer(max_epochs=2, accumulate_grad_batches=2)
    t_resumed.fit(resumed, ckpt_path=os.path.join(budget_dir, "epoch=0-step=2.ckpt"))
    dump(
        "token_budget",
        rank,
        {
            "train": model.train_batches,
            "loader": model.loader_info,
            "estimated": model.estimated,
            "steps": t.global_step,
            "resumed": resumed.train_batches,
            "resumed_steps": t_resumed.global_step,
        },
    )

    # 12c. a token budget's checkpoint of 3 processes resumed on these 2: the checkpoint above (4 micro-batches
    # done) holding instead the position rank 0 of 3 processes saves after 4 micro-batches (loaders built for
    # 3 processes inside this group, as a 3-process job's rank 0 builds it)
    dump("token_budget_resize", rank, budget_resize(rank, os.path.join(budget_dir, "epoch=0-step=2.ckpt")))

    # 12d. a token budget planned in several windows, accumulation k=2: every epoch read whole, each as long as
    # the first, so estimated_stepping_batches is the optimizer steps taken
    model = WindowedTokenBudgets()
    t = trainer(max_epochs=3, accumulate_grad_batches=2)
    t.fit(model)
    dump(
        "token_budget_epochs",
        rank,
        {
            "train": model.train_batches,
            "lengths": model.epoch_lengths,
            "estimated": model.estimated,
            "steps": t.global_step,
        },
    )

    # 13-15. Fabric's setup_dataloaders, model parallelism, litdata and streaming (when the test wrote them)
    import lightning_fabric_scenario
    import lightning_model_parallel

    lightning_fabric_scenario.main()
    lightning_model_parallel.main()
    if os.path.isdir(os.path.join(OUT, "litdata")):
        import lightning_presplit

        lightning_presplit.main()

    # 16. Fabric on one device, save and load inside an epoch: rank 0 as a process of its own
    alone()
    import lightning_fabric_epochs

    lightning_fabric_epochs.main()


def budget_resize(rank: int, checkpoint: str) -> dict[str, Any]:
    """The token-budget scenario resumed from ``checkpoint`` with the position of rank 0 of 3 processes after 4
    micro-batches (what the 3 processes read before it: ``seen``)."""
    saved = [
        shardplug.prepare_data_loader(TokenBudgets().train_dataloader(), num_processes=3, process_index=i)
        for i in range(3)
    ]
    batches = [iter(loader) for loader in saved]
    seen = [i for it in batches for _ in range(4) for i in next(it).tolist()]
    path = os.path.join(OUT, "token_budget_resize.ckpt")
    if rank == 0:
        state = torch.load(checkpoint, weights_only=False)
        state["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [saved[0].state_dict()]
        torch.save(state, path)
    dist.barrier()
    resumed = TokenBudgets()
    t = trainer(max_epochs=2, accumulate_grad_batches=2)
    t.fit(resumed, ckpt_path=path)
    return {"seen": seen, "resumed": resumed.train_batches, "steps": t.global_step, "loader": resumed.loader_info}


# what the launcher (and streaming's environment) set for the 2 processes: a fresh launch sets its own
LAUNCH_ENVIRONMENT = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")


def alone() -> None:
    """End the 2-process group (rank 1 leaves) and let rank 0 go on as a process that was never launched."""
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:
        leave()
    for key in LAUNCH_ENVIRONMENT:
        os.environ.pop(key, None)


if __name__ == "__main__":
    main()
    leave()
