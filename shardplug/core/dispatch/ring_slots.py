"""Process 0's shared-memory ring for each process of its host, and the slot each step's rows take in it.

A ring has :data:`RING_SLOTS` slots, taken in turn: the steps receipts may lag
(:data:`~shardplug.core.dispatch.receipts.RECEIPT_LAG`), the step being announced, and the one process 0 reads
(and collates into its slot) meanwhile. A ring a step outgrows is replaced by one twice as big; the table of
the rings is part of a step's header, so the others learn of it (:mod:`~shardplug.core.dispatch.wire_protocol`).

Example::

    >>> from shardplug.core.dispatch.liveness import Liveness
    >>> slots = RingSlots(Liveness(rank=0))
    >>> first = slots.next_slot(); slots.slot_taken()
    >>> first, slots.next_slot(), slots.slot_free(0)
    (0, 1, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardplug.core._internal.rows import OBJECT, leaf_spec
from shardplug.core.dispatch.liveness import Liveness
from shardplug.core.dispatch.receipts import RECEIPT_LAG
from shardplug.core.dispatch.shm import RingReader, SharedRing, ring_bytes
from shardplug.core.dispatch.wire_protocol import tensors

__all__ = ["RING_SLOTS", "RingSlots"]

RING_SLOTS = RECEIPT_LAG + 2
"""Slots of a shared-memory ring: the steps receipts may lag, the step being announced, and the
one process 0 reads (and collates into its slot) meanwhile."""

MIN_SLOT_BYTES = 1 << 20
"""Smallest slot of a shared-memory ring (rings double when a step outgrows them)."""


class RingSlots:
    """Process 0: a ring per process of its host (:attr:`targets`) and the step last announced in each slot;
    the others: process 0's ring for this process, mapped when a step names it."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness  # its receipt counters say which slots the processes of this host are done with
        self.targets: frozenset[int] = frozenset()  # the processes of process 0's host (shared memory)
        self.by_process: dict[int, SharedRing] = {}  # process 0: a ring per process of its host
        self.slot_steps = [-1] * RING_SLOTS  # process 0: the step last announced in each ring slot
        self.slots_taken = 0  # process 0: steps read, each given the next slot in turn
        self.reader: RingReader | None = None  # the others: process 0's ring for this process

    def next_slot(self) -> int:
        """Process 0: the ring slot the next step read takes (slots are taken in turn)."""
        return self.slots_taken % RING_SLOTS

    def slot_taken(self) -> None:
        """Process 0: a step was read into :meth:`next_slot`; the step after it takes the following slot."""
        self.slots_taken += 1

    def slot_free(self, slot: int) -> bool:
        """Process 0: whether every process of its host received the step last announced in ``slot``
        (nothing is waited for)."""
        step = self.slot_steps[slot]
        return all(counter.count > step for counter in self.liveness.counters.values())

    def ring_table(self, parts: list[list[Any]]) -> tuple[tuple[int, str, int, int], ...]:
        """Process 0: the ring of every process of its host, each big enough for its part of this step
        (a ring outgrown is replaced; the table is part of the header, so a change is announced)."""
        table = []
        for j in sorted(self.targets):
            need = ring_bytes([leaf_spec(leaf) for leaf in tensors(parts[j])])
            ring = self.by_process.get(j)
            if ring is None or not ring.fits(need):
                if ring is not None:
                    ring.close(remove=False)  # the others may still map it: they remove it
                size = max(need, 2 * ring.slot_bytes if ring is not None else 0, MIN_SLOT_BYTES)
                ring = self.by_process[j] = SharedRing(RING_SLOTS, size)
            table.append((j, ring.path, ring.slots, ring.slot_bytes))
        return tuple(table)

    def write_ring(self, j: int, rows: list[torch.Tensor], slot: int) -> tuple[int, int]:
        """Process 0: this step's rows for process ``j`` into ``slot`` of its ring (free: see
        :meth:`~shardplug.core.dispatch.receipts.Receipts.await_receipts`); rows collated there already stay
        where they are. Returns the bytes of the rows and the bytes copied."""
        total = sum(t.numel() * t.element_size() for t in rows)
        return total, self.by_process[j].write(slot, rows)

    def holds(self, leaf: Any) -> bool:
        """Process 0: whether ``leaf`` is a tensor in one of its rings."""
        return isinstance(leaf, torch.Tensor) and any(ring.holds(leaf) for ring in self.by_process.values())

    def read_ring(
        self, process_index: int, rings: tuple[Any, ...], specs: list[tuple[Any, Any]], slot: int
    ) -> list[torch.Tensor] | None:
        """The other processes: this step's tensors (of the leaf ``specs``) from ``slot`` of process 0's ring
        for this process, or ``None`` when they come through the process group."""
        entry = next((e for e in rings if e[0] == process_index), None)
        if entry is None:
            return None
        _, path, slots, slot_bytes = entry
        if self.reader is None or self.reader.path != path:
            if self.reader is not None:
                self.reader.close()
            self.reader = RingReader(path, slots, slot_bytes)
        return self.reader.read(slot, [spec for spec in specs if spec[0] != OBJECT])

    def close(self, before: Callable[[int], None]) -> None:
        """Remove the rings (``before(j)`` is called before process ``j``'s goes) and unmap process 0's ring."""
        for j, ring in list(self.by_process.items()):
            before(j)
            ring.close()
        self.by_process.clear()
        if self.reader is not None:
            self.reader.close()
            self.reader = None
