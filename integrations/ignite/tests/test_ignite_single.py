"""The Ignite handler in one process (no launcher): epochs, terminate_epoch, custom process functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from shardplug import TokenBudgetBatchSampler, prepare_data_loader
from shardplug_ignite import ShardplugConfig, ShardplugEvents, ShardplugHandler, compat


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
    assert set(handler_state) == set(compat.required_state_keys(ShardplugHandler))


def test_ignite_handler_state_loads_with_weights_only(tmp_path) -> None:
    handler = ShardplugHandler(ShardplugConfig(use_seedable_sampler=True, data_seed=3))
    loader = handler.prepare_data_loader(DataLoader(_data(8), batch_size=2, shuffle=True))
    trainer = Engine(lambda e, b: None)
    handler.attach(trainer)
    trainer.run(loader, max_epochs=1)
    torch.save(handler.state_dict(), tmp_path / "h.pt")
    state = torch.load(tmp_path / "h.pt", weights_only=True)
    assert state["loader"]["seeds"] == [3] and state["gradient_state"] == {"num_steps": 1, "step": 0}


def test_ignite_auto_dataloader_takes_the_global_batch_as_idist_does() -> None:
    rows = []
    for rank in range(2):
        handler = ShardplugHandler(num_processes=2, process_index=rank)
        loader = handler.auto_dataloader(_data(16), batch_size=8)
        batches = [b[0].flatten().int().tolist() for b in loader]
        assert len(loader) == len(batches) == 2 and all(len(b) == 4 for b in batches)  # 8 per step, 4 per rank
        rows.extend(i for b in batches for i in b)
    assert sorted(rows) == list(range(16))
    with pytest.raises(ValueError, match="batch_size=7 is the global batch"):
        ShardplugHandler(num_processes=2, process_index=0).auto_dataloader(_data(16), batch_size=7)
    shares = [[[0, 1, 2], [6, 7, 8], [12, 13, 14]], [[3, 4, 5], [9, 10, 11], [15, 0, 1]]]  # the last one padded
    for rank in range(2):  # a batch sampler (idist leaves it unsharded): its batches shared out whole
        handler = ShardplugHandler(num_processes=2, process_index=rank)
        loader = handler.auto_dataloader(_data(16), batch_sampler=BatchSampler(SequentialSampler(range(16)), 3, False))
        seen: list[list[int]] = []
        trainer = Engine(lambda engine, batch, seen=seen: seen.append(batch[0].flatten().int().tolist()))
        handler.attach(trainer)
        trainer.run(loader, max_epochs=1)
        assert seen == shares[rank] and loader.batch_size is None


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, n: int, sized: bool) -> None:
        self.n, self.sized = n, sized

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(0.0)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len")
        return self.n


@pytest.mark.parametrize("sized", [True, False])
def test_ignite_evaluation_counts_every_stream_sample_once(sized: bool) -> None:
    seen = []
    for rank in range(2):
        handler = ShardplugHandler(num_processes=2, process_index=rank)
        loader = handler.prepare_eval_loader(DataLoader(_Stream(21, sized), batch_size=4))
        evaluator = handler.create_evaluator(torch.nn.Identity(), output_transform=lambda x, y, p: p)
        outputs = []
        evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))  # noqa: B023 (run within this iteration)
        evaluator.run(loader)
        seen.extend(int(v) for out in outputs for v in out.flatten().tolist())
    assert sorted(seen) == list(range(21))  # padding dropped (sized) or never added (no len)


def test_ignite_param_scheduler_attached_to_real_steps_counts_real_steps() -> None:
    from ignite.handlers import PiecewiseLinear

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2), scaler=torch.amp.GradScaler("cpu"))
    holder: dict[str, Engine] = {}

    def loss_fn(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(p.squeeze(1), y)
        return loss * float("inf") if holder["t"].state.iteration == 4 else loss

    trainer = handler.create_trainer(model, torch.optim.SGD(model.parameters(), lr=1.0), loss_fn)
    holder["t"] = trainer
    sched = PiecewiseLinear(handler.optimizers[0], "lr", milestones_values=[(0, 1.0), (10, 0.0)])
    trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED, sched)
    trainer.run(handler.prepare_data_loader(DataLoader(_data(8), batch_size=1)), max_epochs=1)
    # 8 micro-batches, 2 per step: 4 steps, the one ending at iteration 4 skipped by the scaler
    assert trainer.state.optimizer_step == 3 and trainer.state.optimizer_step_skipped == 1
    assert sched.event_index == 3
    assert handler.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.8)  # value at event 2, set for step 3


def test_ignite_mid_epoch_resume_without_the_handler_state_is_refused() -> None:
    handler = ShardplugHandler()
    trainer = Engine(lambda e, b: None)
    handler.attach(trainer)
    trainer.load_state_dict({"iteration": 3, "epoch_length": 4, "max_epochs": 2})
    with pytest.raises(RuntimeError, match="Put the ShardplugHandler in the Checkpoint's to_save"):
        trainer.run(handler.prepare_data_loader(DataLoader(_data(8), batch_size=2)))
    with pytest.raises(ValueError, match="older shardplug-ignite"):
        handler.load_state_dict(
            {
                "seeds": [1],
                "epoch": 0,
                "batches_yielded": 2,
                "optimizer_step": 0,
                "optimizer_step_skipped": 0,
                "accumulation_step": 0,
            }
        )


def _resumable_run(
    stop_at: int | None, state: dict[str, Any] | None = None, token_budget: bool = False
) -> tuple[list[int], dict[str, Any], float]:
    """(rows seen, the handler's and the trainer's states when it stopped, the learning rate) of a
    2-epoch run that stops after iteration ``stop_at`` (``None``: never), resumed from ``state``
    (``token_budget``: micro-batches by a token budget instead of batches of 2)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    handler = ShardplugHandler(ShardplugConfig(use_seedable_sampler=True, data_seed=4, gradient_accumulation_steps=2))
    if token_budget:
        budget = TokenBudgetBatchSampler([(5 * i) % 7 + 1 for i in range(12)], 9, cost="attention", seed=2)
        loader = handler.prepare_data_loader(DataLoader(_data(12), batch_sampler=budget))
    else:
        loader = handler.prepare_data_loader(DataLoader(_data(12), batch_size=2, shuffle=True))
    trainer = handler.create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=1.0), lambda p, y: F.mse_loss(p.squeeze(1), y)
    )
    handler.attach_scheduler(trainer, torch.optim.lr_scheduler.StepLR(handler.optimizers[0].optimizer, 1, gamma=0.5))
    seen: list[int] = []

    @trainer.on(Events.ITERATION_COMPLETED)
    def record(engine: Engine) -> None:
        seen.extend(int(v) for v in engine.state.batch[0].flatten().tolist())
        if engine.state.iteration == stop_at:
            engine.terminate()

    optimizer = handler.optimizers[0].optimizer
    if state is not None:
        handler.load_state_dict(state["shardplug"])
        trainer.load_state_dict(state["trainer"])
        optimizer.load_state_dict(state["optimizer"])
    trainer.run(loader, max_epochs=2)
    saved = {"shardplug": handler.state_dict(), "trainer": trainer.state_dict(), "optimizer": optimizer.state_dict()}
    return seen, saved, handler.optimizers[0].param_groups[0]["lr"]


