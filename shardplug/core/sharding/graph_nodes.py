"""The nodes shardplug adds to a rebuilt ``torchdata.nodes`` graph (imported for graphs only: it imports torchdata).

* :class:`StepSource`: the bottom of a rebuilt graph, this process's :class:`~shardplug.core.sharding.steps.Step`\\ s;
* :class:`Rows` / :class:`Regroup`: a step's rows, tagged, for the graph's per-row work, and back into their step;
* :class:`RowSource`: one source of a weighted mixture, its rows with its position as torchdata's state.

None keeps a state of its own but :class:`RowSource`: a pass of a map-style graph starts where the plan's
position says, and the graph's work is rebuilt for it.

Example::

    >>> from shardplug.core.sharding.steps import Mark, Step
    >>> steps = [Step([1, 2], Mark(2, None, False)), Step([3], Mark(1, None, True))]
    >>> node = Regroup(Rows(StepSource(iter(steps)))); node.reset()
    >>> [step.batch for step in node]
    [[1, 2], [3]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torchdata.nodes as tn

from shardplug.core.sharding.steps import Step, Tag

__all__ = ["StepSource", "Rows", "Regroup", "RowSource", "PassSource"]


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


class StepSource(_Node):
    """The steps of one pass (``steps``: this process's batches, marked); it ends early once :meth:`stop` is
    called (the pass was left: a node's worker thread reading ahead stops at its next step)."""

    def __init__(self, steps: Iterator[Step]) -> None:
        super().__init__()
        self.steps = steps
        self.stopped = False

    def next(self) -> Step:
        if self.stopped:
            raise StopIteration
        return next(self.steps)

    def stop(self) -> None:
        self.stopped = True


class Rows(_Node):
    """The rows of each step of ``source``, each with its :class:`~shardplug.core.sharding.steps.Tag`."""

    def __init__(self, source: Any) -> None:
        super().__init__(source)
        self.pending: list[tuple[Any, Tag]] = []
        self.count = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.pending, self.count = [], 0

    def next(self) -> tuple[Any, Tag]:
        while not self.pending:
            step = next(self.source)
            rows = list(step.batch)
            self.pending = [(row, Tag(self.count, i, len(rows), step.mark)) for i, row in enumerate(rows)][::-1]
            self.count += 1
        return self.pending.pop()


class Regroup(_Node):
    """Tagged rows of ``source`` gathered back into their steps, in their places and in the steps' order (also
    from a ``ParallelMapper`` with ``in_order=False``, which may interleave the rows of neighbouring steps): the
    position counts the batches handed out, so they leave in the plan's order."""

    def __init__(self, source: Any) -> None:
        super().__init__(source)
        self.open: dict[int, dict[int, Any]] = {}
        self.done: dict[int, Step] = {}
        self.upcoming = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self.open, self.done, self.upcoming = {}, {}, 0

    def next(self) -> Step:
        while self.upcoming not in self.done:
            row, tag = next(self.source)
            rows = self.open.setdefault(tag.step, {})
            rows[tag.place] = row
            if len(rows) == tag.size:
                del self.open[tag.step]
                self.done[tag.step] = Step([rows[i] for i in range(tag.size)], tag.mark)
        self.upcoming += 1
        return self.done.pop(self.upcoming - 1)


class PassSource(Protocol):
    """What a :class:`RowSource` reads its part with (a :class:`~shardplug.core.loader.nodes.PassCounter`)."""

    def begin(self) -> Iterator[Step]: ...

    def handed(self, mark: Any) -> None: ...

    def position(self) -> dict[str, Any]: ...

    def load(self, state: dict[str, Any]) -> None: ...


class RowSource(tn.BaseNode):  # type: ignore[misc]  # torchdata has no type information
    """One source of a weighted mixture: the rows of this process's part (``counter`` begins its passes and
    tells its position), through the source's own work (``build``: the work rebuilt on a :class:`StepSource`);
    its state is the part's position, so torchdata's state of the mixture resumes it exactly."""

    def __init__(self, counter: PassSource, build: Callable[[StepSource], Any]) -> None:
        super().__init__()
        self.counter = counter
        self.build = build
        self.top: Any = None

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.counter.load(initial_state["position"])
        self.top = self.build(StepSource(self.counter.begin()))
        self.top.reset()

    def next(self) -> Any:
        step = next(self.top)
        self.counter.handed(step.mark)
        return step.batch[0]

    def get_state(self) -> dict[str, Any]:
        return {"position": self.counter.position()}
