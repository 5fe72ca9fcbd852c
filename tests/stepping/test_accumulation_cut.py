"""The end of a pass ends the accumulation cycle, also when the pass is cut (``TrainingRun``).

Sample ``i`` is ``[2**i, 1]``, the model ``w . x`` with SGD(lr=1): an update's ``-dw * k`` tells
how many micro-batches it summed and which ones.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardplug.core.config import ShardplugConfig
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.training import TrainingRun

K, N = 2, 6


def _setup(k: int = K) -> tuple[TrainingRun, torch.nn.Module, object, object]:
    run = TrainingRun(ShardplugConfig(gradient_accumulation_steps=k), num_processes=1, process_index=0)
    x = torch.tensor([[2.0**i, 1.0] for i in range(N)], dtype=torch.float64)
    loader = run.prepare_data_loader(DataLoader(TensorDataset(x), batch_size=1))
    model = torch.nn.Linear(2, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    optimizer = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    return run, model, loader, optimizer


def _micro_batch(run: TrainingRun, model: torch.nn.Module, optimizer: object, batch: list) -> None:
    with run.accumulate(model):
        run.backward(model(batch[0]).sum())
        optimizer.step()
        optimizer.zero_grad()


def _updates(model: torch.nn.Module, run: TrainingRun, loader: object, optimizer: object, k: int) -> list[int]:
    """Micro-batches summed by each update of one full epoch."""
    counts = []
    before = model.weight.detach().clone().flatten()
    for batch in loader:
        _micro_batch(run, model, optimizer, batch)
        if run.sync_gradients:
            after = model.weight.detach().clone().flatten()
            counts.append(round(float((before - after)[1] * k)))
            before = after
    return counts


@pytest.mark.parametrize("cut", ["break", "exception outside accumulate", "new iter"])
def test_a_pass_cut_after_the_first_micro_batch_drops_its_cycle(cut: str) -> None:
    run, model, loader, optimizer = _setup()
    if cut == "new iter":
        it = iter(loader)
        _micro_batch(run, model, optimizer, next(it))
        it = None  # dropped: the pass ends
    else:
        try:
            for batch in loader:
                _micro_batch(run, model, optimizer, batch)
                if cut == "break":
                    break
                raise KeyError("stop")
        except KeyError:
            pass
    assert model.weight.grad is None, "the cut cycle's gradient was left behind"
    assert run.sync_gradients and run.gradient_state.micro_batches == 0
    assert _updates(model, run, loader, optimizer, K) == [K] * (N // K)  # never 3 micro-batches


def test_an_exhausted_pass_still_steps_with_what_it_accumulated() -> None:
    run, model, loader, optimizer = _setup(k=4)
    assert _updates(model, run, loader, optimizer, 4) == [4, 2]  # 6 batches: the loader's end steps


def test_reset_drops_a_cycle_in_progress_and_hooks_are_weak() -> None:
    state = GradientState(num_steps=3)
    dropped: list[int] = []

    class Owner:
        def drop(self) -> None:
            dropped.append(1)

    owner = Owner()
    state.register_drop_hook(owner.drop)
    remove = state.register_drop_hook(lambda: dropped.append(2))
    state.begin_micro_batch()
    state.reset()
    assert dropped == [1, 2] and state.micro_batches == 0 and state.sync_gradients
    remove()
    del owner
    state.begin_micro_batch()
    state.reset()
    assert dropped == [1, 2]  # the removed hook and the collected owner are gone
    state.reset()  # nothing in progress: nothing dropped
    assert dropped == [1, 2]


def test_a_pickled_prepared_optimizer_registers_again() -> None:
    run, model, loader, optimizer = _setup()
    copy = pickle.loads(pickle.dumps(optimizer))
    assert len(copy.gradient_state._drop_hooks) == 1
