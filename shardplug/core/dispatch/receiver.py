"""The other processes' side of the step protocol: each receives its rows of every step.

A process reads the message before every step (:mod:`~shardplug.core.dispatch.wire_protocol`),
the header when one follows, then its rows -- from process 0's ring when it shares process 0's
host, else through the process group -- and sends its receipt. Messages of a pass it left early
are received and dropped when its next pass starts. The receipt of a pass's last step may find
process 0 gone: a process 0 that ended after sending every step (a script that ends) failed nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist

from shardplug.core._internal.rows import OBJECT, batch_rows, flatten, unflatten
from shardplug.core.dispatch.dispatch_plan import DispatchError, StepPadding
from shardplug.core.dispatch.wire import Wire
from shardplug.core.dispatch.wire_protocol import (
    CLOSE,
    END,
    ERROR,
    HEADER,
    ROWS,
    SAME,
    SEND_TAG,
    UNEVEN,
    DispatchStats,
    Header,
    Message,
    has_objects,
    new_control,
    with_rows,
    with_specs,
)
from shardplug.core.sharding.shard_plan import PassRecord

__all__ = ["StepReceiver"]

logger = logging.getLogger(__name__)


class StepReceiver:
    """A process other than 0: the steps of pass ``pass_number`` as ``(batch, last)``.

    A failure of the process group while waiting (process 0 died, a timeout) is a
    :class:`DispatchError` that names process 0; every wait notices within seconds that a process
    of this host died (:meth:`~shardplug.core.dispatch.timed_waits.TimedWaits.wait`).
    """

    def __init__(
        self,
        wire: Wire,
        stats: DispatchStats,
        process_index: int,
        pass_number: int,
        device: torch.device,
        record: PassRecord | None = None,
        shuffle: torch.Generator | None = None,
    ) -> None:
        self.wire, self.stats, self.process_index, self.pass_number, self.device = (
            wire,
            stats,
            process_index,
            pass_number,
            device,
        )
        self.group = wire.group
        self.record = record if record is not None else PassRecord()  # where each step's padding is noted
        self.shuffle = shuffle  # the shuffle's generator: process 0's state is taken at each pass's end

    def steps(self) -> Iterator[tuple[Any, bool]]:
        """Receive each step's message, then this process's rows; until the pass's last step."""
        control = new_control(self.device)
        header: Header | None = None
        while True:
            try:
                kind, last, header, batch, padding = self._next_step(control, header)
            except DispatchError:
                raise
            except RuntimeError as exc:  # torch.distributed.DistBackendError included
                what = f"step {self.wire.receipts.steps_received} from process 0"
                lost = self.wire.liveness.ended(what) or DispatchError(
                    "lost process 0 (which reads and sends the data in dispatch mode), or another process of the "
                    f"dispatch group died, while waiting for a batch: {exc}"
                )
                raise lost from exc
            if kind in (END, CLOSE):
                return
            padding.mark(self.record, self.process_index, batch_rows(flatten(batch)[0]))
            yield batch, last
            if last:
                return

    def _next_step(
        self, control: torch.Tensor, header: Header | None
    ) -> tuple[int, bool, Header | None, Any, StepPadding]:
        """The next message of this pass: (kind, last, the header now known, the batch, where the step's
        padding begins).

        Messages of an earlier pass (one this process left early) are received and dropped.
        """
        pass_number = self.pass_number
        while True:
            step = self.wire.receipts.steps_received
            self.wire.objects.receive_message(control, f"process 0's message of step {step} (pass {pass_number})")
            message = Message(*control.tolist())
            kind, number = message.kind, message.number
            if number > pass_number:
                raise DispatchError(
                    f"process 0 is in pass {number} over the data and this process in pass {pass_number}: in dispatch "
                    "mode every process must iterate the loader the same number of times"
                )
            if kind == ERROR:
                what = "process 0's error (after its error message)"
                text = self.wire.objects.broadcast_object(None, self.device, what)
                if number == pass_number:
                    raise DispatchError(f"process 0 failed to dispatch a batch: {text}")
                continue
            if kind == END:
                self._take_shuffle_state()
            if kind in (END, CLOSE):
                if number == pass_number:
                    return kind, True, header, None, message.padding
                continue
            header = self._header(message, header)
            if message.last:
                self._take_shuffle_state()
            leaves = self._receive_rows(header, message)
            header_after = (
                None if kind == UNEVEN else header
            )  # after uneven parts, the next step comes with a header of its own
            self._send_receipt(last_of_pass=bool(message.last) and number == pass_number)
            if number < pass_number:
                header = header_after
                continue  # the rest of a pass this process left early
            self.stats.steps += 1
            batch = unflatten(iter(leaves), header[0])
            return kind, bool(message.last), header_after, batch, message.padding

    def _take_shuffle_state(self) -> None:
        """After the message of a pass's last step or end: process 0's state of the shuffle's generator, which
        only its reading advanced (see :meth:`StepSender._send_shuffle_state`)."""
        if self.shuffle is not None:
            what = "process 0's state of the shuffle's generator (at the end of its pass)"
            self.shuffle.set_state(self.wire.objects.broadcast_object(None, self.device, what))

    def _send_receipt(self, last_of_pass: bool) -> None:
        """Tell process 0 that the step arrived. After the pass's last step, this process has every
        row of the pass: process 0 may have ended since (its pass was over), and its receipt then
        reaches nobody, which fails nothing."""
        try:
            self.wire.receipts.send_receipt(self.device)
        except RuntimeError as exc:  # DispatchError, gloo's closed connection
            if not last_of_pass:
                raise
            logger.debug("process 0 ended before taking the receipt of pass %d's last step: %s", self.pass_number, exc)

    def _header(self, message: Message, header: Header | None) -> Header:
        """This process's header of the step ``message`` announces (received when one follows)."""
        kind = message.kind
        if kind in (HEADER, UNEVEN):
            what = f"process 0's header of step {self.wire.receipts.steps_received}"
            received = self.wire.objects.broadcast_object(None, self.device, what)
            self.stats.headers += 1
            if kind == HEADER:
                return cast("tuple[Any, list[tuple[Any, Any]], tuple[tuple[int, str, int, int], ...]]", received)
            first, part_specs = received  # every part's leaf specs: this process reads its own
            return with_specs(first, part_specs[self.process_index])
        if kind == ROWS and header is not None:
            return with_rows(header, message.rows)
        if kind != SAME or header is None:
            raise DispatchError(f"process 0 sent an unexpected dispatch message {kind}")
        return header

    def _receive_rows(self, header: Header, message: Message) -> list[Any]:
        """This process's leaves of the step: pickled ones first, then tensors (from process 0's
        ring on its host, else through the process group)."""
        _, specs, rings = header
        uneven = message.kind == UNEVEN
        what = f"the rows of step {self.wire.receipts.steps_received} from process 0"
        objects: list[Any] = []
        if has_objects(specs):
            objects = self.wire.objects.scatter_objects(None, self.device, what)
        shared = self.wire.rings.read_ring(self.process_index, rings, specs, message.slot)
        if shared is not None:  # process 0's host: the rows are in shared memory
            tensors_in = iter(shared)
            received = [None if dtype == OBJECT else next(tensors_in) for dtype, _ in specs]
        else:
            received = [
                None if dtype == OBJECT else torch.empty(shape, dtype=dtype, device=self.device)
                for dtype, shape in specs
            ]
        for out in received:
            if shared is not None or out is None or (uneven and not out.numel()):
                continue
            if self.device.type == "cpu" or uneven:
                self.wire.waits.wait_sent(dist.irecv(out, src=0, group=self.group, tag=SEND_TAG), what)
            else:
                dist.scatter(out, None, src=0, group=self.group)
        if shared is None and message.number == self.pass_number:
            tensors = [t for t in received if t is not None]
            self.stats.bytes_received += sum(t.numel() * t.element_size() for t in tensors)
        values = iter(objects)
        return [next(values) if out is None else out for out in received]
