"""Where a loader's next pass starts: a loaded position not iterated yet, and ``skip_first_batches``.

A position loaded between passes waits in a :class:`PendingStart` until the next pass begins, which
takes it (one-shot).  ``set_epoch`` decides, before anything changes, what becomes of it
(:meth:`PendingStart.enter_epoch`).

Example::

    >>> start = PendingStart(skip=2)
    >>> start.next_start(), start.skip
    (0, 2)
    >>> start.forget(); start.skip
    0
"""

from __future__ import annotations

from shardplug.core.resume.position import Position

__all__ = ["PendingStart"]


class PendingStart:
    """The start of the next pass.

    ``position``: a loaded position, applied when the next pass starts; ``ended``: that position (an
    epoch's start) is reached as the end of the epoch before it, so the next pass is empty
    (:meth:`enter_epoch`); ``skip``: batches the next pass starts later still (``skip_first_batches``);
    ``epoch_ended``: the position was saved inside the epoch before it, whose rest has no batch on this
    layout (the accumulation cycle it was saved in ends with that epoch).
    """

    __slots__ = ("position", "ended", "skip", "epoch_ended")

    def __init__(self, skip: int = 0) -> None:
        self.position: Position | None = None
        self.ended = False
        self.skip = skip
        self.epoch_ended = False

    def __copy__(self) -> PendingStart:
        new = PendingStart(self.skip)
        new.position, new.ended, new.epoch_ended = self.position, self.ended, self.epoch_ended
        return new

    def forget(self) -> None:
        """The loader follows another loader's pass (its copy's): nothing of its own is pending."""
        self.position, self.ended, self.skip, self.epoch_ended = None, False, 0, False

    def load(self, position: Position, epoch_ended: bool = False) -> None:
        """The next pass starts after ``position`` (a skip pending before is dropped; ``epoch_ended``: see the
        class)."""
        self.position, self.skip, self.epoch_ended = position, 0, epoch_ended

    def next_start(self) -> int:
        """Where (in the plan's unit) the next pass starts, before any skip."""
        return self.position.consumed if self.position is not None else 0

    def take(self) -> tuple[Position | None, bool, int]:
        """``(position, ended, skip)`` for the pass that begins now; nothing stays pending."""
        taken = (self.position, self.ended, self.skip)
        self.forget()
        return taken

    def enter_epoch(self, epoch: int) -> None:
        """The loader is set to ``epoch`` (``set_epoch``, as a user's loop does before each pass): what becomes
        of a loaded position not iterated yet, decided before anything changes.

        * its own epoch: the next pass resumes it;
        * a position at an epoch's start is also the end of the epoch before it: ``set_epoch`` of that
          epoch (the one the position was saved in, while its last pass was still open) makes the next
          pass that epoch's rest, which is empty; the pass after it is the position's epoch;
        * another epoch from its start: the position no longer applies (its shuffle seeds stay);
        * a position inside another epoch is refused: its place is in that epoch's order only.
        """
        self.ended = False
        pending = self.position
        if pending is None or epoch == pending.epoch:
            return
        if (pending.consumed, pending.batches_yielded) != (0, 0):
            raise ValueError(
                f"set_epoch({epoch}) after loading a position inside epoch {pending.epoch} (consumed="
                f"{pending.consumed} {pending.unit}): its place is in epoch {pending.epoch}'s order, and the pass "
                f"would resume in another epoch's; call set_epoch({pending.epoch}) (the loaded position's epoch, "
                "as loader.epoch already says) for the pass that resumes it, or load a position of epoch "
                f"{epoch}"
            )
        if epoch == pending.epoch - 1:
            self.ended = True
            return
        self.position = None
