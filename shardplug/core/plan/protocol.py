"""The protocol every plan answers, the record of one pass, and the helpers they share."""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, Optional, Protocol, Union, runtime_checkable

import torch

from ..layout import ShardLayout
from .arithmetic import EpochHead, EpochOrder

__all__ = ["ShardPlan", "PassRecord", "UNITS", "sized_length"]

UNITS = ("global_batches", "elements", "batches")


def sized_length(obj: Any) -> Optional[int]:
    """``len(obj)``, or ``None`` for an object without one (also when ``__len__`` raises
    ``TypeError`` / ``NotImplementedError``, as unsized ``DataLoader`` and stream wrappers do)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


@runtime_checkable
class ShardPlan(Protocol):
    """What every plan answers, for one process and one epoch."""

    layout: ShardLayout
    unit: str
    """What a position counts: ``"global_batches"``, ``"elements"`` or ``"batches"``."""

    @property
    def consumed_per_batch(self) -> int:
        """How much of the epoch, in ``unit``, the whole job consumes per batch of this process."""

    def epoch_size(self) -> Optional[int]:
        """The epoch's size in ``unit`` (``None`` when unknown before the end, e.g. a stream)."""

    def num_batches(self, consumed: int = 0) -> Optional[int]:
        """Batches this process yields after ``consumed`` (``None`` when unknown without reading)."""

    def finished(self, consumed: int) -> Optional[bool]:
        """Whether no process has a batch left after ``consumed`` (``None`` when unknown)."""

    def samples_before(self, consumed: int) -> Optional[int]:
        """Samples of the epoch the whole job consumed before a pass that starts after ``consumed``
        (``None`` when unknown): where the pass's global batches start, so also what its last one holds."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        """Make the next pass begin after ``consumed`` (one-shot).  Returns how many of the
        loader's batches the loader itself must read and drop (0 when the plan skips them)."""

    untracked_reason: Optional[str]
    """Why batches cannot be told apart from padding (``None``: :meth:`batch_record` works)."""

    reads_ahead: bool
    """The plan reads batches ahead of those handed out (an agreement on when a process runs out): the
    DataLoader's own count and a StatefulDataLoader's state are not the pass's."""

    needs_tags: bool
    """The batches' places cannot be computed: padding tracking tags each element where it is read."""

    def batch_record(self, record: "PassRecord", batch: int) -> tuple[list[int], int]:
        """(indices or stream positions, real count) of the pass's ``batch``-th batch."""

    def pass_batches(self, batches: Iterator[Any], record: "PassRecord") -> Iterator[Any]:
        """The loader's batches of a pass as this plan hands them out (most plans: unchanged)."""


class Unchanged:
    """``pass_batches`` of the plans whose batches come out of the DataLoader as they are handed out."""

    identifies_samples = True
    """Batch records name each sample (dataset indices or stream positions), so an audit can count them."""
    reads_ahead = False
    needs_tags = False

    def pass_batches(self, batches: Iterator[Any], record: "PassRecord") -> Iterator[Any]:
        return batches


class PassRecord:
    """What one pass over a plan handed out: where it started, the epoch's order (padding reads
    its start) and, when ``track`` is set, each batch's indices and number of real samples.

    One record per pass: a pass left early leaves its record behind, never in the next pass.
    """

    __slots__ = ("started_at", "head", "batches")

    def __init__(self, track: bool = False) -> None:
        self.started_at = 0
        self.head: Union[EpochOrder, EpochHead, None] = None
        self.batches: Optional[deque[tuple[list[int], int]]] = deque() if track else None

    def first_indices(self, count: int) -> list[int]:
        """Up to ``count`` first indices of the epoch's order (once the pass has started)."""
        head = self.head
        if isinstance(head, EpochOrder):
            return head.lookup(torch.arange(min(count, head.n), dtype=torch.int64)).tolist()
        return head.first(count) if head is not None else []


def global_batch_samples(layout: ShardLayout, consumed: int) -> Optional[int]:
    """Samples in ``consumed`` global batches (every global batch before a pass's start is full)."""
    return None if layout.batch_size is None else check_consumed(consumed) * layout.batch_size


def check_consumed(consumed: int) -> int:
    if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
        raise ValueError(f"consumed={consumed!r} must be an integer >= 0")
    return consumed
