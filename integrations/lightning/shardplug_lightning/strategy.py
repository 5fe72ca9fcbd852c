"""``ShardplugDDPStrategy``: Lightning's ``DDPStrategy`` with shardplug's data loading and stepping.

The strategy overrides only the hooks that decide what each process reads and when schedulers
step; everything else (process launch, DDP wrapping, ``no_sync`` during accumulation, precision,
checkpointing) is Lightning's ``DDPStrategy``.

The private Lightning attributes it relies on (the ``DistributedSampler`` switch, the predict
loop's index wrapper, late loader states, a resumed epoch's length and batch progress) are reached
only through :mod:`shardplug_lightning.compat`, which lists them, checks each at run time (a
missing one raises a ``RuntimeError`` naming it) and is guarded by ``tests/test_lightning_compat.py``.
Public equivalents are used everywhere else (``lightning_module.trainer``,
``trainer.train_dataloader``).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from shardplug import prepare_data_loader
from shardplug.core.config import ShardplugConfig
from shardplug.core.evaluation import prepare_eval_loader
from shardplug.core.graphs.prepared_graphs import MixtureLoaderShard
from shardplug.core.graphs.reading import is_graph
from shardplug.core.loader.prepared import PreparedDataLoader
from shardplug.core.resume.stateful import POSITION_KEY
from shardplug.core.stepping import amp
from shardplug.core.stepping.scheduler import PreparedScheduler

from . import compat
from ._options import ShardplugOptions, has_distributed_sampler, refuse_prepared

__all__ = [
    "UnshardedLoaderWarning",
    "ShardplugDDPStrategy",
    "ShardplugFSDPStrategy",
    "ShardplugModelParallelStrategy",
    "ShardplugStrategyMixin",
]

logger = logging.getLogger(__name__)

_AS_THEY_ARE = (
    "rank %d: Trainer(use_distributed_sampler=False): shardplug does not shard the loaders, they are used as they "
    "are (each must shard itself); padding marks and shardplug's resume positions do not apply to them, except to "
    "a loader with a DistributedSampler, which is adopted (native DDP's batches, with shardplug's resume)"
)

_STAGE_HOOKS = {
    "train": "train_dataloader()",
    "sanity_check": "val_dataloader()",
    "validate": "val_dataloader()",
    "test": "test_dataloader()",
    "predict": "predict_dataloader()",
}


class UnshardedLoaderWarning(UserWarning):
    """The strategy received a loader it cannot shard (neither a ``DataLoader`` nor a ``torchdata.nodes`` graph):
    every process reads it as it is. Silence it with ``iterables_read_own_part=True`` where each such loader
    already reads only its process's part."""


