"""``ShardplugHandler``: shardplug's loaders and stepping for a PyTorch-Ignite ``Engine``.

It composes small handlers, each with ``attach(engine)``: :class:`~shardplug_ignite.epochs.EpochSync`
(epochs and resume), :class:`~shardplug_ignite.steps.StepEvents` (accumulation and real-step
events), :class:`~shardplug_ignite.steps.SchedulerSteps` (the attached schedulers) and the
evaluation pieces of :mod:`shardplug_ignite.evaluation`; the sharding and stepping rules are the
core's (``shardplug.core``). The first three are ``Serializable``: the handler's state is theirs,
gathered.

Example::

    handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
    loader = handler.prepare_data_loader(DataLoader(dataset, batch_size=8, shuffle=True))
    trainer = handler.create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    trainer.run(loader, max_epochs=3)
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import ignite.distributed as idist
import torch
from ignite.base.mixins import Serializable
from ignite.engine import DeterministicEngine, Engine, Events
from ignite.metrics import Metric
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler

from shardplug.core.config import ShardplugConfig
from shardplug.core.loader.prepared import PreparedDataLoader
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler
from shardplug.core.stepping.training import TrainingRun

from .compat import ignite_prepare_batch, required_state_keys, requires_state_keys
from .epochs import EpochSync
from .evaluation import RealSamplesOnly, _call_model, _identity, evaluation_step
from .steps import SchedulerSteps, ShardplugEvents, StepEvents, register_step_events

__all__ = ["ShardplugHandler"]

logger = logging.getLogger(__name__)


def _loss_item(x: Any, y: Any, y_pred: Any, loss: torch.Tensor) -> float:
    return loss.item()


@requires_state_keys(
    *required_state_keys(EpochSync), *required_state_keys(StepEvents), *required_state_keys(SchedulerSteps)
)  # ("loader", "gradient_state", "optimizer_step", "optimizer_step_skipped", "schedulers")
class ShardplugHandler(Serializable):
    """Makes an Ignite ``Engine`` train with shardplug's exact data sharding and stepping.

    Args:
        config: the shared options (:class:`~shardplug.core.config.ShardplugConfig`):
            ``split_batches``, ``even_batches``, ``gradient_accumulation_steps``,
            ``use_seedable_sampler``/``data_seed``, ...; ``None`` = defaults.
        scaler: a ``torch.amp.GradScaler``: prepared optimizers step through it, the training
            step scales the loss and runs the forward pass under ``torch.autocast``.
        device: the process's device (``None``: the local CUDA device, else CPU).
        num_processes: ``None`` = from the running job (``idist``'s process group).
        process_index: ``None`` = from the running job.

    :meth:`attach` attaches :class:`~shardplug_ignite.epochs.EpochSync` (``STARTED``,
    ``EPOCH_STARTED``, ``DATALOADER_STOP_ITERATION``, ``TERMINATE_SINGLE_EPOCH``, ``EPOCH_COMPLETED``: the
    loader's epoch and ``len()``, the resume position, equal epoch lengths on every rank) and
    :class:`~shardplug_ignite.steps.StepEvents` (``ITERATION_STARTED``: sync or accumulate;
    ``ITERATION_COMPLETED``: ``OPTIMIZER_STEP_COMPLETED`` / ``OPTIMIZER_STEP_SKIPPED``).

    The handler is ``Serializable``: put it in a ``Checkpoint``'s ``to_save``. Its state is the
    loader's full position, the gradient state, the step counters and the attached schedulers'
    states, the same on every rank and loadable with ``weights_only=True``; resuming continues
    mid-epoch exactly, also with another number of processes.

    Example::

        handler = ShardplugHandler(ShardplugConfig(gradient_accumulation_steps=2))
        loader = handler.prepare_data_loader(DataLoader(ds, batch_size=8, shuffle=True))
        model = idist.auto_model(model)
        trainer = handler.create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
        handler.attach_scheduler(trainer, torch.optim.lr_scheduler.StepLR(handler.optimizers[0], 10))
        to_save = {"trainer": trainer, "model": model, "optimizer": handler.optimizers[0], "shardplug": handler}
        trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED(every=50),
                                  Checkpoint(to_save, DiskSaver("ckpt", require_empty=False)))
        trainer.run(loader, max_epochs=3)
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
    ) -> None:
        self.run = TrainingRun(
            config,
            front_end="ignite",
            scaler=scaler,
            device=device,
            num_processes=num_processes,
            process_index=process_index,
            torch_device_mesh=torch_device_mesh,
        )
        self.config: ShardplugConfig = self.run.config
        self.epochs = EpochSync()
        self.steps = StepEvents(self.run)
        self.schedulers = SchedulerSteps(self.run)
        #: the pieces whose states make the handler's (each saves and loads its own keys)
        self._pieces: tuple[Serializable, ...] = (self.epochs, self.steps, self.schedulers)
        self._engine: Engine | None = None

    # -- properties --------------------------------------------------------------------------
    @property
    def gradient_state(self) -> Any:
        """The run's :class:`~shardplug.core.stepping.accumulation.GradientState`."""
        return self.run.gradient_state

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch synchronises gradients and steps the optimizers."""
        return self.run.gradient_state.sync_gradients

    @property
    def scaler(self) -> Any | None:
        return self.run.scaler

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def optimizers(self) -> list[PreparedOptimizer]:
        """The optimizers prepared by this handler."""
        return self.run.optimizers

    @property
    def optimizer_step(self) -> int:
        """Real optimizer steps so far (also ``engine.state.optimizer_step``)."""
        return self.steps.optimizer_step

    @property
    def optimizer_step_skipped(self) -> int:
        """Optimizer steps the scaler skipped so far."""
        return self.steps.optimizer_step_skipped

    # -- preparing ---------------------------------------------------------------------------
    def prepare_data_loader(self, dataloader: DataLoader[Any], **overrides: Any) -> PreparedDataLoader:
        """This process's training loader for ``dataloader`` (``overrides`` beat the config).

        Unlike ``idist.auto_dataloader`` it shards any batch sampler, keeps the batch size per
        process (``split_batches=False``) or cuts it exactly (``split_batches=True``), and shuffles
        with a seed agreed across ranks. Pass the result to ``trainer.run``.
        """
        loader = self.run.prepare_data_loader(dataloader, **overrides)
        self.epochs.loader = loader
        return loader

    def prepare_eval_loader(self, dataloader: DataLoader[Any], **overrides: Any) -> PreparedDataLoader:
        """This process's evaluation loader (``TrainingRun.prepare_eval_loader``): sharded like a
        training loader, not tied to the gradient state, padding tracked for every kind of data that
        has any. Use it with :meth:`create_evaluator` / :meth:`evaluation_step`, which drop the
        padding so every sample counts once."""
        return self.run.prepare_eval_loader(dataloader, **overrides)

    def auto_dataloader(self, dataset: Any, train: bool = True, **kwargs: Any) -> PreparedDataLoader:
        """Drop-in for ``idist.auto_dataloader(dataset, **kwargs)``, with its meaning of the arguments.

        ``batch_size`` is the **global** batch (``idist.auto_dataloader`` divides it by the world
        size): each process gets ``batch_size / num_processes`` rows of every batch
        (``split_batches=True``), and a ``batch_size`` that does not divide is a ``ValueError``
        instead of idist's silent rounding down. A ``batch_sampler=`` (which idist leaves unsharded,
        so that every process would read every batch) is sharded as :meth:`prepare_data_loader`
        shards it: each process gets whole batches of it. ``num_workers`` is divided by the
        processes per node, rounded up, as idist does. Sharding, shuffling and padding are shardplug's.
        A ``sampler=DistributedSampler(...)`` is kept, as idist keeps it, with idist's per-process batch
        (``batch_size // num_processes``): shardplug adopts it (the batches native DDP gives, with its resume).
        """
        n = self.run.num_processes
        adopted = isinstance(kwargs.get("sampler"), DistributedSampler)  # code written for DDP, kept as idist keeps it
        if adopted and kwargs.get("batch_size", 1) >= n:  # idist's per-process batch, rounded down as idist does
            kwargs["batch_size"] = kwargs.get("batch_size", 1) // n
        batch_size = kwargs.get("batch_size", 1) if kwargs.get("batch_sampler") is None and not adopted else None
        if batch_size is not None and batch_size % n:
            raise ValueError(
                f"batch_size={batch_size} is the global batch of auto_dataloader and does not divide by the "
                f"{n} processes; pass a multiple of {n}, or build DataLoader(dataset, batch_size=per_process) "
                "and use handler.prepare_data_loader"
            )
        per_node = idist.get_nproc_per_node() if idist.get_world_size() > 1 else 1
        if kwargs.get("num_workers") and per_node > 1:
            kwargs["num_workers"] = (kwargs["num_workers"] + per_node - 1) // per_node
        loader = DataLoader(dataset, **kwargs)
        split = batch_size is not None and n > 1
        prepare = self.prepare_data_loader if train else self.prepare_eval_loader
        return prepare(loader, split_batches=split) if split else prepare(loader)

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool = True) -> PreparedOptimizer:
        """Wrap ``optimizer`` so that it steps once per accumulation cycle, through the scaler; the
        handler watches its steps to fire :class:`ShardplugEvents`."""
        if isinstance(optimizer, PreparedOptimizer):
            if optimizer not in self.run.optimizers:
                raise ValueError("this PreparedOptimizer was prepared elsewhere; pass the plain optimizer")
            return optimizer
        prepared = self.run.prepare_optimizer(optimizer, device_placement=device_placement)
        self.steps.watch(prepared)
        return prepared

    def attach_scheduler(
        self,
        engine: Engine,
        scheduler: Any,
        optimizers: Optimizer | Sequence[Optimizer] | None = None,
        *,
        scale_scheduler_by_num_processes: bool | None = None,
    ) -> PreparedScheduler:
        """Step a torch ``LRScheduler`` after every real optimizer step (never while accumulating,
        never after a step the scaler skipped); its state is part of the handler's.

        ``scale_scheduler_by_num_processes=True`` steps it ``num_processes`` times per optimizer
        step when batches are not split (a schedule sized on the unsharded loader's length).
        ``None`` takes the config's value; when that is ``None`` too, off: Ignite's convention
        (``ShardplugConfig.scales_scheduler("ignite")``), a schedule is sized in optimizer steps.
        ``ReduceLROnPlateau`` needs a metric: step it yourself after evaluation.

        An Ignite ``ParamScheduler`` follows real steps too: ``trainer.add_event_handler(
        ShardplugEvents.OPTIMIZER_STEP_COMPLETED, param_scheduler)``.
        """
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric: call scheduler.step(metric) in an evaluator handler instead"
            )
        prepared = self.run.prepare_scheduler(
            scheduler, optimizers, scale_scheduler_by_num_processes=scale_scheduler_by_num_processes
        )
        register_step_events(engine)
        event = (
            ShardplugEvents.OPTIMIZER_STEP_COMPLETED
            if self.config.step_scheduler_with_optimizer
            else Events.ITERATION_COMPLETED
        )
        self.schedulers.step_at(engine, event, prepared)
        return prepared

    # -- attaching ---------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        """Attach the epoch and step handlers to the trainer ``engine`` (see the class doc)."""
        if isinstance(engine, DeterministicEngine):
            raise TypeError(
                "ShardplugHandler cannot drive a DeterministicEngine: it rebuilds the loader with its own "
                "ReproducibleBatchSampler and reseeds the global RNG, which fights shardplug's sharded, "
                "seeded loader. Use ignite.engine.Engine; shardplug already makes each epoch's order a pure "
                "function of the seed and the epoch, and resumes mid-epoch exactly."
            )
        if self._engine is not None and self._engine is not engine:
            raise RuntimeError("this ShardplugHandler is already attached to another engine; create one per trainer")
        if self._engine is engine:
            return
        self._engine = engine
        for piece in self._pieces:
            piece.attach(engine)  # type: ignore[attr-defined]

    # -- micro-batch helpers -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, *models: torch.nn.Module) -> Iterator[bool]:
        """Skip the DDP/FSDP gradient all-reduce of ``models`` on micro-batches that do not sync;
        yields whether this micro-batch syncs."""
        sync = self.sync_gradients
        with contextlib.ExitStack() as stack:
            if not sync:
                for model in models:
                    context = getattr(model, "no_sync", None)
                    if callable(context):
                        stack.enter_context(context())
            yield sync

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` averaged over the accumulation cycle and scaled by the scaler."""
        self.run.backward(loss, **kwargs)

    def _autocast(self, enabled: bool | None, dtype: torch.dtype | None) -> Any:
        if enabled is None:
            enabled = self.scaler is not None and bool(self.scaler.is_enabled())
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    # -- step factories ----------------------------------------------------------------------
    def training_step(
        self,
        model: torch.nn.Module,
        optimizer: Optimizer,
        loss_fn: Callable[..., torch.Tensor],
        *,
        device: str | torch.device | None = None,
        non_blocking: bool = False,
        prepare_batch: Callable[..., tuple[Any, Any]] = ignite_prepare_batch,
        model_transform: Callable[[Any], Any] = _identity,
        output_transform: Callable[[Any, Any, Any, torch.Tensor], Any] = _loss_item,
        model_fn: Callable[[torch.nn.Module, Any], Any] = _call_model,
        clip_grad_norm: float | None = None,
        autocast: bool | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> Callable[[Engine, Any], Any]:
        """The process function of a trainer: shardplug's ``supervised_training_step``.

        Per iteration: forward (under ``torch.autocast`` when the handler has an enabled scaler, or
        ``autocast=True``), ``loss / gradient_accumulation_steps`` scaled and back-propagated inside
        ``model.no_sync()`` on non-sync micro-batches, optional clipping (unscaled, sync micro-batches
        only), then the prepared optimizer's ``step()`` and ``zero_grad()``, which act only at the end
        of an accumulation cycle or of the data. Returns ``output_transform(x, y, y_pred, loss)``.

        Example::

            trainer = Engine(handler.training_step(model, optimizer, torch.nn.functional.mse_loss))
            handler.attach(trainer)
        """
        prepared = self.prepare_optimizer(optimizer)

        def update(engine: Engine, batch: Any) -> Any:
            if self.steps.micro_batch_iteration != engine.state.iteration:
                raise RuntimeError(
                    "the shardplug training step runs on an engine the handler is not attached to: "
                    "call handler.attach(trainer) (or use handler.create_trainer)"
                )
            model.train()
            try:
                x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
                with self.no_sync(model):
                    with self._autocast(autocast, autocast_dtype):
                        y_pred = model_transform(model_fn(model, x))
                        loss = loss_fn(y_pred, y)
                    self.run.backward(loss)
                if clip_grad_norm is not None:
                    self.run.clip_grad_norm_(model.parameters(), clip_grad_norm)
                prepared.step()
                prepared.zero_grad()
            except BaseException:
                self.run.abandon_step()  # the next step starts from fresh gradients and a clean scaler
                raise
            return output_transform(x, y, y_pred, loss)

        return update

    def create_trainer(
        self, model: torch.nn.Module, optimizer: Optimizer, loss_fn: Callable[..., torch.Tensor], **kwargs: Any
    ) -> Engine:
        """``Engine(self.training_step(...))`` with this handler attached: the counterpart of
        ``create_supervised_trainer``. ``kwargs`` go to :meth:`training_step`."""
        engine = Engine(self.training_step(model, optimizer, loss_fn, **kwargs))
        self.attach(engine)
        return engine

    def evaluation_step(
        self,
        model: torch.nn.Module,
        *,
        autocast: bool | None = None,
        autocast_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> Callable[[Engine, Any], Any]:
        """The process function of an evaluator over a prepared evaluation loader:
        :func:`~shardplug_ignite.evaluation.evaluation_step` (``device``, ``non_blocking``,
        ``prepare_batch``, ``model_transform``, ``output_transform``, ``model_fn``) with the forward
        pass under the handler's autocast (as the training step: on with an enabled scaler, or
        ``autocast=True``)."""
        return evaluation_step(model, autocast=lambda: self._autocast(autocast, autocast_dtype), **kwargs)

    def create_evaluator(
        self, model: torch.nn.Module, metrics: Mapping[str, Metric] | None = None, **kwargs: Any
    ) -> Engine:
        """``Engine(self.evaluation_step(...))`` with ``metrics`` attached over real samples only: the
        counterpart of ``create_supervised_evaluator``. Run it on :meth:`prepare_eval_loader` output."""
        engine = Engine(self.evaluation_step(model, **kwargs))
        for name, metric in (metrics or {}).items():
            metric.attach(engine, name, usage=RealSamplesOnly())
        return engine

    # -- Serializable ------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, Any]:
        """Rank-independent resume state (plain values and tensors; loads with ``weights_only=True``):
        the pieces' states together (the loader's full position, the gradient state, the step
        counters, the attached schedulers)."""
        state: OrderedDict[str, Any] = OrderedDict()
        for piece in self._pieces:
            state.update(piece.state_dict())
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`: each piece gets its keys; applied when the trainer's next ``run`` starts."""
        if "batches_yielded" in state_dict and "loader" not in state_dict:
            raise ValueError(
                "this ShardplugHandler state was written by an older shardplug-ignite (seeds/epoch/batches_yielded "
                "only): it cannot resume exactly. Resume from a checkpoint written by this version, or from one "
                "saved at an epoch end without the handler in to_save"
            )
        super().load_state_dict(state_dict)  # every piece's keys are there
        for piece in self._pieces:
            piece.load_state_dict({key: state_dict[key] for key in required_state_keys(piece)})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r}, num_processes={self.run.num_processes})"
