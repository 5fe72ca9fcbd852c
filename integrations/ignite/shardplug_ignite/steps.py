"""Optimizer-step events for an Ignite trainer: which micro-batches sync, which steps were real.

Example::

    steps = StepEvents(run)              # run: the handler's shardplug TrainingRun
    steps.watch(prepared_optimizer)
    steps.attach(trainer)
    trainer.add_event_handler(ShardplugEvents.OPTIMIZER_STEP_COMPLETED(every=100), checkpoint)
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ignite.base.mixins import Serializable
from ignite.engine import Engine, EventEnum, Events

from shardplug.core.front_ends import check_int
from shardplug.core.loader.prepared import PreparedDataLoader
from shardplug.core.stepping.optimizer import PreparedOptimizer
from shardplug.core.stepping.scheduler import PreparedScheduler
from shardplug.core.stepping.training import TrainingRun

from .compat import requires_state_keys

__all__ = ["ShardplugEvents", "StepEvents", "SchedulerSteps"]

logger = logging.getLogger(__name__)


class ShardplugEvents(EventEnum):
    """Events fired on a trainer by :class:`StepEvents` (part of ``ShardplugHandler``).

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


def register_step_events(engine: Engine) -> None:
    """Register :class:`ShardplugEvents` on ``engine`` (once) and their counters on its state."""
    if not engine.has_registered_events(ShardplugEvents.OPTIMIZER_STEP_COMPLETED):
        engine.register_events(*ShardplugEvents, event_to_attr=_EVENT_TO_ATTR)
    for attr in _EVENT_TO_ATTR.values():
        if not hasattr(engine.state, attr):
            setattr(engine.state, attr, 0)


