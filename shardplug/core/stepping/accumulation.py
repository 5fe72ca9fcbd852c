"""Gradient accumulation state shared by one training run's loaders, optimizers and schedulers.

A :class:`GradientState` is an ordinary object, not a process-wide singleton: every training run
owns one, so two runs in the same process (or two tests) never see each other's flags.

Who talks to it:

* prepared loaders call ``loader_started`` / ``batch_ready`` / ``loader_stopped`` around each
  pass (set ``loader.gradient_state = state`` to connect a loader);
* the micro-batch context manager of the front door calls :meth:`GradientState.begin_micro_batch`
  once per micro-batch, which decides :attr:`GradientState.sync_gradients`;
* :class:`~shardplug.core.stepping.optimizer.PreparedOptimizer` and
  :class:`~shardplug.core.stepping.scheduler.PreparedScheduler` read :attr:`GradientState.sync_gradients`;
  a prepared optimizer also registers a *drop hook* (:meth:`GradientState.register_drop_hook`) that
  clears its gradients when a cut pass ends a cycle without an update (see "The end of a pass").

Example::

    >>> state = GradientState(num_steps=2)
    >>> [state.begin_micro_batch() for _ in range(4)]
    [False, True, False, True]
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from shardplug.core._internal.arguments import check_int, is_int

__all__ = ["GradientState"]

logger = logging.getLogger(__name__)


def _check_num_steps(num_steps: Any) -> int:
    if not is_int(num_steps) or num_steps < 1:
        raise ValueError(
            f"num_steps={num_steps!r} is invalid: the number of micro-batches per optimizer step must be "
            "an integer >= 1 (use 1 for no gradient accumulation)"
        )
    return num_steps


def _method_reference(fn: Callable[[], Any]) -> Callable[[], Any]:
    """A weak reference to a bound method, else a strong reference to the function."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference when the object allows one, else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class _Pass:
    """One running pass (one ``iter()``) over one loader."""

    __slots__ = ("loader", "started", "delivered", "end", "micro_batches")

    def __init__(self, loader: object, started: int) -> None:
        self.loader = _reference(loader)
        self.started = started
        self.delivered = -1  # tick of the latest batch handed out, -1 before the first
        self.end = False  # the latest batch handed out was the pass's last
        self.micro_batches = 0  # micro-batches begun while this pass was feeding them


