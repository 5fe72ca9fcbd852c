"""Mixed-precision stepping: every use of ``GradScaler``'s records, and the real-step count.

Two things live here and nowhere else (the private ``GradScaler`` record they read and change is
reached only through the accessors of :mod:`shardplug.core._internal.compat`, which lists it):

* :class:`StepCounter`: how many updates an optimizer really made, counted by a public step
  post-hook. A step the scaler skips for inf/NaN gradients is not counted, also for fused and
  ``_step_supports_amp_scaling`` optimizers, which the scaler calls and which then skip inside
  their kernel. Every front end (plain PyTorch, Lightning, Fabric, Ignite) asks
  :func:`step_counter`, and schedulers follow its count;
* the unscale-once and failed-step bookkeeping: :func:`unscale_once` (clipping unscales each
  optimizer once per step), :func:`forget_step` and :func:`close_failed_step` (an exception in the
  middle of a step leaves no stale record behind, so the next update is not applied with gradients
  that are still multiplied by the scale).

Example::

    >>> import torch
    >>> param = torch.nn.Parameter(torch.ones(1))
    >>> opt = torch.optim.SGD([param], lr=0.1)
    >>> counter = step_counter(opt)
    >>> param.grad = torch.ones(1); opt.step()
    >>> counter.taken, step_counter(opt) is counter
    (1, True)
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any, Protocol, TypeGuard, cast

import torch
from torch.optim import Optimizer

from shardplug.core._internal import compat

__all__ = [
    "Scaler",
    "StepCounter",
    "step_counter",
    "scaler_enabled",
    "check_scaler",
    "found_inf",
    "is_unscaled",
    "unscale_once",
    "move_record",
    "forget_step",
    "close_failed_step",
    "StepAttempt",
    "StepOutcome",
    "MAX_UNREAD",
]

logger = logging.getLogger(__name__)


class Scaler(Protocol):
    """What shardplug uses of a ``torch.amp.GradScaler`` (any object with these methods is taken as one)."""

    def scale(self, outputs: Any) -> Any: ...

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any: ...

    def update(self, new_scale: Any = None) -> None: ...

    def unscale_(self, optimizer: Optimizer) -> None: ...

    def is_enabled(self) -> bool: ...


# -- the scaler --------------------------------------------------------------------------------
def scaler_enabled(scaler: Scaler | None) -> TypeGuard[Scaler]:
    """Whether ``scaler`` is a scaler that scales (``None`` and disabled scalers do not)."""
    return scaler is not None and bool(scaler.is_enabled())


def check_scaler(scaler: Any, name: str = "scaler") -> Scaler | None:
    """``scaler`` if it is ``None`` or looks like a ``torch.amp.GradScaler``; else ``TypeError``."""
    if scaler is not None and not all(
        hasattr(scaler, m) for m in ("scale", "step", "update", "unscale_", "is_enabled")
    ):
        raise TypeError(
            f"{name}={scaler!r} is not a GradScaler (it needs scale(), step(), update(), unscale_() and "
            "is_enabled()); pass torch.amp.GradScaler(device) or None"
        )
    return cast("Scaler | None", scaler)


def found_inf(scaler: Scaler | None, optimizer: Optimizer) -> bool | None:
    """Whether the scaler found inf/NaN gradients for ``optimizer`` in this iteration.

    ``None`` when it has not checked them yet (no ``unscale_`` or ``step`` since the last ``update``).
    """
    found = compat.scaler_found_inf(scaler, optimizer)
    if not found:
        return None
    return bool(sum(float(t.item()) for t in found.values()) > 0)


def is_unscaled(scaler: Scaler | None, optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s gradients were unscaled in this iteration and it has not stepped since."""
    return compat.scaler_stage(scaler, optimizer) is compat.opt_state().UNSCALED


def unscale_once(scaler: Scaler | None, optimizer: Optimizer) -> bool:
    """``scaler.unscale_(optimizer)`` unless it was already done in this iteration; True if it unscaled."""
    if not scaler_enabled(scaler):
        return False
    stage = compat.scaler_stage(scaler, optimizer)
    if stage is not None and stage is not compat.opt_state().READY:
        return False
    scaler.unscale_(optimizer)
    return True


def move_record(scaler: Scaler | None, source: Optimizer, target: Optimizer) -> None:
    """Give ``target`` the record the scaler made for ``source`` (``scaler.unscale_(wrapper)``
    followed by a step of the wrapped optimizer must not unscale twice)."""
    compat.move_scaler_record(scaler, source, target)


def forget_step(scaler: Scaler | None, optimizer: Optimizer) -> bool:
    """Drop the scaler's record of a step of ``optimizer`` that will not happen; True if there was one.

    Call it with the gradients it covered cleared: they may be unscaled already.
    """
    stage = compat.scaler_stage(scaler, optimizer)
    if stage is None or stage is compat.opt_state().STEPPED:
        return False  # no record, or the parameters changed: only update() may close this iteration
    return compat.forget_scaler_record(scaler, optimizer)


