"""One pass over a prepared loader: what torch's ``_BaseDataLoaderIter`` is to a ``DataLoader``.

``iter(loader)`` makes a :class:`LoaderPass`; the pass begins at the first ``next()``: it advances
the epoch when the previous pass was complete, agrees shuffle seeds and RNG states with process 0,
lets the loader's resume state place it (a loaded position, ``skip_first_batches``), and then
hands out the loader's batches, knowing the last one (by counting where the plan's length is
exact, by reading one ahead otherwise, or from the source itself), telling the run's gradient
state, recording padding and moving each batch to the device.  At its end it compares what it
yielded with what ``len()`` said when it began (:class:`LengthMismatchWarning`).

The pass is also the state the loader reads between batches (``end_of_dataloader``, the batch's
padding record) and after the pass (where it stands: the loader's resume state, which keeps its last
pass, builds the position from it).  A new pass starts from a new object: nothing of a pass left
early leaks into the next.

The loader keeps its last pass, so the pass holds its loader weakly (:func:`weakref.ref`): a loader
and its pass are no reference cycle, and a loader dropped is freed at once, with its ``DataLoader``
iterator and that iterator's worker processes (a ``StatefulDataLoader`` keeps its iterator), not at a
later garbage collection.  The running pass (the generator ``iter()`` returns) holds it strongly.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

from shardplug.core.loader.building import PassCounts
from shardplug.core.loader.placing import PassStart
from shardplug.core.loader.prefetch import Prefetcher, SideStreamCopy, copy_ahead, resolve_prefetch_depth
from shardplug.core.loader.transfer import DeviceTransfer
from shardplug.core.padding.tracking import PaddingTracker
from shardplug.core.resume.lengths import PassLengths
from shardplug.core.resume.stateful import InnerState
from shardplug.core.sharding.map_style import BatchSamplerShard
from shardplug.core.sharding.shard_plan import PassRecord, ShardPlan, plan_traits
from shardplug.core.shuffle.agreement import Shuffles, synchronize

__all__ = [
    "LoaderPass",
    "LengthMismatchWarning",
    "PassListener",
    "PassKeeper",
    "PassHost",
    "weak_reference",
    "WeakLoader",
]


class PassListener(Protocol):
    """What a pass tells about itself as it goes (the run's
    :class:`~shardplug.core.stepping.accumulation.GradientState` listens: it ends an accumulation cycle with
    the pass). ``loader`` stands for the pass's loader."""

    def loader_started(self, loader: object) -> None: ...

    def batch_ready(self, loader: object, end_of_dataloader: bool) -> None: ...

    def loader_stopped(self, loader: object) -> None: ...

    def restart_cycle(self) -> None: ...


class PassKeeper(Protocol):
    """What keeps a loader's passes (its :class:`~shardplug.core.loader.resume_state.ResumeState`), as a pass
    asks it: the last pass, the shuffles to agree, where a pass starts, the lengths, the
    ``StatefulDataLoader``'s state."""

    last_pass: LoaderPass
    inner: InnerState

    def shuffles(self) -> Shuffles: ...

    def start(self) -> PassStart: ...

    def adopt(self, current: LoaderPass) -> None: ...

    def lengths(self) -> PassLengths: ...


class PassHost(Protocol):
    """What a pass reads of its loader (a :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)."""

    plan: ShardPlan
    epoch: int
    device: torch.device | None
    non_blocking: bool
    prefetch_depth: int | None
    rng_types: tuple[str, ...]
    synchronized_generator: torch.Generator | None
    gradient_state: PassListener | None

    @property
    def source_marks_last(self) -> bool: ...

    @property
    def use_stateful_dataloader(self) -> bool: ...

    @property
    def batch_shard(self) -> BatchSamplerShard | None: ...

    @property
    def padding_tracker(self) -> PaddingTracker | None: ...

    @property
    def resume(self) -> PassKeeper: ...

    def set_epoch(self, epoch: int) -> None: ...

    def next_epoch(self) -> None: ...

    def pin_epoch(self) -> None: ...

    def inner_loader(self) -> Any: ...

    def inner_batches(self, discard: int) -> Iterator[Any]: ...

    def __len__(self) -> int: ...


def _no_loader() -> None:
    return None


def weak_reference(obj: Any) -> Callable[[], Any]:
    """A weak reference to ``obj`` (a callable that returns it, or ``None`` once it is gone)."""
    return weakref.ref(obj) if obj is not None else _no_loader


_Loader = TypeVar("_Loader")


class WeakLoader(Generic[_Loader]):
    """Holds its ``loader`` weakly (in ``_loader``): the loader keeps this object, so a strong reference
    back would make a cycle that only the garbage collector frees.  A copy or a pickle carries the
    loader itself (a weak reference does not travel)."""

    __slots__ = ()
    _loader: Callable[[], Any]

    @property
    def loader(self) -> _Loader:
        """The loader (``None`` once it is gone)."""
        return cast("_Loader", self._loader())

    @loader.setter
    def loader(self, loader: _Loader) -> None:
        self._loader = weak_reference(loader)

    def __getstate__(self) -> dict[str, Any]:
        slots = [name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ())]
        state = {name: getattr(self, name) for name in slots if hasattr(self, name)}
        state.update(getattr(self, "__dict__", {}))
        state["_loader"] = self._loader()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self._loader = weak_reference(state.get("_loader"))


