"""``ShardplugFabricDDPStrategy``: Fabric's ``DDPStrategy`` with shardplug's data loading.

``fabric.setup_dataloaders(loader)`` returns ``prepare_data_loader(loader, ...)`` for this process
(Fabric injects no ``DistributedSampler``: this strategy reports no sampler arguments). Fabric
loops are written by the user, so ``even_batches=False`` is allowed here. Fabric steps no
schedulers: use ``shardplug.core.training.TrainingRun`` / ``PreparedScheduler`` for scheduler and
accumulation semantics, or check :attr:`ShardplugFabricDDPStrategy.step_was_skipped` after
``optimizer.step()`` to skip a scheduler step the ``GradScaler`` skipped.

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShardplugFabricDDPStrategy(split_batches=True))
    fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader

from shardplug import prepare_data_loader

from ._options import ResolvedOptions, refuse_distributed_sampler, refuse_prepared, resolve_options

__all__ = ["ShardplugFabricDDPStrategy"]

logger = logging.getLogger(__name__)


class ShardplugFabricDDPStrategy(DDPStrategy):
    """Fabric's DDP strategy whose ``setup_dataloaders`` shards with ``shardplug.prepare_data_loader``.

    Args:
        config: a ``ShardplugConfig``; the keywords below override its fields.
        split_batches, even_batches, dispatch_batches, use_seedable_sampler, data_seed,
            non_blocking, use_stateful_dataloader, put_on_device, rng_types,
            slice_fn_for_dispatch: the ``prepare_data_loader`` options of every loader.
        **ddp_kwargs: every ``lightning.fabric.strategies.DDPStrategy`` keyword.
    """

    def __init__(
        self,
        *,
        config: Any = None,
        split_batches: Optional[bool] = None,
        even_batches: Optional[bool] = None,
        dispatch_batches: Optional[bool] = None,
        use_seedable_sampler: Optional[bool] = None,
        data_seed: Optional[int] = None,
        non_blocking: Optional[bool] = None,
        use_stateful_dataloader: Optional[bool] = None,
        put_on_device: Optional[bool] = None,
        rng_types: Any = None,
        slice_fn_for_dispatch: Optional[Callable[..., Any]] = None,
        **ddp_kwargs: Any,
    ) -> None:
        given = {
            "split_batches": split_batches,
            "even_batches": even_batches,
            "dispatch_batches": dispatch_batches,
            "use_seedable_sampler": use_seedable_sampler,
            "data_seed": data_seed,
            "non_blocking": non_blocking,
            "use_stateful_dataloader": use_stateful_dataloader,
            "put_on_device": put_on_device,
            "rng_types": tuple(rng_types) if rng_types is not None else None,
            "slice_fn_for_dispatch": slice_fn_for_dispatch,
        }
        self.shardplug_options: ResolvedOptions = resolve_options(config, {k: v for k, v in given.items() if v is not None})
        self._step_was_skipped = False
        super().__init__(**ddp_kwargs)

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        """``None``: Fabric then injects no ``DistributedSampler`` (shardplug shards in ``process_dataloader``)."""
        return None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``optimizer.step()`` was skipped (``GradScaler`` found inf/NaN gradients)."""
        return self._step_was_skipped

    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        """This process's loader: ``prepare_data_loader`` with the strategy's options."""
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        refuse_prepared(dataloader, "fabric.setup_dataloaders()")
        refuse_distributed_sampler(dataloader, "fabric.setup_dataloaders()")
        kwargs = dict(self.shardplug_options.data_kwargs)
        if kwargs.get("put_on_device"):
            kwargs["device"] = self.root_device
        return prepare_data_loader(dataloader, num_processes=self.world_size, process_index=self.global_rank, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's optimizer step, noting whether the optimizer really stepped (:attr:`step_was_skipped`)."""
        own = vars(optimizer)
        had_own_step = "step" in own
        previous = own.get("step")
        inner = optimizer.step
        called: list[bool] = []

        def tracking_step(*args: Any, **step_kwargs: Any) -> Any:
            called.append(True)
            return inner(*args, **step_kwargs)

        optimizer.step = tracking_step
        try:
            output = super().optimizer_step(optimizer, **kwargs)
        finally:
            if had_own_step:
                own["step"] = previous
            else:
                own.pop("step", None)
        self._step_was_skipped = not called
        return output

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``shardplug_ddp`` and ``shardplug_ddp_spawn`` in Fabric's registry."""
        for name, start_method in (("shardplug_ddp", "popen"), ("shardplug_ddp_spawn", "spawn")):
            strategy_registry.register(
                name, cls, description=f"shardplug DDP (start_method={start_method!r})", override=True,
                start_method=start_method,
            )
