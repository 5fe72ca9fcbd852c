"""``ShardplugHandler``: shardplug's loaders and stepping for a PyTorch-Ignite ``Engine``.

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
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import ignite.distributed as idist
import torch
from ignite.base.mixins import Serializable
from ignite.engine import DeterministicEngine, Engine, EventEnum, Events
from ignite.engine import _prepare_batch as ignite_prepare_batch
from ignite.metrics import Metric
from ignite.metrics.metric import MetricUsage
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from shardplug.core.config import ShardplugConfig, renamed_option
from shardplug.core.loaders import PreparedDataLoader
from shardplug.core.optimizer import PreparedOptimizer
from shardplug.core.scheduler import PreparedScheduler
from shardplug.core.training import TrainingRun

__all__ = ["ShardplugEvents", "ShardplugHandler", "RealSamplesOnly", "real_samples", "trim_padding"]

logger = logging.getLogger(__name__)


class ShardplugEvents(EventEnum):
    """Events fired by :class:`ShardplugHandler` on the engine it is attached to.

    * ``OPTIMIZER_STEP_COMPLETED``: after an iteration in which the prepared optimizer(s) really
      updated the parameters; counted in ``engine.state.optimizer_step`` (so ``every=``/``once=``
      filters count real steps).
    * ``OPTIMIZER_STEP_SKIPPED``: after an iteration whose optimizer step the ``GradScaler``
      skipped (inf/NaN gradients); counted in ``engine.state.optimizer_step_skipped``.

    Example::

        trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED(every=100), checkpoint)
    """

    OPTIMIZER_STEP_COMPLETED = "optimizer_step_completed"
    OPTIMIZER_STEP_SKIPPED = "optimizer_step_skipped"


_EVENT_TO_ATTR = {
    ShardplugEvents.OPTIMIZER_STEP_COMPLETED: "optimizer_step",
    ShardplugEvents.OPTIMIZER_STEP_SKIPPED: "optimizer_step_skipped",
}


def _identity(value: Any) -> Any:
    return value


def _call_model(model: torch.nn.Module, x: Any) -> Any:
    return model(x)


def _loss_item(x: Any, y: Any, y_pred: Any, loss: torch.Tensor) -> float:
    return loss.item()


def _prediction_and_target(x: Any, y: Any, y_pred: Any) -> tuple[Any, Any]:
    return y_pred, y


# -- evaluation: telling padded samples from real ones -----------------------------------------
def real_samples(loader: Any) -> Optional[int]:
    """How many leading rows of the batch ``loader`` handed out last are real samples.

    ``None`` means "unknown: all of them" (a loader that does not track padding: an iterable or
    a training loader). The evaluation loaders of :meth:`ShardplugHandler.prepare_eval_loader`
    track it (``loader.track_padding()``); the padding rows come last in every batch, so trimming
    to the returned count keeps each sample exactly once across processes.

    Example::

        rows = real_samples(engine.state.dataloader)   # inside an evaluation step
        y_pred, y = y_pred[:rows], y[:rows]
    """
    return getattr(loader, "batch_real_count", None)


def trim_padding(loader: Any, data: Any) -> Any:
    """``data`` (tensors, or lists/tuples/dicts of them) cut to the real rows of the latest batch.

    Example::

        y_pred, y = trim_padding(engine.state.dataloader, (y_pred, y))
    """
    rows = real_samples(loader)
    if rows is None:
        return data
    return _slice_rows(data, rows)


def _slice_rows(data: Any, rows: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[:rows] if data.dim() > 0 else data
    if isinstance(data, Mapping):
        return type(data)({k: _slice_rows(v, rows) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_slice_rows(v, rows) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_slice_rows(v, rows) for v in data)
    return data


def _first_tensor(data: Any) -> Optional[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return data
    values: Iterable[Any] = data.values() if isinstance(data, Mapping) else data if isinstance(data, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def _output_has_samples(engine: Engine, _event_count: int) -> bool:
    tensor = _first_tensor(engine.state.output)
    return tensor is None or tensor.dim() == 0 or tensor.shape[0] > 0


class RealSamplesOnly(MetricUsage):
    """Epoch-wise metric usage that skips iterations whose (trimmed) output holds no sample.

    A process whose last evaluation batch is pure padding gets an empty output from the
    handler's evaluation step; metrics attached with this usage do not see it (``Loss`` would
    turn an empty batch into NaN).

    Example::

        Accuracy().attach(evaluator, "accuracy", usage=RealSamplesOnly())
    """

    usage_name: str = "real_samples_only"

    def __init__(self) -> None:
        super().__init__(
            started=Events.EPOCH_STARTED,
            completed=Events.EPOCH_COMPLETED,
            iteration_completed=Events.ITERATION_COMPLETED(event_filter=_output_has_samples),
        )


# -- the handler ------------------------------------------------------------------------------
class ShardplugHandler(Serializable):
    """Makes an Ignite ``Engine`` train with shardplug's exact data sharding and stepping.

    Args:
        config: the shared options (:class:`~shardplug.core.config.ShardplugConfig`):
            ``split_batches``, ``even_batches``, ``gradient_accumulation_steps``,
            ``use_seedable_sampler``/``data_seed``, ...; ``None`` = defaults.
        scaler: a ``torch.amp.GradScaler``: prepared optimizers step through it, the training
            step scales the loss and runs the forward pass under ``torch.autocast``.
        device: the process's device (``None``: the local CUDA device, else CPU).
        num_processes, process_index: ``None`` = from the running job (``idist``'s process group).

    :meth:`attach` registers, on the trainer:

    ========================== ==================================================================
    ``STARTED``                the data is a prepared loader; every rank has the same epoch length
                               (else ``RuntimeError`` on every rank instead of a hang); counters
    ``EPOCH_STARTED``          ``loader.set_epoch(epoch - 1)``; first epoch of a resumed run:
                               continue after the checkpoint's batches (no replay)
    ``DATALOADER_STOP_ITERATION`` ``set_epoch(epoch - 1)`` again (the previous pass ended late)
    ``TERMINATE_SINGLE_EPOCH`` ``set_epoch(epoch)`` before Ignite opens the next pass
    ``ITERATION_STARTED``      decide ``sync_gradients`` for this micro-batch
    ``ITERATION_COMPLETED``    fire ``OPTIMIZER_STEP_COMPLETED`` / ``OPTIMIZER_STEP_SKIPPED``
    ========================== ==================================================================

    The handler is ``Serializable``: put it in a ``Checkpoint``'s ``to_save`` (its state is the same
    on every rank and loads with ``weights_only=True``) to resume mid-epoch exactly.

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

    _state_dict_all_req_keys = (
        "seeds",
        "epoch",
        "batches_yielded",
        "optimizer_step",
        "optimizer_step_skipped",
        "accumulation_step",
    )

    def __init__(
        self,
        config: Optional[ShardplugConfig] = None,
        *,
        scaler: Optional[Any] = None,
        device: Union[str, torch.device, None] = None,
        num_processes: Optional[int] = None,
        process_index: Optional[int] = None,
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
        self.optimizer_step = 0
        self.optimizer_step_skipped = 0
        self._engine: Optional[Engine] = None
        self._loader: Optional[PreparedDataLoader] = None
        self._pending: Optional[dict[str, Any]] = None
        self._first_epoch_of_run = False
        self._micro_batch_iteration = -1
        self._step_records: list[bool] = []

    # -- properties --------------------------------------------------------------------------
    @property
    def gradient_state(self) -> Any:
        """The run's :class:`~shardplug.core.accumulation.GradientState`."""
        return self.run.gradient_state

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch synchronises gradients and steps the optimizers."""
        return self.run.gradient_state.sync_gradients

    @property
    def scaler(self) -> Optional[Any]:
        return self.run.scaler

    @property
    def device(self) -> torch.device:
        return self.run.device

    @property
    def optimizers(self) -> list[PreparedOptimizer]:
        """The optimizers prepared by this handler."""
        return self.run.optimizers

    # -- preparing ---------------------------------------------------------------------------
    def prepare_data_loader(self, dataloader: DataLoader, **overrides: Any) -> PreparedDataLoader:
        """This process's training loader for ``dataloader`` (``overrides`` beat the config).

        Unlike ``idist.auto_dataloader`` it shards any batch sampler, keeps the batch size per
        process (``split_batches=False``) or cuts it exactly (``split_batches=True``), and shuffles
        with a seed agreed across ranks. Pass the result to ``trainer.run``.
        """
        loader = self.run.prepare_data_loader(dataloader, **overrides)
        self._loader = loader
        return loader

    def prepare_eval_loader(self, dataloader: DataLoader, **overrides: Any) -> PreparedDataLoader:
        """This process's evaluation loader: sharded like a training loader, but not tied to the
        gradient-accumulation state. Use it with :meth:`create_evaluator` / :meth:`evaluation_step`,
        which drop the padding of the last step so every sample counts once."""
        loader = self.run.prepare_data_loader(dataloader, **overrides)
        loader.gradient_state = None
        if not isinstance(loader.dataset, IterableDataset):
            loader.track_padding()  # which rows of each batch are wrap-around padding
        return loader

    def auto_dataloader(self, dataset: Any, train: bool = True, **kwargs: Any) -> PreparedDataLoader:
        """Drop-in for ``idist.auto_dataloader(dataset, **kwargs)``: ``DataLoader(dataset, **kwargs)``,
        prepared. ``batch_size`` is per process unless ``split_batches=True`` (then it is global)."""
        loader = DataLoader(dataset, **kwargs)
        return self.prepare_data_loader(loader) if train else self.prepare_eval_loader(loader)

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool = True) -> PreparedOptimizer:
        """Wrap ``optimizer`` so that it steps once per accumulation cycle, through the scaler; the
        handler watches its steps to fire :class:`ShardplugEvents`."""
        if isinstance(optimizer, PreparedOptimizer):
            if optimizer not in self.run.optimizers:
                raise ValueError("this PreparedOptimizer was prepared elsewhere; pass the plain optimizer")
            return optimizer
        prepared = self.run.prepare_optimizer(optimizer, device_placement=device_placement)
        prepared.register_step_post_hook(self._record_step)
        return prepared

    def _record_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._step_records.append(bool(optimizer.step_was_skipped))

    def attach_scheduler(
        self,
        engine: Engine,
        scheduler: Any,
        optimizers: Union[Optimizer, Sequence[Optimizer], None] = None,
        *,
        scale_scheduler_by_num_processes: Optional[bool] = None,
        scale_by_num_processes: Optional[bool] = None,
    ) -> PreparedScheduler:
        """Step a torch ``LRScheduler`` after every real optimizer step (never while accumulating,
        never after a step the scaler skipped).

        ``scale_scheduler_by_num_processes=True`` steps it ``num_processes`` times per optimizer
        step when batches are not split (a schedule sized on the unsharded loader's length).
        ``None`` takes the config's value; when that is ``None`` too, off: Ignite's convention
        (``ShardplugConfig.scales_scheduler("ignite")``), a schedule is sized in optimizer steps.
        ``scale_by_num_processes=`` is the deprecated old name. ``ReduceLROnPlateau`` needs a
        metric: step it yourself after evaluation.
        """
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "ReduceLROnPlateau needs a metric: call scheduler.step(metric) in an evaluator handler instead"
            )
        scale = renamed_option(
            "attach_scheduler", "scale_by_num_processes", scale_by_num_processes,
            "scale_scheduler_by_num_processes", scale_scheduler_by_num_processes,
        )
        prepared = self.run.prepare_scheduler(scheduler, optimizers, scale_scheduler_by_num_processes=scale)
        self._register_events(engine)
        event = (
            ShardplugEvents.OPTIMIZER_STEP_COMPLETED
            if self.config.step_scheduler_with_optimizer
            else Events.ITERATION_COMPLETED
        )
        engine.add_event_handler(event, _SchedulerStep(prepared))
        return prepared

    # -- attaching ---------------------------------------------------------------------------
    @staticmethod
    def _register_events(engine: Engine) -> None:
        if not engine.has_registered_events(ShardplugEvents.OPTIMIZER_STEP_COMPLETED):
            engine.register_events(*ShardplugEvents, event_to_attr=_EVENT_TO_ATTR)
        for attr in _EVENT_TO_ATTR.values():
            if not hasattr(engine.state, attr):
                setattr(engine.state, attr, 0)

    def attach(self, engine: Engine) -> None:
        """Register the handler's events and handlers on the trainer ``engine`` (see the class doc)."""
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
        self._register_events(engine)
        engine.add_event_handler(Events.STARTED, self._on_started)
        engine.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        engine.add_event_handler(Events.DATALOADER_STOP_ITERATION, self._on_stop_iteration)
        engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH, self._on_terminate_single_epoch)
        engine.add_event_handler(Events.ITERATION_STARTED, self._on_iteration_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration_completed)

    def _current_loader(self, engine: Engine) -> PreparedDataLoader:
        loader = engine.state.dataloader
        if not isinstance(loader, PreparedDataLoader):
            raise TypeError(
                f"the trainer runs on a {type(loader).__name__}, not a prepared loader: pass "
                "handler.prepare_data_loader(DataLoader(...)) (or handler.auto_dataloader(...)) to trainer.run"
            )
        return loader

    def _on_started(self, engine: Engine) -> None:
        loader = self._current_loader(engine)
        self._loader = loader
        state = self.run.gradient_state
        if loader.gradient_state is not state:
            loader.gradient_state = state
        state.reset()
        self._check_epoch_length(engine, loader)
        pending = self._pending
        if pending is not None:
            self.optimizer_step = int(pending["optimizer_step"])
            self.optimizer_step_skipped = int(pending["optimizer_step_skipped"])
            # keep the uninterrupted run's step boundaries (GradientState warns inside a cycle)
            step = int(pending["accumulation_step"]) % state.num_steps
            state.load_state_dict({"num_steps": state.num_steps, "step": step})
        elif engine.state.iteration == 0:
            self.optimizer_step = self.optimizer_step_skipped = 0
        engine.state.optimizer_step = self.optimizer_step
        engine.state.optimizer_step_skipped = self.optimizer_step_skipped
        self._first_epoch_of_run = True

    def _check_epoch_length(self, engine: Engine, loader: PreparedDataLoader) -> None:
        try:
            length = len(loader)
        except TypeError:
            length = -1
        epoch_length = engine.state.epoch_length if engine.state.epoch_length is not None else -1
        mine = torch.tensor([length, epoch_length], dtype=torch.int64, device=idist.device())
        gathered = idist.all_gather(mine) if idist.get_world_size() > 1 else mine
        per_rank = gathered.view(-1, 2).tolist()
        lengths = [row[0] for row in per_rank]
        epoch_lengths = [row[1] for row in per_rank]
        if len(set(lengths)) > 1 or len(set(epoch_lengths)) > 1:
            raise RuntimeError(
                f"ranks disagree on the epoch length: batches per rank {lengths}, engine epoch_length per rank "
                f"{epoch_lengths}. Every rank must run the same number of iterations, or collectives hang. "
                "Use even_batches=True (the default) or drop_last=True for training loaders, and the same "
                "epoch_length on every rank."
            )
        if length >= 0 and epoch_length >= 0 and length != epoch_length:
            logger.warning(
                "engine epoch_length=%d differs from the loader's %d batches per epoch: epochs then do not "
                "match passes over the data and set_epoch follows the engine's epochs",
                epoch_length,
                length,
            )

    def _on_epoch_started(self, engine: Engine) -> None:
        loader = self._current_loader(engine)
        epoch = engine.state.epoch - 1
        if not self._first_epoch_of_run:
            loader.set_epoch(epoch)
            return
        self._first_epoch_of_run = False
        pending, self._pending = self._pending, None
        epoch_length = engine.state.epoch_length
        done = engine.state.iteration % epoch_length if epoch_length else 0
        if getattr(engine, "_dataloader_iter", None) is not None:
            done = 0  # Ignite continues its open iterator: nothing is replayed
        seeds = list(pending["seeds"]) if pending is not None else loader.position()["seeds"]
        if done or pending is not None:
            loader.resume_at(epoch, done, seeds)
            if done:
                logger.info("resuming epoch %d after %d batches (not replayed)", epoch + 1, done)
        else:
            loader.set_epoch(epoch)

    def _on_stop_iteration(self, engine: Engine) -> None:
        # the previous pass only ended now, inside this epoch: make sure the next pass is this epoch's
        self._current_loader(engine).set_epoch(engine.state.epoch - 1)

    def _on_terminate_single_epoch(self, engine: Engine, iter_counter: int = 0) -> None:
        # Ignite opens the next pass right away, before the next EPOCH_STARTED
        self._current_loader(engine).set_epoch(engine.state.epoch)

    def _on_iteration_started(self, engine: Engine) -> None:
        self._step_records.clear()
        self.run.gradient_state.begin_micro_batch()
        self._micro_batch_iteration = engine.state.iteration

    def _on_iteration_completed(self, engine: Engine) -> None:
        records, self._step_records = self._step_records, []
        if not records:
            return
        if all(records):
            self.optimizer_step_skipped += 1
            engine.state.optimizer_step_skipped = self.optimizer_step_skipped
            engine.fire_event(ShardplugEvents.OPTIMIZER_STEP_SKIPPED)
        else:
            self.optimizer_step += 1
            engine.state.optimizer_step = self.optimizer_step
            engine.fire_event(ShardplugEvents.OPTIMIZER_STEP_COMPLETED)

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

    def _autocast(self, enabled: Optional[bool], dtype: Optional[torch.dtype]) -> Any:
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
        device: Union[str, torch.device, None] = None,
        non_blocking: bool = False,
        prepare_batch: Callable[..., tuple[Any, Any]] = ignite_prepare_batch,
        model_transform: Callable[[Any], Any] = _identity,
        output_transform: Callable[[Any, Any, Any, torch.Tensor], Any] = _loss_item,
        model_fn: Callable[[torch.nn.Module, Any], Any] = _call_model,
        clip_grad_norm: Optional[float] = None,
        autocast: Optional[bool] = None,
        autocast_dtype: Optional[torch.dtype] = None,
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
            if self._micro_batch_iteration != engine.state.iteration:
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

    def create_trainer(self, model: torch.nn.Module, optimizer: Optimizer, loss_fn: Callable[..., torch.Tensor], **kwargs: Any) -> Engine:
        """``Engine(self.training_step(...))`` with this handler attached: the counterpart of
        ``create_supervised_trainer``. ``kwargs`` go to :meth:`training_step`."""
        engine = Engine(self.training_step(model, optimizer, loss_fn, **kwargs))
        self.attach(engine)
        return engine

    def evaluation_step(
        self,
        model: torch.nn.Module,
        *,
        device: Union[str, torch.device, None] = None,
        non_blocking: bool = False,
        prepare_batch: Callable[..., tuple[Any, Any]] = ignite_prepare_batch,
        model_transform: Callable[[Any], Any] = _identity,
        output_transform: Callable[[Any, Any, Any], Any] = _prediction_and_target,
        model_fn: Callable[[torch.nn.Module, Any], Any] = _call_model,
        autocast: Optional[bool] = None,
        autocast_dtype: Optional[torch.dtype] = None,
    ) -> Callable[[Engine, Any], Any]:
        """The process function of an evaluator over a prepared evaluation loader.

        ``x``, ``y`` and ``y_pred`` are trimmed to the real samples (:func:`trim_padding`) before
        ``output_transform(x, y, y_pred)`` (default ``(y_pred, y)``), so metrics count each sample
        once across ranks. A batch of pure padding gives empty tensors: attach metrics with
        :class:`RealSamplesOnly` (as :meth:`create_evaluator` does).
        """

        def evaluate(engine: Engine, batch: Any) -> Any:
            model.eval()
            with torch.no_grad():
                x, y = prepare_batch(batch, device=device, non_blocking=non_blocking)
                with self._autocast(autocast, autocast_dtype):
                    y_pred = model_transform(model_fn(model, x))
                x, y, y_pred = trim_padding(engine.state.dataloader, (x, y, y_pred))
                return output_transform(x, y, y_pred)

        return evaluate

    def create_evaluator(self, model: torch.nn.Module, metrics: Optional[Mapping[str, Metric]] = None, **kwargs: Any) -> Engine:
        """``Engine(self.evaluation_step(...))`` with ``metrics`` attached over real samples only: the
        counterpart of ``create_supervised_evaluator``. Run it on :meth:`prepare_eval_loader` output."""
        engine = Engine(self.evaluation_step(model, **kwargs))
        for name, metric in (metrics or {}).items():
            metric.attach(engine, name, usage=RealSamplesOnly())
        return engine

    # -- Serializable ------------------------------------------------------------------------
    def state_dict(self) -> OrderedDict:
        """Rank-independent resume state: shuffle seeds, data position, step counters (plain values)."""
        loader = self._loader
        if loader is not None:
            position = loader.position()
        else:
            position = {"epoch": 0, "batches_yielded": 0, "seeds": []}
        return OrderedDict(
            seeds=[None if s is None else int(s) for s in position["seeds"]],
            epoch=int(position["epoch"]),
            batches_yielded=int(position["batches_yielded"]),
            optimizer_step=self.optimizer_step,
            optimizer_step_skipped=self.optimizer_step_skipped,
            accumulation_step=int(self.run.gradient_state.step),
        )

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Load a :meth:`state_dict`; applied when the trainer's next ``run`` starts."""
        super().load_state_dict(state_dict)
        self._pending = dict(state_dict)
        self.optimizer_step = int(state_dict["optimizer_step"])
        self.optimizer_step_skipped = int(state_dict["optimizer_step_skipped"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r}, num_processes={self.run.num_processes})"


class _SchedulerStep:
    """Event handler stepping a prepared scheduler (a class, so ``has_event_handler`` sees it)."""

    def __init__(self, scheduler: PreparedScheduler) -> None:
        self.scheduler = scheduler

    def __call__(self, engine: Engine) -> None:
        self.scheduler.step()