def test_len_at_each_epoch_start_after_a_mid_epoch_resume_is_that_epochs_also_in_a_handler_added_first() -> None:
    """Ignite stops the resumed pass at ``epoch_length`` without asking it for more: ``len(loader)`` in an
    ``EPOCH_STARTED`` handler added before the ShardplugHandler's (whose ``set_epoch`` there ends that pass) is the
    rest of the resumed epoch as it starts, then a whole epoch at each later start."""

    def run(stop_at: int | None, state: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
        handler = ShardplugHandler(ShardplugConfig(use_seedable_sampler=True, data_seed=5))
        loader = handler.prepare_data_loader(DataLoader(_data(12), batch_size=2, shuffle=True))
        starts: list[int] = []
        saved = _stopped_run(
            handler, loader, lambda e, b: None, stop_at, state, 3, lambda e: starts.append(len(loader))
        )
        return starts, saved

    _, saved = run(2)  # after 2 of epoch 1's 6 batches
    starts, _ = run(None, saved)
    whole = len(DataLoader(_data(12), batch_size=2))
    assert starts == [whole - 2, whole, whole]


def test_ignite_handler_state_is_its_pieces_states_and_resumes_each(tmp_path) -> None:
    whole, _, lr = _resumable_run(None)
    first, saved, _ = _resumable_run(4)  # inside epoch 1 (6 batches), after 2 optimizer steps
    handler_state = saved["shardplug"]
    assert list(handler_state) == ["loader", "gradient_state", "optimizer_step", "optimizer_step_skipped", "schedulers"]
    assert handler_state["gradient_state"] == {"num_steps": 2, "step": 0} and handler_state["optimizer_step"] == 2
    assert handler_state["schedulers"][0]["last_epoch"] == 2 and handler_state["loader"]["epoch"] == 0
    torch.save(saved, tmp_path / "ckpt.pt")
    rest, _, resumed_lr = _resumable_run(None, torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert first + rest == whole and resumed_lr == lr
    with pytest.raises(ValueError, match="'schedulers' is absent"):
        ShardplugHandler().load_state_dict({key: value for key, value in handler_state.items() if key != "schedulers"})


def test_ignite_resumes_token_budget_micro_batches_exactly(tmp_path) -> None:
    whole, _, lr = _resumable_run(None, token_budget=True)
    first, saved, _ = _resumable_run(3, token_budget=True)  # inside epoch 1
    assert saved["shardplug"]["loader"]["unit"] == "samples" and saved["shardplug"]["loader"]["epoch"] == 0
    torch.save(saved, tmp_path / "ckpt.pt")
    rest, _, resumed_lr = _resumable_run(None, torch.load(tmp_path / "ckpt.pt", weights_only=True), token_budget=True)
    assert first + rest == whole and resumed_lr == lr
    assert sorted(whole) == sorted(list(range(12)) * 2)  # every sample once per epoch


def test_real_count_and_drop_padding_if_tracked():
    import shardplug_ignite

    handler = ShardplugHandler(ShardplugConfig())
    loader = handler.prepare_eval_loader(DataLoader(_data(3), batch_size=4))
    batch = next(iter(loader))
    real = shardplug_ignite.real_count(loader)
    assert real == 3 and [t.shape[0] for t in shardplug_ignite.drop_padding_if_tracked(batch, loader)] == [3, 3]
    assert shardplug_ignite.drop_padding_if_tracked(batch, object()) is batch  # no padding tracked: kept as it is


def test_every_front_end_cuts_the_padding_rows_alike():
    """``shardplug.drop_padding``, Ignite's ``drop_padding_if_tracked`` and a loader's ``drop_padding=True`` keep
    the same rows (one cut); a value of the whole batch (a 0-dim tensor) is kept by each."""
    import shardplug
    import shardplug_ignite
    from shardplug.core.evaluation import prepare_eval_loader

    def loader(drop: bool) -> Any:  # process 1 of 2: [4, padding, padding, padding]
        data = DataLoader(torch.arange(5.0), batch_size=4)
        return prepare_eval_loader(data, drop_padding=drop, num_processes=2, process_index=1)

    tracked, dropped, cuts = loader(False), loader(True), 0
    for batch, kept in zip(tracked, dropped):
        outputs = {"y": batch * 2, "mean": batch.mean()}
        core = shardplug.drop_padding(outputs, tracked)
        ignite = shardplug_ignite.drop_padding_if_tracked(outputs, tracked)
        assert torch.equal(core["y"], kept * 2) and torch.equal(ignite["y"], core["y"])
        assert core["mean"] is outputs["mean"] and ignite["mean"] is outputs["mean"]
        cuts += len(kept) < len(batch)
    assert cuts == 1


def _prefetched_run(depth: int) -> tuple[list[list[float]], int, Any]:
    """A trainer (``create_trainer(..., device=)``) and an evaluator over loaders that put batches on the device,
    reading ``depth`` ahead (on the CPU a look-ahead through the GPU's seam)."""
    from ignite.metrics import Average

    handler = ShardplugHandler(ShardplugConfig(put_on_device=True, prefetch_depth=depth, gradient_accumulation_steps=2))
    model = torch.nn.Linear(1, 1)
    trainer = handler.create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), lambda p, y: F.mse_loss(p.squeeze(1), y), device="cpu"
    )
    seen: list[list[float]] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch[0].flatten().tolist()))
    trainer.run(handler.prepare_data_loader(DataLoader(_data(10), batch_size=2)), max_epochs=2)
    evaluator = handler.create_evaluator(model, {"mean": Average(output_transform=lambda out: out[1])}, device="cpu")
    evaluator.run(handler.prepare_eval_loader(DataLoader(_data(7), batch_size=2)))
    return seen, trainer.state.optimizer_step, torch.as_tensor(evaluator.state.metrics["mean"]).tolist()


