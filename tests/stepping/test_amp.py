"""Mixed-precision stepping: the real-step counter, exception safety (the GradScaler privates:
tests/api/test_compat.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from shardplug.core.config import ShardplugConfig
from shardplug.core.stepping import amp
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.training import TrainingRun

KINDS = ["sgd", "adamw", "adamw_fused"]


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, fused=(kind == "adamw_fused"))


@pytest.mark.parametrize("kind", KINDS)
def test_counter_counts_only_updates_the_scaler_did_not_skip(kind):
    param = torch.nn.Parameter(torch.ones(3))
    opt = make_optimizer(kind, [param])
    counter = amp.step_counter(opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    for inf in (False, True, False, True, True, False):
        before = param.detach().clone()
        opt.zero_grad()
        loss = param.sum() * (float("inf") if inf else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(before, param.detach()) == inf  # the scaler did skip the update
    assert counter.taken == 3
    assert counter.calls == (6 if kind == "adamw_fused" else 3)  # fused steps are called, then skip inside
    assert amp.step_counter(opt) is counter


def test_counter_without_scaler_counts_every_step():
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones(1)
    opt.step()
    counter = amp.step_counter(opt)  # counts from its creation on
    for _ in range(3):
        opt.step()
    assert counter.taken == 3 and counter.calls == 3
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        amp.step_counter(5)


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_optimizer_reports_fused_skips(kind):
    param = torch.nn.Parameter(torch.ones(3))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = PreparedOptimizer(make_optimizer(kind, [param]), scaler=scaler)
    reports = []
    for inf in (False, True, False):
        opt.zero_grad()
        scaler.scale(param.sum() * (float("inf") if inf else 1.0)).backward()
        opt.step()
        reports.append(opt.step_was_skipped)
    assert reports == [False, True, False]
    assert opt.steps_taken == 2


def test_gradient_state_round_trips_and_validates():
    state = GradientState(num_steps=3)
    state.begin_micro_batch()
    saved = state.state_dict()
    assert saved == {"num_steps": 3, "step": 1}
    other = GradientState(num_steps=3)
    other.load_state_dict(saved)
    assert other.micro_batches == 1 and other.sync_gradients is False
    assert [other.begin_micro_batch() for _ in range(3)] == [False, True, False]
    fresh = GradientState(num_steps=2)
    fresh.load_state_dict({"num_steps": 3, "step": 0})  # a cycle boundary: another k is fine
    assert fresh.num_steps == 2 and fresh.sync_gradients
    for bad, words in (
        ({"num_steps": 3}, "expected the keys"),
        ({"num_steps": 3, "step": 3}, r"\[0, 3\)"),
        ({"num_steps": 0, "step": 0}, "num_steps=0"),
        ({"num_steps": 3, "step": True}, "step"),
    ):
        with pytest.raises(ValueError, match=words):
            GradientState(num_steps=3).load_state_dict(bad)
    with pytest.raises(ValueError, match="resume with gradient_accumulation_steps=3"):
        GradientState(num_steps=2).load_state_dict({"num_steps": 3, "step": 1})


def test_changing_num_steps_starts_a_fresh_cycle():
    state = GradientState(num_steps=3)
    state.begin_micro_batch()
    state.num_steps = 2
    assert state.sync_gradients and state.micro_batches == 0


# -- exceptions in the middle of a step -------------------------------------------------------
class Boom(RuntimeError):
    pass


POINTS = ["forward", "backward", "clip", "step_pre_hook", "inner_step", "step_post_hook"]
FAIL_AT = 3  # the batch whose micro-batch raises
OVERFLOW_AT = 7  # a batch whose loss is inf in every run: a skipped step


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    y = torch.randn(16, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=2)


def _train(kind: str, k: int, point: str | None, skip: frozenset[int] = frozenset(), unscheduled: int = -1):
    """Train 8 micro-batches; ``point``: where batch FAIL_AT raises (caught around the micro-batch);
    ``skip``: batches a clean run leaves out; ``unscheduled``: a batch whose scheduler step a clean
    run leaves out. Returns the parameters after each sync micro-batch after FAIL_AT, the skip
    reports, the learning rate and the scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    run = TrainingRun(ShardplugConfig(gradient_accumulation_steps=k), scaler=scaler, num_processes=1, process_index=0)
    loader = run.prepare_data_loader(_data())
    inner = make_optimizer(kind, model.parameters())
    opt = run.prepare_optimizer(inner)
    sched = run.prepare_scheduler(torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5))
    failing = {"on": False}

    def raise_if(where: str) -> None:
        if failing["on"] and point == where:
            failing["on"] = False
            raise Boom(where)

    opt.register_step_pre_hook(lambda *a: raise_if("step_pre_hook"))
    opt.register_step_post_hook(lambda *a: raise_if("step_post_hook"))
    inner.register_step_pre_hook(lambda *a: raise_if("inner_step"))
    history = {}
    for i, (x, y) in enumerate(loader):
        if i in skip:
            continue
        failing["on"] = i == FAIL_AT
        try:
            with run.accumulate(model):
                raise_if("forward")
                loss = torch.nn.functional.mse_loss(model(x), y)
                if i == OVERFLOW_AT:
                    loss = loss * float("inf")
                run.backward(loss)
                raise_if("backward")
                run.clip_grad_norm_(model.parameters(), 100.0)
                raise_if("clip")
                opt.step()
                if i != unscheduled:
                    sched.step()
                opt.zero_grad()
        except Boom:
            continue
        if run.sync_gradients and i > FAIL_AT:
            history[i] = (opt.step_was_skipped, [p.detach().clone() for p in model.parameters()])
    return history, sched.get_last_lr(), scaler.get_scale()


def _abandoned(point: str, k: int) -> frozenset[int]:
    """The batches a clean run leaves out: the failed cycle, unless the step had already happened."""
    if point == "step_post_hook":
        return frozenset()
    return frozenset(range(FAIL_AT - FAIL_AT % k, FAIL_AT + 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("point", POINTS)
def test_an_exception_anywhere_in_a_step_leaves_the_next_steps_exact(kind, k, point):
    history, lr, scale = _train(kind, k, point)
    # the exception also kept the user's own scheduler step from running
    unscheduled = FAIL_AT if point == "step_post_hook" else -1
    clean, clean_lr, clean_scale = _train(kind, k, None, skip=_abandoned(point, k), unscheduled=unscheduled)
    assert sorted(history) == sorted(clean) and any(skipped for skipped, _ in clean.values())
    for i, (skipped, params) in clean.items():
        assert history[i][0] == skipped, i
        for got, want in zip(history[i][1], params):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert lr == clean_lr and scale == clean_scale


def test_backward_after_an_unscale_without_step_abandons_that_step():
    """The user's own try/except, outside run.accumulate(): the stale unscale is not reused."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = TrainingRun(scaler=scaler, num_processes=1, process_index=0)
    opt = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(1, 2)
    run.backward(model(x).sum())
    run.clip_grad_norm_(model.parameters(), 1e6)  # unscaled ... and then no step (an exception)
    before = [p.detach().clone() for p in model.parameters()]
    run.backward(model(x).sum())
    run.clip_grad_norm_(model.parameters(), 1e6)
    opt.step()
    update = [b - p.detach() for b, p in zip(before, model.parameters())]
    torch.testing.assert_close(update[0], 0.1 * x)  # one unscaled gradient: not 1024x, not two summed
