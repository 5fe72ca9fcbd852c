"""No host sync in an optimizer step: a fused step's skip flag is read only when someone needs it
(``step_was_skipped``, ``steps_taken``, a prepared scheduler's decision before the next update uses the
learning rate), and skip accounting stays exact.

On the CPU the flag is on the host and is read at once (nothing deferred: the wrapped optimizer and
scheduler read as torch's do, the last tests here). The lazy path a CUDA flag takes is run on the CPU by
adding ``"cpu"`` to ``amp.DEFERRED_DEVICE_TYPES`` (the ``lazy`` fixture); tests/gpu/ runs it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from shardplug.core.stepping import amp
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler

INF_AT = (2, 5, 6, 11)  # the steps whose gradients hold an inf
STEPS = 14
KINDS = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


@pytest.fixture
def lazy(monkeypatch):
    """A CPU flag read lazily, as a CUDA flag is (the deferral's logic, checked on the CPU)."""
    monkeypatch.setattr(amp, "DEFERRED_DEVICE_TYPES", ("cuda", "cpu"))


def _run(kind: str, inf_at=INF_AT, steps=STEPS, read_between=False):
    """Train a tiny model with a GradScaler; return the lr each real update used, the prepared objects."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, **KINDS[kind])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (e + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    prepared = PreparedOptimizer(opt, scaler=scaler)
    prepared_sched = PreparedScheduler(sched, prepared, num_processes=1)
    used: list[float] = []  # the lr at each call of the wrapped step (a pre-hook registered after shardplug's)
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    updates: list[float] = []
    for i in range(steps):
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        if i in inf_at:
            model.weight.grad[0, 0] = float("inf")
        before = model.weight.detach().clone()
        prepared.step()
        prepared_sched.step()
        if read_between:
            assert prepared.step_was_skipped == (i in inf_at)
        prepared.zero_grad()
        if not torch.equal(before, model.weight.detach()):
            updates.append(used[-1])
    return updates, prepared, prepared_sched


def test_a_fused_step_reads_no_flag_until_asked(lazy):
    _, prepared, sched = _run("fused", steps=3, inf_at=(2,))
    counter = amp.step_counter(prepared.optimizer)
    assert counter.unread == 1 and sched.pending  # the last step's flag: still a tensor, nobody waited
    assert prepared.step_was_skipped is True  # read now
    assert counter.unread == 0 and sched.pending  # read once; the scheduler's decision is still to take
    assert sched.last_epoch == 2 and not sched.pending  # reading the scheduler settles its decision
    assert prepared.steps_taken == 2


def test_the_next_step_settles_the_decision_before_it_uses_the_lr(lazy):
    _, prepared, sched = _run("fused", steps=2, inf_at=())
    opt = prepared.optimizer
    assert sched.pending and sched.scheduler.last_epoch == 1  # one decision waits (not read through sched)
    assert opt.param_groups[0]["lr"] == 0.5  # the raw optimizer's lr is still that of the last update
    assert prepared.param_groups[0]["lr"] == pytest.approx(1 / 3)  # read through the prepared one: settled
    assert not sched.pending


def test_a_checkpoint_of_the_optimizer_saves_the_settled_lr(lazy):
    _, prepared, sched = _run("fused", steps=2, inf_at=())
    assert sched.pending
    saved = prepared.optimizer.state_dict()  # the wrapped optimizer's own (what Lightning saves)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1 / 3) and not sched.pending


def test_unread_outcomes_are_bounded(lazy):
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    counter = amp.step_counter(opt)
    for _ in range(amp.MAX_UNREAD + 5):
        scaler.scale(param.sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert counter.unread == amp.MAX_UNREAD  # the oldest were read, one by one
    assert counter.taken == amp.MAX_UNREAD + 5 and counter.unread == 0


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("read_between", [False, True])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_update_uses_the_lr_of_an_exact_skip_aware_schedule(kind, read_between, deferred, monkeypatch):
    if deferred:
        monkeypatch.setattr(amp, "DEFERRED_DEVICE_TYPES", ("cuda", "cpu"))
    updates, prepared, sched = _run(kind, read_between=read_between)
    real = STEPS - len(INF_AT)
    assert updates == pytest.approx([1.0 / (k + 1) for k in range(real)])  # skips never advance the schedule
    assert prepared.steps_taken == real
    assert sched.last_epoch == real


def test_outcome_of_a_cpu_flag_is_read_at_once():
    assert amp.StepOutcome.of_flag(torch.zeros(())).skipped is False
    outcome = amp.StepOutcome.of_flag(torch.ones(()))
    assert outcome.settled and outcome.skipped


def test_outcome_read_lazily_is_the_flag(lazy):
    assert amp.StepOutcome.of_flag(torch.zeros(())).skipped is False
    outcome = amp.StepOutcome.of_flag(torch.ones(()))
    assert not outcome.settled and outcome.skipped and outcome.settled


# -- where the flag lives on the CPU, nothing is deferred: the wrapped objects read as torch's do ---------------
def _cpu_fused_run(steps, inf_at=(), raise_at=()):
    """A fused AdamW with a CPU GradScaler and a StepLR(gamma=0.5), driven as torch's docs do; after each
    ``scheduler.step()`` the *wrapped* optimizer's lr and the *wrapped* scheduler's ``last_epoch`` are read."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1000)
    prepared = PreparedOptimizer(opt, scaler=scaler)
    prepared_sched = PreparedScheduler(sched, prepared, num_processes=1)
    read = []
    for i in range(steps):
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        if i in inf_at:
            model.weight.grad[0, 0] = float("inf")
        try:
            if i in raise_at:
                raise RuntimeError("between backward and step()")
            prepared.step()
            prepared_sched.step()
        except RuntimeError:
            pass
        read.append((sched.last_epoch, opt.param_groups[0]["lr"]))
        prepared.zero_grad()
    return read, prepared


def _expected(steps, skipped):
    """What torch's own objects read after each iteration: one StepLR step per real update."""
    real = [sum(j not in skipped for j in range(i + 1)) for i in range(steps)]
    return [(n, pytest.approx(0.1 * 0.5**n)) for n in real]


def test_with_a_cpu_flag_the_wrapped_optimizer_reads_the_new_lr_right_after_scheduler_step():
    read, prepared = _cpu_fused_run(1)
    assert read == _expected(1, ())  # lr 0.05 after the first real step (not the previous 0.1)
    assert amp.step_counter(prepared.optimizer).unread == 0


def test_with_a_cpu_flag_overflows_at_steps_1_and_3_read_as_torch():
    read, prepared = _cpu_fused_run(4, inf_at=(0, 2))  # steps 1 and 3 of 4 overflow
    assert [epoch for epoch, _ in read] == [epoch for epoch, _ in _expected(4, (0, 2))]  # 0, 1, 1, 2
    assert read == _expected(4, (0, 2))
    assert prepared.steps_taken == 2


def test_with_a_cpu_flag_an_exception_before_step_leaves_later_reads_right():
    read, _ = _cpu_fused_run(4, raise_at=(1,))
    assert read == _expected(4, (1,))
