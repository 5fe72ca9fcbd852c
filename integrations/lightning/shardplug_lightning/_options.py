"""The shardplug options of a strategy, and the data-side checks the strategies share.

The Lightning and Fabric strategies take their options through :class:`ShardplugOptions`: a
``ShardplugConfig`` and/or its fields as keywords (keywords win), named in each strategy's
``__init__`` (what ``LightningCLI`` reads) and merged once into the
:class:`~shardplug.core.config.ShardplugConfig` the strategy holds; every option is read from it,
never re-stated here, and every loader is prepared with ``prepare_data_loader(config=...)``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from shardplug.core.config import ShardplugConfig
from shardplug.core.loader.prepared import PreparedDataLoader

from . import compat

__all__ = ["ShardplugOptions", "resolve_config", "has_distributed_sampler", "refuse_prepared"]

logger = logging.getLogger(__name__)

#: The ``ShardplugConfig`` fields: the shardplug keywords of every strategy's ``__init__``.
FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ShardplugConfig))


def resolve_config(config: Any, overrides: dict[str, Any]) -> ShardplugConfig:
    """``config`` (a ``ShardplugConfig`` or ``None``) with the keywords the user passed (not ``None``)
    applied; validated by ``ShardplugConfig`` (errors name the argument and the fix)."""
    unknown = set(overrides) - set(FIELD_NAMES)
    if unknown:
        raise TypeError(f"unknown shardplug option(s): {sorted(unknown)}")
    if "rng_types" in overrides and not isinstance(overrides["rng_types"], str):
        overrides = {**overrides, "rng_types": tuple(overrides["rng_types"])}
    if config is None:
        return ShardplugConfig(**overrides)
    if not isinstance(config, ShardplugConfig):
        raise TypeError(f"config={config!r} is invalid: pass a shardplug ShardplugConfig or None")
    return config.replace(**overrides) if overrides else config


class ShardplugOptions:
    """The shardplug options of a strategy, mixed in before the strategy class it extends.

    The ``__init__`` of each front end names ``config`` and every ``ShardplugConfig`` field as
    keyword-only parameters, so jsonargparse (``LightningCLI``), editors and type checkers read them
    (``tests/test_lightning_cli.py`` checks each against the dataclass); it hands its arguments to
    :meth:`_take_options` and every other keyword to the strategy class it is mixed into. Each field
    is ``None`` by default: the config's value (the field's default without ``config``). The
    descriptions below are what ``--help`` shows; the full ones are ``ShardplugConfig``'s.

    Args:
        config: a ``ShardplugConfig``; the keywords override its fields, and the strategy holds the
            merged value (``strategy.shardplug_config``).
        split_batches: cut each batch of the loader into one slice per process (its batch size is the global one).
        even_batches: pad the end of an epoch so that every process gets the same number of batches.
        dispatch_batches: process 0 reads the data and sends each process its rows (the config's ``None``: automatic).
        use_seedable_sampler: replace ``RandomSampler`` by a sampler whose order depends on the seed and the epoch only.
        data_seed: the seed of the shuffles shardplug creates (the config's ``None``: agreed from process 0).
        non_blocking: non-blocking host-to-device copies of the batches (with ``put_on_device``).
        use_stateful_dataloader: back the loaders with ``torchdata``'s ``StatefulDataLoader``.
        put_on_device: move each batch to the process's device.
        rng_types: the RNGs synchronised from process 0 at each epoch start (``torch``, ``cuda``, ``xla``,
            ``generator``).
        slice_fn_for_dispatch: ``slice_fn(data, slice, process_index, num_processes)`` of dispatching loaders.
        shuffle_algorithm: ``randperm`` (one ``torch.randperm`` per epoch) or ``bijective`` (a keyed bijection).
        prefetch_depth: batches read and copied to the device ahead of the step (the config's ``None``, and ``0``:
            off; prefetching is opt-in).
        gradient_accumulation_steps: micro-batches per optimizer step.
        step_scheduler_with_optimizer: prepared schedulers step only after real optimizer updates.
        scale_scheduler_by_num_processes: step prepared schedulers once per process for each optimizer step
            (the config's ``None``: the front end's convention).

    Example::

        class MyStrategy(ShardplugOptions, DDPStrategy):
            def __init__(self, *, config: ShardplugConfig | None = None, split_batches: bool | None = None,
                         ..., **kwargs: Any) -> None:  # every ShardplugConfig field
                self._take_options(config, locals())
                super().__init__(**kwargs)

            def _check_shardplug_config(self, config):
                ...  # refuse what this front end cannot honour
    """

    shardplug_config: ShardplugConfig

    def _take_options(self, config: ShardplugConfig | None, arguments: Mapping[str, Any]) -> None:
        """Merge ``config`` and the ``ShardplugConfig`` fields among ``arguments`` (the ``__init__``'s
        ``locals()``: every field is one of its parameters) that were given (not ``None``)."""
        missing = [name for name in FIELD_NAMES if name not in arguments]
        if missing:  # a front end whose __init__ lacks a field (tests/test_lightning_cli.py checks each)
            raise TypeError(f"{type(self).__name__}.__init__ does not name the shardplug option(s) {missing}")
        given = {name: arguments[name] for name in FIELD_NAMES if arguments[name] is not None}
        merged = resolve_config(config, given)
        self._check_shardplug_config(merged)
        self.shardplug_config = merged

    def _check_shardplug_config(self, config: ShardplugConfig) -> None:
        """Refuse options this front end cannot honour (a ``ValueError`` naming the option and the fix)."""

    def _loader_arguments(self, num_processes: int, process_index: int, **changes: Any) -> dict[str, Any]:
        """``prepare_data_loader`` arguments for one loader of this process: the strategy's config with
        the data option ``changes`` applied, the data topology, and the device when batches go on it."""
        config = self.shardplug_config.for_loaders(**changes)
        device = self.root_device if config.put_on_device else None  # type: ignore[attr-defined]
        return {"config": config, "device": device, "num_processes": num_processes, "process_index": process_index}


def has_distributed_sampler(dataloader: DataLoader[Any]) -> bool:
    """Whether ``dataloader`` reads a ``DistributedSampler`` (its sampler, its batch sampler's, or the one under
    Lightning's predict index wrapper): code written for DDP, which ``prepare_data_loader`` adopts."""
    candidates = [getattr(dataloader, "sampler", None)]
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates.append(getattr(batch_sampler, "sampler", None))
    inner = compat.inner_batch_sampler(batch_sampler)  # Lightning's predict index wrapper
    candidates.append(getattr(inner, "sampler", None))
    return any(isinstance(s, DistributedSampler) for s in candidates)


def refuse_prepared(dataloader: DataLoader[Any], hook: str) -> None:
    """Raise when the loader was already prepared by shardplug (it would be sharded twice)."""
    if isinstance(dataloader, PreparedDataLoader):
        raise ValueError(
            f"the DataLoader returned by {hook} was already prepared by shardplug.prepare_data_loader; "
            "the shardplug strategy prepares every loader itself. Return the plain torch DataLoader instead."
        )
