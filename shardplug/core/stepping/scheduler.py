"""``PreparedScheduler``: a learning-rate scheduler that follows the optimizer steps that happened.

Example::

    >>> import torch
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    >>> sched = PreparedScheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), opt,
    ...                           num_processes=2)
    >>> opt.step(); sched.step(); sched.last_epoch  # not split: 2 scheduler steps per optimizer step
    2
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from shardplug.core._internal import compat
from shardplug.core._internal.arguments import check_int
from shardplug.core._internal.topology import resolve_data_topology
from shardplug.core.config import ShardplugConfig
from shardplug.core.stepping import amp
from shardplug.core.stepping.accumulation import GradientState
from shardplug.core.stepping.optimizer import PreparedOptimizer

__all__ = ["PreparedScheduler", "advance_scheduler"]

logger = logging.getLogger(__name__)

_OWN = frozenset(
    {
        "scheduler",
        "optimizers",
        "step_scheduler_with_optimizer",
        "split_batches",
        "num_processes",
        "scale_scheduler_by_num_processes",
        "_counters",
        "gradient_state",
        "_seen_steps",
        "_warned_total_steps",
        "_pending",
    }
)


def _default_num_processes() -> int:
    return resolve_data_topology()[0]


def advance_scheduler(scheduler: Any, times: int, *args: Any, **kwargs: Any) -> bool:
    """Step ``scheduler`` ``times`` times, never past its ``total_steps`` (``OneCycleLR``).

    Returns True when the cap stopped it (torch raises past ``total_steps``).
    """
    for _ in range(times):
        total = getattr(scheduler, "total_steps", None)
        if isinstance(total, int) and scheduler.last_epoch >= total:
            return True
        scheduler.step(*args, **kwargs)
    return False


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    """The optimizer whose ``step`` updates the parameters (a prepared optimizer's wrapped one)."""
    return optimizer.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer


def _check_optimizers(scheduler: Any, optimizers: Any) -> list[Optimizer]:
    if optimizers is None:
        optimizers = [getattr(scheduler, "optimizer", None)]
    elif isinstance(optimizers, Optimizer):
        optimizers = [optimizers]
    elif hasattr(optimizers, "__iter__") and not isinstance(optimizers, (str, bytes)):
        optimizers = list(optimizers)
    else:
        raise TypeError(
            f"optimizers={optimizers!r} is invalid: pass an optimizer, a list of optimizers, or None "
            "(the scheduler's own optimizer)"
        )
    if not optimizers:
        raise ValueError("optimizers=[] is invalid: a scheduler that follows optimizer steps needs at least one")
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(f"optimizers contains {opt!r}, which is not a torch.optim.Optimizer")
    return cast("list[Optimizer]", optimizers)


@compat.forwards_scheduler_flags  # flags LRScheduler keeps on its class: the wrapped scheduler's are used
class PreparedScheduler(LRScheduler):
    """Wraps a learning-rate scheduler so that it steps once per real optimizer step.

    Args:
        scheduler: the scheduler to wrap (any ``LRScheduler``, including ``ReduceLROnPlateau``).
        optimizers: the optimizer(s) whose steps drive it (prepared or not); ``None`` = the
            scheduler's own optimizer.
        step_scheduler_with_optimizer: ``False`` makes :meth:`step` a plain pass-through.
        split_batches: whether the loaders split batches; when they do, one optimizer step is one
            global batch and the scheduler steps once.
        num_processes: ``None`` = read from the running job.
        scale_scheduler_by_num_processes: when batches are not split, step ``num_processes`` times
            per optimizer step (schedules sized on the unsharded loader's length end on time);
            ``False``: once per optimizer step.
            Front ends pass ``ShardplugConfig.scales_scheduler(front_end)``.
        gradient_state: the run's :class:`GradientState`; ``None`` = the one of the first
            prepared optimizer, else a private one (no accumulation).

    With ``step_scheduler_with_optimizer=True``, :meth:`step` does nothing unless every optimizer in
    ``optimizers`` made a real update since the scheduler last stepped: not while gradients are
    being accumulated, not after a step the ``GradScaler`` skipped (fused optimizers included). The
    updates are counted by :func:`shardplug.core.stepping.amp.step_counter`, whoever steps the optimizer
    (a prepared optimizer, ``scaler.step``, Lightning, Fabric, Ignite). It then steps
    ``num_processes`` times (see above), never past the scheduler's ``total_steps``
    (``OneCycleLR``). ``ReduceLROnPlateau`` is stepped exactly once with its metric.

    Everything else (``last_epoch``, ``base_lrs``, ``optimizer``, ``get_last_lr()``, ``get_lr()``,
    ``state_dict()``, ``load_state_dict()``, ...) is the wrapped scheduler's; attribute writes go
    to the wrapped scheduler too.

    Example::

        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
        >>> plateau = PreparedScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt, num_processes=4)
        >>> opt.step(); plateau.step(0.5); plateau.last_epoch
        1
    """

    # set through the instance dict in __init__ / load_state_dict (annotations only: no class attributes)
    _seen_steps: list[int]
    _warned_total_steps: bool

    def __init__(
        self,
        scheduler: Any,
        optimizers: Optimizer | Iterable[Optimizer] | None = None,
        step_scheduler_with_optimizer: bool = ShardplugConfig.step_scheduler_with_optimizer,
        split_batches: bool = ShardplugConfig.split_batches,
        num_processes: int | None = None,
        scale_scheduler_by_num_processes: bool = True,
        gradient_state: GradientState | None = None,
    ) -> None:
        # LRScheduler.__init__ is deliberately not run: it would step and patch the optimizer.
        if isinstance(scheduler, Optimizer):
            raise TypeError(
                f"scheduler={type(scheduler).__name__} is an optimizer; pass the learning-rate scheduler first "
                "and the optimizer(s) as optimizers="
            )
        if not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler={scheduler!r} has no step() method; pass a torch learning-rate scheduler")
        if isinstance(scheduler, PreparedScheduler):
            raise TypeError("scheduler is already a PreparedScheduler; pass it as it is, or its .scheduler")
        optimizers = _check_optimizers(scheduler, optimizers)
        for name, value in (
            ("step_scheduler_with_optimizer", step_scheduler_with_optimizer),
            ("split_batches", split_batches),
            ("scale_scheduler_by_num_processes", scale_scheduler_by_num_processes),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} is invalid: it must be True or False")
        if num_processes is None:
            num_processes = _default_num_processes()
        check_int("num_processes", num_processes, minimum=1, fix="(leave it None to read it from the job)")
        if gradient_state is not None and not isinstance(gradient_state, GradientState):
            raise TypeError(
                f"gradient_state={gradient_state!r} is not a GradientState; pass the run's GradientState "
                "(e.g. run.gradient_state) or None"
            )
        if gradient_state is None:
            gradient_state = (
                next(
                    (
                        cast(Any, o).gradient_state
                        for o in optimizers
                        if isinstance(getattr(o, "gradient_state", None), GradientState)
                    ),
                    None,
                )
                or GradientState()
            )
        own = self.__dict__
        own["scheduler"] = scheduler
        own["optimizers"] = optimizers
        own["step_scheduler_with_optimizer"] = step_scheduler_with_optimizer
        own["split_batches"] = split_batches
        own["num_processes"] = num_processes
        own["scale_scheduler_by_num_processes"] = scale_scheduler_by_num_processes
        own["gradient_state"] = gradient_state
        own["_counters"] = [amp.step_counter(_unwrapped(o)) for o in optimizers]
        own["_seen_steps"] = self._optimizer_steps()
        own["_warned_total_steps"] = False
        own["_pending"] = None

    @classmethod
    def from_config(
        cls,
        scheduler: Any,
        optimizers: Optimizer | Iterable[Optimizer] | None,
        config: ShardplugConfig,
        *,
        front_end: str,
        num_processes: int,
        gradient_state: GradientState | None = None,
    ) -> PreparedScheduler:
        """The scheduler wrapper every front end builds: its options come from ``config`` only
        (``step_scheduler_with_optimizer``, ``split_batches``, and the N-fold rule decided by
        :meth:`ShardplugConfig.scales_scheduler` for ``front_end``)."""
        if not isinstance(config, ShardplugConfig):
            raise TypeError(f"config={config!r} is not a ShardplugConfig")
        return cls(
            scheduler,
            optimizers,
            step_scheduler_with_optimizer=config.step_scheduler_with_optimizer,
            split_batches=config.split_batches,
            num_processes=num_processes,
            scale_scheduler_by_num_processes=config.scales_scheduler(front_end),
            gradient_state=gradient_state,
        )

    # -- attribute pass-through --------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "scheduler" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self.settle()
        return getattr(self.__dict__["scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            self.__dict__[name] = value
        else:
            self.settle()
            setattr(self.__dict__["scheduler"], name, value)

    # -- stepping ----------------------------------------------------------------------------
    @property
    def steps_per_optimizer_step(self) -> int:
        """Scheduler steps taken per real optimizer step (``ReduceLROnPlateau``: always 1)."""
        if (
            isinstance(self.scheduler, ReduceLROnPlateau)
            or self.split_batches
            or not self.scale_scheduler_by_num_processes
        ):
            return 1
        return cast("int", self.num_processes)

    def _optimizer_steps(self) -> list[int]:
        return [counter.taken for counter in self._counters]

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler if (and as often as) the optimizers really stepped.

        Where an optimizer's last outcome is not read yet (a fused step's skip flag on the device), the
        decision waits (:attr:`pending`) and is settled when it is needed: before the optimizer's next
        step uses the learning rate (a step pre-hook), when this scheduler is read, or at its next
        ``step()``; nothing here waits for the device."""
        self.settle()
        if not self.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return  # accumulating: no optimizer step happened
        if any(counter.unread for counter in self._counters):
            self.__dict__["_pending"] = (args, kwargs)
            for counter in self._counters:
                counter.waiting.add(self)
            return
        self._decide(args, kwargs)

    @property
    def pending(self) -> bool:
        """Whether a ``step()`` waits for an optimizer's skip flag (see :meth:`step`)."""
        return self.__dict__.get("_pending") is not None

    def settle(self) -> None:
        """Take the decision a ``step()`` left waiting (reads the skip flags it needs; nothing when none waits)."""
        pending = self.__dict__.get("_pending")
        if pending is None:
            return
        self.__dict__["_pending"] = None
        for counter in self._counters:
            counter.waiting.discard(self)
        self._decide(*pending)

    def _decide(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Step the wrapped scheduler if every optimizer made an update since it last stepped."""
        now = self._optimizer_steps()
        stepped = all(n > seen for n, seen in zip(now, self._seen_steps))
        if not stepped:
            logger.debug("scheduler not stepped: an optimizer made no update since the last scheduler step")
            return
        self._seen_steps = now
        if (
            advance_scheduler(self.scheduler, self.steps_per_optimizer_step, *args, **kwargs)
            and not self._warned_total_steps
        ):
            self._warned_total_steps = True
            logger.warning("%s reached total_steps; further scheduler steps are ignored", type(self.scheduler).__name__)

    # -- pass-through methods LRScheduler defines --------------------------------------------
    def get_last_lr(self) -> list[Any]:
        """The wrapped scheduler's ``get_last_lr()``."""
        self.settle()
        return cast("list[Any]", self.scheduler.get_last_lr())

    def get_lr(self) -> list[Any]:
        """The wrapped scheduler's ``get_lr()``."""
        self.settle()
        return cast("list[Any]", self.scheduler.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's ``state_dict()``."""
        self.settle()
        return cast("dict[str, Any]", self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped scheduler's ``load_state_dict()``."""
        self.settle()
        self.scheduler.load_state_dict(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        state = dict(self.__dict__)
        del state["_counters"], state["_seen_steps"]  # bound to the optimizer objects of this process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_counters"] = [amp.step_counter(_unwrapped(o)) for o in self.optimizers]
        self.__dict__["_seen_steps"] = self._optimizer_steps()  # the next real step counts
        self.__dict__["_pending"] = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.scheduler!r}, steps_per_optimizer_step={self.steps_per_optimizer_step})"
