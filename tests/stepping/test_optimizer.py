"""PreparedOptimizer: Optimizer API, accumulation gating, GradScaler skip detection, state."""

from __future__ import annotations

import copy
import logging
import pickle
import warnings

import pytest
import torch
from torch.optim import Optimizer

from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer


class ScalingAwareSGD(Optimizer):
    """An optimizer that unscales and skips by itself, as fused torch optimizers do."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.entered = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.entered += 1
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.item() > 0:
            return None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad / grad_scale if grad_scale is not None else p.grad
                    p.add_(grad, alpha=-group["lr"])
        return None


def fused_adamw_supported() -> bool:
    p = torch.nn.Parameter(torch.ones(2))
    try:
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        p.grad = torch.ones(2)
        opt.step()
    except (RuntimeError, ValueError):
        return False
    return True


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    "scaling_aware": lambda params: ScalingAwareSGD(params, lr=0.1),
}


def make(kind: str = "sgd", seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, OPTIMIZERS[kind](model.parameters())


def backward(model, scaler=None, inf: bool = False, seed: int = 1) -> None:
    torch.manual_seed(seed)
    loss = model(torch.randn(4, 3)).pow(2).mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- Optimizer API -------------------------------------------------------------------------------
def test_is_a_real_optimizer_sharing_the_wrapped_objects():
    model, inner = make("adamw")
    opt = PreparedOptimizer(inner)
    assert isinstance(opt, Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert len(inner.param_groups) == 1 and len(inner.param_groups[0]["params"]) == 2  # untouched
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert inner.param_groups[1]["params"][0] is extra and inner.param_groups[1]["lr"] == 0.5
    assert opt.param_groups[1]["betas"] == inner.defaults["betas"]  # inner's defaults filled in
    inner.custom_flag = 3
    assert opt.custom_flag == 3  # other attribute reads fall through
    with pytest.raises(AttributeError, match="missing"):
        opt.missing  # noqa: B018 (the read raises)
    assert "AdamW" in repr(opt)


def test_rejects_non_optimizers():
    with pytest.raises(TypeError, match="optimizer"):
        PreparedOptimizer(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="already"):
        PreparedOptimizer(PreparedOptimizer(make()[1]))
    with pytest.raises(TypeError, match="gradient_state=5 is not a GradientState"):
        PreparedOptimizer(make()[1], gradient_state=5)
    with pytest.raises(TypeError, match="scaler=5 is not a GradScaler"):
        PreparedOptimizer(make()[1], scaler=5)


def test_step_and_zero_grad_act_only_on_sync_micro_batches():
    model, inner = make("sgd")
    state = GradientState(num_steps=2)
    opt = PreparedOptimizer(inner, gradient_state=state)
    backward(model)
    start = params_of(model)
    assert state.begin_micro_batch() is False
    opt.step()
    opt.zero_grad()
    assert same(start, params_of(model))
    assert model.weight.grad is not None  # not cleared while accumulating
    assert state.begin_micro_batch() is True
    opt.step()
    assert not same(start, params_of(model))
    opt.zero_grad(set_to_none=False)
    assert torch.count_nonzero(model.weight.grad) == 0
    opt.zero_grad()
    assert model.weight.grad is None


def test_step_hooks_run_only_when_the_step_acts():
    model, inner = make("sgd")
    state = GradientState(num_steps=2)
    opt = PreparedOptimizer(inner, gradient_state=state)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, o.step_was_skipped)))
    backward(model)
    state.begin_micro_batch()
    opt.step()
    assert calls == []
    state.begin_micro_batch()
    opt.step()
    assert calls == [("pre", True), ("post", True, False)]
    pre.remove()
    state.begin_micro_batch()
    state.begin_micro_batch()
    opt.step()
    assert calls[2:] == [("post", True, False)]


def test_pre_hook_may_replace_the_arguments():
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner)
    backward(model)
    seen = []

    def closure():
        seen.append(True)
        return torch.tensor(7.0)

    hook_args = []

    def hook(o, args, kwargs):
        hook_args.append(args)
        return (o, closure), {}

    opt.register_step_pre_hook(hook)
    assert opt.step().item() == 7.0 and seen == [True]
    assert hook_args == [(opt,)]  # torch's convention: the optimizer first, then step's arguments


def test_closure_passes_through_without_scaler():
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(1, 3)).sum()
        loss.backward()
        return loss

    assert torch.is_tensor(opt.step(closure))


def test_scheduler_built_on_the_wrapper_works_without_warnings():
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            backward(model)
            opt.step()
            sched.step()
            opt.zero_grad()
    assert [str(w.message) for w in caught] == []
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_warns_once_when_accumulating_without_micro_batches(caplog):
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner, gradient_state=GradientState(num_steps=4))
    backward(model)
    with caplog.at_level(logging.WARNING, logger="shardplug.core.stepping.optimizer"):
        opt.step()
        opt.step()
    assert len([r for r in caplog.records if "no micro-batch" in r.getMessage()]) == 1


def test_train_and_eval_are_forwarded():
    class ScheduleFree(torch.optim.SGD):
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.modes = []

        def train(self):
            self.modes.append("train")

        def eval(self):
            self.modes.append("eval")

    model = torch.nn.Linear(2, 2)
    inner = ScheduleFree(model.parameters())
    opt = PreparedOptimizer(inner)
    opt.eval()
    opt.train()
    assert inner.modes == ["eval", "train"]
    PreparedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).train()  # no-op, no error


# -- mixed precision -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_forced_inf_under_grad_scaler_is_a_skipped_step(kind):
    if kind == "adamw_fused" and not fused_adamw_supported():
        pytest.skip("fused AdamW is not supported by this CPU build (covered by scaling_aware)")
    model, inner = make(kind)
    scaler = torch.amp.GradScaler("cpu")
    opt = PreparedOptimizer(inner, scaler=scaler)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
    entered = []
    inner.register_step_pre_hook(lambda o, a, k: entered.append(True))
    from shardplug.core.stepping.scheduler import PreparedScheduler

    prepared_sched = PreparedScheduler(sched, opt, num_processes=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start, scale = params_of(model), scaler.get_scale()
        backward(model, scaler, inf=True)
        opt.step()
        prepared_sched.step()
        opt.zero_grad()
        assert opt.step_was_skipped is True
        assert same(start, params_of(model))
        # read through the prepared scheduler: it settles a decision still waiting for a fused step's flag
        assert prepared_sched.last_epoch == 0 and inner.param_groups[0]["lr"] == pytest.approx(0.1)
        assert scaler.get_scale() < scale
        fused_path = getattr(inner, "_step_supports_amp_scaling", False)
        assert bool(entered) == bool(fused_path)  # fused optimizers are entered and skip inside

        backward(model, scaler)
        opt.step()
        prepared_sched.step()
        opt.zero_grad()
        assert opt.step_was_skipped is False
        assert not same(start, params_of(model))
        assert prepared_sched.last_epoch == 1 and inner.param_groups[0]["lr"] == pytest.approx(0.05)
    leaked = [str(w.message) for w in caught if "optimizer.step()" in str(w.message)]
    assert leaked == []


@pytest.mark.parametrize("kind", ["sgd", "scaling_aware"])
def test_update_through_scaler_matches_plain_update(kind):
    model_a, inner_a = make(kind)
    model_b, inner_b = make(kind)
    opt_a = PreparedOptimizer(inner_a, scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    opt_b = PreparedOptimizer(inner_b)
    backward(model_a, opt_a.scaler)
    backward(model_b)
    opt_a.step()
    opt_b.step()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b)


def test_user_unscale_of_the_wrapper_is_not_applied_twice():
    model_a, inner_a = make("sgd")
    model_b, inner_b = make("sgd")
    scaler_a = torch.amp.GradScaler("cpu", init_scale=256.0)
    opt_a = PreparedOptimizer(inner_a, scaler=scaler_a)
    opt_b = PreparedOptimizer(inner_b)
    backward(model_a, scaler_a)
    backward(model_b)
    scaler_a.unscale_(opt_a)  # what users write before clipping
    torch.testing.assert_close(model_a.weight.grad, model_b.weight.grad)
    opt_a.step()
    opt_b.step()
    assert opt_a.step_was_skipped is False
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b)


def test_user_unscale_sees_the_inf():
    model, inner = make("sgd")
    scaler = torch.amp.GradScaler("cpu")
    opt = PreparedOptimizer(inner, scaler=scaler)
    start = params_of(model)
    backward(model, scaler, inf=True)
    scaler.unscale_(opt)
    opt.step()
    assert opt.step_was_skipped and same(start, params_of(model))


def test_without_scaler_nothing_is_skipped():
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner)
    backward(model, inf=True)
    opt.step()
    assert opt.step_was_skipped is False
    disabled = PreparedOptimizer(make("sgd")[1], scaler=torch.amp.GradScaler("cpu", enabled=False))
    disabled.step()
    assert disabled.step_was_skipped is False


def test_step_was_skipped_is_kept_across_non_sync_micro_batches():
    model, inner = make("sgd")
    scaler = torch.amp.GradScaler("cpu")
    state = GradientState(num_steps=2)
    opt = PreparedOptimizer(inner, scaler=scaler, gradient_state=state)
    state.begin_micro_batch()
    backward(model, scaler)
    state.begin_micro_batch()
    backward(model, scaler, inf=True)
    opt.step()
    assert opt.step_was_skipped
    state.begin_micro_batch()
    opt.step()  # no-op: the record of the last real step stays
    assert opt.step_was_skipped


# -- state ---------------------------------------------------------------------------------------
def train_steps(model, opt, n: int, seed: int = 5) -> None:
    for i in range(n):
        backward(model, seed=seed + i)
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_resumes_identically():
    model, inner = make("adamw")
    opt = PreparedOptimizer(inner)
    train_steps(model, opt, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    assert saved_opt["param_groups"] == inner.state_dict()["param_groups"]
    train_steps(model, opt, 2, seed=50)

    model2, inner2 = make("adamw", seed=9)
    model2.load_state_dict(saved_model)
    opt2 = PreparedOptimizer(inner2)
    opt2.load_state_dict(saved_opt)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        torch.testing.assert_close(inner2.state[model2.weight][key], saved_opt["state"][0][key])
    train_steps(model2, opt2, 2, seed=50)
    for a, b in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(a, b)


def test_state_dict_hooks_run():
    model, inner = make("sgd")
    opt = PreparedOptimizer(inner)
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "marker": 1})
    loaded = []
    opt.register_load_state_dict_post_hook(lambda o: loaded.append(o is opt))
    sd = opt.state_dict()
    assert sd["marker"] == 1
    sd.pop("marker")
    opt.load_state_dict(sd)
    assert loaded == [True]


def test_device_placement_moves_state_but_keeps_step_where_torch_wants_it():
    model, inner = make("adamw")
    train_steps(model, PreparedOptimizer(inner), 1)
    opt = PreparedOptimizer(inner, device="meta")
    state = inner.state[model.weight]
    assert state["exp_avg"].device.type == "meta" and state["exp_avg_sq"].device.type == "meta"
    assert state["step"].device.type == "cpu"  # non-capturable, non-fused: step stays on the host
    model2, inner2 = make("adamw")
    train_steps(model2, PreparedOptimizer(inner2), 1)
    opt.load_state_dict(inner2.state_dict())
    assert inner.state[model.weight]["exp_avg"].device.type == "meta"
    kept, inner3 = make("adamw")
    train_steps(kept, PreparedOptimizer(inner3), 1)
    PreparedOptimizer(inner3, device="meta", device_placement=False)
    assert inner3.state[kept.weight]["exp_avg"].device.type == "cpu"


def test_pickle_round_trip():
    model, inner = make("adamw")
    state = GradientState(num_steps=2)
    opt = PreparedOptimizer(inner, scaler=torch.amp.GradScaler("cpu", init_scale=8.0), gradient_state=state)
    opt.register_step_pre_hook(lambda o, a, k: None)  # a lambda: dropped, as torch does
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # patches opt.step: must not break pickling
    state.begin_micro_batch()
    copy_ = pickle.loads(pickle.dumps(opt))
    assert isinstance(copy_, PreparedOptimizer)
    assert copy_.gradient_state.num_steps == 2 and copy_.gradient_state.sync_gradients is False
    assert copy_.param_groups[0]["lr"] == inner.param_groups[0]["lr"]
    assert copy_.scaler.get_scale() == 8.0
    assert len(copy_._optimizer_step_pre_hooks) == 0
    p = copy_.param_groups[0]["params"][0]
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    copy_.gradient_state.begin_micro_batch()
    copy_.scaler.scale(torch.ones(()))  # starts an iteration for the scaler
    copy_.step()
    assert not torch.equal(before, p)
