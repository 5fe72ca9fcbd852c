"""The protocol every plan answers, the record of one pass, and the helpers they share."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from shardplug.core.sharding.arithmetic import EpochHead, EpochOrder
from shardplug.core.sharding.layout import ShardLayout

__all__ = ["ShardPlan", "PlanDefaults", "PassRecord", "UNITS", "sized_length"]

UNITS = ("global_batches", "elements", "batches")


def sized_length(obj: Any) -> int | None:
    """``len(obj)``, or ``None`` for an object without one (also when ``__len__`` raises
    ``TypeError`` / ``NotImplementedError``, as unsized ``DataLoader`` and stream wrappers do)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


@runtime_checkable
class ShardPlan(Protocol):
    """What every plan answers, for one process and one epoch.

    The loader asks its plan everything that differs between kinds of sharding: how many batches,
    where a pass starts (:meth:`start_after`, the one place a position is loaded into the plan, with
    :meth:`saved_state` its saved half), what a position names (:attr:`stream`, :attr:`sampler`) and
    how a pass's batches are read (:meth:`begin_pass`, :meth:`start_in_workers`, :meth:`pass_batches`).
    """

    layout: ShardLayout
    unit: str
    """What a position counts: ``"global_batches"``, ``"elements"`` or ``"batches"``."""

    # read-only to the loader: plans answer these with class attributes or properties
    @property
    def stream(self) -> bool:
        """The plan shares out a stream (an iterable dataset): a position names no sampler and no dataset
        length (its ``sampler`` is ``"stream"``)."""

    @property
    def sampler(self) -> Any:
        """The index sampler whose order the plan shares out (``None`` for a stream): the shuffle whose
        seed is agreed and saved, or whose generator's state a position records."""

    @property
    def consumed_per_batch(self) -> int:
        """How much of the epoch, in ``unit``, the whole job consumes per batch of this process."""

    def epoch_size(self) -> int | None:
        """The epoch's size in ``unit`` (``None`` when unknown before the end, e.g. a stream)."""

    def num_batches(self, consumed: int = 0) -> int | None:
        """Batches this process yields after ``consumed`` (``None`` when unknown without reading)."""

    exact_length: bool
    """:meth:`num_batches` is what a pass yields (computed from indices): its last batch is known by
    counting. ``False`` where the data may end elsewhere than its ``len()`` says (a stream): the loader
    reads one batch ahead to know the last one."""

    def finished(self, consumed: int) -> bool | None:
        """Whether no process has a batch left after ``consumed`` (``None`` when unknown)."""

    first_holds_most: bool
    """Process 0 holds at least as many batches as any other (a short last global batch goes to the first
    processes): once its pass has handed out its last batch, no process has one left, also where
    :meth:`finished` cannot tell (the stream's end is read in DataLoader workers)."""

    def samples_before(self, consumed: int) -> int | None:
        """Samples of the epoch the whole job consumed before a pass that starts after ``consumed``
        (``None`` when unknown): where the pass's global batches start, so also what its last one holds."""

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        """Make the next pass begin after ``consumed`` (one-shot), ``dataset_state`` being what
        :meth:`saved_state` gave for that place.  Returns how many of the loader's batches the
        loader itself must read and drop (0 when the plan skips them)."""

    def saved_state(self, consumed: int) -> Any:
        """This plan's own part of a position saved after ``consumed`` inside an epoch (the position's
        ``dataset_state``, which :meth:`start_after` takes back); ``None``: the counters say it all."""

    def start_in_workers(self, num_workers: int) -> contextlib.AbstractContextManager[bool]:
        """The context in which the loader starts its pass's reader (``iter()`` of the DataLoader, which
        starts its ``num_workers`` workers with copies of the plan): it yields whether a start set by
        :meth:`start_after` waits to be taken in the workers (persistent workers, started before, would
        miss it: the loader then starts new ones), and on leaving takes that start off this process's
        plan (the workers' copies carry it into this pass only).  Where the start is taken in the
        loader's process it yields ``False`` and does nothing."""

    def begin_pass(self) -> None:
        """A pass starts (in the loader's process, before its reader starts): what the plan keeps of the
        previous one no longer counts."""

    @property
    def untracked_reason(self) -> str | None:
        """Why batches cannot be told apart from padding (``None``: :meth:`batch_record` works)."""

    identifies_samples: bool
    """Batch records name each sample (dataset indices or stream positions), so an audit can count them
    (:class:`PlanDefaults` answers ``True``)."""

    reads_ahead: bool
    """The plan reads batches ahead of those handed out (an agreement on when a process runs out): the
    DataLoader's own count and a StatefulDataLoader's state are not the pass's."""

    inner_state_resumes: bool
    """A ``StatefulDataLoader``'s own state, saved after the batches handed out, is where a resumed pass
    continues (the batches are handed out as the DataLoader yields them).  ``False`` where batches are
    read ahead of those handed out: a resume then skips by the position alone."""

    splits_by_worker: bool
    """The data splits itself across DataLoader workers (each worker reads its own part, padded from its
    own start): with workers, a place inside an epoch is found only by reading whole batches of the
    layout that saved it, with as many workers."""

    needs_tags: bool
    """The batches' places cannot be computed: padding tracking tags each element where it is read."""

    def start_tagging(self) -> bool:
        """Have the readers tag each element (where :attr:`needs_tags`); ``True`` when that starts now
        (the loader then collates through :class:`~shardplug.core.padding.marks.TagCollate`, with new workers)."""

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        """(indices or stream positions, real count) of the pass's ``batch``-th batch handed out
        (``None`` for the indices where the plan has none: a stream that sharded itself)."""

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The loader's batches of a pass as this plan hands them out (most plans: unchanged)."""


