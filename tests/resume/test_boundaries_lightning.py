"""The boundary matrix in Lightning: saved by ``ModelCheckpoint``, resumed by ``Trainer.fit(ckpt_path=...)``; steps
at the new layout's cycles of the epoch.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import LIGHTNING, RELAYS, cases, check, check_relay, relay_cases, scenario_runs


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Lightning setup's first runs (killed) and resumed runs, by setup id."""
    pytest.importorskip("shardplug_lightning")
    return scenario_runs("boundaries_lightning.py", LIGHTNING, "lightning", tmp_path_factory, RELAYS)


@pytest.mark.parametrize("name, before, after, point", cases(LIGHTNING))
def test_lightning_resumes_a_checkpoint_of_every_boundary_exactly(
    lightning_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(LIGHTNING[name][0], lightning_runs[name], before, after, point)


@pytest.mark.parametrize("name, after, point", relay_cases(LIGHTNING, RELAYS, old=True))
def test_lightning_resumes_a_relay_saved_inside_its_epoch_exactly(
    lightning_runs: dict[str, Any], name: str, after: int, point: str
) -> None:
    """A second kill and resize inside the epoch after a first resized resume (from an epoch's last step:
    ``batch_idx`` continues; ``-old``: the checkpoint with the epoch progress an older shardplug left there), and
    one where the new layout has no step left in the epoch (the fit goes on to the next epoch)."""
    check_relay(LIGHTNING[name][0], lightning_runs[name], RELAYS[name], after, point)
