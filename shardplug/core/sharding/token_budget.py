"""Token budgets: micro-batches by a budget of tokens, planned for all processes at once.

The whole path of this kind of sharding: the user's :class:`TokenBudgetBatchSampler` (given to a ``DataLoader`` as
its ``batch_sampler``), the wrapper ``prepare_data_loader`` puts in its place (:class:`TokenBudgetShard`) and its
:class:`TokenBudgetPlan`: which micro-batches this process gets (the epoch's plan of
:mod:`~shardplug.core.sharding.budget_plan`, computed alike on every process), ``len()`` and where a pass resumes.

A place in an epoch counts the samples its steps consumed (unit ``"samples"``); inside a window of the plan, a
position also records the numbers of processes the window was planned for (its ``dataset_state``), so that on
another number of processes the rest of the epoch is planned again, every remaining sample once.

Example::

    >>> from torch.utils.data import DataLoader
    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> sampler = TokenBudgetBatchSampler([4, 3, 6, 2, 5, 1], max_tokens=10, shuffle=False)
    >>> list(sampler), len(sampler)
    ([[2, 5], [4, 3], [0, 1]], 3)
    >>> part = shard(DataLoader(range(6), batch_sampler=sampler), ShardLayout(2, 1))
    >>> list(part.loader_kwargs["batch_sampler"])
    [[4], [1, 3]]
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, Sampler

from shardplug.core._internal.collectives import all_gather_objects, world_size
from shardplug.core.sharding.budget_plan import BudgetSpec, EpochPlan, Replans, Strata, as_lengths, plan_epoch
from shardplug.core.sharding.kinds import Shard
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.map_style import BatchSamplerPlan, BatchSamplerShard
from shardplug.core.sharding.shard_plan import PassRecord, check_consumed, sized_length

__all__ = [
    "TokenBudgetBatchSampler",
    "TokenBudgetPlan",
    "TokenBudgetShard",
    "StepTotals",
    "agree",
    "shard",
    "step_totals",
]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Micro-batches of at most ``max_tokens`` tokens, for a ``DataLoader``'s ``batch_sampler``.

    ``lengths``: each sample's number of tokens (a sequence, a numpy array or a ``numpy.memmap``, used as it is).
    ``cost``: what is balanced between the processes' micro-batches of a step: ``"tokens"`` (the sum of lengths:
    packed rows), ``"padded"`` (rows times the longest: padded batches; their rows then have nearly one length)
    or ``"attention"`` (the sum of squared lengths).  ``shuffle``, ``seed``: the epoch's order, drawn from
    ``(seed, epoch)`` alike on every process (``set_epoch`` changes it).  ``drop_last``: a step in which some
    process would get no sample is dropped instead of padded.

    Alone it yields one process's micro-batches; prepared (``prepare_data_loader``) for N processes, each
    epoch is planned for all of them at once: every process the same number of micro-batches, each within
    ``max_tokens``, the N micro-batches of each step of about the same cost, every sample once per epoch.
    A sample longer than ``max_tokens`` is a ``ValueError`` naming it, or with ``oversized="alone"`` a micro-batch
    of its own (the only ones above the budget).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        cost: str = "tokens",
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        oversized: str = "error",
    ) -> None:
        self.spec = BudgetSpec(
            max_tokens, cost=cost, shuffle=bool(shuffle), seed=seed, drop_last=bool(drop_last), oversized=oversized
        )
        self.lengths = as_lengths(lengths, max_tokens, oversized)
        self.epoch = 0

    max_tokens = property(lambda self: self.spec.max_tokens)
    cost = property(lambda self: self.spec.cost)
    shuffle = property(lambda self: self.spec.shuffle)
    seed = property(lambda self: self.spec.seed)
    drop_last = property(lambda self: self.spec.drop_last)
    oversized = property(lambda self: self.spec.oversized)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next pass plans (with the seed)."""
        self.epoch = int(epoch)

    def plan(
        self, num_processes: int = 1, start: int = 0, replans: Replans | None = None, epoch: int | None = None
    ) -> EpochPlan:
        """This epoch's plan (``epoch``: another's) for ``num_processes`` (see
        :func:`~shardplug.core.sharding.budget_plan.plan_epoch`)."""
        epoch = self.epoch if epoch is None else epoch
        return plan_epoch(self.spec, self.lengths, num_processes, epoch, start, replans, self.strata())

    def strata(self) -> Strata:
        """What every epoch's plan shares (made once for the lengths and options; see
        :class:`~shardplug.core.sharding.budget_plan.Strata`)."""
        kept = self.__dict__.get("_strata")
        if kept is None or kept.spec != self.spec or kept.lengths is not self.lengths:
            kept = Strata(self.lengths, self.spec)
            self.__dict__["_strata"] = kept
        strata: Strata = kept
        return strata

    def _alone(self) -> EpochPlan:
        """This epoch's plan for one process, made once per epoch (``len()`` and iteration ask it)."""
        kept = self.__dict__.get("_alone_plan")
        if kept is None or kept[0] != self.epoch:
            kept = (self.epoch, self.plan())
            self.__dict__["_alone_plan"] = kept
        plan: EpochPlan = kept[1]
        return plan

    def __len__(self) -> int:
        return self._alone().num_steps

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._alone()
        step = 0
        while plan.has_step(step):  # the windows planned as the pass reaches them
            yield plan.micro_batch(step, 0)[0]
            step += 1


