"""``TrainingRun``: the plain-PyTorch front door.

One object per training run: it owns the run's :class:`GradientState` and hands out prepared
loaders, optimizers and schedulers that share it, plus a context manager for one micro-batch.

Example::

    >>> import torch
    >>> run = TrainingRun(ShardplugConfig(gradient_accumulation_steps=2), num_processes=1, process_index=0)
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = run.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> flags = []
    >>> for x in torch.ones(4, 1, 2):
    ...     with run.accumulate(model):
    ...         run.backward(model(x).sum())
    ...         opt.step(); opt.zero_grad()
    ...         flags.append(run.sync_gradients)
    >>> flags
    [False, True, False, True]
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from shardplug.core._internal.topology import ProcessTopology, resolve_data_topology
from shardplug.core.config import FRONT_ENDS, ShardplugConfig
from shardplug.core.evaluation import prepare_eval_loader
from shardplug.core.planner import prepare_data_loader
from shardplug.core.stepping import amp
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from shardplug.core.loader.prepared import PreparedDataLoader

__all__ = ["TrainingRun"]

logger = logging.getLogger(__name__)


class TrainingRun:
    """Loaders, optimizers and schedulers of one training run, stepping together.

    Args:
        config: the shared options (:class:`ShardplugConfig`); ``None`` = defaults.
        scaler: a ``torch.amp.GradScaler`` for mixed precision; prepared optimizers step through
            it and :meth:`backward` scales the loss with it.
        device: the process's device; ``None`` = the one the topology picks (CUDA device of the
            local rank, else CPU).
        num_processes: ``None`` = read from the running job (process group, else the launcher's
            environment, else a single process).
        process_index: ``None`` = read from the running job, as ``num_processes``.
        torch_device_mesh: a ``DeviceMesh`` whose data-parallel dimensions define the data topology.
        front_end: whose conventions the options left ``None`` follow
            (:meth:`ShardplugConfig.scales_scheduler`); integrations pass their name.

    Typical loop (``k`` = ``config.gradient_accumulation_steps``)::

        run = TrainingRun(ShardplugConfig(gradient_accumulation_steps=k), scaler=scaler)
        loader = run.prepare_data_loader(loader)
        optimizer = run.prepare_optimizer(optimizer)
        scheduler = run.prepare_scheduler(scheduler)
        for batch in loader:
            with run.accumulate(ddp_model):  # no all-reduce on the k-1 non-sync micro-batches
                run.backward(loss_fn(ddp_model, batch))
                optimizer.step()  # acts on sync micro-batches only
                scheduler.step()  # ... and only if the optimizer really stepped
                optimizer.zero_grad()
    """

    def __init__(
        self,
        config: ShardplugConfig | None = None,
        *,
        scaler: Any | None = None,
        device: str | torch.device | None = None,
        num_processes: int | None = None,
        process_index: int | None = None,
        torch_device_mesh: Any = None,
        front_end: str = "pytorch",
    ) -> None:
        if config is None:
            config = ShardplugConfig()
        if not isinstance(config, ShardplugConfig):
            raise TypeError(f"config={config!r} is not a ShardplugConfig; build one with ShardplugConfig(...)")
        self.config = config
        self.scaler = amp.check_scaler(scaler)
        self.num_processes, self.process_index = resolve_data_topology(num_processes, process_index, torch_device_mesh)
        self.torch_device_mesh = torch_device_mesh
        self.device = torch.device(device) if device is not None else ProcessTopology.current().device
        self.gradient_state = GradientState(num_steps=config.gradient_accumulation_steps)
        if front_end not in FRONT_ENDS:
            raise ValueError(f"front_end={front_end!r} is invalid: it must be one of {sorted(FRONT_ENDS)}")
        self.front_end = front_end
        self.optimizers: list[PreparedOptimizer] = []
        self.schedulers: list[PreparedScheduler] = []

    # -- state -------------------------------------------------------------------------------
    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch synchronises gradients and steps the optimizers."""
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    # -- preparing ---------------------------------------------------------------------------
    def prepare_data_loader(self, dataloader: DataLoader[Any], **overrides: Any) -> PreparedDataLoader:
        """``prepare_data_loader`` with this run's options (``overrides`` win), connected to the
        run's gradient state so that its last batch of each pass ends an accumulation cycle."""
        loader = prepare_data_loader(dataloader, **self._loader_kwargs(overrides))
        loader.gradient_state = self.gradient_state
        return loader

    def _loader_kwargs(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """``prepare_data_loader`` arguments: ``config`` (the run's, data ``overrides`` applied with
        :meth:`ShardplugConfig.for_loaders`) and this run's topology and device (also overridable)."""
        arguments: dict[str, Any] = {
            "device": self.device,
            "num_processes": self.num_processes,
            "process_index": self.process_index,
            "torch_device_mesh": self.torch_device_mesh,
        }
        options = {name: value for name, value in overrides.items() if name not in arguments}
        arguments.update((name, value) for name, value in overrides.items() if name not in options)
        arguments["config"] = self.config.for_loaders(**options)
        return arguments

    def prepare_eval_loader(
        self, dataloader: DataLoader[Any], *, drop_padding: bool = False, **overrides: Any
    ) -> PreparedDataLoader:
        """This process's evaluation loader: :func:`shardplug.core.evaluation.prepare_eval_loader` with
        this run's options (``overrides`` win), never tied to the gradient state.

        Every process gets the same number of batches whatever the configured ``even_batches`` (an
        evaluation set smaller than one global batch included), and the padding is marked
        (``loader.batch_real_count``; ``drop_padding=True`` also cuts it off the batches), so every
        sample counts once after ``drop_padding`` / ``gather_for_metrics``.
        """
        overrides = dict(overrides)
        even_batches = overrides.pop("even_batches", None)  # evaluation's own rule decides (and refuses False)
        arguments = self._loader_kwargs(overrides)
        if even_batches is not None:
            arguments["even_batches"] = even_batches
        return prepare_eval_loader(dataloader, drop_padding=drop_padding, **arguments)

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool = True) -> PreparedOptimizer:
        """Wrap ``optimizer`` so that it steps at the end of each accumulation cycle, through the
        run's scaler."""
        prepared = PreparedOptimizer(
            optimizer,
            device_placement=device_placement,
            scaler=self.scaler,
            device=self.device if device_placement and self.config.put_on_device else None,
            gradient_state=self.gradient_state,
        )
        self.optimizers.append(prepared)
        return prepared

    def prepare_scheduler(
        self,
        scheduler: Any,
        optimizers: Optimizer | Iterable[Optimizer] | None = None,
        *,
        scale_scheduler_by_num_processes: bool | None = None,
    ) -> PreparedScheduler:
        """Wrap ``scheduler``; it follows ``optimizers`` (default: the prepared optimizer of the
        scheduler's own optimizer, else every optimizer this run prepared).

        ``scale_scheduler_by_num_processes`` overrides the config's value for this scheduler.
        """
        config = self.config
        if scale_scheduler_by_num_processes is not None:
            config = config.replace(scale_scheduler_by_num_processes=scale_scheduler_by_num_processes)
        if optimizers is None:
            target = getattr(scheduler, "optimizer", None)
            matching = [o for o in self.optimizers if o is target or o.optimizer is target]
            optimizers = matching or list(self.optimizers) or ([target] if target is not None else [])
        prepared = PreparedScheduler.from_config(
            scheduler,
            optimizers,
            config,
            front_end=self.front_end,
            num_processes=self.num_processes,
            gradient_state=self.gradient_state,
        )
        self.schedulers.append(prepared)
        return prepared

    # -- one micro-batch ---------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module, force_sync: bool = False) -> Iterator[bool]:
        """Context for one micro-batch; yields whether it synchronises gradients.

        Call it after fetching the batch. On non-sync micro-batches every model that has a
        ``no_sync()`` context (``DistributedDataParallel``, FSDP) skips its gradient all-reduce.
        ``force_sync=True`` makes this micro-batch sync (end of a hand-written loop).
        """
        sync = self.gradient_state.begin_micro_batch(force_sync=force_sync)
        try:
            with contextlib.ExitStack() as stack:
                if not sync:
                    for model in models:
                        no_sync = getattr(model, "no_sync", None)
                        if callable(no_sync):
                            stack.enter_context(no_sync())
                yield sync
        except BaseException:
            self.abandon_step()
            raise

    def abandon_step(self) -> None:
        """Drop the optimizer step being prepared: its gradients, the scaler's record, the cycle.

        Done for you when an exception leaves :meth:`accumulate` (e.g. an out-of-memory error caught
        around the micro-batch, after which the loop goes on): the gradients accumulated in the
        current cycle are cleared, the scaler forgets what it unscaled for the step that never came,
        and the next micro-batch starts a new cycle. The next update is then exactly the one a run
        that never saw the failed cycle would make.
        """
        for prepared in self.optimizers:
            prepared.abandon_step()
        self.gradient_state.restart_cycle()
        logger.warning("an exception ended a micro-batch: the optimizer step in progress was abandoned")

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, averaged over the accumulation cycle (divided by
        ``gradient_accumulation_steps``) and scaled by the run's scaler when there is one.

        If an optimizer's gradients were unscaled for a step that never came (an exception between
        :meth:`clip_grad_norm_` and ``step()``, caught outside :meth:`accumulate`), that step is
        abandoned first (:meth:`PreparedOptimizer.abandon_step`): new scaled gradients are never
        added to unscaled ones.
        """
        if amp.scaler_enabled(self.scaler):
            for prepared in self.optimizers:
                if amp.is_unscaled(self.scaler, prepared.optimizer) or amp.is_unscaled(self.scaler, prepared):
                    logger.warning(
                        "backward() after the gradients of %s were unscaled for a step that never came: that step "
                        "is abandoned (its gradients cleared)",
                        type(prepared.optimizer).__name__,
                    )
                    prepared.abandon_step()
        loss = loss / self.gradient_state.num_steps
        if amp.scaler_enabled(self.scaler):
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def clip_grad_norm_(
        self, parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor | None:
        """Unscale (when there is a scaler) and clip gradients, on sync micro-batches only.

        Only the prepared optimizers that hold some of ``parameters`` are unscaled, each once.

        Returns the total norm, or ``None`` on a micro-batch that does not sync (the gradients are
        still partial sums then, and clipping them would change the result).
        """
        if not self.gradient_state.sync_gradients:
            return None
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if amp.scaler_enabled(self.scaler):
            wanted = {id(p) for p in parameters}
            for prepared in self.optimizers:
                owns = any(id(p) in wanted for group in prepared.param_groups for p in group["params"])
                if prepared.scaler is not self.scaler or not owns or amp.is_unscaled(self.scaler, prepared):
                    continue  # another scaler, other parameters, or already unscaled by the user
                amp.unscale_once(self.scaler, prepared.optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_processes={self.num_processes}, process_index={self.process_index}, "
            f"device={self.device}, gradient_accumulation_steps={self.gradient_state.num_steps})"
        )
