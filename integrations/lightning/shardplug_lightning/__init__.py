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

from ._registry import register as _register
from .fabric import ShardplugFabricDDPStrategy
from .strategy import (
    ShardplugDDPStrategy,
    ShardplugFSDPStrategy,
    ShardplugModelParallelStrategy,
    ShardplugStrategyMixin,
    UnshardedLoaderWarning,
)

__all__ = [
    "ShardplugDDPStrategy",
    "ShardplugFSDPStrategy",
    "ShardplugModelParallelStrategy",
    "ShardplugFabricDDPStrategy",
    "ShardplugStrategyMixin",
    "UnshardedLoaderWarning",
]

__version__ = "0.1.0"

_register()
