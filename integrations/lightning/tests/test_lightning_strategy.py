"""ShardplugDDPStrategy with a real Lightning Trainer on 2 CPU processes (gloo).

``strategy="shardplug_ddp"`` re-executes ``sys.argv`` for rank 1, so the scenarios live in
``scripts/lightning_scenarios.py`` (and the modules it runs: Fabric, model parallelism, litdata and
streaming); one launch runs them all and every rank writes JSON that the tests below check against
``shardplug.prepare_data_loader`` and exact expectations.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, DistributedSampler

import shardplug
import shardplug_lightning
import shardplug_lightning._options
from shardplug import prepare_data_loader
from shardplug.core.config import ShardplugConfig
from shardplug_lightning import ShardplugDDPStrategy, ShardplugFabricDDPStrategy
from shardplug_lightning._registry import STRATEGY_NAMES

SCRIPTS = Path(__file__).parent / "scripts"
N_TRAIN, N_VAL, BATCH, WORLD = 42, 21, 4, 2
PRESPLIT_N = 63  # samples in the litdata and streaming datasets


def _core_tests_on_path() -> None:
    """The core's test helpers (``tests/``) importable."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))


def _stream_helpers() -> Any:
    """The core's test helpers for litdata and streaming (tests/_stream_libraries.py)."""
    _core_tests_on_path()
    import _stream_libraries

    return _stream_libraries


def _write_presplit(out: Path) -> bool:
    """Write the litdata and streaming datasets the scenarios train on; False when a library is missing
    (the scenario is then not run, and its test skips)."""
    helpers = _stream_helpers()
    try:
        helpers.litdata_module()
        helpers.streaming_base()
    except pytest.skip.Exception:
        return False
    helpers.write_litdata(out / "litdata", PRESPLIT_N)
    for name in ("mds", "mds_native0", "mds_native1"):
        helpers.write_mds(out / name, PRESPLIT_N)
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, parquet_shards: Any) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lightning_scenarios")
    shards = parquet_shards(out / "hf")
    presplit = _write_presplit(out)
    _run_script("lightning_scenarios.py", out)
    data: dict[str, Any] = {}
    names = ("default", "split", "predict", "amp", "resume", "limited", "errors", "stream")
    others = (
        "user_samplers",
        "own_sharding",
        "validation_resume",
        "prefetch",
        "fabric",
        "model_parallel",
        "token_budget",
        "token_budget_resize",
        "token_budget_epochs",
    )
    for name in (*names, *others):
        data[name] = [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(WORLD)]
    if presplit:
        data["presplit"] = [json.loads((out / f"presplit_rank{r}.json").read_text()) for r in range(WORLD)]
    data["fabric_epochs"] = json.loads((out / "fabric_epochs.json").read_text())
    data["stream_rows"] = sum(shards)
    return data


def _reference(rank: int, epochs: int, **kwargs: Any) -> list[list[list[int]]]:
    """What ``prepare_data_loader`` gives rank ``rank`` in each epoch (the engine's own answer)."""
    shuffle = kwargs.pop("shuffle", True)
    loader = DataLoader(list(range(N_TRAIN)), batch_size=BATCH, shuffle=shuffle)
    prepared = prepare_data_loader(loader, num_processes=WORLD, process_index=rank, **kwargs)
    result = []
    for epoch in range(epochs):
        prepared.set_epoch(epoch)
        result.append([batch.tolist() for batch in prepared])
    return result


def _by_epoch(train: list[list[Any]], epochs: int) -> list[list[list[int]]]:
    return [[batch for epoch, batch in train if epoch == e] for e in range(epochs)]


# -- training data -------------------------------------------------------------------------------
def test_default_train_batches_equal_prepare_data_loader(runs: dict[str, Any]) -> None:
    for rank, record in enumerate(runs["default"]):
        assert record["strategy"] == "ShardplugDDPStrategy" and record["world_size"] == WORLD
        seed = record["seeds"][0]
        assert seed is not None and record["seeds"] == runs["default"][0]["seeds"]  # agreed from rank 0
        expected = _reference(rank, 2, use_seedable_sampler=True, data_seed=seed)
        assert _by_epoch(record["train"], 2) == expected
        # equal, exact length on every rank (42 samples, 4 per batch, 2 ranks: 6 padded batches)
        assert record["loader"] == {"type": "DataLoaderShard", "len": 6, "num_training_batches": 6}


