"""Dispatch's fault tests under load (issue 40): a process dies -- process 0 or another, at the
first, a middle or the last step of the first pass, with or without DataLoader workers, rows
through shared memory or through the process group -- while a CPU-bound process per core runs
beside the gloo ranks. Every survivor fails with a ``DispatchError`` naming the dead process
within seconds; a hang is reported by ``run_gloo`` with the stack of every process still running.

The cases cover every pair of those settings (6 runs, not the 24 of every combination), each
bounded by ``run_gloo``'s timeout; the ranks are forks of the fork server (where the hang was
first seen, 1 run in 6 under load), started in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from _dist import run_gloo, worker_context
from torch.utils.data import DataLoader

import shardplug
from shardplug import prepare_data_loader

STEPS = 12  # steps per pass: one row per process and step
AT = {"first": 0, "middle": STEPS // 2, "last": STEPS - 1}
LIGHT = ["torch", "shardplug"]  # what the workers' fork server imports: all a list of tensors needs


def _dies_under_load(rank: int, world: int, victim: int, at: int, workers: int, shared_memory: bool) -> dict:
    """Two passes of a dispatching loader; ``victim`` kills itself (SIGKILL) at step ``at`` of the first.

    A death at the last step leaves the first pass complete everywhere: the survivors fail in the second."""
    shardplug.DataLoaderDispatcher.shared_memory = shared_memory
    data = [torch.tensor([float(i)]) for i in range(STEPS * world)]
    loader = prepare_data_loader(
        DataLoader(data, batch_size=1, num_workers=workers, multiprocessing_context=worker_context(workers, LIGHT)),
        put_on_device=True,
        dispatch_batches=True,
    )
    since = time.monotonic()  # the death, as this process sees it: when it reached the victim's step
    try:
        for epoch in range(2):
            for step, _ in enumerate(loader):
                if epoch == 0 and step == at:
                    since = time.monotonic()
                    if rank == victim:
                        os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - since}
    return {"error": None, "seconds": time.monotonic() - since}


@pytest.fixture(scope="module")
def load() -> Iterator[None]:
    """A CPU-bound process per core, for the module's tests; killed afterwards."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


# (who dies, at which step, workers, shared memory): every pair of settings appears once at least.
# "last": the last process (of 3 without workers, of 2 with: process 0's fork server for its workers
# costs seconds under load, a third process more).
CASES = [
    (0, "first", 0, True),
    (0, "middle", 2, False),
    (0, "last", 0, False),
    ("last", "first", 2, False),
    ("last", "middle", 0, True),
    ("last", "last", 2, True),
]


@pytest.mark.parametrize(
    ("victim", "at", "workers", "shared_memory"),
    CASES,
    ids=[f"process{v}-{at}-{w}workers-{'shm' if m else 'group'}" for v, at, w, m in CASES],
)
def test_a_death_under_load_fails_every_survivor_within_seconds(load, victim, at, workers, shared_memory):
    world = 2 if workers else 3
    victim = world - 1 if victim == "last" else victim
    results = run_gloo(
        _dies_under_load,
        victim,
        AT[at],
        workers,
        shared_memory,
        world_size=world,
        timeout=60,
        allow_deaths=True,
    )
    assert results[victim] is None, f"process {victim} did not die"
    for rank, survivor in enumerate(results):
        if rank == victim:
            continue
        assert survivor["error"] is not None, f"process {rank} finished both passes after process {victim} died"
        assert survivor["error"].startswith("DispatchError"), survivor
        assert f"process {victim}" in survivor["error"], survivor
        assert survivor["seconds"] < 15, survivor  # the process group's timeout is 30 s
