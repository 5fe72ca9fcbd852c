"""One configuration value for every shardplug front-end.

:class:`ShardplugConfig` holds the data-loading and stepping options once, so a
plain-PyTorch :class:`~shardplug.core.stepping.training.TrainingRun` and the framework integrations take the
same value. It is frozen and validated on construction: a bad option fails where it is written,
with a message naming the argument, the value and the fix.

Example::

    >>> config = ShardplugConfig(gradient_accumulation_steps=4, split_batches=True)
    >>> config.data_loader_kwargs()["split_batches"]
    True
    >>> config.replace(gradient_accumulation_steps=2).gradient_accumulation_steps
    2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardplug.core._internal.arguments import check_int, check_prefetch_depth
from shardplug.core.shuffle.rng import check_rng_types
from shardplug.core.shuffle.seedable import check_seed, check_shuffle_algorithm

__all__ = ["ShardplugConfig", "FRONT_ENDS", "DATA_OPTIONS"]

#: Whether each front end steps prepared schedulers ``num_processes`` times per optimizer step when
#: ``scale_scheduler_by_num_processes`` is left ``None``: plain PyTorch loops size schedules on the
#: unsharded loader's length (the reference's convention); Lightning, Fabric and Ignite users size
#: them in optimizer steps (``trainer.estimated_stepping_batches``, ``len(loader)`` after setup).
FRONT_ENDS: dict[str, bool] = {"pytorch": True, "lightning": False, "fabric": False, "ignite": False}


#: The options ``prepare_data_loader`` reads (its keywords, or the fields of its ``config``).
DATA_OPTIONS = (
    "split_batches",
    "put_on_device",
    "rng_types",
    "dispatch_batches",
    "even_batches",
    "slice_fn_for_dispatch",
    "use_seedable_sampler",
    "data_seed",
    "non_blocking",
    "use_stateful_dataloader",
    "shuffle_algorithm",
    "prefetch_depth",
)

_BOOL_OPTIONS = (
    "split_batches",
    "even_batches",
    "use_seedable_sampler",
    "non_blocking",
    "use_stateful_dataloader",
    "put_on_device",
    "step_scheduler_with_optimizer",
)


@dataclass(frozen=True)
class ShardplugConfig:
    """Options shared by the loaders, optimizers and schedulers of one training run.

    Data loading (passed to ``prepare_data_loader``, see :meth:`data_loader_kwargs`):

    Args:
        split_batches: cut each batch of the user's loader into ``num_processes`` slices
            (the loader's batch size is the global one) instead of giving each process whole batches.
        even_batches: pad the end of an epoch so that every process gets the same number of batches.
        dispatch_batches: only process 0 reads the data and sends each process its rows;
            ``None`` = only for iterable datasets with ``put_on_device=True``.
        use_seedable_sampler: replace torch's own ``RandomSampler`` with a sampler whose order is a
            pure function of the seed and the epoch (a subclass, or one given a ``set_epoch``, is
            the user's and is kept).
        data_seed: seed of every shuffle shardplug creates (the seedable sampler, and the sampler
            that replaces a ``RandomSampler`` without generator); ``None``: agreed from process 0.
        non_blocking: non-blocking host-to-device copies of the batches.
        use_stateful_dataloader: back the loaders with ``torchdata``'s ``StatefulDataLoader``.
        put_on_device: move each batch to the process's device.
        rng_types: RNGs to synchronise from process 0 at each epoch start
            (``"torch"``, ``"cuda"``, ``"xla"``, ``"generator"``); stored as a tuple.
        slice_fn_for_dispatch: ``slice_fn(data, slice, process_index, num_processes)`` used by
            dispatching loaders.
        shuffle_algorithm: ``"randperm"`` (default: one ``torch.randperm`` per epoch, the
            reference's orders) or ``"bijective"`` (a keyed bijection: no permutation in memory,
            each process computes only its own rows; for very large datasets).
        prefetch_depth: batches read (and copied to the device, on a CUDA side stream) ahead of the one
            handed out, so that the next batch's copy overlaps the step; ``None`` (default) and ``0``:
            no look-ahead (prefetching is opt-in; see docs/gpu.md for what changes with it). Never with dispatch.

    Stepping:

    Args:
        gradient_accumulation_steps: micro-batches per optimizer step (``>= 1``).
        step_scheduler_with_optimizer: prepared schedulers step only when the optimizers really
            stepped; ``False`` makes them plain pass-throughs.
        scale_scheduler_by_num_processes: when batches are not split, each optimizer step advances
            a prepared scheduler ``num_processes`` times, so a schedule sized on the length of the
            *unsharded* loader ends on time (the plain-PyTorch convention). ``False``: one scheduler
            step per optimizer step, for schedules sized in optimizer steps. Never applied to
            ``ReduceLROnPlateau``. ``None`` (default): the front end's convention
            (:meth:`scales_scheduler`): ``True`` for plain PyTorch (``TrainingRun``), ``False`` for
            Lightning, Fabric and Ignite, whose users size schedules in optimizer steps.

    Example::

        >>> ShardplugConfig(gradient_accumulation_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: gradient_accumulation_steps=0 is invalid: ...
    """

    split_batches: bool = False
    even_batches: bool = True
    dispatch_batches: bool | None = None
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False
    put_on_device: bool = False
    rng_types: tuple[str, ...] | None = None
    slice_fn_for_dispatch: Callable[..., Any] | None = None
    shuffle_algorithm: str = "randperm"
    prefetch_depth: int | None = None
    gradient_accumulation_steps: int = 1
    step_scheduler_with_optimizer: bool = True
    scale_scheduler_by_num_processes: bool | None = None

    def __post_init__(self) -> None:
        for name in _BOOL_OPTIONS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} is invalid: it must be True or False")
        if self.scale_scheduler_by_num_processes is not None and not isinstance(
            self.scale_scheduler_by_num_processes, bool
        ):
            raise TypeError(
                f"scale_scheduler_by_num_processes={self.scale_scheduler_by_num_processes!r} is invalid: it must be "
                "True, False or None (the front end's convention)"
            )
        if self.dispatch_batches is not None and not isinstance(self.dispatch_batches, bool):
            raise TypeError(
                f"dispatch_batches={self.dispatch_batches!r} is invalid: it must be True, False or None (automatic)"
            )
        if self.dispatch_batches and not self.put_on_device:
            raise ValueError(
                "dispatch_batches=True needs put_on_device=True (process 0 sends each process its rows on its "
                "device); set put_on_device=True or dispatch_batches=False"
            )
        check_seed("data_seed", self.data_seed)
        check_shuffle_algorithm(self.shuffle_algorithm)
        check_prefetch_depth(self.prefetch_depth)
        if self.rng_types is not None:
            if isinstance(self.rng_types, str):
                raise TypeError(
                    f"rng_types={self.rng_types!r} is invalid: pass a tuple of names, e.g. ({self.rng_types!r},)"
                )
            try:
                rng_types = check_rng_types(self.rng_types)
            except TypeError as exc:
                raise TypeError(f"rng_types={self.rng_types!r} is invalid: it must be a tuple of names") from exc
            object.__setattr__(self, "rng_types", rng_types)  # a fresh tuple: never the caller's list
        if self.slice_fn_for_dispatch is not None and not callable(self.slice_fn_for_dispatch):
            raise TypeError(
                f"slice_fn_for_dispatch={self.slice_fn_for_dispatch!r} is invalid: it must be a callable "
                "slice_fn(data, slice, process_index, num_processes) or None"
            )
        steps = self.gradient_accumulation_steps
        check_int("gradient_accumulation_steps", steps, minimum=1, fix="(1 = an optimizer step on every batch)")
        self._refuse_options_without_effect()

    def _refuse_options_without_effect(self) -> None:
        """A combination in which an option would silently do nothing is a ``ValueError``."""
        if self.slice_fn_for_dispatch is not None and self.dispatch_batches is False:
            raise ValueError(
                "slice_fn_for_dispatch is only used by dispatching loaders, and dispatch_batches=False; "
                "drop slice_fn_for_dispatch, or set dispatch_batches=True (or None: automatic)"
            )
        if self.non_blocking and not self.put_on_device:
            raise ValueError(
                "non_blocking=True has no effect with put_on_device=False (shardplug moves no batch); "
                "set put_on_device=True, or leave non_blocking=False"
            )
        if self.scale_scheduler_by_num_processes and self.split_batches:
            raise ValueError(
                "scale_scheduler_by_num_processes=True has no effect with split_batches=True (one optimizer step is "
                "one global batch: schedulers step once); leave scale_scheduler_by_num_processes=None"
            )
        if self.scale_scheduler_by_num_processes and not self.step_scheduler_with_optimizer:
            raise ValueError(
                "scale_scheduler_by_num_processes=True has no effect with step_scheduler_with_optimizer=False "
                "(prepared schedulers are then plain pass-throughs); leave scale_scheduler_by_num_processes=None"
            )

    def scales_scheduler(self, front_end: str) -> bool:
        """Whether prepared schedulers step ``num_processes`` times per optimizer step.

        ``scale_scheduler_by_num_processes`` when set, else the convention of ``front_end``
        (:data:`FRONT_ENDS`: ``"pytorch"`` scales, ``"lightning"``, ``"fabric"`` and ``"ignite"`` do
        not). The scheduler itself never scales with ``split_batches=True`` or ``ReduceLROnPlateau``.

        Example::

            >>> ShardplugConfig().scales_scheduler("pytorch"), ShardplugConfig().scales_scheduler("ignite")
            (True, False)
        """
        if front_end not in FRONT_ENDS:
            raise ValueError(f"front_end={front_end!r} is not one of {sorted(FRONT_ENDS)}")
        if self.scale_scheduler_by_num_processes is not None:
            return self.scale_scheduler_by_num_processes
        return FRONT_ENDS[front_end]

    def data_loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``prepare_data_loader`` that this configuration decides.

        The run-specific ones (``device``, ``num_processes``, ``process_index``,
        ``torch_device_mesh``) are left to the caller. ``rng_types`` is a fresh list each call.
        """
        return {
            "split_batches": self.split_batches,
            "put_on_device": self.put_on_device,
            "rng_types": None if self.rng_types is None else list(self.rng_types),
            "dispatch_batches": self.dispatch_batches,
            "even_batches": self.even_batches,
            "slice_fn_for_dispatch": self.slice_fn_for_dispatch,
            "use_seedable_sampler": self.use_seedable_sampler,
            "data_seed": self.data_seed,
            "non_blocking": self.non_blocking,
            "use_stateful_dataloader": self.use_stateful_dataloader,
            "shuffle_algorithm": self.shuffle_algorithm,
            "prefetch_depth": self.prefetch_depth,
        }

    def replace(self, **changes: Any) -> ShardplugConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def for_loaders(self, **changes: Any) -> ShardplugConfig:
        """The ``config`` of a ``prepare_data_loader`` call: this configuration's data options with
        ``changes`` (data options only) applied and validated; the stepping options, which loaders do
        not read, at their defaults (so ``split_batches=True`` for one loader never meets a stepping rule).

        Example::

            >>> ShardplugConfig(gradient_accumulation_steps=4).for_loaders(split_batches=True).split_batches
            True
            >>> ShardplugConfig().for_loaders(gradient_accumulation_steps=2)
            Traceback (most recent call last):
            ...
            TypeError: gradient_accumulation_steps is not a prepare_data_loader option; ...
        """
        for name in changes:
            if name not in DATA_OPTIONS:
                raise TypeError(
                    f"{name} is not a prepare_data_loader option; pass one of {list(DATA_OPTIONS)} (stepping options "
                    "belong to the run's ShardplugConfig)"
                )
        stepping = {f.name: f.default for f in dataclasses.fields(self) if f.name not in DATA_OPTIONS}
        return self.replace(**stepping, **changes)
