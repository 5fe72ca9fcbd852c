"""What travels through a rebuilt ``torchdata.nodes`` graph beside the user's data: a row's place while per-row
work runs (:class:`Tag`), carried through the graph's per-row ``map_fn`` by :class:`OnRow`; and how a batch that
is a ``Batcher``'s list of samples loses its padding (:func:`leading_samples`).  Plain values: they cross
``ParallelMapper`` workers (threads or processes) and ``PinMemory`` as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Tag", "OnRow", "leading_samples"]


class Tag(NamedTuple):
    """Where a row belongs while per-row work runs: its batch's number, its place, and the batch's size."""

    step: int
    place: int
    size: int


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


def leading_samples(batch: Any, real: int | None) -> Any:
    """The first ``real`` samples of a batch that is a list of samples (what a ``Batcher`` yields).

    Example::

        >>> leading_samples([{"x": 1}, {"x": 2}, {"x": 3}], 2)
        [{'x': 1}, {'x': 2}]
    """
    if real is None or not isinstance(batch, (list, tuple)):
        return batch
    return batch[:real]
