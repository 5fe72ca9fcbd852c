"""What the boundary matrix's adapters (``boundaries_<front end>.py``) share: the user's DataLoader of a setup, and
the first runs and relays of a front end whose loop saves a file per point (plain PyTorch, Fabric)."""

from __future__ import annotations

import os
from typing import Any

from _boundaries import Setup
from torch.utils.data import DataLoader


def training_loader(setup: Setup, dataset: Any, worker_context: Any, persistent_workers: bool = True) -> DataLoader:
    """The DataLoader a user hands the front end for ``setup``: ``dataset(setup.n)`` shuffled in batches of
    ``setup.batch`` with its ``drop_last`` and workers (from ``worker_context(setup)``; persistent unless told)."""
    return DataLoader(
        training_data(setup, dataset),
        batch_size=setup.batch,
        shuffle=True,
        drop_last=setup.drop_last,
        num_workers=setup.workers,
        multiprocessing_context=worker_context(setup),
        persistent_workers=persistent_workers and bool(setup.workers),
    )


def training_data(setup: Setup, dataset: Any) -> Any:
    """``dataset(setup.n)``; for ``setup.shuffle == "mixture"`` a ``shardplug.Mixture`` of its two halves weighted
    alike (every epoch draws each half exactly once: one cycle of each, in its seeded order, interleaved)."""
    samples = dataset(setup.n)
    if setup.shuffle != "mixture":
        return samples
    import shardplug

    half = setup.n // 2
    halves = {"low": [samples[i] for i in range(half)], "high": [samples[i] for i in range(half, setup.n)]}
    return shardplug.Mixture(halves, {"low": 1, "high": 1}, seed=5)


class SavesPointFiles:
    """An adapter whose ``train`` saves ``<point><suffix>`` after the epoch-0 batch of each point, and a relay's
    ``relay_b<batch><suffix>`` after every batch of its first epoch (``processes()``: the run's number)."""

    suffix: str

    def processes(self) -> int:
        raise NotImplementedError

    def train(self, setup: Setup, saves: dict[str, int] | None = None, load: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def first(self, setup: Setup) -> None:
        saves = {point: setup.save_batch(point, self.processes()) for point in setup.saved_points()}
        self.train(setup, saves={point: -1 if batch is None else batch for point, batch in saves.items()})

    def relay(self, setup: Setup, folder: str, processes: int, point: str) -> None:
        saves = {f"relay_b{b}": b for b in range(setup.batches_per_epoch(self.processes()))}
        self.train(setup, saves=saves, load=self.saved(setup, folder, processes)[point])

    def saved(self, setup: Setup, folder: str, processes: int) -> dict[str, str]:
        return {point: os.path.join(folder, f"{point}{self.suffix}") for point in setup.saved_points()}

    def relay_saved(self, setup: Setup, folder: str, processes: int, epoch: int, batch: int) -> str:
        return os.path.join(folder, f"relay_b{batch}{self.suffix}")

    def variants(self, point: str, path: str, epoch: int) -> list[tuple[str, str]]:
        return [(point, path)]
