"""What travels through a rebuilt ``torchdata.nodes`` graph beside the user's data: a row's place while per-row
work runs (:class:`Tag`), carried through the graph's per-row ``map_fn`` by :class:`OnRow`.  Plain values: they
cross ``ParallelMapper`` workers (threads or processes) and ``PinMemory`` as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Tag", "OnRow"]


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
