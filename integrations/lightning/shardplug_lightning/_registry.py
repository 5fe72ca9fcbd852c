"""The Lightning strategy names shardplug registers, and the registration (run when the package is imported).

Example::

    >>> sorted(STRATEGY_NAMES)
    ['shardplug_ddp', 'shardplug_ddp_spawn']
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from .fabric import ShardplugFabricDDPStrategy
from .strategy import ShardplugDDPStrategy, ShardplugFSDPStrategy, ShardplugModelParallelStrategy

__all__ = ["STRATEGY_NAMES", "OTHER_STRATEGIES", "register"]

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