class GradientState:
    """Gradient-accumulation state of one training run.

    Args:
        num_steps: micro-batches per optimizer step (``gradient_accumulation_steps``), ``>= 1``.

    Semantics:

    * :meth:`begin_micro_batch` counts a micro-batch; gradients synchronise (and the prepared
      optimizer steps) on every ``num_steps``-th micro-batch and always on the last batch of the
      loader that feeds it, after which a new accumulation cycle starts.
    * The loader that "feeds" a micro-batch is the innermost running pass, together with passes
      that handed out a batch after it started (``zip(a, b)``). A nested loop that has already
      finished (an evaluation loop inside the training loop) is forgotten and never forces a sync.
    * **The end of a pass ends the cycle**, also the end of a pass that was cut. A pass that is
      exhausted syncs on its last batch: the loader's end steps with what was accumulated. A pass
      that ends before that (``break``, an exception, Ignite's ``terminate_epoch()`` or
      ``terminate()``, a new ``iter()``, a run ended by a step limit) in the middle of a cycle ends
      the cycle *without* an update: the micro-batches accumulated in it are **dropped** (every
      registered drop hook runs: the prepared optimizers clear their gradients and the scaler's
      record of them), a fresh cycle starts with :attr:`sync_gradients` back to ``True``, and the
      next update sums exactly ``num_steps`` micro-batches. They are dropped, not stepped: their
      gradients were never all-reduced (``no_sync``), so an update from them would differ from
      process to process; and they are what a resume from a checkpoint would not have either.
      :meth:`reset` ends a cycle in progress the same way. (Lightning's own loop does the same: it
      zeroes the gradients on the first micro-batch of every cycle, counted per epoch.)

    Outside any micro-batch :attr:`sync_gradients` is ``True``: an optimizer used without the
    micro-batch context steps every time.

    Example::

        >>> state = GradientState(num_steps=3)
        >>> def loader(n):  # what a prepared loader does
        ...     state.loader_started(loader)
        ...     try:
        ...         for i in range(n):
        ...             state.batch_ready(loader, end_of_dataloader=(i == n - 1))
        ...             yield i
        ...     finally:
        ...         state.loader_stopped(loader)
        >>> [state.begin_micro_batch() for _ in loader(4)]
        [False, False, True, True]
    """

    def __init__(self, num_steps: int = 1) -> None:
        self._num_steps = _check_num_steps(num_steps)
        self._micro_batches = 0
        self._sync = True
        self._passes: list[_Pass] = []
        self._ticks: Iterator[int] = itertools.count()
        self._micro_batch_begun = False
        self._drop_hooks: dict[int, Callable[[], Any]] = {}
        self._hook_ids: Iterator[int] = itertools.count()

    # -- public state ------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self._num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self._num_steps = _check_num_steps(value)
        self.restart_cycle()

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch synchronises gradients and steps the optimizer."""
        return self._sync

    @property
    def micro_batches(self) -> int:
        """Micro-batches accumulated in the current cycle (``0`` right after a sync)."""
        return self._micro_batches

    @property
    def in_dataloader(self) -> bool:
        """Whether a pass over a connected loader is running."""
        self._prune()
        return bool(self._passes)

    @property
    def active_dataloader(self) -> Any | None:
        """The loader of the innermost running pass, or ``None``."""
        self._prune()
        return self._passes[-1].loader() if self._passes else None

    @property
    def micro_batch_begun(self) -> bool:
        """Whether a micro-batch was ever begun (:meth:`begin_micro_batch`)."""
        return self._micro_batch_begun

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the loader feeding the current micro-batch has handed out its last batch."""
        return any(p.end for p in self._current_passes())

    def begin_micro_batch(self, force_sync: bool = False) -> bool:
        """Count one micro-batch and return (and record) whether it synchronises gradients.

        Call it once per micro-batch, *after* fetching the batch (the front door's micro-batch
        context manager does this). ``force_sync=True`` makes this micro-batch sync, e.g. the last
        one of a hand-written loop without a prepared loader.
        """
        current = self._current_passes()
        for p in current:
            p.micro_batches += 1
        self._micro_batch_begun = True
        self._micro_batches += 1
        if force_sync or any(p.end for p in current) or self._micro_batches >= self._num_steps:
            self._sync = True
            self._micro_batches = 0
        else:
            self._sync = False
        return self._sync

    def restart_cycle(self) -> None:
        """Start a fresh accumulation cycle (``sync_gradients=True``); running passes are kept.

        Used when a micro-batch failed and its cycle's gradients were dropped.
        """
        self._micro_batches = 0
        self._sync = True

    def align_cycle(self, batches_before: int) -> None:
        """A pass resumes its epoch after ``batches_before`` of its batches (counted on the loader's layout, from
        a loaded position): the cycle stands where the epoch's cycles put it, ``batches_before % num_steps``
        micro-batches in, whatever cycle :meth:`load_state_dict` restored. The optimizer then steps after every
        ``num_steps``-th batch of the epoch and after its last, as in an uninterrupted run on this layout and as
        Lightning's loop steps by ``batch_idx``; on the layout a position was saved on, that is the saved cycle.

        The gradients of the cycle's micro-batches before the position are in no checkpoint: the first update
        sums fewer micro-batches (logged).

        Example::

            >>> state = GradientState(num_steps=4)
            >>> state.align_cycle(6)  # the 7th and 8th batches of the epoch complete its 2nd cycle
            >>> state.micro_batches, [state.begin_micro_batch() for _ in range(3)]
            (2, [False, True, False])
        """
        check_int("batches_before", batches_before, minimum=0)
        micro_batches = batches_before % self._num_steps
        if micro_batches and micro_batches != self._micro_batches:
            logger.warning(
                "the resumed epoch continues %d micro-batches into a gradient-accumulation cycle of %d (its cycles on "
                "this layout): their gradients are not in the checkpoint, so its first update sums fewer micro-batches",
                micro_batches,
                self._num_steps,
            )
        self._micro_batches = micro_batches
        self._sync = micro_batches == 0

    def reset(self) -> None:
        """Forget running passes and start a fresh accumulation cycle (``sync_gradients=True``);
        the micro-batches of a cycle in progress are dropped (:meth:`register_drop_hook`)."""
        self._passes.clear()
        if self._micro_batches:
            self._drop_cycle("the gradient state was reset")
        self.restart_cycle()

    def register_drop_hook(self, hook: Callable[[], Any]) -> Callable[[], None]:
        """Call ``hook()`` whenever a cycle ends without an update (a cut pass, :meth:`reset`): it
        must forget the gradients accumulated in the cycle. Returns a function that removes it.

        A bound method is held weakly (a prepared optimizer that is garbage collected is forgotten).
        """
        key = next(self._hook_ids)
        self._drop_hooks[key] = _method_reference(hook)

        def remove() -> None:
            self._drop_hooks.pop(key, None)

        return remove

    def _drop_cycle(self, why: str) -> None:
        """The cycle in progress ends without an update: run the drop hooks."""
        logger.warning(
            "%s %d micro-batch(es) into a gradient-accumulation cycle of %d: their gradients are dropped (the end "
            "of a pass ends the cycle; the next optimizer step sums %d fresh micro-batches)",
            why,
            self._micro_batches,
            self._num_steps,
            self._num_steps,
        )
        for key, reference in list(self._drop_hooks.items()):
            hook = reference()
            if hook is None:
                self._drop_hooks.pop(key, None)
            else:
                hook()

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """``{"num_steps": k, "step": micro-batches accumulated in the current cycle}`` (plain ints).

        The ``"step"`` key is the checkpoint format (it holds :attr:`micro_batches`). Running passes
        are not state: they belong to live iterators of this process.
        """
        return {"num_steps": self._num_steps, "step": self._micro_batches}

    def load_state_dict(self, state_dict: Any) -> None:
        """Continue the accumulation cycle of :meth:`state_dict` (validated before anything changes).

        A different ``num_steps`` is accepted only at a cycle boundary (``step == 0``); the gradients
        of a cycle in progress are never in a checkpoint, so resuming inside one logs a warning.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"num_steps", "step"}:
            raise ValueError(
                f"state_dict={state_dict!r} is not a GradientState state: expected the keys 'num_steps' and 'step' "
                "(from GradientState.state_dict())"
            )
        num_steps = _check_num_steps(state_dict["num_steps"])
        step = state_dict["step"]
        check_int("state_dict['step']", step, minimum=0, below=num_steps)
        if step and num_steps != self._num_steps:
            raise ValueError(
                f"the state is {step} micro-batches into a cycle of {num_steps}, but this run accumulates "
                f"{self._num_steps}: resume with gradient_accumulation_steps={num_steps}, or from a checkpoint "
                "saved at the end of an optimizer step"
            )
        if step:
            logger.warning(
                "resuming %d micro-batches into a gradient-accumulation cycle: their gradients are not in the "
                "checkpoint (save checkpoints right after optimizer steps to avoid this)",
                step,
            )
        self._micro_batches = step
        self._sync = step == 0

    # -- loader protocol (called by prepared loaders) ----------------------------------------
    def loader_started(self, loader: object) -> None:
        """A pass over ``loader`` (any object that stands for it: a prepared loader passes itself) begins."""
        self._prune()
        self._passes.append(_Pass(loader, next(self._ticks)))

    def batch_ready(self, loader: object, end_of_dataloader: bool) -> None:
        """The pass over ``loader`` hands out a batch (its last one where ``end_of_dataloader``)."""
        p = self._find(loader)
        if p is None:  # a loader connected mid-pass: treat this batch as the start of a pass
            self.loader_started(loader)
            p = self._passes[-1]
        p.delivered = next(self._ticks)
        p.end = bool(end_of_dataloader)

    def loader_stopped(self, loader: object) -> None:
        """The pass over ``loader`` ended (exhausted or cut): where it fed a cycle, the cycle ends."""
        p = self._find(loader)
        if p is None:
            logger.debug("gradient state: %r stopped a pass that was not registered", loader)
            return
        self._passes.remove(p)
        self._prune()
        if p.micro_batches and not any(q.micro_batches for q in self._passes):
            # the training loop is over (exhausted or cut): the end of a pass ends the cycle
            if self._micro_batches:
                self._drop_cycle("a pass over the training loader ended")
            self._micro_batches = 0
            self._sync = True

    # -- helpers -----------------------------------------------------------------------------
    def _prune(self) -> None:
        """Drop passes whose loader has been garbage collected."""
        if any(p.loader() is None for p in self._passes):
            self._passes = [p for p in self._passes if p.loader() is not None]

    def _find(self, loader: object) -> _Pass | None:
        """The most recent running pass over ``loader`` (identity, never equality)."""
        for p in reversed(self._passes):
            if p.loader() is loader:
                return p
        return None

    def _current_passes(self) -> list[_Pass]:
        self._prune()
        if not self._passes:
            return []
        start = self._passes[-1].started
        return [p for p in self._passes if p.delivered > start]

    # -- pickling / repr ---------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # running passes are bound to live iterators in this process: a copy is never inside a loop
        return {"num_steps": self._num_steps, "step": self._micro_batches, "sync": self._sync}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["num_steps"])  # type: ignore[misc]
        self._micro_batches = state["step"]
        self._sync = state["sync"]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_steps={self._num_steps}, micro_batches={self._micro_batches}, "
            f"sync_gradients={self._sync}, in_dataloader={self.in_dataloader}, "
            f"end_of_dataloader={self.end_of_dataloader})"
        )
