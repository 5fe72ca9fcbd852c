"""Reading and writing a prepared loader's saved positions: its :class:`ResumeState` (``loader.resume``).

The loader's place is its :class:`~shardplug.core.loader.cursor.Cursor` (values only); :class:`ResumeState`
is the one place a position is read and written: it builds the loader's
:class:`~shardplug.core.resume.position.Position` from the cursor's pass
(:func:`~shardplug.core.loader.building.pass_position`), validates a position before anything changes
(:class:`~shardplug.core.resume.checks.PositionCheck`), reads it on this loader's layout and parks it in
the cursor (the next pass then starts after it), and answers ``state_dict()`` / ``load_state_dict()`` and
the counters a front end sets its own from.  It is made on demand by ``loader.resume`` and holds the loader
only while it is used.

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

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from shardplug.core.loader.building import LoaderIdentity, layout_fields, pass_position
from shardplug.core.loader.cursor import Cursor
from shardplug.core.loader.passes import PassHost, inner_state_resumes
from shardplug.core.resume.checks import PositionCheck
from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import POSITION_KEY
from shardplug.core.sharding.shard_plan import ShardPlan, consumed_after, note_place, plan_traits

__all__ = ["ResumeState", "ResumeHost"]

logger = logging.getLogger(__name__)


class ResumeHost(PassHost, Protocol):
    """What the resume state reads of its loader (a :class:`~shardplug.core.loader.prepared.PreparedDataLoader`)
    beyond what a pass reads."""

    @property
    def total_dataset_length(self) -> int | None: ...

    def set_epoch(self, epoch: int) -> None: ...


class ResumeState:
    """The saved positions of one prepared loader (see the module docstring)."""

    __slots__ = ("loader", "cursor")

    def __init__(self, loader: ResumeHost) -> None:
        self.loader = loader
        self.cursor: Cursor = loader.cursor

    @property
    def plan(self) -> ShardPlan:
        return self.loader.plan

    @property
    def resumed_batches(self) -> int:
        """Batches of the epoch that a resumed pass does not yield, counted on this layout: after
        ``load_state_dict`` (also of a position saved with another number of processes),
        ``loader.epoch_length - len(loader)``, and the same while that pass runs; 0 for a pass that
        started at the epoch's beginning. Front ends set their own counters from it (an engine's
        iteration, a trainer's batch progress)."""
        return self.cursor.resumed_batches(self.loader.lengths())

    @property
    def resumed_inside_epoch(self) -> bool:
        """Whether the pass in progress (else the next one) starts inside its epoch: after a position
        saved inside it was loaded, or with a skip. ``False`` for a pass from the epoch's beginning,
        also after a position saved at the end of the previous epoch (which loads as the next
        epoch's start); :attr:`resumed_batches` may be 0 either way (a few samples of another layout)."""
        return self.cursor.next_start(self.plan) > 0

    # -- positions --------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the loader stands, identical on every process: a loaded position not iterated yet, else
        where its last pass stands.  ``consumed`` counts what the whole job consumed of the epoch (in the
        plan's unit: global batches, stream elements or batches), so a position saved with N processes
        can be loaded with M."""
        self.loader.follow_sampler_epoch()  # a user's DistributedSampler set to another epoch: the loader is there
        if self.cursor.position is not None:  # loaded but not iterated yet: still that position
            return self.cursor.position
        return self.pass_position()

    def pass_position(self) -> Position:
        """Where the last pass stands, in this loader's own layout (a loaded position aside)."""
        loader = self.loader
        identity = LoaderIdentity(self.cursor.epoch, loader.total_dataset_length, loader.num_workers)
        return pass_position(loader.plan, identity, self.cursor.now, loader.shuffles)

    def check(self) -> PositionCheck:
        """The refusals of a position for this loader."""
        return PositionCheck(self.plan, self.loader.num_workers, self.inner_state_resumes())

    def check_loadable(self, position: Position, stateful: bool) -> None:
        """Everything that refuses ``position`` for this loader, before anything changes."""
        # the steps after its place may depend on its epoch and its own part (a token budget's)
        forget = note_place(self.plan, position.consumed, position.dataset_state, position.epoch)
        try:
            current = self.pass_position()
            self.check().check_loadable(position, current, stateful, self.loader.lengths().epoch_length)
        except Exception:
            forget()  # refused: the plan as it was
            raise

    def load(self, position: Position | dict[str, Any]) -> None:
        """Continue from ``position`` at the next pass; it is validated first, and nothing changes when
        it is refused."""
        if not isinstance(position, Position):
            position = Position.from_dict(position)
        self.check_loadable(position, stateful=False)
        self.apply(position)

    def apply(self, position: Position) -> None:
        """Continue from ``position`` (already checked) at the next pass (:meth:`on_this_layout`)."""
        self.park(position)

    def park(self, position: Position, repositions: bool = False) -> None:
        """Park ``position`` (already checked), read on this layout (:meth:`on_this_layout`), as the start of
        the next pass (``repositions``: the StatefulDataLoader's own state was loaded and places it)."""
        position = self.on_this_layout(position)
        self.cursor.position = None  # a position loaded before is replaced
        self.loader.shuffles.restore(position.seeds, position.generator_state)
        self.loader.set_epoch(position.epoch)
        self.cursor.park(position, repositions=repositions)

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
        generator = self.loader.shuffles.generator
        if generator is not None:  # the next epoch's order is drawn after this one's: draw it as its pass would
            batches = getattr(self.plan, "index_batches", None)
            if batches is None:
                return position
            saved = generator.get_state()
            self.loader.shuffles.restore(position.seeds, generator_state)
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
        return position.replace(  # an epoch's start is the same on every layout: described in this one's
            epoch=position.epoch + 1,
            batches_yielded=0,
            consumed=0,
            dataset_state=self.everywhere_state(position),
            generator_state=generator_state,
            **layout_fields(self.plan.layout),
        )

    def resume_at(self, epoch: int, batches_yielded: int, seeds: Iterable[int | None] | None = None) -> None:
        """Continue in ``epoch`` after this process's first ``batches_yielded`` batches, with this
        loader's layout (a front end that counts batches itself, e.g. an engine's iteration)."""
        here = self.position()
        self.load(
            here.replace(
                epoch=epoch,
                batches_yielded=batches_yielded,
                consumed=consumed_after(self.plan, 0, batches_yielded),
                seeds=tuple(here.seeds if seeds is None else seeds),
                dataset_state=self.everywhere_state(here),
            )
        )

    def everywhere_state(self, position: Position) -> Any:
        """What of ``position``'s ``dataset_state`` holds at another place of it: the plan's state where it
        describes its order at every place (:class:`~shardplug.core.sharding.shard_plan.PlanTraits`), else none."""
        return position.dataset_state if plan_traits(self.plan).state_everywhere else None

    # -- state dicts ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position as plain values; beside the ``StatefulDataLoader``'s own state where there is one."""
        position = self.position().to_dict()
        loader = self.loader
        if not loader.use_stateful_dataloader:
            return position
        parked = not self.cursor.now.open and (self.cursor.position is not None or self.cursor.skip)
        if (position["consumed"], position["batches_yielded"]) == (0, 0) or (parked and not self.inner_state_resumes()):
            # an epoch's start, or a place the next pass starts at by the position's own skip (loaded, skipped to):
            # the position alone resumes it (asking the StatefulDataLoader would start an iterator, which draws
            # from the shuffle's generator and, with workers, begins a pass of the batch sampler from the epoch's
            # start)
            return {POSITION_KEY: position}
        state = self.cursor.inner.state(loader.inner_loader())
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
        self.cursor.inner.load(loader.inner_loader(), state)
        self.park(position, repositions=True)

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
        return inner_state_resumes(self.loader)
