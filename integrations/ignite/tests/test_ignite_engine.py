"""The Ignite integration under a real ``Engine`` and ``idist.Parallel`` (gloo, 2 CPU processes).

Each launch runs several scenarios per rank and writes one JSON file per rank; the assertions run in
the test process against references computed independently of shardplug.  One launch on 2 processes
(the module's fixture :func:`two_processes`) runs the data, stepping and first elastic scenarios, each
in a folder of its own; the elastic resume on 3 processes is a launch of its own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import pytest
import torch
import torch.nn.functional as F
from ignite.engine import DeterministicEngine, Engine, Events
from ignite.handlers import Checkpoint, DiskSaver
from ignite.metrics import Accuracy, Loss
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from shardplug import TokenBudgetBatchSampler
from shardplug.core.config import ShardplugConfig
from shardplug_ignite import ShardplugEvents, ShardplugHandler

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_then_exit(local_rank: int, fn: Any, out_dir: str) -> None:
    """Run ``fn`` in a spawned rank, then leave at once: about one exit in 15 of a gloo rank of this
    torch aborts in its C++ teardown (SIGABRT with no Python frame, after all the work is done and
    the results written; seen with and without shardplug's changes), which would fail the test."""
    fn(local_rank, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(fn: Any, tmp_path: Path, world: int = WORLD) -> list[dict[str, Any]]:
    with idist.Parallel(backend="gloo", nproc_per_node=world, master_port=_free_port()) as parallel:
        parallel.run(_run_then_exit, fn, str(tmp_path))
    return _ranks(tmp_path, world)


def _ranks(out_dir: Path, world: int = WORLD) -> list[dict[str, Any]]:
    """What each rank of a scenario wrote to ``out_dir``."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def _dataset(n: int) -> TensorDataset:
    """x = [index, two features]; y = index % 3 (a class) — the index lets us see which sample came."""
    idx = torch.arange(n, dtype=torch.float32)
    x = torch.stack([idx, torch.sin(idx), torch.cos(0.5 * idx)], dim=1)
    return TensorDataset(x, (torch.arange(n) % 3))


def _features(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x[:, 1:])


def _indices(batch: Any) -> list[int]:
    return [int(v) for v in batch[0][:, 0].tolist()]


def _record_epochs(config: ShardplugConfig, n: int, batch_size: int, shuffle: bool, epochs: int) -> dict[str, Any]:
    """Run a trainer whose process function only records the indices it receives."""
    handler = ShardplugHandler(config)
    loader = handler.prepare_data_loader(DataLoader(_dataset(n), batch_size=batch_size, shuffle=shuffle))
    return _record_run(handler, loader, epochs)


def _record_run(handler: ShardplugHandler, loader: Any, epochs: int) -> dict[str, Any]:
    seen: dict[int, list[list[int]]] = {}

    def step(engine: Engine, batch: Any) -> None:
        seen.setdefault(engine.state.epoch, []).append(_indices(batch))

    trainer = Engine(step)
    handler.attach(trainer)
    trainer.run(loader, max_epochs=epochs)
    return {"batches": [seen[e] for e in sorted(seen)], "seeds": loader.state_dict()["seeds"]}


# -- launch 1: data sharding, equal-length check, evaluation -------------------------------------
def _eval_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 3)


def _evaluate(config: ShardplugConfig, n: int, batch_size: int) -> dict[str, Any]:
    handler = ShardplugHandler(config)
    loader = handler.prepare_eval_loader(DataLoader(_dataset(n), batch_size=batch_size))
    evaluator = handler.create_evaluator(
        _eval_model(), {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)}, model_fn=_features
    )
    counted: list[int] = []
    evaluator.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: counted.extend(int(v) for v in e.state.output[1].tolist())
    )
    evaluator.run(loader)
    return {"metrics": dict(evaluator.state.metrics), "iterations": evaluator.state.iteration, "labels": counted}


def _record_stream(out_dir: str, epochs: int) -> dict[str, Any]:
    """A Hugging Face stream of the parquet shards, 2 DataLoader workers, through the handler."""
    import datasets

    files = sorted(str(p) for p in Path(out_dir, "hf").glob("*.parquet"))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    handler = ShardplugHandler(ShardplugConfig())
    # workers from a fork server: forking a process whose gloo and pyarrow threads run can deadlock a worker
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "datasets"])
    loader = handler.prepare_data_loader(
        DataLoader(stream, batch_size=3, num_workers=2, multiprocessing_context=context)
    )
    seen: dict[int, list[list[int]]] = {}
    trainer = Engine(lambda engine, batch: seen.setdefault(engine.state.epoch, []).append(batch["x"].tolist()))
    handler.attach(trainer)
    trainer.run(loader, max_epochs=epochs)
    return {"batches": [seen[e] for e in sorted(seen)], "dataset": type(loader.dataset).__module__}


def _worker_data(local_rank: int, out_dir: str) -> None:
    torch.manual_seed(100 + idist.get_rank())  # ranks seeded differently: shuffles must still agree
    res: dict[str, Any] = {}
    res["default"] = _record_epochs(ShardplugConfig(), 21, 3, False, 2)
    res["split"] = _record_epochs(ShardplugConfig(split_batches=True), 22, 4, False, 2)
    handler = ShardplugHandler(ShardplugConfig())  # idist.auto_dataloader's arguments, with a batch sampler
    loader = handler.auto_dataloader(_dataset(21), batch_sampler=BatchSampler(SequentialSampler(range(21)), 3, False))
    res["auto_batch_sampler"] = {**_record_run(handler, loader, 2), "batch_size": loader.batch_size}
    res["shuffle"] = _record_epochs(ShardplugConfig(), 20, 3, True, 3)
    # code written for DDP: idist.auto_dataloader's own DistributedSampler, and one given to handler.auto_dataloader
    handler = ShardplugHandler(ShardplugConfig())
    res["idist_auto"] = _record_run(
        handler, handler.prepare_data_loader(idist.auto_dataloader(_dataset(21), batch_size=6, shuffle=True)), 2
    )
    handler = ShardplugHandler(ShardplugConfig())
    data = _dataset(21)
    res["auto_ddp_sampler"] = _record_run(
        handler, handler.auto_dataloader(data, batch_size=6, sampler=DistributedSampler(data, seed=3)), 2
    )
    try:
        _record_epochs(ShardplugConfig(even_batches=False), 21, 3, False, 1)
        res["uneven_error"] = None
    except RuntimeError as exc:
        res["uneven_error"] = str(exc)
    try:
        ShardplugHandler().attach(DeterministicEngine(lambda e, b: None))
        res["deterministic_error"] = None
    except TypeError as exc:
        res["deterministic_error"] = str(exc)
    res["eval_default"] = _evaluate(ShardplugConfig(), 21, 3)
    res["eval_split"] = _evaluate(ShardplugConfig(split_batches=True), 21, 4)
    res["stream"] = _record_stream(out_dir, 2)
    idist.barrier()
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(res))


def _reference_shards(order: list[int], batch_size: int, split: bool) -> list[list[list[int]]]:
    """Per-rank batches of one epoch, from the documented rule (docs/semantics.md)
    (pad the last step from the epoch start)."""
    step = batch_size if split else batch_size * WORLD
    padded = list(order)
    while len(padded) % step:
        padded.append(order[(len(padded) - len(order)) % len(order)])
    per_rank: list[list[list[int]]] = [[] for _ in range(WORLD)]
    for start in range(0, len(padded), step):
        chunk = padded[start : start + step]
        width = step // WORLD
        for r in range(WORLD):
            per_rank[r].append(chunk[r * width : (r + 1) * width])
    return per_rank


def _reference_eval(n: int) -> dict[str, float]:
    data = _dataset(n)
    with torch.no_grad():
        logits = _features(_eval_model(), data.tensors[0])
    y = data.tensors[1]
    return {
        "accuracy": float((logits.argmax(dim=1) == y).float().mean()),
        "loss": float(F.cross_entropy(logits, y)),
    }


def test_ignite_sharding_length_check_and_evaluation(two_processes: dict[str, Any]) -> None:
    shards, ranks = two_processes["shards"], two_processes["data"]

    # a Hugging Face stream: sharded natively (each rank reads its own shards), equal steps, every row
    assert all(ranks[r]["stream"]["dataset"].startswith("datasets") for r in range(WORLD))
    for epoch in range(2):
        batches = [ranks[r]["stream"]["batches"][epoch] for r in range(WORLD)]
        assert len(batches[0]) == len(batches[1]), "equal steps (the shorter part pads)"
        seen = [x for rank in batches for batch in rank for x in batch]
        assert set(seen) == set(range(sum(shards))), f"epoch {epoch}: every row"

    for name, n, b, split in (("default", 21, 3, False), ("split", 22, 4, True), ("auto_batch_sampler", 21, 3, False)):
        expected = _reference_shards(list(range(n)), b, split)
        for r in range(WORLD):
            assert ranks[r][name]["batches"] == [expected[r]] * 2, (name, r)
    # handler.auto_dataloader(dataset, batch_sampler=...): its batches shared out whole, as prepare_data_loader
    # does; batch_size None, as torch's DataLoader built with a batch sampler says
    assert all(ranks[r]["auto_batch_sampler"]["batch_size"] is None for r in range(WORLD))

    # shuffle: one seed agreed from rank 0, epoch e draws perm(seed + e), a new order every epoch
    seeds = [ranks[r]["shuffle"]["seeds"] for r in range(WORLD)]
    assert seeds[0] == seeds[1] and len(seeds[0]) == 1 and seeds[0][0] is not None
    orders = []
    for epoch in range(3):
        order = torch.randperm(20, generator=torch.Generator().manual_seed(seeds[0][0] + epoch)).tolist()
        orders.append(order)
        expected = _reference_shards(order, 3, False)
        for r in range(WORLD):
            assert ranks[r]["shuffle"]["batches"][epoch] == expected[r], (epoch, r)
        every = sorted(i for r in range(WORLD) for b in ranks[r]["shuffle"]["batches"][epoch] for i in b)
        assert set(every) == set(range(20))
    assert orders[0] != orders[1] != orders[2]

    # a DistributedSampler (idist.auto_dataloader's, or the user's): adopted, the batches native DDP gives, the
    # handler's set_epoch reaching it every epoch
    for name, seed in (("idist_auto", 0), ("auto_ddp_sampler", 3)):
        for r in range(WORLD):
            native = []
            for epoch in range(2):
                sampler = DistributedSampler(range(21), num_replicas=WORLD, rank=r, seed=seed)
                sampler.set_epoch(epoch)
                native.append([b.tolist() for b in DataLoader(range(21), batch_size=3, sampler=sampler)])
            assert ranks[r][name]["batches"] == native, (name, r)

    for r in range(WORLD):
        message = ranks[r]["uneven_error"]
        assert message is not None and "[4, 3]" in message and "even_batches" in message
        assert "DeterministicEngine" in (ranks[r]["deterministic_error"] or "")

    # evaluation: every sample counted once (21 samples: padded to 24 by both layouts)
    for name in ("eval_default", "eval_split"):
        labels = ranks[0][name]["labels"] + ranks[1][name]["labels"]
        assert sorted(labels) == sorted(int(i) % 3 for i in range(21)), name
        assert ranks[0][name]["iterations"] == ranks[1][name]["iterations"]
        reference = _reference_eval(21)
        for r in range(WORLD):
            for key, value in reference.items():
                assert ranks[r][name]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key, r)


# -- launch 2: stepping (accumulation, AMP skip, schedulers, events) and resume -------------------
def _regression_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(2, 1)


def _regression_target(y: torch.Tensor) -> torch.Tensor:
    return y.float().unsqueeze(1)


def _stepping() -> dict[str, Any]:
    """n=14, batch 1 per rank: epoch_length 7, gradient_accumulation_steps=2, loss = inf at iteration 4."""
    scaler = torch.amp.GradScaler("cpu")
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2), scaler=scaler)
    loader = handler.prepare_data_loader(DataLoader(_dataset(14), batch_size=1))
    model = idist.auto_model(_regression_model())  # DDP under gloo
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    holder: dict[str, Engine] = {}

    def loss_fn(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(y_pred.float(), _regression_target(y))
        return loss * math.inf if holder["trainer"].state.iteration == 4 else loss

    trainer = handler.create_trainer(model, optimizer, loss_fn, model_fn=_features)
    holder["trainer"] = trainer
    prepared = handler.optimizers[0]
    plain = handler.attach_scheduler(trainer, torch.optim.lr_scheduler.StepLR(prepared, step_size=1, gamma=0.9))
    n_fold = handler.attach_scheduler(
        trainer,
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 1),
        optimizers=[prepared],
        scale_scheduler_by_num_processes=True,
    )
    rec: dict[str, Any] = {"completed": [], "skipped": [], "every3": [], "sync": [], "lr": [], "grads_nonsync": []}
    trainer.add_event_handler(
        ShardplugEvents.OPTIMIZER_STEP_COMPLETED, lambda e: rec["completed"].append(e.state.iteration)
    )
    trainer.add_event_handler(
        ShardplugEvents.OPTIMIZER_STEP_SKIPPED, lambda e: rec["skipped"].append(e.state.iteration)
    )
    trainer.add_event_handler(
        ShardplugEvents.OPTIMIZER_STEP_COMPLETED(every=3), lambda e: rec["every3"].append(e.state.optimizer_step)
    )

    def after_iteration(engine: Engine) -> None:
        rec["sync"].append(handler.sync_gradients)
        rec["lr"].append(prepared.param_groups[0]["lr"])
        if not handler.sync_gradients:  # gradients still local: no all-reduce happened (no_sync)
            rec["grads_nonsync"].append(model.module.weight.grad.flatten().tolist())

    trainer.add_event_handler(Events.ITERATION_COMPLETED, after_iteration)
    trainer.run(loader, max_epochs=2)
    rec["plain_last_epoch"] = plain.last_epoch
    rec["n_fold_last_epoch"] = n_fold.last_epoch
    rec["optimizer_step"] = trainer.state.optimizer_step
    rec["optimizer_step_skipped"] = trainer.state.optimizer_step_skipped
    rec["weight"] = model.module.weight.flatten().tolist()
    return rec


def _checkpointing(
    trainer: Engine, to_save: dict[str, Any], ckpt_dir: Path, save_at: Any, stop_at: int | None, resume: bool
) -> None:
    """Save ``to_save`` on rank 0 at ``save_at`` and stop after iteration ``stop_at``; or load the one checkpoint."""
    if stop_at is not None:
        checkpoint = Checkpoint(to_save, DiskSaver(str(ckpt_dir), require_empty=False), n_saved=None, save_on_rank=0)
        trainer.add_event_handler(save_at, checkpoint)
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate())
    if resume:
        files = sorted(ckpt_dir.glob("*.pt"))
        assert len(files) == 1, files
        Checkpoint.load_objects(to_save, str(files[0]))


def _resume_parts(
    ckpt_dir: Path, stop_at: int | None, resume: bool
) -> tuple[list[Any], list[float], dict[str, Any], list[list[int]]]:
    """3 epochs of 5 iterations (n=20, batch 2 per rank, shuffled, accumulation 2); the last part is
    ``[epoch, len(loader)]`` at each ``EPOCH_STARTED`` (after the handler's)."""
    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
    torch.manual_seed(1234 if resume else 7)  # a resumed run must take the seed from the checkpoint
    loader = handler.prepare_data_loader(DataLoader(_dataset(20), batch_size=2, shuffle=True))
    model = idist.auto_model(_regression_model())  # DDP: the replicas stay equal, rank 0 saves for all
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_fn(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(y_pred, _regression_target(y))

    trainer = handler.create_trainer(model, optimizer, loss_fn, model_fn=_features)
    seen: list[Any] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: seen.append([e.state.iteration, _indices(e.state.batch), handler.sync_gradients]),
    )
    starts: list[list[int]] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: starts.append([e.state.epoch, len(loader)]))
    to_save = {"trainer": trainer, "model": model, "optimizer": handler.optimizers[0], "shardplug": handler}
    _checkpointing(trainer, to_save, ckpt_dir, ShardplugEvents.OPTIMIZER_STEP_COMPLETED(every=4), stop_at, resume)
    trainer.run(loader, max_epochs=3)
    return seen, model.module.weight.flatten().tolist(), dict(handler.state_dict()), starts


def _worker_stepping(local_rank: int, out_dir: str) -> None:
    res: dict[str, Any] = {"stepping": _stepping()}
    ckpt = Path(out_dir, "ckpt")
    full, full_weight, _, _ = _resume_parts(ckpt, None, False)
    first, _, _, _ = _resume_parts(ckpt, 7, False)  # checkpoint at real step 4 = iteration 7 (epoch 2)
    idist.barrier()
    rest, rest_weight, state, starts = _resume_parts(ckpt, None, True)
    res["resume"] = {"full": full, "first": first, "rest": rest, "full_weight": full_weight, "rest_weight": rest_weight}
    res["resume"]["epoch_starts"] = starts
    res["resume_state"] = state
    idist.barrier()
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(res))


def test_ignite_stepping_and_resume(two_processes: dict[str, Any]) -> None:
    ranks = two_processes["stepping"]
    for r in range(WORLD):
        rec = ranks[r]["stepping"]
        # sync at every 2nd micro-batch and at the end of each epoch (7 iterations per epoch)
        assert rec["sync"] == [False, True, False, True, False, True, True, False, True, False, True, False, True, True]
        assert rec["completed"] == [2, 6, 7, 9, 11, 13, 14]
        assert rec["skipped"] == [4]
        assert rec["every3"] == [3, 6]
        assert rec["optimizer_step"] == 7 and rec["optimizer_step_skipped"] == 1
        assert rec["plain_last_epoch"] == 7  # one scheduler step per real optimizer step
        assert rec["n_fold_last_epoch"] == 14  # scale_scheduler_by_num_processes=True: N per real step
        lr = rec["lr"]
        assert lr[0] == pytest.approx(0.1) and lr[1] == pytest.approx(0.09)
        assert lr[1] == lr[2] == lr[3] == lr[4]  # no step while accumulating, none for the skipped step
        assert len(set(lr)) == 8  # 7 real steps changed it
        assert len(rec["grads_nonsync"]) == 6
    # DDP: non-sync micro-batches kept local gradients (they differ), sync ones kept the replicas equal
    assert ranks[0]["stepping"]["grads_nonsync"] != ranks[1]["stepping"]["grads_nonsync"]
    assert ranks[0]["stepping"]["weight"] == ranks[1]["stepping"]["weight"]

    for r in range(WORLD):
        res = ranks[r]["resume"]
        full, first, rest = res["full"], res["first"], res["rest"]
        assert [row[0] for row in full] == list(range(1, 16))
        assert first == full[:7]
        assert [row[0] for row in rest] == list(range(8, 16))  # no replayed iteration
        assert rest == full[7:]  # the same batches and sync flags as the uninterrupted run
        assert res["rest_weight"] == pytest.approx(res["full_weight"], abs=1e-6)
        assert ranks[r]["resume_state"]["optimizer_step"] == 9
        # len(loader) as each epoch starts: the rest of the resumed epoch 2 (after 2 of its 5 iterations), then
        # a whole epoch 3 (Ignite stops the resumed pass at epoch_length, never asking it for more)
        assert res["epoch_starts"] == [[2, 3], [3, 5]]
    # and the two ranks saw disjoint halves of each shuffled epoch
    for epoch in range(3):
        rows = [ranks[r]["resume"]["full"][epoch * 5 : (epoch + 1) * 5] for r in range(WORLD)]
        samples = sorted(i for r in range(WORLD) for row in rows[r] for i in row[1])
        assert samples == list(range(20))


# -- resuming with another number of processes ------------------------------------------------
ELASTIC_N, ELASTIC_STOP = 24, 4  # 24 samples, batch 2 per rank; the 2-process run stops after iteration 4


BUDGET_LENGTHS = [(5 * i) % 7 + 1 for i in range(36)]  # tokens per sample of the token-budget elastic run


def _elastic_run(out_dir: str, stop_at: int | None, resume: bool, budget: bool = False) -> dict[str, Any]:
    """2 epochs over 24 shuffled samples (seed 11), batch 2 per rank, a StepLR the handler saves; with
    ``budget``, one epoch of micro-batches by a token budget (36 samples, budget 9, accumulation 2) instead."""
    if budget:
        handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
        sampler = TokenBudgetBatchSampler(BUDGET_LENGTHS, 9, cost="attention", seed=2)
        loader = handler.prepare_data_loader(DataLoader(_dataset(len(BUDGET_LENGTHS)), batch_sampler=sampler))
    else:
        handler = ShardplugHandler(ShardplugConfig(use_seedable_sampler=True, data_seed=11))
        loader = handler.prepare_data_loader(DataLoader(_dataset(ELASTIC_N), batch_size=2, shuffle=True))
    loader.track_padding()  # which rows are padding (the end of an epoch is padded)
    model = idist.auto_model(_regression_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = handler.create_trainer(
        model, optimizer, lambda p, y: F.mse_loss(p, _regression_target(y)), model_fn=_features
    )
    handler.attach_scheduler(trainer, torch.optim.lr_scheduler.StepLR(handler.optimizers[0], step_size=1, gamma=0.9))
    rec: dict[str, Any] = {"rows": [], "lr_first": None}

    def seen(engine: Engine) -> None:
        real = loader.batch_real_count
        indices = _indices(engine.state.batch)
        rec["rows"].append([engine.state.epoch, engine.state.iteration, indices[:real], indices[real:]])

    def first_lr(engine: Engine) -> None:
        if rec["lr_first"] is None:
            rec["lr_first"] = handler.optimizers[0].param_groups[0]["lr"]

    trainer.add_event_handler(Events.ITERATION_STARTED, first_lr)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, seen)
    to_save = {"trainer": trainer, "model": model, "optimizer": handler.optimizers[0], "shardplug": handler}
    save_at = Events.ITERATION_COMPLETED(once=stop_at) if stop_at is not None else None
    _checkpointing(trainer, to_save, Path(out_dir, "budget_elastic" if budget else "elastic"), save_at, stop_at, resume)
    trainer.run(loader, max_epochs=1 if budget else 2)
    rec["epoch_length"] = trainer.state.epoch_length
    rec["lr_last"] = handler.optimizers[0].param_groups[0]["lr"]
    rec["optimizer_step"] = handler.state_dict()["optimizer_step"]
    return rec


def _worker_elastic_first(local_rank: int, out_dir: str) -> None:
    res = {"first": _elastic_run(out_dir, ELASTIC_STOP, False), "budget": _elastic_run(out_dir, 4, False, budget=True)}
    idist.barrier()
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(res))


