"""The strategy for the standalone ``pytorch_lightning`` package (its classes differ from ``lightning.pytorch``'s)."""

from __future__ import annotations

from .strategy import make_strategy_class

__all__ = ["PLShardplugDDPStrategy"]

#: ``ShardplugDDPStrategy`` for ``pytorch_lightning.Trainer`` (registered as ``"shardplug_ddp"`` there).
PLShardplugDDPStrategy: type = make_strategy_class("pytorch_lightning", "PLShardplugDDPStrategy")
PLShardplugDDPStrategy.__module__ = __name__
