"""The wire protocol of dispatch mode: the message before every step, and what follows it.

Before every step process 0 broadcasts a message of :data:`CONTROL_SIZE` integers on the
dispatcher's own process group: ``(kind, pass number, rows, last, slot, real, padded part, its real
rows, samples)``, the last four where the step's padding begins
(:class:`~shardplug.core.dispatch.dispatch_plan.StepPadding`: every process knows its real rows, and
the step's) and a fingerprint of the step's samples where every process's plan names them (0 elsewhere): a
token budget's step says its real samples over all processes, that the cut padded no part (each process's real
samples are its own plan's) and the fingerprint, which every process checks against its plan
(:mod:`~shardplug.core.dispatch.budget_steps`). What follows depends on the kind:

* ``SAME``: the step's part has the header sent last; ``ROWS``: that header with dim 0 =
  ``rows`` on every leaf; ``HEADER``: a new header follows (pickled: its size, then its bytes,
  broadcast); ``UNEVEN`` (the parts differ in rows, ``even_batches=False``, or in shape: each process's
  own batch, padded by its collate to its own longest row): part 0's header and every part's leaf specs
  follow (pickled), each process reading its own. Then, in this order: the leaves that travel pickled (their
  sizes broadcast, then one ``scatter``, when there are any), and every tensor leaf -- through process 0's
  shared-memory ring for the processes of its host (nothing on the group), else a point-to-point
  send tagged :data:`SEND_TAG` (CPU groups, and uneven parts) or a ``scatter`` (GPU groups).
  Every process then sends process 0 a receipt (:data:`ACK_TAG`), or counts it in shared memory.
  The message of a pass's last step (``last``) and ``END`` are followed, where the shuffle draws from a
  generator, by process 0's state of that generator (pickled, broadcast), which the others take: only
  process 0's reading advanced it.
* ``END``: the pass had no step; ``CLOSE``: process 0 left the pass early (nothing follows).
* ``ERROR``: process 0 could not read or dispatch a step; the error text follows (pickled).

A header is ``(skeleton of the nested batch, (dtype, shape) of every leaf of one part, the ring
of every process on process 0's host: (process, path, slots, slot bytes))``; it is pickled only
when it changes (once per pass for constant shapes). ``last`` says whether the step is the
pass's last (process 0 reads one step ahead); ``slot`` is the ring slot the step's rows are in.

Example::

    >>> header = (None, [(torch.int64, (4, 3))], ())
    >>> control_for(header, None), control_for(header, header)
    ((2, 0), (0, 0))
    >>> control_for(with_rows(header, 2), header)  # only the rows changed: no header pickled
    (1, 2)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from shardplug.core._internal.rows import OBJECT, leaf_spec
from shardplug.core.dispatch.dispatch_plan import DispatchError, StepPadding

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["DispatchError", "DispatchStats"]


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


SAME, ROWS, HEADER, END, ERROR, CLOSE, UNEVEN = range(7)
"""Kinds of the message process 0 broadcasts before every step (see the module's description)."""

CONTROL_SIZE = 9
"""The message: (kind, process 0's pass number, rows, whether this step is the pass's last, the
ring slot its rows are in, and where the step's padding begins: its real rows over all processes,
the first process whose part holds padding, that part's real rows; and the fingerprint of the step's
samples, where the plan names them, else 0)."""

SEND_TAG = 0x5350
"""Tag of the point-to-point sends of rows (gloo), apart from the user's own sends."""

ACK_TAG = 0x5351
"""Tag of the receipts the other processes send process 0 for every step."""

Header = tuple[Any, list[tuple[Any, Any]], tuple[tuple[int, str, int, int], ...]]
"""(skeleton of the nested batch, (dtype, shape) of every leaf of one process's part, the
shared-memory ring of every process on process 0's host: (process, path, slots, slot bytes))."""


Specs = list[tuple[Any, Any]]
"""(dtype, shape) of every leaf of one process's part."""


class Step(NamedTuple):
    """Process 0: one step read and cut, ready to send."""

    own: Any  # process 0's part, as handed out
    parts: list[list[Any]]  # every process's part as leaves (tensors contiguous, on the group's device)
    header: tuple[Any, Specs]  # part 0's skeleton and leaf specs
    specs: list[Specs]  # every part's leaf specs (their rows, and shapes that may differ: see UNEVEN)
    slot: int  # the ring slot the step's rows take (processes of process 0's host)
    padding: StepPadding  # where the step's padding begins

    @property
    def uneven(self) -> bool:
        """Whether the parts differ in rows or in shape: every part's specs are sent (``UNEVEN``)."""
        return any(specs != self.specs[0] for specs in self.specs[1:])


class Message(NamedTuple):
    """The message before a step, as received."""

    kind: int
    number: int  # process 0's pass number
    rows: int
    last: int
    slot: int
    real: int
    part: int
    part_rows: int
    samples: int

    @property
    def padding(self) -> StepPadding:
        """Where the step's padding begins (see :class:`~shardplug.core.dispatch.dispatch_plan.StepPadding`)."""
        return StepPadding(self.real, self.part, self.part_rows, self.samples)


NO_STEP = StepPadding(0, 0, 0)
"""Where no step follows (``END``, ``CLOSE``, ``ERROR``): no rows, no padding."""


def new_control(device: torch.device) -> torch.Tensor:
    """The buffer a message is broadcast in."""
    return torch.zeros(CONTROL_SIZE, dtype=torch.int64, device=device)


def announce(
    control: torch.Tensor,
    kind: int,
    pass_number: int,
    rows: int = 0,
    last: bool = False,
    slot: int = 0,
    padding: StepPadding = NO_STEP,
    *,
    group: ProcessGroup | None,
    async_op: bool = False,
) -> Any:
    """Process 0: broadcast the message of the coming step (its work when ``async_op``)."""
    control[0], control[1], control[2], control[3], control[4] = kind, pass_number, rows, int(last), slot
    control[5], control[6], control[7], control[8] = padding
    work = dist.broadcast(control, src=0, group=group, async_op=async_op)
    return work if async_op else _Done()


def error_text(exc: BaseException) -> str:
    """What follows an ``ERROR`` message: the error process 0 raises, in words."""
    return f"{type(exc).__name__}: {exc}"


def control_for(header: Header, sent: Header | None) -> tuple[int, int]:
    """How to tell the other processes about ``header`` when ``sent`` is what they know."""
    if sent is None:
        return HEADER, 0
    if header == sent:
        return SAME, 0
    rows = {shape[0] for dtype, shape in header[1] if dtype != OBJECT}
    if len(rows) == 1 and with_rows(sent, next(iter(rows))) == header:
        return ROWS, next(iter(rows))
    return HEADER, 0


def with_specs(header: Header, specs: Specs) -> Header:
    """``header`` with the leaf ``specs`` of another process's part (an ``UNEVEN`` step)."""
    skeleton, _, rings = header
    return skeleton, specs, rings


def with_rows(header: Header, rows: int) -> Header:
    """``header`` with ``rows`` rows on every tensor leaf."""
    skeleton, specs, rings = header
    return (
        skeleton,
        [(dtype, shape if dtype == OBJECT else (rows,) + tuple(shape[1:])) for dtype, shape in specs],
        rings,
    )


def has_objects(specs: list[tuple[Any, Any]]) -> bool:
    """Whether some leaves of a part travel pickled."""
    return any(dtype == OBJECT for dtype, _ in specs)


def objects(leaves: list[Any]) -> list[Any]:
    """The leaves of one part that travel pickled (everything but tensors with rows)."""
    return [leaf for leaf in leaves if leaf_spec(leaf)[0] == OBJECT]


def tensors(leaves: list[Any]) -> list[Any]:
    """The leaves of one part that travel as tensors (through a ring or the process group)."""
    return [leaf for leaf in leaves if leaf_spec(leaf)[0] != OBJECT]


def transportable(leaf: Any, device: torch.device) -> Any:
    """A tensor leaf ready to send (contiguous, on the group's device); other leaves as they are."""
    if leaf_spec(leaf)[0] == OBJECT:
        return leaf
    return leaf.contiguous().to(device)


class _Done:
    """A finished collective."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
