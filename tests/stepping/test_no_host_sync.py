"""No host sync in an optimizer step: a fused step's skip flag is read only when someone needs it
(``step_was_skipped``, ``steps_taken``, a prepared scheduler's decision before the next update uses the
learning rate), and skip accounting stays exact.

On the CPU a fused AdamW with a CPU ``GradScaler`` takes the same path as on a GPU (the flag is an
unread tensor until needed); tests/gpu/ counts the host syncs on CUDA with ``torch.cuda.set_sync_debug_mode``.
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


def test_a_fused_step_reads_no_flag_until_asked():
    _, prepared, sched = _run("fused", steps=3, inf_at=(2,))
    counter = amp.step_counter(prepared.optimizer)
    assert counter.unread == 1 and sched.pending  # the last step's flag: still a tensor, nobody waited
    assert prepared.step_was_skipped is True  # read now
    assert counter.unread == 0 and sched.pending  # read once; the scheduler's decision is still to take
    assert sched.last_epoch == 2 and not sched.pending  # reading the scheduler settles its decision
    assert prepared.steps_taken == 2


def test_the_next_step_settles_the_decision_before_it_uses_the_lr():
    _, prepared, sched = _run("fused", steps=2, inf_at=())
    opt = prepared.optimizer
    assert sched.pending and sched.scheduler.last_epoch == 1  # one decision waits (not read through sched)
    assert opt.param_groups[0]["lr"] == 0.5  # the raw optimizer's lr is still that of the last update
    assert prepared.param_groups[0]["lr"] == pytest.approx(1 / 3)  # read through the prepared one: settled
    assert not sched.pending


def test_a_checkpoint_of_the_optimizer_saves_the_settled_lr():
    _, prepared, sched = _run("fused", steps=2, inf_at=())
    assert sched.pending
    saved = prepared.optimizer.state_dict()  # the wrapped optimizer's own (what Lightning saves)
    assert saved["param_groups"][0]["lr"] == pytest.approx(1 / 3) and not sched.pending


def test_unread_outcomes_are_bounded():
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


@pytest.mark.parametrize("read_between", [False, True])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_update_uses_the_lr_of_an_exact_skip_aware_schedule(kind, read_between):
    updates, prepared, sched = _run(kind, read_between=read_between)
    real = STEPS - len(INF_AT)
    assert updates == pytest.approx([1.0 / (k + 1) for k in range(real)])  # skips never advance the schedule
    assert prepared.steps_taken == real
    assert sched.last_epoch == real


def test_outcome_read_on_cpu_is_the_flag():
    assert amp.StepOutcome.of_flag(torch.zeros(())).skipped is False
    outcome = amp.StepOutcome.of_flag(torch.ones(()))
    assert not outcome.settled and outcome.skipped and outcome.settled
