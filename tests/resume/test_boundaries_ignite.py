"""The boundary matrix in Ignite: ``Checkpoint`` and ``Checkpoint.load_objects``; continues the saved accumulation
cycle of the core's ``GradientState``.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import FEWER_RELAYS, IGNITE, cases, check, check_relay, relay_cases, scenario_runs


@pytest.fixture(scope="module")
def ignite_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Ignite setup's first runs (killed) and resumed runs, by setup id."""
    pytest.importorskip("shardplug_ignite")
    return scenario_runs("boundaries_ignite.py", IGNITE, "ignite", tmp_path_factory, FEWER_RELAYS)


@pytest.mark.parametrize("name, before, after, point", cases(IGNITE))
def test_ignite_resumes_a_checkpoint_of_every_boundary_exactly(
    ignite_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(IGNITE[name][0], ignite_runs[name], before, after, point, cycles="carried")


@pytest.mark.parametrize("name, after, point", relay_cases(IGNITE, FEWER_RELAYS))
def test_ignite_resumes_a_relay_saved_inside_its_epoch_exactly(
    ignite_runs: dict[str, Any], name: str, after: int, point: str
) -> None:
    """A second kill and resize inside the epoch after a first resized resume, and one where the new layout
    has no step left in the epoch."""
    check_relay(IGNITE[name][0], ignite_runs[name], FEWER_RELAYS[name], after, point, cycles="carried")
