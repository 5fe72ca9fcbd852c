"""Padding marked where an element is read: the tag an element carries to the collation, and back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from shardplug.core.sharding.shard_plan import PassRecord

__all__ = ["PaddingTag", "TaggedBatch", "TagCollate", "untagged"]


class PaddingTag(NamedTuple):
    """One element on its way from a reader to the collation, with its place and whether it is real."""

    element: Any
    position: int
    real: bool


class TaggedBatch(NamedTuple):
    """A collated batch and its elements' tags (a named tuple: ``pin_memory`` keeps its type)."""

    batch: Any
    positions: tuple[int, ...]
    real: int


class TagCollate:
    """A ``collate_fn`` that takes the :class:`PaddingTag` off each element, collates the elements with
    ``collate_fn`` and hands the tags on beside the batch (a :class:`TaggedBatch`); anything else
    passes to ``collate_fn`` unchanged."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Any:
        if isinstance(data, PaddingTag):  # no automatic batching: one element per batch
            element, position, real = data
            return TaggedBatch(self.collate_fn(element), (position,), int(real))
        if isinstance(data, list) and data and isinstance(data[0], PaddingTag):
            return TaggedBatch(
                self.collate_fn([t[0] for t in data]), tuple(t[1] for t in data), sum(t[2] for t in data)
            )
        return self.collate_fn(data)


def untagged(batches: Iterator[Any], record: PassRecord) -> Iterator[Any]:
    """``batches`` without their tags, each batch's (positions, real count) appended to ``record``."""
    for batch in batches:
        if isinstance(batch, TaggedBatch):
            batch, positions, real = batch
            if record.batches is not None:
                record.batches.append((list(positions), real))
        yield batch
