"""The protocol every plan answers, the record of one pass, and the helpers they share."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from shardplug.core._internal.arguments import is_int
from shardplug.core.sharding.arithmetic import EpochHead, EpochOrder
from shardplug.core.sharding.layout import ShardLayout

__all__ = [
    "ShardPlan",
    "PlanDefaults",
    "PlanTraits",
    "plan_traits",
    "start_tagging",
    "check_saved_state",
    "sampler_epoch",
    "PassRecord",
    "UNITS",
    "sized_length",
    "consumed_after",
    "own_batches_before",
    "note_place",
    "last_step_real",
]

UNITS = ("global_batches", "elements", "batches", "samples")


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
    What only some plans can do is opt-in (the capability protocols below), read in one place:
    :func:`plan_traits`.
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

    def finished(self, consumed: int) -> bool | None:
        """Whether no process has a batch left after ``consumed`` (``None`` when unknown)."""

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

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        """(indices or stream positions, real count) of the pass's ``batch``-th batch handed out
        (``None`` for the indices where the plan has none: a stream that sharded itself)."""

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The loader's batches of a pass as this plan hands them out (most plans: unchanged)."""


class PlanDefaults:
    """What most plans answer alike: batches come out of the DataLoader as they are handed out, the
    start is taken in the loader's process, nothing beyond the counters is saved."""

    sampler: Any = None

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        return batches

    def begin_pass(self) -> None:
        pass

    def saved_state(self, consumed: int) -> Any:
        return None

    def start_in_workers(self, num_workers: int) -> contextlib.AbstractContextManager[bool]:
        return contextlib.nullcontext(False)


# -- capabilities: opt-in protocols, read by plan_traits() alone ----------------------------------------
@runtime_checkable
class _CountsFromIndices(Protocol):
    """A plan that computes each pass's batches from indices (map-style data): :meth:`ShardPlan.num_batches`
    is exactly what a pass yields, so the pass knows its last batch by counting, without reading ahead."""

    def index_batches(self, consumed: int = 0, record: PassRecord | None = None) -> Iterator[list[int]]: ...


@runtime_checkable
class _LeftoversFirst(Protocol):
    """A plan that gives a short last global batch to the first processes: process 0 holds at least as
    many batches as any other, so once its pass has handed out its last batch no process has one left,
    also where :meth:`ShardPlan.finished` cannot tell (the stream's end is read in DataLoader workers)."""

    first_holds_most: bool


@runtime_checkable
class _NamesSamples(Protocol):
    """A plan whose batch records name each sample (dataset indices or stream positions), so that an
    audit can count them (``identifies_samples``: whether this plan's records do)."""

    identifies_samples: bool


@runtime_checkable
class _StateEverywhere(Protocol):
    """A plan whose saved state (:meth:`ShardPlan.saved_state`) describes its order at every place, an
    epoch's start included (a mixture's weights so far, which a resume with other weights goes on from):
    a position keeps it wherever it stands (``state_everywhere``: whether this plan's does)."""

    state_everywhere: bool


@runtime_checkable
class _AgreesSteps(Protocol):
    """A plan that agrees the step counts of its processes while they read (each reads up to
    ``steps_per_agreement`` batches ahead): the DataLoader's own count is not the pass's, and a position
    counts this process's batches."""

    steps_per_agreement: int


@runtime_checkable
class _ReadsAhead(Protocol):
    """A plan that reads the loader's batches ahead of those it hands out (at most ``read_ahead``): a
    ``StatefulDataLoader``'s own state is then past the place, so a resume skips by the position alone."""

    @property
    def read_ahead(self) -> int: ...


@runtime_checkable
class _WorkerParts(Protocol):
    """A plan over data that may split itself across DataLoader workers (``splits_by_worker``: whether
    this data does; each worker then reads its own part, padded from its own start): with workers, a
    place inside an epoch is found only by reading whole batches of the layout that saved it."""

    splits_by_worker: bool


@runtime_checkable
class _TagsElements(Protocol):
    """A plan whose batches' places may not be computable (a stream without ``len()``): padding
    tracking has its readers tag each element where it is read."""

    def start_tagging(self) -> bool:
        """Have the readers tag each element where the places cannot be computed; ``True`` when that
        starts now (the loader then collates through :class:`~shardplug.core.sharding.marks.TagCollate`,
        with new workers)."""
        ...


@runtime_checkable
class _ChecksState(Protocol):
    """A plan whose saved state (:meth:`ShardPlan.saved_state`) may not fit it (a mixture's, saved with another
    seed): refused with the rest of a position, before anything changes."""

    def check_saved_state(self, state: Any) -> None:
        """Raise a ``ValueError`` naming the fix where ``state`` cannot be loaded into this plan."""
        ...


