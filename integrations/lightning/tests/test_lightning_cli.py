"""The strategy classes configured the way LightningCLI (jsonargparse) users configure them.

``scripts/lightning_cli.py`` is a plain ``LightningCLI(Model, DataModule)`` script: one launch on 2 CPU
processes fits once with the class and its options on the command line, once from a YAML config.
The other tests parse in this process with the real ``LightningCLI`` (``--help``, every class) and
jsonargparse (Fabric, which has no CLI).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader
from shardplug.core.config import ShardplugConfig
from shardplug_lightning import (
    ShardplugDDPStrategy,
    ShardplugFabricDDPStrategy,
    ShardplugFSDPStrategy,
    ShardplugModelParallelStrategy,
)
from shardplug_lightning.pytorch_lightning_compat import PLShardplugDDPStrategy

#: LightningCLI needs jsonargparse[signatures] (the test extra installs it)
needs_jsonargparse = pytest.mark.skipif(importlib.util.find_spec("jsonargparse") is None, reason="no jsonargparse")

SCRIPT = Path(__file__).parent / "scripts" / "lightning_cli.py"
WORLD, SIZE, BATCH = 2, 42, 4
FIELDS = [f.name for f in dataclasses.fields(ShardplugConfig)]
TRAINER = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.max_epochs", "1"]
TRAINER += ["--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
TRAINER += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
YAML = """\
trainer:
  accelerator: cpu
  devices: 2
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {out}/yaml
  strategy:
    class_path: shardplug_lightning.ShardplugDDPStrategy
    init_args:
      config:             # a ShardplugConfig; the keywords beside it win
        use_seedable_sampler: true
        data_seed: 1
      split_batches: true
      data_seed: 5
      eval_even_batches: true
      process_group_backend: gloo
model:
  out: {out}
  run: yaml
data:
  shuffle: true
  num_workers: 2
"""
#: (namespace, strategy class, its registered names): every Trainer strategy class, with the CLI of its namespace.
TRAINER_CLASSES = [
    ("lightning.pytorch", ShardplugDDPStrategy, ["shardplug_ddp", "shardplug_ddp_spawn"]),
    ("lightning.pytorch", ShardplugFSDPStrategy, ["shardplug_fsdp"]),
    ("lightning.pytorch", ShardplugModelParallelStrategy, ["shardplug_model_parallel"]),
    ("pytorch_lightning", PLShardplugDDPStrategy, ["shardplug_ddp", "shardplug_ddp_spawn"]),
]


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """One launch of the script on 2 processes: a fit from the command line, then one from ``cli.yaml``."""
    out = tmp_path_factory.mktemp("lightning_cli")
    (out / "cli.yaml").write_text(YAML.format(out=out))
    command = ["fit", "--model.out", str(out), "--model.run", "cli", *TRAINER]
    command += ["--trainer.default_root_dir", str(out / "cli")]
    command += ["--trainer.strategy", "shardplug_lightning.ShardplugDDPStrategy", "--trainer.strategy.split_batches"]
    command += ["true", "--trainer.strategy.process_group_backend", "gloo"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *command], cwd=out, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, f"lightning_cli.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return {
        run: [json.loads((out / f"{run}_rank{r}.json").read_text()) for r in range(WORLD)] for run in ("cli", "yaml")
    }


def _recorded(config: ShardplugConfig) -> dict[str, Any]:
    """``config`` as the script records it (JSON, without the callable ``slice_fn_for_dispatch``)."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "slice_fn_for_dispatch"}


def _shards(rank: int, shuffle: bool, **options: Any) -> list[list[int]]:
    """What ``prepare_data_loader`` gives ``rank`` of ``DataLoader(range(42), batch_size=4)`` (the engine's answer)."""
    loader = DataLoader(list(range(SIZE)), batch_size=BATCH, shuffle=shuffle)
    prepared = prepare_data_loader(loader, num_processes=WORLD, process_index=rank, **options)
    return [batch.tolist() for batch in prepared]


@needs_jsonargparse
def test_cli_class_path_with_init_args_trains_on_the_split_batches_shards(cli_runs: dict[str, Any]) -> None:
    """``--trainer.strategy shardplug_lightning.ShardplugDDPStrategy --trainer.strategy.split_batches true``."""
    for rank, record in enumerate(cli_runs["cli"]):
        assert record["strategy"] == _class_path(ShardplugDDPStrategy) and record["world_size"] == WORLD
        assert record["config"] == _recorded(ShardplugConfig(split_batches=True))
        assert record["process_group_backend"] == "gloo"  # a DDPStrategy keyword, passed through
        assert record["batches"] == _shards(rank, False, split_batches=True)
        # each global batch of 4 cut in two: rank r holds its slice [2r, 2r + 2) of every batch
        assert record["batches"][0] == [2 * rank, 2 * rank + 1] and len(record["batches"]) == 11


