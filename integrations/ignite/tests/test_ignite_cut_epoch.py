"""An Ignite epoch cut inside a gradient-accumulation cycle (``gradient_accumulation_steps=2``).

The core's rule (``GradientState``: the end of a pass ends the cycle) drops the micro-batches of a
cycle that a cut pass ended: every real update sums exactly 2 micro-batches, as Ignite's own
``create_supervised_trainer(gradient_accumulation_steps=2)`` does. Each sample ``i`` is
``[2**i, 1]`` and the model is ``w . x`` with SGD(lr=1), so an update tells how many micro-batches
it summed (``k * -dw[1]``) and which ones (``k * -dw[0]``, in binary).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from torch.utils.data import DataLoader, TensorDataset

from shardplug_ignite import ShardplugConfig, ShardplugEvents, ShardplugHandler

K, N = 2, 6


def _data() -> TensorDataset:
    x = torch.tensor([[2.0**i, 1.0] for i in range(N)], dtype=torch.float64)
    return TensorDataset(x, torch.zeros(N, dtype=torch.float64))


def _model() -> torch.nn.Module:
    model = torch.nn.Linear(2, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    return model


def _loss(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return y_pred.sum()


def _updates(weights: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(micro-batches summed, bitmask of their samples) of each recorded update."""
    out = []
    for before, after in zip(weights, weights[1:]):
        delta = (before - after) * K
        out.append((round(float(delta[1])), round(float(delta[0]))))
    return out


def _hand_written(handler: ShardplugHandler, model: torch.nn.Module) -> Engine:
    """The hand-written process function of docs/ignite.md."""
    optimizer = handler.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))

    def update(engine: Engine, batch: Any) -> float:
        x, y = batch
        with handler.no_sync(model):
            loss = _loss(model(x), y)
            handler.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    trainer = Engine(update)
    handler.attach(trainer)
    return trainer


def _create_trainer(handler: ShardplugHandler, model: torch.nn.Module) -> Engine:
    return handler.create_trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), _loss)


def _run_cut(build: Callable[[ShardplugHandler, torch.nn.Module], Engine], cut: str) -> list[tuple[int, int]]:
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=K))
    loader = handler.prepare_data_loader(DataLoader(_data(), batch_size=1))
    model = _model()
    trainer = build(handler, model)
    weights = [model.weight.detach().clone().flatten()]
    trainer.add_event_handler(
        ShardplugEvents.OPTIMIZER_STEP_COMPLETED, lambda _: weights.append(model.weight.detach().clone().flatten())
    )

    @trainer.on(Events.ITERATION_COMPLETED(once=1))  # after the first micro-batch of a cycle
    def _cut(engine: Engine) -> None:
        engine.terminate_epoch() if cut == "terminate_epoch" else engine.terminate()

    trainer.run(loader, max_epochs=2)
    if cut == "terminate":
        trainer.run(loader, max_epochs=2)  # continue the run
    return _updates(weights)


@pytest.mark.parametrize("cut", ["terminate_epoch", "terminate"])
@pytest.mark.parametrize("build", [_create_trainer, _hand_written], ids=["create_trainer", "hand_written"])
def test_an_epoch_cut_after_the_first_micro_batch_drops_it(build: Any, cut: str) -> None:
    updates = _run_cut(build, cut)
    assert updates, "no optimizer step was taken"
    assert [count for count, _ in updates] == [K] * len(updates), f"updates summed {updates}"
    assert all(bin(mask).count("1") == K for _, mask in updates)  # two different samples, none twice


def test_ignite_own_trainer_sums_exactly_k_across_a_cut() -> None:
    """The reference behaviour the issue compares with: Ignite's windows always sum ``k``."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = create_supervised_trainer(model, optimizer, _loss, gradient_accumulation_steps=K)
    weights = [model.weight.detach().clone().flatten()]

    @trainer.on(Events.ITERATION_COMPLETED)
    def _record(engine: Engine) -> None:
        if engine.state.iteration % K == 0:
            weights.append(model.weight.detach().clone().flatten())

    trainer.on(Events.ITERATION_COMPLETED(once=1))(lambda engine: engine.terminate_epoch())
    trainer.run(DataLoader(_data(), batch_size=1), max_epochs=2)
    assert [count for count, _ in _updates(weights)] == [K] * (len(weights) - 1)


def test_a_cut_cycle_leaves_no_gradient_behind() -> None:
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=K))
    loader = handler.prepare_data_loader(DataLoader(_data(), batch_size=1))
    model = _model()
    trainer = _create_trainer(handler, model)
    trainer.on(Events.ITERATION_COMPLETED(once=1))(lambda engine: engine.terminate())
    trainer.run(loader, max_epochs=1)
    assert model.weight.grad is None  # dropped when the cut pass ended
    assert handler.sync_gradients and handler.gradient_state.micro_batches == 0
