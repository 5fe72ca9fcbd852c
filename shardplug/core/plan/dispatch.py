"""Dispatch: process 0 reads the global batches, every process receives its rows."""

from __future__ import annotations

from typing import Any, Optional

from ..layout import ShardLayout
from .protocol import PassRecord, ShardPlan, Unchanged, check_consumed, global_batch_samples

__all__ = ["DispatchPlan"]


class DispatchPlan(Unchanged):
    """Process 0 reads the global batches; each step takes one of them (splitting) or ``N``, and
    every process receives its rows.  ``length`` is the number of global batches per epoch;
    ``source`` the plan of process 0's global batches (it skips them on a resume), or ``None``
    when they are read and dropped."""

    unit = "global_batches"
    identifies_samples = False
    untracked_reason = (
        "dispatch_batches=True: only process 0 reads indices, so padding is not tracked per batch; use "
        "loader.remainder for the real rows of the last step, or dispatch_batches=False"
    )

    def __init__(self, layout: ShardLayout, length: Optional[int] = None, source: Optional[ShardPlan] = None) -> None:
        self.layout = layout
        self.length = length
        self.source = source

    @property
    def sampler(self) -> Any:
        """The index sampler of process 0's global batches: its source's (``None`` for a stream).
        The loader finds the shuffle to seed, save and restore through it, as for any plan."""
        return getattr(self.source, "sampler", None)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        if self.source is not None:
            return self.source.start_after(consumed)
        return check_consumed(consumed)

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int], int]:
        raise ValueError(self.untracked_reason)

    @property
    def consumed_per_batch(self) -> int:
        return self.layout.batches_per_step

    def epoch_size(self) -> Optional[int]:
        return self.length

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        if self.length is None:
            return None
        rest = max(self.length - check_consumed(consumed), 0)
        per_step = self.consumed_per_batch
        return rest // per_step if self.layout.drop_last else -(-rest // per_step)

    def samples_before(self, consumed: int) -> Optional[int]:
        return global_batch_samples(self.layout, consumed)

    def finished(self, consumed: int) -> Optional[bool]:
        rest = self.num_batches(consumed)
        return None if rest is None else rest == 0

    # -- answers of the loader's protocol (position keeping, pass start) --
    inner_state_resumes = False
    """Process 0 reads a step ahead (its announcement says whether a step is the pass's last), so a
    ``StatefulDataLoader``'s own state is past the step handed out last (and the other processes'
    states never moved): a resume skips by the position (by index for map-style data, by reading past
    the global batches of a stream), which is exact."""

    @property
    def stream(self) -> bool:
        """Process 0 reads a stream (its global batches are read and dropped on a resume: no ``source``)."""
        return self.source is None
