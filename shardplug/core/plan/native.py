"""Streams that sharded themselves: equal step counts from the parts' lengths or an agreement."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..layout import ShardLayout
from ..rows import first_leaf, map_leaves
from .protocol import PassRecord, PlanDefaults, check_consumed

__all__ = ["NativeStreamPlan"]

logger = logging.getLogger(__name__)


def _rows(batch: Any) -> int:
    """Samples in a collated batch: the length of its first leaf (or of the batch itself)."""
    leaf = first_leaf(batch)
    return len(leaf) if hasattr(leaf, "__len__") else 1


def _detached(batch: Any) -> Any:
    """A copy of ``batch``'s tensors, kept as padding (the caller may change the batch in place)."""
    return map_leaves(batch, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


class NativeStreamPlan(PlanDefaults):
    """A stream that sharded itself: this process reads only its shards (``dataset.shard(N, i)``).

    Each element is read by one process.  Equal step counts come from the parts' batch counts
    (``counts``, when every part's length is known) or else from an agreement between the
    processes on when the first of them runs out: one integer all-reduce per
    :attr:`steps_per_agreement` steps, each process reading that many batches ahead.  Then
    ``even_batches=True``: a process that is done yields padding from the start of its own part
    (real count 0) until every process is done; ``drop_last=True``: every process stops at the
    first step some process cannot fill; ``even_batches=False``: no padding, a process may yield
    fewer batches.  ``agree(value, op)`` starts the reduction and returns a function that waits
    for it: the next agreement travels while the caller works on a chunk's last step.  A position
    counts this loader's batches (padding included): it resumes with the same number of processes.
    """

    unit = "batches"
    stream = True
    consumed_per_batch = 1
    untracked_reason = None
    identifies_samples = False  # the stream's elements have no index shardplug knows
    reads_ahead = True
    inner_state_resumes = False
    """Batches are read from the loader ahead of those handed out (the agreement's chunk), so a
    ``StatefulDataLoader``'s own state is past the place: a resume skips by this plan's count instead."""

    def __init__(
        self,
        layout: ShardLayout,
        counts: Sequence[int] | None = None,
        agree: Callable[[int, str], Callable[[], int]] | None = None,
        start: Callable[[int], tuple[int, bool]] | None = None,
    ) -> None:
        self.layout = layout
        self.counts = list(counts) if counts is not None else None
        self.agree = agree
        self.start = start
        """Called before each pass's reader starts with the batches a resume skips: how many of them the
        stream starts after by itself (its own state; the pass reads past the rest), and whether its
        state changed (see :meth:`~shardplug.core.presplit.NodePart.start`); ``None``: the pass reads past them."""
        self.pending_start = 0
        self.placed_by_stream = 0

    def epoch_size(self) -> int | None:
        return self.num_batches(0)

    def num_batches(self, consumed: int = 0) -> int | None:
        if self.counts is None:
            return None
        if self.layout.pads:
            target = max(self.counts)
        elif self.layout.drop_last:
            target = min(self.counts)
        else:
            target = self.counts[self.layout.process_index]
        return max(target - check_consumed(consumed), 0)

    def finished(self, consumed: int) -> bool | None:
        if self.counts is None:
            return None
        if self.layout.pads or self.layout.drop_last:
            return self.num_batches(consumed) == 0
        return max(self.counts) <= consumed

    def start_after(self, consumed: int, dataset_state: Any = None) -> int:
        self.pending_start = check_consumed(consumed)
        return 0  # pass_batches reads past them (keeping the first one: padding reads it)

    @contextlib.contextmanager
    def start_in_workers(self, num_workers: int) -> Iterator[bool]:
        """The stream positions itself here, before its reader starts, where it can (:attr:`start`)."""
        changed = False
        if self.start is not None:
            self.placed_by_stream, changed = self.start(self.pending_start)
        yield changed

    def samples_before(self, consumed: int) -> int | None:
        return None  # each process counts its own part's batches: no global batch boundary

    def batch_record(self, record: PassRecord, batch: int) -> tuple[list[int] | None, int]:
        return record.batches.popleft() if record.batches else (None, 0)

    steps_per_agreement = 8
    """Steps agreed on by one collective: each process reads that many batches ahead and tells how
    many it has (one all-reduce per ``steps_per_agreement`` steps, in flight during a step).  Lower
    it for very large batches (they are held ahead); measured: 1.03x the time of no agreement at
    8, 1.06x at 4, 1.11x at 1, for 1 ms steps on 2 gloo processes (``benchmarks/run.py`` P8)."""

    def pass_batches(self, batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
        start, self.pending_start = self.pending_start, 0
        iterator = iter(batches)
        head: list[Any] = []  # the first batch of this process's part: what padding repeats
        exhausted = False

        def fetch() -> Any:
            nonlocal exhausted
            batch = _END if exhausted else next(iterator, _END)
            exhausted = batch is _END
            if batch is not _END and not head:
                head.append(_detached(batch))
            return batch

        skip, self.placed_by_stream = start - self.placed_by_stream, 0
        for _ in range(skip):  # read past what the position consumed (padding steps included)
            if fetch() is _END:
                break
        total = self.num_batches(start)
        chunk = self.steps_per_agreement

        def begin(taken: int) -> tuple[list[Any], Callable[[], int]]:
            """The next ``chunk`` batches this process has, and (waiting when called) how many steps
            every process takes of them."""
            ahead: list[Any] = []
            while len(ahead) < chunk and not exhausted:
                batch = fetch()
                if batch is not _END:
                    ahead.append(batch)
            return ahead, self._steps(len(ahead), taken, total)

        taken = 0
        ahead, agreed = begin(taken)
        while True:
            steps = agreed()
            following = None
            for k in range(steps):
                if k == steps - 1 and steps == chunk:  # the next agreement travels during this chunk's last step
                    following = begin(taken + steps)
                yield self._step(ahead, k, head, record)
            taken += steps
            if following is None:  # fewer than a chunk: some (or every) process ran out
                if len(ahead) > steps:
                    logger.info(
                        "stopped after %d batches: another process's part of the stream ran out first "
                        "(drop_last=True); this process's remaining elements were not used",
                        start + taken,
                    )
                return
            ahead, agreed = following

    def _step(self, ahead: list[Any], k: int, head: list[Any], record: PassRecord) -> Any:
        """The ``k``-th step of a chunk: this process's batch, or padding when it has none left."""
        if k < len(ahead):
            if record.batches is not None:
                record.batches.append((None, _rows(ahead[k])))  # type: ignore[arg-type]
            return ahead[k]
        if not head:
            raise ValueError(
                f"process {self.layout.process_index}'s part of the stream is empty, so it has nothing to pad with "
                "while the other processes go on; give the stream at least num_processes shards with data, or "
                "pass even_batches=False"
            )
        if record.batches is not None:
            record.batches.append((None, 0))  # type: ignore[arg-type]
        return head[0]

    def _steps(self, available: int, taken: int, total: int | None) -> Callable[[], int]:
        """How many of the next chunk's steps every process takes, as a function that waits for the
        answer: the counts decide when they are known, else an agreement (started now)."""
        if total is not None:  # the counts say how many steps: padding fills what this part lacks
            answer = max(min(self.steps_per_agreement, total - taken), 0)
            return lambda: answer
        if self.layout.num_processes == 1 or not (self.layout.pads or self.layout.drop_last) or self.agree is None:
            return lambda: available  # even_batches=False: no padding, no agreement
        pending = self.agree(available, "max" if self.layout.pads else "min")
        return pending


_END = object()
