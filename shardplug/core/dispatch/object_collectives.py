"""The collectives of the dispatch group that carry Python objects: process 0's message before a step, and its
pickled objects broadcast or scattered, every wait watched (:mod:`~shardplug.core.dispatch.timed_waits`).

Example::

    >>> _from_bytes(_to_bytes({"step": 3}, torch.device("cpu")))
    {'step': 3}
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from shardplug.core._internal.collectives import world_size
from shardplug.core.dispatch.timed_waits import TimedWaits

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ObjectCollectives"]


class ObjectCollectives:
    """Process 0's messages and objects on every process of ``group`` (this process is ``rank``)."""

    def __init__(self, group: ProcessGroup | None, rank: int, waits: TimedWaits) -> None:
        self.group = group
        self.rank = rank
        self.waits = waits

    def receive_message(self, control: torch.Tensor, what: str) -> None:
        """The other processes: the next message process 0 broadcast, into ``control``."""
        self.waits.wait(dist.broadcast(control, src=0, group=self.group, async_op=True), what)

    def broadcast_object(self, obj: Any, device: torch.device, what: str) -> Any:
        """Process 0's ``obj`` (pickled) on every process, every wait watched (:meth:`TimedWaits.wait`)."""
        size = torch.zeros(1, dtype=torch.int64, device=device)
        data: torch.Tensor | None = None
        if self.rank == 0:
            data = _to_bytes(obj, device)
            size[0] = data.numel()
        self.waits.wait(dist.broadcast(size, src=0, group=self.group, async_op=True), what)
        if data is None:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.waits.wait(dist.broadcast(data, src=0, group=self.group, async_op=True), what)
        return obj if self.rank == 0 else _from_bytes(data)

    def scatter_objects(self, parts: list[Any] | None, device: torch.device, what: str) -> Any:
        """Process ``j``'s object of ``parts`` (process 0's list, pickled) on every process ``j``,
        every wait watched (:meth:`TimedWaits.wait`)."""
        sizes = torch.zeros(world_size(), dtype=torch.int64, device=device)
        blobs: list[torch.Tensor] | None = None
        if self.rank == 0:
            blobs = [_to_bytes(part, device) for part in cast("list[Any]", parts)]
            sizes.copy_(torch.tensor([blob.numel() for blob in blobs], dtype=torch.int64))
        self.waits.wait(dist.broadcast(sizes, src=0, group=self.group, async_op=True), what)
        most = int(sizes.max().item())
        out = torch.empty(most, dtype=torch.uint8, device=device)
        padded = None
        if blobs is not None:
            padded = [torch.cat([b, b.new_zeros(most - b.numel())]) for b in blobs]
        self.waits.wait(dist.scatter(out, padded, src=0, group=self.group, async_op=True), what)
        return parts[0] if parts is not None else _from_bytes(out[: int(sizes[self.rank].item())])


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(data: torch.Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - process 0's own objects, as broadcast_object_list
