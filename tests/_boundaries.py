"""One oracle for a run interrupted at an epoch's boundaries and resumed, for every front end (test helper).

A :class:`Setup` is a training run's options (samples, batch per process, gradient accumulation,
``drop_last``, DataLoader workers, a seeded or an agreed shuffle, an epoch-end validation). Each front
end's scenario program (Lightning, Fabric, Ignite, plain PyTorch) trains it for 2 epochs on N
processes, saves positions at the boundaries (:data:`POINTS`), is killed with SIGKILL at the first
step of epoch 1, and resumes each saved position on M processes to the end of epoch 1; it records
every batch as a :data:`Row`. :func:`check_resumed` then asserts, from one oracle, what an
uninterrupted run promises:

* every real sample of each epoch exactly once across the run before and the run after the save
  (``drop_last``: at most once, less than one step of the new layout short), the padding marked
  (``batch_real_count``) and only in the epoch's last step, every other batch full, equal batches on every
  process;
* each epoch's batch indices on the new layout: contiguous, the same on every process, ending at the
  epoch's last batch (the documented number of batches of that layout);
* optimizer steps by the documented rule (after every ``accumulation``-th batch of the epoch and after
  its last batch), counted on from the saved count; scheduler steps = optimizer steps x the run's factor.
  The same rule in every front end: the core's ``GradientState`` (plain PyTorch, Ignite) aligns its cycle to
  the epoch's cycles of the new layout as a resumed pass begins, Lightning steps by ``batch_idx``;
* the epoch after the resumed one, and a resumed epoch that starts at its beginning (a position saved at
  the previous epoch's end), equal to an uninterrupted run's of M processes (a seeded shuffle).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

POINTS = ("first_step", "middle_step", "last_step", "in_accumulation", "epoch_end", "after_validation")
"""Where a position is saved: after the first, a middle and the last optimizer step of epoch 0, after a
micro-batch inside an accumulation cycle, at epoch 0's end (before any validation), after its
epoch-end validation."""

Row = list[Any]
"""``[epoch, batch index in the epoch, real sample ids, padding ids, optimizer steps before it, scheduler steps
before it]``: one batch as a front end's training step saw it."""


