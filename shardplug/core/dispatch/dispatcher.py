"""``DataLoaderDispatcher``: its options, and the wiring of its plan, sender, receiver and wire."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from shardplug.core._internal import compat
from shardplug.core._internal.collectives import (
    broadcast_object,
    communication_device,
    global_rank,
    require_group,
    world_size,
)
from shardplug.core._internal.rows import slice_rows
from shardplug.core._internal.topology import resolve_data_topology
from shardplug.core.config import ShardplugConfig
from shardplug.core.dispatch.budget_steps import BudgetDispatchPlan
from shardplug.core.dispatch.dispatch_plan import DispatchPlan
from shardplug.core.dispatch.receiver import StepReceiver
from shardplug.core.dispatch.sender import SliceFn, StepReader, StepSender, local_steps
from shardplug.core.dispatch.shm import CollateIntoRing
from shardplug.core.dispatch.wire import Wire, dispatch_group
from shardplug.core.dispatch.wire_protocol import DispatchStats
from shardplug.core.loader.prepared import DataLoaderShard, LoaderOptions, PreparedDataLoader
from shardplug.core.resume.stateful import stateful_dataloader_class
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import ShardPlan
from shardplug.core.sharding.token_budget import TokenBudgetPlan

__all__ = ["DataLoaderDispatcher", "DispatchOptions", "check_slice_fn"]


@dataclass(frozen=True)
class DispatchOptions(LoaderOptions):
    """A dispatcher's options: a prepared loader's (:class:`~shardplug.core.loader.prepared.LoaderOptions`, its
    ``plan`` being process 0's reading of the data) and how the steps are shared out: the ``layout``
    (``prepare_data_loader``'s), else one built from ``split_batches``, ``even_batches`` and the processes
    (``num_processes`` / ``process_index`` / ``torch_device_mesh``, ``None``: the running job's), and the
    ``slice_fn`` that cuts a process's rows."""

    split_batches: bool = ShardplugConfig.split_batches
    slice_fn: SliceFn | None = ShardplugConfig.slice_fn_for_dispatch
    torch_device_mesh: Any = None
    num_processes: int | None = None
    process_index: int | None = None
    even_batches: bool = ShardplugConfig.even_batches
    layout: ShardLayout | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_slice_fn(self.slice_fn)

    @classmethod
    def from_layout(
        cls, layout: ShardLayout, loader: LoaderOptions, slice_fn: SliceFn | None = None, torch_device_mesh: Any = None
    ) -> DispatchOptions:
        """The options of a dispatcher sharing its batches by ``layout`` (``prepare_data_loader``'s), with the
        ``loader`` options of a prepared loader."""
        return cls(
            **_loader_fields(loader),
            split_batches=layout.split_batches,
            slice_fn=slice_fn,
            torch_device_mesh=torch_device_mesh,
            num_processes=layout.num_processes,
            process_index=layout.process_index,
            even_batches=layout.even_batches,
            layout=layout,
        )


def _loader_fields(options: LoaderOptions) -> dict[str, Any]:
    """The fields of a prepared loader's options (without a dispatcher's)."""
    return {field.name: getattr(options, field.name) for field in dataclasses.fields(LoaderOptions) if field.init}


def check_slice_fn(slice_fn: Any) -> None:
    """Refuse a ``slice_fn_for_dispatch`` that cannot be called (it is only called at the first batch)."""
    if slice_fn is not None and not callable(slice_fn):
        raise TypeError(
            f"slice_fn_for_dispatch={slice_fn!r} is not callable; pass a function (batch, rows: slice, process_index, "
            "num_processes) -> that process's part of the batch, or None to cut every tensor along dim 0"
        )


class DataLoaderDispatcher(DataLoaderShard):
    """Process 0 reads every batch; each process receives only its own rows (scatter).

    Per step process 0 takes one batch (``split_batches=True``) or ``N`` consecutive batches
    concatenated along dim 0, and process ``i`` receives rows ``[i*k, (i+1)*k)`` (a
    ``TokenBudgetBatchSampler``'s step: process ``i`` receives micro-batch ``i`` of the plan whole, see
    :mod:`~shardplug.core.dispatch.budget_steps`).  A final
    step whose rows do not divide by ``N`` is completed with rows of the first step.  Shapes may
    change from step to step, and between the batches of one step (each process then receives its
    own batch whole: a collate that pads each batch to its own longest row).
    Non-tensor leaves are delivered (:mod:`shardplug.core._internal.rows`: per-row lists cut, other values
    kept).  A batch that cannot be dispatched is a :class:`DispatchError` raised on every process,
    never a hang.

    Per step process 0 broadcasts a message of a few integers on the loader's own process group
    (same shapes as before / new row count / new structure / no step / error / pass closed early,
    with its pass number, whether the step is the pass's last, its ring slot, where its padding
    begins and, for a token budget's step, a fingerprint of its samples); the pickled
    structure is sent only when it changes (once per pass for constant shapes): the wire protocol
    is :mod:`shardplug.core.dispatch.wire_protocol`.  Process 0 reads one step ahead, so the end of a
    pass is its own on every process; a pass it leaves early (``break``, an exception, garbage
    collection, a new ``iter()``) is closed with a message, so the others stop after the same
    step.  Process 0 hands out its own rows while the others' are still being sent.  Processes on
    process 0's host get their rows through shared memory (:mod:`shardplug.core.dispatch.shm`)
    and count their receipts there; the others get them, and send receipts, through the process
    group.  ``dispatch_stats`` counts steps, headers and bytes.

    Example (2 processes)::

        loader = DataLoaderDispatcher(dataset, batch_size=8, split_batches=True)
        for batch in loader:  # 4 rows here, 4 on the other process
            ...
    """

    plan: DispatchPlan  # process 0's global batches, shared out by steps (see _plan_for)

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = ShardplugConfig.split_batches,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = ShardplugConfig.use_stateful_dataloader,
        slice_fn_for_dispatch: SliceFn | None = ShardplugConfig.slice_fn_for_dispatch,
        torch_device_mesh: Any = None,
        device: str | torch.device | None = None,
        rng_types: Iterable[str] | None = ShardplugConfig.rng_types,
        synchronized_generator: torch.Generator | None = None,
        non_blocking: bool = ShardplugConfig.non_blocking,
        num_processes: int | None = None,
        process_index: int | None = None,
        even_batches: bool = ShardplugConfig.even_batches,
        **dataloader_kwargs: Any,
    ) -> None:
        self._dispatch_options = DispatchOptions(
            split_batches=split_batches,
            slice_fn=slice_fn_for_dispatch,
            torch_device_mesh=torch_device_mesh,
            num_processes=num_processes,
            process_index=process_index,
            even_batches=even_batches,
        )
        super().__init__(
            dataset,
            device=device,
            rng_types=rng_types,
            synchronized_generator=synchronized_generator,
            skip_batches=skip_batches,
            use_stateful_dataloader=use_stateful_dataloader,
            non_blocking=non_blocking,
            **dataloader_kwargs,
        )

    def _setup(self, options: LoaderOptions) -> None:
        if not isinstance(options, DispatchOptions):  # the constructor's: with its own dispatch keywords
            options = dataclasses.replace(self._dispatch_options, **_loader_fields(options))
        options = dataclasses.replace(options, prefetch_depth=0)  # each step's rows arrive as the step comes
        self._dispatch_options = options
        super()._setup(options)
        self._collate = self._collate_into_rings()

    def _plan_for(self, options: LoaderOptions) -> ShardPlan:
        """The steps of process 0's global batches (``options.plan``, else this loader's own), shared out by
        the layout (``prepare_data_loader``'s, else one of this loader's batch size and options)."""
        source = super()._plan_for(options)  # process 0's global batches: a shard of the user's batches, or a stream
        dispatch = self._dispatch_options
        self.split_batches = dispatch.split_batches
        self.slice_fn: SliceFn = dispatch.slice_fn or slice_rows
        self.dispatch_stats = DispatchStats()
        num_processes, process_index = resolve_topology(dispatch)
        layout = dispatch.layout
        if layout is None:
            layout = ShardLayout.for_batches(
                self.batch_size,
                num_processes,
                process_index,
                self.split_batches,
                dispatch.even_batches,
                drop_last=bool(self.drop_last),
            )
        self.num_processes, self.process_index = num_processes, process_index
        # All dispatch traffic goes through a process group of its own: a message a process has not
        # read yet (the close of a pass it left early) can never meet the user's own collectives.
        device_type = communication_device().type
        self._wire = Wire(dispatch_group(device_type) if world_size() > 1 else None, device_type)
        self._wire.rings.targets = self._same_host_processes()
        if isinstance(source, TokenBudgetPlan):  # every process holds the plan of every process's micro-batches
            return BudgetDispatchPlan(layout, source)
        try:
            length = source.num_batches(0)
        except TypeError:  # a batch sampler without __len__
            length = None
        if self._wire.group is not None:  # process 0 reads the data: its length is everybody's
            mine = length if global_rank() == 0 else None
            length = broadcast_object(mine, group=self._wire.group, what="the number of batches (dispatch)")
        return DispatchPlan(layout, length, source if source.unit == "global_batches" else None)

    def _collate_into_rings(self) -> CollateIntoRing | None:
        """Process 0: a ``default_collate`` that stacks the other processes' batches straight into
        their ring slots (one copy less per step), where the batches are process ``j``'s rows as
        collated: ``default_collate``, no workers (collation happens in this process, one batch per
        fetch), whole batches per process (neither ``split_batches`` nor a ``slice_fn``), and the
        DataLoader's own iterator (no look-ahead that could hand back another batch)."""
        usable = (
            global_rank() == 0
            and bool(self._wire.rings.targets)
            and self.num_workers == 0
            and self.collate_fn is default_collate
            and not self.split_batches
            and self.slice_fn is slice_rows
            and _plain_iteration(type(self), self.use_stateful_dataloader)
        )
        if not usable:
            return None
        collate = CollateIntoRing()
        object.__setattr__(self, "collate_fn", collate)  # without a target it is default_collate
        return collate

    shared_memory: bool | None = None
    """Processes on process 0's host receive their rows through shared memory (a ring in
    ``/dev/shm``); the process group carries the control messages only. ``None``: whenever
    possible (a CPU process group, a writable ``/dev/shm``, not ``SHARDPLUG_DISPATCH_SHM=0``);
    ``False``: always through the process group. Read when the loader is built."""

    def _same_host_processes(self) -> frozenset[int]:
        """The processes other than 0 that share process 0's host and read its rings (see
        :meth:`Wire.find_host_processes`: every process also learns the others of its own host)."""
        if self._wire.group is None:
            return frozenset()
        wanted = self.shared_memory
        if wanted is None:
            wanted = os.environ.get("SHARDPLUG_DISPATCH_SHM", "1") != "0"
        wanted = wanted and communication_device().type == "cpu"
        return self._wire.find_host_processes(self.process_index, bool(wanted))

    def __reduce_ex__(self, protocol: Any) -> Any:
        rebuild, args, state = super().__reduce_ex__(protocol)
        # the process group and the open pass belong to this process (a copy cannot dispatch)
        state.update(_wire=Wire(), _collate=None)
        if isinstance(state.get("collate_fn"), CollateIntoRing):
            state["collate_fn"] = default_collate
        return rebuild, args, state

    @property
    def remainder(self) -> int:
        """Real samples in the last step (0 when it is full; -1 when unknown): known from the data's length
        before the pass (see :attr:`PreparedDataLoader.remainder`), else -- a stream without ``len()`` -- from
        the step itself once the last one is handed out (process 0 read it, every process was told), as the
        reference's dispatcher does."""
        known = super().remainder
        current = self.cursor.now
        step, total = current.record.step_real, self.total_batch_size
        if known >= 0 or not current.end_of_dataloader or step is None or not total:
            return known
        return step[0] % total

    source_marks_last = True  # _receive yields (batch, last): the end of the pass is process 0's, on every process

    overlap_reads: bool | None = None
    """Process 0 reads the next step while the current one is sent: ``None`` decides by the cores
    available (see :func:`~shardplug.core.dispatch.sender.overlaps_reads`); ``True`` / ``False`` force it."""

    def inner_batches(self, discard: int) -> Iterator[Any]:
        return self._receive(discard)

    def _receive(self, skip: int) -> Iterator[Any]:
        """This pass's steps as ``(batch, last)``: process 0 reads and sends, everybody receives.

        Every message carries process 0's pass number. Process 0 closes a pass it leaves early
        (``break``, an exception, garbage collection, a new ``iter()``) with a close message, so the
        others end that pass after the same step; a process that left a pass early itself drops the
        rest of that pass's messages when its next pass starts.
        """
        wire = self._wire
        wire.passes_started += 1
        if world_size() == 1:
            return local_steps(self._step_reader(skip), self.dispatch_stats)
        if global_rank() == 0:
            previous = wire.sending() if wire.sending is not None else None
            if previous is not None:
                previous.close()  # a pass still open: the others learn it ended here
            wire.check_group()
            sender = StepSender(
                self._step_reader(skip),
                self.dispatch_stats,
                wire.passes_started,
                communication_device(),
                self.overlap_reads,
                self.shuffles.generator,
            )
            steps = sender.steps()
            wire.sending = weakref.ref(steps)  # weak: an abandoned pass is closed by the garbage collector
            return steps
        wire.check_group()
        receiver = StepReceiver(
            wire,
            self.dispatch_stats,
            self.process_index,
            wire.passes_started,
            communication_device(),
            self.cursor.now.record,
            self.shuffles.generator,
        )
        return receiver.steps()

    def _step_reader(self, discard: int) -> StepReader:
        """Process 0: the reader of this pass's steps, after ``discard`` global batches read and dropped.

        With the default ``slice_fn`` ``N`` full batches of equal rows are not concatenated: batch
        ``j`` is exactly process ``j``'s rows (and, with :meth:`_collate_into_rings`, it is collated
        straight into ``j``'s ring slot).
        """
        load: Callable[[list[int]], Any] | None = None
        if not isinstance(self.dataset, IterableDataset):  # padding of a pass begun mid-epoch: by index
            load = lambda indices: self.collate_fn([self.dataset[i] for i in indices])  # noqa: E731
        return StepReader(
            self.plan,
            self._wire,
            partial(super().inner_batches, discard),
            self.slice_fn,
            uncut=not self.split_batches and self.slice_fn is slice_rows,
            collate=self._collate,
            record=self.cursor.now.record,
            load=load,
        )

    def close(self) -> None:
        """Release the shared-memory rings of this loader (also done when it is garbage collected,
        with the copies ``skip_first_batches`` made of it: they share the rings)."""
        self._wire.close()


def resolve_topology(options: DispatchOptions) -> tuple[int, int]:
    """``(num_processes, process_index)`` of a dispatcher: one process per data shard."""
    num_processes, process_index = resolve_data_topology(
        options.num_processes, options.process_index, options.torch_device_mesh
    )
    require_group(
        num_processes,
        process_index,
        "every batch (process 0 reads it and sends each process its rows)",
        "process 0 could not send the other processes their rows",
        ", or pass dispatch_batches=False (each process reads the data and keeps its own rows)",
    )
    if num_processes != world_size():
        raise ValueError(
            f"DataLoaderDispatcher needs one process per data shard: num_processes={num_processes} but "
            f"the process group has {world_size()} processes; use DataLoaderShard for other layouts"
        )
    return num_processes, process_index


def _plain_iteration(cls: type, stateful: bool) -> bool:
    """Whether a prepared loader class reads its batches through the iteration of ``DataLoader`` (or
    ``StatefulDataLoader``) itself: one collation per batch handed back, in order, no look-ahead
    (``__iter__`` and ``_get_iterator`` not overridden by a subclass)."""
    after = super(PreparedDataLoader, cls)
    known: list[type[DataLoader[Any]]] = [stateful_dataloader_class()] if stateful else [DataLoader]
    return any(
        getattr(after, "__iter__", None) is base.__iter__
        and compat.get_iterator_method(after) is compat.get_iterator_method(base)
        for base in known
    )
