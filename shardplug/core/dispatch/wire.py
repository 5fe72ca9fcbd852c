"""The wire under the step protocol: a dispatcher's process group and the traffic on it, one part per job.

* :class:`~shardplug.core.dispatch.liveness.Liveness`: the processes of this host, and which process this one
  cannot go on without has ended;
* :class:`~shardplug.core.dispatch.timed_waits.TimedWaits`: every wait for another process, watched and timed;
* :class:`~shardplug.core.dispatch.object_collectives.ObjectCollectives`: process 0's messages and pickled
  objects on every process;
* :class:`~shardplug.core.dispatch.receipts.Receipts`: the receipt of every step, process 0 at most
  :data:`~shardplug.core.dispatch.receipts.RECEIPT_LAG` steps ahead of the slowest;
* :class:`~shardplug.core.dispatch.ring_slots.RingSlots`: the shared-memory rings of process 0's host and
  their slots.

:class:`Wire` holds them with the group's own lifecycle: the group, the pass numbers, the pass being sent,
closing.

Example::

    >>> wire = Wire()  # no process group: a pickled loader's, which cannot dispatch
    >>> wire.check_group()
    Traceback (most recent call last):
    ...
    RuntimeError: this DataLoaderDispatcher is a copy (pickled) or was built without a process group: ...
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import global_rank
from shardplug.core.dispatch.liveness import Liveness
from shardplug.core.dispatch.object_collectives import ObjectCollectives
from shardplug.core.dispatch.receipts import Receipts
from shardplug.core.dispatch.ring_slots import RingSlots
from shardplug.core.dispatch.timed_waits import TimedWaits, default_timeout_s

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Wire", "dispatch_group"]

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0
"""How long closing a dispatcher waits for the receipts still due before it removes its rings."""


def dispatch_group(device_type: str) -> Any:
    """The process group of a dispatcher's traffic (every process), with the default group's
    timeout: ``new_group`` would otherwise take torch's default (30 minutes), whatever the user
    passed to ``init_process_group``."""
    return dist.new_group(timeout=compat.group_timeout(dist.group.WORLD, device_type))


class Wire:
    """What a dispatcher keeps about its process group and the traffic on it: the group, the pass
    numbers, and a part per job (see the module): :attr:`liveness`, :attr:`waits`, :attr:`objects`,
    :attr:`receipts`, :attr:`rings`.

    One per loader built with :func:`prepare_data_loader` (on every process); the copy that
    ``skip_first_batches`` makes (``PreparedDataLoader.skipped_copy``) shares it, so that the copy
    and the original number passes and steps alike on every process, whichever of them runs a pass.
    A pickled loader gets an empty one: it cannot dispatch. The rings go when the last loader
    sharing them does.
    """

    def __init__(self, group: ProcessGroup | None = None, device_type: str = "cpu") -> None:
        self.group = group
        rank = global_rank() if group is not None else 0
        watch = device_type == "cpu"  # gloo: waits are polled; nccl's are its own (its watchdog's timeout)
        timeout = compat.group_timeout(group, device_type) if group is not None else None
        self.liveness = Liveness(rank)
        self.waits = TimedWaits(
            self.liveness, watch, timeout.total_seconds() if timeout is not None else default_timeout_s()
        )
        self.objects = ObjectCollectives(group, rank, self.waits)
        self.receipts = Receipts(group, self.liveness, self.waits)
        self.rings = RingSlots(self.liveness)
        self.passes_started = 0  # passes begun on this process; every message names process 0's
        self.sending: weakref.ref[Any] | None = None  # process 0: the pass whose steps are being sent
        self.closing: list[Any] = []  # process 0: close messages not yet read by every process

    @property
    def timeout_s(self) -> float:
        """How long a wait for another process lasts at most: the process group's timeout, in seconds."""
        return self.waits.timeout_s

    @property
    def steps_sent(self) -> int:
        """Process 0: the steps announced (all passes)."""
        return self.liveness.steps_sent

    def step_announced(self, slot: int) -> int:
        """Process 0: a step, its rows in ring ``slot``, is announced; its number (all passes)."""
        step = self.rings.slot_steps[slot] = self.liveness.steps_sent
        self.liveness.steps_sent += 1
        return step

    def find_host_processes(self, process_index: int, wanted: bool) -> frozenset[int]:
        """The processes other than 0 that share process 0's host, which read its rings (``wanted``: where
        shared memory is to be used); see :meth:`~shardplug.core.dispatch.liveness.Liveness.find_host_processes`."""
        return self.liveness.find_host_processes(self.group, process_index, wanted)

    def close(self) -> None:
        """Release the shared-memory rings.

        Process 0 first waits (briefly) for the receipts still due: a process that has not read its
        last steps yet may not have mapped its ring, and removing the file would leave it nothing to map.
        """
        self.rings.close(before=self._settle)  # (the receipt counters stay: their files are gone already)

    def _settle(self, j: int) -> None:
        """Wait (at most :data:`CLOSE_WAIT_S`) for process ``j``'s receipts of every step announced."""
        failure = self.receipts.await_shared_receipts(j, self.liveness.steps_sent, CLOSE_WAIT_S)
        if failure is not None:  # gone, or not reading any more: the file goes anyway
            logger.debug("closing the dispatch ring of process %d without its receipts: %s", j, failure)

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
