"""Whether the processes a dispatching process cannot go on without still run.

Never a hang: a process waiting for another one (:mod:`~shardplug.core.dispatch.timed_waits`) asks
:meth:`Liveness.lost` every :data:`~shardplug.core.dispatch.timed_waits.WATCH_S` whether a process it needs has
ended. Process 0 watches the processes of its host that still owe receipts, and writes the one that ended into
every receipt counter in shared memory (:class:`~shardplug.core.dispatch.shm.ReceiptCounter`: a receipt count
and a notice of a death at once); the others watch for that, and for process 0's end; a zombie does not run. A
process that ended after its last step failed nothing.

Example::

    >>> import os
    >>> process_alive(os.getpid())
    True
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING

from shardplug.core._internal.collectives import all_gather_objects, broadcast_object, global_rank
from shardplug.core.dispatch.dispatch_plan import DispatchError
from shardplug.core.dispatch.shm import ReceiptCounter, shared_memory_dir

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["EXIT_S", "RESTART", "Liveness", "process_alive"]

EXIT_S = 1.0
"""How long a process whose process group failed looks for a process of its host that ended (it
closes its connections a moment before it stops running)."""

RESTART = "dispatch cannot go on without it: stop every process and start the job again (from its last checkpoint)"
"""What to do when a process of the dispatch group is gone."""


class Liveness:
    """The processes of this process's host, the receipt counters of process 0's host, and which process this
    one cannot go on without has ended (:meth:`lost`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.peers: dict[int, int] = {}  # the other processes of this host: their process ids, to notice an end
        self.counters: dict[int, ReceiptCounter] = {}  # process 0: per process of its host, its receipts
        self.counter: ReceiptCounter | None = None  # a process on process 0's host: where it counts
        self.steps_sent = 0  # process 0: steps announced (all passes), which every process owes a receipt for

    def find_host_processes(self, group: ProcessGroup | None, process_index: int, wanted: bool) -> frozenset[int]:
        """The processes other than 0 that share process 0's host (one collective of everybody's
        host and process id, one broadcast of the table): they read its rings and count their
        receipts in shared memory. Every process keeps the process ids of the others of its own
        host (:attr:`peers`), to notice a death while it waits."""
        space = _process_space()
        mine = (socket.gethostname(), wanted and shared_memory_dir() is not None, os.getpid(), space)
        everyone = all_gather_objects(mine, group=group, what="the host and process id of every process (dispatch)")
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
        table = broadcast_object(table, group=group, what="the shared-memory rings of its host (dispatch)")
        if process_index in table:
            self.counter = ReceiptCounter(table[process_index])
        return frozenset(table)

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
    except (FileNotFoundError, ProcessLookupError):  # gone, also between the open and the read (ESRCH)
        return False


def _process_space() -> tuple[str, int] | None:
    """Which process ids this process sees: its boot and process-id namespace (Linux), so that
    only processes whose ids mean the same here are watched (not those of another container that
    shares the host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return boot.read().strip(), os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