@runtime_checkable
class _PlansSteps(Protocol):
    """A plan whose steps consume different amounts of the epoch (a token budget's): the place after some of
    this process's batches is the plan's to say, not a multiple of ``consumed_per_batch``."""

    def consumed_after(self, start: int, batches: int) -> int: ...

    def note_place(self, consumed: int, dataset_state: Any, epoch: int) -> Callable[[], None]:
        """A position's place in its ``epoch`` and its own part (what :meth:`ShardPlan.saved_state` gave there),
        read before the position is loaded: the steps after a place may depend on it (raise a ``ValueError``, the
        plan as it was, where it is not one of the epoch's places); until the position's pass begins, the place
        is the position's epoch's (asked before the loader stands at that epoch).  Returns what forgets it, for a
        position then refused: the plan as it was before."""


@runtime_checkable
class _CountsBefore(Protocol):
    """A plan that counts the batches its layout has before another layout's place itself, without counting
    the epoch from its start (a token budget's: its windows before the place are counted, not planned)."""

    def batches_before(self, consumed: int) -> int:
        """The batches of the epoch before ``consumed`` (another layout's position's) on this layout: what
        ``num_batches(0) - num_batches(consumed)`` says, without counting both whole."""
        ...


def note_place(plan: ShardPlan, consumed: int, dataset_state: Any, epoch: int) -> Callable[[], None]:
    """Tell ``plan`` a position's place in its ``epoch`` and its own part before anything is asked about it (see
    :class:`_PlansSteps`); nothing for the plans whose places are their counters alone.  Returns what forgets
    it (call it where the position is refused: the plan is then as it was)."""
    if isinstance(plan, _PlansSteps):
        return plan.note_place(consumed, dataset_state, epoch)
    return _nothing


def _nothing() -> None:
    """Nothing to forget."""


def own_batches_before(plan: ShardPlan, consumed: int) -> int | None:
    """The batches of the epoch before ``consumed`` on ``plan``'s layout where the plan counts them itself
    (:class:`_CountsBefore`); ``None`` for the others (counted from :meth:`ShardPlan.num_batches`)."""
    if isinstance(plan, _CountsBefore):
        return plan.batches_before(consumed)
    return None


def consumed_after(plan: ShardPlan, start: int, batches: int) -> int:
    """The place in the epoch (in ``plan``'s unit) after this process's next ``batches`` batches from ``start``.

    Example::

        >>> from shardplug.core.sharding.local import LocalPlan
        >>> consumed_after(LocalPlan(ShardLayout(batch_size=2)), 3, 2)
        5
    """
    if isinstance(plan, _PlansSteps):
        return plan.consumed_after(start, batches)
    return start + batches * plan.consumed_per_batch


@runtime_checkable
class _CountsLastStep(Protocol):
    """A plan whose last step's real samples are not the epoch's rest modulo a step (a user's
    ``DistributedSampler``: its wrap-around padding and its ``drop_last`` cut lie inside the processes' strides)."""

    def last_step_real(self, consumed: int) -> int: ...


def last_step_real(plan: ShardPlan, consumed: int) -> int | None:
    """Real samples in the last global batch of a pass that starts after ``consumed`` where ``plan`` counts them
    itself (:class:`_CountsLastStep`; 0 when that batch is full); ``None``: the epoch's rest modulo a step tells."""
    return plan.last_step_real(consumed) if isinstance(plan, _CountsLastStep) else None


@runtime_checkable
class _Untracked(Protocol):
    """A plan whose batches cannot be told apart from padding (``untracked_reason`` says why, and what
    to use instead)."""

    untracked_reason: str


@runtime_checkable
class _SamplerEpoch(Protocol):
    """A plan whose order is drawn from its sampler's own epoch, as the user or a front end set it (a user's
    ``DistributedSampler``: native DDP reads its ``epoch`` and never advances it by itself): the loader's epoch
    follows the sampler's (where it is read, and as a pass begins), instead of moving on by itself after a complete
    pass."""

    def sampler_epoch(self) -> int:
        """The epoch the plan's sampler stands at."""
        ...


