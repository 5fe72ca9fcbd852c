"""Every private name of another library that shardplug's core reads or writes, and its accessors.

No public API does what these names do (reset a ``DataLoader``'s persistent workers, read a
``GradScaler``'s record of an iteration, run an optimizer's step hooks around a wrapped step, ...).
The rest of the core reaches them only through the functions below, so a library release that
drops or renames one breaks one module, and ``tests/api/test_compat.py`` says which name.

* :data:`PRIVATES`: each name (dotted from its library's root), with what it is used for;
* :data:`CHECKED_AGAINST`: the library versions the list was checked against.

Example::

    >>> from torch.utils.data import DataLoader
    >>> loader = DataLoader(range(4), num_workers=0)
    >>> forget_iterator(loader)  # the next iter() starts new workers
    >>> is_dataloader_internal("_iterator"), is_dataloader_internal("batch_size")
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.utils.data._utils import collate as torch_collate

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    "PRIVATES",
    "CHECKED_AGAINST",
    "library_of",
    "forget_iterator",
    "without_iterator",
    "is_dataloader_internal",
    "get_iterator_method",
    "random_sampler_num_samples",
    "torch_collate",
    "scaler_stage",
    "scaler_found_inf",
    "move_scaler_record",
    "forget_scaler_record",
    "opt_state",
    "step_inf_flag",
    "OPTIMIZER_HOOK_REGISTRIES",
    "optimizer_hooks",
    "restore_hook_registries",
    "patch_step_function",
    "steps_as_plain_optimizer",
    "runs_own_step_hooks",
    "LR_SCHEDULER_FLAGS",
    "forwards_scheduler_flags",
    "hf_example_iterable",
    "hf_node_split",
    "hf_legacy_shuffling",
    "streaming_rank_world",
    "wrapped_dataloader",
    "group_timeout",
    "pin_memory_device",
]

CHECKED_AGAINST: dict[str, str] = {
    "torch": "2.13.0",
    "torchdata": "0.11.0",
    "datasets": "5.2.0",
    "mosaicml-streaming": "0.13.0",
    "ray": "2.60.0",
}
"""The versions of the libraries whose private names :data:`PRIVATES` lists, as last checked."""

PRIVATES: dict[str, str] = {
    # -- torch.utils.data ---------------------------------------------------------------------
    "torch.utils.data.DataLoader._iterator": "the iterator a DataLoader with persistent workers keeps between "
    "passes: set to None where a pass needs new workers, and never pickled or copied (also by the Lightning "
    "strategy)",
    "torch.utils.data.DataLoader._get_iterator": "compared by identity only: a subclass that overrides it may look "
    "ahead, so dispatch does not collate into shared memory for it",
    "torch.utils.data.DataLoader._DataLoader__initialized": "with _DataLoader__multiprocessing_context, the "
    "name-mangled attributes DataLoader.__init__ sets: never copied from the user's loader to the prepared one",
    "torch.utils.data.RandomSampler._num_samples": "the num_samples the user passed (None: one per element); the "
    "public num_samples property fills it in, so it cannot tell a shuffle from a draw of a set size",
    "torch.utils.data._utils.collate.collate": "default_collate's recursion over dicts, sequences and namedtuples, "
    "with a table of per-type functions (the documented way to extend default_collate)",
    "torch.utils.data._utils.collate.default_collate_fn_map": "that table as default_collate uses it",
    "torch.utils.data._utils.collate.collate_tensor_fn": "default_collate's function for tensors",
    "torch.utils.data._utils.collate.collate_float_fn": "its function for Python floats (placed in the slot after it)",
    "torch.utils.data._utils.collate.collate_int_fn": "its function for Python ints (likewise)",
    "torch.utils.data._utils.collate.collate_numpy_scalar_fn": "its function for numpy scalars (likewise)",
    # -- torch.amp ----------------------------------------------------------------------------
    "torch.amp.GradScaler._per_optimizer_states": "the scaler's record of this iteration per optimizer (keyed by "
    "id): its stage and found_inf_per_device; read to tell an unscaled optimizer and its inf/NaN check, moved "
    "from a wrapper to the wrapped optimizer, dropped when a step fails",
    "torch.amp.grad_scaler.OptState": "the stages of that record (READY, UNSCALED, STEPPED)",
    "torch.optim.Optimizer.found_inf": "the inf/NaN flag GradScaler.step sets on a _step_supports_amp_scaling "
    "(fused) optimizer for the duration of its step; read in the step post-hook to tell a skipped fused step",
    "torch.optim.Optimizer._step_supports_amp_scaling": "set to False on PreparedOptimizer: GradScaler must treat "
    "the wrapper as a plain optimizer (the wrapped one takes the fused path)",
    # -- torch.optim --------------------------------------------------------------------------
    "torch.optim.Optimizer._optimizer_step_pre_hooks": "the step pre-hooks of PreparedOptimizer, run by its own "
    "step only on the calls that update",
    "torch.optim.Optimizer._optimizer_step_post_hooks": "its step post-hooks (likewise)",
    "torch.optim.Optimizer._optimizer_state_dict_pre_hooks": "its state_dict pre-hooks, run around the wrapped "
    "optimizer's state_dict()",
    "torch.optim.Optimizer._optimizer_state_dict_post_hooks": "its state_dict post-hooks (likewise)",
    "torch.optim.Optimizer._optimizer_load_state_dict_pre_hooks": "its load_state_dict pre-hooks, run around the "
    "wrapped optimizer's load_state_dict()",
    "torch.optim.Optimizer._optimizer_load_state_dict_post_hooks": "its load_state_dict post-hooks (likewise)",
    "torch.optim.Optimizer._patch_step_function": "re-run after unpickling, as Optimizer.__setstate__ does",
    "torch.optim.Optimizer.step.hooked": "the mark that keeps Optimizer from wrapping a step with its hook-running "
    "profiler wrapper: PreparedOptimizer.step runs its hooks itself, on the calls that update only",
    "torch.optim.lr_scheduler.LRScheduler._get_lr_called_within_step": "a flag LRScheduler reads and sets on "
    "itself: PreparedScheduler forwards it to the wrapped scheduler",
    "torch.optim.lr_scheduler.LRScheduler._is_initial": "likewise (the initial step of a scheduler)",
    # -- torch.distributed ----------------------------------------------------------------------
    "torch.distributed.ProcessGroup._get_backend": "a process group's backend for a device (gloo's, nccl's): its "
    "options hold the group's timeout, which no public function reads",
    "torch.distributed.ProcessGroupGloo.Options._timeout": "the timeout a process group was made with "
    "(init_process_group(timeout=...)): dispatch's own process group takes the default group's, and its waits "
    "give up after it",
    # -- torchdata ----------------------------------------------------------------------------
    "torchdata.stateful_dataloader.StatefulDataLoader._iterator": "as DataLoader._iterator, for loaders backed by "
    "a StatefulDataLoader",
    "torchdata.stateful_dataloader.StatefulDataLoader._get_iterator": "as DataLoader._get_iterator (its own "
    "override, compared by identity)",
    "torchdata.nodes.PinMemory._pin_memory_device": "the device a PinMemory node pins for (None: the default): "
    "a torchdata.nodes graph prepared by shardplug rebuilds its PinMemory on this process's part with it",
    # -- datasets (duck typed: never imported by shardplug) -----------------------------------
    "datasets.IterableDataset._ex_iterable": "the chain of example iterables of a Hugging Face stream: tells one "
    "and its buffer shuffle",
    "datasets.IterableDataset._distributed": "the node split split_dataset_by_node recorded (rank, world_size)",
    "datasets.IterableDataset._shuffling": "the shuffle of a stream of datasets < 3 (read only when present)",
    # -- MosaicML streaming ---------------------------------------------------------------------
    "streaming.StreamingDataset._parallel_rank_world": "the ranks the stream splits itself over (its rank and "
    "num_ranks, replication applied): a stream split by rank is this process's part",
    # -- Ray Train (duck typed: never imported by shardplug) ------------------------------------
    "ray.train.torch.train_loop_utils._WrappedDataLoader._dataloader": "the DataLoader that Ray Train's "
    "prepare_data_loader wraps in a loader that is its own iterator: shardplug prepares the DataLoader in its place",
}
"""Every private name above, with its use (``tests/api/test_compat.py`` fails when a library drops one)."""


def library_of(name: str) -> str:
    """The distribution a name of :data:`PRIVATES` belongs to (its first dotted part, or the
    distribution that installs that package).

    Example::

        >>> library_of("torch.amp.grad_scaler.OptState"), library_of("streaming.StreamingDataset.x")
        ('torch', 'mosaicml-streaming')
    """
    package = name.split(".", 1)[0]
    return _DISTRIBUTIONS.get(package, package)


_DISTRIBUTIONS = {"streaming": "mosaicml-streaming"}
"""Import packages whose distribution has another name."""


# -- DataLoader ---------------------------------------------------------------------------------
_ITERATOR = "_iterator"


def forget_iterator(loader: DataLoader[Any]) -> None:
    """Drop the persistent iterator of ``loader`` (a ``DataLoader``): its next pass starts new workers."""
    object.__setattr__(loader, _ITERATOR, None)


def without_iterator(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a copy of a loader's ``__dict__``) with no open iterator in it (returned for chaining)."""
    state[_ITERATOR] = None
    return state