def _token_budget_reference(rank: int, epochs: int) -> list[list[list[int]]]:
    """What ``prepare_data_loader`` gives rank ``rank`` of the token-budget scenario (its lengths: the script's
    ``TOKEN_LENGTHS``)."""
    lengths = [(7 * i) % 23 + 1 for i in range(N_TRAIN)]
    sampler = shardplug.TokenBudgetBatchSampler(lengths, 40, cost="attention", seed=5)
    prepared = prepare_data_loader(
        DataLoader(list(range(N_TRAIN)), batch_sampler=sampler), num_processes=WORLD, process_index=rank
    )
    result = []
    for epoch in range(epochs):
        prepared.set_epoch(epoch)
        result.append([batch.tolist() for batch in prepared])
    return result


def test_token_budget_micro_batches_with_exact_len_and_estimated_stepping_batches(runs: dict[str, Any]) -> None:
    records = runs["token_budget"]
    for rank, record in enumerate(records):
        expected = _token_budget_reference(rank, epochs=2)
        assert _by_epoch(record["train"], 2) == expected  # the plan's micro-batches, epoch by epoch
        length = len(expected[0])
        assert record["loader"]["len"] == record["loader"]["num_training_batches"] == length
        assert record["estimated"] == record["steps"] == record["resumed_steps"] == math.ceil(length / 2) * 2
        assert record["resumed"] == record["train"][4:]  # resumed after 2 optimizer steps of 2 micro-batches
    samples = [i for record in records for epoch, batch in record["train"] if epoch == 0 for i in batch]
    assert sorted(samples) == list(range(N_TRAIN))


def test_token_budget_epochs_of_several_windows_are_read_whole_and_estimated_stepping_batches_is_exact(
    runs: dict[str, Any],
) -> None:
    """A plan of 7 windows, each epoch's windows drawn from its own order, accumulation k=2: every epoch as long
    as the first (Lightning's ``num_training_batches`` as each starts), each read whole, every sample once per
    epoch, and ``estimated_stepping_batches`` (the first epoch's length times the epochs) is the optimizer steps
    taken."""
    lengths = [(61 * i) % 199 + 1 for i in range(300)]  # the script's WINDOWED_LENGTHS
    seen: list[list[int]] = [[], [], []]
    for rank, record in enumerate(runs["token_budget_epochs"]):
        sampler = shardplug.TokenBudgetBatchSampler(lengths, 256, cost="tokens", seed=0)
        sampler.spec = dataclasses.replace(sampler.spec, window=40)
        prepared = prepare_data_loader(
            DataLoader(list(range(300)), batch_sampler=sampler), num_processes=WORLD, process_index=rank
        )
        expected = []
        for epoch in range(3):
            prepared.set_epoch(epoch)
            expected.append([batch.tolist() for batch in prepared])
        assert len(set(map(tuple, (sorted(i for batch in epoch for i in batch) for epoch in expected)))) > 1
        assert _by_epoch(record["train"], 3) == expected
        length = len(expected[0])
        assert record["lengths"] == [len(epoch) for epoch in expected] == [length] * 3
        assert record["estimated"] == record["steps"] == math.ceil(length / 2) * 3
        for epoch in range(3):
            seen[epoch] += [i for batch in expected[epoch] for i in batch]
    assert all(sorted(part) == list(range(300)) for part in seen)


