"""A prepared loader's place in its epochs, as values: its :class:`Cursor`.

One cursor per loader (``loader.cursor``) owns everything that describes where the loader stands: its
epoch, where its next pass starts (a loaded position, the ``set_epoch`` decision about it, a
``skip_first_batches`` skip, a ``StatefulDataLoader`` state that repositions it: the one place a start
is parked), the pass in progress or the last one (a :class:`PassState`: where it started, what it
handed out, whether it ended) and the lengths that follow from them.  It holds values only: no
reference to its loader, so a loader and its cursor are no cycle.

A ``skip_first_batches`` copy of a loader shares its cursor through a :class:`SkipView`, which only
adds its own skip: the copy's passes are the loader's (its epoch, its position) without writing
another loader's fields.

Example::

    >>> cursor = Cursor(skip=2)
    >>> cursor.next_start(consumed_per_batch=1), cursor.now.yielded
    (2, 0)
    >>> cursor.take_start().skip, cursor.skip
    (2, 0)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from shardplug.core.resume.lengths import PassLengths
from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import InnerState
from shardplug.core.sharding.shard_plan import PassRecord

__all__ = ["Cursor", "PassState", "ParkedStart", "SkipView"]


class ParkedStart(NamedTuple):
    """The start parked for the next pass, as it takes it: ``position`` (loaded), ``ended`` (the rest of an
    epoch whose end was loaded: an empty pass), ``skip`` (batches later still), ``epoch_ended`` (the position
    was saved inside the epoch before it, whose rest has no batch on this layout), ``repositions`` (a
    ``StatefulDataLoader`` state of its own was loaded: it repositions the pass)."""

    position: Position | None = None
    ended: bool = False
    skip: int = 0
    epoch_ended: bool = False
    repositions: bool = False


class PassState:
    """One pass's counters (the pass in progress, or the last one): the only place they are kept.

    ``start``: how much of the epoch (in the plan's unit) was consumed before the pass; ``resumed``: this
    process's batches of the epoch before it; ``yielded``: this process's batches of the epoch handed out
    so far (``resumed`` included); ``total``: the pass's last batch counted the same way, where the plan's
    length is exact; ``length``: what ``len()`` said when the pass began.
    """

    __slots__ = (
        "open",
        "start",
        "resumed",
        "yielded",
        "complete",
        "exhausted",
        "empty",
        "end_of_dataloader",
        "length",
        "total",
        "record",
        "batch_indices",
        "batch_real",
        "generator_state",
    )

    def __init__(self) -> None:
        self.open = False  # begun and not yet ended: len() is this pass's
        self.start = 0
        self.resumed = 0
        self.yielded = 0
        self.complete = False  # its last batch was handed out
        self.exhausted = False  # the loop over it ended by itself (StopIteration)
        self.empty = False  # the rest of an epoch whose end was loaded: the DataLoader is not read
        self.end_of_dataloader = False
        self.length: int | None = None
        self.total: int | None = None
        self.record = PassRecord()
        self.batch_indices: list[int] | None = None
        self.batch_real: int | None = None
        self.generator_state: torch.Tensor | None = None  # the shuffle generator's state at the pass start

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = PassState()
        for name in self.__slots__:
            setattr(self, name, state.get(name, getattr(fresh, name)))


class Cursor:
    """Where one loader stands (see the module docstring): ``epoch``, the parked start of its next pass
    (``position``, ``ended``, ``skip``, ``epoch_ended``, ``repositions``), ``now`` (the pass in progress
    or the last one), ``inner`` (the ``StatefulDataLoader``'s snapshot)."""

    __slots__ = ("epoch", "position", "ended", "skip", "epoch_ended", "repositions", "now", "inner")

    def __init__(self, skip: int = 0) -> None:
        self.epoch = 0
        self.position: Position | None = None
        self.ended = False
        self.skip = skip
        self.epoch_ended = False
        self.repositions = False
        self.now = PassState()
        self.inner = InnerState()

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in Cursor.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    # -- the parked start -------------------------------------------------------------------
    def park(self, position: Position, epoch_ended: bool = False, repositions: bool = False) -> None:
        """The next pass starts after ``position`` (a skip parked before is dropped)."""
        self.position, self.skip, self.epoch_ended = position, 0, epoch_ended
        self.repositions = repositions

    def take_start(self) -> ParkedStart:
        """The start parked for the pass that begins now; nothing stays parked."""
        taken = ParkedStart(self.position, self.ended, self.skip, self.epoch_ended, self.repositions)
        self.position, self.ended, self.skip, self.epoch_ended, self.repositions = None, False, 0, False, False
        return taken

    def next_start(self, consumed_per_batch: int) -> int:
        """Where (in the plan's unit) the pass in progress started, or where the next one starts."""
        if self.now.open:
            return self.now.start
        return (self.position.consumed if self.position is not None else 0) + self.skip * consumed_per_batch

    def enter_epoch(self, epoch: int) -> None:
        """The loader is set to ``epoch`` (``set_epoch``, as a user's loop does before each pass): what becomes
        of a loaded position not iterated yet is decided before anything changes; the pass in progress is
        then not the epoch's end, and outside a pass nothing of the last pass is this epoch's.

        * the position's own epoch: the next pass resumes it;
        * a position at an epoch's start is also the end of the epoch before it: ``set_epoch`` of that
          epoch (the one the position was saved in, while its last pass was still open) makes the next
          pass that epoch's rest, which is empty; the pass after it is the position's epoch;
        * another epoch from its start: the position no longer applies (its shuffle seeds stay);
        * a position inside another epoch is refused: its place is in that epoch's order only.
        """
        self.ended = False
        parked = self.position
        if parked is not None and epoch != parked.epoch:
            if (parked.consumed, parked.batches_yielded) != (0, 0):
                raise ValueError(
                    f"set_epoch({epoch}) after loading a position inside epoch {parked.epoch} (consumed="
                    f"{parked.consumed} {parked.unit}): its place is in epoch {parked.epoch}'s order, and the pass "
                    f"would resume in another epoch's; call set_epoch({parked.epoch}) (the loaded position's epoch, "
                    "as loader.epoch already says) for the pass that resumes it, or load a position of epoch "
                    f"{epoch}"
                )
            if epoch == parked.epoch - 1:
                self.ended = True
            else:
                self.position = None
        if self.now.open:
            self.now.complete = False  # the next pass is this epoch
        else:
            self.now = PassState()
        self.epoch = epoch

    # -- lengths ----------------------------------------------------------------------------
    def length(self, lengths: PassLengths) -> int:
        """Batches the pass yields: the pass in progress while one is open, else the next one."""
        now = self.now
        if now.open:
            if now.length is not None:  # counted when the pass began: the same place
                return now.length
            return 0 if now.empty else max(lengths.batches_after(now.start), 0)
        if self.ended:
            return 0
        start = self.position.consumed if self.position is not None else 0
        return max(lengths.batches_after(start) - self.skip, 0)

    def resumed_batches(self, lengths: PassLengths) -> int:
        """Batches of the epoch that a resumed pass does not yield, counted on this layout (see
        :attr:`~shardplug.core.loader.resume_state.ResumeState.resumed_batches`)."""
        total = lengths.epoch_length()
        if total is None:
            return 0
        try:
            if self.position is not None:
                rest = self.length(lengths)
            else:
                rest = lengths.batches_after(self.now.start)
        except TypeError:
            return 0
        return max(total - rest, 0)


class SkipView(Cursor):
    """The cursor of a ``skip_first_batches`` copy: ``base`` (the loader's own cursor) with a skip of its
    own.  Everything but the skip is read from and written to ``base``, so the copy's passes are the
    loader's: the loader follows them (its epoch, its position), and nothing is copied back."""

    __slots__ = ("base", "own_skip")

    def __init__(self, base: Cursor, skip: int) -> None:  # noqa: D107 (no Cursor.__init__: the fields are base's)
        object.__setattr__(self, "base", base.base if isinstance(base, SkipView) else base)
        object.__setattr__(self, "own_skip", skip)

    def __getattribute__(self, name: str) -> Any:
        if name in Cursor.__slots__:
            if name == "skip":
                return object.__getattribute__(self, "own_skip")
            return getattr(object.__getattribute__(self, "base"), name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "skip":
            object.__setattr__(self, "own_skip", value)
            return
        setattr(self.base, name, value)

    def take_start(self) -> ParkedStart:
        taken = super().take_start()
        self.base.skip = 0  # the loader follows this pass: nothing of its own stays parked
        return taken

    def __reduce__(self) -> Any:  # a pickled copy travels alone: a cursor of its own, with the view's skip
        return (_cursor_from_state, (Cursor.__getstate__(self),))


def _cursor_from_state(state: dict[str, Any]) -> Cursor:
    """Unpickling helper: a cursor with ``state``."""
    cursor = Cursor.__new__(Cursor)
    cursor.__setstate__(state)
    return cursor
