"""The boundary matrix's scenario program, one for every front end: several jobs in one process group.

Usage: ``python boundaries.py FRONT_END PROCESSES JOBS_JSON``: on PROCESSES ranks of the front end's
adapter (``boundaries_<front end>.py`` here: Lightning, Fabric, Ignite, plain PyTorch), runs each job of
the list in turn, each a ``{"setup": ..., "mode": ..., "out": OUT_DIR, "sources": [...]}`` (the setup of
``tests/_boundaries.py``):

* ``first`` trains 2 epochs, saves a position at every boundary of epoch 0 (after its first, a middle and
  its last optimizer step, inside an accumulation cycle, at its end, after its validation) the front end's
  way, then every rank kills itself (SIGKILL) at the first batch of epoch 1; each rank writes its batches to
  ``OUT_DIR/first_rank<r>.jsonl`` as they come;
* ``relay`` (a source ``CKPT_DIR:N:POINT``) resumes a first run's point and saves after every batch of
  its first epoch, killed in the next (the relay); it writes its batches as a first run does;
* ``resume`` (sources ``CKPT_DIR:N`` of first runs, ``CKPT_DIR:N:EPOCH:POINT=BATCH,...`` of a relay)
  resumes every position of each source (saved on N processes) to the end of epoch 1, then runs a fresh
  run of that size; every rank writes ``OUT_DIR/resume_rank<r>.json``.

A killing job comes last in its list (the test orders them: ``tests/_boundary_runs.py``). A DataLoader
worker (of a fork server) runs this module once more: it imports no front end (:func:`main` imports the
adapter).
"""

from __future__ import annotations

import functools
import importlib
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "scripts")]
from _boundaries import Setup  # noqa: E402  (the tests' helpers)
from _ranks import leave  # noqa: E402  (this directory: how a rank ends)


class Indices(Dataset[torch.Tensor]):
    """The samples ``0 .. n-1``, each its own index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


class Adapter(Protocol):
    """What a front end's adapter (``boundaries_<front end>.py``: ``Adapter(processes, Indices, worker_context)``
    beside its ``PRELOAD``) does; its ``__init__`` starts this program's ranks or leaves that to its front end."""

    rank: int
    out: str  # the running job's folder (its ``ckpt/`` and the rows it writes)

    def first(self, setup: Setup) -> None:
        """Train, saving at every point of ``setup.saved_points()``; killed at the first batch of epoch 1."""

    def relay(self, setup: Setup, folder: str, processes: int, point: str) -> None:
        """Resume a first run's ``point``, saving after every batch of its first epoch; killed in the next."""

    def saved(self, setup: Setup, folder: str, processes: int) -> dict[str, str]:
        """A first run's checkpoint of each point (saved on ``processes`` in ``folder``)."""

    def relay_saved(self, setup: Setup, folder: str, processes: int, epoch: int, batch: int) -> str:
        """A relay's checkpoint after ``batch`` of its ``epoch``."""

    def variants(self, point: str, path: str, epoch: int) -> list[tuple[str, str]]:
        """The relay checkpoints to resume for one position, by key (Lightning adds ``<point>-old``)."""

    def train(self, setup: Setup, load: str | None = None) -> dict[str, Any]:
        """Train to the end of the run (from ``load``): ``{"rows": ..., "counters": [optimizer, scheduler steps]}``."""


def worker_context(setup: Setup, preload: list[str]) -> Any:
    """The multiprocessing context of a setup's DataLoader workers: a rank runs gloo's threads, so its workers
    come from a fork server, which has imported ``preload`` (the adapter's ``PRELOAD``: what a worker imports
    again, else each worker imports it)."""
    if not setup.workers:
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)
    return context


def resume(adapter: Adapter, setup: Setup, sources: list[str]) -> dict[str, Any]:
    """Every position of ``sources`` resumed to the end of the run, and a fresh run: ``{"resumed": {key: result},
    "fresh": result}``, a result being ``{"rows": ..., "counters": [optimizer steps, scheduler steps]}``."""
    out: dict[str, Any] = {"resumed": {}}
    for source in sources:
        folder, processes, *relayed = source.split(":")
        if relayed:  # a relay's positions: EPOCH:point=batch,...
            epoch = int(relayed[0])
            for point, batch in (item.split("=") for item in relayed[1].split(",")):
                path = adapter.relay_saved(setup, folder, int(processes), epoch, int(batch))
                for key, ckpt in adapter.variants(point, path, epoch):
                    out["resumed"][f"relay{processes}:{key}"] = adapter.train(setup, load=ckpt)
            continue
        for point, path in adapter.saved(setup, folder, int(processes)).items():
            out["resumed"][f"{processes}:{point}"] = adapter.train(setup, load=path)
    out["fresh"] = adapter.train(setup)
    return out


def main() -> None:
    front_end, processes, jobs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    module = importlib.import_module(f"boundaries_{front_end}")
    adapter: Adapter = module.Adapter(processes, Indices, functools.partial(worker_context, preload=module.PRELOAD))
    for job in jobs:
        setup, mode, out, sources = Setup(**job["setup"]), job["mode"], job["out"], job["sources"]
        adapter.out = out
        os.makedirs(os.path.join(out, "ckpt"), exist_ok=True)
        if mode == "first":
            adapter.first(setup)
            raise AssertionError("the run was not killed")
        if mode == "relay":  # resumed from a first run's point, saved after every batch of its first epoch
            folder, n, point = sources[0].split(":")
            adapter.relay(setup, folder, int(n), point)
            continue
        result = resume(adapter, setup, sources)
        with open(os.path.join(out, f"resume_rank{adapter.rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    leave()