class PlanDefaults:
    """What most plans answer alike: batches come out of the DataLoader as they are handed out, the
    start is taken in the loader's process, nothing beyond the counters is saved."""

    identifies_samples = True
    """Batch records name each sample (dataset indices or stream positions), so an audit can count them."""
    reads_ahead = False
    first_holds_most = False
    inner_state_resumes = True
    splits_by_worker = False
    exact_length = False
    needs_tags = False
    sampler: Any = None

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        return batches

    def begin_pass(self) -> None:
        pass

    def saved_state(self, consumed: int) -> Any:
        return None

    def start_in_workers(self, num_workers: int) -> contextlib.AbstractContextManager[bool]:
        return contextlib.nullcontext(False)

    def start_tagging(self) -> bool:
        return False


class PassRecord:
    """What one pass over a plan handed out: where it started, the epoch's order (padding reads
    its start) and, when ``track`` is set, each batch's indices and number of real samples.

    ``fast_forwarded``: batches of the pass the DataLoader drew but never hands out (a
    ``StatefulDataLoader`` fast-forwarding to its loaded state): a plan that records a batch where
    its indices are drawn drops their records.

    One record per pass: a pass left early leaves its record behind, never in the next pass.
    """

    __slots__ = ("started_at", "head", "batches", "fast_forwarded")

    def __init__(self, track: bool = False) -> None:
        self.started_at = 0
        self.head: EpochOrder | EpochHead | None = None
        self.batches: deque[tuple[list[int], int]] | None = deque() if track else None
        self.fast_forwarded = 0

    def first_indices(self, count: int) -> list[int]:
        """Up to ``count`` first indices of the epoch's order (once the pass has started)."""
        head = self.head
        if isinstance(head, EpochOrder):
            return head.lookup(torch.arange(min(count, head.n), dtype=torch.int64)).tolist()
        return head.first(count) if head is not None else []


def global_batch_samples(layout: ShardLayout, consumed: int) -> int | None:
    """Samples in ``consumed`` global batches (every global batch before a pass's start is full)."""
    return None if layout.batch_size is None else check_consumed(consumed) * layout.batch_size


def check_consumed(consumed: int) -> int:
    if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
        raise ValueError(f"consumed={consumed!r} must be an integer >= 0")
    return consumed