def _worker_elastic_resumed(local_rank: int, out_dir: str) -> None:
    res = {
        "resumed": _elastic_run(out_dir, None, True),
        "fresh": _elastic_run(out_dir, None, False),
        "budget": _elastic_run(out_dir, None, True, budget=True),
    }
    idist.barrier()
    Path(out_dir, f"rank{idist.get_rank()}.json").write_text(json.dumps(res))


# the scenarios of the module's one launch on 2 processes: each writes to the folder of its name
TWO_PROCESS_SCENARIOS = {"data": _worker_data, "stepping": _worker_stepping, "elastic": _worker_elastic_first}


def _worker_two_processes(local_rank: int, out_dir: str) -> None:
    for name, worker in TWO_PROCESS_SCENARIOS.items():
        worker(local_rank, str(Path(out_dir, name)))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, parquet_shards: Any) -> dict[str, Any]:
    """One launch on 2 processes: what each rank of each scenario wrote, the stream's rows per shard
    (``shards``), and the folder of the first elastic run (``elastic_dir``: its checkpoints)."""
    out = tmp_path_factory.mktemp("ignite_two_processes")
    for name in TWO_PROCESS_SCENARIOS:
        (out / name).mkdir()
    shards = parquet_shards(out / "data" / "hf")
    with idist.Parallel(backend="gloo", nproc_per_node=WORLD, master_port=_free_port()) as parallel:
        parallel.run(_run_then_exit, _worker_two_processes, str(out))
    return {
        **{name: _ranks(out / name) for name in TWO_PROCESS_SCENARIOS},
        "shards": shards,
        "elastic_dir": out / "elastic",
    }


