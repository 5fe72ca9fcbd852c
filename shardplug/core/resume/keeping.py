"""Position keeping: where a prepared loader stands in its epoch, and where its next pass starts.

One :class:`PositionKeeper` per loader builds the loader's :class:`~shardplug.core.resume.position.Position`
from its last pass, validates a position before anything changes (every refusal names the fix),
loads it (the next pass then starts after it, by the plan's
:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.start_after`),
and answers ``state_dict()`` / ``load_state_dict()``, with the ``StatefulDataLoader``'s own state
beside the position where the loader has one (:mod:`shardplug.core.resume.stateful`).  It also holds the
one-shot start of ``skip_first_batches`` and knows the lengths that depend on where a pass starts.

What differs between kinds of sharding is the plan's: its unit, what it saves beyond the counters
(:meth:`~shardplug.core.sharding.shard_plan.ShardPlan.saved_state`), whether it shares out a stream, whether a
``StatefulDataLoader``'s state resumes it, whether its data splits itself across DataLoader workers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, cast

from torch.utils.data import IterableDataset

from shardplug.core.loader.passes import WeakLoader, weak_reference
from shardplug.core.resume.position import Position
from shardplug.core.resume.stateful import POSITION_KEY, InnerState
from shardplug.core.sharding.shard_plan import ShardPlan
from shardplug.core.shuffle.agreement import Shuffles

__all__ = ["PositionKeeper"]


_WITHOUT_LEN = "iterate without len() (for batch in loader: ..., with a step budget of your own where one is needed)"


def _user_stream(dataset: Any) -> Any:
    """The user's stream under shardplug's wrappers of it (each keeps it as ``.dataset``)."""
    while type(dataset).__module__.startswith("shardplug.") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return dataset


class PositionKeeper(WeakLoader):
    """The position of one prepared loader (``loader``; see the module docstring).

    ``pending``: a loaded position, applied when the next pass starts; ``ended``: that position (an
    epoch's start) is reached as the end of the epoch before it, so the next pass is empty
    (:meth:`enter_epoch`); ``skip``: batches the next pass starts later still (``skip_first_batches``);
    ``inner``: the ``StatefulDataLoader``'s own state.
    """

    def __init__(self, loader: Any, skip: int = 0) -> None:
        self._loader = weak_reference(loader)  # weakly: the loader keeps its keeper (no reference cycle)
        self.pending: Position | None = None
        self.ended = False
        self.skip = skip
        self.inner = InnerState()

    def copy_for(self, loader: Any) -> PositionKeeper:
        """The same place, kept for ``loader`` (a ``skip_first_batches`` copy)."""
        new = copy.copy(self)
        new.loader = loader
        new.inner = copy.copy(self.inner)
        return new

    def forget(self) -> None:
        """The loader follows another loader's pass (its copy's): nothing of its own is pending."""
        self.pending, self.ended, self.skip = None, False, 0

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
        pending = self.pending
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
        self.pending = None

    @property
    def plan(self) -> ShardPlan:
        return cast("ShardPlan", self.loader.plan)

    def shuffles(self) -> Shuffles:
        """The shuffles whose seeds and generator state a position records."""
        return Shuffles(self.loader.plan.sampler, getattr(self.loader, "sampler", None))

    # -- lengths ----------------------------------------------------------------------------
    def batches_after(self, consumed: int) -> int:
        """Batches of a pass that starts after ``consumed`` (``TypeError`` when unknown)."""
        plan = self.plan
        length = plan.num_batches(consumed)
        if length is None:
            if plan.reads_ahead:  # the DataLoader's count is not the agreed one
                raise TypeError(
                    "the number of batches of this natively sharded stream is agreed while it is read (its parts "
                    "have no len(), or DataLoader workers split them in a way shardplug cannot count), so len() is "
                    f"unknown; {_WITHOUT_LEN}"
                )
            try:
                return cast("int", self.loader._inner_loader().__len__())  # the DataLoader's own answer
            except TypeError:
                stream = _user_stream(self.loader.dataset)
                if not isinstance(stream, IterableDataset) or hasattr(stream, "__len__"):
                    raise  # a sampler without len() (torch's message names it), or a __len__ that failed
                name = type(stream).__name__
                raise TypeError(
                    f"len() of this loader needs the length of its stream, and the {name} has no __len__; give {name} "
                    f"a __len__ (the number of elements the whole stream yields), or {_WITHOUT_LEN}"
                ) from None
        return length

    def next_start(self) -> int:
        """Where (in the plan's unit) the next pass starts, before any skip."""
        return self.pending.consumed if self.pending is not None else 0

    def length(self) -> int:
        """Batches the pass yields: the pass in progress while one is open, else the next one."""
        current = self.loader._pass
        if current.open:
            return 0 if current.empty else max(self.batches_after(current.consumed_at_start), 0)
        if self.ended:
            return 0
        return max(self.batches_after(self.next_start()) - self.skip, 0)

    def pass_start(self) -> int:
        """Where (in the plan's unit) the pass in progress started, or where the next one starts."""
        current = self.loader._pass
        if current.open:
            return cast("int", current.consumed_at_start)
        return self.next_start() + self.skip * self.plan.consumed_per_batch

    def same_layout_length(self) -> int | None:
        """Batches of a whole epoch on this loader's layout (``None`` when unknown)."""
        try:
            return self.batches_after(0)
        except TypeError:
            return None

    def resumed_batches(self) -> int:
        """Batches of the epoch that a resumed pass does not yield, on this layout."""
        total = self.same_layout_length()
        if total is None:
            return 0
        try:
            rest = (
                self.length() if self.pending is not None else self.batches_after(self.loader._pass.consumed_at_start)
            )
        except TypeError:
            return 0
        return max(total - rest, 0)

    # -- the start of a pass ----------------------------------------------------------------
    def start(self, current: Any) -> int:
        """Position the pass ``current`` (a :class:`~shardplug.core.loader.passes.LoaderPass` that begins) after
        the loaded position and the pending skip; return how many batches it reads and drops first."""
        discard = 0
        pending, self.pending = self.pending, None
        ended, self.ended = self.ended, False
        if ended:  # the rest of an epoch whose end was loaded: nothing (the DataLoader is not read)
            current.empty = True
            self.skip, self.inner.repositions = 0, False
            return 0
        if pending is not None:
            discard = self._start_after(pending, current)
        skip, self.skip = self.skip, 0
        if skip:  # skip_first_batches: this pass starts that many batches later still
            plan = self.plan
            current.consumed_at_start += skip * plan.consumed_per_batch
            current.resumed += skip
            if (
                self.loader.use_stateful_dataloader and self.inner_state_resumes()
            ):  # read through it: its state counts them
                discard += skip
                current.record.fast_forwarded += skip  # their records are not the batches handed out
            elif self.workers_split_stream():  # only whole batches tell where each worker is: read and drop them
                discard += skip
            else:
                discard = plan.start_after(current.consumed_at_start)
        self.inner.repositions = False  # a loaded state of the StatefulDataLoader's own repositions this pass only
        return discard

    def _start_after(self, position: Position, current: Any) -> int:
        """Position the pass ``current`` after what ``position`` consumed; return batches to read and drop."""
        plan = self.plan
        layout = plan.layout
        same_layout = (position.num_processes, position.split_batches) == (layout.num_processes, layout.split_batches)
        current.consumed_at_start = position.consumed
        if self.inner.repositions:  # a StatefulDataLoader that loaded its own state
            current.resumed = position.batches_yielded
            current.record.fast_forwarded = (
                current.resumed
            )  # drawn (and, where the sampler logs, logged) but not handed out
            return 0
        if same_layout:
            current.resumed = position.batches_yielded
            if self.workers_split_stream():  # only whole batches tell where each worker is: read and drop them
                return position.batches_yielded
        else:
            full, rest = plan.num_batches(0), plan.num_batches(position.consumed)
            current.resumed = (
                full - rest if full is not None and rest is not None else (position.consumed // plan.consumed_per_batch)
            )
        return plan.start_after(position.consumed, position.dataset_state)

    # -- positions --------------------------------------------------------------------------
    def position(self) -> Position:
        """Where the loader stands: a loaded position not iterated yet, else where its last pass stands."""
        if self.pending is not None:  # loaded but not iterated yet: still that position
            return self.pending
        return self.pass_position()

    def pass_position(self) -> Position:
        """Where the last pass stands, in this loader's own layout (a loaded position aside)."""
        loader, plan = self.loader, self.plan
        current, layout = loader._pass, plan.layout
        shuffles = self.shuffles()
        generator = shuffles.generator
        epoch, done, dataset_state = loader.epoch, current.batches_yielded, None
        consumed = current.consumed_at_start + (done - current.resumed) * plan.consumed_per_batch
        generator_state = current.generator_state
        # A pass is over for every process once none has a batch left. A process with fewer batches
        # (even_batches=False) reports the same place as the others until its loop has ended by itself,
        # then the epoch's end (the others finish theirs before they meet it again).
        finished = plan.finished(consumed)
        if finished is None:  # unknown lengths: where every process yields as many batches, all end together,
            # and process 0's last batch is the job's last where it holds the most (docs/resume.md)
            finished = (
                layout.pads
                or layout.drop_last
                or layout.num_processes == 1
                or (plan.first_holds_most and layout.process_index == 0)
            )
        if current.complete and (current.exhausted or finished):
            epoch, done, consumed = epoch + 1, 0, 0
            generator_state = generator.get_state() if generator is not None else None
        else:
            dataset_state = plan.saved_state(consumed)  # the plan's own part (a dataset's own position)
        if generator_state is None and generator is not None:
            generator_state = generator.get_state()
        return Position(
            epoch=epoch,
            batches_yielded=done,
            consumed=consumed,
            unit=plan.unit,
            num_processes=layout.num_processes,
            split_batches=layout.split_batches,
            even_batches=layout.even_batches,
            drop_last=layout.drop_last,
            dataset_length=None if plan.stream else loader.total_dataset_length,
            batch_size=layout.batch_size,
            process_batch_size=layout.process_batch_size,
            step_batch_size=layout.step_batch_size,
            sampler=shuffles.kind(plan.stream),
            num_workers=loader.num_workers,
            seeds=shuffles.seeds(),
            generator_state=generator_state,
            dataset_state=dataset_state,
        )

    def load(self, position: Position | dict[str, Any]) -> None:
        """Continue from ``position`` at the next pass; it is validated first, and nothing changes when
        it is refused."""
        if not isinstance(position, Position):
            position = Position.from_dict(position)
        self.check_loadable(position, stateful=False)
        self.apply(position)

    def apply(self, position: Position) -> None:
        """Continue from ``position`` (already checked) at the next pass."""
        self.pending = None  # a position loaded before is replaced
        self.shuffles().restore(position.seeds, position.generator_state)
        self.loader.set_epoch(position.epoch)
        self.pending = position
        self.skip = 0

    def resume_at(self, epoch: int, batches_yielded: int, seeds: Iterable[int | None] | None = None) -> None:
        """Continue in ``epoch`` after this process's first ``batches_yielded`` batches, with this layout."""
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

    # -- validation -------------------------------------------------------------------------
    def check_loadable(self, position: Position, stateful: bool) -> None:
        """Everything that refuses ``position`` for this loader, before anything changes."""
        current, processes = self.pass_position(), self.plan.layout.num_processes
        at_start = (position.consumed, position.batches_yielded) == (0, 0)  # nothing to share out anew
        if position.num_processes != processes and position.unit == current.unit and not at_start:
            self.refuse_resize(position, stateful and self.inner_state_resumes())
        self.check_workers(position)
        if self.workers_split_stream():
            if position.consumed and not stateful:
                raise ValueError(
                    f"with num_workers={self.loader.num_workers} each DataLoader worker reads its own part of this "
                    f"stream, so the place after {position.consumed} elements cannot be found by skipping elements; "
                    "resume at an epoch's start (a position saved after a complete pass), save and resume with "
                    "num_workers=0, or build both loaders with use_stateful_dataloader=True (each worker's place is "
                    "saved; same numbers of processes and workers)"
                )
        position.check_resumable(current, self.plan.epoch_size(), self.same_layout_length())

    def check_workers(self, position: Position) -> None:
        """Refuse a position inside an epoch whose place depends on the number of DataLoader workers
        (the loader's batches are read again and dropped, and the workers make them in their own
        order: a natively sharded stream, a stream that splits itself across workers) when it was saved
        with another number of workers than this loader's."""
        inside = (position.consumed, position.batches_yielded) != (0, 0)
        workers = self.loader.num_workers
        if (
            not inside
            or not (self.plan.splits_by_worker or position.unit == "batches")
            or position.num_workers == workers
        ):
            return
        if position.num_workers is None:
            raise ValueError(
                "the position was saved by a shardplug that did not record its DataLoader's num_workers, and this "
                "stream's place inside an epoch depends on it (each worker makes its own batches); resume from a "
                "position saved at an epoch's end, or with a position saved by this shardplug"
            )
        raise ValueError(
            f"the position was saved with num_workers={position.num_workers} and this loader has "
            f"num_workers={workers}: each DataLoader worker makes its own batches of this stream, so its "
            f"place inside an epoch depends on the number of workers; resume with num_workers={position.num_workers}, "
            "or from a position saved at an epoch's end"
        )

    def workers_split_stream(self) -> bool:
        """Data that splits itself across this loader's DataLoader workers: where each worker is cannot be
        found by skipping stream elements."""
        return self.plan.splits_by_worker and self.loader.num_workers > 0

    def refuse_resize(self, position: Position, inner_state: bool) -> None:
        """Refuse a position inside an epoch, of another number of processes, where this loader cannot resize
        (``inner_state``: a StatefulDataLoader's own state, each process's, is what resumes it)."""
        plan = self.plan
        moves = f"cannot move from {position.num_processes} to {plan.layout.num_processes} processes"
        anew = (
            f"resume with num_processes={position.num_processes}, or from a position saved at an epoch's end (it "
            "loads into any number of processes)"
        )
        if plan.reads_ahead or plan.unit == "batches":
            raise ValueError(
                "this stream is sharded natively (each process reads its own shards) or read by one process, so its "
                f"position counts this process's batches, and a position inside an epoch {moves}; {anew}"
            )
        if self.workers_split_stream():
            raise ValueError(
                f"with num_workers={self.loader.num_workers} each DataLoader worker reads its own part of this stream "
                "(it splits itself across workers), so its place is found by reading whole batches of the layout that "
                f"saved it, and a position inside an epoch {moves}; {anew}"
            )
        if inner_state:
            raise ValueError(
                "use_stateful_dataloader=True resumes this stream from each process's own saved state (its "
                f"DataLoader workers' places), which {moves}; {anew}"
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
        state = self.inner.state(loader._inner_loader())
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
        if self.position_suffices(position):
            self.apply(position)  # shardplug's own skip (exact) repositions the next pass
            return
        self.inner.load(loader._inner_loader(), state)
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
        * a plan whose batches are read ahead of those handed out (``plan.inner_state_resumes``: a
          natively sharded stream agrees its step counts a few batches ahead, a dispatcher's process 0
          reads a step ahead): the inner state is past the place.
        """
        return callable(getattr(self.loader.dataset, "state_dict", None)) and self.plan.inner_state_resumes