def test_ignite_with_a_prefetching_loader_runs_the_same_steps() -> None:
    seen, steps, mean = _prefetched_run(2)
    assert (seen, steps, mean) == _prefetched_run(0)
    assert steps == 6  # 5 micro-batches per epoch, 2 per step: the end of the loader ends a step (3 per epoch)


def _epoch_rows(
    processes: int, rank: int, stop_at: int | None, state: dict[str, Any] | None, stateful: bool
) -> tuple[dict[int, list[list[int]]], dict[str, Any]]:
    """(rows seen by epoch, the trainer's and the handler's states where it stopped) of a 2-epoch run of
    152 samples, batch 8, ``drop_last``, an agreed shuffle, as rank ``rank`` of ``processes`` (a layout of
    its own: the other ranks' batches are computed alike), stopped after iteration ``stop_at`` and resumed
    from ``state``."""
    config = ShardplugConfig(use_seedable_sampler=True, data_seed=5, use_stateful_dataloader=stateful)
    handler = ShardplugHandler(config, num_processes=processes, process_index=rank)
    loader = handler.prepare_data_loader(DataLoader(range(152), batch_size=8, shuffle=True, drop_last=True))
    seen: dict[int, list[list[int]]] = {}

    def record(engine: Engine, batch: Any) -> None:
        seen.setdefault(engine.state.epoch, []).append(batch.tolist())

    return seen, _stopped_run(handler, loader, record, stop_at, state, 2)