@needs_jsonargparse
def test_cli_yaml_config_with_init_args_trains_on_the_split_batches_shards(cli_runs: dict[str, Any]) -> None:
    """``fit --config cli.yaml`` whose ``trainer.strategy`` has ``class_path`` and ``init_args`` (a ``config``
    and keywords, which win over it; 2 DataLoader workers)."""
    records = cli_runs["yaml"]
    for rank, record in enumerate(records):
        assert record["strategy"] == _class_path(ShardplugDDPStrategy)
        expected = ShardplugConfig(split_batches=True, use_seedable_sampler=True, data_seed=5)
        assert record["config"] == _recorded(expected)
        assert record["eval_even_batches"] is True and record["process_group_backend"] == "gloo"
        assert record["batches"] == _shards(rank, True, split_batches=True, use_seedable_sampler=True, data_seed=5)
    seen = [i for record in records for batch in record["batches"] for i in batch]
    assert set(seen) == set(range(SIZE)) and len(seen) == 44  # every sample; the last global batch padded by 2


def _cli(namespace: str, args: list[str]) -> Any:
    """The real ``LightningCLI`` of ``namespace`` over its ``BoringModel``, parsing ``args`` (as the command
    line of a script), not running."""
    cli = importlib.import_module(f"{namespace}.cli")
    model = importlib.import_module(f"{namespace}.demos.boring_classes").BoringModel
    with mock.patch.object(sys, "argv", ["train.py"]):  # not pytest's
        return cli.LightningCLI(model, run=False, args=args, save_config_callback=None)


def _own_keywords(cls: type) -> list[str]:
    """The keywords of the Lightning strategy ``cls`` extends (its last base), read from its ``__init__``."""
    parameters = inspect.signature(cls.__bases__[-1].__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


@needs_jsonargparse
@pytest.mark.parametrize("namespace, cls, names", TRAINER_CLASSES, ids=[c.__name__ for _, c, _ in TRAINER_CLASSES])
def test_cli_help_lists_every_option_and_the_class_builds(
    namespace: str, cls: type, names: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trainer.strategy.help CLASS``: every ShardplugConfig field, ``config``, ``eval_even_batches`` and the
    base strategy's keywords; ``--trainer.strategy CLASS --trainer.strategy.split_batches true ...`` builds the
    class with those options, and its registered names still build it."""
    with pytest.raises(SystemExit) as exit_info:
        _cli(namespace, ["--trainer.strategy.help", _class_path(cls)])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    for name in ["config", *FIELDS, "eval_even_batches", *_own_keywords(cls)]:
        assert f"--trainer.strategy.{name} " in shown, f"--trainer.strategy.{name} missing from the help"
    devices = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.logger", "false"]
    args = ["--trainer.strategy", _class_path(cls), "--trainer.strategy.split_batches", "true"]
    args += ["--trainer.strategy.data_seed", "7", "--trainer.strategy.rng_types", "[torch]"]
    strategy = _cli(namespace, [*args, *devices]).trainer.strategy
    assert type(strategy) is cls
    assert strategy.shardplug_config == ShardplugConfig(split_batches=True, data_seed=7, rng_types=("torch",))
    for name in names:
        assert type(_cli(namespace, ["--trainer.strategy", name, *devices]).trainer.strategy) is cls, name


@pytest.mark.parametrize("cls", [cls for _, cls, _ in TRAINER_CLASSES] + [ShardplugFabricDDPStrategy])
def test_every_config_field_is_a_typed_keyword_of_the_strategy_init(cls: type) -> None:
    """Each strategy's ``__init__`` (what jsonargparse, editors and type checkers read) names every
    ``ShardplugConfig`` field, keyword-only, typed ``<the field's type> | None``, default ``None``
    (the config's value), and ``config: ShardplugConfig | None``."""
    parameters = inspect.signature(cls.__init__).parameters
    hints = typing.get_type_hints(cls.__init__)
    field_types = typing.get_type_hints(ShardplugConfig)
    for name in ["config", *FIELDS]:
        assert name in parameters, f"{cls.__name__}.__init__ does not name {name}"
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and parameters[name].default is None
        assert hints[name] == (ShardplugConfig if name == "config" else field_types[name]) | None, name
    assert "__signature__" not in vars(cls) and inspect.signature(cls) == inspect.signature(cls.__init__).replace(
        parameters=list(parameters.values())[1:]
    )


@needs_jsonargparse
def test_fabric_strategy_is_built_by_jsonargparse_from_its_options() -> None:
    """Fabric has no CLI; a jsonargparse parser (what a CLI over Fabric uses) builds the class from its options."""
    from jsonargparse import ArgumentParser
    from lightning.fabric.strategies import Strategy

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(Strategy, "strategy")
    args = ["--strategy", _class_path(ShardplugFabricDDPStrategy), "--strategy.split_batches", "true"]
    args += ["--strategy.even_batches", "false", "--strategy.start_method", "spawn"]
    strategy = parser.instantiate(parser.parse_args(args)).strategy
    assert type(strategy) is ShardplugFabricDDPStrategy and strategy._start_method == "spawn"
    assert strategy.shardplug_config == ShardplugConfig(split_batches=True, even_batches=False)
