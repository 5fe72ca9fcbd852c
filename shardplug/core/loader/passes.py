"""One pass over a prepared loader, as a short chain of stages: what torch's ``_BaseDataLoaderIter`` is to
a ``DataLoader``.

``iter(loader)`` returns :func:`run_pass`'s generator; the pass begins at the first ``next()``:

1. :func:`begin` -- the epoch (the next one after a complete pass), the shuffle seeds and RNG states agreed
   with process 0, the start taken from the loader's :class:`~shardplug.core.loader.cursor.Cursor` and
   placed (:func:`~shardplug.core.loader.cursor.place`), the lengths counted once; a new
   :class:`~shardplug.core.loader.cursor.PassState` is the cursor's pass from here on;
2. read from the source: the loader's ``inner_batches`` (the ``DataLoader``, or a dispatcher's steps) as the
   plan hands them out;
3. mark the last batch: by counting where the plan's length is exact, by reading one ahead
   (:func:`looked_ahead`) otherwise, or the source marks it itself (a dispatcher);
4. look ahead: with a prefetch depth, a :class:`~shardplug.core.loader.prefetch.Prefetcher` reads and copies
   batches ahead of the one handed out (:func:`prefetched`);
5. hand out (:class:`HandOut`): count the batch, record its padding, tell the run's gradient state, copy it
   to the device (the options' :class:`~shardplug.core.loader.transfer.DeviceTransfer`).

At its end the pass compares what it yielded with what ``len()`` said when it began
(:class:`LengthMismatchWarning`).  Each pass writes its own :class:`PassState` only: a pass left early and
closed later changes nothing of the next one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Protocol, cast

from shardplug.core.loader.cursor import Cursor, PassLengths, PassStart, PassState, place
from shardplug.core.loader.options import LoaderOptions
from shardplug.core.loader.prefetch import Prefetcher, SideStreamCopy, copy_ahead
from shardplug.core.padding.tracking import PaddingTracker
from shardplug.core.resume.stateful import InnerState
from shardplug.core.sharding.map_style import BatchSamplerPlan
from shardplug.core.sharding.shard_plan import PassRecord, PlanTraits, ShardPlan
from shardplug.core.shuffle.agreement import Shuffles, synchronize

__all__ = ["run_pass", "begin", "HandOut", "LengthMismatchWarning", "PassListener", "PassHost"]

_NO_START = PassStart()


class PassListener(Protocol):
    """What a pass tells about itself as it goes (the run's
    :class:`~shardplug.core.stepping.accumulation.GradientState` listens: it ends an accumulation cycle with
    the pass). ``loader`` stands for the pass's loader."""

    def loader_started(self, loader: object) -> None: ...

    def batch_ready(self, loader: object, end_of_dataloader: bool) -> None: ...

    def loader_stopped(self, loader: object) -> None: ...

    def align_cycle(self, batches_before: int) -> None: ...


class PassHost(Protocol):
    """What a pass reads of its loader (a :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)."""

    options: LoaderOptions
    plan: ShardPlan
    cursor: Cursor
    shuffles: Shuffles
    traits: PlanTraits
    tracker: PaddingTracker | None
    sampler_plan: BatchSamplerPlan | None
    gradient_state: PassListener | None
    keeps_own_epoch: bool
    source_marks_last: bool
    num_workers: int
    dataset: Any

    @property
    def epoch(self) -> int: ...

    @property
    def use_stateful_dataloader(self) -> bool: ...

    def next_epoch(self) -> None: ...

    def pin_epoch(self) -> None: ...

    def follow_sampler_epoch(self, pass_begins: bool = False) -> None: ...

    def lengths(self) -> PassLengths: ...

    def inner_loader(self) -> Any: ...

    def inner_batches(self, discard: int) -> Iterator[Any]: ...


class LengthMismatchWarning(UserWarning):
    """A pass yielded another number of batches than ``len()`` said when it began (as torch's
    ``DataLoader`` warns for an iterable dataset whose ``len()`` is wrong)."""


def inner_state_resumes(loader: PassHost) -> bool:
    """Whether the loader's ``StatefulDataLoader`` state is where a resumed pass continues (see
    :meth:`~shardplug.core.loader.resume_state.ResumeState.inner_state_resumes`)."""
    return callable(getattr(loader.dataset, "state_dict", None)) and loader.traits.inner_state_resumes