def _stopped_run(
    handler: ShardplugHandler,
    loader: Any,
    record: Callable[[Engine, Any], None],
    stop_at: int | None,
    state: dict[str, Any] | None,
    max_epochs: int,
    on_epoch_started: Callable[[Engine], None] | None = None,
) -> dict[str, Any]:
    """The trainer's and the handler's states where a run of ``loader`` for ``max_epochs`` stopped: an engine whose
    step gives each batch to ``record`` and stops after iteration ``stop_at``, resumed from ``state``
    (``on_epoch_started``: an ``EPOCH_STARTED`` handler added before the handler's)."""

    def step(engine: Engine, batch: Any) -> None:
        record(engine, batch)
        if engine.state.iteration == stop_at:
            engine.terminate()

    trainer = Engine(step)
    if on_epoch_started is not None:
        trainer.add_event_handler(Events.EPOCH_STARTED, on_epoch_started)
    handler.attach(trainer)
    if state is not None:
        handler.load_state_dict(state["shardplug"])
        trainer.load_state_dict(state["trainer"])
    trainer.run(loader, max_epochs=max_epochs)
    return {"trainer": trainer.state_dict(), "shardplug": handler.state_dict()}


@pytest.mark.parametrize("stateful", [False, True])
def test_ignite_resumed_where_the_new_layout_has_no_step_left_starts_the_next_epoch(stateful: bool) -> None:
    # 144 of 152 samples consumed on 1 process; on 2 processes the 8 left fill no step of 16 (drop_last
    # drops them): the resumed run is at epoch 1's end, as an uninterrupted run of 2 processes there
    _, saved = _epoch_rows(1, 0, 18, None, stateful)
    assert saved["trainer"]["iteration"] == 18
    for rank in range(2):
        whole, _ = _epoch_rows(2, rank, None, None, stateful)
        resumed, after = _epoch_rows(2, rank, None, saved, stateful)
        assert list(resumed) == [2], f"rank {rank}: epochs run {list(resumed)}, only epoch 2 was left"
        assert resumed[2] == whole[2], f"rank {rank}: epoch 2 differs from an uninterrupted run's"
        assert after["trainer"]["iteration"] == 18, f"rank {rank}: {after['trainer']}"


def test_token_budget_epochs_of_several_windows_are_each_read_whole() -> None:
    """A token budget planned in several windows, each epoch's windows drawn from its own order: every epoch has
    as many micro-batches as the first (the engine's epoch_length holds for each) and is read whole; an
    epoch_length of the user's own is kept."""
    lengths = [(37 * i) % 199 + 1 for i in range(300)]

    def loader(handler: Any = None) -> Any:
        sampler = TokenBudgetBatchSampler(lengths, 256, seed=0)
        sampler.spec = dataclasses.replace(sampler.spec, window=40)
        data = DataLoader(_data(300), batch_sampler=sampler)
        return handler.prepare_data_loader(data) if handler is not None else prepare_data_loader(data)

    reference = loader()
    expected = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected.append([batch[0].flatten().int().tolist() for batch in reference])
    length = len(expected[0])
    assert [len(epoch) for epoch in expected] == [length] * 3
    assert expected[0] != expected[1] and all(sorted(sum(epoch, [])) == list(range(300)) for epoch in expected)
    handler = ShardplugHandler(ShardplugConfig())
    seen: list[list[list[int]]] = [[], [], []]
    lengths_at_start: list[int] = []
    trainer = Engine(lambda engine, batch: seen[engine.state.epoch - 1].append(batch[0].flatten().int().tolist()))
    handler.attach(trainer)
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: lengths_at_start.append(engine.state.epoch_length))
    trainer.run(loader(handler), max_epochs=3)
    assert seen == expected
    assert lengths_at_start == [length] * 3
    capped = Engine(lambda engine, batch: None)  # an epoch_length of the user's own is kept
    handler = ShardplugHandler(ShardplugConfig())
    handler.attach(capped)
    capped.run(loader(handler), max_epochs=2, epoch_length=50)
    assert capped.state.epoch_length == 50 and capped.state.iteration == 100
