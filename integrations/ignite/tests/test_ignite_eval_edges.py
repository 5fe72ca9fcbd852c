"""Ignite evaluation on tiny sets (gloo, 2 CPU processes, one launch): an evaluation set smaller than
one global batch, more processes than batches, two evaluation loaders of which one is tiny, with the
default options and with ``even_batches=False`` in the training config. Every rank runs every
evaluation step (a per-step all-reduce proves it) and the metrics count each sample once."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from ignite.metrics import Accuracy, Loss
from torch.utils.data import DataLoader, TensorDataset

from shardplug.core.config import ShardplugConfig
from shardplug_ignite import ShardplugHandler, drop_padding_if_tracked

WORLD = 2
SETS = {"three": (3, 4), "five": (5, 4), "big": (27, 4)}  # (samples, batch): 3 < 1 batch < 2 processes


def _dataset(n: int) -> TensorDataset:
    idx = torch.arange(n, dtype=torch.float32)
    return TensorDataset(torch.stack([idx, torch.sin(idx), torch.cos(0.5 * idx)], dim=1), torch.arange(n) % 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 3)


def _features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x[:, 1:])


def _evaluate(evaluator: Engine, handler: ShardplugHandler, name: str) -> dict[str, Any]:
    n, batch_size = SETS[name]
    seen: list[int] = []
    steps: list[int] = []

    def record(engine: Engine) -> None:
        x, _ = drop_padding_if_tracked(engine.state.batch, engine.state.dataloader)
        seen.extend(int(v) for v in x[:, 0].tolist())
        steps.append(int(idist.all_reduce(torch.tensor(1))))  # a per-step collective: every rank is here

    handle = evaluator.add_event_handler(Events.ITERATION_COMPLETED, record)
    evaluator.run(handler.prepare_eval_loader(DataLoader(_dataset(n), batch_size=batch_size)))
    handle.remove()
    return {"seen": seen, "steps": steps, "metrics": dict(evaluator.state.metrics)}


def _worker(local_rank: int, out_dir: str) -> None:
    res: dict[str, Any] = {}
    for label, config in (("default", ShardplugConfig()), ("uneven", ShardplugConfig(even_batches=False))):
        handler = ShardplugHandler(config)
        evaluator = handler.create_evaluator(
            _model(), {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)}, model_fn=_features
        )
        res[label] = {name: _evaluate(evaluator, handler, name) for name in ("three", "five", "big", "three")}
        res[label]["two_loaders"] = [_evaluate(evaluator, handler, name) for name in ("big", "three")]
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # see test_ignite_engine._run_then_exit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reference(n: int) -> dict[str, float]:
    data = _dataset(n)
    with torch.no_grad():
        y_pred = _features(_model(), data.tensors[0])
    y = data.tensors[1]
    return {"accuracy": float((y_pred.argmax(1) == y).float().mean()), "loss": float(F.cross_entropy(y_pred, y))}


def test_tiny_evaluation_sets_run_on_every_rank_and_count_each_sample_once(tmp_path: Path) -> None:
    with idist.Parallel(
        backend="gloo", nproc_per_node=WORLD, master_port=_free_port(), timeout=datetime.timedelta(seconds=40)
    ) as parallel:
        parallel.run(_worker, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for label in ("default", "uneven"):
        runs = [
            [(name, r[label][name]) for name in ("three", "five", "big")]
            + [(name, run) for name, run in zip(("big", "three"), r[label]["two_loaders"])]
            for r in ranks
        ]
        for per_rank in zip(*runs):
            name = per_rank[0][0]
            n = SETS[name][0]
            steps = [run["steps"] for _, run in per_rank]
            assert steps[0] == steps[1] and steps[0] and all(s == WORLD for s in steps[0]), (label, name, steps)
            seen = sorted(i for _, run in per_rank for i in run["seen"])
            assert seen == list(range(n)), (label, name, seen)  # each sample exactly once
            expected = _reference(n)
            for _, run in per_rank:
                assert abs(run["metrics"]["accuracy"] - expected["accuracy"]) < 1e-6, (label, name)
                assert abs(run["metrics"]["loss"] - expected["loss"]) < 1e-5, (label, name)
