"""The shardplug configuration of a strategy, and the data-side checks the strategies share.

The strategies accept a ``ShardplugConfig`` and/or its fields as keywords (keywords win) and hold
the merged :class:`~shardplug.core.config.ShardplugConfig` itself: every option is read from it,
never re-stated here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from shardplug.core.config import ShardplugConfig
from shardplug.core.loaders import PreparedDataLoader

__all__ = ["resolve_config", "data_loader_kwargs", "refuse_distributed_sampler", "refuse_prepared"]

logger = logging.getLogger(__name__)

_FIELDS = frozenset(f.name for f in dataclasses.fields(ShardplugConfig))


def resolve_config(config: Any, overrides: dict[str, Any]) -> ShardplugConfig:
    """``config`` (a ``ShardplugConfig`` or ``None``) with the keywords the user passed (not ``None``)
    applied; validated by ``ShardplugConfig`` (errors name the argument and the fix)."""
    unknown = set(overrides) - _FIELDS
    if unknown:
        raise TypeError(f"unknown shardplug option(s): {sorted(unknown)}")
    if "rng_types" in overrides and not isinstance(overrides["rng_types"], str):
        overrides = {**overrides, "rng_types": tuple(overrides["rng_types"])}
    if config is None:
        return ShardplugConfig(**overrides)
    if not isinstance(config, ShardplugConfig):
        raise TypeError(f"config={config!r} is invalid: pass a shardplug ShardplugConfig or None")
    return config.replace(**overrides) if overrides else config


def data_loader_kwargs(
    config: ShardplugConfig, num_processes: int, process_index: int, device: Any, even_batches: Optional[bool] = None
) -> dict[str, Any]:
    """``prepare_data_loader`` keywords for one loader of this process (``even_batches`` overrides the config's)."""
    kwargs = config.data_loader_kwargs()
    if even_batches is not None:
        kwargs["even_batches"] = even_batches
    if config.put_on_device:
        kwargs["device"] = device
    kwargs["num_processes"] = num_processes
    kwargs["process_index"] = process_index
    return kwargs


def _has_distributed_sampler(dataloader: DataLoader) -> bool:
    candidates = [getattr(dataloader, "sampler", None)]
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates.append(getattr(batch_sampler, "sampler", None))
    inner = getattr(batch_sampler, "_batch_sampler", None)  # Lightning's predict index wrapper
    candidates.append(getattr(inner, "sampler", None))
    return any(isinstance(s, DistributedSampler) for s in candidates)


def refuse_distributed_sampler(dataloader: DataLoader, hook: str) -> None:
    """Raise when the loader already shards itself: shardplug would shard it a second time."""
    if _has_distributed_sampler(dataloader):
        raise ValueError(
            f"the DataLoader returned by {hook} already uses a DistributedSampler, and the shardplug strategy "
            "shards every loader itself: each process would see only 1/N of its 1/N share. Remove the "
            "DistributedSampler from the DataLoader (use shuffle=True, or a plain sampler) and let shardplug "
            "shard it; shardplug's shuffle already agrees across processes and changes every epoch."
        )


def refuse_prepared(dataloader: DataLoader, hook: str) -> None:
    """Raise when the loader was already prepared by shardplug (it would be sharded twice)."""
    if isinstance(dataloader, PreparedDataLoader):
        raise ValueError(
            f"the DataLoader returned by {hook} was already prepared by shardplug.prepare_data_loader; "
            "the shardplug strategy prepares every loader itself. Return the plain torch DataLoader instead."
        )
