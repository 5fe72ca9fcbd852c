"""Options of the shardplug strategies, and the data-side helpers they share.

The strategies accept a ``shardplug`` configuration value (``ShardplugConfig``) and/or its fields
as keywords; keywords win over the value's fields. :func:`resolve_options` turns them into the
keyword arguments of :func:`shardplug.prepare_data_loader` plus the stepping options.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from shardplug.core.loaders import PreparedDataLoader

__all__ = ["ResolvedOptions", "resolve_options", "refuse_distributed_sampler", "refuse_prepared"]

logger = logging.getLogger(__name__)

try:  # the shared configuration value (shardplug >= the stepping release)
    from shardplug.core.config import ShardplugConfig
except ImportError:  # pragma: no cover - older shardplug: keywords only
    ShardplugConfig = None  # type: ignore[assignment,misc]

#: ``prepare_data_loader`` keywords a strategy decides (the run-specific ones are filled in per process).
DATA_FIELDS: tuple[str, ...] = (
    "split_batches",
    "even_batches",
    "dispatch_batches",
    "use_seedable_sampler",
    "data_seed",
    "non_blocking",
    "use_stateful_dataloader",
    "put_on_device",
    "rng_types",
    "slice_fn_for_dispatch",
)
STEP_FIELDS: tuple[str, ...] = ("gradient_accumulation_steps", "step_scheduler_with_optimizer")

_DATA_DEFAULTS: dict[str, Any] = {
    "split_batches": False,
    "even_batches": True,
    "dispatch_batches": None,
    "use_seedable_sampler": False,
    "data_seed": None,
    "non_blocking": False,
    "use_stateful_dataloader": False,
    "put_on_device": False,
    "rng_types": None,
    "slice_fn_for_dispatch": None,
}


@dataclass(frozen=True)
class ResolvedOptions:
    """What a strategy does with the data and the optimizers (plain values: the strategy stays picklable)."""

    data_kwargs: dict[str, Any] = field(default_factory=dict)
    gradient_accumulation_steps: int = 1
    step_scheduler_with_optimizer: bool = True

    @property
    def split_batches(self) -> bool:
        return bool(self.data_kwargs.get("split_batches", False))

    @property
    def even_batches(self) -> bool:
        return bool(self.data_kwargs.get("even_batches", True))


def resolve_options(config: Any, overrides: dict[str, Any]) -> ResolvedOptions:
    """Merge ``config`` (a ``ShardplugConfig`` or ``None``) with explicit keyword ``overrides``.

    ``overrides`` holds only the keywords the user passed (not ``None``). The merged value is
    validated by ``ShardplugConfig`` when it is available (errors name the argument and the fix).
    """
    unknown = set(overrides) - set(DATA_FIELDS) - set(STEP_FIELDS)
    if unknown:
        raise TypeError(f"unknown shardplug option(s): {sorted(unknown)}")
    if ShardplugConfig is not None:
        if config is None:
            merged = ShardplugConfig(**overrides)
        elif isinstance(config, ShardplugConfig):
            merged = config.replace(**overrides) if overrides else config
        else:
            raise TypeError(f"config={config!r} is invalid: pass a shardplug ShardplugConfig or None")
        return ResolvedOptions(
            data_kwargs=merged.data_loader_kwargs(),
            gradient_accumulation_steps=merged.gradient_accumulation_steps,
            step_scheduler_with_optimizer=merged.step_scheduler_with_optimizer,
        )
    if config is not None:  # pragma: no cover - older shardplug
        raise TypeError("config= needs shardplug with ShardplugConfig; pass the options as keywords instead")
    data = dict(_DATA_DEFAULTS)
    data.update({k: v for k, v in overrides.items() if k in DATA_FIELDS})
    if data["rng_types"] is not None:
        data["rng_types"] = list(data["rng_types"])
    return ResolvedOptions(
        data_kwargs=data,
        gradient_accumulation_steps=int(overrides.get("gradient_accumulation_steps", 1)),
        step_scheduler_with_optimizer=bool(overrides.get("step_scheduler_with_optimizer", True)),
    )


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
