"""Process 0's side of the step protocol: it reads each step and sends the others their rows.

:class:`StepReader` reads the loader's global batches and has the plan make them into steps
(checked, padded, cut into every process's part); :class:`StepSender` announces each step,
sends its rows (:mod:`~shardplug.core.dispatch.wire_protocol`) and hands out process 0's own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardplug.core._internal.collectives import world_size
from shardplug.core._internal.rows import (
    OBJECT,
    batch_rows,
    flatten,
    leaf_spec,
    mark_ragged_rows,
    slice_rows,
    unflatten,
)
from shardplug.core.dispatch.dispatch_plan import DispatchError, DispatchPlan, StepPadding
from shardplug.core.dispatch.receipts import RECEIPT_LAG
from shardplug.core.dispatch.shm import CollateIntoRing
from shardplug.core.dispatch.wire import Wire
from shardplug.core.dispatch.wire_protocol import (
    CLOSE,
    END,
    ERROR,
    HEADER,
    SEND_TAG,
    UNEVEN,
    DispatchStats,
    Header,
    Specs,
    Step,
    announce,
    control_for,
    error_text,
    has_objects,
    new_control,
    objects,
    tensors,
    transportable,
)
from shardplug.core.sharding.shard_plan import PassRecord

__all__ = ["StepReader", "StepSender", "local_steps", "overlaps_reads"]

logger = logging.getLogger(__name__)

SliceFn = Callable[[Any, slice, int, int], Any]

_NO_BATCH = object()


class StepReader:
    """Process 0: the steps of one pass, each with the ring slot its rows will take.

    ``read_batches()`` gives the pass's global batches; per step the reader takes one of them
    (``split_batches``) or ``N``, collating batch ``j`` straight into ``j``'s ring slot where
    ``collate`` can (and the slot is free), and the plan makes the step (:meth:`DispatchPlan.step`):
    with the default ``slice_fn`` (``uncut``) ``N`` full batches of equal rows are already every
    process's part. Padding comes from the epoch's head: the first step's rows, or ``load`` of
    the epoch's first indices in ``record`` when the pass starts mid-epoch.
    """

    def __init__(
        self,
        plan: DispatchPlan,
        wire: Wire,
        read_batches: Callable[[], Iterator[Any]],
        slice_fn: SliceFn,
        *,
        uncut: bool,
        collate: CollateIntoRing | None,
        record: PassRecord,
        load: Callable[[list[int]], Any] | None,
    ) -> None:
        self.plan, self.wire, self.read_batches, self.slice_fn = plan, wire, read_batches, slice_fn
        self.uncut, self.collate, self.record, self.load = uncut, collate, record, load

    def steps(self) -> Iterator[tuple[Any, int, StepPadding]]:
        """The global batch of each step (padded to a multiple of N rows), its ring slot and where its
        padding begins."""
        batches = self.read_batches()
        per_step = self.plan.layout.batches_per_step
        head: Any | None = None  # a copy of the first rows: process 0 may change its own rows in place
        while True:
            slot = self.wire.rings.next_slot()
            group = self._group(batches, per_step, slot)
            if not group:
                return
            self.wire.rings.slot_taken()
            if not self.plan.takes_step(group):
                return
            group = mark_ragged_rows(group)  # lists of one tensor per row: one leaf, in every batch alike
            rows = self.plan.check_step(group)  # shapes may change from one step to the next
            if head is None:
                head = self.plan.epoch_head(group, self.record, self.load)
            step = self.plan.step(group, rows, head, self.uncut)
            yield step, slot, self.plan.padding_of(step, rows)

    def _group(self, batches: Iterator[Any], count: int, slot: int) -> list[Any]:
        """Up to ``count`` batches: one step's, batch ``j`` collated into ``j``'s ring ``slot``
        where that is possible and the slot is free."""
        collate, group = self.collate, []
        try:
            for j in range(count):
                if collate is not None:
                    ring = self.wire.rings.by_process.get(j)
                    collate.target = (ring, slot) if ring is not None and self.wire.rings.slot_free(slot) else None
                batch = next(batches, _NO_BATCH)
                if batch is _NO_BATCH:
                    break
                group.append(batch)
        finally:
            if collate is not None:
                collate.target = None
        return group

    def cut_steps(self, device: torch.device) -> Iterator[Step]:
        """Each step cut into the parts of every process, ready to send."""
        for step, slot, padding in self.steps():
            parts = self.plan.cut(step, self.slice_fn)
            leaves, skeleton = flatten(parts[0])
            # never its own rows: the ring is reused
            rings = self.wire.rings
            if rings.by_process and any(rings.holds(leaf) for leaf in leaves):
                leaves = [leaf.clone() if rings.holds(leaf) else leaf for leaf in leaves]
                parts[0] = unflatten(iter(leaves), skeleton)
            flat = [[transportable(leaf, device) for leaf in flatten(part)[0]] for part in parts]
            specs = [[leaf_spec(leaf) for leaf in part_leaves] for part_leaves in flat]
            yield Step(parts[0], flat, (skeleton, [leaf_spec(leaf) for leaf in leaves]), specs, slot, padding)

    def hand_out(self, own: Any, padding: StepPadding, rows: int | None) -> Any:
        """Process 0's part ``own`` of ``rows`` rows, its padding marked in the pass's record
        (:meth:`StepPadding.mark`)."""
        padding.mark(self.record, 0, rows)
        return own


def local_steps(reader: StepReader, stats: DispatchStats) -> Iterator[tuple[Any, bool]]:
    """Without a process group: process 0's own part of every step, and whether it is the last."""
    for (step, _, padding), last in _flag_last(reader.steps()):
        parts = reader.plan.cut(step, reader.slice_fn)
        stats.steps += 1
        yield reader.hand_out(parts[0], padding, batch_rows(flatten(parts[0])[0])), last


