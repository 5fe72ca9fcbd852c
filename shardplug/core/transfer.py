"""Moving (nested) batches to a device."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .rows import map_leaves

__all__ = ["send_to_device"]


def send_to_device(
    data: Any,
    device: Union[str, torch.device, int, None],
    non_blocking: bool = False,
    skip_keys: Optional[Union[str, list[str]]] = None,
) -> Any:
    """Move every tensor in ``data`` (nested lists, tuples, namedtuples, dicts, objects with ``.to()``) to ``device``.

    Containers keep their type (:func:`~shardplug.core.rows.map_leaves`); ``skip_keys`` names dict
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

    def move(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return leaf.to(device, non_blocking=non_blocking)
        to = getattr(leaf, "to", None)
        if callable(to):
            try:
                return to(device, non_blocking=non_blocking)
            except TypeError:
                return to(device)
        return leaf

    return map_leaves(data, move, skip_keys=set(skip_keys or ()))
