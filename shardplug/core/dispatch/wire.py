"""The transport under the step protocol: the dispatcher's process group, its shared-memory
rings, the receipts of every step and the liveness of the processes they come from.

Process 0 keeps at most :data:`RECEIPT_LAG` steps ahead of the slowest receipt: processes on
other hosts send one per step through the process group, those on process 0's host count theirs
in shared memory (:class:`~shardplug.core.dispatch.shm.ReceiptCounter`), and process 0 waits for
them by spinning, then sleeping.

Never a hang: every wait of a process for another one -- a receipt in shared memory, the message
of a step, a header, pickled leaves -- checks every :data:`WATCH_S` whether a process it cannot go
on without has ended (:meth:`Wire.lost`: process 0 watches the processes of its host that still
owe receipts, and writes the one that ended into every receipt counter; the others watch for that,
and for process 0's end; a zombie does not run), raises a :class:`DispatchError` naming it, and
gives up after the process group's timeout (that of the default group: processes on other hosts).
A process that ended after its last step failed nothing. Rows and receipts through the process
group (point-to-point) are waited for whole (:meth:`Wire.wait_sent`): each depends on one peer,
whose death closes the connection. Watching only the process waited for is not enough: with gloo,
a broadcast that fails on process 0 because one receiver died is never delivered to a receiver
that posts its receive afterwards, so a live process waits for a message that will not come, and
process 0 for that live process's receipt.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import all_gather_objects, broadcast_object, global_rank, world_size
from shardplug.core._internal.rows import OBJECT, leaf_spec
from shardplug.core.dispatch.dispatch_plan import DispatchError
from shardplug.core.dispatch.shm import ReceiptCounter, RingReader, SharedRing, ring_bytes, shared_memory_dir
from shardplug.core.dispatch.wire_protocol import ACK_TAG, tensors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ReceiptCounter", "process_alive"]

logger = logging.getLogger(__name__)

RECEIPT_LAG = 2
"""Steps process 0 may run ahead of the slowest receipt."""

RING_SLOTS = RECEIPT_LAG + 2
"""Slots of a shared-memory ring: the steps receipts may lag, the step being announced, and the
one process 0 reads (and collates into its slot) meanwhile."""

CLOSE_WAIT_S = 10.0
"""How long closing a dispatcher waits for the receipts still due before it removes its rings."""

MIN_SLOT_BYTES = 1 << 20
"""Smallest slot of a shared-memory ring (rings double when a step outgrows them)."""

SPIN_S = 2e-4
"""How long process 0 waits for a receipt in shared memory by yielding its core, before it sleeps."""

WATCH_S = 0.2
"""How often a process waiting for another one checks whether a process it needs has ended."""

_WATCH = timedelta(seconds=WATCH_S)

EXIT_S = 1.0
"""How long a process whose process group failed looks for a process of its host that ended (it
closes its connections a moment before it stops running)."""

RESTART = "dispatch cannot go on without it: stop every process and start the job again (from its last checkpoint)"
"""What to do when a process of the dispatch group is gone."""


def dispatch_group(device_type: str) -> Any:
    """The process group of a dispatcher's traffic (every process), with the default group's
    timeout: ``new_group`` would otherwise take torch's default (30 minutes), whatever the user
    passed to ``init_process_group``."""
    return dist.new_group(timeout=compat.group_timeout(dist.group.WORLD, device_type))


class Wire:
    """What a dispatcher keeps about its process group and the traffic on it: the group, the pass
    numbers, the steps sent and received, the receipts and the shared-memory rings.

    One per loader built with :func:`prepare_data_loader` (on every process); the copy that
    ``skip_first_batches`` makes (``PreparedDataLoader.skipped_copy``) shares it, so that the copy
    and the original number passes and steps alike on every process, whichever of them runs a pass.
    A pickled loader gets an empty one: it cannot dispatch. The rings go when the last loader
    sharing them does.
    """

    def __init__(self, group: ProcessGroup | None = None, device_type: str = "cpu") -> None:
        self.group = group
        self.rank = global_rank() if group is not None else 0
        self.watch = device_type == "cpu"  # gloo: waits are polled; nccl's are its own (its watchdog's timeout)
        timeout = compat.group_timeout(group, device_type) if group is not None else None
        self.timeout_s = timeout.total_seconds() if timeout is not None else default_timeout_s()
        self.peers: dict[int, int] = {}  # the other processes of this host: their process ids, to notice an end
        self.watched = 0.0  # when wait_sent last looked for a dead process
        self.passes_started = 0  # passes begun on this process; every message names process 0's
        self.sending: weakref.ref[Any] | None = None  # process 0: the pass whose steps are being sent
        self.closing: list[Any] = []  # process 0: close messages not yet read by every process
        self.acks: dict[int, list[Any]] = {}  # process 0: per process elsewhere, receipts of steps not yet seen
        self.ack_sends: list[Any] = []  # the other processes: receipts in flight
        self.steps_received = 0  # the other processes: step messages received (all passes)
        self.counters: dict[int, ReceiptCounter] = {}  # process 0: per process of its host, its receipts
        self.counter: ReceiptCounter | None = None  # a process on process 0's host: where it counts
        self.shm_targets: frozenset[int] = frozenset()  # the processes of process 0's host (shared memory)
        self.rings: dict[int, SharedRing] = {}  # process 0: a ring per process of its host
        self.steps_sent = 0  # process 0: steps announced (all passes)
        self.slot_steps = [-1] * RING_SLOTS  # process 0: the step last announced in each ring slot
        self.slots_taken = 0  # process 0: steps read, each given the next slot in turn
        self.reader: RingReader | None = None  # the others: process 0's ring for this process

    def close(self) -> None:
        """Release the shared-memory rings.

        Process 0 first waits (briefly) for the receipts still due: a process that has not read its
        last steps yet may not have mapped its ring, and removing the file would leave it nothing to map.
        """
        for j, ring in list(self.rings.items()):
            failure = self.await_shared_receipts(j, self.steps_sent, CLOSE_WAIT_S)
            if failure is not None:  # gone, or not reading any more: the file goes anyway
                logger.debug("closing the dispatch ring of process %d without its receipts: %s", j, failure)
            ring.close()
        self.rings.clear()  # (the receipt counters stay: their files are gone already, and passes may follow)
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def check_group(self) -> None:
        """Refuse to dispatch without a process group (a pickled copy of a loader has none)."""
        if self.group is None:
            raise RuntimeError(
                "this DataLoaderDispatcher is a copy (pickled) or was built without a process group: it cannot "
                "dispatch; build the loader in each process with prepare_data_loader"
            )

    # -- the processes of process 0's host ----------------------------------------------------
    def find_host_processes(self, process_index: int, wanted: bool) -> frozenset[int]:
        """The processes other than 0 that share process 0's host (one collective of everybody's
        host and process id, one broadcast of the table): they read its rings and count their
        receipts in shared memory. Every process keeps the process ids of the others of its own
        host (:attr:`peers`), to notice a death while it waits."""
        space = _process_space()
        mine = (socket.gethostname(), wanted and shared_memory_dir() is not None, os.getpid(), space)
        everyone = all_gather_objects(
            mine, group=self.group, what="the host and process id of every process (dispatch)"
        )
        me = global_rank()
        self.peers = {j: pid for j, (h, _, pid, s) in enumerate(everyone) if j != me and (h, s) == (mine[0], space)}
        table: dict[int, str] | None = None
        if me == 0:
            host, usable, _, _ = everyone[0]
            chosen = [
                j
                for j, (h, u, pid, _) in enumerate(everyone)
                if j and usable and (h, u) == (host, True) and (j not in self.peers or process_alive(pid))
            ]
            self.counters = {j: ReceiptCounter() for j in chosen}
            table = {j: counter.path for j, counter in self.counters.items()}
        table = broadcast_object(table, group=self.group, what="the shared-memory rings of its host (dispatch)")
        if process_index in table:
            self.counter = ReceiptCounter(table[process_index])
        return frozenset(table)

    # -- waiting for the others ---------------------------------------------------------------
    def dead_peers(self) -> dict[int, int]:
        """The processes of this host that no longer run: their process ids, by process."""
        return {j: pid for j, pid in self.peers.items() if not process_alive(pid)}

    def lost(self) -> int | None:
        """A process whose end this one cannot go on without, if any.

        Process 0: a process of its host that counts its receipts in shared memory, no longer runs
        and did not receive every step announced (one that ended after its last step ended its
        pass; a broadcast it misses fails, and gloo never delivers a failed broadcast to a receiver
        that posts its receive afterwards); it tells the others in their counters. The others: the
        process process 0 told them of, or process 0 itself when it no longer runs."""
        if self.rank == 0:
            for j, counter in self.counters.items():
                if counter.count < self.steps_sent and j in self.peers and not process_alive(self.peers[j]):
                    for other in self.counters.values():
                        other.dead = j
                    return j
            return None
        dead = self.counter.dead if self.counter is not None else -1
        if dead >= 0:  # (process 0 may have ended since, failing on it)
            return dead
        return 0 if 0 in self.peers and not process_alive(self.peers[0]) else None

    def died(self, what: str) -> DispatchError | None:
        """The error to raise when a process this one cannot go on without (:meth:`lost`) ended while
        it waited for ``what``."""
        j = self.lost()
        if j is None:
            return None
        pid = f" (pid {self.peers[j]})" if j in self.peers else ""
        return DispatchError(
            f"process {j}{pid} of the dispatch group ended while process {self.rank} waited for {what}: {RESTART}"
        )

    def ended(self, what: str) -> DispatchError | None:
        """After the process group failed while this one waited for ``what``: the error naming the
        processes of this host that no longer run, if any (looking for :data:`EXIT_S`: a process
        that ends closes its connections a moment before it stops running)."""
        deadline = time.monotonic() + EXIT_S
        while True:
            failure = self.died(what)
            dead = self.dead_peers()
            if failure is None and dead:
                names = " and ".join(f"process {j} (pid {pid})" for j, pid in dead.items())
                failure = DispatchError(
                    f"{names} of the dispatch group ended while process {self.rank} waited for {what}: {RESTART}"
                )
            if failure is not None or time.monotonic() > deadline:
                return failure
            time.sleep(0.05)

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (an asynchronous collective on the group) to finish, checking every
        :data:`WATCH_S` that no process this one needs ended (:meth:`lost`): a :class:`DispatchError`
        that names it, or ``what`` was waited for when the group's timeout passed or the operation
        failed (a process on another host died, ...). (On GPU groups: nccl's own wait.)"""
        if not self.watch or not hasattr(work, "is_completed"):
            work.wait()
            return
        start = time.monotonic()
        while True:
            try:
                work.wait(timeout=_WATCH)
                return
            except RuntimeError:
                if work.is_completed():  # it failed (or finished just now)
                    break
            failure = self.died(what)
            if failure is None and time.monotonic() - start > self.timeout_s + WATCH_S:
                failure = self.timed_out(what)
            if failure is not None:
                raise failure
        self._finish(work, what)

    def _finish(self, work: Any, what: str) -> None:
        """Wait for ``work`` to end; a failure is a :class:`DispatchError` naming the process that ended, if one did."""
        try:
            work.wait()
        except RuntimeError as exc:
            failure = self.ended(what) or DispatchError(
                f"process {self.rank} waited for {what}, and the process group failed: {exc}; a process of the "
                f"dispatch group died or stopped iterating the loader: {RESTART}"
            )
            raise failure from exc

    def timed_out(self, what: str) -> DispatchError:
        """The error to raise when this process waited the group's timeout for ``what``."""
        return DispatchError(
            f"process {self.rank} waited {self.timeout_s:g} s (the process group's timeout) for {what}: a process of "
            "the dispatch group died on another host, hangs, or stopped iterating the loader (every process must "
            "iterate it the same number of times)"
        )

    def wait_all(self, works: list[Any], what: str) -> None:
        """:meth:`wait` for (and forget) the collectives in ``works``."""
        while works:
            self.wait(works.pop(0), what)

    def wait_sent(self, work: Any, what: str) -> None:
        """Wait for a point-to-point operation (``isend`` / ``irecv``) whole.

        gloo cannot watch one: its ``is_completed()`` stays false until ``wait()`` is called, and a
        ``wait(timeout)`` that times out closes every connection of the group. Such a wait depends
        on one peer only (a death closes its connections, failing the wait) and ends, at the
        latest, after the group's timeout; a process of this host found dead (checked every
        :data:`WATCH_S`) is named before, and after a failure."""
        if self.watch and time.monotonic() - self.watched >= WATCH_S:
            self.watched = time.monotonic()
            failure = self.died(what)
            if failure is not None:
                raise failure
        self._finish(work, what)

    def wait_all_sent(self, works: list[Any], what: str) -> None:
        """:meth:`wait_sent` for (and forget) the point-to-point operations in ``works``."""
        while works:
            self.wait_sent(works.pop(0), what)

    # -- messages -----------------------------------------------------------------------------
    def receive_message(self, control: torch.Tensor, what: str) -> None:
        """The other processes: the next message process 0 broadcast, into ``control``."""
        self.wait(dist.broadcast(control, src=0, group=self.group, async_op=True), what)

    def broadcast_object(self, obj: Any, device: torch.device, what: str) -> Any:
        """Process 0's ``obj`` (pickled) on every process, every wait watched (:meth:`wait`)."""
        size = torch.zeros(1, dtype=torch.int64, device=device)
        data: torch.Tensor | None = None
        if self.rank == 0:
            data = _to_bytes(obj, device)
            size[0] = data.numel()
        self.wait(dist.broadcast(size, src=0, group=self.group, async_op=True), what)
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.wait(dist.broadcast(data, src=0, group=self.group, async_op=True), what)
        return obj if self.rank == 0 else _from_bytes(data)

    def scatter_objects(self, parts: list[Any] | None, device: torch.device, what: str) -> Any:
        """Process ``j``'s object of ``parts`` (process 0's list, pickled) on every process ``j``,
        every wait watched (:meth:`wait`)."""
        sizes = torch.zeros(world_size(), dtype=torch.int64, device=device)
        blobs: list[torch.Tensor] | None = None
        if self.rank == 0:
            blobs = [_to_bytes(part, device) for part in cast("list[Any]", parts)]
            sizes.copy_(torch.tensor([blob.numel() for blob in blobs], dtype=torch.int64))
        self.wait(dist.broadcast(sizes, src=0, group=self.group, async_op=True), what)
        most = int(sizes.max().item())
        out = torch.empty(most, dtype=torch.uint8, device=device)
        padded = None
        if blobs is not None:
            padded = [torch.cat([b, b.new_zeros(most - b.numel())]) for b in blobs]
        self.wait(dist.scatter(out, padded, src=0, group=self.group, async_op=True), what)
        return parts[0] if parts is not None else _from_bytes(out[: int(sizes[self.rank].item())])

    # -- receipts -----------------------------------------------------------------------------
    def expect_receipts(self, num_processes: int, device: torch.device) -> None:
        """Process 0: after a step went out, wait (later) for the receipt of it of every process on
        another host (those of its host count theirs in shared memory)."""
        for j in range(1, num_processes):
            if j in self.counters:
                continue
            receipt = torch.zeros(1, dtype=torch.int64, device=device)
            self.acks.setdefault(j, []).append(dist.irecv(receipt, src=j, group=self.group, tag=ACK_TAG))

    def await_receipts(self, slot: int) -> DispatchError | None:
        """Process 0: before the step taking ``slot`` goes out (step ``t``), wait until every
        process received step ``t - RECEIPT_LAG``, and the processes of its host the step last
        announced in ``slot``.

        It keeps process 0 at most that many steps ahead, and a process that died (or hangs) is
        noticed within a few steps: the others then get an error message instead of waiting. (The
        ring has ``RECEIPT_LAG + 2`` slots, and process 0 reads one step ahead: the slot is free by
        then, and so it is when the step was read into it.)
        Returns the ``DispatchError`` to raise everywhere, if any.
        """
        for j, works in self.acks.items():
            while len(works) > RECEIPT_LAG:
                try:
                    self.wait_sent(works.pop(0), f"the receipt of process {j} (on another host)")
                except DispatchError as exc:
                    return exc
        needed = max(self.steps_sent - RECEIPT_LAG, self.slot_steps[slot] + 1)
        for j in self.counters:
            failure = self.await_shared_receipts(j, needed)
            if failure is not None:
                return failure
        return None

    def await_shared_receipts(self, j: int, count: int, timeout_s: float | None = None) -> DispatchError | None:
        """Process 0: wait until process ``j`` of its host counted ``count`` steps received; the
        ``DispatchError`` to raise when a process of its host died meanwhile (``j`` or any other:
        ``j`` may be waiting for it) or ``j`` did not get there within ``timeout_s`` (the process
        group's timeout)."""
        counter = self.counters.get(j)
        if counter is None or counter.count >= count:
            return None
        limit = timeout_s if timeout_s is not None else self.timeout_s
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
                failure = self.died(what)
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
        if self.counter is not None:
            self.counter.count = self.steps_received  # after the step's rows were copied out
            return
        while len(self.ack_sends) > RECEIPT_LAG:
            self.wait_sent(self.ack_sends.pop(0), "process 0 to take this process's receipt")
        receipt = torch.ones(1, dtype=torch.int64, device=device)
        self.ack_sends.append(dist.isend(receipt, dst=0, group=self.group, tag=ACK_TAG))

    # -- rings --------------------------------------------------------------------------------
    def take_slot(self) -> int:
        """Process 0: the ring slot the next step read takes (slots are taken in turn)."""
        return self.slots_taken % RING_SLOTS

    def slot_free(self, slot: int) -> bool:
        """Process 0: whether every process of its host received the step last announced in ``slot``
        (nothing is waited for)."""
        step = self.slot_steps[slot]
        return all(counter.count > step for counter in self.counters.values())

    def ring_table(self, parts: list[list[Any]]) -> tuple[tuple[int, str, int, int], ...]:
        """Process 0: the ring of every process of its host, each big enough for its part of this step
        (a ring outgrown is replaced; the table is part of the header, so a change is announced)."""
        table = []
        for j in sorted(self.shm_targets):
            need = ring_bytes([leaf_spec(leaf) for leaf in tensors(parts[j])])
            ring = self.rings.get(j)
            if ring is None or not ring.fits(need):
                if ring is not None:
                    ring.close(remove=False)  # the others may still map it: they remove it
                size = max(need, 2 * ring.slot_bytes if ring is not None else 0, MIN_SLOT_BYTES)
                ring = self.rings[j] = SharedRing(RING_SLOTS, size)
            table.append((j, ring.path, ring.slots, ring.slot_bytes))
        return tuple(table)

    def write_ring(self, j: int, rows: list[torch.Tensor], slot: int) -> tuple[int, int]:
        """Process 0: this step's rows for process ``j`` into ``slot`` of its ring (free: see
        :meth:`await_receipts`); rows collated there already stay where they are. Returns the
        bytes of the rows and the bytes copied."""
        total = sum(t.numel() * t.element_size() for t in rows)
        return total, self.rings[j].write(slot, rows)

    def holds(self, leaf: Any) -> bool:
        """Process 0: whether ``leaf`` is a tensor in one of its rings."""
        return isinstance(leaf, torch.Tensor) and any(ring.holds(leaf) for ring in self.rings.values())

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


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs: on Linux by ``/proc`` (a zombie does not run)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: it exists
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def default_timeout_s() -> float:
    """torch's default timeout of a process group, in seconds (where a group's own cannot be read)."""
    return dist.constants.default_pg_timeout.total_seconds()


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - process 0's own objects, as broadcast_object_list


def _process_space() -> tuple[str, int] | None:
    """Which process ids this process sees: its boot and process-id namespace (Linux), so that
    only processes whose ids mean the same here are watched (not those of another container that
    shares the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip(), os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
