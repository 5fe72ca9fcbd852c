"""The picture as a figure: one row per process, one cell per sample slot (matplotlib, the
``plot`` extra: ``pip install shardplug[plot]``).

Real samples are blue cells, padding orange and hatched, samples nobody gets grey and crossed
in a row of their own; a red line marks where a resume happens, and the resumed run's processes
continue from it. SVG output is reproducible: the same picture gives the same bytes.

Example::

    from shardplug.explain import ExplainOptions, explain
    from shardplug.explain.figure import save_figure

    save_figure(explain(ExplainOptions(samples=21, batch_size=3, processes=2)), "shares.svg")
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .picture import EpochView, Picture

__all__ = ["MissingExtra", "save_figure"]

CELL = 0.34  # inches per sample slot
GAP = 0.4  # slots between two batches
REAL, PADDING, DROPPED, RESUME = "#9ecae1", "#fdae6b", "#d9d9d9", "#d62728"
_STYLE = {
    "svg.hashsalt": "shardplug",  # ids in the SVG do not depend on the run
    "svg.fonttype": "none",  # text stays text: no glyph paths that depend on the fonts installed
    "font.family": "DejaVu Sans",  # the font matplotlib ships
    "font.size": 8,
    "hatch.linewidth": 0.6,
    "path.simplify": False,
}


class MissingExtra(ImportError):
    """matplotlib is not installed: figures need the ``plot`` extra."""


def _matplotlib() -> Any:
    """matplotlib, or a :class:`MissingExtra` naming the extra to install."""
    try:
        import matplotlib
        import matplotlib.figure  # noqa: F401 (Figure: no pyplot, no backend chosen for the caller)
    except ImportError:
        raise MissingExtra(
            "figures need matplotlib, which is not installed: pip install 'shardplug[plot]' (or pip install "
            "matplotlib), or leave out --format svg/png to print the text"
        ) from None
    return matplotlib


@contextmanager
def _style(mpl: Any) -> Iterator[None]:
    with mpl.rc_context(_STYLE):
        yield


class _Rows:
    """Where the rows go: a label per row, drawn top to bottom."""

    def __init__(self, slots: int) -> None:
        self.slots = slots  # slots per batch
        self.labels: list[str] = []
        self.titles: list[tuple[int, str, float]] = []  # (row, title, where it starts)

    def x(self, batch: int, slot: int, start: float = 0.0) -> float:
        return start + batch * (self.slots + GAP) + slot

    def add(self, label: str) -> int:
        self.labels.append(label)
        return len(self.labels) - 1


def _draw_cell(ax: Any, x: float, row: int, text: str, kind: str) -> None:
    face = {"real": REAL, "padding": PADDING, "dropped": DROPPED}[kind]
    hatch = {"real": None, "padding": "////", "dropped": "x"}[kind]
    ax.add_patch(
        _rectangle((x + 0.04, -row - 0.42), 0.92, 0.84, facecolor=face, edgecolor="#555555", hatch=hatch, lw=0.6)
    )
    ax.text(x + 0.5, -row, text, ha="center", va="center", fontsize=7, color="#000000")


def _rectangle(xy: tuple[float, float], w: float, h: float, **kwargs: Any) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, **kwargs)


def _draw_pass(ax: Any, rows: _Rows, view: EpochView, title: str, slots: int, start: float = 0.0) -> float:
    """Draw one pass of every process (and its dropped samples); return the right end."""
    rows.titles.append((rows.add(""), title, start - 0.2 if start else -0.2))  # a row of its own for the title
    right = start + 0.35 + 0.23 * len(title)  # room for the title (about 0.23 slots a character)
    for share in view.shares:
        row = rows.add(f"process {share.process}  len()={share.length}")
        for k, batch in enumerate(share.batches):
            for s, index in enumerate(batch.indices):
                x = start + k * (slots + GAP) + s
                _draw_cell(ax, x, row, str(index), "real" if s < batch.real else "padding")
                right = max(right, x + 1)
    if view.dropped:
        row = rows.add("dropped")
        for s, index in enumerate(view.dropped):
            _draw_cell(ax, start + s, row, str(index), "dropped")
            right = max(right, start + s + 1)
    return right


def draw(picture: Picture) -> Any:
    """The figure of ``picture`` (a matplotlib ``Figure``; :func:`save_figure` writes it)."""
    mpl = _matplotlib()
    o = picture.options
    slots = picture.process_batch_size
    with _style(mpl):
        fig = mpl.figure.Figure()
        ax = fig.subplots()
        rows = _Rows(slots)
        right = 0.0
        for view in picture.epochs:
            right = max(right, _draw_pass(ax, rows, view, f"epoch {view.epoch} on {o.processes} processes", slots))
        resume = picture.resume
        if resume is not None:
            # the resume happens after `step` batches of every process of epoch 0 (drawn first, from row 0)
            x = resume.step * (slots + GAP) - GAP / 2
            after_slots = max((len(b.indices) for s in resume.rest.shares for b in s.batches), default=slots)
            what = "the rest of epoch 0" if resume.rest.epoch == 0 else f"epoch {resume.rest.epoch}"
            title = f"resume after step {resume.step}: {what} on {resume.processes} processes"
            right = max(right, _draw_pass(ax, rows, resume.rest, title, after_slots, start=x + GAP / 2))
            bottom = len(rows.labels) - 1
            ax.plot([x, x], [-0.5, -bottom - 0.5], color=RESUME, lw=1.6, ls="--")
        _finish(ax, fig, rows, right, picture)
    return fig


def _finish(ax: Any, fig: Any, rows: _Rows, right: float, picture: Picture) -> None:
    from matplotlib.patches import Patch

    count = len(rows.labels)
    label_width = 1.9  # inches for the row labels
    width = max(right, 6.0) * CELL + label_width + 0.3
    height = count * CELL + 1.0
    fig.set_size_inches(width, height)
    ax.set_xlim(-0.2, max(right, 6.0) + 0.2)
    ax.set_ylim(-count + 0.45, 0.45)
    ax.set_yticks([-r for r in range(count)], rows.labels)
    ax.set_xticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.tick_params(left=False)
    for row, title, x in rows.titles:
        color = RESUME if x > 0 else "#000000"  # the resumed run's title starts at the resume's line
        ax.text(x + (0.35 if x > 0 else 0), -row - 0.1, title, ha="left", va="center", fontweight="bold", color=color)
    o = picture.options
    fig.suptitle(
        f"{o.samples} samples, batch size {o.batch_size}, {o.processes} processes"
        + "".join(
            f", {flag}"
            for flag, on in (
                ("split_batches", o.split_batches),
                ("even_batches=False", not o.even_batches),
                ("drop_last", o.drop_last),
                (f"shuffle (seed {o.spec.seed})", o.shuffle),
                ("dispatch", o.dispatch),
            )
            if on
        ),
        fontsize=9,
    )
    handles = [
        Patch(facecolor=REAL, edgecolor="#555555", label="sample"),
        Patch(facecolor=PADDING, edgecolor="#555555", hatch="////", label="padding"),
        Patch(facecolor=DROPPED, edgecolor="#555555", hatch="x", label="dropped"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=7)
    fig.subplots_adjust(left=label_width / width, right=1 - 0.15 / width, top=1 - 0.45 / height, bottom=0.4 / height)


def save_figure(picture: Picture, path: str | Path, form: str | None = None) -> None:
    """Write the figure of ``picture`` to ``path`` as ``form`` (``"svg"`` or ``"png"``; default: the
    suffix of ``path``). A :class:`MissingExtra` when matplotlib is not installed."""
    form = form or Path(path).suffix.lstrip(".").lower()
    if form not in ("svg", "png"):
        raise ValueError(f"form={form!r} is invalid: draw 'svg' or 'png'")
    mpl = _matplotlib()
    fig = draw(picture)
    with _style(mpl):
        metadata = {"Date": None} if form == "svg" else {"Software": None}
        fig.savefig(path, format=form, metadata=metadata, dpi=150)
