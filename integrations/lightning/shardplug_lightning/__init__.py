"""shardplug for Lightning: Trainer and Fabric strategies that load data and step optimizers exactly.

Importing this package registers the strategy names ``"shardplug_ddp"`` and
``"shardplug_ddp_spawn"`` in the ``lightning.pytorch`` Trainer registry, in the ``pytorch_lightning``
one when that package is installed, and in Fabric's registry; and ``"shardplug_fsdp"`` and
``"shardplug_model_parallel"`` in the ``lightning.pytorch`` registry.

Example::

    import shardplug_lightning  # registers "shardplug_ddp"
    trainer = lightning.pytorch.Trainer(strategy="shardplug_ddp", accelerator="cpu", devices=2)
    # or, with options:
    trainer = lightning.pytorch.Trainer(strategy=shardplug_lightning.ShardplugDDPStrategy(split_batches=True), ...)
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from .fabric import ShardplugFabricDDPStrategy
from .strategy import (
    ShardplugDDPStrategy,
    ShardplugFSDPStrategy,
    ShardplugModelParallelStrategy,
    ShardplugStrategyMixin,
)

__all__ = [
    "ShardplugDDPStrategy",
    "ShardplugFSDPStrategy",
    "ShardplugModelParallelStrategy",
    "ShardplugFabricDDPStrategy",
    "ShardplugStrategyMixin",
    "STRATEGY_NAMES",
    "OTHER_STRATEGIES",
    "register",
]

__version__ = "0.1.0"

logger = logging.getLogger(__name__)

#: Registered strategy names and their process start methods.
STRATEGY_NAMES: dict[str, str] = {"shardplug_ddp": "popen", "shardplug_ddp_spawn": "spawn"}
#: The other registered names (``lightning.pytorch`` only) and their strategy classes.
OTHER_STRATEGIES: dict[str, type] = {
    "shardplug_fsdp": ShardplugFSDPStrategy,
    "shardplug_model_parallel": ShardplugModelParallelStrategy,
}


def _register_in(registry: Any, cls: type) -> None:
    for name, start_method in STRATEGY_NAMES.items():
        registry.register(
            name,
            cls,
            description=f"shardplug DDP (start_method={start_method!r})",
            override=True,
            start_method=start_method,
        )


def register() -> None:
    """Register the strategy names in every installed Lightning registry (done at import)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    _register_in(StrategyRegistry, ShardplugDDPStrategy)
    for name, cls in OTHER_STRATEGIES.items():
        StrategyRegistry.register(name, cls, description=f"shardplug {cls.__bases__[-1].__name__}", override=True)
    ShardplugFabricDDPStrategy.register_strategies(STRATEGY_REGISTRY)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PLStrategyRegistry

        from .pytorch_lightning_compat import PLShardplugDDPStrategy

        _register_in(PLStrategyRegistry, PLShardplugDDPStrategy)
    logger.debug("registered %s", sorted(STRATEGY_NAMES))


register()
