"""Checks that need a CUDA GPU (skipped without one; ``make gpu-check`` runs them with ``benchmarks/gpu.py``).

Whatever runs here also runs on the CPU where it can: the prefetcher's logic (tests/loader/test_prefetch_exact.py)
and the lazy skip flag (tests/stepping/test_no_host_sync.py). Here: the CUDA side of both (side-stream copies,
pinned memory, events, host syncs counted with ``torch.cuda.set_sync_debug_mode`` and event waits counted as
``torch.cuda.Event.synchronize`` calls, which it does not see), nested batches on the
device, collectives on an NCCL group of one process, Lightning with 16-mixed and bf16-mixed, Ignite on a GPU.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _datasets import Records, Stream
from _dist import free_port
from torch.utils.data import DataLoader, TensorDataset

from shardplug import prepare_data_loader
from shardplug.core._internal.rows import iter_leaves
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check on one)")

CUDA = torch.device("cuda", 0)
LR = 1e-3


def _prepared(data, depth=None, batch_size=4, **kwargs):
    return prepare_data_loader(
        DataLoader(data, batch_size=batch_size, **kwargs),
        num_processes=1,
        process_index=0,
        put_on_device=True,
        device=CUDA,
        prefetch_depth=depth,
    )


def _cpu(batch):
    return [leaf.cpu().tolist() if isinstance(leaf, torch.Tensor) else leaf for leaf in iter_leaves(batch)]


@pytest.mark.parametrize("depth", [None, 0, 1, 3])
def test_nested_batches_arrive_on_the_device_and_equal(depth):
    expected = [_cpu(b) for b in DataLoader(Records(10), batch_size=4)]
    loader = _prepared(Records(10), depth)
    seen = []
    for batch in loader:
        assert all(leaf.device == CUDA for leaf in iter_leaves(batch) if isinstance(leaf, torch.Tensor))
        seen.append((_cpu(batch), loader.end_of_dataloader))
    assert [s for s, _ in seen] == expected
    assert [last for _, last in seen] == [False, False, True]


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_on_cuda_is_exact_after_break_and_resume(depth, pin_memory):
    data = TensorDataset(torch.arange(40).view(20, 2))
    loader = _prepared(data, depth, batch_size=2, pin_memory=pin_memory)
    taken = []
    for (x,) in loader:
        torch.cuda._sleep(1_000_000)  # a long step on the compute stream: copies run beside it
        taken.append(x.sum().item())
        if len(taken) == 4:
            break
    state = loader.state_dict()
    assert state["batches_yielded"] == 4
    again = _prepared(data, depth, batch_size=2)
    again.load_state_dict(state)
    rest = [x.sum().item() for (x,) in again]
    assert taken + rest == [sum(range(4 * i, 4 * i + 4)) for i in range(10)]


def _amp_run(kind, inf_at=(3, 7, 8, 20), steps=40, count_syncs=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(2)]).to(CUDA)
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "plain": {"foreach": False}}[kind]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (e + 1))
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000)  # no overflow of its own
    prepared = PreparedOptimizer(opt, scaler=scaler)
    prepared_sched = PreparedScheduler(sched, prepared, num_processes=1)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    x = torch.ones(8, 64, device=CUDA)
    syncs = waits = 0
    original = torch.cuda.Event.synchronize

    def counted(event):  # host waits on events: set_sync_debug_mode does not see them
        nonlocal waits
        waits += 1
        return original(event)

    for i in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        if i in inf_at:
            next(model.parameters()).grad.fill_(float("inf"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if count_syncs:
                torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.Event.synchronize = counted
            try:
                prepared.step()
                prepared_sched.step()
                prepared.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                torch.cuda.Event.synchronize = original
        syncs += sum("synchroniz" in str(w.message) for w in caught)
    return prepared, prepared_sched, used, syncs, waits


@pytest.mark.parametrize("kind", ["fused", "foreach", "plain"])
def test_amp_skips_are_exact_and_host_waits_are_counted(kind):
    prepared, sched, used, syncs, waits = _amp_run(kind, count_syncs=True)
    if kind == "fused":
        assert syncs == 0  # no stream or device synchronize in the steps (torch's own fused loop has none)
        # one event wait per step after the first: the next step's pre-hook reads the previous step's flag
        # for the prepared scheduler's decision (docs/gpu.md, "What waits on the host")
        assert waits == 40 - 1
    else:
        assert waits == 0  # no flag: nothing lazy to read
    assert prepared.steps_taken == 36 and sched.last_epoch == 36
    if kind == "fused":
        real = [lr for i, lr in enumerate(used) if i not in (3, 7, 8, 20)]  # fused: called on skipped steps too
    else:
        real = used  # the scaler does not call a plain optimizer on inf gradients
    assert real == pytest.approx([LR / (k + 1) for k in range(36)])


@pytest.fixture
def nccl_world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=CUDA)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_on_an_nccl_group_of_one(nccl_world_of_one):
    from shardplug.core.padding.metrics import gather_for_metrics

    loader = prepare_data_loader(
        DataLoader(list(range(30)), batch_size=4, shuffle=True),
        put_on_device=True,
        device=CUDA,
        rng_types=["torch", "cuda"],
    )
    loader.track_padding()
    seen = []
    for i, batch in enumerate(loader):
        assert batch.device == CUDA
        seen.extend(gather_for_metrics(batch, loader).tolist())
        if i == 3:
            state = loader.state_dict()
    assert sorted(seen) == list(range(30))
    again = prepare_data_loader(
        DataLoader(list(range(30)), batch_size=4, shuffle=True), put_on_device=True, device=CUDA
    )
    again.load_state_dict(state)
    assert len([b for b in again]) == len(loader) - 4
    dispatched = prepare_data_loader(DataLoader(Stream(10), batch_size=2), put_on_device=True, device=CUDA)
    assert type(dispatched).__name__.startswith("DataLoaderDispatcher")  # a stream on the device: dispatched
    batches = list(dispatched)
    assert all(b.device == CUDA for b in batches) and torch.cat(batches).tolist() == list(range(10))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_on_the_gpu_steps_the_scheduler_per_real_step(precision, fused, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    pytest.importorskip("shardplug_lightning")

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).float().pow(2).mean()
            return loss * float("inf") if batch_idx in (5, 11) else loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.1, fused=fused)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "step"}]

    model = Model()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=pytest.importorskip("shardplug_lightning").ShardplugDDPStrategy(put_on_device=True),
        precision=precision,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(52, 8)), batch_size=2))
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    skipped = 2 if precision == "16-mixed" else 0  # bf16 has no scaler: inf losses step (with nan weights)
    assert scheduler.last_epoch == 26 - skipped
    if torch.distributed.is_initialized():  # the strategy's group of one process: not left to the next test
        torch.distributed.destroy_process_group()


def test_lightning_transfer_hooks_see_device_batches_with_put_on_device(tmp_path):
    """docs/gpu.md: with ``put_on_device=True`` Lightning still calls its three transfer hooks once per batch, in
    order, and the batch they receive is already on the device (shardplug moved it, overlapped)."""
    pl = pytest.importorskip("lightning.pytorch")
    shardplug_lightning = pytest.importorskip("shardplug_lightning")
    calls: list[tuple[str, str]] = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def on_before_batch_transfer(self, batch, dataloader_idx):
            calls.append(("before", batch[0].device.type))
            return batch

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            calls.append(("transfer", batch[0].device.type))
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch, dataloader_idx):
            calls.append(("after", batch[0].device.type))
            return batch

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=shardplug_lightning.ShardplugDDPStrategy(put_on_device=True),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(12, 8)), batch_size=2))
    assert calls == [("before", "cuda"), ("transfer", "cuda"), ("after", "cuda")] * 6, calls
    if torch.distributed.is_initialized():  # the strategy's group of one process: not left to the next test
        torch.distributed.destroy_process_group()


def test_ignite_trainer_and_evaluator_with_a_cuda_device():
    pytest.importorskip("ignite")
    from shardplug.core.config import ShardplugConfig
    from shardplug_ignite import ShardplugHandler

    handler = ShardplugHandler(ShardplugConfig(put_on_device=True), device=CUDA)
    model = torch.nn.Linear(4, 1).to(CUDA)
    trainer = handler.create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, device=CUDA
    )
    data = TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    loader = handler.prepare_data_loader(DataLoader(data, batch_size=4))
    trainer.run(loader, max_epochs=2)
    assert trainer.state.optimizer_step == 12
    assert next(model.parameters()).device == CUDA
