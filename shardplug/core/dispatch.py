"""Dispatch mode: process 0 reads the data and scatters each process its own rows."""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate

from .collectives import broadcast_object, communication_device, global_rank, world_size
from .config import renamed_option
from .layout import ShardLayout
from .loaders import DataLoaderShard, PreparedDataLoader, stateful_dataloader_class
from .plan import DispatchPlan, ShardPlan
from .rows import OBJECT, batch_rows, concatenate_rows, describe_path, flatten, leaf_spec, slice_rows, take_rows, unflatten
from .shm import CollateIntoRing, ReceiptCounter, RingReader, SharedRing, ring_bytes, shared_memory_dir
from .topology import resolve_data_topology

__all__ = ["DataLoaderDispatcher", "DispatchError", "DispatchOptions", "DispatchStats", "slice_rows", "concatenate_rows"]

logger = logging.getLogger(__name__)

SliceFn = Callable[[Any, slice, int, int], Any]


class DispatchError(RuntimeError):
    """Raised on every process when process 0 cannot dispatch a batch."""


@dataclass
class DispatchStats:
    """What a dispatcher has moved so far (all passes together).

    ``steps``: batches handed out; ``headers``: batch structures pickled and broadcast (process
    0) or received (the others) -- once per pass while the structure and shapes stay the same;
    ``bytes_sent``: bytes of the other processes' rows process 0 passed to scatter;
    ``bytes_received``: bytes of rows this process received through the process group (not on
    process 0); ``bytes_shared``: bytes of rows process 0 wrote into shared memory for the
    processes of its host (not counted in ``bytes_sent``); ``bytes_collated_in_place``: those of
    ``bytes_shared`` that were collated straight into shared memory (no copy).
    """

    steps: int = 0
    headers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_shared: int = 0
    bytes_collated_in_place: int = 0

    def snapshot(self) -> dict[str, int]:
        """The counters now, as a plain dict."""
        return asdict(self)

    def since(self, before: dict[str, int]) -> dict[str, int]:
        """What was counted after ``before`` (a :meth:`snapshot`)."""
        return {name: value - before[name] for name, value in asdict(self).items()}


_FIX = "pass split_batches=True (one batch per step, no concatenation) or dispatch_batches=False"


def _check_step(group: list[Any]) -> list[int]:
    """The rows of each batch of one step; a ``DispatchError`` when they cannot be dispatched
    together (different structures, or shapes beyond dim 0 that differ within the step)."""
    rows, first = [], None
    for batch in group:
        leaves, skeleton = flatten(batch)
        count = batch_rows(leaves)
        if count is None:
            raise DispatchError(
                "dispatch_batches=True cuts batches along their rows, but this batch has no tensor with a batch "
                "dimension and no list of values to cut; give it one, or pass dispatch_batches=False"
            )
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != count:
                raise DispatchError(
                    f"dispatch_batches=True needs every tensor of a batch to have the same number of rows, but "
                    f"{describe_path(skeleton, k)} has {leaf.shape[0]} and the batch {count}; pass dispatch_batches=False"
                )
        signature = (skeleton, [leaf_spec(leaf)[1][1:] if leaf_spec(leaf)[1] else None for leaf in leaves])
        if first is None:
            first = signature
        elif signature != first:
            raise DispatchError(
                "dispatch_batches=True joins the batches of one step, but they differ in structure or in shape beyond "
                f"dim 0 within the step ({first[1]} vs {signature[1]}); {_FIX}"
            )
        rows.append(count)
    return rows