def is_dataloader_internal(name: str) -> bool:
    """Whether the instance attribute ``name`` is ``DataLoader``'s own bookkeeping, never copied between
    loaders (the persistent iterator, the name-mangled ``__init__`` state)."""
    return name == _ITERATOR or name.startswith("_DataLoader__")


def get_iterator_method(obj: Any) -> Callable[..., Any] | None:
    """The ``_get_iterator`` of a loader class (or ``None``), to compare by identity."""
    return getattr(obj, "_get_iterator", None)


def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was built with (``None``: one draw per element)."""
    return cast("int | None", sampler._num_samples)


# -- GradScaler ---------------------------------------------------------------------------------
_SCALER_RECORDS = "_per_optimizer_states"


def _scaler_records(scaler: Any) -> dict[int, dict[str, Any]]:
    """The scaler's per-optimizer records of this iteration (keyed by ``id(optimizer)``; empty without a scaler).

    Read only here: it is a ``defaultdict`` that makes a record on a lookup by ``[]``, so it is looked up with
    ``get`` and ``in`` only."""
    records = getattr(scaler, _SCALER_RECORDS, None)
    return records if records is not None else {}


def scaler_stage(scaler: Any, optimizer: Any) -> Any:
    """The stage (:func:`opt_state`: ``READY``, ``UNSCALED``, ``STEPPED``) of ``scaler``'s record of this
    iteration for ``optimizer``; ``None`` when it has none (none since the last ``update()``). Makes no record."""
    record = _scaler_records(scaler).get(id(optimizer))
    return None if record is None else record["stage"]


def scaler_found_inf(scaler: Any, optimizer: Any) -> dict[Any, Any]:
    """The inf/NaN flags (one tensor per device) ``scaler`` found in ``optimizer``'s gradients in this
    iteration; empty when it has not checked them (no ``unscale_`` or ``step`` since the last ``update()``)."""
    record = _scaler_records(scaler).get(id(optimizer))
    return dict((record or {}).get("found_inf_per_device") or {})


def move_scaler_record(scaler: Any, source: Any, target: Any) -> None:
    """Give ``target`` the record ``scaler`` made for ``source`` in this iteration, if any (``source`` has none
    after it)."""
    records = _scaler_records(scaler)
    if id(source) in records:
        records[id(target)] = records.pop(id(source))


def forget_scaler_record(scaler: Any, optimizer: Any) -> bool:
    """Drop ``scaler``'s record of this iteration for ``optimizer``; True if there was one."""
    return _scaler_records(scaler).pop(id(optimizer), None) is not None