@dataclass(frozen=True)
class Setup:
    """The options of a run: ``n`` samples ``0 .. n-1``, ``batch`` per process, ``shuffle`` "seeded"
    (``use_seedable_sampler`` + ``data_seed``), "agreed" (a ``shuffle=True`` DataLoader, its seed agreed from
    process 0) or "mixture" (a ``shardplug.Mixture`` of the samples' two halves weighted alike, ``n`` even: each
    epoch reads each half's cycle once), ``validation``: an epoch-end validation loop (Lightning)."""

    n: int = 37
    batch: int = 2
    accumulation: int = 1
    drop_last: bool = False
    workers: int = 0
    shuffle: str = "seeded"
    validation: bool = False
    epochs: int = 2
    points: tuple[str, ...] = ()
    """The points saved at, where not every one that meets the setup (a setup for a kind of data, not options)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Setup:
        return cls(**json.loads(text))

    def batches_per_epoch(self, processes: int) -> int:
        """The batches each of ``processes`` processes trains per epoch."""
        step = self.batch * processes
        return self.n // step if self.drop_last else math.ceil(self.n / step)

    def steps_after(self, batch_index: int, processes: int) -> bool:
        """Whether the optimizer steps after the epoch's ``batch_index``-th batch (the documented rule)."""
        last = self.batches_per_epoch(processes) - 1
        return (batch_index + 1) % self.accumulation == 0 or batch_index == last

    def saved_points(self) -> tuple[str, ...]:
        """The points this setup saves at (inside an accumulation cycle only with accumulation; after a
        validation only with one)."""
        return tuple(
            p
            for p in POINTS
            if (p != "in_accumulation" or self.accumulation > 1)
            and (p != "after_validation" or self.validation)
            and (not self.points or p in self.points)
        )

    def save_batch(self, point: str, processes: int) -> int | None:
        """The batch of epoch 0 after which a step-based ``point`` is saved (``None``: at the epoch's end)."""
        last = self.batches_per_epoch(processes) - 1
        steps = [b for b in range(last + 1) if self.steps_after(b, processes)]
        assert len(steps) >= 3 and self.accumulation < last, f"{self}: too few steps on {processes} processes"
        return {
            "first_step": steps[0],
            "middle_step": steps[len(steps) // 2],
            "last_step": last,
            "in_accumulation": self.accumulation,  # the 2nd cycle's first micro-batch: no step after it
        }.get(point)


def rows_until(rows: list[Row], point: str, setup: Setup, processes: int) -> list[Row]:
    """The rows of a first run up to the one after which ``point`` was saved."""
    batch = setup.save_batch(point, processes)
    if batch is None:
        return [row for row in rows if row[0] == 0]
    return [row for row in rows if row[0] == 0 and row[1] <= batch]


def check_resumed(
    setup: Setup,
    point: str,
    before: list[list[Row]],
    after: list[list[Row]],
    counters: list[tuple[int, int]],
    fresh: list[list[Row]] | None = None,
    factor: int = 1,
    saved_factor: int | None = None,
    relayed: Relayed | None = None,
) -> None:
    """Assert that ``after`` (one list of rows per process of the resumed run, with its final ``counters``
    ``(optimizer steps, scheduler steps)`` per process) continues ``before`` (rows per process of the first
    run up to the save at ``point``, see :func:`rows_until`) as an uninterrupted run would; ``fresh``: an
    uninterrupted run's rows on the resumed layout, ``factor``: its scheduler steps per optimizer step,
    ``saved_factor``: the first run's (``None``: the same; a scheduler stepping N times per optimizer step
    on N processes steps another number of times per step after a resize); ``relayed``: ``before`` is a
    relay's (a run itself resumed from a first run, see :class:`Relayed`)."""
    where = f"{setup} saved at {point} on {len(before)}, resumed on {len(after)}"
    n_before, n_after = len(before), len(after)
    per_epoch = setup.batches_per_epoch(n_after)
    last_saved = max((row for rank in before for row in rank), key=lambda row: (row[0], row[1]))
    stepped_last = setup.steps_after(last_saved[1], n_before)
    saved_steps = last_saved[4] + (1 if stepped_last else 0)
    saved_scheduler = last_saved[5] + ((factor if saved_factor is None else saved_factor) if stepped_last else 0)
    prior: list[Row] = []
    if relayed is not None:  # the relay's own counters after its saved batch, and its first run's batches
        (saved_steps, saved_scheduler), prior = relayed.counters, relayed.prior
    _check_no_step_left(setup, last_saved, len(before), after, prior + [row for rank in before for row in rank], where)

    for rank, rows in enumerate(after):
        assert rows, f"{where}: rank {rank} trained nothing"
        assert rows[0][4] == saved_steps, (
            f"{where}: rank {rank} resumed at optimizer step {rows[0][4]}, saved {saved_steps}"
        )
        assert rows[0][5] == saved_scheduler, f"{where}: rank {rank} resumed at scheduler step {rows[0][5]}"
        for row, following in zip(rows, rows[1:] + [None]):
            stepped = 1 if setup.steps_after(row[1], n_after) else 0
            steps, scheduled = (following[4], following[5]) if following else counters[rank]
            assert steps - row[4] == stepped, (
                f"{where}: rank {rank} epoch {row[0]} batch {row[1]}: step {steps - row[4]}"
            )
            assert scheduled - row[5] == factor * stepped, f"{where}: rank {rank} batch {row[1]}: scheduler"
    epochs = sorted({row[0] for rank in after for row in rank})
    assert epochs == list(range(epochs[0], setup.epochs)), f"{where}: epochs {epochs}"
    for epoch in epochs:
        indices = [[row[1] for row in rank if row[0] == epoch] for rank in after]
        assert all(ix == indices[0] for ix in indices), f"{where}: epoch {epoch}: unequal batches {indices}"
        assert indices[0] == list(range(per_epoch - len(indices[0]), per_epoch)), (
            f"{where}: epoch {epoch}: batch indices {indices[0]}, the epoch has {per_epoch}"
        )
        done = [i for row in prior if row[0] == epoch for i in row[2]]
        done += [i for rank in before for row in rank if row[0] == epoch for i in row[2]]
        rest = [i for rank in after for row in rank if row[0] == epoch for i in row[2]]
        if epoch == epochs[0] and done:
            step = setup.batch * n_after
            done_rows = sum(len(row[2]) + len(row[3]) for row in prior if row[0] == epoch)
            done_rows += sum(len(row[2]) + len(row[3]) for rank in before for row in rank if row[0] == epoch)
            assert indices[0][0] == -(-done_rows // step), f"{where}: epoch {epoch} resumed at batch {indices[0][0]}"
        _check_once(setup, done + rest, setup.batch * n_after, f"{where}: epoch {epoch}")
        for rank in after:
            for row in rank:
                if row[0] == epoch and row[1] < per_epoch - 1:  # the epoch's last batch may be short or padded
                    assert len(row[2]) == setup.batch and not row[3], f"{where}: a short or padded batch {row}"
                elif row[0] == epoch:
                    assert not (row[3] and setup.drop_last), f"{where}: padding with drop_last {row}"
        if fresh is not None and setup.shuffle in ("seeded", "mixture") and (epoch > epochs[0] or not done):
            mine = [[row[:4] for row in rank if row[0] == epoch] for rank in after]
            theirs = [[row[:4] for row in rank if row[0] == epoch] for rank in fresh]
            assert mine == theirs, f"{where}: epoch {epoch} differs from an uninterrupted run's"


@dataclass(frozen=True)
class Relayed:
    """What a relay saved (a run resumed from a first run's position on another number of processes, itself
    saved inside its epoch and resumed on a third): its ``counters`` after the saved batch (optimizer and
    scheduler steps) and the first run's batches before the relay (``prior``, all ranks)."""

    counters: tuple[int, int]
    prior: list[Row]


def relay_epoch(point: str) -> int:
    """The epoch a relay resumed from a first run's ``point`` runs first (a position at or after epoch 0's last
    step is epoch 1's start)."""
    return 1 if point in ("last_step", "epoch_end", "after_validation") else 0


def relay_points(setup: Setup, first: tuple[int, str], processes: int, resumed_on: int) -> dict[str, int]:
    """Where a relay on ``processes`` of the first run on ``first = (N, point)`` is resumed on ``resumed_on``, by
    point (a batch of the relay's first epoch, after which it ran on): after its first batch, a middle one and,
    where this setup leaves one, the first batch after which the resumed layout has no step left in the epoch
    (``drop_last``, onto more processes)."""
    n, point = first
    per_epoch = setup.batches_per_epoch(processes)
    start = 0
    if relay_epoch(point) == 0:
        done = (setup.save_batch(point, n) + 1) * setup.batch * n  # type: ignore[operator]
        start = -(-done // (setup.batch * processes))
    batches = list(range(start, per_epoch - 1))
    points = {"relay_first": batches[0], "relay_middle": batches[len(batches) // 2]}
    left = [
        b for b in batches if setup.drop_last and setup.n - (b + 1) * setup.batch * processes < setup.batch * resumed_on
    ]
    if left:
        points["relay_no_step_left"] = left[0]
    return points


def relayed(relay: list[list[Row]], batch: int, first: list[list[Row]]) -> tuple[list[list[Row]], Relayed]:
    """The relay's rows (per rank) up to its epoch's ``batch``, and what it saved there (``first``: the rows of
    the first run, per rank, up to the position the relay resumed)."""
    epoch = relay[0][0][0]
    before = [[row for row in rows if (row[0], row[1]) <= (epoch, batch)] for rows in relay]
    following = next(row for row in relay[0] if (row[0], row[1]) > (epoch, batch))
    counters = (following[4], following[5])
    prior = [row for rows in first for row in rows]
    return before, Relayed(counters, prior)


def _check_no_step_left(
    setup: Setup, last_saved: Row, saved_on: int, after: list[list[Row]], done: list[Row], where: str
) -> None:
    """A resumed run that starts in a later epoch than its position's: the rest of that epoch filled no step of
    the saved layout (its end) or of the new one (``drop_last`` dropped it), as at an epoch's end."""
    assert all(after), (
        f"{where}: a rank trained nothing (epochs run: {[sorted({r[0] for r in rank}) for rank in after]})"
    )
    first_epoch = min(row[0] for rank in after for row in rank)
    if first_epoch == last_saved[0]:
        return
    assert first_epoch == last_saved[0] + 1, f"{where}: resumed in epoch {first_epoch} after epoch {last_saved[0]}"
    left = setup.n - sum(len(row[2]) for row in done if row[0] == last_saved[0])
    if left:
        step = setup.batch * max(saved_on, len(after))
        assert setup.drop_last and left < step, f"{where}: {left} samples of the epoch skipped"


def _check_once(setup: Setup, seen: list[int], step: int, where: str) -> None:
    repeated = sorted(i for i, c in Counter(seen).items() if c > 1)
    assert not repeated, f"{where}: samples seen twice: {repeated}"
    missing = sorted(set(range(setup.n)) - set(seen))
    if setup.drop_last:
        assert len(missing) < step, f"{where}: {len(missing)} samples lost: {missing}"
    else:
        assert not missing, f"{where}: {len(missing)} samples never seen: {missing}"


def read_ranks(folder: Path, name: str, processes: int) -> list[Any]:
    """The JSON every rank of a scenario wrote as ``folder/<name>_rank<r>.json``."""
    return [json.loads((folder / f"{name}_rank{r}.json").read_text()) for r in range(processes)]
