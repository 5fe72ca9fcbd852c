"""The few collectives the engine needs, safe without a process group."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from .topology import distributed_is_active

__all__ = ["broadcast_object", "world_size", "global_rank"]


def world_size() -> int:
    return dist.get_world_size() if distributed_is_active() else 1


def global_rank() -> int:
    return dist.get_rank() if distributed_is_active() else 0


def broadcast_object(obj: Any, src: int = 0, group: Optional[Any] = None) -> Any:
    """Return process ``src``'s ``obj`` on every process (``obj`` itself without a process group)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
