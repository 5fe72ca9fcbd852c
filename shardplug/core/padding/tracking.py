"""Padding tracking: which samples each batch a loader hands out holds, and how many are real.

A prepared loader with :meth:`~shardplug.core.loader.prepared.PreparedDataLoader.track_padding` has a
:class:`PaddingTracker`: its pass asks the plan for the record of every batch it hands out (indices or
stream positions, real count) and hands both to the tracker, which records them in the loader's audit when
there is one (:class:`~shardplug.core.padding.audit.SampleAudit`) and, with ``drop_padding_rows()``, cuts
the padding rows off the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardplug.core._internal.rows import batch_rows, flatten, slice_rows
from shardplug.core.padding.audit import SampleAudit

__all__ = ["PaddingTracker", "leading_rows"]


class PaddingTracker:
    """What one loader does with the record of each batch it hands out (see the module docstring).

    ``dropping``: hand out the real rows only; ``audit``: the samples consumed, per epoch; ``cut``: how the
    padding rows come off a batch (:func:`leading_rows`; a batch that is a list of samples, as a
    ``torchdata.nodes`` ``Batcher`` yields, is cut to its leading samples instead).
    """

    __slots__ = ("dropping", "audit", "cut")

    def __init__(self) -> None:
        self.dropping = False
        self.audit: SampleAudit | None = None
        self.cut: Callable[[Any, int | None], Any] = leading_rows

    def hand_out(self, batch: Any, indices: list[int] | None, real: int, epoch: int) -> Any:
        """Record a batch of ``epoch`` handed out, with its ``indices`` (or stream positions) of which the first
        ``real`` are real samples: into the audit, and the padding rows off the batch when dropping."""
        if self.audit is not None and indices is not None:  # an audit needs ids (enable_audit checks the plan)
            self.audit.record(epoch, indices, real)
        return self.cut(batch, real) if self.dropping else batch


def leading_rows(batch: Any, real: int | None) -> Any:
    """The first ``real`` rows of ``batch`` (unchanged when it has no more, or ``real`` is ``None``).

    The one padding cutter: the loader's ``drop_padding_rows()``, :func:`shardplug.drop_padding` and
    Ignite's ``drop_padding_if_tracked`` all cut here. Rows are as :mod:`shardplug.core._internal.rows`
    defines them: a tensor's dim 0, a list of one value per row; what belongs to the whole batch
    (a 0-dim tensor, a string) is kept.

    Example::

        >>> import torch
        >>> part = leading_rows({"x": torch.arange(4), "ids": ["a", "b", "c", "d"], "n": torch.tensor(4)}, 3)
        >>> part["x"].tolist(), part["ids"], part["n"].item()
        ([0, 1, 2], ['a', 'b', 'c'], 4)
    """
    if real is None:
        return batch
    rows = batch_rows(flatten(batch)[0])
    if rows is None or rows <= real:
        return batch
    return slice_rows(batch, slice(0, real))
