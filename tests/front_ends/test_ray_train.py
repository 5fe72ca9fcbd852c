"""Ray Train's ``TorchTrainer`` with ``shardplug.prepare_data_loader`` in its training function.

A local Ray cluster started here (one for the module: no dashboard, no usage stats), CPU workers
and gloo, as docs/ray.md shows. A run of 2 workers trains a whole epoch, then 2 steps of the next,
and reports a checkpoint holding the loader's position (``ray.train.report(checkpoint=...)``); a
run of 3 workers under the same run name gets it back (``ray.train.get_checkpoint()``) and
finishes that epoch. Each worker records its batches and which rows were padding: every sample
once per epoch, and across the two runs once in the resized epoch.

The same two runs read two more loaders, saved in the same checkpoint: a ``shardplug.Mixture`` of three
sources (one 10 times smaller) stopped inside its first epoch and resumed on 3 workers through its second
(the global sequence is the mixture's, every sample once per source cycle), and the loader of Ray's own
``ray.train.torch.prepare_data_loader`` (a ``DistributedSampler`` of the job's, in a wrapper that moves batches
to the device) prepared by shardplug: native DDP's batches, and its position resumed exactly on 3 workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from _datasets import check_mixture_read

# ray is imported by the tests that run, not at collection (its import takes seconds)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray[train] (the test extra)")

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, BATCH, SEED = 28, 2, 5
STOP_AFTER = 2  # steps of the second epoch before the checkpoint
MIXTURE_STOP = 3  # steps of the mixture's first epoch before the checkpoint (2 workers: 12 of its 53 positions)
DDP_SAMPLES = 23  # the DistributedSampler's: neither 2 nor 3 workers divide them (padding)
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
    extra = {"mixture": _mixture_loader(), "ddp": _ddp_loader()}
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            for name, prepared in extra.items():
                prepared.load_state_dict(torch.load(os.path.join(folder, f"{name}.pt"), weights_only=True))
    mixture, ddp = extra["mixture"], extra["ddp"]
    if checkpoint is None:  # the mixture: MIXTURE_STOP steps of epoch 0; DDP's: epoch 0, STOP_AFTER steps of 1
        record["mixture"] = _read(mixture, [0], MIXTURE_STOP)
        record["ddp_len"] = [len(ddp)]
        record["ddp"] = _read(ddp, [0], None) + _read(ddp, [1], STOP_AFTER)
    else:  # the rest of the saved epoch (and the mixture's next one) on this run's workers
        record["mixture"] = _read(mixture, [mixture.epoch, mixture.epoch + 1], None)
        record["ddp_len"] = [len(ddp)]
        record["ddp"] = _read(ddp, [ddp.epoch], None)
    if checkpoint is None:  # every worker reports; process 0 with the position (the same on every process)
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save(loader.state_dict(), os.path.join(folder, "loader.pt"))
                for name, prepared in extra.items():
                    torch.save(prepared.state_dict(), os.path.join(folder, f"{name}.pt"))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"epoch": config["epochs"] - 1}, checkpoint=saved)
    with open(os.path.join(config["out"], f"{config['phase']}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _mixture() -> Any:
    from _datasets import MIXTURE_WEIGHTS, mixture_sources

    import shardplug

    return shardplug.Mixture(mixture_sources(), MIXTURE_WEIGHTS, seed=SEED)


def _mixture_loader() -> Any:
    """The mixture's loader on this worker (the process group Ray set up tells the processes)."""
    from torch.utils.data import DataLoader

    import shardplug

    return shardplug.prepare_data_loader(DataLoader(_mixture(), batch_size=BATCH))


def _ddp_loader() -> Any:
    """Ray's own ``prepare_data_loader`` (a ``DistributedSampler`` of the job's, shuffled, seed 0, in Ray's
    wrapper), then shardplug's."""
    import ray.train.torch
    from torch.utils.data import DataLoader

    import shardplug

    ray_loader = ray.train.torch.prepare_data_loader(DataLoader(range(DDP_SAMPLES), batch_size=BATCH, shuffle=True))
    return shardplug.prepare_data_loader(ray_loader)


def _read(loader: Any, epochs: list[int], stop: int | None) -> list[list[Any]]:
    """``[epoch, batch, real rows]`` of each batch of ``epochs``, up to ``stop`` batches of each (``None``: all)."""
    loader.track_padding()
    rows = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            rows.append([epoch, batch.tolist(), loader.batch_real_count])
            if stop is not None and step + 1 == stop:
                break
    return rows


@pytest.fixture(scope="module")
def cluster() -> Any:
    """A local Ray cluster for this module; its workers import shardplug (and the tests' helpers) from this
    checkout."""
    import ray

    saved = {key: os.environ.get(key) for key in (*QUIET, "PYTHONPATH")}
    os.environ.update(QUIET)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [saved["PYTHONPATH"]])])
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


