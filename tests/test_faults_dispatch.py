"""Dispatch mode on real gloo processes: the death of process 0 fails the others, never a hang."""

from __future__ import annotations

import os
import signal
import time

from torch.utils.data import DataLoader

from _dist import run_gloo
from shardplug import prepare_data_loader
from test_faults import BATCH, Line


def _dispatch_then_die(rank: int, world: int) -> dict:
    loader = prepare_data_loader(DataLoader(Line(), batch_size=BATCH), put_on_device=True, dispatch_batches=True)
    start = time.monotonic()
    try:
        for step, _ in enumerate(loader):
            if rank == 0 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:  # what the surviving process sees
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_dispatch_death_of_process_0_fails_the_others_instead_of_hanging():
    results = run_gloo(_dispatch_then_die, world_size=2, timeout=90, allow_deaths=True)
    assert results[0] is None
    survivor = results[1]
    assert survivor["error"] is not None, "process 1 finished an epoch whose data source died"
    assert survivor["seconds"] < 60, survivor
    assert "process 0" in survivor["error"], survivor
