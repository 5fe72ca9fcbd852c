"""The nodes shardplug adds to a rebuilt ``torchdata.nodes`` graph (imported for graphs only: it imports torchdata).

* :class:`BatchSource`: the bottom of a rebuilt graph, this process's batches of keys;
* :class:`Rows` / :class:`Regroup`: a batch's rows, tagged, for the graph's per-row work, and back into their batch;
* :class:`RowSource`: one source of a weighted mixture, its rows with its position as torchdata's state.

None keeps a state of its own but :class:`RowSource`: a pass of a map-style graph starts where the prepared
loader's position says, and the graph's work is rebuilt for it.

Example::

    >>> node = Regroup(Rows(BatchSource(iter([[1, 2], [3]])))); node.reset()
    >>> list(node)
    [[1, 2], [3]]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torchdata.nodes as tn

from shardplug.core.graphs.row_tags import Tag

__all__ = ["BatchSource", "Rows", "Regroup", "RowSource"]


class _Node(tn.BaseNode):  # type: ignore[misc]  # torchdata has no type information
    """A node over ``source`` (``None``: none) that keeps no state of its own."""

    def __init__(self, source: Any = None) -> None:
        super().__init__()
        self.source = source

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self.source is not None:
            self.source.reset()

    def get_state(self) -> dict[str, Any]:
        return {}


class BatchSource(_Node):
    """The batches of one pass (``batches``: this process's batches of keys); it ends early once :meth:`stop` is
    called (the pass was left: a node's worker thread reading ahead stops at its next batch)."""

    def __init__(self, batches: Iterator[list[Any]]) -> None:
        super().__init__()
        self.batches = batches
        self.stopped = False

    def next(self) -> list[Any]:
        if self.stopped:
            raise StopIteration
        return next(self.batches)

    def stop(self) -> None:
        self.stopped = True


class Rows(_Node):
    """The rows of each batch of ``source``, each with its :class:`~shardplug.core.graphs.row_tags.Tag`."""

    def __init__(self, source: Any) -> None:
        super().__init__(source)
        self.pending: list[tuple[Any, Tag]] = []
        self.count = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.pending, self.count = [], 0

    def next(self) -> tuple[Any, Tag]:
        while not self.pending:
            rows = list(next(self.source))
            self.pending = [(row, Tag(self.count, i, len(rows))) for i, row in enumerate(rows)][::-1]
            self.count += 1
        return self.pending.pop()


class Regroup(_Node):
    """Tagged rows of ``source`` gathered back into their batches, in their places and in the batches' order (also
    from a ``ParallelMapper`` with ``in_order=False``, which may interleave the rows of neighbouring batches): the
    prepared loader counts and marks its batches in the plan's order."""

    def __init__(self, source: Any) -> None:
        super().__init__(source)
        self.open: dict[int, dict[int, Any]] = {}
        self.done: dict[int, list[Any]] = {}
        self.upcoming = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.open, self.done, self.upcoming = {}, {}, 0

    def next(self) -> list[Any]:
        while self.upcoming not in self.done:
            row, tag = next(self.source)
            rows = self.open.setdefault(tag.step, {})
            rows[tag.place] = row
            if len(rows) == tag.size:
                del self.open[tag.step]
                self.done[tag.step] = [rows[i] for i in range(tag.size)]
        self.upcoming += 1
        return self.done.pop(self.upcoming - 1)


class RowSource(tn.BaseNode):  # type: ignore[misc]  # torchdata has no type information
    """One source of a weighted mixture: the rows of this process's ``part`` (its prepared loader, which counts
    what it hands out); its state is the part's position, so torchdata's state of the mixture resumes it exactly."""

    def __init__(self, part: Any) -> None:
        super().__init__()
        self.part = part
        self.rows: Iterator[Any] | None = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.part.load_state_dict(initial_state["position"])
        self.rows = iter(self.part)

    def next(self) -> Any:
        return next(self.rows)  # type: ignore[arg-type]

    def get_state(self) -> dict[str, Any]:
        return {"position": self.part.state_dict()}
