"""A prepared loader's place in its epochs, as values: its :class:`Cursor`.

One cursor per loader (``loader.cursor``) owns everything that describes where the loader stands: its
epoch, where its next pass starts (a loaded position, the ``set_epoch`` decision about it, a
``skip_first_batches`` skip, a ``StatefulDataLoader`` state that repositions it: the one place a start
is parked), the pass in progress or the last one (a :class:`PassState`: where it started, what it
handed out, whether it ended) and the lengths that follow from them (:class:`PassLengths`: how many
batches a pass yields after a place in its epoch, the plan's count, else the ``DataLoader``'s own).  It
holds values only: no reference to its loader, so a loader and its cursor are no cycle.

Where a pass that begins starts is placed here too (:func:`place`: the parked start as a :class:`PassStart`,
told to the plan's :meth:`~shardplug.core.sharding.shard_plan.ShardPlan.start_after`), and so are the lengths.

A ``skip_first_batches`` copy of a loader shares its cursor through a :class:`SkipView`, which only
adds its own skip: the copy's passes are the loader's (its epoch, its position) without writing
another loader's fields.

Example::

    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.local import LocalPlan
    >>> cursor = Cursor(skip=2)
    >>> cursor.next_start(LocalPlan(ShardLayout(batch_size=2))), cursor.now.yielded
    (2, 0)
    >>> cursor.take_start().skip, cursor.skip
    (2, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset

from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import InnerState
from shardplug.core.sharding.shard_plan import PassRecord, ShardPlan, consumed_after, own_batches_before, plan_traits

__all__ = ["Cursor", "PassState", "ParkedStart", "SkipView", "PassStart", "place", "batches_before", "PassLengths"]


class ParkedStart(NamedTuple):
    """The start parked for the next pass, as it takes it: ``position`` (loaded), ``ended`` (the rest of an
    epoch whose end was loaded: an empty pass), ``skip`` (batches later still), ``repositions`` (a
    ``StatefulDataLoader`` state of its own was loaded: it repositions the pass)."""

    position: Position | None = None
    ended: bool = False
    skip: int = 0
    repositions: bool = False


class PassState:
    """One pass's counters (the pass in progress, or the last one): the only place they are kept.

    ``record.started_at``: how much of the epoch (in the plan's unit) was consumed before the pass (kept in
    the plan's :class:`~shardplug.core.sharding.shard_plan.PassRecord`, which the plan reads); ``resumed``: this
    process's batches of the epoch before it; ``yielded``: this process's batches of the epoch handed out
    so far (``resumed`` included); ``total``: the pass's last batch counted the same way, where the plan's
    length is exact; ``length``: what ``len()`` said when the pass began.
    """

    __slots__ = (
        "open",
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

    def __init__(self, record: PassRecord | None = None) -> None:
        self.open = False  # begun and not yet ended: len() is this pass's
        self.resumed = 0
        self.yielded = 0
        self.complete = False  # its last batch was handed out
        self.exhausted = False  # the loop over it ended by itself (StopIteration)
        self.empty = False  # the rest of an epoch whose end was loaded: the DataLoader is not read
        self.end_of_dataloader = False
        self.length: int | None = None
        self.total: int | None = None
        self.record = record if record is not None else PassRecord()
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
    (``position``, ``ended``, ``skip``, ``repositions``), ``now`` (the pass in progress
    or the last one), ``inner`` (the ``StatefulDataLoader``'s snapshot)."""

    __slots__ = ("epoch", "position", "ended", "skip", "repositions", "now", "inner")

    def __init__(self, skip: int = 0) -> None:
        self.epoch = 0
        self.position: Position | None = None
        self.ended = False
        self.skip = skip
        self.repositions = False
        self.now = PassState()
        self.inner = InnerState()

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in Cursor.__slots__}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)

    # -- the parked start -------------------------------------------------------------------
    def park(self, position: Position, repositions: bool = False) -> None:
        """The next pass starts after ``position`` (a skip parked before is dropped)."""
        self.position, self.skip, self.repositions = position, 0, repositions

    def take_start(self) -> ParkedStart:
        """The start parked for the pass that begins now; nothing stays parked."""
        taken = ParkedStart(self.position, self.ended, self.skip, self.repositions)
        self.position, self.ended, self.skip, self.repositions = None, False, 0, False
        return taken

    def next_start(self, plan: ShardPlan) -> int:
        """Where (in ``plan``'s unit) the pass in progress started, or where the next one starts."""
        if self.now.open:
            return self.now.record.started_at
        start = self.position.consumed if self.position is not None else 0
        return consumed_after(plan, start, self.skip) if self.skip else start

    def end_finished_pass(self) -> bool:
        """End the pass in progress if its last batch was handed out: its loop has not asked for more (a loop
        that stops at ``len()``: Lightning's, Ignite's, ``next()`` ``len()`` times) and never will, as the next
        epoch begins. Until then ``len()`` stays that pass's (a loop reads it during the last batch, to know it
        is the last); from then on it is the next pass's. Nothing else changes: the position already stood at
        the next epoch's start, and the next pass begins that epoch as after a pass that ran out. Whether a pass
        was ended."""
        now = self.now
        if not (now.open and now.complete):
            return False
        now.open = False
        return True

    def enter_epoch(self, epoch: int) -> None:
        """The loader is set to ``epoch`` (``set_epoch``, as a user's loop does before each pass): what becomes
        of a loaded position not iterated yet is decided before anything changes; a pass in progress whose last
        batch was handed out is over (:meth:`end_finished_pass`), another one is then not the epoch's end, and
        outside a pass nothing of the last pass is this epoch's (the loader stands at ``epoch``'s start).

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
        self.end_finished_pass()  # its batches are no part of ``epoch``
        if self.now.open:
            self.now.complete = False  # the next pass is this epoch
        else:
            self.now = PassState()
        self.epoch = epoch

    # -- lengths ----------------------------------------------------------------------------
    def length(self, lengths: PassLengths) -> int:
        """Batches the pass yields: the pass in progress while one is open (also while its last batch is
        processed), else the next one (see :meth:`end_finished_pass`)."""
        now = self.now
        if now.open:
            return 0 if now.empty else max(lengths.batches_after(now.record.started_at), 0)
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
                rest = lengths.batches_after(self.now.record.started_at)
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


# -- where a pass starts ----------------------------------------------------------------------------
class PassStart(NamedTuple):
    """Where a pass starts: ``consumed_at_start`` (the epoch consumed before it, in the plan's unit),
    ``resumed`` (this process's batches of the epoch before it), ``discard`` (batches to read and drop
    first), ``fast_forwarded`` (batches drawn before the first one handed out, whose records are not the
    batches handed out) and ``empty`` (the rest of an epoch whose end was loaded: nothing is read)."""

    consumed_at_start: int = 0
    resumed: int = 0
    discard: int = 0
    fast_forwarded: int = 0
    empty: bool = False


def place(plan: ShardPlan, parked: ParkedStart, reads_through: bool, workers_split_stream: bool) -> PassStart:
    """Where a pass of a loader with ``plan`` that begins starts: after the ``parked`` position and its skip
    (``reads_through``: a skip is read through the loader's ``StatefulDataLoader``, whose state then counts the
    batches; ``workers_split_stream``: only whole batches tell where each DataLoader worker is).  The plan is
    told where its batches start (:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.start_after`).

    Example::

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> from shardplug.core.sharding.layout import ShardLayout
        >>> from shardplug.core.sharding.map_style import BatchSamplerPlan
        >>> batches = BatchSampler(SequentialSampler(range(12)), 2, False)
        >>> plan = BatchSamplerPlan(batches, ShardLayout(2, 0, batch_size=2))
        >>> place(plan, ParkedStart(skip=2), reads_through=False, workers_split_stream=False)
        PassStart(consumed_at_start=4, resumed=2, discard=0, fast_forwarded=0, empty=False)
    """
    if parked.ended:  # the rest of an epoch whose end was loaded: nothing (the DataLoader is not read)
        return PassStart(empty=True)
    position, skip = parked.position, parked.skip
    start = PassStart()
    if position is not None:
        start = _start_after(plan, position, parked.repositions, workers_split_stream)
    if skip:  # skip_first_batches: this pass starts that many batches later still
        consumed = consumed_after(plan, start.consumed_at_start, skip)
        start = start._replace(consumed_at_start=consumed, resumed=start.resumed + skip)
        if reads_through:  # read through the StatefulDataLoader: its state counts them
            start = start._replace(discard=start.discard + skip, fast_forwarded=start.fast_forwarded + skip)
        elif workers_split_stream:  # only whole batches tell where each worker is: read and drop them
            start = start._replace(discard=start.discard + skip)
        else:
            start = start._replace(discard=plan.start_after(consumed))
    return start


def batches_before(plan: ShardPlan, consumed: int) -> int:
    """The batches of the epoch before ``consumed`` (of another layout's position) counted on ``plan``'s layout,
    the same on every process (a position is): this process's, where every process yields as many batches
    (padding, ``drop_last``); else the whole steps of this layout the place holds (``even_batches=False``: the
    processes' own counts differ by where the saved layout's leftovers fell, never by more than a step).

    Example (21 samples in batches of 3, a place after 3 global batches of 7, 2 processes)::

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> from shardplug.core.sharding.layout import ShardLayout
        >>> from shardplug.core.sharding.map_style import BatchSamplerPlan
        >>> def placed(index, even):
        ...     layout = ShardLayout(2, index, even_batches=even, batch_size=3)
        ...     return batches_before(BatchSamplerPlan(BatchSampler(SequentialSampler(range(21)), 3, False), layout), 3)
        >>> [placed(index, even=True) for index in range(2)], [placed(index, even=False) for index in range(2)]
        ([2, 2], [1, 1])
    """
    own = own_batches_before(plan, consumed)
    if own is not None:  # the plan counts them itself (a token budget's: without counting both whole)
        return own
    layout = plan.layout
    full, rest = plan.num_batches(0), plan.num_batches(consumed)
    equal = layout.pads or layout.drop_last or layout.num_processes == 1 or plan_traits(plan).plans_steps
    if full is None or rest is None or not equal:
        return consumed // plan.consumed_per_batch
    return max(full - rest, 0)


def _start_after(plan: ShardPlan, position: Position, repositions: bool, workers_split_stream: bool) -> PassStart:
    """The start after what ``position`` consumed (``repositions``: a StatefulDataLoader loaded its own state,
    which places the pass)."""
    layout = plan.layout
    consumed = position.consumed
    if repositions:  # a StatefulDataLoader that loaded its own state
        # drawn (and logged where the sampler logs), never handed out
        return PassStart(consumed, position.batches_yielded, fast_forwarded=position.batches_yielded)
    if (position.num_processes, position.split_batches) == (layout.num_processes, layout.split_batches):
        if workers_split_stream:  # only whole batches tell where each worker is: read and drop them
            return PassStart(consumed, position.batches_yielded, discard=position.batches_yielded)
        resumed = position.batches_yielded
    else:
        resumed = batches_before(plan, consumed)
    return PassStart(consumed, resumed, discard=plan.start_after(consumed, position.dataset_state))


# -- lengths ---------------------------------------------------------------------------------------
_WITHOUT_LEN = "iterate without len() (for batch in loader: ..., with a step budget of your own where one is needed)"


def _user_stream(dataset: Any) -> Any:
    """The user's stream under shardplug's wrappers of it (each keeps it as ``.dataset``)."""
    while type(dataset).__module__.startswith("shardplug.") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


class PassLengths:
    """The lengths of the passes of a loader with ``plan`` (what ``len()`` of a loader answers): the plan counts
    them (:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.num_batches`); where it cannot, ``inner_length``
    (the ``DataLoader``'s own ``len()``, which may raise ``TypeError``) is the answer, except where the plan
    agrees its step counts while reading: a ``TypeError`` then says how to iterate without ``len()``.
    ``dataset`` is the loader's dataset (named in the refusal).

    Example::

        >>> from shardplug.core.sharding.layout import ShardLayout
        >>> from shardplug.core.sharding.local import LocalPlan
        >>> lengths = PassLengths(LocalPlan(ShardLayout(batch_size=2), length=5), inner_length=lambda: 5, dataset=None)
        >>> lengths.batches_after(2), lengths.epoch_length()
        (3, 5)
    """

    __slots__ = ("plan", "inner_length", "dataset")

    def __init__(self, plan: ShardPlan, inner_length: Callable[[], int], dataset: Any) -> None:
        self.plan = plan
        self.inner_length = inner_length
        self.dataset = dataset

    def batches_after(self, consumed: int) -> int:
        """Batches of a pass that starts after ``consumed`` (``TypeError`` when unknown)."""
        plan = self.plan
        length = plan.num_batches(consumed)
        if length is not None:
            return length
        if plan_traits(plan).agrees_steps:  # the DataLoader's count is not the agreed one
            raise TypeError(
                "the number of batches of this natively sharded stream is agreed while it is read (its parts "
                "have no len(), or DataLoader workers split them in a way shardplug cannot count), so len() is "
                f"unknown; {_WITHOUT_LEN}"
            )
        try:
            return self.inner_length()  # the DataLoader's own answer
        except TypeError:
            stream = _user_stream(self.dataset)
            if not isinstance(stream, IterableDataset) or hasattr(stream, "__len__"):
                raise  # a sampler without len() (torch's message names it), or a __len__ that failed
            name = type(stream).__name__
            raise TypeError(
                f"len() of this loader needs the length of its stream, and the {name} has no __len__; give {name} "
                f"a __len__ (the number of elements the whole stream yields), or {_WITHOUT_LEN}"
            ) from None

    def epoch_length(self) -> int | None:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown)."""
        try:
            return self.batches_after(0)
        except TypeError:
            return None