@requires_state_keys("gradient_state", "optimizer_step", "optimizer_step_skipped")
class StepEvents(Serializable):
    """Gradient-accumulation and optimizer-step events of one trainer.

    Args:
        run: the ``TrainingRun`` whose gradient state and optimizers this follows.

    Registers:

    ================== ================================================================
    ``STARTED``        the loader feeds the run's gradient state; a fresh accumulation
                       cycle, or the checkpoint's; the step counters on ``engine.state``
    ``ITERATION_STARTED`` decide ``sync_gradients`` for this micro-batch
    ``ITERATION_COMPLETED`` fire ``OPTIMIZER_STEP_COMPLETED`` / ``OPTIMIZER_STEP_SKIPPED``
                       when a watched optimizer acted
    ================== ================================================================

    Its state (:meth:`state_dict`) is the gradient state and the two counters.
    """

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.optimizer_step = 0
        self.optimizer_step_skipped = 0
        self.micro_batch_iteration = -1  #: the engine iteration whose micro-batch was begun last
        self._records: list[Any] = []  # the optimizers that acted in this iteration (their outcome read at its end)
        self._pending: dict[str, Any] | None = None

    def watch(self, optimizer: PreparedOptimizer) -> None:
        """Count the steps of ``optimizer`` (a post-hook: it runs on the steps that act)."""
        optimizer.register_step_post_hook(self._record)

    def _record(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._records.append(optimizer)  # its skip flag is read at the iteration's end, not in the step

    def attach(self, engine: Engine) -> None:
        register_step_events(engine)
        engine.add_event_handler(Events.STARTED, self._on_started)
        engine.add_event_handler(Events.ITERATION_STARTED, self._on_iteration_started)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._on_iteration_completed)

    def _on_started(self, engine: Engine) -> None:
        state = self.run.gradient_state
        loader = engine.state.dataloader
        if isinstance(loader, PreparedDataLoader) and loader.gradient_state is not state:
            loader.gradient_state = state
        state.reset()
        pending, self._pending = self._pending, None
        if pending is not None:
            state.load_state_dict(pending["gradient_state"])  # warns when resuming inside a cycle
            self.optimizer_step = pending["optimizer_step"]
            self.optimizer_step_skipped = pending["optimizer_step_skipped"]
        elif engine.state.iteration == 0:
            self.optimizer_step = self.optimizer_step_skipped = 0
        engine.state.optimizer_step = self.optimizer_step  # type: ignore[attr-defined]  # ignite's State takes new attributes
        engine.state.optimizer_step_skipped = self.optimizer_step_skipped  # type: ignore[attr-defined]  # ignite's State takes new attributes

    def _on_iteration_started(self, engine: Engine) -> None:
        self._records.clear()
        self.run.gradient_state.begin_micro_batch()
        self.micro_batch_iteration = engine.state.iteration

    def _on_iteration_completed(self, engine: Engine) -> None:
        records, self._records = self._records, []
        if not records:
            return
        if all(optimizer.step_was_skipped for optimizer in records):
            self.optimizer_step_skipped += 1
            engine.state.optimizer_step_skipped = self.optimizer_step_skipped  # type: ignore[attr-defined]  # ignite's State takes new attributes
            engine.fire_event(ShardplugEvents.OPTIMIZER_STEP_SKIPPED)
        else:
            self.optimizer_step += 1
            engine.state.optimizer_step = self.optimizer_step  # type: ignore[attr-defined]  # ignite's State takes new attributes
            engine.fire_event(ShardplugEvents.OPTIMIZER_STEP_COMPLETED)

    def state_dict(self) -> OrderedDict[str, Any]:
        """The gradient state and the step counters (plain values)."""
        return OrderedDict(
            gradient_state=self.run.gradient_state.state_dict(),
            optimizer_step=self.optimizer_step,
            optimizer_step_skipped=self.optimizer_step_skipped,
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Validate a :meth:`state_dict`; it is applied when the trainer's next run starts."""
        super().load_state_dict(state_dict)
        gradient = state_dict["gradient_state"]
        if not isinstance(gradient, Mapping) or set(gradient) != {"num_steps", "step"}:
            raise ValueError(f"gradient_state={gradient!r} is not a GradientState state (GradientState.state_dict())")
        for key in ("optimizer_step", "optimizer_step_skipped"):
            value = state_dict[key]
            check_int(key, value, minimum=0)
        self._pending = {key: state_dict[key] for key in ("gradient_state", "optimizer_step", "optimizer_step_skipped")}
        self.optimizer_step = state_dict["optimizer_step"]
        self.optimizer_step_skipped = state_dict["optimizer_step_skipped"]


@requires_state_keys("schedulers")
class SchedulerSteps(Serializable):
    """The schedulers attached to a trainer (``ShardplugHandler.attach_scheduler``): each steps at
    its event, and their states are saved and loaded together.

    ================== ================================================================
    ``STARTED``        the schedulers load the states of a loaded checkpoint (the same
                       number of schedulers must be attached, else ``ValueError``)
    ================== ================================================================

    Its state (:meth:`state_dict`) is ``{"schedulers": [each scheduler's state_dict()]}``.
    """

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self._pending: list[Any] | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._on_started)

    def step_at(self, engine: Engine, event: Any, scheduler: PreparedScheduler) -> None:
        """Step ``scheduler`` at ``event`` of ``engine``."""
        engine.add_event_handler(event, _SchedulerStep(scheduler))

    def _on_started(self, engine: Engine) -> None:
        states, self._pending = self._pending, None
        if states is None:
            return
        if len(states) != len(self.run.schedulers):
            raise ValueError(
                f"the checkpoint holds {len(states)} scheduler state(s) but {len(self.run.schedulers)} scheduler(s) "
                "are attached: attach the same schedulers (handler.attach_scheduler) before resuming"
            )
        for scheduler, state in zip(self.run.schedulers, states):
            scheduler.load_state_dict(state)

    def state_dict(self) -> OrderedDict[str, Any]:
        """``{"schedulers": [...]}``: the attached schedulers' states, in the order they were attached."""
        return OrderedDict(schedulers=[scheduler.state_dict() for scheduler in self.run.schedulers])

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Validate a :meth:`state_dict`; the schedulers load it when the trainer's next run starts."""
        super().load_state_dict(state_dict)
        schedulers = state_dict["schedulers"]
        if not isinstance(schedulers, (list, tuple)):
            raise ValueError(f"schedulers={schedulers!r} is invalid: a list of scheduler states")
        self._pending = list(schedulers)


class _SchedulerStep:
    """Event handler stepping a prepared scheduler (a class, so ``has_event_handler`` sees it)."""

    def __init__(self, scheduler: PreparedScheduler) -> None:
        self.scheduler = scheduler

    def __call__(self, engine: Engine) -> None:
        self.scheduler.step()