def opt_state() -> Any:
    """``torch.amp.grad_scaler.OptState``: the stages of a record (``READY``, ``UNSCALED``, ``STEPPED``)."""
    from torch.amp.grad_scaler import OptState

    return OptState


def step_inf_flag(optimizer: Any) -> Any:
    """The inf/NaN flag ``GradScaler.step`` sets on a fused optimizer during its step (else ``None``)."""
    return getattr(optimizer, "found_inf", None)


# -- Optimizer ----------------------------------------------------------------------------------
OPTIMIZER_HOOK_REGISTRIES: dict[str, str] = {
    "step_pre": "_optimizer_step_pre_hooks",
    "step_post": "_optimizer_step_post_hooks",
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}
"""The hook registries of an ``Optimizer``, by kind."""


def optimizer_hooks(optimizer: Any, kind: str) -> list[Callable[..., Any]]:
    """The hooks of ``kind`` (a key of :data:`OPTIMIZER_HOOK_REGISTRIES`) registered on ``optimizer``, in order."""
    return list(getattr(optimizer, OPTIMIZER_HOOK_REGISTRIES[kind]).values())


def restore_hook_registries(optimizer: Any) -> None:
    """Give an unpickled optimizer empty hook registries where it has none (hooks are never pickled)."""
    from collections import OrderedDict

    for attribute in OPTIMIZER_HOOK_REGISTRIES.values():
        optimizer.__dict__.setdefault(attribute, OrderedDict())


