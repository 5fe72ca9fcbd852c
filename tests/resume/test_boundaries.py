"""The boundary matrix, in every front end: a position saved at any of an epoch's boundaries resumes exactly on
the same, fewer and more processes.

One parametrized matrix (its setups, relays and runs: ``tests/_boundary_runs.py``; the oracle:
``tests/_boundaries.py``; the scenario program and its adapter per front end: ``tests/scripts/boundaries*.py``),
one class per front end, so that the front ends' runs (a class-scoped fixture each) go side by side under
``pytest -n --dist loadscope``:

* plain PyTorch: ``torch.save`` of ``state_dict()``;
* Lightning: saved by ``ModelCheckpoint``, resumed by ``Trainer.fit(ckpt_path=...)``; a relay's positions saved
  after a resume from an epoch's last step are also resumed with the epoch progress an older shardplug left there
  (``-old``);
* Fabric: ``fabric.save`` / ``fabric.load``;
* Ignite: ``Checkpoint`` and ``Checkpoint.load_objects``.

Every front end steps at the new layout's cycles of the epoch (the core's ``GradientState`` aligns its cycle as a
resumed pass begins; Lightning steps by ``batch_idx``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from _boundaries import Setup
from _boundary_runs import (
    FABRIC,
    FEWER_RELAYS,
    IGNITE,
    LIGHTNING,
    PLAIN,
    RELAYS,
    Layouts,
    Relay,
    cases,
    check,
    check_relay,
    relay_cases,
    scenario_runs,
)


class Matrix:
    """The matrix of one front end: its setups, relays, the package it needs, and whether its relays are also
    resumed as an older shardplug left them (``old``)."""

    front_end: ClassVar[str]
    setups: ClassVar[dict[str, tuple[Setup, Layouts]]]
    relays: ClassVar[dict[str, Relay]]
    needs: ClassVar[str | None] = None
    old: ClassVar[bool] = False

    @pytest.fixture(scope="class")
    @classmethod
    def runs(cls, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        """Every setup's first runs (killed), relay and resumed runs in this front end, by setup id."""
        if cls.needs:
            pytest.importorskip(cls.needs)
        return scenario_runs(cls.front_end, cls.setups, tmp_path_factory, cls.relays)

    def test_resumes_a_checkpoint_of_every_boundary_exactly(
        self, runs: dict[str, Any], name: str, before: int, after: int, point: str
    ) -> None:
        check(self.setups[name][0], runs[name], before, after, point)

    def test_resumes_a_relay_saved_inside_its_epoch_exactly(
        self, runs: dict[str, Any], name: str, after: int, point: str
    ) -> None:
        """A second kill and resize inside the epoch after a first resized resume (from an epoch's last step:
        Lightning's ``batch_idx`` continues), and one where the new layout has no step left in the epoch (the
        run goes on to the next epoch)."""
        check_relay(self.setups[name][0], runs[name], self.relays[name], after, point)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    matrix = metafunc.cls
    if metafunc.function.__name__.endswith("every_boundary_exactly"):
        metafunc.parametrize("name, before, after, point", cases(matrix.setups))
    else:
        metafunc.parametrize("name, after, point", relay_cases(matrix.setups, matrix.relays, old=matrix.old))


class TestPlainPyTorch(Matrix):
    front_end, setups, relays = "plain", PLAIN, RELAYS


class TestLightning(Matrix):
    front_end, setups, relays, needs, old = "lightning", LIGHTNING, RELAYS, "shardplug_lightning", True


class TestFabric(Matrix):
    front_end, setups, relays, needs = "fabric", FABRIC, FEWER_RELAYS, "shardplug_lightning"


class TestIgnite(Matrix):
    front_end, setups, relays, needs = "ignite", IGNITE, FEWER_RELAYS, "shardplug_ignite"
