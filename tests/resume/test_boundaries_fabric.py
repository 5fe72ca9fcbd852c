"""The boundary matrix in Fabric: ``fabric.save`` / ``fabric.load``; steps at the new layout's cycles of the epoch.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import FABRIC, cases, check, scenario_runs


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Fabric setup's first runs (killed) and resumed runs, by setup id."""
    pytest.importorskip("shardplug_lightning")
    return scenario_runs("boundaries_fabric.py", FABRIC, "fabric", tmp_path_factory)


@pytest.mark.parametrize("name, before, after, point", cases(FABRIC))
def test_fabric_resumes_a_checkpoint_of_every_boundary_exactly(
    fabric_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(FABRIC[name][0], fabric_runs[name], before, after, point)