@pytest.fixture(scope="module")
def fits(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], list[Any]]:
    """The two runs every test below reads: 2 workers, then 3 resuming their checkpoint (each worker's record)."""
    tmp_path = tmp_path_factory.mktemp("ray")
    first = _fit(cluster, tmp_path, "first", workers=2, epochs=2)
    return first, _fit(cluster, tmp_path, "resumed", workers=3, epochs=2)


def test_ray_train_workers_read_each_sample_once_and_resume_into_another_number(fits) -> None:
    first, resumed = fits
    assert [record["world"] for record in first] == [2, 2]
    steps = -(-SAMPLES // (BATCH * 2))
    assert all(record["len"] == [steps, steps] for record in first)  # len() on every worker, each epoch
    assert all(len(record["epochs"]["0"]) == steps for record in first)
    assert _real(first, 0) == list(range(SAMPLES)), "epoch 0: every sample once over the 2 workers"
    before = _real(first, 1)
    assert len(before) == STOP_AFTER * BATCH * 2 and len(set(before)) == len(before)

    assert [record["world"] for record in resumed] == [3, 3, 3]
    rest = SAMPLES - len(before)
    assert all(record["len"] == [-(-rest // (BATCH * 3))] for record in resumed)
    after = _real(resumed, 1)
    assert sorted(before + after) == list(range(SAMPLES)), "the resized epoch: every sample once, exactly"


def _global(records: list[dict[str, Any]], key: str, epoch: int) -> list[int]:
    """The real rows of ``epoch`` over all workers in global order: step by step, worker by worker."""
    batches = [[rows[:real] for e, rows, real in record[key] if e == epoch] for record in records]
    assert len({len(each) for each in batches}) == 1, f"{key}: the same number of steps on every worker"
    return [i for step in zip(*batches) for rows in step for i in rows]


def test_ray_train_reads_a_mixture_in_its_global_order_across_a_resize(fits) -> None:
    """Saved on 2 workers inside the mixture's first epoch, resumed on 3 (the same run: its checkpoint) through
    its second: the global sequence is the uninterrupted one (the mixture's own positions), every sample once per
    source cycle."""
    first, resumed = fits
    before = _global(first, "mixture", 0)
    assert len(before) == MIXTURE_STOP * BATCH * 2
    check_mixture_read(before + _global(resumed, "mixture", 0) + _global(resumed, "mixture", 1), _mixture())


def test_ray_train_prepare_data_loader_keeps_native_ddp_batches_and_resumes_exactly(fits) -> None:
    """Ray's ``prepare_data_loader`` then shardplug's: native DDP's batches on each of the 2 workers (epoch 0, and
    epoch 1 until the checkpoint), with its length; resumed on 3, the rest of epoch 1's order dealt as torch's
    sampler deals it (worker ``r``: positions ``start + r, start + r + 3, ...``), every sample of it once."""
    from torch.utils.data import DataLoader, DistributedSampler

    first, resumed = fits

    for rank, record in enumerate(first):
        native = []
        for epoch in (0, 1):
            sampler = DistributedSampler(range(DDP_SAMPLES), num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            native += [[epoch, b.tolist()] for b in DataLoader(range(DDP_SAMPLES), batch_size=BATCH, sampler=sampler)]
        steps = -(-len(sampler) // BATCH)
        assert record["ddp_len"] == [steps] and len(record["ddp"]) == steps + STOP_AFTER
        assert [[epoch, batch] for epoch, batch, _ in record["ddp"]] == native[: steps + STOP_AFTER], "DDP's batches"
        padding = [len(batch) - real for _, batch, real in record["ddp"]]  # the wrapped-around row: the last
        assert padding == [0] * (steps - 1) + [rank + 1 - DDP_SAMPLES % 2] + [0] * STOP_AFTER, "padding marked"
    sampler = DistributedSampler(range(DDP_SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(1)
    order = list(sampler)
    start = STOP_AFTER * BATCH * 2
    for rank, record in enumerate(resumed):
        assert all(epoch == 1 for epoch, _, _ in record["ddp"])
        rest = [i for _, rows, real in record["ddp"] for i in rows[:real]]
        assert rest == order[start + rank :: 3], f"worker {rank}: its stride of the rest of epoch 1's order"
        assert record["ddp_len"] == [len(record["ddp"])]
    before = [i for record in first for e, rows, real in record["ddp"] if e == 1 for i in rows[:real]]
    after = [i for record in resumed for _, rows, real in record["ddp"] for i in rows[:real]]
    assert sorted(before + after) == list(range(DDP_SAMPLES)), "epoch 1 across the resize: every sample once"
