"""ShardplugConfig: defaults, validation messages, loader kwargs."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from shardplug.core.config import DATA_OPTIONS, ShardplugConfig


def test_defaults():
    config = ShardplugConfig()
    assert (config.split_batches, config.even_batches, config.dispatch_batches) == (False, True, None)
    assert config.gradient_accumulation_steps == 1
    assert config.step_scheduler_with_optimizer and config.scale_scheduler_by_num_processes is None
    assert config.rng_types is None


def test_frozen_and_replace_validates():
    config = ShardplugConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.split_batches = True  # type: ignore[misc]
    assert config.replace(split_batches=True).split_batches is True
    with pytest.raises(ValueError, match="gradient_accumulation_steps=0"):
        config.replace(gradient_accumulation_steps=0)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"gradient_accumulation_steps": 0}, ValueError, ["gradient_accumulation_steps=0", ">= 1"]),
        ({"gradient_accumulation_steps": 2.0}, ValueError, ["gradient_accumulation_steps=2.0"]),
        ({"gradient_accumulation_steps": True}, ValueError, ["gradient_accumulation_steps=True"]),
        ({"split_batches": "yes"}, TypeError, ["split_batches='yes'", "True or False"]),
        ({"dispatch_batches": 1}, TypeError, ["dispatch_batches=1"]),
        ({"dispatch_batches": True}, ValueError, ["dispatch_batches=True", "put_on_device=True"]),
        ({"data_seed": "3", "use_seedable_sampler": True}, TypeError, ["data_seed='3'"]),
        ({"data_seed": 2**64, "use_seedable_sampler": True}, ValueError, ["data_seed=", "range"]),
        ({"rng_types": "torch"}, TypeError, ["rng_types='torch'", "('torch',)"]),
        ({"rng_types": ("torch", "tpu")}, ValueError, ["rng_types", "'tpu'"]),
        ({"slice_fn_for_dispatch": 3}, TypeError, ["slice_fn_for_dispatch=3", "callable"]),
        # options that would silently do nothing
        (
            {"slice_fn_for_dispatch": len, "dispatch_batches": False},
            ValueError,
            ["slice_fn_for_dispatch", "dispatch_batches=False"],
        ),
        ({"non_blocking": True}, ValueError, ["non_blocking=True", "put_on_device=True"]),
        (
            {"scale_scheduler_by_num_processes": True, "split_batches": True},
            ValueError,
            ["scale_scheduler_by_num_processes=True", "split_batches=True"],
        ),
        (
            {"scale_scheduler_by_num_processes": True, "step_scheduler_with_optimizer": False},
            ValueError,
            ["scale_scheduler_by_num_processes=True", "step_scheduler_with_optimizer=False"],
        ),
    ],
)
def test_validation_names_argument_value_and_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        ShardplugConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_rng_types_become_a_fresh_tuple():
    names = ["torch", "generator"]
    config = ShardplugConfig(rng_types=names)  # type: ignore[arg-type]
    assert config.rng_types == ("torch", "generator")
    kwargs = config.data_loader_kwargs()
    kwargs["rng_types"].remove("generator")
    assert names == ["torch", "generator"] and config.data_loader_kwargs()["rng_types"] == ["torch", "generator"]
    assert hash(config) == hash(ShardplugConfig(rng_types=("torch", "generator")))


def test_data_loader_kwargs_are_prepare_data_loader_arguments():
    prepare = pytest.importorskip("shardplug.core.planner")

    def slicer(data, s, i, n):
        return data

    config = ShardplugConfig(
        split_batches=True,
        even_batches=False,
        dispatch_batches=True,
        put_on_device=True,
        use_seedable_sampler=True,
        data_seed=7,
        non_blocking=True,
        rng_types=("torch",),
        slice_fn_for_dispatch=slicer,
    )
    kwargs = config.data_loader_kwargs()
    parameters = inspect.signature(prepare.prepare_data_loader).parameters
    assert set(kwargs) <= set(parameters)
    assert set(parameters) - set(kwargs) == {
        "dataloader",
        "device",
        "num_processes",
        "process_index",
        "torch_device_mesh",
        "config",
    }
    assert set(kwargs) == set(DATA_OPTIONS)
    assert kwargs["slice_fn_for_dispatch"] is slicer and kwargs["data_seed"] == 7 and kwargs["split_batches"] is True


def test_scheduler_scaling_is_decided_in_one_place():
    assert [ShardplugConfig().scales_scheduler(f) for f in ("pytorch", "lightning", "fabric", "ignite")] == [
        True,
        False,
        False,
        False,
    ]
    assert ShardplugConfig(scale_scheduler_by_num_processes=True).scales_scheduler("ignite") is True
    assert ShardplugConfig(scale_scheduler_by_num_processes=False).scales_scheduler("pytorch") is False
    with pytest.raises(ValueError, match="front_end='keras'"):
        ShardplugConfig().scales_scheduler("keras")


def test_dispatcher_takes_the_one_spelling():
    from shardplug.core.dispatch.dispatcher import DataLoaderDispatcher

    def slicer(data, rows, process_index, num_processes):
        return data

    loader = DataLoaderDispatcher(
        list(range(4)), batch_size=2, slice_fn_for_dispatch=slicer, num_processes=1, process_index=0
    )
    assert loader.slice_fn is slicer
    with pytest.raises(TypeError, match="slice_fn"):  # a name that was never released
        DataLoaderDispatcher(list(range(4)), batch_size=2, slice_fn=slicer, num_processes=1, process_index=0)
