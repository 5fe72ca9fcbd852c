"""Every wait of a dispatching process for another one: timed, and watched for a process that ended.

Never a hang: every wait for another process -- the message of a step, a header, pickled leaves --
checks every :data:`WATCH_S` whether a process it cannot go on without has ended
(:meth:`~shardplug.core.dispatch.liveness.Liveness.lost`), raises a
:class:`~shardplug.core.dispatch.dispatch_plan.DispatchError` naming it, and gives up after the process group's
timeout (that of the default group: processes on other hosts). Rows and receipts through the process group
(point-to-point) are waited for whole (:meth:`TimedWaits.wait_sent`): each depends on one peer, whose death
closes the connection. Watching only the process waited for is not enough: with gloo, a broadcast that fails
on process 0 because one receiver died is never delivered to a receiver that posts its receive afterwards, so
a live process waits for a message that will not come, and process 0 for that live process's receipt.

Example::

    >>> from shardplug.core.dispatch.liveness import Liveness
    >>> waits = TimedWaits(Liveness(rank=0), watch=True, timeout_s=30.0)
    >>> waits.timed_out("step 3").args[0][:40]
    'process 0 waited 30 s (the process group'
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardplug.core.dispatch.dispatch_plan import DispatchError
from shardplug.core.dispatch.liveness import RESTART, Liveness

__all__ = ["WATCH_S", "TimedWaits", "default_timeout_s"]

WATCH_S = 0.2
"""How often a process waiting for another one checks whether a process it needs has ended."""

_WATCH = timedelta(seconds=WATCH_S)


class TimedWaits:
    """The waits of one process for the traffic of the dispatch group: collectives watched every
    :data:`WATCH_S` (:meth:`wait`), point-to-point operations whole (:meth:`wait_sent`), both given up after
    ``timeout_s`` (the process group's). ``watch``: whether waits are polled (gloo; nccl's are its own, with
    its watchdog's timeout)."""

    def __init__(self, liveness: Liveness, watch: bool, timeout_s: float) -> None:
        self.liveness = liveness
        self.watch = watch
        self.timeout_s = timeout_s
        self.watched = 0.0  # when wait_sent last looked for a dead process

    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` (an asynchronous collective on the group) to finish, checking every
        :data:`WATCH_S` that no process this one needs ended (:meth:`Liveness.lost`): a :class:`DispatchError`
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
            failure = self.liveness.died(what)
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
            failure = self.liveness.ended(what) or DispatchError(
                f"process {self.liveness.rank} waited for {what}, and the process group failed: {exc}; a process of "
                f"the dispatch group died or stopped iterating the loader: {RESTART}"
            )
            raise failure from exc

    def timed_out(self, what: str) -> DispatchError:
        """The error to raise when this process waited the group's timeout for ``what``."""
        return DispatchError(
            f"process {self.liveness.rank} waited {self.timeout_s:g} s (the process group's timeout) for {what}: a "
            "process of the dispatch group died on another host, hangs, or stopped iterating the loader (every "
            "process must iterate it the same number of times)"
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
            failure = self.liveness.died(what)
            if failure is not None:
                raise failure
        self._finish(work, what)

    def wait_all_sent(self, works: list[Any], what: str) -> None:
        """:meth:`wait_sent` for (and forget) the point-to-point operations in ``works``."""
        while works:
            self.wait_sent(works.pop(0), what)


def default_timeout_s() -> float:
    """torch's default timeout of a process group, in seconds (where a group's own cannot be read)."""
    return dist.constants.default_pg_timeout.total_seconds()
