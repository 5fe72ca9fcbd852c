"""shardplug for PyTorch-Ignite: exact sharded loading, accumulation, AMP skips and resume for ``Engine``.

Example::

    from shardplug.core.config import ShardplugConfig
    from shardplug_ignite import ShardplugHandler

    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
    loader = handler.prepare_data_loader(DataLoader(dataset, batch_size=8, shuffle=True))
    trainer = handler.create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    trainer.run(loader, max_epochs=3)
"""

from shardplug.core.config import ShardplugConfig

from .evaluation import RealSamplesOnly, drop_padding_if_tracked, evaluation_step, real_count
from .handler import ShardplugHandler
from .steps import ShardplugEvents

__version__ = "0.1.0"

__all__ = [
    "RealSamplesOnly",
    "ShardplugConfig",
    "ShardplugEvents",
    "ShardplugHandler",
    "drop_padding_if_tracked",
    "evaluation_step",
    "real_count",
]