def patch_step_function(optimizer: Any) -> None:
    """What ``Optimizer.__setstate__`` does after unpickling: re-wrap ``step`` (profiling, global hooks)."""
    optimizer._patch_step_function()


_Class = TypeVar("_Class", bound=type)
_Function = TypeVar("_Function", bound=Callable[..., Any])


def steps_as_plain_optimizer(cls: _Class) -> _Class:
    """Class decorator: ``GradScaler.step`` treats instances as plain optimizers (no fused path)."""
    cls._step_supports_amp_scaling = False  # type: ignore[attr-defined]
    return cls


def runs_own_step_hooks(step: _Function) -> _Function:
    """Mark a ``step`` that runs the step hooks itself: ``Optimizer`` then does not wrap it."""
    step.hooked = True  # type: ignore[attr-defined]
    return step


# -- LRScheduler ---------------------------------------------------------------------------------
LR_SCHEDULER_FLAGS: tuple[str, ...] = ("_get_lr_called_within_step", "_is_initial")
"""Flags ``LRScheduler`` defines on its class and reads and sets on itself."""


def _forwarded_flag(name: str) -> property:
    def get(self: Any) -> bool:
        return getattr(self.scheduler, name, False)

    def put(self: Any, value: bool) -> None:
        setattr(self.scheduler, name, value)

    return property(get, put, doc=f"The wrapped scheduler's ``{name}``.")


def forwards_scheduler_flags(cls: _Class) -> _Class:
    """Class decorator for a scheduler wrapper (an ``LRScheduler`` with a ``scheduler`` attribute):
    the flags of :data:`LR_SCHEDULER_FLAGS` read and set the wrapped scheduler's own."""
    for name in LR_SCHEDULER_FLAGS:
        setattr(cls, name, _forwarded_flag(name))
    return cls


# -- torchdata.nodes ----------------------------------------------------------------------------
def pin_memory_device(node: Any) -> str | None:
    """The device a ``torchdata.nodes.PinMemory`` node pins for (``None``: the default one); torchdata keeps
    the ``pin_memory_device`` argument only privately."""
    return cast("str | None", node._pin_memory_device)


# -- datasets -----------------------------------------------------------------------------------
def hf_example_iterable(dataset: Any) -> Any:
    """The outermost example iterable of a Hugging Face stream (``None`` for anything else)."""
    return getattr(dataset, "_ex_iterable", None)


def hf_node_split(dataset: Any) -> Any:
    """The node split ``split_dataset_by_node`` recorded on a Hugging Face stream (``None``: none)."""
    return getattr(dataset, "_distributed", None)


def hf_legacy_shuffling(dataset: Any) -> Any:
    """The shuffle of a Hugging Face stream of ``datasets < 3`` (``None``: none, or a newer release)."""
    return getattr(dataset, "_shuffling", None)


def streaming_rank_world(dataset: Any) -> Any:
    """The rank world a MosaicML ``streaming.StreamingDataset`` splits itself over (``rank``,
    ``num_ranks``), or ``None`` for any other object."""
    world = getattr(dataset, "_parallel_rank_world", None)
    return world if hasattr(world, "num_ranks") and hasattr(world, "rank") else None


def wrapped_dataloader(loader: Any) -> Any:
    """The loader a ``DataLoader`` that is its own iterator wraps (Ray Train's ``prepare_data_loader``'s), or
    ``None`` for any other loader."""
    return getattr(loader, "_dataloader", None)


# -- torch.distributed --------------------------------------------------------------------------
def group_timeout(group: Any, device_type: str) -> timedelta | None:
    """The timeout of process group ``group`` (``init_process_group(timeout=...)`` for the default
    group) as its backend for ``device_type`` (``"cpu"``, ``"cuda"``) has it, or ``None`` where it
    cannot be read."""
    try:
        timeout = group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
    return timeout if isinstance(timeout, timedelta) else None
