"""``ShardplugFabricDDPStrategy``: Fabric's ``DDPStrategy`` with shardplug's data loading and stepping.

``fabric.setup_dataloaders(loader)`` returns ``prepare_data_loader(loader, ...)`` for this process
(Fabric injects no ``DistributedSampler``: this strategy reports no sampler arguments). Fabric
loops are written by the user, so ``even_batches=False`` is allowed here. A scheduler given to
``fabric.setup(model, optimizer, scheduler=scheduler)`` comes back as a
:class:`~shardplug.core.stepping.scheduler.PreparedScheduler`: it advances only after real optimizer
updates (not after a step the ``GradScaler`` skipped, fused optimizers included), with the same
rules as every other front end.

Example::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ShardplugFabricDDPStrategy(split_batches=True))
    fabric.launch()
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=True))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from lightning.fabric.strategies.ddp import DDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from shardplug import prepare_data_loader
from shardplug.core.config import ShardplugConfig
from shardplug.core.evaluation import prepare_eval_loader
from shardplug.core.graphs.reading import is_graph
from shardplug.core.stepping import amp
from shardplug.core.stepping.scheduler import PreparedScheduler

from ._options import ShardplugOptions, refuse_prepared

__all__ = ["ShardplugFabricDDPStrategy"]

logger = logging.getLogger(__name__)


class ShardplugFabricDDPStrategy(ShardplugOptions, DDPStrategy):
    """Fabric's DDP strategy whose ``setup_dataloaders`` shards with ``shardplug.prepare_data_loader``.

    Keyword-only arguments: ``config`` and every ``ShardplugConfig`` field (``None``: the config's
    value; the ``prepare_data_loader`` options of every loader, and how the scheduler of
    ``fabric.setup`` steps). Every other keyword goes to ``lightning.fabric``'s ``DDPStrategy``
    (``accelerator``, ``process_group_backend``, ``start_method``, DDP's ``find_unused_parameters``, ...).

    Args:
        scale_scheduler_by_num_processes: ``None`` (here and in the config): off, Fabric's
            convention, whose ``len(loader)`` is already per process.
        gradient_accumulation_steps: other than 1 is refused: in a Fabric loop you decide when to
            step (``fabric.no_backward_sync``), and the option would do nothing.

    Example::

        strategy = ShardplugFabricDDPStrategy(split_batches=True, process_group_backend="gloo")
    """

    def __init__(
        self,
        *,
        config: ShardplugConfig | None = None,
        split_batches: bool | None = None,
        even_batches: bool | None = None,
        dispatch_batches: bool | None = None,
        use_seedable_sampler: bool | None = None,
        data_seed: int | None = None,
        non_blocking: bool | None = None,
        use_stateful_dataloader: bool | None = None,
        put_on_device: bool | None = None,
        rng_types: tuple[str, ...] | None = None,
        slice_fn_for_dispatch: Callable[..., Any] | None = None,
        shuffle_algorithm: str | None = None,
        prefetch_depth: int | None = None,
        gradient_accumulation_steps: int | None = None,
        step_scheduler_with_optimizer: bool | None = None,
        scale_scheduler_by_num_processes: bool | None = None,
        **kwargs: Any,
    ) -> None:
        self._take_options(config, locals())  # every ShardplugConfig field is a parameter above
        self._last_step: amp.StepAttempt | None = None
        super().__init__(**kwargs)  # Fabric's DDPStrategy keywords

    @override
    def _check_shardplug_config(self, config: ShardplugConfig) -> None:
        if config.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={config.gradient_accumulation_steps} has no effect with Fabric: your "
                "loop decides when to step. Leave it 1, skip optimizer.step() on accumulating micro-batches and "
                "wrap them in fabric.no_backward_sync(model)"
            )

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        """``None``: Fabric then injects no ``DistributedSampler`` (shardplug shards in ``process_dataloader``)."""
        return None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``optimizer.step()`` made no update (``GradScaler`` found inf/NaN gradients)."""
        return self._last_step is not None and self._last_step.skipped

    def process_dataloader(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        """This process's loader: ``prepare_data_loader`` with the strategy's options."""
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        refuse_prepared(dataloader, "fabric.setup_dataloaders()")  # a DistributedSampler of the job's is adopted
        prepared = prepare_data_loader(dataloader, **self._loader_arguments(self.world_size, self.global_rank))
        # Fabric's wrapper sets its own count of passes as the samplers' epoch at every iter(): a resumed run
        # would read a loaded epoch in another epoch's order. The loader's own epoch decides.
        prepared.keeps_own_epoch = True
        return prepared

    def prepare_loader(self, loader: Any) -> Any:
        """This process's part of a training loader ``fabric.setup_dataloaders`` cannot take: a ``torchdata.nodes``
        graph (a ``Loader`` or a ``BaseNode``), prepared with the strategy's options (a ``DataLoader`` goes through
        :meth:`process_dataloader`, as ``setup_dataloaders`` would send it).

        Example::

            loader = fabric.strategy.prepare_loader(tn.Loader(tn.Batcher(tn.SamplerWrapper(sampler), 8)))
        """
        if isinstance(loader, DataLoader):
            return self.process_dataloader(loader)
        if not is_graph(loader):
            raise TypeError(
                f"loader={type(loader).__name__} is neither a DataLoader nor a torchdata.nodes graph: shardplug cannot "
                "shard it; pass one of those, or read only this process's part inside it and use it as it is"
            )
        arguments = self._loader_arguments(self.world_size, self.global_rank)
        if self.shardplug_config.dispatch_batches:  # a graph is read by every process, never dispatched
            arguments["config"] = arguments["config"].replace(dispatch_batches=False, slice_fn_for_dispatch=None)
        return prepare_data_loader(loader, **arguments)

    def prepare_eval_loader(self, dataloader: DataLoader[Any], *, drop_padding: bool = False) -> DataLoader[Any]:
        """This process's evaluation loader, by the core's rule (``shardplug.core.evaluation``): the same
        number of batches on every process whatever ``even_batches`` says (a set smaller than one
        global batch, or more processes than batches, leaves no process out of a collective), the
        padding marked in ``loader.batch_real_count`` (``shardplug.gather_for_metrics(outputs, loader)``
        counts each sample once) and, with ``drop_padding=True``, cut off the batches.

        Use it instead of ``fabric.setup_dataloaders`` for evaluation loaders (Fabric cannot tell them
        from training loaders); batches arrive on the device when ``put_on_device=True``.
        """
        refuse_prepared(dataloader, "fabric.strategy.prepare_eval_loader()")
        arguments = self._loader_arguments(self.world_size, self.global_rank)
        return cast("DataLoader[Any]", prepare_eval_loader(dataloader, drop_padding=drop_padding, **arguments))

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """Fabric's set-up; the scheduler comes back as a ``PreparedScheduler`` following real steps."""
        module, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        if scheduler is not None and not isinstance(scheduler, PreparedScheduler):
            scheduler = PreparedScheduler.from_config(
                scheduler, None, self.shardplug_config, front_end="fabric", num_processes=self.world_size
            )
        return module, optimizers, scheduler

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Fabric's optimizer step, counted by shardplug's real-step counter (:attr:`step_was_skipped`);
        if it raises, the scaler's record of the step is closed."""
        scaler = getattr(self.precision, "scaler", None)
        with amp.StepAttempt(optimizer, scaler) as attempt:
            self._last_step = attempt
            return super().optimizer_step(optimizer, **kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``shardplug_ddp`` and ``shardplug_ddp_spawn`` in Fabric's registry."""
        for name, start_method in (("shardplug_ddp", "popen"), ("shardplug_ddp_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"shardplug DDP (start_method={start_method!r})",
                override=True,
                start_method=start_method,
            )
