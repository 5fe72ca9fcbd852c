"""The Ignite handler in one process (no launcher): epochs, terminate_epoch, custom process functions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine
from torch.utils.data import DataLoader, TensorDataset

from shardplug_ignite import ShardplugConfig, ShardplugEvents, ShardplugHandler


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.zeros(n))


def _orders(terminate_at: int | None) -> list[list[int]]:
    handler = ShardplugHandler(ShardplugConfig(use_seedable_sampler=True, data_seed=5))
    loader = handler.prepare_data_loader(DataLoader(_data(8), batch_size=2, shuffle=True))
    seen: dict[int, list[int]] = {}

    def step(engine: Engine, batch: Any) -> None:
        seen.setdefault(engine.state.epoch, []).extend(int(v) for v in batch[0].flatten().tolist())
        if engine.state.epoch == 1 and engine.state.iteration == terminate_at:
            engine.terminate_epoch()

    trainer = Engine(step)
    handler.attach(trainer)
    trainer.run(loader, max_epochs=3)
    return [seen[e] for e in sorted(seen)]


def test_ignite_epochs_follow_the_seed_also_after_terminate_epoch() -> None:
    expected = [torch.randperm(8, generator=torch.Generator().manual_seed(5 + e)).tolist() for e in range(3)]
    assert _orders(None) == expected
    cut = _orders(2)
    assert cut[0] == expected[0][:4] and cut[1:] == expected[1:]


def test_ignite_custom_process_function_with_clipping_and_scaler() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=3), scaler=torch.amp.GradScaler("cpu"))
    optimizer = handler.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    loader = handler.prepare_data_loader(DataLoader(_data(8), batch_size=1))
    norms: list[Any] = []

    def update(engine: Engine, batch: Any) -> float:
        x, y = batch
        with handler.no_sync(model):
            loss = F.mse_loss(model(x).squeeze(1), y)
            handler.backward(loss)
        norms.append(handler.run.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    trainer = Engine(update)
    handler.attach(trainer)
    steps: list[int] = []
    trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED, lambda e: steps.append(e.state.iteration))
    trainer.run(loader, max_epochs=1)
    assert steps == [3, 6, 8]
    assert [n is not None for n in norms] == [i in (3, 6, 8) for i in range(1, 9)]
    assert all(float(n) <= 1e6 for n in norms if n is not None)


def test_ignite_unprepared_loader_and_unattached_step_are_refused() -> None:
    handler = ShardplugHandler()
    trainer = Engine(lambda e, b: None)
    handler.attach(trainer)
    with pytest.raises(TypeError, match="prepare_data_loader"):
        trainer.run(DataLoader(_data(4), batch_size=2), max_epochs=1)
    other = ShardplugHandler()
    model = torch.nn.Linear(1, 1)
    step = other.training_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    loose = Engine(step)
    with pytest.raises(RuntimeError, match="attach"):
        loose.run(other.prepare_data_loader(DataLoader(_data(4), batch_size=2)), max_epochs=1)
    handler_state = other.state_dict()
    assert set(handler_state) == set(ShardplugHandler._state_dict_all_req_keys)
