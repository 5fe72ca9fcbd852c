"""Dispatch of a token budget's micro-batches: process 0 reads every process's, each process receives its own.

A :class:`~shardplug.core.sharding.token_budget.TokenBudgetBatchSampler` plans each step's ``N`` micro-batches for
all processes at once (:class:`~shardplug.core.sharding.token_budget.TokenBudgetPlan`, made alike on every
process).  Dispatched, process 0's batch sampler yields every process's micro-batch of each step, in process order
(the plan's ``reads_all``), and :class:`BudgetDispatchPlan` makes each step of them whole: process ``p`` receives
exactly micro-batch ``p`` of the step, as collated, never a slice of a concatenation, and the dispatcher adds no
padding of its own (the plan's padding micro-batches are its own, at whichever process the plan puts them).

Everything else is the token budget's plan, on every process: ``len()``, the places of a position (samples,
``unit="samples"``), resume and resize, each batch's samples and real count (``track_padding``, the audit) and
:func:`~shardplug.core.sharding.token_budget.step_totals`.  The step's message carries its real samples over all
processes and a fingerprint of its samples, which every process compares with its own plan's (a plan that differs
from process 0's, e.g. an epoch set on some processes only, is a
:class:`~shardplug.core.dispatch.dispatch_plan.DispatchError`, not wrong marks).

Example (2 processes: process 0 reads both micro-batches of each step, in process order)::

    >>> from shardplug.core.sharding.layout import ShardLayout
    >>> from shardplug.core.sharding.token_budget import TokenBudgetBatchSampler, TokenBudgetPlan
    >>> budget = TokenBudgetBatchSampler([4, 3, 6, 2, 5, 1], max_tokens=10, shuffle=False)
    >>> plan = BudgetDispatchPlan(ShardLayout(2, 0), TokenBudgetPlan(budget, ShardLayout(2, 0), reads_all=True))
    >>> plan.num_batches(), plan.unit, list(plan.source.next_pass())
    (2, 'samples', [[2], [4], [0, 5], [1, 3]])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from shardplug.core._internal.rows import batch_rows, flatten
from shardplug.core.dispatch.dispatch_plan import CutStep, DispatchError, DispatchPlan, StepPadding
from shardplug.core.sharding.layout import ShardLayout
from shardplug.core.sharding.shard_plan import PassRecord
from shardplug.core.sharding.token_budget import TokenBudgetPlan

__all__ = ["BudgetDispatchPlan"]


class BudgetDispatchPlan(DispatchPlan):
    """The steps of a token budget's plan (``source``), each of its ``N`` micro-batches sent whole to its process
    (see the module)."""

    unit = "samples"
    stream = False
    first_holds_most = True  # every process holds as many micro-batches
    identifies_samples = True  # each process's batch records are its micro-batches' samples, from the plan

    source: TokenBudgetPlan

    def __init__(self, layout: ShardLayout, source: TokenBudgetPlan) -> None:
        super().__init__(layout, None, source)
        self.read_steps = 0
        """Process 0: the steps of the pass in progress read so far (each step's real samples are the plan's)."""

    # -- the token budget's answers: lengths and places -----------------------------------------------------
    @property
    def consumed_per_batch(self) -> int:
        return self.source.consumed_per_batch

    def consumed_after(self, start: int, batches: int) -> int:
        return self.source.consumed_after(start, batches)

    def note_place(self, consumed: int, dataset_state: Any, epoch: int) -> Callable[[], None]:
        return self.source.note_place(consumed, dataset_state, epoch)

    def epoch_size(self) -> int:
        return self.source.epoch_size()

    def num_batches(self, consumed: int = 0) -> int:
        return self.source.num_batches(consumed)

    def batches_before(self, consumed: int) -> int:
        return self.source.batches_before(consumed)

    def samples_before(self, consumed: int) -> int:
        return self.source.samples_before(consumed)

    def finished(self, consumed: int) -> bool:
        return self.source.finished(consumed)

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        """The pass's steps as received, each checked against this process's plan: the pass's plan is taken where
        the batch sampler is not iterated (every process but 0), and each step's real samples and the fingerprint
        of its samples, as the message told them, must be the plan's."""
        if self.layout.process_index != 0:
            self.source.begin_reading()
        self.read_steps = 0
        for step, item in enumerate(batches):
            told = (record.step_real[0] if record.step_real is not None else None, record.step_samples)
            planned = self.source.pass_step(step)
            if told != planned:
                raise DispatchError(
                    f"process 0 sent step {step} of the pass with {told[0]} real samples (fingerprint {told[1]}) "
                    f"where this process's token-budget plan has {planned[0]} (fingerprint {planned[1]}): the "
                    "processes plan different epochs or places; call set_epoch, load_state_dict and "
                    "skip_first_batches alike on every process"
                )
            yield item

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        """This process's micro-batch of the pass's ``batch``-th step, as its plan has it (indices, real count)."""
        return self.source.pass_micro_batch(batch)

    # -- the steps process 0 makes: whole micro-batches --------------------------------------------------------
    def takes_step(self, group: list[Any]) -> bool:
        if len(group) != self.layout.num_processes:  # the plan gives every process a micro-batch at every step
            raise DispatchError(
                f"the token budget's plan gave a step of {len(group)} micro-batches for {self.layout.num_processes} "
                "processes; please report this to shardplug"
            )
        return True

    def check_step(self, group: list[Any]) -> list[int]:
        """The rows of each micro-batch (0 where it has none to count); a :class:`DispatchError` where they differ
        in structure (each process rebuilds its batch on the structure of process 0's).  Their rows, shapes and
        dtypes may differ: each is sent whole, with its own."""
        rows, first = [], None
        for batch in group:
            leaves, skeleton = flatten(batch)
            if first is None:
                first = (skeleton, len(leaves))
            elif (skeleton, len(leaves)) != first:
                raise DispatchError(
                    "dispatch_batches=True sends each process its token-budget micro-batch whole, but the "
                    "micro-batches of one step differ in structure (their keys or nesting); have the collate_fn "
                    "return one structure for every micro-batch, or pass dispatch_batches=False"
                )
            rows.append(batch_rows(leaves) or 0)
        return rows

    def epoch_head(self, group: list[Any], record: PassRecord, load: Callable[[list[int]], Any] | None = None) -> Any:
        """No rows pad a step here (the plan's padding micro-batches are read like the others)."""
        return group

    def step(self, group: list[Any], rows: list[int], head: Any, uncut: bool) -> Any:
        """The step: micro-batch ``p`` is process ``p``'s, whole."""
        return CutStep(group)

    def padding_of(self, step: Any, rows: list[int]) -> StepPadding:
        """The step's real samples over all processes and the fingerprint of its samples (the plan's, counted as
        process 0 reads the steps); the dispatcher's cut adds no padding (``part`` is the number of processes):
        each process's real samples are its plan's."""
        real, samples = self.source.pass_step(self.read_steps)
        self.read_steps += 1
        return StepPadding(real, self.layout.num_processes, 0, samples)
