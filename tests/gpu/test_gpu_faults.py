"""GPU checks that fail when the faults of the prefetcher and the lazy skip flag are there (skipped without CUDA).

Each compares with what ``prefetch_depth=0`` (no look-ahead, the default) hands out, or with a count derived
from the run itself: sparse and nested leaves; a side-stream copy made slow on purpose (``torch.cuda._sleep``
queued on the side stream before the copy), with the step on the current stream and on the user's own stream
(the way docs/gpu.md says); a source that reuses one device buffer; the skip flag on a device other than the
current one (no CUDA context on GPU 0); host waits counted as ``torch.cuda.Event.synchronize`` calls (which
``set_sync_debug_mode`` does not see); two fused optimizers sharing one scaler; 200 unread steps; the device
memory of a typical loop over 100 batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from shardplug import prepare_data_loader
from shardplug.core.loader.prefetch import SideStreamCopy
from shardplug.core.stepping import amp
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check on one)")

CUDA = torch.device("cuda", 0)
ROOT = Path(__file__).parents[2]


def _loader(data, depth, **kwargs):
    return prepare_data_loader(
        DataLoader(data, batch_size=None, **kwargs),
        num_processes=1,
        process_index=0,
        put_on_device=True,
        device=CUDA,
        prefetch_depth=depth,
    )


@pytest.fixture
def slow_copy(monkeypatch):
    """Every side-stream copy queued behind a long sleep on the side stream: a missing wait reads too early."""
    original = SideStreamCopy.start

    def start(self, batch):
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(50_000_000)
        return original(self, batch)

    monkeypatch.setattr(SideStreamCopy, "start", start)


@pytest.fixture
def event_waits(monkeypatch):
    """Counts ``torch.cuda.Event.synchronize`` calls (host waits ``set_sync_debug_mode`` does not see)."""
    count = [0]
    original = torch.cuda.Event.synchronize

    def synchronize(self):
        count[0] += 1
        return original(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)
    return count


# -- sparse and nested leaves --------------------------------------------------------------------
def _sparse_and_nested(n=6):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nested's prototype warning
        for i in range(n):
            dense = torch.arange(12.0).reshape(3, 4) * (i + 1) * (torch.arange(12).reshape(3, 4) % 3 == 0)
            yield {
                "coo": dense.to_sparse(),
                "csr": dense.to_sparse_csr(),
                "nested": torch.nested.nested_tensor([torch.full((2,), float(i)), torch.full((3,), float(i))]),
                "jagged": torch.nested.nested_tensor(
                    [torch.full((2, 3), float(i)), torch.full((4, 3), float(i))], layout=torch.jagged
                ),
            }


def _host(batch):
    return {
        "coo": batch["coo"].to_dense().cpu().tolist(),
        "csr": batch["csr"].to_dense().cpu().tolist(),
        "nested": [t.cpu().tolist() for t in batch["nested"].unbind()],
        "jagged": [t.cpu().tolist() for t in batch["jagged"].unbind()],
    }


@pytest.mark.parametrize("depth", [1, 2])
def test_sparse_and_nested_leaves_equal_depth_0(depth, slow_copy):
    data = list(_sparse_and_nested())
    expected = [_host(b) for b in _loader(data, 0)]
    seen = []
    for batch in _loader(data, depth):
        assert batch["coo"].device == CUDA and batch["jagged"].device == CUDA
        seen.append(_host(batch))
    assert seen == expected


# -- a slow copy, the step on the current stream or on the user's ------------------------------------
def _numbered(n=12, numel=1 << 16):
    return [torch.full((numel,), float(i)) for i in range(n)]


@pytest.mark.parametrize("pin_memory", [False, True])
def test_a_slow_side_stream_copy_is_waited_for(slow_copy, pin_memory):
    data = _numbered()
    sums = [float(batch.sum()) for batch in _loader(data, 2, pin_memory=pin_memory)]
    assert sums == [float(t.sum()) for t in data]


def test_a_step_on_the_users_stream_waits_when_next_runs_on_it(slow_copy):
    """docs/gpu.md: put the whole loop inside ``with torch.cuda.stream(s):`` (``next()`` then runs on ``s``)."""
    data = _numbered()
    user = torch.cuda.Stream(CUDA)
    sums = []
    with torch.cuda.stream(user):
        for batch in _loader(data, 2):
            sums.append((batch * 1).sum())  # queued on the user's stream
    user.synchronize()
    assert [float(s) for s in sums] == [float(t.sum()) for t in data]


def test_a_step_on_the_users_stream_waits_with_wait_stream_and_record_stream(slow_copy):
    """docs/gpu.md's other way: ``s.wait_stream(current)`` and ``record_stream(s)`` after ``next()``."""
    data = _numbered()
    user = torch.cuda.Stream(CUDA)
    sums = []
    for batch in _loader(data, 2):
        user.wait_stream(torch.cuda.current_stream(CUDA))
        batch.record_stream(user)
        with torch.cuda.stream(user):
            sums.append((batch * 1).sum())
    user.synchronize()
    assert [float(s) for s in sums] == [float(t.sum()) for t in data]


