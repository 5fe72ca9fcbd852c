"""PreparedScheduler: N-fold stepping, gating on real optimizer steps, OneCycle, ReduceLROnPlateau."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau, StepLR

from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler


def make(lr: float = 1.0, state: GradientState | None = None, scaler=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    return model, inner, PreparedOptimizer(inner, scaler=scaler, gradient_state=state)


def optimizer_step(model, opt, scaler=None, inf: bool = False) -> None:
    loss = model(torch.ones(2, 2)).sum()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if inf:
        model.bias.grad.fill_(float("nan"))
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("num_processes", [1, 2, 3])
@pytest.mark.parametrize("split_batches", [False, True])
@pytest.mark.parametrize("scale", [True, False])
def test_step_counts(num_processes, split_batches, scale):
    model, inner, opt = make()
    sched = PreparedScheduler(
        StepLR(inner, step_size=1, gamma=0.5),
        opt,
        split_batches=split_batches,
        num_processes=num_processes,
        scale_scheduler_by_num_processes=scale,
    )
    per_step = num_processes if (scale and not split_batches) else 1
    assert sched.steps_per_optimizer_step == per_step
    for done in range(1, 4):
        optimizer_step(model, opt)
        sched.step()
        assert sched.last_epoch == done * per_step
        assert inner.param_groups[0]["lr"] == pytest.approx(0.5 ** (done * per_step))


def test_no_step_while_accumulating():
    state = GradientState(num_steps=3)
    model, inner, opt = make(state=state)
    sched = PreparedScheduler(StepLR(inner, step_size=1), opt, num_processes=2)
    assert sched.gradient_state is state  # taken from the prepared optimizer
    epochs = []
    for _ in range(7):
        state.begin_micro_batch()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        epochs.append(sched.last_epoch)
    assert epochs == [0, 0, 2, 2, 2, 4, 4]


def test_needs_an_optimizer_step_since_the_last_scheduler_step():
    model, inner, opt = make()
    sched = PreparedScheduler(StepLR(inner, step_size=1), opt, num_processes=1)
    sched.step()  # before any optimizer step
    assert sched.last_epoch == 0
    optimizer_step(model, opt)
    sched.step()
    sched.step()  # a second call without a new optimizer step
    assert sched.last_epoch == 1


def test_any_skipped_optimizer_blocks_the_step():
    scaler = torch.amp.GradScaler("cpu")
    model_a, inner_a, opt_a = make(scaler=scaler)
    model_b, inner_b, opt_b = make(scaler=scaler)
    sched = PreparedScheduler(StepLR(inner_a, step_size=1), [opt_a, opt_b], num_processes=2)
    optimizer_step(model_a, opt_a, scaler)
    optimizer_step(model_b, opt_b, scaler, inf=True)
    assert not opt_a.step_was_skipped and opt_b.step_was_skipped
    sched.step()
    assert sched.last_epoch == 0
    optimizer_step(model_b, opt_b, scaler)
    sched.step()
    assert sched.last_epoch == 2


def test_one_cycle_never_steps_past_total_steps():
    model, inner, opt = make()
    raw = OneCycleLR(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), max_lr=1.0, total_steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping a bare scheduler without an optimizer step
        for _ in range(5):
            raw.step()
    with pytest.raises(ValueError):  # what the guard protects against
        raw.step()
    sched = PreparedScheduler(OneCycleLR(inner, max_lr=1.0, total_steps=5), opt, num_processes=2)
    for _ in range(4):  # 8 scheduler steps wanted, 5 allowed
        optimizer_step(model, opt)
        sched.step()
    assert sched.last_epoch == 5
    assert all(torch.isfinite(torch.tensor(lr)) for lr in sched.get_last_lr())


def test_reduce_lr_on_plateau_is_stepped_once_per_call():
    model, inner, opt = make(lr=1.0)
    sched = PreparedScheduler(ReduceLROnPlateau(inner, patience=3, factor=0.1), opt, num_processes=2)
    assert sched.steps_per_optimizer_step == 1
    lrs = []
    for _ in range(5):
        optimizer_step(model, opt)
        sched.step(1.0)  # constant metric
        lrs.append(inner.param_groups[0]["lr"])
    assert sched.last_epoch == 5
    assert lrs[:4] == [1.0] * 4 and lrs[4] == pytest.approx(0.1)  # cut on the 5th call, not the 3rd


def test_step_with_optimizer_false_is_a_pass_through():
    state = GradientState(num_steps=4)
    model, inner, opt = make(state=state)
    sched = PreparedScheduler(StepLR(inner, step_size=1), opt, step_scheduler_with_optimizer=False, num_processes=3)
    state.begin_micro_batch()
    assert not state.sync_gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no optimizer step at all: torch says so
        sched.step()
        sched.step()
    assert sched.last_epoch == 2


def test_attribute_pass_through():
    model, inner, opt = make(lr=0.3)
    step_lr = StepLR(inner, step_size=2, gamma=0.1)
    sched = PreparedScheduler(step_lr, opt, num_processes=1)
    assert isinstance(sched, LRScheduler)
    assert sched.optimizer is inner
    assert sched.base_lrs == [0.3]
    assert sched.step_size == 2 and sched.gamma == 0.1
    assert sched.get_last_lr() == step_lr.get_last_lr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when get_lr() is called outside step()
        assert sched.get_lr() == step_lr.get_lr()
    sched.last_epoch = 7
    assert step_lr.last_epoch == 7 and "last_epoch" not in sched.__dict__
    with pytest.raises(AttributeError, match="nope"):
        sched.nope  # noqa: B018 (the read raises)
    assert "StepLR" in repr(sched)


def test_invalid_arguments():
    _, inner, opt = make()
    with pytest.raises(TypeError, match="step"):
        PreparedScheduler(object(), opt, num_processes=1)
    with pytest.raises(ValueError, match="num_processes"):
        PreparedScheduler(StepLR(inner, step_size=1), opt, num_processes=0)
    with pytest.raises(TypeError, match="optimizers"):
        PreparedScheduler(StepLR(inner, step_size=1), [object()], num_processes=1)
    with pytest.raises(TypeError, match="scheduler=SGD is an optimizer; pass the learning-rate scheduler first"):
        PreparedScheduler(inner, StepLR(inner, step_size=1), num_processes=1)
    with pytest.raises(TypeError, match="optimizers=5 is invalid"):
        PreparedScheduler(StepLR(inner, step_size=1), 5, num_processes=1)
    with pytest.raises(ValueError, match=r"optimizers=\[\] is invalid"):
        PreparedScheduler(StepLR(inner, step_size=1), [], num_processes=1)
    with pytest.raises(TypeError, match="gradient_state=5 is not a GradientState"):
        PreparedScheduler(StepLR(inner, step_size=1), opt, num_processes=1, gradient_state=5)
    with pytest.raises(TypeError, match="split_batches='no' is invalid"):
        PreparedScheduler(StepLR(inner, step_size=1), opt, split_batches="no", num_processes=1)


def test_the_option_names_are_the_only_spellings():
    _, inner, opt = make()
    sched = PreparedScheduler(StepLR(inner, step_size=1), opt, step_scheduler_with_optimizer=False, num_processes=2)
    assert sched.step_scheduler_with_optimizer is False
    sched = PreparedScheduler(StepLR(inner, step_size=1), opt, scale_scheduler_by_num_processes=False, num_processes=2)
    assert sched.steps_per_optimizer_step == 1 and sched.scale_scheduler_by_num_processes is False
    for unreleased in ("step_with_optimizer", "scale_by_num_processes"):  # names that were never released
        with pytest.raises(TypeError, match=unreleased):
            PreparedScheduler(StepLR(inner, step_size=1), opt, num_processes=2, **{unreleased: False})


def test_a_plain_optimizer_stepped_through_a_scaler_gates_the_scheduler():
    """Not prepared, stepped by the user's own scaler.step: a skipped update does not move the schedule."""
    param = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.AdamW([param], lr=0.1, fused=True)
    sched = PreparedScheduler(StepLR(inner, step_size=1), inner, num_processes=1)
    scaler = torch.amp.GradScaler("cpu")
    for inf in (False, True, False):
        inner.zero_grad()
        scaler.scale(param.sum() * (float("inf") if inf else 1.0)).backward()
        scaler.step(inner)
        scaler.update()
        sched.step()
    assert sched.last_epoch == 2