# -- 1. the start ---------------------------------------------------------------------------------
def begin(loader: PassHost, cursor: Cursor) -> tuple[PassState, int]:
    """Start a pass of ``loader``: its :class:`PassState` (the cursor's pass from now on) and how many batches
    to read and drop before the first one."""
    cursor.inner.snapshot = None  # what a pass left early kept describes no place once a new one begins
    if loader.keeps_own_epoch:
        if cursor.now.complete:
            loader.next_epoch()
        loader.pin_epoch()
    elif loader.traits.follows_sampler_epoch:  # a user's DistributedSampler: its epoch, as the user set it
        loader.follow_sampler_epoch(pass_begins=True)
    elif cursor.now.complete:
        loader.next_epoch()
    shuffles, options = loader.shuffles, loader.options
    synchronize(shuffles.seedable, options.rng_types, options.synchronized_generator)
    plan = loader.plan
    plan.begin_pass()
    state = PassState(PassRecord(track=loader.tracker is not None))
    record = state.record
    generator = shuffles.generator
    if generator is not None:
        state.generator_state = generator.get_state()
    parked = cursor.take_start()
    start = _NO_START
    if parked.position is not None or parked.ended or parked.skip:
        reads_through = bool(parked.skip) and loader.use_stateful_dataloader and inner_state_resumes(loader)
        workers_split = loader.num_workers > 0 and loader.traits.splits_by_worker
        start = place(plan, parked, reads_through, workers_split)
        if parked.position is not None and loader.gradient_state is not None:
            # a loaded position: the accumulation cycle stands where this layout's cycles of the epoch put it
            # (also after a resize, and at the next epoch's start where the saved epoch ended on this layout)
            loader.gradient_state.align_cycle(start.resumed)
    record.started_at, record.fast_forwarded = start.consumed_at_start, start.fast_forwarded
    state.resumed, state.empty = start.resumed, start.empty
    state.yielded = start.resumed
    if state.empty:  # the lengths, counted once: what len() says while the pass runs, and its last batch
        state.length = 0
    else:
        try:
            after = loader.lengths().batches_after(record.started_at)
            state.length = max(after, 0)
            if loader.traits.exact_length:  # the last batch is then known without reading ahead
                state.total = state.resumed + after
        except TypeError:  # unknown (a stream without len()): read one ahead
            pass
    state.open = True
    if loader.sampler_plan is not None:
        loader.sampler_plan.parked_record = record  # the sampler fills it as torch's DataLoader draws this pass
    cursor.now = state
    return state, start.discard


# -- the chain ------------------------------------------------------------------------------------
def run_pass(loader: PassHost) -> Iterator[Any]:
    """The batches of one pass of ``loader``, as handed out (a generator: the pass begins at its first
    ``next()``, and the generator holds the loader from there on)."""
    cursor = loader.cursor
    state, discard = begin(loader, cursor)
    listener = loader.gradient_state
    if listener is not None:
        listener.loader_started(loader)
    try:
        if not state.empty:
            batches = loader.inner_batches(discard)  # 2. read
            if not loader.traits.batches_unchanged:
                batches = loader.plan.pass_batches(batches, state.record)
            options, total = loader.options, state.total
            if options.depth > 0:  # 4. look ahead
                hand_out = HandOut(loader, state)
                yield from prefetched(loader, cursor.inner, mark_last(loader, state, batches), options.depth, hand_out)
            elif total is not None and not loader.source_marks_last:  # 3. counted: the last is known
                if listener is None and loader.tracker is None and options.transfer is None:
                    for batch in batches:  # 5. nothing to hand out but the count
                        state.yielded += 1
                        if state.yielded >= total:
                            state.end_of_dataloader = state.complete = True
                        yield batch
                else:
                    hand_out = HandOut(loader, state)
                    for batch in batches:
                        yield hand_out(batch, state.yielded + 1 >= total)
            else:
                hand_out = HandOut(loader, state)
                for batch, last in mark_last(loader, state, batches):
                    yield hand_out(batch, last)
        state.complete = state.exhausted = True
        check_length(state)
    finally:
        state.open = False
        if state.exhausted:  # a pass left early (break, an exception) keeps the state of its last batch
            cursor.inner.snapshot = None
        if listener is not None:
            listener.loader_stopped(loader)


