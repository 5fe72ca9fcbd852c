"""A learning-rate scheduler wrapper that follows the optimizer steps that really happened."""

from __future__ import annotations

import logging
from typing import Any, Callable

from shardplug.core.scheduler import advance_scheduler

__all__ = ["StepGatedScheduler"]

logger = logging.getLogger(__name__)

_OWN = frozenset({"scheduler", "real_steps", "steps_per_optimizer_step", "_seen", "_warned_total_steps"})


class StepGatedScheduler:
    """Wraps an ``interval="step"`` scheduler of a Lightning run.

    :meth:`step` steps the wrapped scheduler only when its optimizer made a real update since the
    last scheduler step (an update that ``GradScaler`` skipped for inf/NaN gradients does not
    count), and then ``steps_per_optimizer_step`` times, never past a ``total_steps``
    (``OneCycleLR``). Everything else (``state_dict``, ``load_state_dict``, ``get_last_lr``,
    ``optimizer``, ``last_epoch``, ...) is the wrapped scheduler's.

    Args:
        scheduler: the scheduler Lightning built from ``configure_optimizers``.
        real_steps: returns how many real updates the scheduler's optimizer has made so far.
        steps_per_optimizer_step: scheduler steps per real optimizer step (1, or the number of
            processes when schedules are scaled).
    """

    def __init__(self, scheduler: Any, real_steps: Callable[[], int], steps_per_optimizer_step: int = 1) -> None:
        own = self.__dict__
        own["scheduler"] = scheduler
        own["real_steps"] = real_steps
        own["steps_per_optimizer_step"] = int(steps_per_optimizer_step)
        own["_seen"] = real_steps()
        own["_warned_total_steps"] = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "scheduler" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            self.__dict__[name] = value
        else:
            setattr(self.__dict__["scheduler"], name, value)

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler if (and as often as) its optimizer really stepped."""
        now = self.real_steps()
        if now <= self._seen:
            logger.debug("scheduler %s not stepped: its optimizer step was skipped", type(self.scheduler).__name__)
            return
        self._seen = now
        if advance_scheduler(self.scheduler, self.steps_per_optimizer_step, *args, **kwargs) and not self._warned_total_steps:
            self._warned_total_steps = True
            logger.warning("%s reached total_steps; further scheduler steps are ignored", type(self.scheduler).__name__)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's ``state_dict()``."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped scheduler's ``load_state_dict()``."""
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[Any]:
        """The wrapped scheduler's ``get_last_lr()``."""
        return self.scheduler.get_last_lr()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheduler!r}, steps_per_optimizer_step={self.steps_per_optimizer_step})"
