"""Dispatch mode on real gloo processes: the death of process 0 fails the others, never a hang."""

from __future__ import annotations

import os
import signal
import time

import torch
from _datasets import Line
from _dist import run_gloo
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

BATCH = 4  # as the fault tests of a resumed training run (tests/resume/test_faults.py)


def _dispatch_until_one_dies(rank: int, world: int, victim: int, dataset: object) -> dict:
    """Iterate a dispatching loader; process ``victim`` kills itself (SIGKILL) at its third step."""
    loader = prepare_data_loader(
        DataLoader(dataset, batch_size=BATCH if victim == 0 else 1), put_on_device=True, dispatch_batches=True
    )
    start = time.monotonic()
    try:
        for step, _ in enumerate(loader):
            if rank == victim and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:  # what the surviving processes see
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _dispatch_then_die(rank: int, world: int) -> dict:
    return _dispatch_until_one_dies(rank, world, 0, Line())


def test_dispatch_death_of_process_0_fails_the_others_instead_of_hanging():
    results = run_gloo(_dispatch_then_die, world_size=2, timeout=90, allow_deaths=True)
    assert results[0] is None
    survivor = results[1]
    assert survivor["error"] is not None, "process 1 finished an epoch whose data source died"
    assert survivor["seconds"] < 60, survivor
    assert "process 0" in survivor["error"], survivor


def _dispatch_while_another_dies(rank: int, world: int) -> dict:
    data = [torch.tensor([float(i)]) for i in range(40 * world)]  # 40 steps of one row per process
    return _dispatch_until_one_dies(rank, world, world - 1, data)


def test_dispatch_death_of_another_process_fails_every_survivor_within_seconds():
    results = run_gloo(_dispatch_while_another_dies, world_size=3, timeout=90, allow_deaths=True)
    assert results[2] is None
    for rank in (0, 1):
        survivor = results[rank]
        assert survivor["error"] is not None, f"process {rank} finished an epoch after process 2 died"
        assert survivor["error"].startswith("DispatchError"), survivor
        assert survivor["seconds"] < 30, survivor


def _dispatch_while_another_dies_and_one_is_busy(rank: int, world: int) -> dict:
    """Process 2 dies at its second step while process 1 spends 3 s on its own second step."""
    data = [torch.tensor([float(i)]) for i in range(40 * world)]
    loader = prepare_data_loader(DataLoader(data, batch_size=1), put_on_device=True, dispatch_batches=True)
    start = time.monotonic()
    try:
        for step, _ in enumerate(loader):
            if rank == 2 and step == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 1 and step == 1:
                time.sleep(3.0)  # a long training step: the next message is announced, and fails, meanwhile
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def test_a_survivor_busy_when_another_process_dies_fails_within_seconds():
    """The interleaving of the hang of issue 40, forced. Process 0 runs two steps ahead, so it
    announces steps 2-4 while process 1 is busy; those broadcasts fail on process 0 (process 2 is
    gone), and gloo never delivers a failed broadcast to a receiver that posts its receive later:
    process 1 waited in the broadcast of step 2 and process 0 for process 1's receipt of step 2,
    each until the dispatch group's timeout (30 minutes), as long as they watched only the process
    they waited for. Process 0 now watches every process of its host that owes receipts, and tells
    the others which one ended."""
    results = run_gloo(_dispatch_while_another_dies_and_one_is_busy, world_size=3, timeout=60, allow_deaths=True)
    assert results[2] is None
    for rank in (0, 1):
        survivor = results[rank]
        assert survivor["error"] is not None, f"process {rank} finished an epoch after process 2 died"
        assert survivor["error"].startswith("DispatchError"), survivor
        assert "process 2 (pid" in survivor["error"] and "start the job again" in survivor["error"], survivor
        assert survivor["seconds"] < 3.0 + 10, survivor  # process 1's own 3 s step, then seconds at most


def _dispatch_with_a_slow_process(rank: int, world: int, shared_memory: bool) -> list[int]:
    """Process 1 spends 0.4 s on each step: process 0 waits for its receipts and the others for messages."""
    import shardplug

    shardplug.DataLoaderDispatcher.shared_memory = shared_memory
    data = [torch.tensor([float(i)]) for i in range(5 * world)]
    loader = prepare_data_loader(DataLoader(data, batch_size=1), put_on_device=True, dispatch_batches=True)
    seen = []
    for batch in loader:
        seen.append(int(batch.item()))
        if rank == 1:
            time.sleep(0.4)
    return seen