class LengthMismatchWarning(UserWarning):
    """A pass yielded another number of batches than ``len()`` said when it began (as torch's
    ``DataLoader`` warns for an iterable dataset whose ``len()`` is wrong)."""


class LoaderPass(WeakLoader[PassHost]):
    """One pass (one iteration) of the prepared loader ``loader`` (see the module docstring), the only
    writer of its fields: it places its start, counts what it hands out, marks padding and knows its end.

    ``batches_yielded`` counts this process's batches of the epoch, including those before a
    resume (``resumed``); ``consumed_at_start`` is how much of the epoch (in the plan's unit) was
    consumed before this pass started; ``total`` the pass's batches counted the same way (when the
    plan's length is exact); ``length`` what ``len()`` said when the pass began.
    """

    __slots__ = (
        "_loader",
        "open",
        "length",
        "exhausted",
        "batches_yielded",
        "end_of_dataloader",
        "complete",
        "resumed",
        "consumed_at_start",
        "total",
        "record",
        "batch_indices",
        "batch_real",
        "generator_state",
        "empty",
    )

    def __init__(self, loader: PassHost) -> None:
        self._loader = weak_reference(loader)
        self.open = False  # begun and not yet ended: len() is this pass's
        self.length: int | None = None  # len() when the pass began (None: unknown), checked at its end
        self.exhausted = False  # the loop over it ended by itself (StopIteration)
        self.batches_yielded = 0
        self.end_of_dataloader = False
        self.complete = False
        self.resumed = 0
        self.consumed_at_start = 0
        self.total: int | None = None
        self.record = PassRecord()
        self.batch_indices: list[int] | None = None
        self.batch_real: int | None = None
        self.generator_state: torch.Tensor | None = None  # the shuffle generator's state at the pass start
        self.empty = False  # the rest of an epoch whose end was loaded: the DataLoader is not read

    def counts(self) -> PassCounts:
        """Where this pass stands, as values (a position is built from them)."""
        return PassCounts(
            self.batches_yielded,
            self.resumed,
            self.consumed_at_start,
            self.complete,
            self.exhausted,
            self.generator_state,
        )

    def continue_epoch(self) -> None:
        """The loader was set to this pass's epoch while the pass runs: its end is not the epoch's end."""
        self.complete = False

    def kept_by(self, loader: PassHost) -> LoaderPass:
        """A closed copy of this pass as ``loader``'s last pass (a ``skip_first_batches`` copy of its loader)."""
        new = copy.copy(self)
        new._loader, new.open = weak_reference(loader), False
        return new

    def __iter__(self) -> Iterator[Any]:
        """The pass's batches as handed out (a generator: the pass begins at its first ``next()``)."""
        return self._run(self.loader)  # the generator holds the loader from here on

    def _run(self, loader: PassHost) -> Iterator[Any]:
        discard = self._begin()
        resume = loader.resume
        state = loader.gradient_state
        if state is not None:
            state.loader_started(loader)
        try:
            if not self.empty:
                batches = loader.plan.pass_batches(loader.inner_batches(discard), self.record)
                yield from self._deliver(batches)
            self.complete = self.exhausted = True
            self._check_length()
        finally:
            self.open = False
            if self.exhausted:  # a pass left early (break, an exception) keeps the state of its last batch
                resume.inner.end_pass()
            if state is not None:
                state.loader_stopped(loader)

    # -- the start --------------------------------------------------------------------------
    def _begin(self) -> int:
        """Start the pass; return how many batches to read and drop before the first one."""
        loader = self.loader
        resume = loader.resume
        resume.inner.end_pass()  # what a pass left early kept describes no place once a new one begins
        if resume.last_pass.complete:
            loader.next_epoch()
        loader.pin_epoch()
        shuffles = resume.shuffles()
        synchronize(shuffles.seedable, loader.rng_types, loader.synchronized_generator)
        plan = loader.plan
        plan.begin_pass()
        self.record = PassRecord(track=loader.padding_tracker is not None)
        generator = shuffles.generator
        if generator is not None:
            self.generator_state = generator.get_state()
        start = resume.start()
        self.consumed_at_start, self.resumed, self.empty = start.consumed_at_start, start.resumed, start.empty
        self.record.fast_forwarded = start.fast_forwarded
        self.batches_yielded = self.resumed
        self.open = True
        self.record.started_at = self.consumed_at_start
        self.total = self._counted_total()
        shard = loader.batch_shard
        if shard is not None:
            shard.record_next_pass(self.record)
        resume.adopt(self)  # the loader's last pass (and the loaders it was skipped from follow it)
        try:
            self.length = len(loader)
        except TypeError:
            self.length = None
        return start.discard

    def _counted_total(self) -> int | None:
        """The epoch's batches counted up to the end of this pass, when the plan's length is exact
        (map-style data with a sized batch sampler): the last batch is then known without looking ahead."""
        loader = self.loader
        if not plan_traits(loader.plan).exact_length:
            return None
        try:
            return self.resumed + loader.resume.lengths().batches_after(self.consumed_at_start)
        except TypeError:  # a batch sampler without __len__
            return None

    # -- delivery ---------------------------------------------------------------------------
    def _deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The pass's batches as handed out, each through :meth:`_hand_out`: the last one known from the
        source (it marks it), from the exact length, else by reading one ahead."""
        loader = self.loader
        if loader.source_marks_last:
            steps = cast("Iterator[tuple[Any, bool]]", batches)
        elif self.total is not None:
            steps = self._counted(batches, self.total)
        else:
            steps = self._looked_ahead(batches)
        hand_out = self._hand_out
        transfer = DeviceTransfer.to(loader.device, loader.non_blocking)
        depth = resolve_prefetch_depth(loader.prefetch_depth, loader.device)
        if depth > 0:
            yield from self._prefetched(steps, depth, transfer)
            return
        if loader.gradient_state is None and transfer is None and loader.padding_tracker is None:
            hand_out = self._count  # nothing more to do per batch than counting it
        for batch, last in steps:
            yield hand_out(batch, last, transfer)

    def _prefetched(
        self, steps: Iterator[tuple[Any, bool]], depth: int, transfer: DeviceTransfer | None
    ) -> Iterator[Any]:
        """:meth:`_deliver` with ``depth`` batches read (and copied to the device) ahead of the one handed out:
        everything a batch tells (its count, padding, ``end_of_dataloader``, the StatefulDataLoader's state)
        is still told when it is handed out (see :mod:`~shardplug.core.loader.prefetch`)."""
        loader = self.loader
        start: Any = copy_ahead(transfer)  # a batch read ahead is copied as it is read: as at depth 0
        finish = None
        if transfer is not None and transfer.device.type == "cuda":
            copy = SideStreamCopy(transfer.device)
            start, finish = copy.start, copy.finish
        inner = loader.resume.inner if loader.use_stateful_dataloader else None
        note = None
        if inner is not None:
            if self.total is not None or loader.source_marks_last:  # no look-ahead took the snapshot
                steps = self._snapshotted(steps)
            note = inner.current_snapshot
        for batch, last, snapshot in Prefetcher(steps, depth, start, finish, note):
            if inner is not None:
                inner.snapshot = snapshot  # the state after this batch, not after those read ahead
            yield self._hand_out(batch, last, None)
            del batch  # the user's now: no reference kept while the next batches are read

    def _snapshotted(self, steps: Iterator[tuple[Any, bool]]) -> Iterator[tuple[Any, bool]]:
        """``steps``, with the ``StatefulDataLoader``'s state kept after each batch is read."""
        loader = self.loader
        inner = loader.resume.inner
        for step in steps:
            inner.take_snapshot(loader.inner_loader())
            yield step

    def _count(self, batch: Any, last: bool, transfer: DeviceTransfer | None = None) -> Any:
        """Count ``batch`` as handed out (``last``: the pass's last)."""
        self.batches_yielded += 1
        if last:
            self.end_of_dataloader = self.complete = True
        return batch

    def _hand_out(self, batch: Any, last: bool, transfer: DeviceTransfer | None) -> Any:
        """The one step every batch leaves the pass by: count it, mark its padding (and cut it where the loader
        drops it), tell the run's gradient state, move it to the device."""
        self._count(batch, last)
        loader = self.loader
        tracker = loader.padding_tracker
        if tracker is not None:
            indices, real = loader.plan.batch_record(self.record, self.batches_yielded - self.resumed - 1)
            self.batch_indices, self.batch_real = indices, real
            batch = tracker.hand_out(batch, indices, real, loader.epoch)
        state = loader.gradient_state
        if state is not None:
            state.batch_ready(loader, last)
        return transfer(batch) if transfer is not None else batch

    def _counted(self, batches: Iterator[Any], total: int) -> Iterator[tuple[Any, bool]]:
        """``(batch, last)`` where the pass's length is exact."""
        count = self.batches_yielded
        for batch in batches:
            count += 1
            yield batch, count >= total

    def _looked_ahead(self, batches: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
        """``(batch, last)`` by reading one batch ahead (a ``StatefulDataLoader``'s state is kept from before
        each look-ahead)."""
        iterator = iter(batches)
        loader = self.loader
        inner = loader.resume.inner if loader.use_stateful_dataloader else None
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

    # -- the end ----------------------------------------------------------------------------
    def _check_length(self) -> None:
        """Compare what this pass yielded with its ``len()``: a wrong length never passes silently."""
        yielded = self.batches_yielded - self.resumed
        if self.length is not None and yielded != self.length:
            warnings.warn(
                f"this pass of the prepared loader yielded {yielded} batches, but len() said {self.length} when it "
                "began; if the dataset's __len__ is right, please report this to shardplug (with the options used)",
                LengthMismatchWarning,
                stacklevel=3,
            )
