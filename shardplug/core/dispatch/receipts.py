"""The receipts of every dispatched step: process 0 keeps at most :data:`RECEIPT_LAG` steps ahead of the slowest.

Processes on other hosts send one per step through the process group (tagged
:data:`~shardplug.core.dispatch.wire_protocol.ACK_TAG`); those on process 0's host count theirs in shared memory
(:class:`~shardplug.core.dispatch.shm.ReceiptCounter`), and process 0 waits for them by spinning, then sleeping,
watching for a process that ended (:meth:`~shardplug.core.dispatch.liveness.Liveness.died`).

Example::

    >>> from shardplug.core.dispatch.liveness import Liveness
    >>> from shardplug.core.dispatch.timed_waits import TimedWaits
    >>> liveness = Liveness(rank=0)
    >>> receipts = Receipts(None, liveness, TimedWaits(liveness, watch=True, timeout_s=30.0))
    >>> receipts.await_receipts(last_in_slot=-1) is None  # no process owes one
    True
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardplug.core.dispatch.dispatch_plan import DispatchError
from shardplug.core.dispatch.liveness import Liveness
from shardplug.core.dispatch.timed_waits import WATCH_S, TimedWaits
from shardplug.core.dispatch.wire_protocol import ACK_TAG

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["RECEIPT_LAG", "Receipts"]

RECEIPT_LAG = 2
"""Steps process 0 may run ahead of the slowest receipt."""

SPIN_S = 2e-4
"""How long process 0 waits for a receipt in shared memory by yielding its core, before it sleeps."""


class Receipts:
    """The receipts of the steps on ``group``: process 0 expects and awaits them, the others send them (the
    counters in shared memory are the :class:`~shardplug.core.dispatch.liveness.Liveness`'s: a process that
    ended is posted there too)."""

    def __init__(self, group: ProcessGroup | None, liveness: Liveness, waits: TimedWaits) -> None:
        self.group = group
        self.liveness = liveness
        self.waits = waits
        self.acks: dict[int, list[Any]] = {}  # process 0: per process elsewhere, receipts of steps not yet seen
        self.ack_sends: list[Any] = []  # the other processes: receipts in flight
        self.steps_received = 0  # the other processes: step messages received (all passes)

    def expect_receipts(self, num_processes: int, device: torch.device) -> None:
        """Process 0: after a step went out, wait (later) for the receipt of it of every process on
        another host (those of its host count theirs in shared memory)."""
        for j in range(1, num_processes):
            if j in self.liveness.counters:
                continue
            receipt = torch.zeros(1, dtype=torch.int64, device=device)
            self.acks.setdefault(j, []).append(dist.irecv(receipt, src=j, group=self.group, tag=ACK_TAG))

    def await_receipts(self, last_in_slot: int) -> DispatchError | None:
        """Process 0: before the step taking a ring slot goes out (step ``t``), wait until every
        process received step ``t - RECEIPT_LAG``, and the processes of its host the step last
        announced in that slot (``last_in_slot``).

        It keeps process 0 at most that many steps ahead, and a process that died (or hangs) is
        noticed within a few steps: the others then get an error message instead of waiting. (The
        ring has ``RECEIPT_LAG + 2`` slots, and process 0 reads one step ahead: the slot is free by
        then, and so it is when the step was read into it.)
        Returns the ``DispatchError`` to raise everywhere, if any.
        """
        for j, works in self.acks.items():
            while len(works) > RECEIPT_LAG:
                try:
                    self.waits.wait_sent(works.pop(0), f"the receipt of process {j} (on another host)")
                except DispatchError as exc:
                    return exc
        needed = max(self.liveness.steps_sent - RECEIPT_LAG, last_in_slot + 1)
        for j in self.liveness.counters:
            failure = self.await_shared_receipts(j, needed)
            if failure is not None:
                return failure
        return None

    def await_shared_receipts(self, j: int, count: int, timeout_s: float | None = None) -> DispatchError | None:
        """Process 0: wait until process ``j`` of its host counted ``count`` steps received; the
        ``DispatchError`` to raise when a process of its host died meanwhile (``j`` or any other:
        ``j`` may be waiting for it) or ``j`` did not get there within ``timeout_s`` (the process
        group's timeout)."""
        counter = self.liveness.counters.get(j)
        if counter is None or counter.count >= count:
            return None
        limit = timeout_s if timeout_s is not None else self.waits.timeout_s
        what = f"the receipt of step {count - 1} of process {j}"
        start = checked = time.monotonic()
        pause = 0.0  # yield the core only, at first: a receipt is usually a few microseconds away
        while counter.count < count:
            time.sleep(pause)
            now = time.monotonic()
            if now - start < SPIN_S:
                continue
            pause = min(2 * pause or 5e-5, 1e-3)
            if pause >= 1e-3 and now - checked >= WATCH_S:
                checked = now
                failure = self.liveness.died(what)
                if failure is not None:
                    return failure
            if now - start > limit:
                return DispatchError(
                    f"process {j} received no dispatched batch for {limit:g} s: every process must iterate the loader"
                )
        return None

    def send_receipt(self, device: torch.device) -> None:
        """The other processes: tell process 0 that a step arrived (counted in shared memory on its host)."""
        self.steps_received += 1
        if self.liveness.counter is not None:
            self.liveness.counter.count = self.steps_received  # after the step's rows were copied out
            return
        while len(self.ack_sends) > RECEIPT_LAG:
            self.waits.wait_sent(self.ack_sends.pop(0), "process 0 to take this process's receipt")
        receipt = torch.ones(1, dtype=torch.int64, device=device)
        self.ack_sends.append(dist.isend(receipt, dst=0, group=self.group, tag=ACK_TAG))
