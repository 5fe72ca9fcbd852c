"""Moving (nested) batches to a device: :func:`send_to_device`, and the :class:`DeviceTransfer` of a
prepared loader (what each pass moves its batches with)."""

from __future__ import annotations

from typing import Any

import torch

from shardplug.core._internal.rows import map_leaves
from shardplug.core.config import ShardplugConfig

__all__ = ["send_to_device", "move_leaf", "DeviceTransfer"]


def send_to_device(
    data: Any,
    device: str | torch.device | int | None,
    non_blocking: bool = ShardplugConfig.non_blocking,
    skip_keys: str | list[str] | None = None,
) -> Any:
    """Move every tensor in ``data`` (nested lists, tuples, namedtuples, dicts, objects with ``.to()``) to ``device``.

    Containers keep their type (:func:`~shardplug.core._internal.rows.map_leaves`); ``skip_keys`` names dict
    keys whose values stay where they are; leaves that are not tensors and have no ``.to()`` are
    returned unchanged.

    Example::

        >>> send_to_device({"x": torch.ones(2), "id": "a"}, "cpu")["id"]
        'a'
    """
    if device is None:
        return data
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]

    return map_leaves(data, lambda leaf: move_leaf(leaf, device, non_blocking), skip_keys=set(skip_keys or ()))


def move_leaf(leaf: Any, device: str | torch.device | int, non_blocking: bool) -> Any:
    """The one copy of a leaf to ``device``, for the plain path and the CUDA side stream's
    (:class:`~shardplug.core.loader.prefetch.SideStreamCopy`): a tensor by ``.to()``, an object by its own
    ``.to()`` (without ``non_blocking`` where it takes none), anything else as it is.

    Example::

        >>> move_leaf(torch.ones(1), "cpu", False).device.type, move_leaf("a", "cpu", False)
        ('cpu', 'a')
    """
    if isinstance(leaf, torch.Tensor):
        return leaf.to(device, non_blocking=non_blocking)
    to = getattr(leaf, "to", None)
    if callable(to):
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:
            return to(device)
    return leaf


class DeviceTransfer:
    """Moves each batch a prepared loader hands out to ``device`` (:func:`send_to_device`).

    Example::

        >>> move = DeviceTransfer.to("cpu")
        >>> move({"x": torch.ones(1)})["x"].device.type, DeviceTransfer.to(None)
        ('cpu', None)
    """

    __slots__ = ("device", "non_blocking")

    def __init__(self, device: str | torch.device, non_blocking: bool = ShardplugConfig.non_blocking) -> None:
        self.device = torch.device(device)
        self.non_blocking = bool(non_blocking)

    @classmethod
    def to(
        cls, device: str | torch.device | None, non_blocking: bool = ShardplugConfig.non_blocking
    ) -> DeviceTransfer | None:
        """The transfer to ``device``, or ``None`` where batches stay where they are (no device)."""
        return None if device is None else cls(device, non_blocking)

    def __call__(self, batch: Any) -> Any:
        return send_to_device(batch, self.device, self.non_blocking)