@pytest.fixture(scope="module")
def three_processes(two_processes: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch on 3 processes resuming the 2 processes' checkpoints: what each rank wrote."""
    out = tmp_path_factory.mktemp("ignite_three_processes")
    for name in ("elastic", "budget_elastic"):  # the 2 processes' checkpoints
        shutil.copytree(two_processes["elastic_dir"] / name, out / name)
    return _launch(_worker_elastic_resumed, out, world=3)


def test_ignite_resumes_with_another_number_of_processes_exactly(
    two_processes: dict[str, Any], three_processes: list[dict[str, Any]]
) -> None:
    first = [r["first"] for r in two_processes["elastic"]]
    runs = three_processes
    resumed, fresh = [r["resumed"] for r in runs], [r["fresh"] for r in runs]
    # epoch 1: what the 2 processes read before the checkpoint, and the 3 processes after it
    before = [i for rec in first for epoch, _, real, _ in rec["rows"] if epoch == 1 for i in real]
    after = [i for rec in resumed for epoch, _, real, _ in rec["rows"] if epoch == 1 for i in real]
    assert len(before) == 2 * 2 * ELASTIC_STOP
    assert sorted(before + after) == list(range(ELASTIC_N))  # every sample once: none lost, none repeated
    padding = [i for rec in resumed for epoch, _, _, pad in rec["rows"] if epoch == 1 for i in pad]
    assert len(after) + len(padding) == 2 * 3 * (len(resumed[0]["rows"]) - 4)  # equal steps on every rank
    for r in range(3):
        # the engine counts on the new layout: 24 / (3 x 2) = 4 iterations per epoch
        assert resumed[r]["epoch_length"] == fresh[r]["epoch_length"] == 4
        iterations = [it for _, it, _, _ in resumed[r]["rows"]]
        assert iterations == list(range(iterations[0], 9)) and iterations[0] > 1
        # epoch 2 equals a fresh 3-process run's epoch 2
        assert [row for row in resumed[r]["rows"] if row[0] == 2] == [row for row in fresh[r]["rows"] if row[0] == 2]
        # the schedule continues: 4 real steps before the checkpoint (gamma 0.9 per step)
        assert resumed[r]["lr_first"] == pytest.approx(0.1 * 0.9**ELASTIC_STOP)
        steps_after = len(resumed[r]["rows"])
        assert resumed[r]["lr_last"] == pytest.approx(0.1 * 0.9 ** (ELASTIC_STOP + steps_after))


def test_ignite_resumes_a_token_budget_checkpoint_of_2_processes_on_3_exactly(
    two_processes: dict[str, Any], three_processes: list[dict[str, Any]]
) -> None:
    first = [r["budget"] for r in two_processes["elastic"]]
    resumed = [r["budget"] for r in three_processes]
    assert [len(rec["rows"]) for rec in first] == [4, 4]
    before = [i for rec in first for _, _, real, _ in rec["rows"] for i in real]
    after = [i for rec in resumed for _, _, real, _ in rec["rows"] for i in real]
    assert sorted(before + after) == list(range(len(BUDGET_LENGTHS)))  # every sample once: none lost or repeated
    assert all(sum(BUDGET_LENGTHS[i] for i in real) <= 9 for rec in resumed for _, _, real, _ in rec["rows"])
    counts = {len(rec["rows"]) for rec in resumed}
    assert len(counts) == 1 and counts != {0}  # equal steps on every process
    fresh = len(list(TokenBudgetBatchSampler(BUDGET_LENGTHS, 9, cost="attention", seed=2).plan(3).consumed))
    for rec in resumed:
        assert rec["epoch_length"] == fresh  # the engine counts the epoch on the new layout
        iterations = [it for _, it, _, _ in rec["rows"]]
        assert iterations == list(range(iterations[0], fresh + 1)) and iterations[0] > 1
    assert len({rec["optimizer_step"] for rec in resumed}) == 1 and len({rec["lr_last"] for rec in resumed}) == 1
