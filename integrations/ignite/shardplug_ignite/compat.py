"""Every private name of PyTorch-Ignite that shardplug_ignite reads, and its accessors.

* :data:`PRIVATES`: each name (dotted from the ``ignite`` root), with what it is used for;
* :data:`CHECKED_AGAINST`: the library versions the list was checked against.

The rest of the package reaches them only through this module;
``integrations/ignite/tests/test_ignite_compat.py`` fails on an Ignite release that drops or renames one.

Example::

    >>> import torch
    >>> x, y = ignite_prepare_batch((torch.ones(2), torch.zeros(2)), device=None, non_blocking=False)
    >>> x.tolist(), y.tolist()
    ([1.0, 1.0], [0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from ignite.engine import _prepare_batch

__all__ = ["PRIVATES", "CHECKED_AGAINST", "ignite_prepare_batch"]

CHECKED_AGAINST: dict[str, str] = {"ignite": "0.5.5"}
"""The version of PyTorch-Ignite (``pip show pytorch-ignite``) :data:`PRIVATES` was checked against."""

PRIVATES: dict[str, str] = {
    "ignite.engine._prepare_batch": "the default prepare_batch of Ignite's supervised trainers and evaluators "
    "(an (x, y) pair moved to the device); the default of ShardplugHandler.create_trainer / "
    "create_evaluator and evaluation_step, so that they read batches as Ignite's own factories do",
}
"""Every private name above, with its use."""

# its annotation says a tuple of any length; it returns the (x, y) pair
ignite_prepare_batch = cast("Callable[..., tuple[Any, Any]]", _prepare_batch)
"""Ignite's default ``prepare_batch(batch, device=None, non_blocking=False) -> (x, y)``."""
