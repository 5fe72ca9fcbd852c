"""``prepare_data_loader(config=...)``: the data options from a ``ShardplugConfig``, the same loader
as the keywords, a disagreeing keyword refused; every default stated once, in ``ShardplugConfig``."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader
from shardplug.core.config import DATA_OPTIONS, ShardplugConfig
from shardplug.core.stepping.training import TrainingRun

CONFIGS = [
    ShardplugConfig(),
    ShardplugConfig(split_batches=True),
    ShardplugConfig(even_batches=False),
    ShardplugConfig(use_seedable_sampler=True, data_seed=3),
    ShardplugConfig(shuffle_algorithm="bijective", data_seed=5),
]


def _batches(loader):
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "split", "uneven", "seedable", "bijective"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_config_gives_the_loader_of_its_keywords(config, shuffle):
    if config.shuffle_algorithm == "bijective" and not shuffle:
        pytest.skip("the bijective shuffle needs shuffle=True")
    if shuffle and config.data_seed is None:
        config = config.replace(data_seed=11)  # an unseeded shuffle draws its seed: two loaders would differ
    keywords = {name: getattr(config, name) for name in DATA_OPTIONS}
    for index in range(2):
        torch.manual_seed(0)
        by_config = prepare_data_loader(
            DataLoader(range(21), batch_size=4, shuffle=shuffle), num_processes=2, process_index=index, config=config
        )
        torch.manual_seed(0)
        by_keywords = prepare_data_loader(
            DataLoader(range(21), batch_size=4, shuffle=shuffle), num_processes=2, process_index=index, **keywords
        )
        for epoch in range(2):
            by_config.set_epoch(epoch)
            by_keywords.set_epoch(epoch)
            assert _batches(by_config) == _batches(by_keywords)
        assert len(by_config) == len(by_keywords)
        assert by_config.plan.layout == by_keywords.plan.layout


def test_a_keyword_that_disagrees_with_the_config_is_refused_naming_both_and_the_fix():
    loader = DataLoader(range(8), batch_size=2)
    with pytest.raises(TypeError, match=r"config= and split_batches=True, .*says split_batches=False.*config\.replace"):
        prepare_data_loader(loader, num_processes=2, process_index=0, split_batches=True, config=ShardplugConfig())
    with pytest.raises(TypeError, match=r"even_batches=False.*data_seed=4.*even_batches=True.*data_seed=None"):
        prepare_data_loader(loader, even_batches=False, data_seed=4, config=ShardplugConfig())
    with pytest.raises(TypeError, match="config=.*is invalid: pass a ShardplugConfig"):
        prepare_data_loader(loader, config={"split_batches": True})


def test_a_keyword_that_agrees_with_the_config_is_accepted():
    config = ShardplugConfig(split_batches=True, rng_types=("generator",))
    loader = prepare_data_loader(
        DataLoader(range(8), batch_size=2),
        num_processes=2,
        process_index=1,
        split_batches=True,
        rng_types=["generator"],
        config=config,
    )
    assert loader.plan.layout.split_batches and loader.rng_types == ("generator",)
    assert _batches(loader) == [[1], [3], [5], [7]]


def test_the_config_wins_over_keywords_left_at_their_default():
    loader = prepare_data_loader(
        DataLoader(range(8), batch_size=2),
        num_processes=2,
        process_index=0,
        even_batches=True,
        config=ShardplugConfig(split_batches=True, even_batches=True),
    )
    assert loader.plan.layout.split_batches
    assert _batches(loader) == [[0], [2], [4], [6]]


def test_every_default_of_prepare_data_loader_is_the_config_field():
    parameters = inspect.signature(prepare_data_loader).parameters
    defaults = {field.name: field.default for field in dataclasses.fields(ShardplugConfig)}
    for name in DATA_OPTIONS:
        assert parameters[name].default is defaults[name] or parameters[name].default == defaults[name], name
    assert parameters["config"].default is None


def test_for_loaders_keeps_the_data_options_and_refuses_stepping_ones():
    config = ShardplugConfig(gradient_accumulation_steps=3, scale_scheduler_by_num_processes=True, data_seed=2)
    loaders = config.for_loaders(split_batches=True)  # would clash with scale_scheduler_by_num_processes=True
    assert loaders.split_batches and loaders.data_seed == 2
    assert loaders.gradient_accumulation_steps == 1 and loaders.scale_scheduler_by_num_processes is None
    with pytest.raises(TypeError, match="gradient_accumulation_steps is not a prepare_data_loader option"):
        config.for_loaders(gradient_accumulation_steps=2)


def test_training_run_passes_its_config_and_applies_overrides():
    config = ShardplugConfig(scale_scheduler_by_num_processes=True, data_seed=1)
    run = TrainingRun(config, num_processes=2, process_index=1)
    split = run.prepare_data_loader(DataLoader(range(8), batch_size=4), split_batches=True)
    assert split.plan.layout.split_batches and _batches(split) == [[2, 3], [6, 7]]
    plain = run.prepare_data_loader(DataLoader(range(8), batch_size=2))
    assert not plain.plan.layout.split_batches and _batches(plain) == [[2, 3], [6, 7]]
    with pytest.raises(TypeError, match="not a prepare_data_loader option"):
        run.prepare_data_loader(DataLoader(range(8), batch_size=2), gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="even_batches=False is invalid for an evaluation loader"):
        run.prepare_eval_loader(DataLoader(range(8), batch_size=2), even_batches=False)
    evaluation = TrainingRun(ShardplugConfig(even_batches=False), num_processes=2, process_index=1)
    assert len(evaluation.prepare_eval_loader(DataLoader(range(6), batch_size=2))) == 2  # padded: even


def test_one_layout_is_handed_down_to_the_shard_and_the_loader():
    loader = prepare_data_loader(
        DataLoader(range(10), batch_size=2),
        num_processes=2,
        process_index=0,
        config=ShardplugConfig(even_batches=False),
    )
    assert loader.batch_sampler.plan is loader.plan
    assert loader.batch_sampler.layout is loader.plan.layout
    single = prepare_data_loader(DataLoader(range(5), batch_size=None), num_processes=2, process_index=1)
    assert single.sampler.shard.plan is single.plan and list(single) == [1, 3, 0]


def test_prepare_reads_exactly_the_data_options_of_the_config():
    from shardplug.core import planner as prepare

    assert prepare._DataOptions._fields == DATA_OPTIONS
    assert set(DATA_OPTIONS) == set(ShardplugConfig().data_loader_kwargs())
