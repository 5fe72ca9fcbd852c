"""The picture as text: every process's batches (padding marked ``*``), ``len()``, steps, drops.

Example::

    >>> from shardplug.explain.picture import ExplainOptions, explain
    >>> print(render_text(explain(ExplainOptions(samples=5, batch_size=2, processes=2))))
    5 samples, batch size 2, 2 processes: 2 samples per process and step, 4 per step
    split_batches=False, even_batches=True, drop_last=False (* marks padding)
    <BLANKLINE>
    epoch 0: 2 steps, every process runs them all
      process 0  len()=2  [0 1] [4 0*]
      process 1  len()=2  [2 3] [1* 2*]
      padding: 3 samples  dropped: none
"""

from __future__ import annotations

from .picture import BatchView, EpochView, Picture

__all__ = ["render_text"]


def _batch(batch: BatchView) -> str:
    names = batch.labels or tuple(str(i) for i in batch.indices)
    cells = list(names[: batch.real]) + [f"{name}*" for name in names[batch.real :]]
    return "[" + " ".join(cells) + "]"


def _split(view: EpochView) -> list[str]:
    """A mixture's split of the epoch's real rows: each source's count and share, each process's counts."""
    rows = [
        (share.process, label)
        for share in view.shares
        for batch in share.batches
        for label in batch.labels[: batch.real]
    ]
    if not rows:
        return []
    names = sorted({label.rstrip("0123456789") for _, label in rows})
    total = len(rows)
    counts = {name: sum(1 for _, label in rows if label.rstrip("0123456789") == name) for name in names}
    line = ", ".join(f"{name} {counts[name]} ({counts[name] / total:.0%})" for name in names)
    per = "; ".join(
        f"process {share.process}: "
        + " ".join(
            f"{name} {sum(1 for p, label in rows if p == share.process and label.rstrip('0123456789') == name)}"
            for name in names
        )
        for share in view.shares
    )
    return [f"  sources: {line}", f"  per process: {per}"]


def _samples(count: int) -> str:
    return "1 sample" if count == 1 else f"{count} samples"


def _processes(count: int) -> str:
    return "1 process" if count == 1 else f"{count} processes"


def _steps(view: EpochView) -> str:
    steps = view.steps
    fewer = [share for share in view.shares if share.length < steps]
    head = f"{steps} step" if steps == 1 else f"{steps} steps"
    if steps == 0:
        return "no step"
    if not fewer:
        return f"{head}, every process runs them all"
    return head + "; " + ", ".join(f"process {share.process} runs {share.length}" for share in fewer)


def _pass(view: EpochView) -> list[str]:
    width = len(str(len(view.shares) - 1))
    lines = []
    for share in view.shares:
        batches = " ".join(_batch(batch) for batch in share.batches) or "(no batch)"
        lines.append(f"  process {share.process:<{width}}  len()={share.length}  {batches}")
    padding = view.padding
    dropped = " ".join(str(i) for i in view.dropped) if view.dropped else "none"
    lines.append(f"  padding: {_samples(padding) if padding else 'none'}  dropped: {dropped}")
    return lines + _split(view)


def render_text(picture: Picture) -> str:
    """What each process gets, as the ``shardplug explain`` command prints it."""
    o = picture.options
    lines = [
        f"{_samples(o.samples)}, batch size {o.batch_size}, {_processes(o.processes)}: "
        f"{picture.process_batch_size} samples per process and step, {picture.step_batch_size} per step",
        f"split_batches={o.split_batches}, even_batches={o.even_batches}, drop_last={o.drop_last}"
        + (f", shuffle with data_seed={o.spec.seed}" if o.shuffle else "")
        + (
            ", a Mixture of "
            + ", ".join(f"{name} ({length} samples, weight {weight:g})" for name, length, weight in o.mixture)
            + f" with seed={o.spec.seed}; positions of the epoch read <source><sample>"
            if o.mixture
            else ""
        )
        + (", dispatch_batches=True" if o.dispatch else "")
        + " (* marks padding)",
    ]
    for view in picture.epochs:
        lines += ["", f"epoch {view.epoch}: {_steps(view)}"] + _pass(view)
    resume = picture.resume
    if resume is not None:
        lines += [
            "",
            f"resume after step {resume.step} of epoch 0 (the position: epoch {resume.rest.epoch}, {resume.consumed} "
            f"global batches consumed) on {_processes(resume.processes)}: {_steps(resume.rest)}",
        ]
        lines += _pass(resume.rest)
        lines.append(f"  the next epoch on {_processes(resume.processes)}: len()={resume.next_epoch_length}")
    return "\n".join(lines)