@dataclass(frozen=True)
class DispatchOptions:
    """What a dispatcher needs beyond a loader's settings (see :class:`DataLoaderDispatcher`)."""

    split_batches: bool = False
    slice_fn: Optional[SliceFn] = None
    torch_device_mesh: Any = None
    num_processes: Optional[int] = None
    process_index: Optional[int] = None
    even_batches: bool = True

    def __post_init__(self) -> None:
        check_slice_fn(self.slice_fn)


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
    concatenated along dim 0, and process ``i`` receives rows ``[i*k, (i+1)*k)``.  A final
    step whose rows do not divide by ``N`` is completed with rows of the first step.  Shapes may
    change from step to step; the batches joined into one step must agree beyond dim 0.
    Non-tensor leaves are delivered (:mod:`shardplug.core.rows`: per-row lists cut, other values
    kept).  A batch that cannot be dispatched is a :class:`DispatchError` raised on every process,
    never a hang.

    Per step process 0 broadcasts a five-integer message on the loader's own process group
    (same shapes as before / new row count / new structure / no step / error / pass closed early,
    with its pass number, whether the step is the pass's last and its ring slot); the pickled
    structure is sent only when it changes (once per pass for constant shapes).  Process 0 reads
    one step ahead, so the end of a pass is its own on every process; a pass it leaves early
    (``break``, an exception, garbage collection, a new ``iter()``) is closed with a message, so
    the others stop after the same step.  Process 0 hands out its own rows while the others' are
    still being sent.  Processes on process 0's host get their rows through shared memory
    (:mod:`shardplug.core.shm`) and count their receipts there; the others get them, and send
    receipts, through the process group.  ``dispatch_stats`` counts steps, headers and bytes.

    Example (2 processes)::

        loader = DataLoaderDispatcher(dataset, batch_size=8, split_batches=True)
        for batch in loader:  # 4 rows here, 4 on the other process
            ...
    """

    def __init__(
        self,
        dataset: Any,
        split_batches: bool = False,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        slice_fn_for_dispatch: Optional[SliceFn] = None,
        torch_device_mesh: Any = None,
        device: Union[str, torch.device, None] = None,
        rng_types: Optional[Iterable[str]] = None,
        synchronized_generator: Optional[torch.Generator] = None,
        non_blocking: bool = False,
        num_processes: Optional[int] = None,
        process_index: Optional[int] = None,
        even_batches: bool = True,
        slice_fn: Optional[SliceFn] = None,
        **dataloader_kwargs: Any,
    ) -> None:
        slice_fn = renamed_option("DataLoaderDispatcher", "slice_fn", slice_fn, "slice_fn_for_dispatch", slice_fn_for_dispatch)
        super(DataLoaderShard, self).__init__(dataset, **dataloader_kwargs)
        options = DispatchOptions(split_batches, slice_fn, torch_device_mesh, num_processes, process_index, even_batches)
        self._finish_init(device, rng_types, synchronized_generator, skip_batches, non_blocking, dispatch=options)

    def _finish_init(  # type: ignore[override]
        self,
        device: Union[str, torch.device, None],
        rng_types: Optional[Iterable[str]],
        synchronized_generator: Optional[torch.Generator],
        skip_batches: int,
        non_blocking: bool,
        plan: Optional[ShardPlan] = None,
        dispatch: Optional[DispatchOptions] = None,
    ) -> None:
        super()._finish_init(device, rng_types, synchronized_generator, skip_batches, non_blocking, plan)
        options = dispatch if dispatch is not None else DispatchOptions()
        self.split_batches = options.split_batches
        self.slice_fn: SliceFn = options.slice_fn or slice_rows
        self.dispatch_stats = DispatchStats()
        self.num_processes, self.process_index = resolve_data_topology(
            options.num_processes, options.process_index, options.torch_device_mesh
        )
        if self.num_processes != world_size():
            raise ValueError(
                f"DataLoaderDispatcher needs one process per data shard: num_processes={self.num_processes} but "
                f"the process group has {world_size()} processes; use DataLoaderShard for other layouts"
            )
        layout = ShardLayout.for_batches(
            self.batch_size, self.num_processes, self.process_index, self.split_batches, options.even_batches,
            drop_last=bool(self.drop_last),
        )
        source = self.plan  # process 0's global batches: a shard of the user's batches, or the stream's own
        try:
            length = source.num_batches(0)
        except TypeError:  # a batch sampler without __len__
            length = None
        # All dispatch traffic goes through a process group of its own: a message a process has not
        # read yet (the close of a pass it left early) can never meet the user's own collectives.
        self._wire = _Wire(dist.new_group() if world_size() > 1 else None)
        if self._wire.group is not None:  # process 0 reads the data: its length is everybody's
            length = broadcast_object(length if global_rank() == 0 else None, group=self._wire.group)
        self.plan = DispatchPlan(layout, length, source if source.unit == "global_batches" else None)
        self._wire.shm_targets = self._same_host_processes()
        self._collate = self._collate_into_rings()

    def _collate_into_rings(self) -> Optional[CollateIntoRing]:
        """Process 0: a ``default_collate`` that stacks the other processes' batches straight into
        their ring slots (one copy less per step), where the batches are process ``j``'s rows as
        collated: ``default_collate``, no workers (collation happens in this process, one batch per
        fetch), whole batches per process (neither ``split_batches`` nor a ``slice_fn``), and the
        DataLoader's own iterator (no look-ahead that could hand back another batch)."""
        usable = (
            global_rank() == 0 and bool(self._wire.shm_targets) and self.num_workers == 0
            and self.collate_fn is default_collate and not self.split_batches and self.slice_fn is slice_rows
            and _plain_iteration(type(self), self.use_stateful_dataloader)
        )
        if not usable:
            return None
        collate = CollateIntoRing()
        object.__setattr__(self, "collate_fn", collate)  # without a target it is default_collate
        return collate

    shared_memory: Optional[bool] = None
    """Processes on process 0's host receive their rows through shared memory (a ring in
    ``/dev/shm``); the process group carries the control messages only. ``None``: whenever
    possible (a CPU process group, a writable ``/dev/shm``, not ``SHARDPLUG_DISPATCH_SHM=0``);
    ``False``: always through the process group. Read when the loader is built."""

    def _same_host_processes(self) -> frozenset[int]:
        """The processes other than 0 that share process 0's host: they read its rings and count
        their receipts in shared memory (process 0 sees their process ids, to notice a death)."""
        if self._wire.group is None or _communication_device().type != "cpu":
            return frozenset()
        wanted = self.shared_memory
        if wanted is None:
            wanted = os.environ.get("SHARDPLUG_DISPATCH_SHM", "1") != "0"
        mine = (socket.gethostname(), bool(wanted) and shared_memory_dir() is not None, os.getpid())
        everyone: list[Any] = [None] * world_size()
        dist.all_gather_object(everyone, mine, group=self._wire.group)
        table: Optional[dict[int, str]] = None
        if global_rank() == 0:
            host, usable, _ = everyone[0]
            chosen = [j for j, (h, u, pid) in enumerate(everyone) if j and usable and (h, u) == (host, True)
                      and _process_alive(pid)]
            self._wire.pids = {j: everyone[j][2] for j in chosen}
            self._wire.counters = {j: ReceiptCounter() for j in chosen}
            table = {j: counter.path for j, counter in self._wire.counters.items()}
        table = broadcast_object(table, group=self._wire.group)
        if self.process_index in table:
            self._wire.counter = ReceiptCounter(table[self.process_index])
        return frozenset(table)

    def __reduce_ex__(self, protocol: Any) -> Any:
        rebuild, args, state = super().__reduce_ex__(protocol)
        # the process group and the open pass belong to this process (a copy cannot dispatch)
        state.update(_wire=_Wire(), _collate=None)
        if isinstance(state.get("collate_fn"), CollateIntoRing):
            state["collate_fn"] = default_collate
        return rebuild, args, state

    _source_marks_last = True  # _receive yields (batch, last): the end of the pass is process 0's, on every process

    overlap_reads: Optional[bool] = None
    """Process 0 reads the next step while the current one is sent: ``None`` decides by the cores
    available (see :meth:`_overlap_reads`); ``True`` / ``False`` force it."""

    @property
    def _batches_per_step(self) -> int:
        return self.plan.layout.batches_per_step

    def _inner_batches(self, discard: int) -> Iterator[Any]:
        return self._receive(discard)

    # -- process 0 --------------------------------------------------------------------------
    def _read_steps(self, discard: int) -> Iterator[tuple[Any, int]]:
        """Process 0: the global batch of each step (padded to a multiple of N rows), after
        ``discard`` global batches read and dropped, with the ring slot the step's rows will take.

        ``N`` full batches of equal rows are not concatenated: with the default ``slice_fn``
        batch ``j`` is exactly process ``j``'s rows, so the step is handed on already cut (and,
        with :meth:`_collate_into_rings`, batch ``j`` is collated straight into ``j``'s ring slot).
        """
        batches = super()._inner_batches(discard)
        per_step = self._batches_per_step
        uncut = not self.split_batches and self.slice_fn is slice_rows
        head: Optional[Any] = None  # a copy of the first rows: process 0 may change its own rows in place
        while True:
            slot = self._wire.slots_taken % _RING_SLOTS
            group = self._read_group(batches, per_step, slot)
            if not group:
                return
            self._wire.slots_taken += 1
            if self.drop_last and len(group) < per_step:
                return
            rows = set(_check_step(group))  # shapes may change from one step to the next
            if head is None:
                head = self._epoch_head_rows(group)
            if uncut and len(group) == per_step and len(rows) == 1:
                yield _Parts(group), slot
                continue
            step = group[0] if len(group) == 1 else concatenate_rows(group)
            yield (self._pad_rows(step, head) if self.plan.layout.even_batches else step), slot

    def _read_group(self, batches: Iterator[Any], count: int, slot: int) -> list[Any]:
        """Up to ``count`` batches: one step's, batch ``j`` collated into ``j``'s ring ``slot``
        where that is possible and the slot is free."""
        collate, group = self._collate, []
        try:
            for j in range(count):
                if collate is not None:
                    ring = self._wire.rings.get(j)
                    collate.target = (ring, slot) if ring is not None and self._slot_free(slot) else None
                batch = next(batches, _NO_BATCH)
                if batch is _NO_BATCH:
                    break
                group.append(batch)
        finally:
            if collate is not None:
                collate.target = None
        return group

    def _slot_free(self, slot: int) -> bool:
        """Process 0: whether every process of its host received the step last announced in ``slot``
        (nothing is waited for)."""
        step = self._wire.slot_steps[slot]
        return all(counter.count > step for counter in self._wire.counters.values())

    def _epoch_head_rows(self, group: list[Any]) -> Any:
        """A copy of the epoch's first N-1 rows, which padding cycles through.

        A pass that starts mid-epoch (a resume or a skip) loads them by index: the first rows it
        reads are not the epoch's.
        """
        record = self._pass.record
        if record.started_at > 0 and not isinstance(self.dataset, IterableDataset):
            indices = record.first_indices(max(self.num_processes - 1, 1))
            return self.collate_fn([self.dataset[i] for i in indices])
        return _head_rows(group, self.num_processes - 1)

    def _pad_rows(self, step: Any, head: Any) -> Any:
        """``step`` completed to a multiple of N rows with the first rows of the pass (wrapped)."""
        rows = batch_rows(flatten(step)[0]) or 0
        missing = -rows % self.num_processes
        if missing == 0:
            return step
        source_rows = batch_rows(flatten(head)[0]) or 1
        picks = torch.arange(missing) % source_rows
        return concatenate_rows([step, take_rows(head, picks)])

    # -- every process ----------------------------------------------------------------------
    def _receive(self, skip: int) -> Iterator[Any]:
        """This pass's steps as ``(batch, last)``: process 0 reads and sends, everybody receives.

        Every message carries process 0's pass number. Process 0 closes a pass it leaves early
        (``break``, an exception, garbage collection, a new ``iter()``) with a close message, so the
        others end that pass after the same step; a process that left a pass early itself drops the
        rest of that pass's messages when its next pass starts.
        """
        self._wire.passes_started += 1
        if world_size() == 1:
            return self._local_steps(skip)
        if global_rank() == 0:
            previous = self._wire.sending() if self._wire.sending is not None else None
            if previous is not None:
                previous.close()  # a pass still open: the others learn it ended here
            self._check_group()
            steps = self._send_steps(skip, self._wire.passes_started)
            self._wire.sending = weakref.ref(steps)  # weak: an abandoned pass is closed by the garbage collector
            return steps
        self._check_group()
        return self._receive_steps(self._wire.passes_started)

    def _check_group(self) -> None:
        if self._wire.group is None:
            raise RuntimeError(
                "this DataLoaderDispatcher is a copy (pickled) or was built without a process group: it cannot "
                "dispatch; build the loader in each process with prepare_data_loader"
            )

    def _local_steps(self, skip: int) -> Iterator[tuple[Any, bool]]:
        """Without a process group: process 0's own part of every step."""
        stats = self.dispatch_stats
        for (step, _), last in _flag_last(self._read_steps(skip)):
            parts = self._cut(step)
            stats.steps += 1
            yield parts[0], last

    def _send_steps(self, skip: int, pass_number: int) -> Iterator[tuple[Any, bool]]:
        """Process 0: read a step, tell the others what comes, send each its rows, hand out its own.

        Step ``t + 1`` is read before step ``t`` is announced, so the announcement says whether
        ``t`` is the pass's last. On CPU process groups (gloo) every other process's rows go out as
        asynchronous point-to-point sends -- a scatter without the copy of process 0's own rows --
        and process 0 hands out its own rows at once: the sends of step ``t`` proceed in the process
        group's threads while the caller works on its rows, and are waited for before step
        ``t + 2`` is read -- or, with :meth:`_overlap_reads`, while it is read and collated. On GPU
        process groups (nccl) each leaf is a synchronous ``scatter``.
        """
        stats = self.dispatch_stats
        comm_device = _communication_device()
        on_cpu = comm_device.type == "cpu"
        # Parts from the default slice_fn are disjoint row ranges, so process 0 may use its own
        # rows while the others' are still being sent; a custom slice_fn may share rows.
        overlap = on_cpu and self.slice_fn is slice_rows
        overlap_reads = overlap and self._overlap_reads()
        control = torch.zeros(_CONTROL_SIZE, dtype=torch.int64, device=comm_device)
        group = self._wire.group
        _wait(self._wire.closing)  # every process has read the close of the previous pass by now, or is about to
        steps = self._read_steps_cut(skip)
        sent: Optional[_Header] = None
        pending: list[Any] = []  # the rows in flight to other hosts
        announced: list[Any] = []  # the step messages in flight (not waited for before a read: nothing to copy)
        ended = False  # the others know where this pass ends (its last step, its end or an error)

        def read_next() -> Any:
            """The next step, ``None`` at the end, or the exception reading it raised."""
            if not overlap_reads:
                _wait(pending)
            try:
                return next(steps, None)
            except Exception as exc:  # reached every process when its turn comes, not before
                return exc
            finally:
                _wait(pending)

        read_failure: Optional[BaseException] = None  # the dataset's own error: raised as it is
        try:
            upcoming = read_next()
            if upcoming is None:
                ended = True
                _announce(control, _END, pass_number, group=group)
                return
            while upcoming is not None:
                if not isinstance(upcoming, Exception):
                    upcoming = self._await_receipts(upcoming)
                if isinstance(upcoming, Exception):
                    ended = True
                    if not isinstance(upcoming, DispatchError):
                        read_failure = upcoming
                    _announce(control, _ERROR, pass_number, group=group)
                    broadcast_object(f"{type(upcoming).__name__}: {upcoming}", group=group)
                    raise upcoming
                following = read_next()
                last = following is None
                own, parts, header, part_rows, slot = upcoming
                header = header + (self._ring_table(parts),)
                uneven = len(set(part_rows)) > 1  # even_batches=False: the last step's leftovers
                kind, rows = (_UNEVEN, 0) if uneven else _control_for(header, sent)
                for j in self._wire.shm_targets:  # this host: through shared memory, written before it is announced
                    self._write_ring(j, [leaf for leaf in parts[j] if leaf_spec(leaf)[0] != OBJECT], slot)
                self._wire.slot_steps[slot] = self._wire.steps_sent
                self._wire.steps_sent += 1
                while len(announced) > _RECEIPT_LAG:  # (receipts keep it short anyway)
                    announced.pop(0).wait()
                message = torch.empty_like(control) if on_cpu else control  # each in flight has its own
                announced.append(_announce(message, kind, pass_number, rows, last, slot, group=group, async_op=on_cpu))
                ended = last
                if kind == _HEADER:
                    broadcast_object(header, group=group)
                    stats.headers += 1
                elif kind == _UNEVEN:
                    broadcast_object((header, part_rows), group=group)
                    stats.headers += 1
                sent = None if uneven else header
                sources: list[torch.Tensor] = []
                if any(dtype == OBJECT for dtype, _ in header[1]):
                    dist.scatter_object_list([None], [_objects(leaves) for leaves in parts], src=0, group=group)
                for k, (dtype, shape) in enumerate(header[1]):
                    if dtype == OBJECT:
                        continue
                    sources = [leaves[k] for leaves in parts]
                    if on_cpu or uneven:  # point to point (scatter needs equal parts)
                        pending.extend(
                            dist.isend(source, dst=j, group=group, tag=_SEND_TAG)
                            for j, source in enumerate(sources)
                            if j != 0 and source.numel() and j not in self._wire.shm_targets
                        )
                    else:
                        out = torch.empty(shape, dtype=dtype, device=comm_device)
                        dist.scatter(out, sources, src=0, group=group)
                        sources[0] = out
                    stats.bytes_sent += sum(
                        t.numel() * t.element_size() for j, t in enumerate(sources)
                        if j and j not in self._wire.shm_targets
                    )
                    parts[0][k] = sources[0]
                stats.steps += 1
                self._expect_receipts(comm_device)
                if not overlap:
                    _wait(pending)
                if not (on_cpu or uneven):
                    own = unflatten(iter(parts[0]), header[0])
                del parts, upcoming, sources  # rows in flight stay referenced by their sends only
                yield own, last
                upcoming = following
        except RuntimeError as exc:
            if exc is read_failure or isinstance(exc, DispatchError):
                raise
            ended = True  # the process group failed: a process died or stopped receiving
            raise DispatchError(f"process 0 lost a process it dispatches to: {exc}") from exc
        finally:
            try:
                _wait(pending)
                _wait(announced)
                if not ended and dist.is_initialized():
                    # left early: the others stop after this step. Not waited for here: a process that
                    # left the pass early too reads it only when its next pass starts.
                    message = _announce(control.clone(), _CLOSE, pass_number, group=group, async_op=True)
                    self._wire.closing.append(message)
                    logger.debug("dispatch pass %d closed early by process 0", pass_number)
            except Exception:  # already failing or closing: the original error matters more
                logger.exception("the dispatcher could not tell the other processes that the pass ended")

    def _ring_table(self, parts: list[list[Any]]) -> tuple[tuple[int, str, int, int], ...]:
        """Process 0: the ring of every process of its host, each big enough for its part of this step
        (a ring outgrown is replaced; the table is part of the header, so a change is announced)."""
        table = []
        for j in sorted(self._wire.shm_targets):
            need = ring_bytes([leaf_spec(leaf) for leaf in parts[j] if leaf_spec(leaf)[0] != OBJECT])
            ring = self._wire.rings.get(j)
            if ring is None or not ring.fits(need):
                if ring is not None:
                    ring.close(remove=False)  # the others may still map it: they remove it
                size = max(need, 2 * ring.slot_bytes if ring is not None else 0, _MIN_SLOT_BYTES)
                ring = self._wire.rings[j] = SharedRing(_RING_SLOTS, size)
            table.append((j, ring.path, ring.slots, ring.slot_bytes))
        return tuple(table)

    def _write_ring(self, j: int, tensors: list[torch.Tensor], slot: int) -> None:
        """Process 0: this step's rows for process ``j`` into ``slot`` of its ring (free: see
        :meth:`_await_receipts`); rows collated there already stay where they are."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        copied = self._wire.rings[j].write(slot, tensors)
        self.dispatch_stats.bytes_shared += total
        self.dispatch_stats.bytes_collated_in_place += total - copied

    def _read_ring(self, rings: tuple[Any, ...], specs: list[tuple[Any, Any]], slot: int) -> Optional[list[torch.Tensor]]:
        """The other processes: this step's tensors from ``slot`` of process 0's ring for this
        process, or ``None`` when they come through the process group."""
        entry = next((e for e in rings if e[0] == self.process_index), None)
        if entry is None:
            return None
        _, path, slots, slot_bytes = entry
        if self._wire.reader is None or self._wire.reader.path != path:
            if self._wire.reader is not None:
                self._wire.reader.close()
            self._wire.reader = RingReader(path, slots, slot_bytes)
        return self._wire.reader.read(slot, [spec for spec in specs if spec[0] != OBJECT])

    def close(self) -> None:
        """Release the shared-memory rings of this loader (also done when it is garbage collected,
        with the copies ``skip_first_batches`` made of it: they share the rings)."""
        self._wire.close()

    def _expect_receipts(self, device: torch.device) -> None:
        """Process 0: after a step went out, wait (later) for the receipt of it of every process on
        another host (those of its host count theirs in shared memory)."""
        for j in range(1, self.num_processes):
            if j in self._wire.counters:
                continue
            receipt = torch.zeros(1, dtype=torch.int64, device=device)
            self._wire.acks.setdefault(j, []).append(dist.irecv(receipt, src=j, group=self._wire.group, tag=_ACK_TAG))

    def _await_receipts(self, upcoming: "_Step") -> Union["_Step", DispatchError]:
        """Process 0: hold step ``t`` until every process received step ``t - _RECEIPT_LAG``, and
        the processes of its host the step last announced in the slot ``t`` takes.

        It keeps process 0 at most that many steps ahead, and a process that died (or hangs) is
        noticed within a few steps: the others then get an error message instead of waiting. (The
        ring has ``_RECEIPT_LAG + 2`` slots, and process 0 reads one step ahead: the slot is free by
        then, and so it is when the step was read into it.)
        Returns ``upcoming``, or the ``DispatchError`` to raise everywhere.
        """
        for j, works in self._wire.acks.items():
            while len(works) > _RECEIPT_LAG:
                try:
                    works.pop(0).wait()
                except RuntimeError as exc:
                    return DispatchError(f"process {j} stopped receiving dispatched batches: {exc}")
        needed = max(self._wire.steps_sent - _RECEIPT_LAG, self._wire.slot_steps[upcoming.slot] + 1)
        for j in self._wire.counters:
            failure = self._wire.await_shared_receipts(j, needed)
            if failure is not None:
                return failure
        return upcoming

    def _send_receipt(self, device: torch.device) -> None:
        """The other processes: tell process 0 that a step arrived (counted in shared memory on its host)."""
        self._wire.steps_received += 1
        if self._wire.counter is not None:
            self._wire.counter.count = self._wire.steps_received  # after the step's rows were copied out
            return
        while len(self._wire.ack_sends) > _RECEIPT_LAG:
            self._wire.ack_sends.pop(0).wait()
        receipt = torch.ones(1, dtype=torch.int64, device=device)
        self._wire.ack_sends.append(dist.isend(receipt, dst=0, group=self._wire.group, tag=_ACK_TAG))

    def _overlap_reads(self) -> bool:
        """Whether process 0 reads step ``t + 1`` while step ``t`` is still being sent.

        ``overlap_reads`` when set; otherwise only with more than two CPU cores per process of the
        group on this machine: reading and sending both copy memory, and on fewer cores (2 cores,
        2 processes: 1.1-1.2x slower measured) they only slow each other down.
        """
        if self.overlap_reads is not None:
            return bool(self.overlap_reads)
        return _available_cores() > 2 * world_size()

    def _receive_steps(self, pass_number: int) -> Iterator[tuple[Any, bool]]:
        """Processes other than 0: receive each step's announcement, then this process's rows.

        A failure of the process group while waiting (process 0 died, a timeout) is a
        :class:`DispatchError` that names process 0.
        """
        comm_device = _communication_device()
        control = torch.zeros(_CONTROL_SIZE, dtype=torch.int64, device=comm_device)
        header: Optional[_Header] = None
        while True:
            try:
                kind, last, header, batch = self._receive_step(control, header, comm_device, pass_number)
            except DispatchError:
                raise
            except RuntimeError as exc:  # torch.distributed.DistBackendError included
                raise DispatchError(
                    "lost process 0 (which reads and sends the data in dispatch mode), or another process of the "
                    f"dispatch group died, while waiting for a batch: {exc}"
                ) from exc
            if kind in (_END, _CLOSE):
                return
            yield batch, last
            if last:
                return

    def _receive_step(
        self, control: torch.Tensor, header: Optional[_Header], comm_device: torch.device, pass_number: int
    ) -> tuple[int, bool, Optional[_Header], Any]:
        """The next message of pass ``pass_number``: (kind, last, the header now known, the batch).

        Messages of an earlier pass (one this process left early) are received and dropped.
        """
        group = self._wire.group
        while True:
            dist.broadcast(control, src=0, group=group)
            kind, number, rows, last, slot = control.tolist()
            if number > pass_number:
                raise DispatchError(
                    f"process 0 is in pass {number} over the data and this process in pass {pass_number}: in dispatch "
                    "mode every process must iterate the loader the same number of times"
                )
            if kind == _ERROR:
                message = broadcast_object(None, group=group)
                if number == pass_number:
                    raise DispatchError(f"process 0 failed to dispatch a batch: {message}")
                continue
            if kind in (_END, _CLOSE):
                if number == pass_number:
                    return kind, True, header, None
                continue
            uneven = kind == _UNEVEN
            if kind == _HEADER:
                header = broadcast_object(None, group=group)
                self.dispatch_stats.headers += 1
            elif uneven:
                first, part_rows = broadcast_object(None, group=group)
                header = _with_rows(first, part_rows[self.process_index])
                self.dispatch_stats.headers += 1
            elif kind == _ROWS and header is not None:
                header = _with_rows(header, rows)
            elif kind != _SAME or header is None:
                raise DispatchError(f"process 0 sent an unexpected dispatch message {kind}")
            skeleton, specs, rings = header
            objects: list[Any] = []
            if any(dtype == OBJECT for dtype, _ in specs):
                box: list[Any] = [None]
                dist.scatter_object_list(box, None, src=0, group=group)
                objects = box[0]
            shared = self._read_ring(rings, specs, slot)
            if shared is not None:  # process 0's host: the rows are in shared memory
                tensors_in = iter(shared)
                received = [None if dtype == OBJECT else next(tensors_in) for dtype, _ in specs]
            else:
                received = [None if dtype == OBJECT else torch.empty(shape, dtype=dtype, device=comm_device) for dtype, shape in specs]
            for out in received:
                if shared is not None or out is None or (uneven and not out.numel()):
                    continue
                if comm_device.type == "cpu" or uneven:
                    dist.recv(out, src=0, group=group, tag=_SEND_TAG)
                else:
                    dist.scatter(out, None, src=0, group=group)
            if uneven:
                header_after: Optional[_Header] = None  # the next step comes with a header of its own
            else:
                header_after = header
            self._send_receipt(comm_device)
            if number < pass_number:
                header = header_after
                continue  # the rest of a pass this process left early
            self.dispatch_stats.steps += 1
            if shared is None:
                tensors = [t for t in received if t is not None]
                self.dispatch_stats.bytes_received += sum(t.numel() * t.element_size() for t in tensors)
            values = iter(objects)
            leaves = [next(values) if out is None else out for out in received]
            return kind, bool(last), header_after, unflatten(iter(leaves), skeleton)

    def _read_steps_cut(self, skip: int) -> Iterator["_Step"]:
        """Process 0: each step cut into the parts of every process."""
        comm_device = _communication_device()
        for step, slot in self._read_steps(skip):
            parts = self._cut(step)
            leaves, skeleton = flatten(parts[0])
            # never its own rows: the ring is reused
            if self._wire.rings and any(self._in_a_ring(leaf) for leaf in leaves):
                leaves = [leaf.clone() if self._in_a_ring(leaf) else leaf for leaf in leaves]
                parts[0] = unflatten(iter(leaves), skeleton)
            flat = [[_transportable(leaf, comm_device) for leaf in flatten(part)[0]] for part in parts]
            rows = [batch_rows(part_leaves) or 0 for part_leaves in flat]
            yield _Step(parts[0], flat, (skeleton, [leaf_spec(leaf) for leaf in leaves]), rows, slot)

    def _in_a_ring(self, leaf: Any) -> bool:
        return isinstance(leaf, torch.Tensor) and any(ring.holds(leaf) for ring in self._wire.rings.values())

    def _cut(self, step: Any) -> list[Any]:
        if isinstance(step, _Parts):  # already one batch per process, nothing to cut
            return step.parts
        rows = batch_rows(flatten(step)[0]) or 0
        n = self.num_processes
        sizes = [rows // n + (1 if j < rows % n else 0) for j in range(n)]  # even: rows divide by N
        starts = [sum(sizes[:j]) for j in range(n)]
        parts = [self.slice_fn(step, slice(starts[j], starts[j] + sizes[j]), j, n) for j in range(n)]
        first_leaves, first_skeleton = flatten(parts[0])
        for part in parts[1:]:
            leaves, skeleton = flatten(part)
            if skeleton != first_skeleton or [_trailing(l) for l in leaves] != [_trailing(l) for l in first_leaves]:
                raise DispatchError("slice_fn_for_dispatch returned parts of different structure or shape for different processes")
        return parts


class _Wire:
    """What a dispatcher keeps about its process group and the traffic on it: the group, the pass
    numbers, the steps sent and received, the receipts and the shared-memory rings.

    One per loader built with :func:`prepare_data_loader` (on every process); the copy that
    ``skip_first_batches`` makes (``PreparedDataLoader._skipped_copy``) shares it, so that the copy
    and the original number passes and steps alike on every process, whichever of them runs a pass.
    A pickled loader gets an empty one: it cannot dispatch. The rings go when the last loader
    sharing them does.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.passes_started = 0  # passes begun on this process; every message names process 0's
        self.sending: Optional["weakref.ref[Any]"] = None  # process 0: the pass whose steps are being sent
        self.closing: list[Any] = []  # process 0: close messages not yet read by every process
        self.acks: dict[int, list[Any]] = {}  # process 0: per process elsewhere, receipts of steps not yet seen
        self.ack_sends: list[Any] = []  # the other processes: receipts in flight
        self.steps_received = 0  # the other processes: step messages received (all passes)
        self.counters: dict[int, ReceiptCounter] = {}  # process 0: per process of its host, its receipts
        self.counter: Optional[ReceiptCounter] = None  # a process on process 0's host: where it counts
        self.pids: dict[int, int] = {}  # process 0: the process id of every process of its host
        self.shm_targets: frozenset[int] = frozenset()  # the processes of process 0's host (shared memory)
        self.rings: dict[int, SharedRing] = {}  # process 0: a ring per process of its host
        self.steps_sent = 0  # process 0: steps announced (all passes)
        self.slot_steps = [-1] * _RING_SLOTS  # process 0: the step last announced in each ring slot
        self.slots_taken = 0  # process 0: steps read, each given the next slot in turn
        self.reader: Optional[RingReader] = None  # the others: process 0's ring for this process

    def close(self) -> None:
        """Release the shared-memory rings.

        Process 0 first waits (briefly) for the receipts still due: a process that has not read its
        last steps yet may not have mapped its ring, and removing the file would leave it nothing to map.
        """
        for j, ring in list(self.rings.items()):
            failure = self.await_shared_receipts(j, self.steps_sent, _CLOSE_WAIT_S)
            if failure is not None:  # gone, or not reading any more: the file goes anyway
                logger.debug("closing the dispatch ring of process %d without its receipts: %s", j, failure)
            ring.close()
        self.rings.clear()  # (the receipt counters stay: their files are gone already, and passes may follow)
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def await_shared_receipts(self, j: int, count: int, timeout_s: Optional[float] = None) -> Optional[DispatchError]:
        """Process 0: wait until process ``j`` of its host counted ``count`` steps received; the
        ``DispatchError`` to raise when it died or did not get there within ``timeout_s`` (the
        process group's default timeout)."""
        counter = self.counters.get(j)
        if counter is None or counter.count >= count:
            return None
        limit = timeout_s if timeout_s is not None else _default_timeout_s()
        start = time.monotonic()
        pause = 0.0  # yield the core only, at first: a receipt is usually a few microseconds away
        while counter.count < count:
            time.sleep(pause)
            now = time.monotonic()
            if now - start < _SPIN_S:
                continue
            pause = min(2 * pause or 5e-5, 1e-3)
            if pause >= 1e-3 and not _process_alive(self.pids[j]):
                return DispatchError(f"process {j} died: it stopped receiving dispatched batches")
            if now - start > limit:
                return DispatchError(
                    f"process {j} received no dispatched batch for {limit:g} s: every process must iterate the loader"
                )
        return None


# -- the per-step messages ----------------------------------------------------------------------
_Header = tuple[Any, list[tuple[Any, Any]], tuple[tuple[int, str, int, int], ...]]
"""(skeleton of the nested batch, (dtype, shape) of every leaf of one process's part, the
shared-memory ring of every process on process 0's host: (process, path, slots, slot bytes))."""


class _Step(NamedTuple):
    """Process 0: one step read and cut, ready to send."""

    own: Any  # process 0's part, as handed out
    parts: list[list[Any]]  # every process's part as leaves (tensors contiguous, on the group's device)
    header: tuple[Any, list[tuple[Any, Any]]]  # part 0's skeleton and leaf specs
    rows: list[int]  # every part's rows
    slot: int  # the ring slot the step's rows take (processes of process 0's host)


_NO_BATCH = object()

_CLOSE_WAIT_S = 10.0
"""How long closing a dispatcher waits for the receipts still due before it removes its rings."""

_MIN_SLOT_BYTES = 1 << 20
"""Smallest slot of a shared-memory ring (rings double when a step outgrows them)."""

_SEND_TAG = 0x5350
"""Tag of the point-to-point sends of rows (gloo), apart from the user's own sends."""

_ACK_TAG = 0x5351
"""Tag of the receipts the other processes send process 0 for every step."""

_RECEIPT_LAG = 2
"""Steps process 0 may run ahead of the slowest receipt."""

_SPIN_S = 2e-4
"""How long process 0 waits for a receipt in shared memory by yielding its core, before it sleeps."""

_RING_SLOTS = _RECEIPT_LAG + 2
"""Slots of a shared-memory ring: the steps receipts may lag, the step being announced, and the
one process 0 reads (and collates into its slot) meanwhile."""

_SAME, _ROWS, _HEADER, _END, _ERROR, _CLOSE, _UNEVEN = range(7)
"""Kinds of the message process 0 broadcasts before every step: the part has the header sent
last / that header with dim 0 = ``rows`` on every leaf / a new header follows (pickled) / the
pass had no step / an error message follows (pickled) / process 0 left the pass early / the
parts have different rows (``even_batches=False``): part 0's header and every part's rows follow
(pickled)."""

_CONTROL_SIZE = 5
"""The message: (kind, process 0's pass number, rows, whether this step is the pass's last, the
ring slot its rows are in)."""


def _announce(
    control: torch.Tensor, kind: int, pass_number: int, rows: int = 0, last: bool = False, slot: int = 0, *,
    group: Any, async_op: bool = False,
) -> Any:
    """Process 0: broadcast the message of the coming step (its work when ``async_op``)."""
    control[0], control[1], control[2], control[3], control[4] = kind, pass_number, rows, int(last), slot
    work = dist.broadcast(control, src=0, group=group, async_op=async_op)
    return work if async_op else _Done()


def _flag_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` for each item (one read ahead)."""
    iterator = iter(items)
    for upcoming in iterator:
        break
    else:
        return
    for following in iterator:
        yield upcoming, False
        upcoming = following
    yield upcoming, True


def _control_for(header: _Header, sent: Optional[_Header]) -> tuple[int, int]:
    """How to tell the other processes about ``header`` when ``sent`` is what they know."""
    if sent is None:
        return _HEADER, 0
    if header == sent:
        return _SAME, 0
    rows = {shape[0] for dtype, shape in header[1] if dtype != OBJECT}
    if len(rows) == 1 and _with_rows(sent, next(iter(rows))) == header:
        return _ROWS, next(iter(rows))
    return _HEADER, 0


def _with_rows(header: _Header, rows: int) -> _Header:
    skeleton, specs, rings = header
    return skeleton, [(dtype, shape if dtype == OBJECT else (rows,) + tuple(shape[1:])) for dtype, shape in specs], rings


def _trailing(leaf: Any) -> Any:
    """What must agree between the parts of one step: a tensor's dtype and shape beyond dim 0."""
    dtype, shape = leaf_spec(leaf)
    return (dtype, shape[1:]) if shape is not None else dtype


def _objects(leaves: list[Any]) -> list[Any]:
    """The leaves of one part that travel pickled (everything but tensors with rows)."""
    return [leaf for leaf in leaves if leaf_spec(leaf)[0] == OBJECT]


def _transportable(leaf: Any, device: torch.device) -> Any:
    """A tensor leaf ready to send (contiguous, on the group's device); other leaves as they are."""
    if leaf_spec(leaf)[0] == OBJECT:
        return leaf
    return leaf.contiguous().to(device)


class _Done:
    """A finished collective."""

    def wait(self) -> bool:
        return True


def _wait(works: list[Any]) -> None:
    """Wait for (and forget) the collectives in ``works``."""
    while works:
        works.pop(0).wait()


class _Parts:
    """A step that is already cut: one batch per process (N full batches of equal rows)."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts


def _head_rows(group: list[Any], count: int) -> Any:
    """A copy of the first ``count`` rows of the concatenated ``group`` (fewer when it is shorter)."""
    taken, pieces = 0, []
    for batch in group:
        if taken >= max(count, 1):
            break
        piece = slice_rows(batch, slice(0, max(count, 1) - taken))
        pieces.append(piece)
        taken += batch_rows(flatten(piece)[0]) or 0
    rows = concatenate_rows(pieces) if len(pieces) > 1 else pieces[0]
    return take_rows(rows, torch.arange(min(max(count, 1), taken)))


def _available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


_communication_device = communication_device


def _plain_iteration(cls: type, stateful: bool) -> bool:
    """Whether a prepared loader class reads its batches through the iteration of ``DataLoader`` (or
    ``StatefulDataLoader``) itself: one collation per batch handed back, in order, no look-ahead
    (``__iter__`` and ``_get_iterator`` not overridden by a subclass)."""
    after = super(PreparedDataLoader, cls)
    known = [stateful_dataloader_class()] if stateful else [DataLoader]
    return any(
        getattr(after, "__iter__", None) is getattr(base, "__iter__") and getattr(after, "_get_iterator", None)
        is getattr(base, "_get_iterator", None) for base in known
    )


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs: on Linux by ``/proc`` (a zombie does not run)."""
    if not os.path.isdir("/proc"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's: it exists
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False


def _default_timeout_s() -> float:
    """The process group's default timeout, in seconds (how long a receipt may take)."""
    return dist.constants.default_pg_timeout.total_seconds()
