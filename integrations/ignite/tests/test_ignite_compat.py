"""Every private name listed in shardplug_ignite.compat still exists in PyTorch-Ignite (real objects).

Fails when an Ignite release drops or renames one; shardplug_ignite/compat.py says what each is for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import version

import pytest
import torch

from shardplug_ignite import compat


def _check_prepare_batch() -> None:
    prepare = importlib.import_module("ignite.engine")._prepare_batch
    assert compat.ignite_prepare_batch is prepare
    x, y = prepare((torch.ones(2), torch.zeros(2)), device="cpu", non_blocking=False)
    assert torch.equal(x, torch.ones(2)) and torch.equal(y, torch.zeros(2))
    # Ignite's own factories use it as their default: shardplug's follow the same reading of a batch
    import inspect

    from ignite.engine import create_supervised_evaluator, create_supervised_trainer

    for factory in (create_supervised_trainer, create_supervised_evaluator):
        assert inspect.signature(factory).parameters["prepare_batch"].default is prepare


def _check_required_keys() -> None:
    from ignite.base.mixins import Serializable

    assert importlib.import_module("ignite.base.mixins").Serializable._state_dict_all_req_keys == ()

    @compat.requires_state_keys("a", "b")
    class Piece(Serializable):
        pass

    assert compat.required_state_keys(Piece) == ("a", "b") == compat.required_state_keys(Piece())
    Piece().load_state_dict({"a": 1, "b": 2})  # every required key: accepted
    with pytest.raises(ValueError, match="'b' is absent"):  # Serializable.load_state_dict reads the keys
        Piece().load_state_dict({"a": 1})


CHECKS: dict[str, Callable[[], None]] = {
    "ignite.engine._prepare_batch": _check_prepare_batch,
    "ignite.base.mixins.Serializable._state_dict_all_req_keys": _check_required_keys,
}


def test_every_listed_name_has_a_check_and_a_checked_version():
    assert set(CHECKS) == set(compat.PRIVATES)
    assert {name.split(".")[0] for name in compat.PRIVATES} == set(compat.CHECKED_AGAINST)


@pytest.mark.parametrize("name", sorted(compat.PRIVATES))
def test_the_private_name_still_exists(name):
    try:
        CHECKS[name]()
    except (AttributeError, KeyError, AssertionError, ImportError, TypeError) as exc:
        raise AssertionError(
            f"pytorch-ignite {version('pytorch-ignite')} no longer has {name} as shardplug_ignite uses it (checked "
            f"against {compat.CHECKED_AGAINST['ignite']}): see shardplug_ignite/compat.py"
        ) from exc
