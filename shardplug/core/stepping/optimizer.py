"""``PreparedOptimizer``: an optimizer that steps only when gradients are synchronised.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = PreparedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    >>> isinstance(opt, torch.optim.Optimizer), opt.step_was_skipped
    (True, False)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.optim import Optimizer

from shardplug.core._internal import compat
from shardplug.core.stepping import amp
from shardplug.core.stepping.accumulation import GradientState

__all__ = ["PreparedOptimizer"]

logger = logging.getLogger(__name__)


@compat.steps_as_plain_optimizer  # the fused path is the wrapped optimizer's, which step() hands to the scaler
class PreparedOptimizer(Optimizer):
    """Wraps an optimizer so that it steps at the end of each gradient-accumulation cycle.

    It *is* a :class:`torch.optim.Optimizer` (``isinstance`` holds, the ``register_*_hook``
    methods work, an ``LRScheduler`` can be built on it), and ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's own objects. Other attributes are read from the
    wrapped optimizer.

    Args:
        optimizer: the optimizer to wrap.
        device_placement: move the optimizer's state to ``device`` now and on every
            ``load_state_dict``.
        scaler: a ``torch.amp.GradScaler``; ``step()`` then goes through ``scaler.step`` followed by
            ``scaler.update()`` and sets :attr:`step_was_skipped`.
        device: where the state goes; ``None`` = the device of each state's parameter.
        gradient_state: the run's :class:`GradientState`; ``None`` = a private one that syncs on
            every call (no accumulation).

    Stepping: ``step()`` and ``zero_grad()`` act only when ``gradient_state.sync_gradients`` is
    true and do nothing on the other micro-batches. When a cut pass ends a cycle without an update
    (:class:`GradientState`: the end of a pass ends the cycle), :meth:`abandon_step` runs by itself:
    the cycle's gradients are cleared, so the next update sums exactly ``num_steps`` micro-batches.
    Step hooks registered on this object run around the steps that act (check :attr:`step_was_skipped`
    in a post-hook); global optimizer hooks run for the wrapped optimizer's own ``step``, as torch decides.

    Skipped steps: a step counts as taken when the wrapped optimizer's ``step`` completed and the
    scaler did not skip it (:class:`~shardplug.core.stepping.amp.StepCounter`, the counter every front end
    and every prepared scheduler reads), so fused and ``_step_supports_amp_scaling`` optimizers,
    which the scaler calls even when they then skip, are reported correctly. Without a scaler (or
    with a disabled one) nothing is ever skipped. ``scaler.unscale_(prepared)`` before ``step()``
    (gradient clipping) is honoured.

    Exceptions: if ``step()`` raises (in a hook, in the scaler, in the wrapped step), the scaler's
    iteration is closed (``update()`` when the parameters had changed, else its record is dropped)
    and the gradients are cleared, so the next step is computed from fresh gradients only; the
    exception then propagates. :meth:`abandon_step` does the same for an exception between
    ``backward()`` and ``step()``.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = GradientState(num_steps=2)
        >>> opt = PreparedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gradient_state=state)
        >>> before = model.weight.detach().clone()
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> state.begin_micro_batch()  # first of two micro-batches: no step
        False
        >>> opt.step(); torch.equal(before, model.weight)
        True
    """

    def __init__(
        self,
        optimizer: Optimizer,
        device_placement: bool = True,
        scaler: Any | None = None,
        device: str | torch.device | None = None,
        gradient_state: GradientState | None = None,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer; pass the optimizer instance"
            )
        if isinstance(optimizer, PreparedOptimizer):
            raise TypeError("optimizer is already a PreparedOptimizer; pass it as it is, or its .optimizer")
        amp.check_scaler(scaler)
        if gradient_state is not None and not isinstance(gradient_state, GradientState):
            raise TypeError(
                f"gradient_state={gradient_state!r} is not a GradientState; pass the run's GradientState "
                "(e.g. run.gradient_state) or None"
            )
        self.__dict__["optimizer"] = optimizer
        # Run Optimizer's own set-up (hook registries, profiling name) against a scratch group,
        # so that the wrapped optimizer's groups, state and defaults are left untouched.
        self.__dict__["_scratch"] = {"param_groups": [], "state": {}, "defaults": {}}
        try:
            Optimizer.__init__(self, [torch.empty(0)], {})
        finally:
            del self.__dict__["_scratch"]
        self.scaler = scaler
        self.device_placement = bool(device_placement)
        self.device = torch.device(device) if device is not None else None
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        self._last_step: amp.StepAttempt | amp.StepOutcome | None = None  # the last step that acted (read lazily)
        self._counter = amp.step_counter(optimizer)
        self._warned_no_micro_batch = False
        self.gradient_state.register_drop_hook(self.abandon_step)  # a cut pass drops its partial cycle
        if self.device_placement:
            self._place_state()

    # -- the wrapped optimizer's objects -----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups, with the learning rate a waiting scheduler decision sets (settled here)."""
        scratch = self.__dict__.get("_scratch")
        counter = self.__dict__.get("_counter")
        if counter is not None and counter.waiting:
            counter.settle_waiting()
        return cast(
            "list[dict[str, Any]]", scratch["param_groups"] if scratch is not None else self.optimizer.param_groups
        )

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        scratch = self.__dict__.get("_scratch")
        if scratch is not None:
            scratch["param_groups"] = value
        else:
            self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        scratch = self.__dict__.get("_scratch")
        return scratch["state"] if scratch is not None else self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        scratch = self.__dict__.get("_scratch")
        if scratch is not None:
            scratch["state"] = value
        else:
            self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        scratch = self.__dict__.get("_scratch")
        return cast("dict[str, Any]", scratch["defaults"] if scratch is not None else self.optimizer.defaults)

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        scratch = self.__dict__.get("_scratch")
        if scratch is not None:
            scratch["defaults"] = value
        else:
            self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        # only reached for names not found on this object: read them from the wrapped optimizer
        if name.startswith("__") or "optimizer" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__["optimizer"], name)

    # -- stepping ----------------------------------------------------------------------------
    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step that acted was skipped by the scaler (inf/NaN gradients).

        Read when asked: with a fused optimizer this waits for that step's kernels (not for later work)."""
        last = self._last_step
        return last is not None and last.skipped

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the parameters on a sync micro-batch; do nothing on the others."""
        state = self.gradient_state
        if not state.sync_gradients:
            return None
        if state.num_steps > 1 and not state.micro_batch_begun and not self._warned_no_micro_batch:
            self._warned_no_micro_batch = True
            logger.warning(
                "gradient accumulation is set to %d micro-batches but no micro-batch was begun: the optimizer "
                "steps on every call. Wrap each micro-batch in the run's accumulate() context.",
                state.num_steps,
            )
        if closure is not None and amp.scaler_enabled(self.scaler):
            raise RuntimeError("closures are not supported with a GradScaler (as in torch); call step() without one")
        attempt = amp.StepAttempt(self.optimizer, self.scaler)
        try:
            # hooks see (self, *step arguments), as torch's own step wrapper passes them
            args: tuple[Any, ...] = (self,) if closure is None else (self, closure)
            kwargs: dict[str, Any] = {}
            for pre_hook in compat.optimizer_hooks(self, "step_pre"):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            f"an optimizer step pre-hook must return None or (args, kwargs), got {result!r}"
                        )
                    args, kwargs = result
            out = self._step_wrapped(attempt, tuple(args[1:]), kwargs)
            self._last_step = attempt
            for post_hook in compat.optimizer_hooks(self, "step_post"):
                post_hook(self, args, kwargs)
        except BaseException:
            self._step_failed(stepped=attempt.stepped)
            raise
        return out

    def _step_wrapped(self, attempt: amp.StepAttempt, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The wrapped step inside ``attempt`` (which closes the scaler's iteration if it raises)."""
        scaler, optimizer = self.scaler, self.optimizer
        if not amp.scaler_enabled(scaler):
            with attempt:
                return optimizer.step(*args, **kwargs)
        amp.move_record(scaler, self, optimizer)  # the user called scaler.unscale_(this wrapper)
        with attempt:
            out = scaler.step(optimizer, *args, **kwargs)
        scaler.update()
        return out

    def _step_failed(self, stepped: bool) -> None:
        """An exception inside :meth:`step`: no stale scaler record, no gradients left behind."""
        self.abandon_step()
        logger.warning(
            "%s.step() raised %s the parameters were updated: the gradients of this step were cleared so that "
            "the next step starts clean",
            type(self.optimizer).__name__,
            "after" if stepped else "before",
        )

    def abandon_step(self) -> None:
        """Give up the step being prepared: clear the gradients and the scaler's record of them.

        Call it when an exception ends a micro-batch between ``backward()`` and ``step()`` and the
        loop goes on (``TrainingRun.accumulate`` does): the next step then uses only the gradients of
        the micro-batches that follow, never gradients that were unscaled for a step that never came.
        """
        amp.forget_step(self.scaler, self.optimizer)
        amp.forget_step(self.scaler, self)
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def steps_taken(self) -> int:
        """Updates the wrapped optimizer has really made (steps the scaler skipped excluded)."""
        return self._counter.taken

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on a sync micro-batch; do nothing on the others."""
        if self.gradient_state.sync_gradients:
            amp.forget_step(self.scaler, self.optimizer)  # unscaled for a step that did not come
            self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- the rest of the Optimizer API -------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        if "_scratch" in self.__dict__:  # Optimizer.__init__'s scratch group
            Optimizer.add_param_group(self, param_group)
            return
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, through this object's state-dict hooks."""
        for pre_hook in compat.optimizer_hooks(self, "state_dict_pre"):
            pre_hook(self)
        state_dict = self.optimizer.state_dict()
        for post_hook in compat.optimizer_hooks(self, "state_dict_post"):
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return cast("dict[str, Any]", state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then place the state on the device."""
        for pre_hook in compat.optimizer_hooks(self, "load_state_dict_pre"):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.optimizer.load_state_dict(state_dict)
        if self.device_placement:
            self._place_state()
        for post_hook in compat.optimizer_hooks(self, "load_state_dict_post"):
            post_hook(self)

    def train(self) -> None:
        """Forward ``train()`` to optimizers that have one (schedule-free optimizers)."""
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        """Forward ``eval()`` to optimizers that have one (schedule-free optimizers)."""
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def _place_state(self) -> None:
        """Move state tensors to ``device`` (default: their parameter's), following torch's rule
        that a non-capturable, non-fused optimizer keeps ``step`` where it is."""
        optimizer = self.optimizer
        for group in optimizer.param_groups:
            keep_step = not (group.get("capturable") or group.get("fused"))
            for param in group["params"]:
                param_state = optimizer.state.get(param)
                if not param_state:
                    continue
                target = self.device if self.device is not None else param.device
                for key, value in param_state.items():
                    if torch.is_tensor(value) and value.device != target and not (key == "step" and keep_step):
                        param_state[key] = value.to(target)

    # -- pickling / repr ---------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # hooks (often closures) are dropped, as torch does for optimizers
        return {
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "device_placement": self.device_placement,
            "device": self.device,
            "gradient_state": self.gradient_state,
            "_last_step": amp.StepOutcome.known(self.step_was_skipped),  # read: an attempt holds this process's hooks
            "_warned_no_micro_batch": self._warned_no_micro_batch,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        compat.restore_hook_registries(self)
        self.__dict__["_counter"] = amp.step_counter(self.optimizer)
        compat.patch_step_function(self)
        self.gradient_state.register_drop_hook(self.abandon_step)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


# Step hooks are run by PreparedOptimizer.step itself, only on the steps that act: keep torch from
# wrapping it with the hook-running profiler wrapper (which would also run them on no-op calls).
compat.runs_own_step_hooks(PreparedOptimizer.step)