def test_state_dict_round_trip():
    model, inner, opt = make()
    sched = PreparedScheduler(StepLR(inner, step_size=2, gamma=0.5), opt, num_processes=2)
    for _ in range(3):
        optimizer_step(model, opt)
        sched.step()
    saved = sched.state_dict()
    assert saved == sched.scheduler.state_dict() and saved["last_epoch"] == 6

    model2, inner2, opt2 = make()
    sched2 = PreparedScheduler(StepLR(inner2, step_size=2, gamma=0.5), opt2, num_processes=2)
    sched2.load_state_dict(saved)
    inner2.load_state_dict(inner.state_dict())
    assert sched2.last_epoch == 6 and sched2.get_last_lr() == sched.get_last_lr()
    optimizer_step(model, opt)
    optimizer_step(model2, opt2)
    sched.step()
    sched2.step()
    assert sched2.get_last_lr() == sched.get_last_lr() and inner2.param_groups[0]["lr"] == inner.param_groups[0]["lr"]


def test_pickle_round_trip():
    state = GradientState(num_steps=2)
    model, inner, opt = make(state=state)
    sched = PreparedScheduler(StepLR(inner, step_size=1, gamma=0.5), opt, num_processes=2)
    state.begin_micro_batch()
    state.begin_micro_batch()
    optimizer_step(model, opt)
    sched.step()
    copy_ = pickle.loads(pickle.dumps(sched))
    assert isinstance(copy_, PreparedScheduler)
    assert copy_.last_epoch == sched.last_epoch == 2
    assert copy_.num_processes == 2 and copy_.gradient_state.num_steps == 2
    assert copy_.optimizers[0].optimizer is copy_.optimizer  # one object graph
    copy_opt = copy_.optimizers[0]
    p = copy_opt.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    copy_opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the copy's optimizer is no longer patched by the scheduler
        copy_.step()
    assert copy_.last_epoch == 4 and sched.last_epoch == 2


def test_full_loop_leaks_no_torch_warning():
    scaler = torch.amp.GradScaler("cpu")
    state = GradientState(num_steps=2)
    model, inner, opt = make(scaler=scaler, state=state)
    inner_sched = torch.optim.lr_scheduler.LinearLR(inner, total_iters=10)  # built before preparing
    sched = PreparedScheduler(inner_sched, opt, num_processes=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):
            state.begin_micro_batch()
            loss = model(torch.ones(1, 2)).sum()
            scaler.scale(loss).backward()
            if i < 2:
                model.bias.grad.fill_(float("inf"))  # the first real step is skipped
            opt.step()
            sched.step()
            opt.zero_grad()
    assert [str(w.message) for w in caught] == []
    assert sched.last_epoch == 2 * 3  # 4 real steps, the first skipped
