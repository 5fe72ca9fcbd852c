"""The few collectives the engine needs, safe without a process group, and the one rule for
what cannot be done without one (:func:`require_group`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardplug.core._internal import compat
from shardplug.core._internal.topology import distributed_is_active

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "broadcast_object",
    "all_gather_objects",
    "world_size",
    "global_rank",
    "all_reduce_int_async",
    "communication_device",
    "require_group",
    "waiting_for",
]


def world_size() -> int:
    return dist.get_world_size() if distributed_is_active() else 1


def global_rank() -> int:
    return dist.get_rank() if distributed_is_active() else 0


def require_group(num_processes: int, process_index: int, needs: str, without: str, fix: str = "") -> None:
    """Refuse to share data among ``num_processes > 1`` processes that need a process group for
    ``needs``, where none of several processes runs (the topology then came from the
    launcher's environment or from explicit arguments): ``without`` says what would go wrong, silently,
    and ``fix`` the way that needs no group (``""``: none), after "initialise the process group first".

    Example::

        >>> require_group(1, 0, "agreeing on the seed of its shuffle", "each process would draw its own order")
    """
    if num_processes == 1 or world_size() > 1:
        return
    group = "no process group is initialised" if not distributed_is_active() else "its process group has 1 process"
    raise ValueError(
        f"prepare_data_loader shares this DataLoader among num_processes={num_processes} processes (this is process "
        f"{process_index}), and they need the process group for {needs}, but {group}: {without}. "
        "Initialise the process group first (torch.distributed.init_process_group(...) before prepare_data_loader)"
        + fix
    )


@contextmanager
def waiting_for(what: str, source: int | None = None, group: ProcessGroup | None = None) -> Iterator[None]:
    """Turn the failure of a collective inside (a process died, or did not get there within the
    process group's timeout, which bounds every such wait) into a ``RuntimeError`` that says what
    this process waited for, and from whom (``source``; ``None``: every process of ``group``)."""
    try:
        yield
    except RuntimeError as exc:
        timeout = compat.group_timeout(group if group is not None else dist.group.WORLD, communication_device().type)
        limit = f"{timeout.total_seconds():g} s" if timeout is not None else "its timeout"
        whom = f"process {source}" if source is not None else "every process of the group"
        raise RuntimeError(
            f"process {global_rank()} waited for {whom} ({what}), and the process group failed (a wait is given up "
            f"after the group's timeout, {limit}): {exc}. A process died, or did not get there: every process must "
            "build and iterate its loaders alike. Restart the job (every process)"
        ) from exc


def broadcast_object(obj: Any, src: int = 0, group: ProcessGroup | None = None, what: str = "an object") -> Any:
    """Return process ``src``'s ``obj`` on every process (``obj`` itself without a process group);
    ``what`` it is names the wait when the collective fails (:func:`waiting_for`)."""
    if world_size() == 1:
        return obj
    box = [obj]
    with waiting_for(what, src, group):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: ProcessGroup | None = None, what: str = "an object") -> list[Any]:
    """Every process's ``obj``, by rank (``[obj]`` without a process group); ``what`` it is names
    the wait when the collective fails (:func:`waiting_for`)."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with waiting_for(what, None, group):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def communication_device() -> torch.device:
    """Where tensors of collectives live: the current GPU for nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}


AGREEMENT = "the batches each process has read ahead: the agreement on equal steps of a stream without len()"
"""What :func:`all_reduce_int_async` waits for unless told."""


def all_reduce_int_async(value: int, op: str, what: str = AGREEMENT) -> Callable[[], int]:
    """Start reducing ``value`` over every process; the returned function waits and gives the result
    (``what`` it is names the wait when the collective fails: :func:`waiting_for`).

    Every process must start its reductions in the same order (as with any collective)."""
    if world_size() == 1:
        return lambda: value
    tensor = torch.tensor([value], dtype=torch.int64, device=communication_device())
    with waiting_for(what):
        work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)

    def result() -> int:
        with waiting_for(what):
            work.wait()
        return int(tensor.item())

    return result
