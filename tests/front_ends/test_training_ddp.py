"""TrainingRun: the plain-PyTorch front door, in one process and on a real 2-process DDP job."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from _dist import run_gloo, run_torchrun
from torch.utils.data import DataLoader, TensorDataset

from shardplug.core.config import ShardplugConfig
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler
from shardplug.core.stepping.training import TrainingRun


def expected_pattern(n: int, k: int) -> list[bool]:
    flags, count = [], 0
    for i in range(n):
        count += 1
        flags.append(count == k or i == n - 1)
        if flags[-1]:
            count = 0
    return flags


def single_run(k: int = 1, scaler=None) -> TrainingRun:
    return TrainingRun(ShardplugConfig(gradient_accumulation_steps=k), scaler=scaler, num_processes=1, process_index=0)


# -- one process ---------------------------------------------------------------------------------
def test_run_owns_its_gradient_state():
    run_a, run_b = single_run(2), single_run(2)
    assert isinstance(run_a.gradient_state, GradientState) and run_a.gradient_state is not run_b.gradient_state
    with run_a.accumulate() as sync:
        assert sync is False and run_a.sync_gradients is False
        assert run_b.sync_gradients is True
    assert run_a.gradient_accumulation_steps == 2 and "gradient_accumulation_steps=2" in repr(run_a)


def test_rejects_a_config_of_the_wrong_type():
    with pytest.raises(TypeError, match="ShardplugConfig"):
        TrainingRun({"split_batches": True})  # type: ignore[arg-type]


def test_no_sync_is_entered_only_on_non_sync_micro_batches():
    class DDPLike(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 1)
            self.entered = []

        @contextlib.contextmanager
        def no_sync(self):
            self.entered.append(True)
            yield

    run = single_run(3)
    model, plain = DDPLike(), torch.nn.Linear(2, 1)
    flags = []
    for i in range(5):
        with run.accumulate(model, plain, force_sync=(i == 4)) as sync:
            flags.append(sync)
    assert flags == [False, False, True, False, True]
    assert len(model.entered) == flags.count(False)


def test_backward_averages_over_the_cycle():
    k = 4
    run = single_run(k)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    reference = copy.deepcopy(model)
    x = torch.randn(k * 2, 3)
    for chunk in x.chunk(k):
        with run.accumulate(model):
            run.backward(model(chunk).pow(2).mean())
    reference(x).pow(2).mean().backward()
    torch.testing.assert_close(model.weight.grad, reference.weight.grad)


def test_clip_grad_norm_unscales_once_and_only_on_sync():
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    run, plain_run = single_run(2, scaler), single_run(2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    plain = copy.deepcopy(model)
    opt = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    plain_opt = plain_run.prepare_optimizer(torch.optim.SGD(plain.parameters(), lr=0.5))
    norms = []
    for x in torch.randn(4, 2, 3):
        for r, m, o, out in ((run, model, opt, norms), (plain_run, plain, plain_opt, [])):
            with r.accumulate(m):
                r.backward(m(x).pow(2).sum())
                out.append(r.clip_grad_norm_(m.parameters(), max_norm=0.1))
                o.step()
                o.zero_grad()
    assert norms[0] is None and norms[2] is None and norms[1] is not None and norms[3] is not None
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b)


def test_clip_grad_norm_unscales_only_the_owning_optimizer():
    from torch.amp.grad_scaler import OptState

    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    run = single_run(1, scaler)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a = run.prepare_optimizer(torch.optim.SGD(a.parameters(), lr=0.1))
    opt_b = run.prepare_optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
    with run.accumulate(a, b):
        run.backward(a(torch.ones(1, 2)).sum() + b(torch.ones(1, 2)).sum())
        grad_b = b.weight.grad.clone()
        run.clip_grad_norm_(a.parameters(), max_norm=100.0)
        states = scaler._per_optimizer_states
        assert states[id(opt_a.optimizer)]["stage"] is OptState.UNSCALED
        assert states[id(opt_b.optimizer)]["stage"] is OptState.READY
        torch.testing.assert_close(b.weight.grad, grad_b)
        opt_a.step()
        opt_b.step()
    assert not opt_a.step_was_skipped and not opt_b.step_was_skipped


def test_prepare_scheduler_follows_its_own_optimizer():
    run = TrainingRun(ShardplugConfig(split_batches=False), num_processes=3, process_index=0)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a = run.prepare_optimizer(torch.optim.SGD(a.parameters(), lr=1.0))
    opt_b = run.prepare_optimizer(torch.optim.SGD(b.parameters(), lr=1.0))
    sched = run.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt_b.optimizer, step_size=1))
    assert isinstance(sched, PreparedScheduler) and sched.optimizers == [opt_b]
    assert sched.num_processes == 3 and sched.steps_per_optimizer_step == 3
    assert isinstance(opt_a, PreparedOptimizer) and run.optimizers == [opt_a, opt_b]
    opt_b.step()
    sched.step()
    assert sched.last_epoch == 3
    once = TrainingRun(ShardplugConfig(scale_scheduler_by_num_processes=False), num_processes=3, process_index=0)
    o = once.prepare_optimizer(torch.optim.SGD(a.parameters(), lr=1.0))
    assert once.prepare_scheduler(torch.optim.lr_scheduler.StepLR(o, step_size=1)).steps_per_optimizer_step == 1


def test_prepared_loader_drives_the_cycle_in_one_process():
    pytest.importorskip("shardplug.core.planner")
    run = single_run(2)
    loader = run.prepare_data_loader(DataLoader(torch.arange(10.0), batch_size=2))
    assert loader.gradient_state is run.gradient_state
    model = torch.nn.Linear(2, 1)
    opt = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    steps = []
    for batch in loader:
        with run.accumulate(model):
            before = model.weight.detach().clone()
            run.backward(model(batch.view(1, 2)).sum())
            opt.step()
            opt.zero_grad()
            steps.append(not torch.equal(before, model.weight))
    assert steps == expected_pattern(5, 2)  # 5 batches, k=2: the last one steps


# -- two processes: DistributedDataParallel over gloo --------------------------------------------
def ddp_accumulation(rank: int, world: int, scenarios: list[tuple[int, int, bool]]) -> list[dict]:
    """Train on DDP with accumulation and compare with one large-batch step per cycle."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    b = 2
    reports = []
    for k, per_rank, nested_eval in scenarios:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        reference, initial = copy.deepcopy(model), copy.deepcopy(model)
        gen = torch.Generator().manual_seed(123)
        n = per_rank * world * b
        x_all, y_all = torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen)

        ddp = DDP(model)
        calls: list[int] = []

        def counting_hook(state, bucket):
            calls.append(1)  # noqa: B023 (called within this iteration)
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, counting_hook)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        run = TrainingRun(ShardplugConfig(gradient_accumulation_steps=k), scaler=scaler)
        assert (run.num_processes, run.process_index) == (world, rank)
        loader = run.prepare_data_loader(DataLoader(TensorDataset(x_all, y_all), batch_size=b))
        eval_loader = run.prepare_data_loader(DataLoader(TensorDataset(x_all), batch_size=b))
        opt = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        sched = run.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.9))
        log = []
        for x, y in loader:
            with run.accumulate(ddp) as sync:
                before = len(calls)
                run.backward(F.mse_loss(ddp(x), y))
                reduced = len(calls) - before
                if nested_eval:
                    with torch.no_grad():
                        for (xe,) in eval_loader:
                            model(xe)
                    assert run.sync_gradients == sync
                opt.step()
                sched.step()
                opt.zero_grad()
                log.append((sync, reduced, opt.step_was_skipped))

        # the same training as large-batch steps on one model: rank r had global batches r, r+world, ...
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.9)
        for start in range(0, per_rank, k):
            ref_opt.zero_grad()
            for j in range(start, min(start + k, per_rank)):
                for r in range(world):
                    rows = slice((j * world + r) * b, (j * world + r + 1) * b)
                    (F.mse_loss(reference(x_all[rows]), y_all[rows]) / (k * world)).backward()
            ref_opt.step()
            for _ in range(world):
                ref_sched.step()
        diff = max((a - c).abs().max().item() for a, c in zip(model.parameters(), reference.parameters()))
        moved = max((a - c).abs().max().item() for a, c in zip(model.parameters(), initial.parameters()))
        reports.append(
            {
                "log": log,
                "diff": diff,
                "last_epoch": sched.last_epoch,
                "ref_last_epoch": ref_sched.last_epoch,
                "moved": moved,
                "in_dataloader": run.gradient_state.in_dataloader,
            }
        )
    return reports


def test_ddp_accumulation_equals_large_batch_steps_and_skips_all_reduce():
    scenarios = [(3, 6, False), (2, 3, True)]  # (k, batches per rank, nested eval loop)
    per_rank_reports = run_gloo(ddp_accumulation, scenarios, world_size=2, timeout=60.0)
    for reports in per_rank_reports:
        for (k, per_rank, _), report in zip(scenarios, reports):
            log = report["log"]
            assert [sync for sync, _, _ in log] == expected_pattern(per_rank, k)
            for sync, reduced, skipped in log:
                assert not skipped
                assert (reduced > 0) if sync else (reduced == 0)  # no all-reduce while accumulating
            assert report["last_epoch"] == report["ref_last_epoch"] == 2 * expected_pattern(per_rank, k).count(True)
            assert report["moved"] > 1e-3  # it did train
            assert report["diff"] < 1e-5, report["diff"]
            assert not report["in_dataloader"]


def test_example_runs_under_torchrun():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = run_torchrun(root / "examples" / "train_accumulation.py", "--epochs", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2, done.stderr[-3000:]
    losses = [float(line.split("mean loss ")[1].split(",")[0]) for line in lines]
    assert losses[1] < losses[0]