class StepSender:
    """Process 0: one pass's steps, announced and sent to the other processes; its own handed out.

    Step ``t + 1`` is read before step ``t`` is announced, so the announcement says whether
    ``t`` is the pass's last. On CPU process groups (gloo) every other process's rows go out as
    asynchronous point-to-point sends -- a scatter without the copy of process 0's own rows --
    and process 0 hands out its own rows at once: the sends of step ``t`` proceed in the process
    group's threads while the caller works on its rows, and are waited for before step
    ``t + 2`` is read -- or, with :func:`overlaps_reads`, while it is read and collated. On GPU
    process groups (nccl) each leaf is a synchronous ``scatter``.
    """

    def __init__(
        self,
        reader: StepReader,
        stats: DispatchStats,
        pass_number: int,
        device: torch.device,
        overlap_reads: bool | None = None,
        shuffle: torch.Generator | None = None,
    ) -> None:
        self.shuffle = shuffle  # the generator process 0's sampler draws the order from (see _send_shuffle_state)
        self.reader, self.wire, self.stats, self.pass_number, self.device = (
            reader,
            reader.wire,
            stats,
            pass_number,
            device,
        )
        self.group = self.wire.group
        self.on_cpu = device.type == "cpu"
        # Parts from the default slice_fn are disjoint row ranges, so process 0 may use its own
        # rows while the others' are still being sent; a custom slice_fn may share rows.
        self.overlap = self.on_cpu and reader.slice_fn is slice_rows
        self.overlap_reads = self.overlap and overlaps_reads(overlap_reads)
        self.control = new_control(device)
        self.sent: Header | None = None
        self.pending: list[Any] = []  # the rows in flight to other hosts
        self.announced: list[Any] = []  # the step messages in flight (not waited for before a read: nothing to copy)
        self.ended = False  # the others know where this pass ends (its last step, its end or an error)
        self.read_failure: BaseException | None = None  # the dataset's own error: raised as it is

    def steps(self) -> Iterator[tuple[Any, bool]]:
        """This pass's steps as ``(process 0's rows, last)``, each sent before it is handed out."""
        steps = self.reader.cut_steps(self.device)
        try:
            # every process has read the close of the previous pass by now, or is about to
            self.wire.waits.wait_all(self.wire.closing, "the other processes to read the close of the previous pass")
            upcoming = self._read_next(steps)
            if upcoming is None:
                self.ended = True
                self._announce_now(END, "the other processes to receive the end of the pass")
                self._send_shuffle_state()
                return
            while upcoming is not None:
                if not isinstance(upcoming, Exception):
                    failure = self.wire.receipts.await_receipts(self.wire.rings.slot_steps[upcoming.slot])
                    upcoming = upcoming if failure is None else failure
                if isinstance(upcoming, Exception):
                    self._fail(upcoming)
                following = self._read_next(steps)
                last = following is None
                padding, rows = upcoming.padding, batch_rows(upcoming.parts[0])
                own = self._send(upcoming, last)
                del upcoming  # rows in flight stay referenced by their sends only
                yield self.reader.hand_out(own, padding, rows), last
                upcoming = following
        except RuntimeError as exc:
            if exc is self.read_failure or isinstance(exc, DispatchError):
                raise
            self.ended = True  # the process group failed: a process died or stopped receiving
            what = f"the other processes to take step {self.wire.steps_sent}"
            lost = self.wire.liveness.ended(what) or DispatchError(f"process 0 lost a process it dispatches to: {exc}")
            raise lost from exc
        finally:
            self._finish()

    def _read_next(self, steps: Iterator[Step]) -> Any:
        """The next step, ``None`` at the end, or the exception reading it raised."""
        if not self.overlap_reads:
            self._wait_rows()
        try:
            return next(steps, None)
        except Exception as exc:  # reached every process when its turn comes, not before
            return exc
        finally:
            self._wait_rows()

    def _wait_rows(self) -> None:
        """Wait until the rows in flight through the process group were received."""
        self.wire.waits.wait_all_sent(
            self.pending, f"the other processes to receive the rows of step {self.wire.steps_sent - 1} (process group)"
        )

    def _announce_now(self, kind: int, what: str) -> None:
        """Broadcast a message that no step follows, and wait until every process received it."""
        message = self.control.clone() if self.on_cpu else self.control
        self.wire.waits.wait(announce(message, kind, self.pass_number, group=self.group, async_op=self.on_cpu), what)

    def _fail(self, exc: Exception) -> None:
        """Tell the others that this pass failed, and why; raise ``exc``."""
        self.ended = True
        if not isinstance(exc, DispatchError):
            self.read_failure = exc
        try:
            self._announce_now(ERROR, "the other processes to receive process 0's error")
            self.wire.objects.broadcast_object(
                error_text(exc), self.device, "the other processes to receive process 0's error"
            )
        except DispatchError as telling:
            if isinstance(exc, DispatchError):  # a process is gone: that error says so already
                raise exc from None
            raise telling from exc
        raise exc

    def _send(self, step: Step, last: bool) -> Any:
        """Announce ``step`` and send its rows; process 0's own part as handed out."""
        own, parts, first, part_specs, slot, _ = step
        header: Header = first + (self.wire.rings.ring_table(parts),)
        uneven = step.uneven  # the last step's leftovers (even_batches=False), or batches of their own shapes
        for j in self.wire.rings.targets:  # this host: through shared memory, written before it is announced
            total, copied = self.wire.rings.write_ring(j, tensors(parts[j]), slot)
            self.stats.bytes_shared += total
            self.stats.bytes_collated_in_place += total - copied
        self._announce(header, part_specs, uneven, last, slot, step.padding)
        self._send_rows(parts, header, uneven)
        self.stats.steps += 1
        self.wire.receipts.expect_receipts(self.reader.plan.layout.num_processes, self.device)
        if not self.overlap:
            self._wait_rows()
        if not (self.on_cpu or uneven):
            own = unflatten(iter(parts[0]), header[0])
        return own

    def _announce(
        self, header: Header, part_specs: list[Specs], uneven: bool, last: bool, slot: int, padding: StepPadding
    ) -> None:
        """The message of the step, and its header when the others do not know it."""
        kind, rows = (UNEVEN, 0) if uneven else control_for(header, self.sent)
        self.wire.step_announced(slot)
        while len(self.announced) > RECEIPT_LAG:  # (receipts keep it short anyway)
            what = f"the other processes to receive the message of step {self.wire.steps_sent - 1 - RECEIPT_LAG}"
            self.wire.waits.wait(self.announced.pop(0), what)
        message = torch.empty_like(self.control) if self.on_cpu else self.control  # each in flight has its own
        self.announced.append(
            announce(message, kind, self.pass_number, rows, last, slot, padding, group=self.group, async_op=self.on_cpu)
        )
        self.ended = last
        what = f"the other processes to receive the header of step {self.wire.steps_sent - 1}"
        if kind == HEADER:
            self.wire.objects.broadcast_object(header, self.device, what)
            self.stats.headers += 1
        elif kind == UNEVEN:
            self.wire.objects.broadcast_object((header, part_specs), self.device, what)
            self.stats.headers += 1
        if last:
            self._send_shuffle_state()
        self.sent = None if uneven else header

    def _send_shuffle_state(self) -> None:
        """With the pass's last message (its last step, or its end): the state of the shuffle's generator, which
        only process 0's reading advanced (the order, the DataLoader's base seed); the others take it, so every
        process's position records the same ``generator_state`` and the next pass starts from it."""
        if self.shuffle is not None:
            what = "the other processes to receive the state of the shuffle's generator"
            self.wire.objects.broadcast_object(self.shuffle.get_state(), self.device, what)

    def _send_rows(self, parts: list[list[Any]], header: Header, uneven: bool) -> None:
        """Every other process's leaves of the step: pickled ones, then tensors (those of process
        0's host are in their rings already); ``parts[0]`` becomes process 0's own tensors."""
        group, targets = self.group, self.wire.rings.targets
        if has_objects(header[1]):
            what = f"the other processes to receive the rows of step {self.wire.steps_sent - 1}"
            self.wire.objects.scatter_objects([objects(leaves) for leaves in parts], self.device, what)
        for k, (dtype, shape) in enumerate(header[1]):
            if dtype == OBJECT:
                continue
            sources = [leaves[k] for leaves in parts]
            if self.on_cpu or uneven:  # point to point (scatter needs equal parts)
                self.pending.extend(
                    dist.isend(source, dst=j, group=group, tag=SEND_TAG)
                    for j, source in enumerate(sources)
                    if j != 0 and source.numel() and j not in targets
                )
            else:
                out = torch.empty(shape, dtype=dtype, device=self.device)
                dist.scatter(out, sources, src=0, group=group)
                sources[0] = out
            self.stats.bytes_sent += sum(
                t.numel() * t.element_size() for j, t in enumerate(sources) if j and j not in targets
            )
            parts[0][k] = sources[0]

    def _finish(self) -> None:
        """The end of the pass: wait for what is in flight; a pass left early is closed."""
        try:
            self._wait_rows()
            self.wire.waits.wait_all(self.announced, "the other processes to receive the messages of the last steps")
            if not self.ended and dist.is_initialized():
                # left early: the others stop after this step. Not waited for here: a process that
                # left the pass early too reads it only when its next pass starts.
                message = announce(self.control.clone(), CLOSE, self.pass_number, group=self.group, async_op=True)
                self.wire.closing.append(message)
                logger.debug("dispatch pass %d closed early by process 0", self.pass_number)
        except DispatchError as exc:  # a process is gone: the error of the pass says so already
            logger.debug("the dispatcher could not tell the other processes that the pass ended: %s", exc)
        except Exception:  # already failing or closing: the original error matters more
            logger.exception("the dispatcher could not tell the other processes that the pass ended")


def overlaps_reads(setting: bool | None) -> bool:
    """Whether process 0 reads step ``t + 1`` while step ``t`` is still being sent.

    ``setting`` (the loader's ``overlap_reads``) when set; otherwise only with more than two CPU
    cores per process of the group on this machine: reading and sending both copy memory, and on
    fewer cores (2 cores, 2 processes: 1.1-1.2x slower measured) they only slow each other down.
    """
    if setting is not None:
        return bool(setting)
    return _available_cores() > 2 * world_size()


def _available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _flag_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)`` for each item (one read ahead)."""
    iterator = iter(items)
    for upcoming in iterator:  # noqa: B007 (the first item, read ahead: used after the loop)
        break
    else:
        return
    for following in iterator:
        yield upcoming, False
        upcoming = following
    yield upcoming, True
