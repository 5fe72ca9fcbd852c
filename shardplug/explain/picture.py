"""What each process gets, computed from the planner ``prepare_data_loader`` uses.

:func:`explain` builds the prepared loaders of a job over ``range(samples)`` (one per simulated
process: ``num_processes=N, process_index=i``, no process group) and asks their plans for every
process's batches with their padding, their ``len()``, and, for a resume, what a position saved
after some steps gives each process of a run with another number of processes.

Example::

    >>> picture = explain(ExplainOptions(samples=5, batch_size=2, processes=2))
    >>> [[batch.indices for batch in share.batches] for share in picture.epochs[0].shares]
    [[(0, 1), (4, 0)], [(2, 3), (1, 2)]]
    >>> [batch.real for batch in picture.epochs[0].shares[1].batches]
    [2, 0]
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from . import _engine

__all__ = ["ExplainOptions", "ExplainError", "BatchView", "Share", "EpochView", "ResumeView", "Picture", "explain"]


class ExplainError(ValueError):
    """Options that describe no job (each message names the option, its value and the fix)."""


@dataclass(frozen=True)
class ExplainOptions:
    """A job to explain: a ``DataLoader(range(samples), batch_size=..., shuffle=..., drop_last=...)``
    prepared on ``processes`` processes, and optionally a resume after ``resume_at`` steps of the
    first epoch on ``processes_after`` processes."""

    samples: int
    batch_size: int
    processes: int = 1
    split_batches: bool = False
    even_batches: bool = True
    drop_last: bool = False
    shuffle: bool = False
    seed: int | None = None
    dispatch: bool = False
    epochs: int = 1
    resume_at: int | None = None
    processes_after: int | None = None
    mixture: tuple[tuple[str, int, float], ...] = ()
    """``(name, length, weight)`` of each source: the job reads a ``shardplug.Mixture`` of ``range(length)``
    sources (seeded by ``seed``, ``samples`` positions an epoch) instead of ``range(samples)``."""

    def __post_init__(self) -> None:
        for name in ("samples", "batch_size", "processes", "epochs", "processes_after"):
            value = getattr(self, name)
            minimum = 0 if name == "samples" else 1
            if value is None and name == "processes_after":
                continue
            if not _engine.is_int(value) or value < minimum:
                raise ExplainError(f"{_flag(name)} {value!r} is invalid: it must be an integer >= {minimum}")
        if self.resume_at is not None and (not _engine.is_int(self.resume_at) or self.resume_at < 0):
            raise ExplainError(f"--resume-at {self.resume_at!r} is invalid: it must be an integer >= 0 (a step)")
        if self.processes_after is not None and self.resume_at is None:
            raise ExplainError(
                f"--processes-after {self.processes_after} needs --resume-at STEP: the step after which the "
                "position is saved"
            )
        if self.seed is not None and not self.shuffle and not self.mixture:
            raise ExplainError(f"--seed {self.seed} needs --shuffle (or --mixture): an unshuffled order has no seed")
        if self.mixture and self.shuffle:
            raise ExplainError(
                "--shuffle with --mixture: a mixture's order is its own (seeded by --seed); drop --shuffle"
            )

    @property
    def spec(self) -> _engine.LoaderSpec:
        seed = (self.seed if self.seed is not None else 0) if self.shuffle else None
        if self.mixture:
            seed = self.seed if self.seed is not None else 0
        return _engine.LoaderSpec(
            self.samples,
            self.batch_size,
            self.split_batches,
            self.even_batches,
            self.drop_last,
            self.shuffle,
            seed,
            self.mixture,
        )

    @property
    def resumes(self) -> bool:
        return self.resume_at is not None

    @property
    def after(self) -> int:
        """The number of processes of the resumed run."""
        return self.processes_after if self.processes_after is not None else self.processes


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class BatchView:
    """One batch of one process: its dataset indices, the first ``real`` of them real, the rest
    padding (samples repeated from the epoch's start so every process runs the same steps)."""

    indices: tuple[int, ...]
    real: int
    labels: tuple[str, ...] = ()
    """A mixture's rows as ``<source><sample>`` (empty for other data)."""

    @property
    def padding(self) -> tuple[int, ...]:
        return self.indices[self.real :]


@dataclass(frozen=True)
class Share:
    """What one process gets in one pass: its batches and its loader's ``len()``."""

    process: int
    batches: tuple[BatchView, ...]
    length: int

    def real_samples(self, first: int | None = None) -> list[int]:
        """The real samples of the first ``first`` batches (all by default)."""
        return [i for batch in self.batches[:first] for i in batch.indices[: batch.real]]


@dataclass(frozen=True)
class EpochView:
    """One pass of every process: their shares, and the samples of the epoch nobody gets."""

    epoch: int
    shares: tuple[Share, ...]
    dropped: tuple[int, ...]

    @property
    def steps(self) -> int:
        """Steps of the job: the most batches any process runs."""
        return max((share.length for share in self.shares), default=0)

    @property
    def padding(self) -> int:
        return sum(len(batch.padding) for share in self.shares for batch in share.batches)


@dataclass(frozen=True)
class ResumeView:
    """A position saved after ``step`` steps of epoch 0 (``consumed`` global batches of the whole
    job in ``rest.epoch``, as ``loader.state_dict()`` says: after the epoch's last step, the next
    epoch's start), loaded into ``processes`` processes: the pass they run from it, and the
    ``len()`` of the epoch after it on them."""

    step: int
    consumed: int
    processes: int
    rest: EpochView
    next_epoch_length: int


@dataclass(frozen=True)
class Picture:
    """What each process gets: every epoch, and the resume when one was asked for."""

    options: ExplainOptions
    process_batch_size: int
    step_batch_size: int
    epochs: tuple[EpochView, ...]
    resume: ResumeView | None = None


def explain(options: ExplainOptions) -> Picture:
    """Every process's batches for ``options``, from the loaders ``prepare_data_loader`` makes.

    A refused option (by ``prepare_data_loader`` or here) is an :class:`ExplainError`.
    """
    spec = options.spec
    try:
        loaders = [_engine.prepared(spec, options.processes, i) for i in range(options.processes)]
    except ValueError as exc:
        raise ExplainError(f"{_given(options)}: {exc}") from None
    epochs = tuple(
        _with_dropped(_epoch(options, spec, options.processes, epoch, 0), options.samples, set())
        for epoch in range(options.epochs)
    )
    layout_sizes = loaders[0].batch_size, loaders[0].total_batch_size
    resume = _resume(options, spec, epochs[0]) if options.resumes else None
    return Picture(options, int(layout_sizes[0] or 0), int(layout_sizes[1] or 0), epochs, resume)


def _given(options: ExplainOptions) -> str:
    flags = [f"--samples {options.samples}", f"--batch-size {options.batch_size}", f"--processes {options.processes}"]
    flags += [
        flag for flag, on in (("--split-batches", options.split_batches), ("--drop-last", options.drop_last)) if on
    ]
    if not options.even_batches:
        flags.append("--no-even-batches")
    return " ".join(flags)


def _epoch(options: ExplainOptions, spec: _engine.LoaderSpec, processes: int, epoch: int, consumed: int) -> EpochView:
    """Every process's pass of ``epoch`` after ``consumed`` global batches."""
    loaders = [_engine.prepared(spec, processes, i, epoch) for i in range(processes)]
    if options.dispatch:
        reader = _engine.prepared(spec, 1, 0, epoch)
        per_process = _engine.dispatched_batches(reader, loaders[0], consumed)
        lengths = [_engine.dispatched_length(reader, loaders[0], consumed)] * processes
    else:
        per_process = [_engine.shard_batches(loader, consumed) for loader in loaders]
        lengths = [_engine.shard_length(loader, consumed) for loader in loaders]
    shares = tuple(
        Share(
            i,
            tuple(
                BatchView(tuple(rows), real, tuple(_engine.source_labels(loaders[0], epoch, rows)))
                for rows, real in batches
            ),
            int(length),
        )
        for i, (batches, length) in enumerate(zip(per_process, lengths))
    )
    return EpochView(epoch, shares, ())


def _with_dropped(view: EpochView, samples: int, taken_before: set[int]) -> EpochView:
    seen = taken_before | {i for share in view.shares for i in share.real_samples()}
    return EpochView(view.epoch, view.shares, tuple(i for i in range(samples) if i not in seen))


def _resume(options: ExplainOptions, spec: _engine.LoaderSpec, first: EpochView) -> ResumeView:
    step = options.resume_at or 0
    if step > first.steps:
        raise ExplainError(
            f"--resume-at {step} is past the end of the epoch: with these options the {options.processes} "
            f"processes run {first.steps} steps; pass --resume-at 0 to {first.steps}"
        )
    saving = _engine.prepared(spec, options.processes, 0)
    for _ in itertools.islice(saving, step):  # process 0 holds the most batches: its position is the job's
        pass
    position = saving.state_dict()  # after the epoch's last batch: the next epoch's start
    try:
        resumed = _engine.prepared(spec, options.after, 0)
        resumed.load_state_dict(position)  # the position is checked as a real run would check it
    except ValueError as exc:
        raise ExplainError(f"--resume-at {step} --processes-after {options.after}: {exc}") from None
    epoch, consumed = int(position["epoch"]), int(position["consumed"])
    before = {i for share in first.shares for i in share.real_samples(step)} if epoch == 0 else set()
    rest = _with_dropped(_epoch(options, spec, options.after, epoch, consumed), options.samples, before)
    return ResumeView(step, consumed, options.after, rest, int(resumed.epoch_length or 0))
