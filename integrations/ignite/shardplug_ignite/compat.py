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
from typing import Any, TypeVar, cast

from ignite.base.mixins import Serializable
from ignite.engine import _prepare_batch

__all__ = ["PRIVATES", "CHECKED_AGAINST", "ignite_prepare_batch", "requires_state_keys", "required_state_keys"]

_S = TypeVar("_S", bound=type[Serializable])

CHECKED_AGAINST: dict[str, str] = {"ignite": "0.5.5"}
"""The version of PyTorch-Ignite (``pip show pytorch-ignite``) :data:`PRIVATES` was checked against."""

PRIVATES: dict[str, str] = {
    "ignite.engine._prepare_batch": "the default prepare_batch of Ignite's supervised trainers and evaluators "
    "(an (x, y) pair moved to the device); the default of ShardplugHandler.create_trainer / "
    "create_evaluator and evaluation_step, so that they read batches as Ignite's own factories do",
    "ignite.base.mixins.Serializable._state_dict_all_req_keys": "the keys Serializable.load_state_dict requires "
    "(a missing one is a ValueError naming it); set on the handler and its pieces (EpochSync, StepEvents, "
    "SchedulerSteps), and read to hand each piece its keys",
}
"""Every private name above, with its use."""

# its annotation says a tuple of any length; it returns the (x, y) pair
ignite_prepare_batch = cast("Callable[..., tuple[Any, Any]]", _prepare_batch)
"""Ignite's default ``prepare_batch(batch, device=None, non_blocking=False) -> (x, y)``."""


def requires_state_keys(*keys: str) -> Callable[[_S], _S]:
    """A class decorator: ``Serializable.load_state_dict`` of the class refuses a state without ``keys``.

    Example::

        >>> @requires_state_keys("loader")
        ... class Piece(Serializable):
        ...     pass
        >>> required_state_keys(Piece)
        ('loader',)
    """

    def decorate(cls: _S) -> _S:
        cls._state_dict_all_req_keys = tuple(keys)
        return cls

    return decorate


def required_state_keys(serializable: Serializable | type[Serializable]) -> tuple[str, ...]:
    """The keys ``serializable``'s ``load_state_dict`` requires (set by :func:`requires_state_keys`)."""
    return tuple(serializable._state_dict_all_req_keys)