@dataclass(frozen=True)
class PlanTraits:
    """What a plan can do beyond :class:`ShardPlan` (see the capability protocols above)."""

    exact_length: bool = False
    """:meth:`ShardPlan.num_batches` is what a pass yields (:class:`_CountsFromIndices`)."""
    first_holds_most: bool = False
    """Process 0 holds the most batches (:class:`_LeftoversFirst`)."""
    identifies_samples: bool = False
    """Batch records name the samples (:class:`_NamesSamples`)."""
    agrees_steps: bool = False
    """Step counts are agreed while reading (:class:`_AgreesSteps`)."""
    state_everywhere: bool = False
    """A position keeps the plan's saved state at every place (:class:`_StateEverywhere`)."""
    inner_state_resumes: bool = True
    """A ``StatefulDataLoader``'s own state is where a resumed pass continues (not :class:`_ReadsAhead`)."""
    splits_by_worker: bool = False
    """The data splits itself across DataLoader workers (:class:`_WorkerParts`)."""
    untracked_reason: str | None = None
    """Why padding cannot be tracked (:class:`_Untracked`; ``None``: :meth:`ShardPlan.batch_record` works)."""
    batches_unchanged: bool = False
    """The loader's batches are handed out as they come (:meth:`ShardPlan.pass_batches` is
    :class:`PlanDefaults`'s): a pass need not call it."""
    follows_sampler_epoch: bool = False
    """The loader's epoch is its sampler's own (:class:`_SamplerEpoch`)."""
    plans_steps: bool = False
    """Every process yields as many batches, each step consuming what the plan says (:class:`_PlansSteps`)."""


def plan_traits(plan: ShardPlan) -> PlanTraits:
    """The capabilities ``plan`` opts into, read in this one place.

    Example::

        >>> from shardplug.core.sharding.local import LocalPlan
        >>> traits = plan_traits(LocalPlan(ShardLayout(batch_size=2)))
        >>> traits.exact_length, traits.inner_state_resumes, traits.untracked_reason is not None
        (False, True, True)
        >>> traits.batches_unchanged  # it compares the first batches of the processes as they are read
        False
    """
    return PlanTraits(
        exact_length=isinstance(plan, _CountsFromIndices),
        first_holds_most=isinstance(plan, _LeftoversFirst) and plan.first_holds_most,
        identifies_samples=isinstance(plan, _NamesSamples) and plan.identifies_samples,
        agrees_steps=isinstance(plan, _AgreesSteps),
        state_everywhere=isinstance(plan, _StateEverywhere) and plan.state_everywhere,
        inner_state_resumes=not isinstance(plan, _ReadsAhead),
        splits_by_worker=isinstance(plan, _WorkerParts) and plan.splits_by_worker,
        untracked_reason=plan.untracked_reason if isinstance(plan, _Untracked) else None,
        batches_unchanged=getattr(type(plan), "pass_batches", None) is PlanDefaults.pass_batches,
        follows_sampler_epoch=isinstance(plan, _SamplerEpoch),
        plans_steps=isinstance(plan, _PlansSteps),
    )


def check_saved_state(plan: ShardPlan, state: Any) -> None:
    """Refuse a position's ``dataset_state`` that ``plan`` cannot load (:class:`_ChecksState`); others pass."""
    if state is not None and isinstance(plan, _ChecksState):
        plan.check_saved_state(state)


def sampler_epoch(plan: ShardPlan) -> int | None:
    """The epoch ``plan``'s sampler stands at, where its order is drawn from that epoch (:class:`_SamplerEpoch`);
    ``None`` for every other plan."""
    return plan.sampler_epoch() if isinstance(plan, _SamplerEpoch) else None


def start_tagging(plan: ShardPlan) -> bool:
    """Have ``plan``'s readers tag each element where it can (:class:`_TagsElements`); ``True`` when that
    starts now."""
    return isinstance(plan, _TagsElements) and plan.start_tagging()


class PassRecord:
    """What one pass over a plan handed out: where it started, the epoch's order (padding reads
    its start) and, when ``track`` is set, each batch's indices and number of real samples.

    ``fast_forwarded``: batches of the pass the DataLoader drew but never hands out (a
    ``StatefulDataLoader`` fast-forwarding to its loaded state): a plan that records a batch where
    its indices are drawn drops their records.

    ``step_real``: ``(real samples of the step handed out last over all processes, those of this
    process's part)``, where the pass learns them with the step (a dispatcher's: process 0 reads the
    data and tells the others); ``None`` elsewhere. ``step_samples``: the fingerprint of that step's samples
    the dispatcher's message told, where the plan names them (a token budget's), else 0.

    One record per pass: a pass left early leaves its record behind, never in the next pass.
    """

    __slots__ = ("started_at", "head", "batches", "fast_forwarded", "step_real", "step_samples")

    def __init__(self, track: bool = False) -> None:
        self.started_at = 0
        self.head: EpochOrder | EpochHead | None = None
        self.batches: deque[tuple[list[int], int]] | None = deque() if track else None
        self.fast_forwarded = 0
        self.step_real: tuple[int, int] | None = None
        self.step_samples = 0

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
    if type(consumed) is int and consumed >= 0:  # the common case, without a call
        return consumed
    if not is_int(consumed) or consumed < 0:
        raise ValueError(f"consumed={consumed!r} must be an integer >= 0")
    return consumed