# -- 3. mark the last batch -----------------------------------------------------------------------
def mark_last(loader: PassHost, state: PassState, batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """``(batch, last)`` pairs: from the source itself where it marks its last, by counting where the pass's
    length is exact, else by reading one ahead (:func:`looked_ahead`)."""
    if loader.source_marks_last:
        return cast("Iterator[tuple[Any, bool]]", batches)
    inner = loader.cursor.inner if loader.use_stateful_dataloader else None
    if state.total is not None:
        return counted(batches, state, state.total)
    return looked_ahead(batches, inner, loader)


def counted(batches: Iterator[Any], state: PassState, total: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, last)`` where the pass's length is exact (``total``: its last batch counted in the epoch)."""
    count = state.yielded
    for batch in batches:
        count += 1
        yield batch, count >= total


def looked_ahead(batches: Iterator[Any], inner: InnerState | None, loader: PassHost) -> Iterator[tuple[Any, bool]]:
    """``(batch, last)`` by reading one batch ahead (a ``StatefulDataLoader``'s state is kept from before
    each look-ahead, in ``inner``)."""
    iterator = iter(batches)
    for upcoming in iterator:  # noqa: B007 (the first item, read ahead: used after the loop)
        break
    else:
        return
    while True:
        batch = upcoming
        if inner is not None:  # the state after ``batch``, before the look-ahead fetch
            inner.take_snapshot(loader.inner_loader())
        try:
            upcoming = next(iterator)
        except StopIteration:
            yield batch, True
            return
        except Exception:  # the batch before it is handed out first, as without the look-ahead
            yield batch, False
            raise
        yield batch, False


# -- 4. look ahead --------------------------------------------------------------------------------
def prefetched(
    loader: PassHost, inner: InnerState, steps: Iterator[tuple[Any, bool]], depth: int, hand_out: HandOut
) -> Iterator[Any]:
    """The pass's batches with ``depth`` batches read (and copied to the device) ahead of the one handed out:
    everything a batch tells (its count, padding, ``end_of_dataloader``, the StatefulDataLoader's state) is
    still told when it is handed out (see :mod:`~shardplug.core.loader.prefetch`)."""
    transfer, hand_out.transfer = hand_out.transfer, None  # the copy starts as a batch is read
    start: Any = copy_ahead(transfer)  # a batch read ahead is copied as it is read: as at depth 0
    finish = None
    if transfer is not None and transfer.device.type == "cuda":
        copy = SideStreamCopy(transfer.device)
        start, finish = copy.start, copy.finish
    stateful = loader.use_stateful_dataloader
    note = None
    if stateful:
        if hand_out.state.total is not None or loader.source_marks_last:
            # no look-ahead took the snapshot
            steps = _snapshotted(steps, inner, loader)
        note = inner.current_snapshot
    for batch, last, snapshot in Prefetcher(steps, depth, start, finish, note):
        if stateful:
            inner.snapshot = snapshot  # the state after this batch, not after those read ahead
        yield hand_out(batch, last)
        del batch  # the user's now: no reference kept while the next batches are read


def _snapshotted(steps: Iterator[tuple[Any, bool]], inner: InnerState, loader: PassHost) -> Iterator[tuple[Any, bool]]:
    """``steps``, with the ``StatefulDataLoader``'s state kept after each batch is read."""
    for step in steps:
        inner.take_snapshot(loader.inner_loader())
        yield step


# -- 5. hand out ----------------------------------------------------------------------------------
class HandOut:
    """The one step every batch of a pass leaves by: count it (in ``state``), record its padding (and cut it
    where the loader drops it), tell the run's gradient state, copy it to the device."""

    __slots__ = ("loader", "state", "tracker", "listener", "transfer")

    def __init__(self, loader: PassHost, state: PassState) -> None:
        self.loader = loader
        self.state = state
        self.tracker = loader.tracker
        self.listener = loader.gradient_state
        self.transfer = loader.options.transfer

    def __call__(self, batch: Any, last: bool) -> Any:
        state = self.state
        state.yielded += 1
        if last:
            state.end_of_dataloader = state.complete = True
        loader = self.loader
        tracker = self.tracker
        if tracker is not None:
            indices, real = loader.plan.batch_record(state.record, state.yielded - state.resumed - 1)
            state.batch_indices, state.batch_real = indices, real
            batch = tracker.hand_out(batch, indices, real, loader.epoch)
        if self.listener is not None:
            self.listener.batch_ready(loader, last)
        return self.transfer(batch) if self.transfer is not None else batch


# -- the end --------------------------------------------------------------------------------------
def check_length(state: PassState) -> None:
    """Compare what the pass yielded with its ``len()`` when it began: a wrong length never passes silently."""
    yielded = state.yielded - state.resumed
    if state.length is not None and yielded != state.length:
        warnings.warn(
            f"this pass of the prepared loader yielded {yielded} batches, but len() said {state.length} when it "
            "began; if the dataset's __len__ is right, please report this to shardplug (with the options used)",
            LengthMismatchWarning,
            stacklevel=3,
        )