class _DeviceBuffer(IterableDataset):
    """Yields one device tensor, refilled in place (on the current stream) with 0, 1, ..., n - 1."""

    def __init__(self, n=10):
        self.n = n

    def __iter__(self):
        buffer = torch.zeros(1 << 12, device=CUDA)
        for i in range(self.n):
            buffer.fill_(float(i))
            yield buffer


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_source_reusing_one_device_buffer_hands_out_what_depth_0_does(depth, slow_copy):
    expected = [float(b[0]) for b in _loader(_DeviceBuffer(), 0)]
    assert [float(b[0]) for b in _loader(_DeviceBuffer(), depth)] == expected


# -- memory held --------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_typical_loop_over_100_batches_holds_depth_plus_two(depth):
    numel = 1 << 18  # 1 MiB batches
    data = [torch.full((numel,), float(i)) for i in range(100)]
    loader = _loader(data, depth)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    total = 0.0
    for batch in loader:  # the loop's variable holds the previous batch while the next is read
        total += float(batch.sum())  # the step reads its batch (and waits for it, as a logged loss does)
    peak = torch.cuda.max_memory_allocated(CUDA) - base
    assert total == sum(float(t.sum()) for t in data)
    assert peak <= (depth + 2) * numel * 4 + (1 << 20), peak


# -- the skip flag ---------------------------------------------------------------------------------
def _fused_run(steps, inf_at, scheduler=True):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000)
    prepared = PreparedOptimizer(opt, scaler=scaler)
    sched = None
    if scheduler:
        sched = PreparedScheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9), prepared, num_processes=1)
    x = torch.ones(8, 64, device=CUDA)
    for i in range(steps):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().mean()
        scaler.scale(loss).backward()
        if i in inf_at:
            model.weight.grad.fill_(float("inf"))
        prepared.step()
        if sched is not None:
            sched.step()
        prepared.zero_grad()
    return prepared, sched


def test_host_waits_of_a_fused_step_with_a_prepared_scheduler_are_one_event_wait_per_step(event_waits):
    """docs/gpu.md: the next step's pre-hook reads the previous step's flag (one event wait per step after
    the first); set_sync_debug_mode would count none of these."""
    steps = 30
    prepared, sched = _fused_run(steps, inf_at=(4, 9))
    assert event_waits[0] == steps - 1
    assert prepared.steps_taken == steps - 2 and sched.last_epoch == steps - 2


def test_200_unread_steps_are_counted_exactly(event_waits):
    steps = 200
    prepared, _ = _fused_run(steps, inf_at=(10, 150), scheduler=False)
    assert event_waits[0] == steps - amp.MAX_UNREAD  # beyond MAX_UNREAD, the oldest is read, one by one
    assert prepared.steps_taken == steps - 2
    assert event_waits[0] == steps  # reading the count read the rest


def test_two_fused_optimizers_sharing_one_scaler_with_an_overflow_in_one():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8).to(CUDA), torch.nn.Linear(8, 8).to(CUDA)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=True)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000)
    prepared_a, prepared_b = PreparedOptimizer(opt_a, scaler=scaler), PreparedOptimizer(opt_b, scaler=scaler)
    x = torch.ones(4, 8, device=CUDA)
    for i in range(6):
        scaler.scale(a(x).sum() + b(x).sum()).backward()
        if i == 3:
            a.weight.grad.fill_(float("inf"))  # only a's gradients overflow
        prepared_a.step()
        prepared_b.step()
        assert prepared_a.step_was_skipped == (i == 3) and not prepared_b.step_was_skipped
        scaler.update()
        prepared_a.zero_grad()
        prepared_b.zero_grad()
    assert prepared_a.steps_taken == 5 and prepared_b.steps_taken == 6


_OTHER_DEVICE = textwrap.dedent(
    """
    import json, sys
    import torch
    from shardplug.core.stepping.optimizer import PreparedOptimizer

    device = torch.device("cuda", 1)  # not the current device (0): torch.cuda.set_device is never called
    model = torch.nn.Linear(64, 64).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=1000)
    prepared = PreparedOptimizer(opt, scaler=scaler)
    skipped = []
    for i in range(6):
        loss = model(torch.ones(8, 64, device=device)).mean()
        scaler.scale(loss).backward()
        if i in (1, 4):
            model.weight.grad.fill_(float("inf"))
        with torch.cuda.device(device):
            torch.cuda._sleep(50_000_000)  # the step's kernels (and its flag) on device 1 come late
        prepared.step()
        skipped.append(prepared.step_was_skipped)
        prepared.zero_grad()
    out = {"skipped": skipped, "taken": prepared.steps_taken, "context_on_0": torch._C._cuda_hasPrimaryContext(0)}
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: the flag on a device other than the current")
def test_a_flag_on_another_device_is_read_after_its_step_and_gpu_0_is_not_touched():
    path = f"{ROOT}{os.pathsep}{ROOT / 'integrations/lightning'}{os.pathsep}{ROOT / 'integrations/ignite'}"
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", _OTHER_DEVICE], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["skipped"] == [i in (1, 4) for i in range(6)]  # each flag read after its own step's kernels
    assert out["taken"] == 4
    assert out["context_on_0"] is False  # no CUDA context on a GPU this process was not given