class StepTotals(NamedTuple):
    """The real tokens and samples of a group of steps over all processes (padding not counted)."""

    tokens: int
    samples: int


class TokenBudgetPlan(BatchSamplerPlan):
    """One process's micro-batches of the epoch's plan of a :class:`TokenBudgetBatchSampler` (see the module)."""

    unit = "samples"
    stream = False
    first_holds_most = True  # every process holds as many micro-batches
    identifies_samples = True

    def __init__(self, budget: TokenBudgetBatchSampler, layout: ShardLayout, reads_all: bool = False) -> None:
        super().__init__(budget, layout)
        self.budget = budget
        self.reads_all = reads_all
        """A pass reads every process's micro-batches, step by step in process order (a dispatcher's process 0,
        which sends each process its own); else this process's only."""
        self.pending_replans: Replans | None = None
        self.places: dict[int, Replans] = {}
        """Places of loaded positions and how their windows were planned, until a pass begins (a later pass at
        the same place, of this epoch again or another, plans its own window: the loaded history is not its)."""
        self.loading: tuple[int, int] | None = None
        """The place and epoch of the position loaded last, until its pass begins (the loader stands at its epoch
        only then: before, its place is asked of that epoch)."""
        self.current: EpochPlan | None = None
        """The plan of the pass in progress or the last one (it begins where the pass began)."""
        self.current_epoch = -1
        self.current_start = 0
        """Where the pass in progress or the last one began (its plan may begin earlier: one made before)."""
        self.plans: list[tuple[tuple[int, int, Replans | None], EpochPlan]] = []
        """The last few plans made, with their (epoch, start, replans): a plan passes many places."""

    @property
    def sampler(self) -> Any:
        return None

    @property
    def consumed_per_batch(self) -> int:
        """The processes' micro-batches per step (a step's samples vary: :meth:`consumed_after` counts them)."""
        return self.layout.num_processes

    def _plan(self, start: int, replans: Replans | None = None) -> EpochPlan:
        """The epoch's plan through the place ``start``: one made before that passes there, else a new one
        from ``start`` (``replans``: how its window was planned; by default a loaded position's, at its place)."""
        epoch = self.budget.epoch
        if self.loading is not None and self.loading[0] == start:  # a loaded position's place: of its epoch
            epoch = self.loading[1]
        if replans is None and start and start == self.pending_start:
            replans = self.pending_replans
        if replans is None:
            replans = self.places.get(start)
        current = self.current
        if replans is None and current is not None and self.current_epoch == epoch and current.passes(start):
            return current  # the pass's own plan first: the places of its steps
        for (made_epoch, made_start, made_replans), plan in self.plans:
            if made_epoch != epoch:
                continue
            if (replans is None and plan.passes(start)) or (made_start, made_replans) == (start, replans):
                return plan
        plan = self.budget.plan(self.layout.num_processes, start, replans, epoch)
        self.plans = [((epoch, start, replans), plan), *self.plans[:2]]
        return plan

    def consumed_after(self, start: int, batches: int) -> int:
        """The place after this process's next ``batches`` micro-batches from the place ``start``."""
        if not batches:
            return start
        plan = self._plan(start)
        before = plan.steps_before(start)
        step = before + batches - 1
        if not plan.has_step(step):
            raise ValueError(
                f"{batches} micro-batches after {start} samples pass the epoch's end ({plan.num_steps - before} steps "
                f"left on {self.layout.num_processes} processes)"
            )
        return plan.consumed_at(step)

    def epoch_size(self) -> int:
        return int(self.budget.lengths.size)

    def num_batches(self, consumed: int = 0) -> int:
        plan = self._plan(check_consumed(consumed))
        return plan.num_steps - plan.steps_before(consumed)

    def has_batches(self, consumed: int, count: int) -> bool:
        """Whether ``count`` more micro-batches follow the place ``consumed`` (the windows up to them planned)."""
        plan = self._plan(check_consumed(consumed))
        return count <= 0 or plan.has_step(plan.steps_before(consumed) + count - 1)

    def batches_before(self, consumed: int) -> int:
        """The epoch's steps on this layout before the place ``consumed`` (another layout's position's):
        ``num_batches(0) - num_batches(consumed)``, counted through the place's window only (the windows after it
        are planned alike in the epoch's plan and in the place's; the windows through it, from their starts, have
        the steps the :class:`~shardplug.core.sharding.budget_plan.Strata` counts)."""
        plan = self._plan(check_consumed(consumed))  # the place's (one from before it, where one passes it)
        window = plan.window_of(consumed)
        after = plan.steps_through_window(window) - plan.steps_before(consumed)  # its window's steps after the place
        return max(self.budget.strata().steps_through(self.layout.num_processes, window) - after, 0)

    def samples_before(self, consumed: int) -> int:
        return consumed

    def finished(self, consumed: int) -> bool:
        if consumed == 0 and not self.budget.drop_last:  # every window of samples makes a step: nothing to plan
            return self.epoch_size() == 0
        return consumed >= self.epoch_size() or not self.has_batches(consumed, 1)

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start, self.pending_replans = check_consumed(consumed), _replans(dataset_state)
        return 0

    def note_place(self, consumed: int, dataset_state: Any, epoch: int) -> Callable[[], None]:
        places, plans, loading = dict(self.places), list(self.plans), self.loading

        def forget() -> None:  # the place and the plans made for it, where the position is refused
            self.places, self.plans, self.loading = places, plans, loading

        try:
            self.loading = (check_consumed(consumed), epoch)
            replans = _replans(dataset_state)
            if replans is not None:
                self.places[check_consumed(consumed)] = replans
            if consumed:
                self._plan(consumed, replans)  # a ValueError where the place is none of the plan's
        except Exception:
            forget()
            raise
        return forget

    def saved_state(self, consumed: int) -> Any:
        """How the window of the place ``consumed`` was planned (``None`` at a window's start)."""
        if consumed == 0:  # the epoch's start: nothing to plan (a loader not yet iterated asks it)
            return None
        replans = self._plan(consumed).replans_at(consumed)
        return None if replans is None else {"replans": [list(pair) for pair in replans]}

    def next_pass(self) -> Iterator[list[int]]:
        first, record = self.begin_reading()
        yield from self._index_batches(first, record if record is not None else PassRecord())

    def begin_reading(self) -> tuple[int, PassRecord | None]:
        """A pass begins: its start and the record parked for it, taken (one-shot), and its plan made (what
        :meth:`step_totals` and :meth:`pass_micro_batch` read).  A process that does not iterate its batch
        sampler (a dispatcher's other processes) calls it as its pass begins."""
        self.loading = None  # the loader stands at the loaded position's epoch now
        first, record, self.pending_start, self.parked_record = self.pending_start, self.parked_record, 0, None
        replans, self.pending_replans = self.pending_replans, None
        self.current, self.current_epoch, self.current_start = self._plan(first, replans), self.budget.epoch, first
        self.places = {}  # the pass's plan holds the loaded place's history (replans_at): later passes are not its
        return first, record

    def _index_batches(self, consumed: int, record: PassRecord) -> Iterator[list[int]]:
        record.started_at = consumed
        plan = self._plan(consumed)
        self.current, self.current_epoch, self.current_start = plan, self.budget.epoch, consumed
        log = record.batches
        process = self.layout.process_index
        step = plan.steps_before(consumed)
        if self.reads_all:  # every process's micro-batch of each step, in process order (none logged: each
            while plan.has_step(step):  # process's own are the plan's, see pass_micro_batch)
                for p in range(plan.num_processes):
                    yield plan.micro_batch(step, p)[0]
                step += 1
            return
        while plan.has_step(step):  # the windows planned as the pass reaches them
            indices, real = plan.micro_batch(step, process)
            step += 1
            if log is not None:
                log.append((indices, real))
            yield indices

    def _pass_step(self, batch: int) -> tuple[EpochPlan, int]:
        """The pass's plan and the step in it of the pass's ``batch``-th batch (0: the pass's first)."""
        plan = self.current
        if plan is None:
            raise ValueError("no pass of this loader has begun: iterate it first")
        return plan, plan.steps_before(self.current_start) + batch

    def pass_micro_batch(self, batch: int) -> tuple[list[int], int]:
        """(sample indices, real count) of this process's ``batch``-th micro-batch of the pass in progress."""
        plan, step = self._pass_step(batch)
        return plan.micro_batch(step, self.layout.process_index)

    def pass_step(self, batch: int) -> tuple[int, int]:
        """(real samples over all processes, fingerprint of its micro-batches) of the pass's ``batch``-th step: the
        fingerprint changes with any sample, its place or its micro-batch (a dispatched step is checked by it)."""
        plan, step = self._pass_step(batch)
        n = plan.num_processes
        parts = [plan.micro_batch(step, p) for p in range(n)]  # (a padding micro-batch: one sample, none real)
        ids = np.array([i for indices, _ in parts for i in indices], dtype=np.uint64) + np.uint64(1)
        places = np.arange(1, ids.size + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        sizes = np.array([len(indices) for indices, _ in parts], dtype=np.uint64) * np.arange(1, n + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64, alike on every process
            mixed = int((ids * places).sum(dtype=np.uint64) ^ sizes.sum(dtype=np.uint64))
        return sum(real for _, real in parts), mixed >> 2  # within an int64 message

    def step_totals(self, first: int, count: int) -> StepTotals:
        """The real tokens and samples over all processes of ``count`` steps from the pass's step ``first`` (0: the
        pass's first; negative: before the pass began, counted from a plan of the windows before it where its
        window was planned on this number of processes alone, else not)."""
        plan = self.current
        if plan is None:
            raise ValueError("no pass of this loader has begun: iterate it first")
        start, before = self.current_start, first
        first = before + plan.steps_before(start)
        window = plan.window_of(start) + 1
        alone = plan.replans_at(start) in (None, ((self.layout.num_processes, 0),))
        while first < 0 and window > 0 and alone:
            window -= 1  # a plan from an earlier window's start, on this number of processes, passes the place
            begin = int(plan.window_starts[window])
            if begin < start:
                plan = self._plan(begin)
                first = before + plan.steps_before(start)
        return StepTotals(*plan.totals(first, first + count))


def _replans(dataset_state: Any) -> Replans | None:
    """How a position's window was planned, from its ``dataset_state`` (:meth:`TokenBudgetPlan.saved_state`)."""
    if dataset_state is None:
        return None
    try:
        return tuple((int(n), int(at)) for n, at in dataset_state["replans"])
    except (TypeError, KeyError, ValueError):
        raise ValueError(
            f"the position's dataset_state={dataset_state!r} is not a token budget's (a dict with 'replans': "
            "[[num_processes, samples], ...]); load the position this loader saved"
        ) from None


class TokenBudgetShard(BatchSamplerShard):
    """This process's micro-batches of a :class:`TokenBudgetBatchSampler` (what ``prepare_data_loader`` gives the
    ``DataLoader`` as its batch sampler); ``len()`` is exactly what it yields."""

    plan: TokenBudgetPlan

    def __init__(  # noqa: D107
        self, budget: TokenBudgetBatchSampler, layout: ShardLayout, reads_all: bool = False
    ) -> None:
        self.batch_sampler = budget
        self.plan = TokenBudgetPlan(budget, layout, reads_all)
        self.epoch = 0

    def __len__(self) -> int:
        """The micro-batches it yields: this process's, or with ``reads_all`` every process's."""
        steps = self.plan.num_batches(self.plan.pending_start)
        return steps * self.layout.num_processes if self.plan.reads_all else steps

    @property
    def sampler(self) -> Any:
        """The budget's sampler itself: the epoch of its order is set where a framework sets a batch sampler's
        sampler's (Lightning's loops)."""
        return self.batch_sampler

    def skip_next(self, num_batches: int) -> None:
        if num_batches < 0:
            raise ValueError(f"num_batches={num_batches} must be >= 0")
        self.plan.start_after(self.plan.consumed_after(0, num_batches))


def agree(budget: TokenBudgetBatchSampler, layout: ShardLayout) -> None:
    """Refuse processes whose samplers would plan different epochs (another number or sum of lengths, another
    ``max_tokens``, cost, shuffle, seed or ``drop_last``): their micro-batch counts would differ, and a step's
    collective would wait for a process that has none.  One all-gather, where the job's processes are the
    layout's (a process group of ``num_processes``); a mismatch is a ``ValueError`` on every process."""
    if layout.num_processes == 1 or world_size() != layout.num_processes:
        return
    mine = (int(budget.lengths.size), int(budget.lengths.sum(dtype=np.int64)), budget.spec)
    everyone = all_gather_objects(mine, what="every process's TokenBudgetBatchSampler (its lengths and options)")
    other = next((rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]), None)
    if other is None:
        return

    def described(rank: int) -> str:
        count, total, spec = everyone[rank]
        return (
            f"process {rank}: {count} lengths summing to {total}, max_tokens={spec.max_tokens}, cost={spec.cost!r}, "
            f"shuffle={spec.shuffle}, seed={spec.seed}, drop_last={spec.drop_last}"
        )

    raise ValueError(
        f"the processes' TokenBudgetBatchSamplers differ ({described(0)}; {described(other)}): they would plan "
        "different micro-batches and numbers of steps, and a step's collective would wait for a process that has "
        "none; give every process the same lengths, max_tokens, cost, shuffle, seed and drop_last"
    )


def shard(dataloader: DataLoader[Any], layout: ShardLayout, reads_all: bool = False) -> Shard:
    """This process's part of a loader whose batch sampler is a :class:`TokenBudgetBatchSampler` (a copy: the
    user's is never changed), under ``layout``: every process plans the same epochs from the seed, so nothing
    is agreed but the dataset's length, compared when the loader is prepared.  ``reads_all``: the part reads
    every process's micro-batches of each step (a dispatcher's process 0 sends each process its own)."""
    budget = copy.copy(dataloader.batch_sampler)
    assert isinstance(budget, TokenBudgetBatchSampler)
    budget.__dict__.pop("_alone_plan", None)  # the prepared plans are the shard's
    length = sized_length(dataloader.dataset)
    if length is not None and length != budget.lengths.size:
        raise ValueError(
            f"the TokenBudgetBatchSampler has {budget.lengths.size} lengths and the dataset {length} samples; pass "
            "one length per sample of the dataset"
        )
    agree(budget, layout)
    part = TokenBudgetShard(budget, layout, reads_all)
    check = (length, None) if layout.num_processes > 1 else None
    return Shard(dataloader.dataset, part.plan, {"batch_sampler": part}, None, check)


def step_totals(loader: Any, accumulation_steps: int = 1) -> StepTotals:
    """The real tokens and samples, over all processes, of the optimizer step that the batch ``loader`` handed out
    last belongs to: with ``accumulation_steps`` k, its k micro-batches on every process (a step's micro-batches
    are counted from the epoch's start, as the loader counts them: the k batches from batch ``k * (i // k)``).
    Known from the plan on every process, without a collective: divide a loss summed over tokens by
    ``totals.tokens`` and its gradient is the mean over the step's tokens of all processes (a DDP all-reduce
    averages over the N processes: multiply by N).

    ``loader``: a prepared loader whose batch sampler is a :class:`TokenBudgetBatchSampler`.  After a resume
    inside an optimizer step, the micro-batches of that step handed out before the resume are counted too where
    the position was saved on the same number of processes (after a resize they were another layout's: not).

    Example::

        >>> from torch.utils.data import DataLoader
        >>> from shardplug import prepare_data_loader
        >>> sampler = TokenBudgetBatchSampler([4, 3, 6, 2, 5, 1], max_tokens=10, shuffle=False)
        >>> loader = prepare_data_loader(DataLoader(range(6), batch_sampler=sampler), num_processes=2, process_index=0)
        >>> batches = iter(loader); first = next(batches)
        >>> step_totals(loader), step_totals(loader, accumulation_steps=2)
        (StepTotals(tokens=11, samples=2), StepTotals(tokens=21, samples=6))
    """
    plan = getattr(loader, "plan", None)
    if not isinstance(plan, TokenBudgetPlan):  # a dispatcher's: the steps of its token budget's plan
        plan = getattr(plan, "source", None)
    if not isinstance(plan, TokenBudgetPlan):
        raise TypeError(
            f"step_totals needs a prepared loader whose batch_sampler is a TokenBudgetBatchSampler, got {loader!r}; "
            "pass the loader prepare_data_loader returned for "
            "DataLoader(..., batch_sampler=TokenBudgetBatchSampler(...))"
        )
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an integer >= 1")
    now = loader.cursor.now
    if now.yielded <= now.resumed:
        raise ValueError("the loader has handed out no batch in this pass yet: call step_totals after next(loader)")
    index = now.yielded - 1
    return plan.step_totals(index - index % accumulation_steps - now.resumed, accumulation_steps)
