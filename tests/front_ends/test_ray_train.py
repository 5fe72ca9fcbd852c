"""Ray Train's ``TorchTrainer`` with ``shardplug.prepare_data_loader`` in its training function.

A local Ray cluster started here (one for the module: no dashboard, no usage stats), CPU workers
and gloo, as docs/ray.md shows. A run of 2 workers trains a whole epoch, then 2 steps of the next,
and reports a checkpoint holding the loader's position (``ray.train.report(checkpoint=...)``); a
run of 3 workers under the same run name gets it back (``ray.train.get_checkpoint()``) and
finishes that epoch. Each worker records its batches and which rows were padding: every sample
once per epoch, and across the two runs once in the resized epoch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

# ray is imported by the tests that run, not at collection (its import takes seconds)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray[train] (the test extra)")

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, BATCH, SEED = 28, 2, 5
STOP_AFTER = 2  # steps of the second epoch before the checkpoint
QUIET = {  # a local cluster that starts and stops quickly and writes nothing it need not
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",  # the controller sees a run end at once (default: every 2 s)
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_TRAIN_ENABLE_CONTROLLER_STRUCTURED_LOGGING": "0",
    "RAY_TRAIN_ENABLE_WORKER_STRUCTURED_LOGGING": "0",
    "RAY_enable_metrics_collection": "0",
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",
}


def train_function(config: dict[str, Any]) -> None:
    """One Ray Train worker: this process's loader, trained on; a checkpoint reported, or resumed."""
    import tempfile

    import ray.train
    import torch
    from torch.utils.data import DataLoader

    import shardplug

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    loader = shardplug.prepare_data_loader(DataLoader(range(SAMPLES), batch_size=BATCH, shuffle=True), data_seed=SEED)
    loader.track_padding()  # which rows are padding (the last step's, taken from the epoch's start)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    record: dict[str, Any] = {"world": world, "len": [], "epochs": {}}
    checkpoint = ray.train.get_checkpoint()
    epochs = range(config["epochs"])
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            position = torch.load(os.path.join(folder, "loader.pt"), weights_only=True)
        loader.load_state_dict(position)  # the saved epoch's rest, split among this run's workers
        epochs = range(position["epoch"], position["epoch"] + 1)
    for epoch in epochs:
        loader.set_epoch(epoch)
        record["len"].append(len(loader))
        seen = record["epochs"].setdefault(str(epoch), [])
        for step, batch in enumerate(loader):
            loss = model(batch.float().view(-1, 1)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(batch[: loader.batch_real_count].tolist())
            if checkpoint is None and epoch == config["epochs"] - 1 and step + 1 == STOP_AFTER:
                break
    if checkpoint is None:  # every worker reports; process 0 with the position (the same on every process)
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save(loader.state_dict(), os.path.join(folder, "loader.pt"))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"epoch": config["epochs"] - 1}, checkpoint=saved)
    with open(os.path.join(config["out"], f"{config['phase']}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A local Ray cluster for this module; its workers import shardplug from this checkout."""
    import ray

    saved = {key: os.environ.get(key) for key in (*QUIET, "PYTHONPATH")}
    os.environ.update(QUIET)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [saved["PYTHONPATH"]])])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the training function travels by value
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _fit(cluster: Any, tmp_path: Path, phase: str, workers: int, epochs: int) -> list[dict[str, Any]]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_function,
        train_loop_config={"out": str(tmp_path), "phase": phase, "epochs": epochs},
        torch_config=TorchConfig(backend="gloo", timeout_s=60),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(name="shardplug", storage_path=str(tmp_path / "runs")),
    )
    trainer.fit()
    return [json.loads((tmp_path / f"{phase}_rank{r}.json").read_text()) for r in range(workers)]


def _real(records: list[dict[str, Any]], epoch: int) -> list[int]:
    return sorted(i for record in records for batch in record["epochs"].get(str(epoch), []) for i in batch)


def test_ray_train_workers_read_each_sample_once_and_resume_into_another_number(cluster, tmp_path: Path) -> None:
    first = _fit(cluster, tmp_path, "first", workers=2, epochs=2)
    assert [record["world"] for record in first] == [2, 2]
    steps = -(-SAMPLES // (BATCH * 2))
    assert all(record["len"] == [steps, steps] for record in first)  # len() on every worker, each epoch
    assert all(len(record["epochs"]["0"]) == steps for record in first)
    assert _real(first, 0) == list(range(SAMPLES)), "epoch 0: every sample once over the 2 workers"
    before = _real(first, 1)
    assert len(before) == STOP_AFTER * BATCH * 2 and len(set(before)) == len(before)

    resumed = _fit(cluster, tmp_path, "resumed", workers=3, epochs=2)  # the same run: its checkpoint
    assert [record["world"] for record in resumed] == [3, 3, 3]
    rest = SAMPLES - len(before)
    assert all(record["len"] == [-(-rest // (BATCH * 3))] for record in resumed)
    after = _real(resumed, 1)
    assert sorted(before + after) == list(range(SAMPLES)), "the resized epoch: every sample once, exactly"