def test_a_slow_process_is_waited_for_not_taken_for_dead():
    """Waits longer than the liveness checks' 0.2 s, through shared memory and through the process group
    (where a gloo point-to-point wait that times out would close every connection of the group)."""
    for shared_memory in (True, False):
        seen = run_gloo(_dispatch_with_a_slow_process, shared_memory, world_size=3, timeout=60)
        assert sorted(sum(seen, [])) == list(range(15)), seen


def _dispatch_while_process_0_ends_first(rank: int, world: int, shared_memory: bool) -> list[int]:
    """Process 0 goes through its pass and ends (its process group destroyed, as a script that ends
    does) between the others' receiving the last step and their sending its receipt (forced: the
    receipt of the last step waits 1.5 s; the suite once met this interleaving by chance)."""
    import shardplug
    from shardplug.core.dispatch.receipts import Receipts as Wire

    shardplug.DataLoaderDispatcher.shared_memory = shared_memory
    data = [torch.tensor([float(i)]) for i in range(5 * world)]
    loader = prepare_data_loader(DataLoader(data, batch_size=1), put_on_device=True, dispatch_batches=True)
    send_receipt = Wire.send_receipt

    def late_last_receipt(wire: Wire, device: torch.device) -> None:
        if wire.steps_received == len(loader) - 1:
            time.sleep(1.5)  # process 0 ends its pass and leaves meanwhile
        send_receipt(wire, device)

    Wire.send_receipt = late_last_receipt  # type: ignore[method-assign]
    return [int(batch.item()) for batch in loader]


def test_process_0_that_ended_after_the_last_step_failed_nothing():
    """The others received the last step whole: their receipt of it can no longer reach process 0, and
    that is no failure (it was, through the process group: a DispatchError on every other process at the
    last step, whose batch was not handed out)."""
    for shared_memory in (True, False):
        seen = run_gloo(_dispatch_while_process_0_ends_first, shared_memory, world_size=3, timeout=60)
        assert sorted(sum(seen, [])) == list(range(15)), seen
        assert [len(part) for part in seen] == [5, 5, 5], seen


def _dispatch_group_timeout(rank: int, world: int) -> float:
    from shardplug.core._internal.compat import group_timeout

    loader = prepare_data_loader(DataLoader(range(8), batch_size=2), put_on_device=True, dispatch_batches=True)
    return loader._wire.timeout_s, group_timeout(loader._wire.group, "cpu").total_seconds()


def test_the_dispatch_group_gives_up_with_the_default_group_not_after_30_minutes():
    """``new_group()`` alone takes torch's default timeout (30 minutes), not init_process_group's (30 s here)."""
    assert run_gloo(_dispatch_group_timeout, world_size=2) == [(30.0, 30.0)] * 2


def _dispatch_then_stop(rank: int, world: int) -> dict:
    """A whole pass, a pass left early by an exception, and a pass outgrowing its ring."""
    data = [torch.full((4,), float(i)) for i in range(8 * world)]
    loader = prepare_data_loader(DataLoader(data, batch_size=2), put_on_device=True, dispatch_batches=True)
    rows = sum(batch.shape[0] for batch in loader)
    try:
        for step, _ in enumerate(loader):
            if step == 1:
                raise ValueError("stop")
    except ValueError:
        pass
    big = [torch.zeros(2**19) for _ in range(2 * world)]  # 4 MiB per process and step: a bigger ring
    grown = prepare_data_loader(DataLoader(big, batch_size=2), put_on_device=True, dispatch_batches=True)
    rows += sum(batch.shape[0] for batch in grown)
    return {"rows": rows, "shared": loader.dispatch_stats.bytes_shared + grown.dispatch_stats.bytes_shared}


def test_shared_memory_rings_leave_nothing_behind(tmp_path, monkeypatch):
    """Exits, exceptions and SIGKILL (of process 0, and of another process): no file is left."""
    monkeypatch.setenv("SHARDPLUG_SHM_DIR", str(tmp_path))
    results = run_gloo(_dispatch_then_stop, world_size=2, timeout=90)
    assert results[0]["shared"] > 0, "process 0 did not use shared memory on one host"
    assert results[1]["rows"] == 8 + 2  # its half of 16 samples, then of 4
    run_gloo(_dispatch_then_die, world_size=2, timeout=90, allow_deaths=True)
    run_gloo(_dispatch_while_another_dies, world_size=3, timeout=90, allow_deaths=True)
    assert sorted(os.listdir(tmp_path)) == []


def test_shared_memory_can_be_switched_off_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLUG_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("SHARDPLUG_DISPATCH_SHM", "0")
    results = run_gloo(_dispatch_then_stop, world_size=2, timeout=90)
    assert results[0]["shared"] == 0  # every row through the process group
    assert results[1]["rows"] == 8 + 2
