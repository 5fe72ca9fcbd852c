"""The boundary matrix in Lightning: saved by ``ModelCheckpoint``, resumed by ``Trainer.fit(ckpt_path=...)``; steps
at the new layout's cycles of the epoch.

Every position saved at an epoch's boundaries resumes exactly on the same, fewer and more processes (the matrix,
its setups and the oracle: ``tests/_boundary_runs.py`` and ``tests/_boundaries.py``). One module per front end,
so that the front ends' matrices run side by side under ``pytest -n``.
"""

from __future__ import annotations

from typing import Any

import pytest
from _boundary_runs import LIGHTNING, cases, check, scenario_runs


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every Lightning setup's first runs (killed) and resumed runs, by setup id."""
    pytest.importorskip("shardplug_lightning")
    return scenario_runs("boundaries_lightning.py", LIGHTNING, "lightning", tmp_path_factory)


@pytest.mark.parametrize("name, before, after, point", cases(LIGHTNING))
def test_lightning_resumes_a_checkpoint_of_every_boundary_exactly(
    lightning_runs: dict[str, Any], name: str, before: int, after: int, point: str
) -> None:
    check(LIGHTNING[name][0], lightning_runs[name], before, after, point)


def test_lightning_resumed_twice_in_a_row_keeps_its_loop_state_and_batch_idx(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Resumed from epoch 0's last step, then from that run's checkpoint inside epoch 1 (and from the same
    checkpoint with the epoch progress an older shardplug left there): Lightning's epoch progress is an
    uninterrupted run's, and ``batch_idx`` continues where the checkpoint stood."""
    pytest.importorskip("shardplug_lightning")
    import json

    from _boundary_runs import run_script

    out = tmp_path_factory.mktemp("lightning-chain")
    run_script("lightning_resume_chain.py", out)
    runs = json.loads((out / "chain.json").read_text())
    assert runs["progress"] == {"ready": 2, "started": 2, "processed": 1, "completed": 1}, runs["progress"]
    whole = runs["whole"]
    assert runs["second"] == [row for row in whole if row[0] == 1]
    for name in ("third", "old"):
        assert runs[name] == [row for row in whole if row[0] == 1 and row[1] >= 5], f"{name}: {runs[name][:2]}"
