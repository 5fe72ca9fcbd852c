"""The boundary matrix in plain PyTorch: ``torch.save`` of ``state_dict()``; continues the saved accumulation cycle
of the core's ``GradientState``.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import PLAIN, RELAYS, cases, check, check_relay, relay_cases, scenario_runs


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every plain PyTorch setup's first runs (killed) and resumed runs, by setup id."""
    return scenario_runs("boundaries_plain.py", PLAIN, "plain", tmp_path_factory, RELAYS)


@pytest.mark.parametrize("name, before, after, point", cases(PLAIN))
def test_plain_pytorch_resumes_a_save_of_every_boundary_exactly(
    plain_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(PLAIN[name][0], plain_runs[name], before, after, point, cycles="carried")


@pytest.mark.parametrize("name, after, point", relay_cases(PLAIN, RELAYS))
def test_plain_pytorch_resumes_a_relay_saved_inside_its_epoch_exactly(
    plain_runs: dict[str, Any], name: str, after: int, point: str
) -> None:
    """A second kill and resize inside the epoch after a first resized resume (and where the new layout has
    no step left in it)."""
    check_relay(PLAIN[name][0], plain_runs[name], RELAYS[name], after, point, cycles="carried")
