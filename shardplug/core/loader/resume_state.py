"""A prepared loader's resume state: where its last pass stands, where its next pass starts.

One :class:`ResumeState` per loader (``loader.resume``) keeps the loader's last pass (a
:class:`~shardplug.core.loader.passes.LoaderPass`, which counts its batches), a loaded position not
iterated yet with the ``skip_first_batches`` start (:class:`~shardplug.core.resume.pending.PendingStart`)
and the ``StatefulDataLoader``'s own state (:class:`~shardplug.core.resume.stateful.InnerState`).  It
builds the loader's :class:`~shardplug.core.resume.position.Position` from the last pass
(:func:`~shardplug.core.loader.building.pass_position`), validates a position before anything changes
(:class:`~shardplug.core.resume.checks.PositionCheck`), loads it (the next pass then starts after it),
places each pass as it begins (:class:`~shardplug.core.loader.placing.PassPlacement`, by the plan's
:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.start_after`), and answers ``state_dict()`` /
``load_state_dict()`` and the lengths that depend on where a pass starts
(:class:`~shardplug.core.resume.lengths.PassLengths`).

What differs between kinds of sharding is the plan's: its unit, what it saves beyond the counters
(:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.saved_state`) and its capabilities
(:func:`~shardplug.core.sharding.shard_plan.plan_traits`).

Example::

    >>> from shardplug import DataLoaderShard
    >>> loader = DataLoaderShard(range(6), batch_size=2)
    >>> batches = iter(loader); _ = next(batches)
    >>> position = loader.resume.position()
    >>> position.epoch, position.batches_yielded
    (0, 1)
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any, Protocol, cast

import torch

from shardplug.core.loader.building import LoaderIdentity, pass_position
from shardplug.core.loader.passes import LoaderPass, PassHost, WeakLoader, weak_reference
from shardplug.core.loader.placing import PassPlacement, PassStart
from shardplug.core.resume.checks import PositionCheck
from shardplug.core.resume.lengths import PassLengths
from shardplug.core.resume.pending import PendingStart
from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import POSITION_KEY, InnerState
from shardplug.core.sharding.shard_plan import PlanTraits, ShardPlan, plan_traits
from shardplug.core.shuffle.agreement import Shuffles

__all__ = ["ResumeState", "ResumeHost"]

logger = logging.getLogger(__name__)


class ResumeHost(PassHost, Protocol):
    """What the resume state reads of its loader (a :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)
    beyond what a pass reads."""

    num_workers: int
    dataset: Any  # the user's dataset (or shardplug's shard of it)

    @property
    def resume(self) -> ResumeState: ...

    @property
    def total_dataset_length(self) -> int | None: ...


class ResumeState(WeakLoader[ResumeHost]):
    """The resume state of one prepared loader (``loader``, held weakly; see the module docstring).

    ``last_pass``: the last pass begun (a new one, not begun, after ``set_epoch``); ``pending``: where
    the next pass starts; ``inner``: the ``StatefulDataLoader``'s own state; ``skipped_from``: the loader
    this one is a ``skip_first_batches`` copy of (it follows this loader's passes).
    """

    def __init__(self, loader: ResumeHost, skip: int = 0) -> None:
        self._loader = weak_reference(loader)  # weakly: the loader keeps its state (no reference cycle)
        self.last_pass = LoaderPass(loader)
        self.pending = PendingStart(skip)
        self.inner = InnerState()
        self.skipped_from: ResumeHost | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["skipped_from"] = None  # a copy travels alone
        return state

    @property
    def plan(self) -> ShardPlan:
        return self.loader.plan

    @property
    def traits(self) -> PlanTraits:
        return plan_traits(self.loader.plan)

    def shuffles(self) -> Shuffles:
        """The shuffles whose seeds and generator state a position records."""
        loader = self.loader
        return Shuffles(loader.plan.sampler, getattr(loader, "sampler", None))

    def copy_for(self, loader: ResumeHost, skip: int) -> ResumeState:
        """The same place, kept for ``loader`` (a ``skip_first_batches`` copy whose next pass starts
        ``skip`` batches later): this loader then follows the copy's passes."""
        new = copy.copy(self)
        new.loader = loader
        new.last_pass = self.last_pass.kept_by(loader)
        new.pending = copy.copy(self.pending)
        new.pending.skip = skip
        new.inner = copy.copy(self.inner)
        new.skipped_from = self.loader
        return new

    # -- epochs and passes ------------------------------------------------------------------
    def enter_epoch(self, epoch: int) -> None:
        """The loader is set to ``epoch`` (:meth:`PendingStart.enter_epoch` decides first what becomes
        of a loaded position): the pass in progress is not the epoch's end, and outside a pass nothing
        of the last pass is this epoch's."""
        self.pending.enter_epoch(epoch)
        if self.last_pass.open:
            self.last_pass.continue_epoch()  # the next pass is this epoch
        else:
            self.last_pass = LoaderPass(self.loader)

    def adopt(self, current: LoaderPass) -> None:
        """``current`` has begun: it is the loader's last pass, and the loaders it was skipped from follow
        it (its epoch, its position)."""
        self.last_pass = current
        epoch, origin = self.loader.epoch, self.skipped_from
        while origin is not None:
            origin.epoch = epoch
            state = origin.resume
            state.last_pass = current
            state.pending.forget()
            origin = state.skipped_from

    def start(self) -> PassStart:
        """Where a pass that begins starts: after the loaded position and the pending skip, which it takes
        (:class:`~shardplug.core.loader.placing.PassPlacement`)."""
        reads_through = self.loader.use_stateful_dataloader and self.inner_state_resumes()
        placement = PassPlacement(self.plan, self.inner, reads_through, self.check().workers_split_stream)
        state = self.loader.gradient_state
        if self.pending.epoch_ended and state is not None:
            # the loaded position's epoch ended on this layout: as at every epoch's end, the accumulation
            # cycle it was saved in ends with it (its micro-batches' gradients are in no checkpoint)
            state.restart_cycle()
        return placement.place(*self.pending.take())

    # -- lengths ----------------------------------------------------------------------------
    def lengths(self) -> PassLengths:
        loader = self.loader
        return PassLengths(loader.plan, lambda: cast("int", loader.inner_loader().__len__()), loader.dataset)

    def length(self) -> int:
        """Batches the pass yields: the pass in progress while one is open, else the next one."""
        current = self.last_pass
        if current.open:
            return 0 if current.empty else max(self.lengths().batches_after(current.consumed_at_start), 0)
        if self.pending.ended:
            return 0
        return max(self.lengths().batches_after(self.pending.next_start()) - self.pending.skip, 0)

    def pass_start(self) -> int:
        """Where (in the plan's unit) the pass in progress started, or where the next one starts."""
        current = self.last_pass
        if current.open:
            return current.consumed_at_start
        return self.pending.next_start() + self.pending.skip * self.plan.consumed_per_batch

    @property
    def resumed_batches(self) -> int:
        """Batches of the epoch that a resumed pass does not yield, counted on this layout: after
        ``load_state_dict`` (also of a position saved with another number of processes),
        ``loader.epoch_length - len(loader)``, and the same while that pass runs; 0 for a pass that
        started at the epoch's beginning. Front ends set their own counters from it (an engine's
        iteration, a trainer's batch progress)."""
        lengths = self.lengths()
        total = lengths.epoch_length()
        if total is None:
            return 0
        try:
            rest = (
                self.length()
                if self.pending.position is not None
                else lengths.batches_after(self.last_pass.consumed_at_start)
            )
        except TypeError:
            return 0
        return max(total - rest, 0)

    @property
    def resumed_inside_epoch(self) -> bool:
        """Whether the pass in progress (else the next one) starts inside its epoch: after a position
        saved inside it was loaded, or with a skip. ``False`` for a pass from the epoch's beginning,
        also after a position saved at the end of the previous epoch (which loads as the next
        epoch's start); :attr:`resumed_batches` may be 0 either way (a few samples of another layout)."""
        return self.pass_start() > 0

    # -- positions --------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the loader stands, identical on every process: a loaded position not iterated yet, else
        where its last pass stands.  ``consumed`` counts what the whole job consumed of the epoch (in the
        plan's unit: global batches, stream elements or batches), so a position saved with N processes
        can be loaded with M."""
        if self.pending.position is not None:  # loaded but not iterated yet: still that position
            return self.pending.position
        return self.pass_position()

    def pass_position(self) -> Position:
        """Where the last pass stands, in this loader's own layout (a loaded position aside)."""
        loader = self.loader
        identity = LoaderIdentity(loader.epoch, loader.total_dataset_length, loader.num_workers)
        return pass_position(loader.plan, identity, self.last_pass.counts(), self.shuffles())

    def check(self) -> PositionCheck:
        """The refusals of a position for this loader."""
        return PositionCheck(self.plan, self.loader.num_workers, self.inner_state_resumes())

    def check_loadable(self, position: Position, stateful: bool) -> None:
        """Everything that refuses ``position`` for this loader, before anything changes."""
        current = self.pass_position()
        self.check().check_loadable(position, current, stateful, self.lengths().epoch_length)

    def load(self, position: Position | dict[str, Any]) -> None:
        """Continue from ``position`` at the next pass; it is validated first, and nothing changes when
        it is refused."""
        if not isinstance(position, Position):
            position = Position.from_dict(position)
        self.check_loadable(position, stateful=False)
        self.apply(position)

    def apply(self, position: Position) -> None:
        """Continue from ``position`` (already checked) at the next pass (:meth:`on_this_layout`)."""
        saved_epoch = position.epoch
        position = self.on_this_layout(position)
        self.pending.position = None  # a position loaded before is replaced
        self.shuffles().restore(position.seeds, position.generator_state)
        self.loader.set_epoch(position.epoch)
        self.pending.load(position, epoch_ended=position.epoch != saved_epoch)

    def on_this_layout(self, position: Position) -> Position:
        """``position`` (already checked) as this loader's layout reads it: a place inside an epoch after which
        no process of this layout has a batch left (:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.finished`,
        the rule that also ends a pass, see :func:`~shardplug.core.loader.building.pass_position`) is the end of
        that epoch, so the next epoch's start, as an uninterrupted run on this layout reaches it.  That happens
        after a resize: the samples left (saved with another number of processes) fill no step of this layout
        (``drop_last`` drops them).  Every front end then counts the resumed run from the next epoch, and no pass
        reads past the epoch."""
        if (position.consumed, position.batches_yielded) == (0, 0) or self.plan.finished(position.consumed) is not True:
            return position
        generator_state = position.generator_state
        generator = self.shuffles().generator
        if generator is not None:  # the next epoch's order is drawn after this one's: draw it as its pass would
            batches = getattr(self.plan, "index_batches", None)
            if batches is None:
                return position
            saved = generator.get_state()
            self.shuffles().restore(position.seeds, generator_state)
            if getattr(self.loader, "generator", None) is generator:  # a DataLoader draws from its own generator
                torch.empty((), dtype=torch.int64).random_(generator=generator)  # iter() draws its base seed first
            for _ in batches(position.consumed):
                pass  # nothing is left: only the order is drawn
            generator_state = generator.get_state()
            generator.set_state(saved)
        logger.info(
            "the loaded position (epoch %d, %d %s consumed on %d processes) leaves no batch of this layout in its "
            "epoch: the next pass starts epoch %d",
            position.epoch,
            position.consumed,
            position.unit,
            position.num_processes,
            position.epoch + 1,
        )
        layout = self.plan.layout  # an epoch's start is the same on every layout: described in this one's
        return position.replace(
            epoch=position.epoch + 1,
            batches_yielded=0,
            consumed=0,
            dataset_state=None,
            generator_state=generator_state,
            num_processes=layout.num_processes,
            split_batches=layout.split_batches,
            even_batches=layout.even_batches,
            process_batch_size=layout.process_batch_size,
            step_batch_size=layout.step_batch_size,
        )

    def resume_at(self, epoch: int, batches_yielded: int, seeds: Iterable[int | None] | None = None) -> None:
        """Continue in ``epoch`` after this process's first ``batches_yielded`` batches, with this
        loader's layout (a front end that counts batches itself, e.g. an engine's iteration)."""
        here = self.position()
        self.load(
            here.replace(
                epoch=epoch,
                batches_yielded=batches_yielded,
                consumed=batches_yielded * self.plan.consumed_per_batch,
                seeds=tuple(here.seeds if seeds is None else seeds),
                dataset_state=None,
            )
        )

    # -- state dicts ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain values; beside the ``StatefulDataLoader``'s own state where there is one."""
        position = self.position().to_dict()
        loader = self.loader
        if not loader.use_stateful_dataloader:
            return position
        if (position["consumed"], position["batches_yielded"]) == (0, 0):
            # an epoch's start: the position alone resumes it (asking the StatefulDataLoader would start an
            # iterator, which draws from the shuffle's generator)
            return {POSITION_KEY: position}
        state = self.inner.state(loader.inner_loader())
        state[POSITION_KEY] = position
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned (validated before anything changes)."""
        loader = self.loader
        if not loader.use_stateful_dataloader:  # a StatefulDataLoader's state too: its position
            self.load(state_dict.get(POSITION_KEY, state_dict) if isinstance(state_dict, dict) else state_dict)
            return
        state = dict(state_dict)
        if POSITION_KEY not in state:
            raise ValueError(
                f"this loader is backed by a StatefulDataLoader and its state has no {POSITION_KEY!r} key; "
                "pass what its state_dict() returned"
            )
        position = Position.from_dict(state.pop(POSITION_KEY))
        self.check_loadable(position, stateful=True)
        if self.position_suffices(self.on_this_layout(position)):
            self.apply(position)  # shardplug's own skip (exact) repositions the next pass
            return
        self.inner.load(loader.inner_loader(), state)
        self.apply(position)

    def position_suffices(self, position: Position) -> bool:
        """Whether ``position`` alone resumes this StatefulDataLoader exactly (its own state is then not
        loaded, and the position may come from another number of processes): at an epoch's start (the
        state may still describe the end of the previous pass), and wherever the inner state does not
        resume a pass (:meth:`inner_state_resumes`)."""
        return (position.consumed, position.batches_yielded) == (0, 0) or not self.inner_state_resumes()

    def inner_state_resumes(self) -> bool:
        """Whether the StatefulDataLoader's own state is where a resumed pass continues (else it is not
        loaded, and the position's own skip, which is exact, repositions the pass).  Not for:

        * data without a ``state_dict()`` of its own: map-style data is started after any batch by
          index, and the state of a stream without one only counts batches (torchdata 0.11 counts them
          twice after a resume, so a second resume would skip batches);
        * a plan whose batches are read ahead of those handed out
          (:class:`~shardplug.core.sharding.shard_plan._ReadsAhead`: a natively sharded stream agrees its
          step counts a few batches ahead, a dispatcher's process 0 reads a step ahead): the inner state
          is past the place.
        """
        return callable(getattr(self.loader.dataset, "state_dict", None)) and self.traits.inner_state_resumes
