"""The shardplug options of a strategy, and the data-side checks the strategies share.

The Lightning and Fabric strategies take their options through :class:`ShardplugOptions`: a
``ShardplugConfig`` and/or its fields as keywords (keywords win), merged once into the
:class:`~shardplug.core.config.ShardplugConfig` the strategy holds; every option is read from it,
never re-stated here, and every loader is prepared with ``prepare_data_loader(config=...)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, cast

from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from shardplug.core.config import ShardplugConfig
from shardplug.core.loaders import PreparedDataLoader

from . import compat

__all__ = ["ShardplugOptions", "resolve_config", "refuse_distributed_sampler", "refuse_prepared"]

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


class ShardplugOptions:
    """The shardplug options of a strategy, mixed in before the strategy class it extends.

    Keyword-only: ``config`` (a ``ShardplugConfig`` or ``None``) and every ``ShardplugConfig``
    field (``None``: the config's value); any other keyword goes to the strategy class it is mixed
    into. The merged value is ``strategy.shardplug_config``.

    Example::

        class MyStrategy(ShardplugOptions, DDPStrategy):
            def _check_shardplug_config(self, config):
                ...  # refuse what this front end cannot honour
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _signature(cls)  # type: ignore[attr-defined]

    def __init__(self, *, config: Any = None, **kwargs: Any) -> None:
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in _FIELDS}
        merged = resolve_config(config, {name: value for name, value in options.items() if value is not None})
        self._check_shardplug_config(merged)
        self.shardplug_config: ShardplugConfig = merged
        super().__init__(**kwargs)

    def _check_shardplug_config(self, config: ShardplugConfig) -> None:
        """Refuse options this front end cannot honour (a ``ValueError`` naming the option and the fix)."""

    def _loader_arguments(self, num_processes: int, process_index: int, **changes: Any) -> dict[str, Any]:
        """``prepare_data_loader`` arguments for one loader of this process: the strategy's config with
        the data option ``changes`` applied, the data topology, and the device when batches go on it."""
        config = self.shardplug_config.for_loaders(**changes)
        device = self.root_device if config.put_on_device else None  # type: ignore[attr-defined]
        return {"config": config, "device": device, "num_processes": num_processes, "process_index": process_index}


def _signature(cls: type) -> inspect.Signature:
    """What ``help()``, IDEs and argument parsers show for a strategy: ``config``, every
    ``ShardplugConfig`` field (``None``: the config's), the class's own keywords, ``**kwargs``."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    shardplug = [inspect.Parameter("config", keyword, default=None, annotation="Optional[ShardplugConfig]")]
    shardplug += [
        inspect.Parameter(f.name, keyword, default=None, annotation=_optional(str(f.type)))
        for f in dataclasses.fields(ShardplugConfig)
    ]
    own = [
        p
        for name, p in inspect.signature(cast(Any, cls).__init__).parameters.items()
        if p.kind is keyword and name not in _FIELDS and name != "config"
    ]
    return inspect.Signature([*shardplug, *own, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])


def _optional(annotation: str) -> str:
    return annotation if annotation.startswith("Optional[") else f"Optional[{annotation}]"


def _has_distributed_sampler(dataloader: DataLoader[Any]) -> bool:
    candidates = [getattr(dataloader, "sampler", None)]
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    candidates.append(getattr(batch_sampler, "sampler", None))
    inner = compat.inner_batch_sampler(batch_sampler)  # Lightning's predict index wrapper
    candidates.append(getattr(inner, "sampler", None))
    return any(isinstance(s, DistributedSampler) for s in candidates)


def refuse_distributed_sampler(dataloader: DataLoader[Any], hook: str, keep_it: str = "") -> None:
    """Raise when the loader already shards itself: shardplug would shard it a second time
    (``keep_it``: how this front end uses such a loader as it is, the error's second fix)."""
    if _has_distributed_sampler(dataloader):
        raise ValueError(
            f"the DataLoader returned by {hook} already uses a DistributedSampler, and the shardplug strategy "
            "shards every loader itself: each process would see only 1/N of its 1/N share. Remove the "
            "DistributedSampler from the DataLoader (use shuffle=True, or a plain sampler) and let shardplug "
            f"shard it; shardplug's shuffle already agrees across processes and changes every epoch.{keep_it}"
        )


def refuse_prepared(dataloader: DataLoader[Any], hook: str) -> None:
    """Raise when the loader was already prepared by shardplug (it would be sharded twice)."""
    if isinstance(dataloader, PreparedDataLoader):
        raise ValueError(
            f"the DataLoader returned by {hook} was already prepared by shardplug.prepare_data_loader; "
            "the shardplug strategy prepares every loader itself. Return the plain torch DataLoader instead."
        )
