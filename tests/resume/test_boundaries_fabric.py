"""The boundary matrix in Fabric: ``fabric.save`` / ``fabric.load``; steps at the new layout's cycles of the epoch.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import FABRIC, FEWER_RELAYS, cases, check, check_relay, relay_cases, scenario_runs


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Fabric setup's first runs (killed) and resumed runs, by setup id."""
    pytest.importorskip("shardplug_lightning")
    return scenario_runs("boundaries_fabric.py", FABRIC, "fabric", tmp_path_factory, FEWER_RELAYS)


@pytest.mark.parametrize("name, before, after, point", cases(FABRIC))
def test_fabric_resumes_a_checkpoint_of_every_boundary_exactly(
    fabric_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(FABRIC[name][0], fabric_runs[name], before, after, point)


@pytest.mark.parametrize("name, after, point", relay_cases(FABRIC, FEWER_RELAYS))
def test_fabric_resumes_a_relay_saved_inside_its_epoch_exactly(
    fabric_runs: dict[str, Any], name: str, after: int, point: str
) -> None:
    """A second kill and resize inside the epoch after a first resized resume, and one where the new layout
    has no step left in the epoch."""
    check_relay(FABRIC[name][0], fabric_runs[name], FEWER_RELAYS[name], after, point)