def test_token_budget_checkpoint_of_3_processes_resumes_on_2_with_every_remaining_sample_once(
    runs: dict[str, Any],
) -> None:
    records = runs["token_budget_resize"]
    seen = records[0]["seen"]  # the 3 processes' first 4 micro-batches each
    rest = [[batch for epoch, batch in record["resumed"] if epoch == 0] for record in records]
    assert len(rest[0]) == len(rest[1]) > 0  # equal steps on both processes
    assert sorted(seen + [i for part in rest for batch in part for i in batch]) == list(range(N_TRAIN))
    for rank, record in enumerate(records):  # the next epoch as a 2-process run plans it
        assert _by_epoch(record["resumed"], 2)[1] == _token_budget_reference(rank, epochs=2)[1]
        assert record["loader"]["num_training_batches"] == len(_by_epoch(record["resumed"], 2)[1])
        # the optimizer steps of an uninterrupted 2-process run: Lightning steps at this layout's cycles
        assert record["steps"] == runs["token_budget"][rank]["steps"]


def test_a_prefetching_loader_keeps_batches_hooks_and_positions(runs: dict[str, Any]) -> None:
    """``put_on_device=True, prefetch_depth=2`` (on the CPU a look-ahead through the GPU's seam)."""
    for rank, record in enumerate(runs["prefetch"]):
        expected = _reference(rank, 1, shuffle=False)[0]
        assert [batch for _, batch in record["on"]["train"]] == expected
        # Lightning's transfer hooks: once per batch, in order, each batch before the next one
        assert record["on"]["hooks"] == [[hook, b] for b in expected for hook in ("before", "transfer", "after")]
        assert record["on"] == record["off"]  # positions included: they count the batches handed out


def test_shuffle_is_disjoint_across_ranks_and_changes_per_epoch(runs: dict[str, Any]) -> None:
    per_rank = [_by_epoch(r["train"], 2) for r in runs["default"]]
    for epoch in range(2):
        flat = [i for rank in per_rank for batch in rank[epoch] for i in batch]
        # 48 slots: all 42 samples, and the 6 padding slots repeat the epoch's first samples
        assert sorted(set(flat)) == list(range(N_TRAIN))
        assert len(flat) == 48
        rank0 = {i for b in per_rank[0][epoch][:5] for i in b}
        rank1 = {i for b in per_rank[1][epoch][:5] for i in b}
        assert not rank0 & rank1  # disjoint before the padding batch
    assert per_rank[0][0] != per_rank[0][1]  # Lightning's set_epoch reached the sampler


def test_split_batches_train_batches(runs: dict[str, Any]) -> None:
    for rank, record in enumerate(runs["split"]):
        expected = _reference(rank, 1, shuffle=False, split_batches=True)
        assert _by_epoch(record["train"], 1) == expected
        assert record["loader"]["len"] == 11 == len(expected[0])
    assert runs["split"][1]["train"][0][1] == [2, 3]


def test_cut_short_epochs_keep_the_loader_epoch_and_shuffle(runs: dict[str, Any]) -> None:
    for rank, record in enumerate(runs["limited"]):
        expected = _reference(rank, 2, use_seedable_sampler=True, data_seed=record["seeds"][0])
        assert _by_epoch(record["train"], 2) == [epoch[:3] for epoch in expected]
        # the checkpointable position names Lightning's epoch even though no pass was complete
        assert record["positions"] == [[e, e, k] for e in range(2) for k in range(1, 4)]