def close_failed_step(scaler: Scaler | None, optimizer: Optimizer, stepped: bool) -> None:
    """Leave the scaler right after an exception inside ``scaler.step(optimizer)`` (or just before it).

    ``stepped``: whether ``optimizer`` had updated the parameters before the exception; then the
    iteration is closed with ``scaler.update()`` as a completed step would be, else its record is
    dropped.
    """
    if not scaler_enabled(scaler):
        return
    if stepped or compat.scaler_stage(scaler, optimizer) is compat.opt_state().STEPPED:
        scaler.update()
    else:
        forget_step(scaler, optimizer)


# -- real steps --------------------------------------------------------------------------------
#: Unread outcomes a :class:`StepCounter` keeps at most; beyond, the oldest is read (its step is long done).
MAX_UNREAD = 64

#: Device types whose skip flag is read lazily. On the CPU the flag is on the host already: reading it costs
#: nothing, so it is read at once and the wrapped optimizer and scheduler read as torch's do right after
#: ``scheduler.step()`` (the tests add ``"cpu"`` here to run the lazy path on the CPU).
DEFERRED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class StepOutcome:
    """Whether one call of an optimizer's ``step`` was skipped, read only when someone asks.

    A fused (or ``_step_supports_amp_scaling``) optimizer skips inside its kernel on the flag
    ``GradScaler`` sets; on a CUDA device the flag is copied to pinned host memory behind the step's
    kernels and an event is recorded after the copy, so reading :attr:`skipped` waits for that
    step's kernels only, never for work queued after it. On the CPU the flag is on the host: it is read
    at once (the outcome is settled), nothing is deferred.

    Example::

        >>> StepOutcome.known(False).skipped, StepOutcome.of_flag(torch.ones(())).settled
        (False, True)
    """

    __slots__ = ("_skipped", "_flag", "_event")

    def __init__(self) -> None:
        self._skipped: bool | None = None
        self._flag: torch.Tensor | None = None
        self._event: Any = None

    @classmethod
    def known(cls, skipped: bool) -> StepOutcome:
        """An outcome known at once (a plain optimizer the scaler did or did not call)."""
        outcome = cls()
        outcome._skipped = bool(skipped)
        return outcome

    @classmethod
    def of_flag(cls, flag: torch.Tensor) -> StepOutcome:
        """The outcome of a step that skips on ``flag`` (non-zero: skipped), read lazily."""
        if flag.device.type not in DEFERRED_DEVICE_TYPES:
            return cls.known(bool(float(flag.detach().sum()) != 0.0))
        outcome = cls()
        if flag.device.type == "cuda":
            # everything on the flag's own device and its current stream (the step's kernels ran there), never
            # on the process's current device: under torchrun without torch.cuda.set_device that is GPU 0,
            # where this process has nothing to do
            with torch.cuda.device(flag.device):
                stream = torch.cuda.current_stream(flag.device)
                host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
                host.copy_(flag, non_blocking=True)  # on the current stream of the flag's device: ``stream``
                event = torch.cuda.Event()
                event.record(stream)
            outcome._flag, outcome._event = host, event
        else:
            outcome._flag = flag.detach().clone()
        return outcome

    @property
    def settled(self) -> bool:
        """Whether the flag was read already."""
        return self._skipped is not None

    @property
    def skipped(self) -> bool:
        """Whether the step made no update (reads the flag the first time: waits for that step's kernels)."""
        if self._skipped is None:
            if self._event is not None:
                self._event.synchronize()
            flag = cast("torch.Tensor", self._flag)
            self._skipped = bool(float(flag.sum()) != 0.0)
            self._flag = self._event = None
        return self._skipped

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'unread' if self._skipped is None else f'skipped={self._skipped}'})"


