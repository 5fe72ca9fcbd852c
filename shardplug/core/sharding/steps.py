"""What travels through a rebuilt ``torchdata.nodes`` graph: each batch of this process's part with its padding
mark (:class:`Step`, :class:`Mark`), its rows tagged while per-row work runs, and the wrappers that carry the marks
through the graph's ``map_fn``\\ s (:class:`OnRow`, :class:`OnBatch`).  Plain values: they cross ``ParallelMapper``
workers (threads or processes) and ``PinMemory`` as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Mark", "Step", "Tag", "OnRow", "OnBatch", "leading_samples"]


class Mark(NamedTuple):
    """What a batch carries from the plan to the hand-out: how many leading rows are real (``None``:
    not tracked), its keys (the sampler's outputs; ``None``: not tracked), whether it is the pass's last."""

    real: int | None
    indices: list[Any] | None
    last: bool


class Step(NamedTuple):
    """One batch (the sampler's keys, then what the graph's work made of them) and its :class:`Mark`."""

    batch: Any
    mark: Mark


class Tag(NamedTuple):
    """Where a row belongs while per-row work runs: its batch's number, its place, the batch's size and mark."""

    step: int
    place: int
    size: int
    mark: Mark


class OnRow:
    """A per-row ``map_fn`` applied to a tagged row, the tag carried along (picklable when ``fn`` is).

    Example::

        >>> OnRow(str)((3, "tag"))
        ('3', 'tag')
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, item: tuple[Any, Any]) -> tuple[Any, Any]:
        row, tag = item
        return self.fn(row), tag


class OnBatch:
    """A per-batch ``map_fn`` applied to a :class:`Step`'s batch, its mark carried along.

    Example::

        >>> OnBatch(sum)(Step([1, 2], Mark(2, None, True))).batch
        3
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, step: Step) -> Step:
        return Step(self.fn(step.batch), step.mark)


def leading_samples(batch: Any, real: int | None) -> Any:
    """The first ``real`` samples of a batch that is a list of samples (what a ``Batcher`` yields).

    Example::

        >>> leading_samples([{"x": 1}, {"x": 2}, {"x": 3}], 2)
        [{'x': 1}, {'x': 2}]
    """
    if real is None or not isinstance(batch, (list, tuple)):
        return batch
    return batch[:real]