def test_a_random_sampler_subclass_is_sharded_as_it_is_and_gets_set_epoch(runs: dict[str, Any]) -> None:
    """A user's RandomSampler subclass (only the even indices) is not replaced by shardplug's shuffle:
    its own order is shared out (disjoint, complete, the same order on both ranks) and Lightning's
    set_epoch reaches it; a RandomSampler given a set_epoch (validation) gets Lightning's calls too."""
    ranks = runs["user_samplers"]
    evens = list(range(0, N_TRAIN, 2))
    orders = []
    for epoch in range(2):
        per_rank = [[b for e, b in r["train"] if e == epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == 3  # 21 indices, 4 per batch, 2 ranks
        order = [i for k in range(3) for batch in (per_rank[0][k], per_rank[1][k]) for i in batch]
        assert sorted(order[: len(evens)]) == evens, f"epoch {epoch}: each even index exactly once"
        assert order[len(evens) :] == order[: len(order) - len(evens)], "only padding from the epoch's start repeats"
        orders.append(order)
    assert orders[0] != orders[1], "the subclass's shuffle changes with the epoch"
    for record in ranks:
        assert sorted(set(record["train_epochs"])) == [0, 1] and record["train_epochs"][-1] == 1
        assert sorted(set(record["val_epochs"])) == [0, 1]  # Lightning's set_epoch at each validation
    seen = [i for r in ranks for batch in r["val"] for i in batch]
    assert sorted(seen) == sorted(list(range(N_VAL)) * 2)  # 2 validations, every sample once each


def test_use_distributed_sampler_false_uses_the_loaders_as_they_are(runs: dict[str, Any]) -> None:
    """Trainer(use_distributed_sampler=False): a loader that shards itself with a sampler of its own is used as it
    is, as Lightning does, not sharded a second time; one with a DistributedSampler is adopted (its batches, its
    padding marked and, in evaluation, dropped: each sample counts once)."""
    for rank, record in enumerate(runs["own_sharding"]):
        assert record["type"] == "DataLoader"
        own = list(range(rank, N_TRAIN, WORLD))
        assert [b for _, b in record["train"]] == [own[k : k + BATCH] for k in range(0, len(own), BATCH)]
        share = list(range(N_VAL))[rank::WORLD]  # DistributedSampler(shuffle=False)'s, without its padding
        assert record["val"] == [share[k : k + BATCH] for k in range(0, len(share), BATCH)]


@pytest.mark.parametrize("saved", ["validation", "epoch_end"])
def test_resume_from_an_epochs_end_keeps_the_batch_progress(runs: dict[str, Any], saved: str) -> None:
    """Checkpoints saved when validation at an epoch's end failed, and at an epoch's end (validation
    every 8 batches across epochs of 4): the resumed fit trains each remaining epoch once (reruns
    the failed validation) and ends with Lightning's own ddp's counters and validation steps."""
    first = {"validation": 2, "epoch_end": 1}[saved]  # the first epoch the resumed fit trains
    for record in runs["validation_resume"]:
        ours, native = record["shardplug_ddp"][saved], record["ddp"][saved]
        for key in ("validated_at", "global_step", "total_ready", "total_batch_idx", "current_epoch"):
            assert ours[key] == native[key], key
        assert ours["validated_at"] == [8, 16] and ours["total_ready"] == 16 and ours["total_batch_idx"] == 15
        assert [e for e, _ in ours["train"]] == [e for e in range(first, 4) for _ in range(4)]  # each epoch once


# -- evaluation ------------------------------------------------------------------------------------
def test_validation_and_test_see_every_sample_once(runs: dict[str, Any]) -> None:
    for key, passes in (("val", 2), ("test", 1)):
        seen = [i for r in runs["default"] for batch in r[key] for i in batch]
        assert sorted(seen) == sorted(list(range(N_VAL)) * passes)
    assert runs["default"][1]["test"] == [[4, 5, 6, 7], [12, 13, 14, 15], [20]]  # uneven, no padding


def test_predict_batch_indices_match_batches(runs: dict[str, Any]) -> None:
    seen = []
    for record in runs["predict"]:
        assert record["writer"], "BasePredictionWriter got no batches"
        for item in record["writer"]:
            assert item["batch_indices"] == item["batch"]
            seen.extend(item["batch"])
        assert record["predictions"] == [item["batch"] for item in record["writer"]]
    assert sorted(seen) == list(range(N_VAL))


# -- stepping --------------------------------------------------------------------------------------
def test_accumulation_and_skipped_amp_step_do_not_advance_scheduler(runs: dict[str, Any]) -> None:
    for record in runs["amp"]:
        # accumulate_grad_batches=2: Lightning's no_sync on micro-batches, sync on every 2nd
        assert record["grad_sync"] == [False, True, False, True, False, True]
        # step 0 overflowed (inf loss): GradScaler skipped it, the scheduler did not advance
        assert record["skipped"][1] is True and record["skipped"][3] is False and record["skipped"][5] is False
        assert record["global_step"] == 3  # Lightning counts the skipped step
        assert record["scheduler_epochs"] == [0, 0, 0, 1, 1, 2]  # 2 real steps; plain Lightning: 3
        assert record["scheduler_type"] == "PreparedScheduler"
        assert record["warnings"] == []  # no "lr_scheduler.step() before optimizer.step()"


def test_mid_epoch_resume_continues_with_the_same_batches(runs: dict[str, Any]) -> None:
    for record in runs["resume"]:
        assert record["estimated_stepping_batches"] == 12  # per-process steps: 6 batches x 2 epochs
        # checkpoint after global step 2 (2 batches of epoch 0): the rest must be exactly the same
        assert record["resumed"] == record["full"][2:]
        assert record["resumed_scheduler"] == record["full_scheduler"][2:]
        assert record["global_step"] == 12


def test_the_epoch_after_a_mid_epoch_resume_has_the_whole_length(runs: dict[str, Any]) -> None:
    """Lightning's loop stops the resumed pass at its length, never asking it for more: as the next epoch starts
    (``on_train_epoch_start``, before its pass begins), ``len(trainer.train_dataloader)`` is a whole epoch's,
    as ``num_training_batches`` and ``estimated_stepping_batches`` are, not the rest of the resumed epoch."""
    for record in runs["resume"]:
        length = len(_reference(0, 1, shuffle=False)[0])  # 6 batches per process and epoch
        # [epoch, len(), num_training_batches, estimated_stepping_batches]: Lightning opens only epoch 1 (epoch 0
        # was resumed inside)
        assert record["epoch_starts"] == [[1, length, length, 2 * length]]


# -- errors and registration -------------------------------------------------------------------------
@pytest.mark.parametrize("injection", [True, False], ids=["default", "use_distributed_sampler=False"])
def test_a_distributed_sampler_of_code_written_for_ddp_gives_native_ddps_batches(
    runs: dict[str, Any], injection: bool
) -> None:
    """A module written for ``ddp`` builds its own DistributedSampler: under shardplug_ddp (with and without
    Trainer(use_distributed_sampler=False)) every rank trains on the batches native DDP gives (Lightning's
    set_epoch on the sampler reaches the loader's epoch), and validates each sample once (the padding dropped)."""
    for rank, record in enumerate(runs["errors"]):
        adopted = record["adopted"][str(injection)]
        assert adopted["type"] != "DataLoader", "prepared by shardplug"
        for epoch in range(2):
            sampler = DistributedSampler(range(N_TRAIN), num_replicas=WORLD, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            native = [b.tolist() for b in DataLoader(range(N_TRAIN), batch_size=BATCH, sampler=sampler)]
            assert [b for e, b in adopted["train"] if e == epoch] == native
        assert all(epoch == loader_epoch for epoch, loader_epoch, done in adopted["positions"] if done)
        share = list(range(N_VAL))[rank::WORLD]
        assert adopted["val"] == 2 * [share[k : k + BATCH] for k in range(0, len(share), BATCH)]


def test_a_distributed_sampler_resumes_a_checkpoint_saved_inside_an_epoch_exactly(runs: dict[str, Any]) -> None:
    for record in runs["errors"]:
        full = record["adopted"]["True"]["train"]
        assert record["adopted"]["resumed"] == full[3:], "the rest of epoch 0 after 3 steps, then epoch 1"


def test_a_distributed_sampler_of_another_rank_is_refused_with_the_fix(runs: dict[str, Any]) -> None:
    for rank, record in enumerate(runs["errors"]):
        message = record["distributed_sampler"]
        assert f"DistributedSampler has rank={1 - rank}" in message
        assert f"DistributedSampler(dataset, num_replicas={WORLD}, rank={rank})" in message  # the fix


def test_even_batches_false_is_refused_for_training() -> None:
    with pytest.raises(ValueError, match="even_batches=False is not supported for training"):
        ShardplugDDPStrategy(even_batches=False)


def test_registered_names_build_the_strategy() -> None:
    import lightning.pytorch as pl

    trainer = pl.Trainer(strategy="shardplug_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardplugDDPStrategy)
    assert trainer.strategy._start_method == "popen"
    spawn = pl.Trainer(strategy="shardplug_ddp_spawn", accelerator="cpu", devices=2, logger=False)
    assert isinstance(spawn.strategy, ShardplugDDPStrategy) and spawn.strategy._start_method == "spawn"
    assert set(STRATEGY_NAMES) == {"shardplug_ddp", "shardplug_ddp_spawn"}


def test_registered_in_pytorch_lightning_too() -> None:
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    from shardplug_lightning.pytorch_lightning_compat import PLShardplugDDPStrategy

    trainer = pytorch_lightning.Trainer(strategy="shardplug_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, PLShardplugDDPStrategy)
    assert isinstance(trainer.strategy, pytorch_lightning.strategies.DDPStrategy)


def test_strategy_accepts_the_shared_config_value() -> None:
    config_module = pytest.importorskip("shardplug.core.config")
    config = config_module.ShardplugConfig(split_batches=True, use_seedable_sampler=True, data_seed=3)
    strategy = ShardplugDDPStrategy(config=config, put_on_device=True, find_unused_parameters=True)
    held = strategy.shardplug_config
    assert held == config.replace(put_on_device=True)  # the config itself, keywords applied
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}  # DDP keywords pass through
    assert (
        held.scales_scheduler("lightning") is False
    )  # off by default (docs/lightning.md, integrations/lightning/README.md)
    with pytest.raises(ValueError, match="non_blocking=True has no effect"):
        ShardplugDDPStrategy(config=config, non_blocking=True)
    with pytest.raises(TypeError, match="unknown shardplug option"):
        shardplug_lightning._options.resolve_config(None, {"split_batch": True})


def test_fabric_strategy_refuses_options_that_would_do_nothing() -> None:
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 has no effect with Fabric"):
        ShardplugFabricDDPStrategy(config=ShardplugConfig(gradient_accumulation_steps=2))
    held = ShardplugFabricDDPStrategy(split_batches=True, shuffle_algorithm="bijective").shardplug_config
    assert held.split_batches and held.shuffle_algorithm == "bijective"


def test_lightning_and_fabric_strategies_read_their_options_in_one_place() -> None:
    options = {"split_batches": True, "data_seed": 3, "rng_types": ["torch"], "use_seedable_sampler": True}
    expected = ShardplugConfig(split_batches=True, data_seed=3, rng_types=("torch",), use_seedable_sampler=True)
    for cls in (ShardplugDDPStrategy, ShardplugFabricDDPStrategy):
        assert issubclass(cls, shardplug_lightning._options.ShardplugOptions)
        strategy = cls(config=ShardplugConfig(data_seed=1), **options)
        assert strategy.shardplug_config == expected
        loader = strategy._loader_arguments(2, 1, even_batches=False)
        assert loader == {
            "config": expected.replace(even_batches=False),
            "device": None,
            "num_processes": 2,
            "process_index": 1,
        }
        parameters = inspect.signature(cls).parameters  # what help() and argument parsers show
        assert {"config", *options, "gradient_accumulation_steps"} <= set(parameters)
        assert all(parameters[name].default is None for name in options)
    assert "eval_even_batches" in inspect.signature(ShardplugDDPStrategy).parameters
    with pytest.raises(ValueError, match="even_batches=False is not supported for training with Lightning"):
        ShardplugDDPStrategy(config=ShardplugConfig(even_batches=False))
    assert ShardplugFabricDDPStrategy(even_batches=False).shardplug_config.even_batches is False


# -- Fabric ----------------------------------------------------------------------------------------
def test_fabric_setup_dataloaders_uses_the_engine(runs: dict[str, Any]) -> None:
    records = runs["fabric"]
    assert records[0]["seeds"] == records[1]["seeds"]
    for rank, record in enumerate(records):
        assert record["strategy"] == "ShardplugFabricDDPStrategy" and record["len"] == 6
        expected = _reference(rank, 2, use_seedable_sampler=True, data_seed=record["seeds"][0])
        assert record["epochs"] == expected  # Fabric's per-iteration set_epoch reaches the sampler
        assert record["step_was_skipped"] is False
        assert f"DistributedSampler has rank={1 - rank}" in record["error"]
        for epoch, batches in enumerate(record["ddp_epochs"]):  # a DistributedSampler adopted: native DDP's
            sampler = DistributedSampler(range(42), num_replicas=WORLD, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            assert batches == [b.tolist() for b in DataLoader(range(42), batch_size=4, sampler=sampler)]
        budget = _token_budget_reference(rank, epochs=2)  # Fabric's set_epoch reaches the budget's plan too
        assert record["token_budget"] == {"epochs": budget, "len": len(budget[0])}
    assert records[0]["epochs"][0] != records[0]["epochs"][1]


def test_fabric_loads_a_mixture_saved_on_3_processes_in_its_global_order(runs: dict[str, Any]) -> None:
    """A ``shardplug.Mixture`` position saved on 3 processes (``fabric.save``), loaded by ``setup_dataloaders``'
    loader on Fabric's 2 (``fabric.load``) and read to the end of the next epoch: the global sequence of an
    uninterrupted run, every sample once per source cycle."""
    _core_tests_on_path()
    from _datasets import MIXTURE_WEIGHTS, check_mixture_read, mixture_sources

    records = [record["mixture"] for record in runs["fabric"]]
    assert records[0]["before"] == records[1]["before"] and len(records[0]["before"]) == 6  # 2 steps of 3
    assert len(records[0]["after"]) == len(records[1]["after"]), "equal steps on both ranks"
    after = [row for step in zip(*(r["after"] for r in records)) for rows in step for row in rows]
    read = [row for rows in records[0]["before"] for row in rows] + after
    mixture = shardplug.Mixture(mixture_sources(), MIXTURE_WEIGHTS, seed=5)
    assert len(read) == 2 * len(mixture), "the rest of epoch 0, then epoch 1"
    check_mixture_read(read, mixture)


def test_fabric_loads_a_token_budget_position_of_3_processes_on_2_with_every_remaining_sample_once(
    runs: dict[str, Any],
) -> None:
    parts = [record["token_budget_resize"] for record in runs["fabric"]]
    assert len(parts[0]["rest"]) == len(parts[1]["rest"]) > 0  # equal steps on both processes
    rest = [i for part in parts for batch in part["rest"] for i in batch]
    assert sorted(parts[0]["seen"] + rest) == list(range(N_TRAIN))


def test_a_hugging_face_stream_trains_exactly_once_per_epoch_with_equal_steps(runs):
    """Sharded natively under Lightning (each rank reads its own shards; 2 workers), padded to equal steps."""
    ranks = runs["stream"]
    assert all(r["dataset"].startswith("datasets") for r in ranks), "each rank reads only its own shards"
    total = runs["stream_rows"]
    for epoch in range(2):
        batches = [[b for e, b in r["train"] if e == epoch] for r in ranks]
        # each of the 2 workers batches its own shard: parts of 6 and 7 batches, the first padded once
        assert len(batches[0]) == len(batches[1]) == 7, "equal steps on both ranks"
        seen = [x for rank in batches for batch in rank for x in batch]
        assert set(seen) == set(range(total)), f"epoch {epoch}: every row trained on"
        assert len(seen) - total == BATCH, "the only repeat: one padding step (the shorter part's first batch)"


# -- FSDP and model parallelism --------------------------------------------------------------------
def test_model_parallel_shards_over_the_data_parallel_dimension_only(runs: dict[str, Any]) -> None:
    ranks = runs["model_parallel"]
    assert all(r["tensor_parallel"]["strategy"] == "ShardplugModelParallelStrategy" for r in ranks)
    # tensor parallel over both ranks: one data-parallel group, the same batches on both
    assert ranks[0]["tensor_parallel"]["batches"] == ranks[1]["tensor_parallel"]["batches"]
    assert sorted(i for b in ranks[0]["tensor_parallel"]["batches"] for i in b) == list(range(16))
    # data parallel over both ranks: disjoint halves
    halves = [sorted(i for b in r["data_parallel"]["batches"] for i in b) for r in ranks]
    assert not set(halves[0]) & set(halves[1]) and sorted(halves[0] + halves[1]) == list(range(16))


def test_fsdp_and_model_parallel_names_build_shardplug_strategies() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry

    from shardplug_lightning import ShardplugFSDPStrategy, ShardplugModelParallelStrategy

    assert issubclass(ShardplugFSDPStrategy, FSDPStrategy) and issubclass(
        ShardplugModelParallelStrategy, ModelParallelStrategy
    )
    assert StrategyRegistry["shardplug_fsdp"]["strategy"] is ShardplugFSDPStrategy
    trainer = pl.Trainer(strategy="shardplug_model_parallel", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ShardplugModelParallelStrategy)
    strategy = ShardplugFSDPStrategy(split_batches=True, sharding_strategy="SHARD_GRAD_OP")
    assert strategy.shardplug_config.split_batches  # shardplug's options, FSDP's keywords passed through
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)  # runs on GPUs only
    assert trainer.strategy is strategy


def test_fabric_load_inside_a_later_epoch_resumes_that_epoch_in_its_order(runs: dict[str, Any]) -> None:
    """Fabric's loader wrapper sets its own count of passes (0 after a restart) as the samplers' epoch at
    every iter(): the loader keeps its own (the loaded position's) epoch, so the rest of epoch 1 is epoch
    1's, every sample once."""
    run = runs["fabric_epochs"]
    epoch1 = run["uninterrupted"][1]
    assert run["before"] == epoch1[:3]
    assert run["rest"] == epoch1[3:], "the rest of epoch 1 in epoch 1's order"
    assert sorted(i for batch in run["before"] + run["rest"] for i in batch) == list(range(12))


def test_fabric_len_after_a_resumed_epoch_read_len_times_is_a_whole_epoch(runs: dict[str, Any]) -> None:
    """The loaded rest of epoch 1 read by ``next()`` ``len()`` times (a loop that never asks for one more batch):
    the same batches; ``len(loader)`` is the rest's while its last batch is processed, and the next epoch's whole
    length once the loop asks for that epoch's pass (``iter()``)."""
    run = runs["fabric_epochs"]
    assert run["counted_rest"] == run["rest"]
    assert run["len_at_last_batch"] == len(run["rest"])
    assert run["len_next_epoch"] == len(run["uninterrupted"][0])


def _run_script(script: str, out: Path, *args: str) -> None:
    """Run ``scripts/<script> OUT ARGS...`` (it launches its own processes); fail with its output."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / script), str(out), *args],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


# -- streams that split themselves by rank ---------------------------------------------------------
def test_litdata_and_streaming_train_once_per_epoch_with_equal_steps(runs: dict[str, Any]) -> None:
    """litdata's and streaming's StreamingDataset under the strategy on 2 processes: each rank trains on
    its own part as the library splits it (litdata drops its split's tail, streaming repeats to fill its
    ranks), the same number of steps on both, not split a second time."""
    helpers = _stream_helpers()
    helpers.litdata_module()
    helpers.streaming_base()
    n = PRESPLIT_N
    ranks = runs["presplit"]
    for kind in ("litdata", "streaming"):
        assert all(r[kind]["part"] == "NodePart" for r in ranks), "read as each process's part"
        for epoch in range(2):
            batches = [[b for e, b in r[kind]["train"] if e == epoch] for r in ranks]
            assert len(batches[0]) == len(batches[1]) > 0, "equal steps on both ranks"
            for rank in range(WORLD):
                trained = [x for batch in batches[rank] for x in batch]
                assert trained == ranks[rank][kind]["native"][epoch], f"{kind} epoch {epoch}: the library's part"
        seen = [x for r in ranks for e, b in r[kind]["train"] if e == 0 for x in b]
        if kind == "litdata":
            assert len(seen) == len(set(seen)) < n, "litdata drops its split's tail, never repeats"
        else:
            assert set(seen) == set(range(n)), "streaming: every sample (repeating to fill its ranks)"