class StepCounter:
    """The updates one optimizer really made: its ``step`` completed and was not skipped.

    Counted by a step post-hook (``Optimizer.register_step_post_hook``), so it sees every call,
    whoever makes it (``scaler.step``, Lightning's precision plugin, a user). ``GradScaler`` does
    not call a plain optimizer's ``step`` on inf/NaN gradients; it does call fused and
    ``_step_supports_amp_scaling`` optimizers, with the inf flag set on them: such a call counts only
    when the flag is zero. Each call leaves a :class:`StepOutcome`; a fused step's flag on a CUDA device
    is read only when :attr:`taken` is read (or when more than :data:`MAX_UNREAD` are unread): nothing
    in a step waits for the device. A flag on the CPU is read at once.

    Use :func:`step_counter` to get the one counter of an optimizer.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self._taken = 0
        self._unread: deque[StepOutcome] = deque()  # outcomes of fused steps, read lazily, oldest first
        self.calls = 0  #: completed calls of ``step`` (skipped fused steps included)
        self.outcomes: deque[StepOutcome] = deque(maxlen=8)  #: the outcomes of the last calls, newest last
        #: decisions waiting on this optimizer's outcomes (a prepared scheduler's): settled before its next step
        self.waiting: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handle = optimizer.register_step_post_hook(self._after_step)
        self._pre_handle = optimizer.register_step_pre_hook(self._before_step)
        # a checkpoint of the optimizer holds the learning rate: a waiting decision is taken before it is saved
        self._save_handle = optimizer.register_state_dict_pre_hook(self._before_save)

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.settle_waiting()

    def _before_save(self, optimizer: Optimizer) -> None:
        self.settle_waiting()

    def settle_waiting(self) -> None:
        """Settle the decisions that wait on this optimizer's outcomes (before its next update reads the lr)."""
        while self.waiting:
            self.waiting.pop().settle()

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.calls += 1
        flag = compat.step_inf_flag(optimizer)
        if isinstance(flag, torch.Tensor):
            outcome = StepOutcome.of_flag(flag)
            if outcome.settled:  # a flag on the host (CPU): counted now, as a plain optimizer's step is
                self._taken += not outcome.skipped
            else:
                self._unread.append(outcome)
                if len(self._unread) > MAX_UNREAD:
                    self._settle_oldest()
        else:
            scaler = kwargs.get("grad_scaler") if isinstance(kwargs, dict) else None
            # the deprecated protocol: the optimizer consulted the scaler itself
            outcome = StepOutcome.known(scaler is not None and bool(found_inf(scaler, optimizer)))
            self._taken += not outcome.skipped
        self.outcomes.append(outcome)

    def _settle_oldest(self) -> None:
        self._taken += not self._unread.popleft().skipped

    @property
    def unread(self) -> int:
        """Outcomes not read yet (fused steps whose flag nobody needed so far)."""
        return sum(not outcome.settled for outcome in self._unread)

    @property
    def taken(self) -> int:
        """Updates made so far (steps the scaler skipped excluded); reads the unread outcomes."""
        while self._unread:
            self._settle_oldest()
        return self._taken

    def remove(self) -> None:
        """Stop counting (removes the hooks)."""
        self._handle.remove()
        self._pre_handle.remove()
        self._save_handle.remove()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(taken={self.taken}, calls={self.calls})"


_COUNTERS: weakref.WeakKeyDictionary[Optimizer, StepCounter] = weakref.WeakKeyDictionary()


def step_counter(optimizer: Optimizer) -> StepCounter:
    """The :class:`StepCounter` of ``optimizer`` (created, and its hook registered, on first use)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer")
    counter = _COUNTERS.get(optimizer)
    if counter is None:
        counter = _COUNTERS[optimizer] = StepCounter(optimizer)
    return counter


class StepAttempt:
    """One attempt to step an optimizer (``scaler.step``, a framework's precision plugin, a plain
    ``step``): keeps the :class:`StepOutcome` of each call made in it and closes the scaler's
    iteration if the attempt raises.

    The calls are counted from when the ``with`` block is entered (or the attempt made); :attr:`skipped`
    reads the outcomes only when it is read (a fused step's flag: see :class:`StepOutcome`).

    Example::

        >>> import torch
        >>> param = torch.nn.Parameter(torch.ones(1)); param.grad = torch.ones(1)
        >>> opt = torch.optim.SGD([param], lr=0.1)
        >>> with StepAttempt(opt, scaler=None) as attempt:
        ...     opt.step()
        >>> attempt.skipped
        False
    """

    def __init__(self, optimizer: Optimizer, scaler: Scaler | None) -> None:
        self.optimizer = optimizer
        self.scaler = scaler
        self._counter = step_counter(optimizer)
        self._calls_before = self._counter.calls
        self._outcomes: list[StepOutcome] | None = None

    def __enter__(self) -> StepAttempt:
        self._calls_before, self._outcomes = self._counter.calls, None
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._outcomes = self._made()
        if exc_type is not None:
            close_failed_step(self.scaler, self.optimizer, stepped=self.stepped)

    def _made(self) -> list[StepOutcome]:
        made = self._counter.calls - self._calls_before
        outcomes = list(self._counter.outcomes)
        return outcomes[len(outcomes) - min(made, len(outcomes)) :]

    @property
    def stepped(self) -> bool:
        """Whether the optimizer's ``step`` completed in the attempt (the parameters may have changed)."""
        return self._counter.calls > self._calls_before

    @property
    def outcomes(self) -> list[StepOutcome]:
        """The outcomes of the calls made in the attempt (none read by asking for them)."""
        return self._outcomes if self._outcomes is not None else self._made()

    @property
    def skipped(self) -> bool:
        """Whether the attempt made no update (the scaler skipped it, or nothing called ``step``)."""
        return all(outcome.skipped for outcome in self.outcomes)
