"""The strategy for the standalone ``pytorch_lightning`` package (its classes differ from ``lightning.pytorch``'s)."""

from __future__ import annotations

from pytorch_lightning.strategies import DDPStrategy

from .strategy import ShardplugStrategyMixin

__all__ = ["PLShardplugDDPStrategy"]


class PLShardplugDDPStrategy(ShardplugStrategyMixin, DDPStrategy):
    """``pytorch_lightning``'s ``DDPStrategy`` with shardplug, for ``pytorch_lightning.Trainer`` (registered as
    ``"shardplug_ddp"`` there): ``ShardplugDDPStrategy``'s options and behaviour. Its keywords:
    :class:`~shardplug_lightning.ShardplugStrategyMixin`'s and ``DDPStrategy``'s."""

    _pl_namespace = "pytorch_lightning"
