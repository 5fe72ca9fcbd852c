"""Fault tests on real gloo process groups: processes are SIGKILLed mid-epoch.

A 2-process DDP training run checkpoints mid-epoch and is killed; it restarts from the checkpoint
with 2 and with 3 processes, and the audit shows every sample of the epoch exactly once (padding
apart).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _datasets import Line
from _dist import run_gloo
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

SAMPLES, BATCH, KILL_AFTER = Line.samples, 4, 3


def _train(rank: int, world: int, ckpt: str, resume: bool) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = prepare_data_loader(DataLoader(Line(), batch_size=BATCH, shuffle=True))
    audit = loader.enable_audit()
    path = Path(ckpt, "checkpoint.pt")
    if resume:
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        if rank == 0:  # the interrupted run's record, already summed over its processes
            audit.load_state_dict(state["audit"])
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if not resume and step + 1 == KILL_AFTER:
            gathered = audit.gathered()
            if rank == 0:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(),
                    "audit": gathered.state_dict(),
                }
                torch.save(state, path.with_suffix(".tmp"))
                os.replace(path.with_suffix(".tmp"), path)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    report = audit.gathered().report(0)
    return {
        "exact": report.exact,
        "seen": report.seen,
        "missing": report.missing,
        "duplicated": report.duplicated,
        "padding": report.padding,
        "epoch_after": loader.epoch,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fault"))
    results = run_gloo(_train, ckpt, False, world_size=2, timeout=120, allow_deaths=True)
    assert results == [None, None], "both processes were to be killed after the checkpoint"
    assert Path(ckpt, "checkpoint.pt").exists()
    return ckpt


@pytest.mark.parametrize("world", [2, 3])
def test_killed_run_resumes_exactly_with_2_and_3_processes(checkpoint, world):
    reports = run_gloo(_train, checkpoint, True, world_size=world, timeout=120)
    for report in reports:
        assert report["exact"], report
        assert report["seen"] == SAMPLES
    assert reports[0] == reports[-1], "the gathered audit is the same on every process"