class ShardplugStrategyMixin(ShardplugOptions):
    """The shardplug behaviour, mixed into a strategy of one Lightning namespace (``DDPStrategy``,
    ``FSDPStrategy``, ``ModelParallelStrategy``): ``class S(ShardplugStrategyMixin, DDPStrategy)``.

    Keyword-only arguments: ``config`` and every ``ShardplugConfig`` field (``None``: the config's
    value; the ``prepare_data_loader`` options of the training loaders, and the stepping options),
    and ``eval_even_batches``. Every other keyword goes to the strategy class it is mixed into (all
    of ``DDPStrategy``'s: ``accelerator``, ``process_group_backend``, ``timeout``, ``start_method``,
    DDP's ``find_unused_parameters``, ...).

    Args:
        config: a ``shardplug.core.config.ShardplugConfig``; the keywords override its fields, and
            the strategy holds the merged value (``strategy.shardplug_config``).
        even_batches: pad the end of an epoch so that every rank gets the same number of batches;
            ``False`` is refused for training: Lightning cannot join ranks that run out of batches
            at different steps.
        eval_even_batches: what validation / test batches hold. Every rank always runs the same
            number of evaluation steps (the core's rule, ``shardplug.core.evaluation``: an
            evaluation set smaller than one global batch, or more ranks than batches, leaves no rank
            out, so ``self.log(..., sync_dist=True)`` and other collectives never hang). Default
            ``False``: the padding that evens out the last step is cut off before ``validation_step``
            / ``test_step``, so every sample counts exactly once (a rank whose last step holds no
            real sample gets a batch of 0 rows). ``True``: batches keep their padding rows,
            marked in the loader's ``batch_real_count`` (``shardplug.drop_padding`` /
            ``gather_for_metrics`` drop them). Predict loaders are never padded.
        iterables_read_own_part: the loaders that are neither a ``DataLoader`` nor a ``torchdata.nodes`` graph
            (which shardplug cannot shard) already read only this process's part: no
            :class:`UnshardedLoaderWarning` for them. Default ``False``: one warning per such loader, naming it.
        step_scheduler_with_optimizer: ``interval="step"`` schedulers step only after a real
            optimizer update (not after one ``GradScaler`` skipped). ``False``: Lightning's behaviour.
        scale_scheduler_by_num_processes: step ``interval="step"`` schedulers ``world_size`` times
            per optimizer step when batches are not split. ``None`` (default, here or in the config):
            off, Lightning's convention (``ShardplugConfig.scales_scheduler("lightning")``): users
            size schedules with ``trainer.estimated_stepping_batches``, which already counts the
            per-process steps; scaling would run such a schedule ``world_size`` times too fast.
        gradient_accumulation_steps: must be 1 or equal to ``Trainer(accumulate_grad_batches=...)``
            (Lightning owns accumulation; its cycle ends on every k-th batch and on the epoch's last
            batch, exactly the engine's sync micro-batches).
    """

    #: ``lightning.pytorch`` or ``pytorch_lightning``: the namespace this class belongs to.
    _pl_namespace: str = "lightning.pytorch"

    if TYPE_CHECKING:  # given by the DDPStrategy this class is mixed into

        @property
        def global_rank(self) -> int: ...

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
        eval_even_batches: bool = False,
        iterables_read_own_part: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(eval_even_batches, bool):
            raise TypeError(f"eval_even_batches={eval_even_batches!r} is invalid: it must be True or False")
        if not isinstance(iterables_read_own_part, bool):
            raise TypeError(f"iterables_read_own_part={iterables_read_own_part!r} is invalid: it must be True or False")
        self._take_options(config, locals())  # every ShardplugConfig field is a parameter above
        self.eval_even_batches = eval_even_batches
        self.iterables_read_own_part = iterables_read_own_part
        self._last_step: amp.StepAttempt | None = None
        super().__init__(**kwargs)  # the Lightning strategy's keywords

    @override
    def _check_shardplug_config(self, config: ShardplugConfig) -> None:
        if not config.even_batches:
            raise ValueError(
                "even_batches=False is not supported for training with Lightning: ranks would run out of batches "
                "at different steps, and Lightning has no way to join uneven ranks (the DDP gradient all-reduce of "
                "the longer ranks would hang). Keep even_batches=True (the default; the last batches are padded "
                "with samples from the start of the epoch), or use drop_last=True in the DataLoader. Evaluation "
                "loaders follow their own rule (the same number of steps on every rank, padding dropped)."
            )

    # -- helpers ------------------------------------------------------------------------
    def _get_trainer(self) -> Any:
        module = getattr(self, "lightning_module", None)
        try:
            return module.trainer  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            raise RuntimeError("the shardplug strategy needs a LightningModule attached to a Trainer") from None

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step made no update (``GradScaler`` found inf/NaN gradients)."""
        return self._last_step is not None and self._last_step.skipped

    def _stage_name(self, trainer: Any) -> str:
        stage = trainer.state.stage
        if stage is None:
            fn = trainer.state.fn
            return "train" if fn is not None and fn.value == "fit" else "validate"
        return str(stage.value)

    # -- data ---------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Turn Lightning's ``DistributedSampler`` injection off: shardplug shards every loader (unless
        ``Trainer(use_distributed_sampler=False)``: the loaders are then used as they are)."""
        shards = compat.turn_off_distributed_sampler(self._get_trainer())
        super().setup_environment()  # type: ignore[misc]
        if not shards:
            logger.info(_AS_THEY_ARE, self.global_rank)

    def _data_topology(self) -> tuple[int, int]:
        """(processes sharing the data, this one's index): the strategy's own data-parallel view
        (``distributed_sampler_kwargs``: the ``data_parallel`` dimension of a model-parallel device
        mesh; ranks that differ only in tensor parallelism get identical data), else every rank."""
        kwargs = super().distributed_sampler_kwargs  # type: ignore[misc]
        if isinstance(kwargs, dict) and "num_replicas" in kwargs and "rank" in kwargs:
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        return self.world_size, self.global_rank  # type: ignore[attr-defined]

    def _data_arguments(self, **changes: Any) -> dict[str, Any]:
        """``prepare_data_loader`` arguments for a loader of this rank (``changes``: data options)."""
        return self._loader_arguments(*self._data_topology(), **changes)

    def process_dataloader(self, dataloader: object) -> object:
        """Shard ``dataloader`` for this process with ``prepare_data_loader``.

        Training loaders use the strategy's options; validation / test loaders use
        the core's evaluation rule (the same number of steps on every rank; padding dropped from the
        batches unless ``eval_even_batches=True``: each sample exactly once); predict loaders are
        sharded inside Lightning's index-recording batch sampler so ``batch_indices`` are right.
        With ``Trainer(use_distributed_sampler=False)`` every loader is used as it is, as Lightning
        does (it shards itself), except one with a ``DistributedSampler`` (code written for DDP): that one is
        adopted as under the default, with the batches native DDP gives and shardplug's resume.
        """
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self._get_trainer()
        if not compat.user_distributed_sampler(trainer):  # used as they are: code written for DDP is adopted
            if not (isinstance(dataloader, DataLoader) and has_distributed_sampler(dataloader)):
                return dataloader
        stage = self._stage_name(trainer)
        hook = _STAGE_HOOKS.get(stage, "the *_dataloader() hook")
        if not isinstance(dataloader, DataLoader):
            return self._process_other(dataloader, stage, hook)
        refuse_prepared(dataloader, hook)  # a DistributedSampler of the job's is adopted (prepare_data_loader)
        if stage == "predict":
            return self._prepare_predict(dataloader)
        if stage == "train":
            prepared = prepare_data_loader(dataloader, **self._data_arguments())
        else:  # the core's evaluation rule: equal steps on every rank, padding marked (and dropped)
            prepared = prepare_eval_loader(
                dataloader, drop_padding=not self.eval_even_batches, **self._data_arguments()
            )
        prepared.epochs_set_by_framework = True  # Lightning's loops set its samplers' epoch before every pass
        logger.debug("rank %d: %s loader prepared (%s)", self.global_rank, stage, type(prepared.plan).__name__)
        return prepared

    def _process_other(self, loader: object, stage: str, hook: str) -> object:
        """A loader that is not a ``DataLoader``: a ``torchdata.nodes`` graph is sharded (training: the strategy's
        options; evaluation: equal steps, padding dropped unless ``eval_even_batches``; predict: no padding);
        anything else is read whole by every process, with one :class:`UnshardedLoaderWarning`."""
        if isinstance(loader, (MixtureLoaderShard, type(None))):  # prepared already (Fabric, or by hand)
            return loader
        world = int(self.world_size)  # type: ignore[attr-defined]
        if not is_graph(loader):
            if not self.iterables_read_own_part and world > 1:
                warnings.warn(
                    f"{hook} returned a {type(loader).__module__}.{type(loader).__qualname__}, which shardplug cannot "
                    f"shard (it shards DataLoaders and torchdata.nodes graphs): every one of the {world} processes "
                    "reads all of it. Return a DataLoader or a torchdata.nodes graph, or, where it already reads only "
                    "its process's part, pass ShardplugDDPStrategy(iterables_read_own_part=True)",
                    UnshardedLoaderWarning,
                    stacklevel=2,
                )
            return loader
        changes: dict[str, Any] = {}
        if self.shardplug_config.dispatch_batches:  # a graph is read by every process, never dispatched
            changes.update(dispatch_batches=False, slice_fn_for_dispatch=None)
        if stage == "train":
            prepared = prepare_data_loader(loader, **self._data_arguments(**changes))
        elif stage == "predict":
            prepared = prepare_data_loader(loader, **self._data_arguments(even_batches=False, **changes))
        else:
            prepared = prepare_data_loader(loader, **self._data_arguments(even_batches=True, **changes))
            if isinstance(prepared, PreparedDataLoader):  # a mixture marks no padding
                if self.eval_even_batches or not getattr(prepared, "hands_out_batches", True):
                    prepared.track_padding()
                else:
                    prepared.drop_padding_rows()
        logger.debug("rank %d: %s graph prepared (%s)", self.global_rank, stage, type(prepared).__name__)
        return prepared

    def _prepare_predict(self, dataloader: DataLoader[Any]) -> DataLoader[Any]:
        changes: dict[str, Any] = {"even_batches": False}  # predict loaders are never padded, never dispatch
        if self.shardplug_config.dispatch_batches:
            changes.update(dispatch_batches=False, slice_fn_for_dispatch=None)
        wrapper_cls = compat.index_batch_sampler_wrapper(self._pl_namespace)
        wrapper = dataloader.batch_sampler
        if not isinstance(wrapper, wrapper_cls):
            return prepare_data_loader(dataloader, **self._data_arguments(**changes))
        inner = compat.wrapped_batch_sampler(wrapper)
        plain = _with_batch_sampler(dataloader, inner)
        prepared = prepare_data_loader(plain, **self._data_arguments(**changes))
        shard = prepared.batch_sampler
        compat.set_wrapped_batch_sampler(wrapper, shard)
        object.__setattr__(prepared, "batch_sampler", wrapper)  # DataLoader forbids it after __init__
        return prepared

    # -- stepping -----------------------------------------------------------------------
    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's optimizers and schedulers; ``interval="step"`` schedulers follow real steps."""
        super().setup_optimizers(trainer)  # type: ignore[misc]
        config = self.shardplug_config
        wanted = config.gradient_accumulation_steps
        if wanted != 1 and wanted != trainer.accumulate_grad_batches:
            raise ValueError(
                f"gradient_accumulation_steps={wanted} in the shardplug options, but "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}); Lightning owns accumulation: "
                f"use Trainer(accumulate_grad_batches={wanted}) and leave gradient_accumulation_steps=1"
            )
        if not config.step_scheduler_with_optimizer:
            return
        for scheduler_config in self.lr_scheduler_configs:  # type: ignore[attr-defined]
            scheduler = scheduler_config.scheduler
            if scheduler_config.interval != "step" or scheduler_config.reduce_on_plateau:
                continue  # epoch schedules and ReduceLROnPlateau are Lightning's
            if isinstance(scheduler, PreparedScheduler) or not isinstance(
                getattr(scheduler, "optimizer", None), Optimizer
            ):
                continue
            scheduler_config.scheduler = PreparedScheduler.from_config(
                scheduler,
                None,
                config,
                front_end="lightning",
                num_processes=self.world_size,  # type: ignore[attr-defined]
            )

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step, counted by shardplug's real-step counter.

        ``GradScaler`` skips an update when the gradients hold inf/NaN (fused optimizers inside
        their kernel); :attr:`step_was_skipped` tells, and prepared schedulers do not advance. If
        the step raises, the scaler's record of it is closed (no stale unscale survives).
        """
        scaler = getattr(self.precision_plugin, "scaler", None)  # type: ignore[attr-defined]
        with amp.StepAttempt(optimizer, scaler) as attempt:
            self._last_step = attempt
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    # -- resume -------------------------------------------------------------------------
    def on_train_start(self) -> None:
        """After the restore, before the epoch loop starts: make a resumed epoch continue exactly.

        ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` sets the training data up
        before the checkpoint is restored, and Lightning then never applies the saved loader state
        (Lightning issue #20550): it is applied here. Then Lightning's epoch length and batch
        progress are set to the loader's view (:meth:`_align_batch_progress`).
        """
        super().on_train_start()  # type: ignore[misc]
        fit_loop = self._get_trainer().fit_loop
        applied = compat.apply_late_loader_states(fit_loop)
        if applied:
            logger.debug("rank %d: applied %d training loader state(s) after restore", self.global_rank, applied)
        self._align_batch_progress(fit_loop)
        trainer = self._get_trainer()
        if not any(isinstance(callback, _EpochLength) for callback in trainer.callbacks):
            trainer.callbacks.append(_epoch_length_callback(self._pl_namespace))
        if compat.open_the_next_epoch(fit_loop):
            logger.debug(
                "rank %d: resumed after an epoch's last batch: the next epoch opens as in a run", self.global_rank
            )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, with the epoch progress an older shardplug left after two resumes in a row repaired
        (:func:`~shardplug_lightning.compat.repair_epoch_progress`): it then resumes inside its epoch."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        if compat.repair_epoch_progress(checkpoint, _epoch_inside):
            logger.info("the checkpoint's epoch progress counted its running epoch as not started: repaired")
        return cast("dict[str, Any]", checkpoint)

    def _align_batch_progress(self, fit_loop: Any) -> None:
        """After a resume, count the epoch's batches as the loader does on this layout.

        Lightning takes the epoch's length from the loader after its state was loaded (the resumed
        pass's batches: every later epoch would be cut to it) and the batches done from the
        checkpoint (on the checkpoint's layout: with another number of devices the epoch would end
        too early or too late). The loader knows both on this layout (``epoch_length``,
        ``resume.resumed_batches``): the epoch's length is set back and the progress counters shifted,
        keeping their relations. Only where both describe the same place in Lightning's epoch
        (:func:`_batches_done`): a checkpoint saved after the epoch's last batch (in its validation)
        finds the loader at the next epoch's start, with every batch of Lightning's epoch done.
        """
        trainer = self._get_trainer()
        loaders = [dl for dl in _loaders_in(trainer.train_dataloader) if isinstance(dl, PreparedDataLoader)]
        if len(loaders) != 1 or loaders[0].epoch_length is None:
            return
        loader = loaders[0]
        progress = compat.batch_progress(fit_loop)
        combined = compat.combined_loader(fit_loop)
        limit = min(
            [cast(int, loader.epoch_length)]
            + [int(x) for x in getattr(combined, "limits", None) or [] if x != float("inf")]
        )
        resumed = _batches_done(loader, trainer.current_epoch, limit, progress.current.ready, progress.is_last_batch)
        if resumed is None:
            return  # Lightning starts its epoch from the beginning: nothing to align
        compat.set_epoch_length(trainer, fit_loop, limit)
        delta = resumed - progress.current.ready
        for tracker in (progress.current, progress.total):
            for name in ("ready", "started", "processed", "completed"):
                # the same shift for all: a checkpoint of on_train_batch_end has completed = ready - 1,
                # and Lightning adds the 1 when it restarts (completed may be -1 until then)
                setattr(tracker, name, getattr(tracker, name) + delta)
        if loader.epoch == trainer.current_epoch + 1 and compat.finish_the_epoch(fit_loop):
            logger.info(
                "rank %d: resumed where this layout has no batch left in epoch %d: the next epoch starts",
                self.global_rank,
                loader.epoch - 1,
            )
        if delta:
            logger.info(
                "rank %d: resumed on another layout: %d of %d batches of this epoch done (the checkpoint counted %d)",
                self.global_rank,
                resumed,
                limit,
                resumed - delta,
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        """Keep each training loader's epoch equal to Lightning's (passes cut short by limits/max_steps)."""
        super().on_train_batch_start(batch, batch_idx, *args, **kwargs)  # type: ignore[misc]
        trainer = self._get_trainer()
        epoch = trainer.current_epoch
        for loader in _loaders_in(trainer.train_dataloader):
            if isinstance(loader, PreparedDataLoader) and loader.epoch != epoch and not loader.end_of_dataloader:
                loader.renumber_epoch(epoch)  # the pass goes on in its order: no set_epoch


def _batches_done(loader: PreparedDataLoader, epoch: int, limit: int, counted: int, last_counted: bool) -> int | None:
    """The batches of Lightning's running ``epoch`` done, on the loader's layout, where the loader and
    Lightning (which ``counted`` batches done, the last of its epoch if ``last_counted``) describe the
    same place in it. Three places:

    * the loader resumes inside ``epoch``: its ``resume.resumed_batches``;
    * the loader stands at the next epoch's start while Lightning still counts batches of this one (a
      checkpoint saved after the epoch's last batch, e.g. in its validation): all ``limit`` batches;
    * the loader stands at the start of ``epoch`` while Lightning's counters still hold the previous
      epoch's last batch (a checkpoint of ``on_train_batch_end`` at an epoch's last batch: Lightning has
      moved to the next epoch and resets its counters only when they reach the epoch's length, which it
      compares on this layout): the previous epoch was done whole, ``limit`` batches of it, so that
      Lightning starts ``epoch`` at its first batch also where an epoch is longer per process than in
      the checkpoint's layout.

    ``None``: Lightning starts its epoch from the beginning by itself (its counters, if any, are the
    previous epoch's, which Lightning resets itself).

    Example: 4 batches an epoch, saved while epoch 1 validated, resumed: ``_batches_done(loader, 1, 4, 4, True)``
    is 4 (the loader stands at epoch 2's start); a pass from epoch 1's start with nothing counted gives ``None``.
    """
    if loader.epoch == epoch and loader.resume.resumed_inside_epoch:
        return loader.resume.resumed_batches
    if loader.epoch == epoch + 1 and not loader.resume.resumed_inside_epoch and counted:
        return limit
    if loader.epoch == epoch and not loader.resume.resumed_inside_epoch and counted and last_counted:
        return limit
    return None


def _epoch_inside(state: Any) -> int | None:
    """The epoch inside which a saved loader state (a position, or a StatefulDataLoader's state with one)
    stands; ``None`` at an epoch's start or for another state."""
    if not isinstance(state, dict):
        return None
    position = state.get(POSITION_KEY, state)
    if not isinstance(position, dict) or not position.get("consumed"):
        return None
    epoch = position.get("epoch")
    return epoch if isinstance(epoch, int) else None


class _EpochLength:
    """Makes each new training epoch as long as the loader says (``loader.epoch_length``, within
    ``limit_train_batches``): Lightning takes the length of the first epoch for every epoch, but a loader's epochs
    may differ (a user's batch sampler whose batches are formed from each epoch's order), and Lightning would end
    a longer epoch early: its last micro-batches never read. Called after Lightning set the
    epoch's samplers' epoch, before the epoch's first batch (a ``Callback`` of the trainer's package:
    :func:`_epoch_length_callback`). As each epoch ends, it ends the loader's pass whose last batch was handed out
    (Lightning stops at the epoch's length and never asks for more, and sets the next epoch on the samplers only):
    ``len(trainer.train_dataloader)`` in the next epoch's ``on_train_epoch_start`` is then that epoch's, not the
    rest of a resumed one."""

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        for loader in _loaders_in(trainer.train_dataloader):
            if isinstance(loader, PreparedDataLoader):
                loader.end_finished_pass()  # the core decides: only a pass whose last batch was handed out

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        loaders = [dl for dl in _loaders_in(trainer.train_dataloader) if isinstance(dl, PreparedDataLoader)]
        if len(loaders) != 1 or loaders[0].epoch_length is None:
            return
        length, limit = loaders[0].epoch_length, trainer.limit_train_batches
        batches = min(length, limit) if isinstance(limit, int) else int(length * limit)
        fit_loop = trainer.fit_loop
        if fit_loop.max_batches == batches:
            return
        logger.info("epoch %d: %d batches, the loader's (was %s)", trainer.current_epoch, batches, fit_loop.max_batches)
        compat.combined_loader(fit_loop).limits = [batches]
        compat.set_epoch_length(trainer, fit_loop, batches)


def _epoch_length_callback(namespace: str) -> _EpochLength:
    """An :class:`_EpochLength` that is a ``Callback`` of ``namespace`` (``lightning.pytorch`` or
    ``pytorch_lightning``: their classes differ)."""
    base = importlib.import_module(f"{namespace}.callbacks").Callback
    return cast(_EpochLength, type("EpochLength", (_EpochLength, base), {})())


def _loaders_in(iterables: Any) -> list[Any]:
    """The loaders in ``trainer.train_dataloader`` (one loader, or a list / tuple / dict of them)."""
    if iterables is None:
        return []
    if isinstance(iterables, dict):
        return [loader for value in iterables.values() for loader in _loaders_in(value)]
    if isinstance(iterables, (list, tuple)):
        return [loader for value in iterables for loader in _loaders_in(value)]
    return [iterables]


def _with_batch_sampler(dataloader: DataLoader[Any], batch_sampler: Any) -> DataLoader[Any]:
    """A shallow copy of ``dataloader`` reading ``batch_sampler`` (only used as input of ``prepare_data_loader``)."""
    clone = object.__new__(type(dataloader))
    clone.__dict__.update(vars(dataloader))
    object.__setattr__(clone, "batch_sampler", batch_sampler)
    compat.forget_iterator(clone)
    return clone


class ShardplugDDPStrategy(ShardplugStrategyMixin, DDPStrategy):
    """Lightning's ``DDPStrategy`` with shardplug's data loading and stepping (``strategy="shardplug_ddp"``).

    Its keywords: :class:`ShardplugStrategyMixin`'s (``config``, every ``ShardplugConfig`` field,
    ``eval_even_batches``) and ``DDPStrategy``'s.

    Example::

        trainer = Trainer(strategy=ShardplugDDPStrategy(split_batches=True, process_group_backend="gloo"), ...)
        # LightningCLI:
        #   --trainer.strategy shardplug_lightning.ShardplugDDPStrategy --trainer.strategy.split_batches true
    """


class ShardplugFSDPStrategy(ShardplugStrategyMixin, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` with shardplug's data loading and stepping (``strategy="shardplug_fsdp"``;
    Lightning runs FSDP on GPUs only). Its keywords: :class:`ShardplugStrategyMixin`'s and ``FSDPStrategy``'s."""


class ShardplugModelParallelStrategy(ShardplugStrategyMixin, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` with shardplug (``strategy="shardplug_model_parallel"``): the data
    is sharded over the mesh's ``data_parallel`` dimension only. Its keywords: :class:`ShardplugStrategyMixin`'s
    and ``ModelParallelStrategy``'s (``data_parallel_size``, ``tensor_parallel_size``, ...)."""
